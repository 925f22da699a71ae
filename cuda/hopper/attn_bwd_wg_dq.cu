/*
 * attn_bwd_wg_dq.cu -- the Hopper (sm_90a) backward's deterministic dq
 * pass for float16 and bfloat16 with head_dim 64 or 128, on warpgroup
 * matrix multiplies (wgmma), bulk tensor copies (TMA) and warp
 * specialisation.  With deterministic=True it follows the dk/dv pass of
 * attn_bwd_wg.cu (dkdv_wg_kernel), in place of the mma.sync dq pass
 * (attn_bwd_tc_dq.cu, the fallback), with the same contract and formulas:
 *   P_ij = exp(scale q_i . k_j - lse_i) for visible pairs (0 otherwise and
 *   for rows whose lse is -inf; the exponent rule of mask.cuh),
 *   dS_ij = P_ij (dout_i . v_j - delta_i),   dq_i = scale sum_j dS_ij k_j,
 * causal, GQA, S_q != S_k, ring position offsets and strides, documents,
 * windows and soft-capping (the masked instantiation M: each row's key
 * span, ids of tiles not all the block's one id, the capped score and
 * 1 - tanh^2), dilated attention's branch rule (mask.cuh branch_rule_fix,
 * on the pairs the exponent rule snapped).  Each dq element is written once
 * by its one owner thread (added into float32 with p.accumulate, else
 * stored as float32 or 16-bit): the same bits on every run.
 *
 * Shapes: q, dout, dq (B, S_q, H, D); k, v (B, S_k, H_kv, D); lse, delta
 * (B, H, S_q) float32.  q, dout, k, v are read through tensor maps made per
 * call (the strides ra_bwd_wg_supported accepts); without them the caller
 * runs attn_bwd_tc_dq.cu.
 *
 * Algorithm: a block of three warpgroups owns 128 query rows of one
 * (b, h).  Warp 0 (the producer) copies Q and dout of the rows once and
 * streams the key tiles of 64 keys the rows can see (block_keys; with
 * documents only the tiles holding an id of the rows, WarpDocTiles), K and
 * V of a tile together, into a two-stage ring, each stage with its
 * TileMeta (first key; whether every id of the tile is the block's one id;
 * k0 = -1 ends the block) and, with documents, the keys' ids.  Consumer
 * warpgroup c owns rows 64 c.. and per tile issues S = Q_c K^T and dP =
 * dout_c V^T (64 x 64 each, both operands from shared memory), waits for
 * both, turns them into dS = P (dP - delta) in registers (attn_bwd_tc.cuh
 * dq_p_ds, the mma.sync dq pass's step) and issues dQ += dS K (dS from
 * registers as the A operand, K N-major), dQ float32 in registers for the
 * whole walk (D / 2 per thread).  The two consumers take turns issuing
 * (the forward's ping-pong: S and dP, then dQ, two turns per tile), so
 * one's dS step runs under the other's products; a warpgroup's own dQ and
 * next S, dP are not issued back to back (that pipelining spilled the
 * masked D 128 variant: 68 bytes stored, 100 loaded).
 *
 * Launch: grid B * H * ceil(S_q / 128) (1-D, heaviest causal blocks
 * first), 384 threads, one block per SM (setmaxnreg 40 for the producer
 * warpgroup, 232 for the consumers), Smem<D>::kLaunchBytes of dynamic
 * shared memory (129 KB at D 128, 65 KB at D 64).
 */
#include <string.h>

#include "attn_bwd_tc.cuh"
#include "hopper/bwd_mainloop.cuh"   /* Stage, release */
#include "hopper/fwd_mainloop.cuh"   /* turn_begin, turn_end */
#include "hopper/tensor_map.h"

namespace {

using ra::wg::TileMeta;   /* the stage's tile: first key (-1: no more), all one id */
using ra::wg::uniform;
using ra::wgb::release;
using ra::wgb::Stage;

constexpr int kBlockQ = 128;   /* query rows per block */
constexpr int kRowsPerWg = 64; /* per consumer warpgroup (wgmma's M) */
constexpr int kConsumers = kBlockQ / kRowsPerWg;
constexpr int kBlockK = 64;    /* keys per streamed tile: S, dP 32 registers each */
constexpr int kStages = ra::wgb::kStages;   /* the ring of stages: wgb::Stage */
constexpr int kWarpgroupThreads = 128;
constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;
/* the producer's document walk fits 40; the consumers hold dQ (D / 2), S,
 * dP and dS's fragments: 128 x 40 + 256 x 232 = 64512 of 65536 */
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
constexpr int kAtomBytes = 1024;            /* 8 rows x 128 bytes: the swizzle's period */
constexpr int kQHalfBytes = kBlockQ * 128;  /* a 64-column half of the Q or dout tile */
constexpr int kKHalfBytes = kBlockK * 128;  /* of a K or V tile */


/* Shared memory from a 1024-aligned base: Q, dout (128 rows x D each, D / 64
 * swizzled halves), K[s], V[s] (64 x D), the keys' ids[s], meta[s], and the
 * barriers full_q (Q and dout landed), full[s] (K, V, ids, meta), empty[s]
 * (every consumer warp done with stage s), in the backward's barrier
 * layout (bwd_traits.cuh init_barriers). */
template <int D>
struct Smem {
    static_assert(D == 64 || D == 128, "head_dim 64 or 128");
    static constexpr int kHalves = D / 64;
    static constexpr int kQ = 0;
    static constexpr int kDO = kQ + kHalves * kQHalfBytes;
    static constexpr int kK = kDO + kHalves * kQHalfBytes;
    static constexpr int kV = kK + kStages * kHalves * kKHalfBytes;
    static constexpr int kIds = kV + kStages * kHalves * kKHalfBytes;
    static constexpr int kMeta = kIds + kStages * kBlockK * 4;
    static constexpr int kBars = kMeta + kStages * 8;
    static constexpr int kNumBars = 1 + 2 * kStages;
    static constexpr int kBytes = kBars + kNumBars * 8;
    static constexpr int kLaunchBytes = kBytes + kAtomBytes;
};

template <int D>
struct Buffers {
    unsigned char *base;

    __device__ __forceinline__ explicit Buffers(unsigned char *raw) {
        const uint32_t a = ra::sm90::smem_u32(raw);
        base = raw + ((kAtomBytes - (a % kAtomBytes)) % kAtomBytes);
    }
    __device__ __forceinline__ uint64_t *bars() const {
        return reinterpret_cast<uint64_t *>(base + Smem<D>::kBars);
    }
    __device__ __forceinline__ uint64_t *full_q() const { return bars(); }
    __device__ __forceinline__ uint64_t *full(int s) const { return bars() + 1 + s; }
    __device__ __forceinline__ uint64_t *empty(int s) const { return bars() + 1 + kStages + s; }
    __device__ __forceinline__ unsigned char *q() const { return base + Smem<D>::kQ; }
    __device__ __forceinline__ unsigned char *dout() const { return base + Smem<D>::kDO; }
    __device__ __forceinline__ unsigned char *k(int s) const {
        return base + Smem<D>::kK + s * Smem<D>::kHalves * kKHalfBytes;
    }
    __device__ __forceinline__ unsigned char *v(int s) const {
        return base + Smem<D>::kV + s * Smem<D>::kHalves * kKHalfBytes;
    }
    __device__ __forceinline__ int32_t *ids(int s) const {
        return reinterpret_cast<int32_t *>(base + Smem<D>::kIds) + s * kBlockK;
    }
    __device__ __forceinline__ TileMeta *meta(int s) const {
        return reinterpret_cast<TileMeta *>(base + Smem<D>::kMeta) + s;
    }
};

/* The kernel's argument: the backward's params, the tensor maps of q, dout
 * (box 64 x 128 rows) and k, v (box 64 x 64 rows), the branch rule's
 * branches (n = 0 without p.branches). */
struct DqArgs {
    CUtensorMap q_map, do_map, k_map, v_map;
    ra_attn_bwd_params p;
    int64_t n_qblocks;
    ra::Branches br;
};

/* ---- the producer ------------------------------------------------------------- */

/* Run by every lane of the producer warp: Q and dout of the block's rows
 * once, then K and V of each key tile the rows can see, from kbegin up to
 * kend, with documents only the tiles holding an id of the rows. */
template <int D, bool M>
__device__ void produce(const DqArgs &a, const Buffers<D> &buf, const ra::QBlock &blk,
                        int64_t kbegin, int64_t kend) {
    const ra_attn_bwd_params &p = a.p;
    const int lane = threadIdx.x % 32;
    const bool leader = ra::sm90::elect_one();
    const int64_t m_tiles = kend > kbegin ? (kend - kbegin + kBlockK - 1) / kBlockK : 0;
    const bool docs = M && ra::mask_docs(p.mask);
    ra::WarpDocTiles<kBlockK> walk;
    ra::SegIds kids{};
    if constexpr (M) {
        if (docs) {
            const int64_t q_end = blk.q0 + kBlockQ < p.seqlen_q ? blk.q0 + kBlockQ : p.seqlen_q;
            kids = ra::kv_seg_ids(p.mask, blk.b);
            walk.init(ra::q_seg_ids(p.mask, blk.b), blk.q0, q_end, kids, kbegin, kend);
        }
    }
    const int32_t cb = (int32_t)blk.b, ch = (int32_t)blk.h, chk = (int32_t)blk.hk;
    constexpr int kH = Smem<D>::kHalves;
    if (leader) {
        ra::sm90::tma_prefetch_map(&a.k_map);
        ra::sm90::tma_prefetch_map(&a.v_map);
    }
    Stage st{0, 0};
    bool q_loaded = false;
    int64_t t = 0;
    for (;;) {
        ra::Hit hit{t, true};
        if constexpr (M) {
            if (docs) hit = walk.next(t, m_tiles);
        }
        const int s = st.index;
        ra::sm90::mbar_wait(buf.empty(s), st.phase ^ 1u);
        if (hit.tile >= m_tiles) {
            if (leader) {
                *buf.meta(s) = TileMeta{-1, 0};
                ra::sm90::mbar_arrive(buf.full(s));
            }
            break;
        }
        const int64_t k0 = kbegin + hit.tile * kBlockK;
        if (docs) {
            for (int r = lane; r < kBlockK; r += 32) {
                const int64_t key = k0 + r;
                buf.ids(s)[r] = key < kend ? kids.at(key) : 0;
            }
        }
        __syncwarp();   // the lanes' ids before the leader's arrive releases them
        if (leader) {
            *buf.meta(s) = TileMeta{(int32_t)k0, hit.same ? 1 : 0};
            if (!q_loaded) {
                ra::sm90::mbar_arrive_expect_tx(buf.full_q(), 2u * kH * kQHalfBytes);
#pragma unroll
                for (int hf = 0; hf < kH; hf++) {
                    ra::sm90::tma_load_4d(buf.q() + hf * kQHalfBytes, &a.q_map, buf.full_q(),
                                          hf * 64, (int32_t)blk.q0, ch, cb);
                    ra::sm90::tma_load_4d(buf.dout() + hf * kQHalfBytes, &a.do_map, buf.full_q(),
                                          hf * 64, (int32_t)blk.q0, ch, cb);
                }
            }
            ra::sm90::mbar_arrive_expect_tx(buf.full(s), 2u * kH * kKHalfBytes);
#pragma unroll
            for (int hf = 0; hf < kH; hf++) {
                ra::sm90::tma_load_4d(buf.k(s) + hf * kKHalfBytes, &a.k_map, buf.full(s), hf * 64,
                                      (int32_t)k0, chk, cb);
                ra::sm90::tma_load_4d(buf.v(s) + hf * kKHalfBytes, &a.v_map, buf.full(s), hf * 64,
                                      (int32_t)k0, chk, cb);
            }
        }
        q_loaded = true;
        st.advance();
        t = hit.tile + 1;
    }
}

/* ---- the consumers' products ------------------------------------------------------ */

/* acc (64 rows x 64 keys) = X_c Y^T: X the 128-row tile x (Q or dout; rows
 * 64 c..), Y the stage's 64-key tile y (K or V), both K-major over D (the
 * descriptors of fwd_mainloop.cuh issue_s). */
template <typename T, int D>
__device__ __forceinline__ void issue_xyt(float (&acc)[kBlockK / 2], const unsigned char *x,
                                          const unsigned char *y, int c) {
    const unsigned char *xc = x + c * kRowsPerWg * 128;
    ra::sm90::fence_operand(acc);
    ra::sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        const int col = (kk % 4) * 32;
        const uint64_t da = ra::sm90::make_desc(xc + (kk / 4) * kQHalfBytes + col, 16,
                                                kAtomBytes, ra::sm90::SWIZZLE_128B);
        const uint64_t db = ra::sm90::make_desc(y + (kk / 4) * kKHalfBytes + col, 16,
                                                kAtomBytes, ra::sm90::SWIZZLE_128B);
        ra::sm90::wgmma_ss<kBlockK, T, 0, 0>(acc, da, db, kk > 0);
    }
    ra::sm90::wgmma_commit();
    ra::sm90::fence_operand(acc);
}

/* dq (64 x D) += dS K: A = dS from registers (ds[kk]: keys 16 kk.., as the
 * mma A fragment), B = the stage's K tile, N-major (a row is one key, D
 * along it: the k-step advances 16 keys = 2 atoms; the second 64-column
 * half is LBO away). */
template <typename T, int D>
__device__ __forceinline__ void issue_dq(float (&dq)[D / 2], uint32_t (&ds)[kBlockK / 16][4],
                                         const unsigned char *k) {
    ra::sm90::fence_operand(dq);
    ra::sm90::fence_operand(ds);
    ra::sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; kk++) {
        const uint64_t db = ra::sm90::make_desc(k + kk * 2 * kAtomBytes, kKHalfBytes, kAtomBytes,
                                                ra::sm90::SWIZZLE_128B);
        ra::sm90::wgmma_rs<D, T, 1>(dq, ds[kk], db, true);
    }
    ra::sm90::wgmma_commit();
    ra::sm90::fence_operand(dq);
    ra::sm90::fence_operand(ds);
}

/* One consumer warpgroup (c = 0, 1) over the tiles the producer hands it,
 * then its rows' dq.  The two take turns issuing their products (the
 * forward's ping-pong, fwd_mainloop.cuh turn_begin / turn_end; two turns
 * per tile, S and dP, then dQ), so one's dS step runs while the other's
 * products do. */
template <typename T, int D, bool M>
__device__ void consume(const DqArgs &a, const Buffers<D> &buf, const ra::QBlock &blk,
                        int64_t kend, int c) {
    const ra_attn_bwd_params &p = a.p;
    // the thread's two rows: 16 w + g of the warpgroup's 64, and + 8
    const int warp = (threadIdx.x / 32) % 4, g = (threadIdx.x % 32) / 4;
    const ra::bwd_tc::DqRows r = ra::bwd_tc::dq_rows<M>(p, blk.b, blk.h, blk.q0, kBlockQ,
                                                        blk.q0 + c * kRowsPerWg + 16 * warp + g);
    float dq[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++) dq[i] = 0.f;

    Stage st{0, 0};
    ra::sm90::mbar_wait(buf.full(0), 0);
    TileMeta m = uniform(*buf.meta(0));
    if (m.k0 >= 0) ra::sm90::mbar_wait(buf.full_q(), 0);
    bool first = true;
    while (m.k0 >= 0) {
        const int s = st.index;
        float sx[kBlockK / 2], dpx[kBlockK / 2];
        ra::wg::turn_begin(c, first);
        issue_xyt<T, D>(sx, buf.q(), buf.k(s), c);
        issue_xyt<T, D>(dpx, buf.dout(), buf.v(s), c);
        ra::wg::turn_end(c, false);
        first = false;
        ra::sm90::wgmma_wait<0>();
        ra::sm90::fence_operand(sx);
        ra::sm90::fence_operand(dpx);
        // P and dS (attn_bwd_tc.cuh: the mma.sync dq pass's step on the same
        // fragment geometry, element e of n-tile i at 4 i + e)
        ra::bwd_tc::dq_p_ds<M, kBlockK / 8>(
            p, r, a.br, [&](int i, int e) { return sx[4 * i + e]; },
            [&](int i, int e) -> float & { return dpx[4 * i + e]; }, m.k0, kend, m.same != 0,
            buf.ids(s), blk.h);
        uint32_t ds[kBlockK / 16][4];
        ra::a_from_acc<T, kBlockK>(ds, dpx);
        // the next stage's meta first: the dQ product of the last tile is
        // the warpgroup's last turn
        Stage nxt = st;
        nxt.advance();
        ra::sm90::mbar_wait(buf.full(nxt.index), nxt.phase);
        const TileMeta mn = uniform(*buf.meta(nxt.index));
        ra::wg::turn_begin(c, false);
        issue_dq<T, D>(dq, ds, buf.k(s));
        ra::wg::turn_end(c, mn.k0 < 0);
        ra::sm90::wgmma_wait<0>();
        ra::sm90::fence_operand(dq);
        ra::sm90::fence_operand(ds);
        release(buf.empty(s));
        st = nxt;
        m = mn;
    }

    // rows a, b; columns 8 j + 2 t, + 1
    const int t = threadIdx.x % 4;
    const float scale = (float)p.scale;
    const bool f32 = p.grad_dtype == RA_FLOAT32, acc = p.accumulate != 0;
    const int64_t off_a = blk.b * p.dq_batch_stride + r.row_a * p.dq_seq_stride +
                          blk.h * p.dq_head_stride;
    const int64_t off_b = off_a + 8 * p.dq_seq_stride;
#pragma unroll
    for (int j = 0; j < D / 8; j++) {
        const int d = 8 * j + 2 * t;
        if (r.row_a < p.seqlen_q)
            ra::bwd_tc::store_grad2<T>(p.dq, off_a + d, acc, f32, dq[4 * j] * scale,
                                       dq[4 * j + 1] * scale);
        if (r.row_a + 8 < p.seqlen_q)
            ra::bwd_tc::store_grad2<T>(p.dq, off_b + d, acc, f32, dq[4 * j + 2] * scale,
                                       dq[4 * j + 3] * scale);
    }
}

template <typename T, int D, bool M>
__global__ void __launch_bounds__(kThreads, 1) dq_wg_kernel(const __grid_constant__ DqArgs a) {
#if defined(RA_CUDA_EMULATED) || defined(RA_SM90_ASM)
    const Buffers<D> buf(ra::dynamic_smem());
    const int wg = __shfl_sync(0xffffffffu, (int)(threadIdx.x / kWarpgroupThreads), 0);
    static_assert(kConsumers == ra::wgb::kConsumers, "init_barriers' empty count");
    ra::wgb::init_barriers(buf.bars());
    // the block and its keys, computed by each role after its setmaxnreg
    if (wg == 0) {
        ra::sm90::setmaxnreg_dec<kProducerRegs>();
        if (threadIdx.x < 32) {
            const ra::QBlock blk = ra::q_block<kBlockQ>(a.p, a.n_qblocks);
            const ra::Range keys = ra::block_keys<kBlockQ, M>(a.p, blk.q0);
            produce<D, M>(a, buf, blk, keys.begin, keys.end);
        }
        return;
    }
    ra::sm90::setmaxnreg_inc<kConsumerRegs>();
    const ra::QBlock blk = ra::q_block<kBlockQ>(a.p, a.n_qblocks);
    consume<T, D, M>(a, buf, blk, ra::block_keys<kBlockQ, M>(a.p, blk.q0).end, wg - 1);
#else
    (void)a;
    __trap();   // built for another architecture: the dispatcher never launches it there
#endif
}

template <typename T, int D, bool M>
ra_status launch(const DqArgs &a, cudaStream_t s) {
    const size_t smem = (size_t)Smem<D>::kLaunchBytes;
    RA_CHECK(ra_set_smem(dq_wg_kernel<T, D, M>, smem));
    int64_t blocks = 0;
    RA_CHECK(ra_grid_1d(a.n_qblocks * a.p.heads * a.p.batch, 1, &blocks));
    if (blocks == 0) return RA_OK;
    // grid: B * H * ceil(S_q / 128) blocks of 384 threads
    RA_LAUNCH((dq_wg_kernel<T, D, M>), (unsigned)blocks, kThreads, smem, s)(a);
    RA_CUDA_CHECK_LAUNCH("dq_wg_kernel");
    return RA_OK;
}

template <bool M>
ra_status dispatch(const DqArgs &a, cudaStream_t s) {
    if (a.p.dtype == RA_FLOAT16)
        return a.p.head_dim == 64 ? launch<ra::half_t, 64, M>(a, s)
                                  : launch<ra::half_t, 128, M>(a, s);
    return a.p.head_dim == 64 ? launch<ra::bf16_t, 64, M>(a, s) : launch<ra::bf16_t, 128, M>(a, s);
}

}  // namespace

ra_status ra_bwd_wg_dq(const ra_attn_bwd_params &p, cudaStream_t s, bool *ran) {
    *ran = false;
    const int64_t D = p.head_dim;
    const size_t need = D == 64 ? (size_t)Smem<64>::kLaunchBytes : (size_t)Smem<128>::kLaunchBytes;
    size_t optin = 0;
    RA_CHECK(ra_smem_optin(&optin));
    if (optin < need) return RA_OK;
    DqArgs a;
    memset(&a, 0, sizeof a);
    a.p = p;
    a.n_qblocks = (p.seqlen_q + kBlockQ - 1) / kBlockQ;
    a.br = ra::branches_of(p);
    const int bf = p.dtype == RA_BFLOAT16;
    char err[300];
    if (ra_tensor_map_bshd(&a.q_map, bf, p.q, p.batch, p.seqlen_q, p.heads, D, p.q_batch_stride,
                           p.q_seq_stride, p.q_head_stride, kBlockQ, err, sizeof err) != 0 ||
        ra_tensor_map_bshd(&a.do_map, bf, p.dout, p.batch, p.seqlen_q, p.heads, D,
                           p.dout_batch_stride, p.dout_seq_stride, p.dout_head_stride, kBlockQ,
                           err, sizeof err) != 0 ||
        ra_tensor_map_bshd(&a.k_map, bf, p.k, p.batch, p.seqlen_k, p.heads_kv, D,
                           p.k_batch_stride, p.k_seq_stride, p.k_head_stride, kBlockK, err,
                           sizeof err) != 0 ||
        ra_tensor_map_bshd(&a.v_map, bf, p.v, p.batch, p.seqlen_k, p.heads_kv, D,
                           p.v_batch_stride, p.v_seq_stride, p.v_head_stride, kBlockK, err,
                           sizeof err) != 0)
        return RA_OK;   // no tensor map: the caller runs the mma.sync dq pass
    RA_CHECK(ra::masked_variant(p) ? dispatch<true>(a, s) : dispatch<false>(a, s));
    *ran = true;
    return RA_OK;
}
