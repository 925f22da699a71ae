/*
 * attn_bwd_fused.cu -- the fused tensor-core backward (deterministic=False):
 * dq, dk and dv in one pass for float16 and bfloat16 with head_dim 64 or
 * 128 (mma.sync m16n8k16, sm_80 and newer).  The split kernels
 * (attn_bwd_tc_dkdv.cu, attn_bwd_tc_dq.cu) stay for deterministic=True:
 * here every block adds its part of dq by float32 atomics, whose order, and
 * so whose last bits, vary from run to run.
 *
 * With P_ij = exp(scale * q_i . k_j - lse_i) for visible pairs (0 otherwise
 * and for rows whose final lse is -inf), dP_ij = dout_i . v_j and
 * dS_ij = P_ij (dP_ij - delta_i):
 *   dv_j = sum_i P_ij dout_i,  dk_j = scale sum_i dS_ij q_i,
 *   dq_i = scale sum_j dS_ij k_j,
 * dk, dv summed over the H / H_kv query heads that read kv head hk.
 *
 * Shapes: q, dout, dq (B, S_q, H, D); k, v, dk, dv (B, S_k, H_kv, D); lse,
 * delta (B, H, S_q) float32.  Gradients float16/bfloat16 or float32
 * (float32 when p.accumulate, which adds into them).
 *
 * Algorithm (tile shapes, warp roles and shared memory: attn_bwd_fused.cuh):
 * a block owns 128 keys of one (b, hk) and walks the (query head, 64-row
 * query tile) pairs that can see them -- a causal block from the first
 * query that sees its first key, a masked one over the window's span and
 * only the tiles holding one of its document ids, as the split dk/dv kernel
 * does -- with the next pair's Q and dout loading by cp.async (its rows'
 * lse and delta into registers) while this one computes:
 *   S, dP (mainloop), P and dS (attn_bwd_fused_ds.cuh) into shared memory
 *   (with p.branches, M, the branch rule then fixes them there:
 *   branch_rule_tile),
 *   dV += P^T dout, dK += dS^T Q (registers), dQ_part = dS K added into
 *   float32 by red.global.add (attn_bwd_fused_epi.cuh),
 * and at the end writes dK, dV (the epilogue).  The float32 dq target is
 * dq itself when the call accumulates (the ring's steps), else a zeroed
 * scratch (B, S_q, H, D) from ringattn's caching pool that dq_convert_kernel
 * turns into dq afterwards.
 *
 * Launch: grid B * H_kv * ceil(S_k / 128) (1-D; the earliest keys, which see
 * the most causal queries, first), 256 threads, Layout<D, M>::kBytes of
 * dynamic shared memory; dq_convert_kernel one thread per 8 elements.
 */
#include "attn_bwd_fused_ds.cuh"
#include "attn_bwd_fused_epi.cuh"

#include <type_traits>

namespace {

using namespace ra::bwd_fused;

/* The branch rule of dilated attention (mask.cuh) on one tile, in shared
 * memory: once the P/dS step has stored P and dS (64 x 128, 16-bit, rows
 * 256 bytes apart, 16-byte chunk c of row r at chunk c ^ (r & 7)), every
 * element whose P is exactly 1 -- a pair the exponent rule snapped (an
 * unsnapped x < band gives P < 1 in a band row; hidden pairs hold 0) --
 * takes P and dS times 2^-log2(c).  It runs between the phases, where only
 * dK and dV are live: inside the step (D 128) the kernel has no registers
 * left for it and spilled.  Head hg of the block's group; keys from k0. */
template <typename T>
__device__ void branch_rule_tile(const ra_attn_bwd_params &p, const ra::Branches &br,
                                 int64_t n_kblocks, int hg, int64_t m0, int64_t k0,
                                 unsigned char *sp, unsigned char *sds) {
    const ra::KBlock blk = ra::k_block<kBlockN>(p, n_kblocks);
    const int64_t h = br.head0 + br.head_stride * (blk.hk * blk.group + hg);
#pragma unroll 1
    for (int e = ra::tid_x(); e < kBlockM * kBlockN; e += kThreads) {
        const int row = e / kBlockN, key = e % kBlockN;
        const int off = row * 256 + (((key / 8) ^ (row & 7)) << 4) + (key % 8) * 2;
        T *pp = reinterpret_cast<T *>(sp + off);
        if (ra::to_acc(*pp) != 1.f) continue;
        const float x = ra::shared_exponent<true, float>(
            br, h, p.q_pos_offset + (m0 + row) * p.q_pos_stride,
            p.k_pos_offset + (k0 + key) * p.k_pos_stride);
        if (x == 0.f) continue;
        const float f = exp2f(x);
        T *dd = reinterpret_cast<T *>(sds + off);
        *pp = ra::from_accf<T>(f);
        *dd = ra::from_accf<T>(ra::to_acc(*dd) * f);
    }
}

/* A (query head, query tile) pair of the block's walk. */
struct Iter {
    int hg;        // query head within the group (the group's size: done)
    int64_t m0;    // first row of the query tile
    bool same;     // M: every id of the tile equals the block's one id
};

template <typename T, int D, bool M>
__global__ void __launch_bounds__(kThreads, 1)
bwd_tc_kernel(ra_attn_bwd_params p, int64_t n_kblocks, DqTarget tgt,
              const __grid_constant__ ra::Branches br) {
    typedef Layout<D, M> L;
    unsigned char *smem = ra::dynamic_smem();
    const ra::saddr_t sb = ra::saddr(smem);
    RowStats *srows = reinterpret_cast<RowStats *>(smem + L::kStats);
    int32_t *skid = reinterpret_cast<int32_t *>(smem + L::kKid);
    uint32_t *doc_words = reinterpret_cast<uint32_t *>(smem + L::kWords);
    BlockState *state = reinterpret_cast<BlockState *>(smem + L::kState);
    const bool docs = M && ra::mask_docs(p.mask);
    const float scale = (float)p.scale;

    ra::DocTiles<kBlockM, kWarps> tiles;
    int64_t n_mtiles = 0;  // query tiles of the walk (M with documents)
    Iter first;

    // the walk: every (head, tile) pair in turn, or with documents the
    // tiles that hold one of the block's ids (the same for every head):
    // the first pair at or after (head hg, the tile at row m0)
    auto next = [&](const BlockState &st, int hg, int64_t m0) -> Iter {
        if constexpr (M) {
            if (docs) {
                int64_t mt = (m0 - st.i_begin) / kBlockM;
                while (hg < st.group) {
                    const ra::Hit hit = tiles.next(mt, n_mtiles);
                    if (hit.tile < n_mtiles)
                        return Iter{hg, st.i_begin + hit.tile * kBlockM, hit.same};
                    if (mt == 0) break;  // no tile of any head
                    hg++;
                    mt = 0;
                }
                return Iter{st.group, 0, false};
            }
        }
        if (m0 >= st.i_end) {
            hg++;
            m0 = st.i_begin;
        }
        return Iter{hg, m0, true};
    };

    // A pair's tiles: cp.async its Q and dout rows into stage `buf`, and
    // load (threads < 64, one row each) its rows' lse, delta and with
    // documents their ids into registers; stage_stats stores them, in the
    // form the P/dS step reads, once the loads have landed (at the end of
    // the tile being computed: a plain load waited for at once cost every
    // tile two L2 round trips, the largest item of one warp's schedule).
    auto stage = [&](const BlockState &st, const Iter &it, int buf) -> RowLoad {
        const int tid = ra::tid_x();
        const int64_t m0 = it.m0;
        const T *qg = (const T *)p.q + st.q_off + it.hg * p.q_head_stride;
        const T *dog = (const T *)p.dout + st.dout_off + it.hg * p.dout_head_stride;
        ra::cp_async_rows<T, D, kBlockM, kThreads>(smem + L::kQ + buf * L::kQT, qg,
                                                   p.q_seq_stride, m0, p.seqlen_q, tid);
        ra::cp_async_rows<T, D, kBlockM, kThreads>(smem + L::kDO + buf * L::kQT, dog,
                                                   p.dout_seq_stride, m0, p.seqlen_q, tid);
        RowLoad r{-CUDART_INF_F, 0.f, 0};
        const int64_t row = m0 + tid;
        if (tid < kBlockM && row < p.seqlen_q) {
            const int64_t li = st.lse_off + it.hg * p.lse_head_stride + row * p.lse_seq_stride;
            r.lse = ((const float *)p.lse)[li];
            r.delta = ((const float *)p.delta)[li];
            if constexpr (M) {
                if (docs && row < st.i_end) r.qid = st.qids[row * p.mask.q_seg_seq_stride];
            }
        }
        return r;
    };
    auto stage_stats = [&](const RowLoad &r, int buf) {
        const int tid = ra::tid_x();
        if (tid < kBlockM) {
            const int i = buf * kBlockM + tid;
            row_stats_of(r, scale, srows + i);
        }
    };

    // ---- the block: 128 keys of (b, hk), and the query rows that see them
    {
        const ra::KBlock blk = ra::k_block<kBlockN>(p, n_kblocks);
        const int64_t b = blk.b, hk = blk.hk, k0 = blk.k0;
        const int64_t h0 = hk * blk.group;  // the group's first query head
        const int64_t k_end = k0 + kBlockN < p.seqlen_k ? k0 + kBlockN : p.seqlen_k;
        // queries outside [i_begin, i_end) see none of the block's keys
        const ra::Range queries = ra::block_queries<kBlockN, M>(p, k0);
        BlockState st;
        st.k0 = k0;
        st.i_begin = queries.begin;
        st.i_end = queries.end;
        st.group = (int)blk.group;
        // the rows that see all 128 keys need no element test: those at or
        // past the first that sees the last key (without M; every row
        // without the causal rule), with M those in both the first and the
        // last key's spans; none when the block has fewer than 128 keys
        st.full_lo = st.full_hi = 0;
        if (k0 + kBlockN <= p.seqlen_k) {
            const int64_t kpos_first = p.k_pos_offset + k0 * p.k_pos_stride;
            const int64_t kpos_last = kpos_first + (kBlockN - 1) * p.k_pos_stride;
            if constexpr (M) {
                st.full_lo = ra::count_below_sat(ra::queries_seeing(p, kpos_last).lo,
                                                 p.q_pos_offset, p.q_pos_stride, p.seqlen_q);
                st.full_hi = ra::count_upto_sat(ra::queries_seeing(p, kpos_first).hi,
                                                p.q_pos_offset, p.q_pos_stride, p.seqlen_q);
            } else {
                st.full_lo = p.causal ? ra::causal_query_begin(k0 + kBlockN - 1, p.q_pos_offset,
                                                               p.q_pos_stride, p.k_pos_offset,
                                                               p.k_pos_stride, p.seqlen_q)
                                      : 0;
                st.full_hi = p.seqlen_q;
            }
        }
        st.q_off = b * p.q_batch_stride + h0 * p.q_head_stride;
        st.dout_off = b * p.dout_batch_stride + h0 * p.dout_head_stride;
        st.lse_off = b * p.lse_batch_stride + h0 * p.lse_head_stride;
        st.dq_off = b * tgt.batch_stride + h0 * tgt.head_stride;
        st.qids = nullptr;
        if constexpr (M) {
            if (docs) {
                const ra::SegIds kids = ra::kv_seg_ids(p.mask, b);
                const ra::SegIds qids = ra::q_seg_ids(p.mask, b);
                st.qids = qids.ids;
                n_mtiles = st.i_end > st.i_begin ? (st.i_end - st.i_begin + kBlockM - 1) / kBlockM
                                                 : 0;
                tiles.init_block(kids, k0, k_end, qids, st.i_begin, st.i_end, doc_words);
                if (threadIdx.x < kBlockN) {
                    const int64_t key = k0 + threadIdx.x;
                    skid[threadIdx.x] = key < k_end ? kids.at(key) : 0;
                }
            }
        }
        if (threadIdx.x == 0) *state = st;  // read after the loop's first barrier

        // the owned K, V rows: with the first pair's tiles, cp.async group 0
        const T *kg = (const T *)p.k + b * p.k_batch_stride + hk * p.k_head_stride;
        const T *vg = (const T *)p.v + b * p.v_batch_stride + hk * p.v_head_stride;
        first = Iter{st.i_end > st.i_begin ? 0 : st.group, st.i_begin, true};
        if constexpr (M) {
            if (docs) {
                const ra::Hit hit = tiles.next(0, n_mtiles);
                first = hit.tile < n_mtiles
                    ? Iter{0, st.i_begin + hit.tile * kBlockM, hit.same}
                    : Iter{st.group, 0, false};
            }
        }
        if (first.hg < st.group) {
            ra::cp_async_rows<T, D, kBlockN, kThreads>(smem + L::kK, kg, p.k_seq_stride, k0,
                                                       p.seqlen_k, threadIdx.x);
            ra::cp_async_rows<T, D, kBlockN, kThreads>(smem + L::kV, vg, p.v_seq_stride, k0,
                                                       p.seqlen_k, threadIdx.x);
            stage_stats(stage(st, first, 0), 0);
            ra::cp_async_commit();
        }
    }

    // per-lane ldmatrix addresses (smem_frag.cuh), one set per operand
    // role; K and V, Q and dout, P and dS share a set at a constant
    // distance.  The stage-dependent sets (Q, dout) start at stage 0.
    typedef ra::LaneOff<D> LD;
    typedef ra::LaneOff<kBlockN> LN;
    const int lane = threadIdx.x % 32, wm = threadIdx.x / 128, wn = (threadIdx.x / 32) % 4;
    ra::FragAddr<D> fa_q = ra::FragAddr<D>::make(sb + L::kQ, LD::a(lane), 32 * wm, 0);
    const ra::FragAddr<D> fa_k = ra::FragAddr<D>::make(sb + L::kK, LD::nk(lane), 32 * wn, 0);
    const ra::FragAddr<kBlockN> fa_pt =
        ra::FragAddr<kBlockN>::make(sb + L::kP, LN::nk(lane), 0, 4 * wn);
    ra::FragAddr<D> fa_ob = ra::FragAddr<D>::make(sb + L::kDO, LD::kn(lane), 0, (D / 16) * wm);
    const ra::FragAddr<kBlockN> fa_ds =
        ra::FragAddr<kBlockN>::make(sb + L::kDS, LN::a(lane), 32 * wm, 0);
    const ra::FragAddr<D> fa_kb = ra::FragAddr<D>::make(sb + L::kK, LD::kn(lane), 0, (D / 32) * wn);
    int stage_step = L::kQT;  // to the other stage

    float dk[2][D / 16][4], dv[2][D / 16][4];
#pragma unroll
    for (int i = 0; i < 2; i++) {
#pragma unroll
        for (int n = 0; n < D / 16; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) dk[i][n][e] = dv[i][n][e] = 0.f;
        }
    }

    const int ngroup = (int)(p.heads / p.heads_kv);
    // D 64: the warp's K fragments of S = Q K^T (keys 32 wn + 16 j2, all 64
    // columns: 32 registers) are the same on every tile, loaded once here
    // rather than 8 ldmatrix per tile (docs/results.md "The backward as
    // built"); at D 128 they would be 64 registers beside dK, dV's 128
    constexpr bool kKeepK = D == 64;
    uint32_t kfr[kKeepK ? D / 16 : 1][2][4];
    if constexpr (kKeepK) {
        ra::cp_async_wait<0>();
        __syncthreads();  // K (cp.async group 0) visible
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
            for (int j2 = 0; j2 < 2; j2++) {
                if (first.hg < ngroup)
                    ra::ldsm_x4(kfr[kk][j2], fa_k.at(16 * j2, 16 * kk));
                else
                    kfr[kk][j2][0] = kfr[kk][j2][1] = kfr[kk][j2][2] = kfr[kk][j2][3] = 0u;
            }
        }
    }
    const float sl2 = scale * ra::bwd_tc::kLog2e;
    const bool capped = M && p.mask.softcap > 0;
    const float cap_in = capped ? (float)(p.scale / p.mask.softcap) : 0.f;
    const float cap_out = capped ? (float)(p.mask.softcap * (double)ra::bwd_tc::kLog2e) : 0.f;
    for (Iter cur = first; cur.hg < ngroup;) {
        ra::cp_async_wait<0>();
        __syncthreads();  // pair `cur` (and the block state) visible; every warp
                          // done with the previous pair
        const BlockState &st = *state;
        const int buf = stage_step < 0 ? 1 : 0;  // stage_step leads to the other stage
        const Iter nxt = next(st, cur.hg, cur.m0 + kBlockM);  // block-uniform
        RowLoad rows_next{-CUDART_INF_F, 0.f, 0};
        if (nxt.hg < ngroup) {
            rows_next = stage(st, nxt, buf ^ 1);
            ra::cp_async_commit();
        }
        const int64_t m0 = cur.m0;

        // the tile's context for the P/dS step
        TileCtx c;
        c.m0 = m0;
        c.k0 = st.k0;
        {
            const int64_t last = m0 + kBlockM <= p.seqlen_q ? m0 + kBlockM - 1 : p.seqlen_q - 1;
            c.full = m0 >= st.full_lo && last < st.full_hi && cur.same;
        }
        c.doc_test = docs && !cur.same;
        c.rows = srows + buf * kBlockM;
        c.kid = skid;

        // S = Q K^T and dP = dout V^T for the m-tiles [i0, i0 + NI) of the
        // warp's rows (32 wm + 16 i, keys 32 wn + 16 j2: two n-tiles each),
        // then their P/dS step
        auto rows_step = [&](auto ni) {
            constexpr int NI = decltype(ni)::value;
#pragma unroll
            for (int i0 = 0; i0 < 2; i0 += NI) {
                float s[NI][4][4], dp[NI][4][4];
#pragma unroll
                for (int i = 0; i < NI; i++) {
#pragma unroll
                    for (int j = 0; j < 4; j++) {
#pragma unroll
                        for (int e = 0; e < 4; e++) s[i][j][e] = dp[i][j][e] = 0.f;
                    }
                }
#pragma unroll
                for (int kk = 0; kk < D / 16; kk++) {
                    uint32_t a[NI][4];
#pragma unroll
                    for (int i = 0; i < NI; i++)
                        ra::ldsm_x4(a[i], fa_q.at(16 * (i0 + i), 16 * kk) + (L::kDO - L::kQ));
#pragma unroll
                    for (int j2 = 0; j2 < 2; j2++) {
                        uint32_t bv[4];
                        ra::ldsm_x4(bv, fa_k.at(16 * j2, 16 * kk) + (L::kV - L::kK));
#pragma unroll
                        for (int i = 0; i < NI; i++) {
                            ra::mma_16816<T>(dp[i][2 * j2], a[i], bv[0], bv[1]);
                            ra::mma_16816<T>(dp[i][2 * j2 + 1], a[i], bv[2], bv[3]);
                        }
                    }
                }
#pragma unroll
                for (int kk = 0; kk < D / 16; kk++) {
                    uint32_t a[NI][4];
#pragma unroll
                    for (int i = 0; i < NI; i++) ra::ldsm_x4(a[i], fa_q.at(16 * (i0 + i), 16 * kk));
#pragma unroll
                    for (int j2 = 0; j2 < 2; j2++) {
                        uint32_t bk[4];
                        if constexpr (kKeepK) {
#pragma unroll
                            for (int e = 0; e < 4; e++) bk[e] = kfr[kk][j2][e];
                        } else {
                            ra::ldsm_x4(bk, fa_k.at(16 * j2, 16 * kk));
                        }
#pragma unroll
                        for (int i = 0; i < NI; i++) {
                            ra::mma_16816<T>(s[i][2 * j2], a[i], bk[0], bk[1]);
                            ra::mma_16816<T>(s[i][2 * j2 + 1], a[i], bk[2], bk[3]);
                        }
                    }
                }
#pragma unroll
                for (int i = 0; i < NI; i++)
                    p_ds_rows<T, M>(p, c, i0 + i, s[i], dp[i], smem + L::kP, smem + L::kDS, sl2,
                                    scale, cap_in, cap_out);
            }
        };
        // D 128: one m-tile at a time, S and dP of 16 rows (dK, dV hold 128
        // registers; with 32 rows of S and dP live the kernel spilled),
        // reloading the K and V fragments: +32 ldmatrix per warp-tile
        // (144 -> 176); D 64: both m-tiles at once
        rows_step(std::integral_constant<int, D == 128 ? 1 : 2>());
        __syncthreads();  // P and dS visible
        if constexpr (M) {
            if (br.n != 0) {  // block-uniform: one branch of dilated attention
                branch_rule_tile<T>(p, br, n_kblocks, cur.hg, m0, c.k0,
                                    smem + L::kP, smem + L::kDS);
                __syncthreads();  // the rule's P and dS visible
            }
        }

        // dQ part = dS K: rows 32 wm + 16 i, columns (D / 4) wn + 16 n2
        float dq[2][D / 32][4];
#pragma unroll
        for (int i = 0; i < 2; i++) {
#pragma unroll
            for (int n = 0; n < D / 32; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) dq[i][n][e] = 0.f;
            }
        }
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; kk++) {
            uint32_t a[2][4];
#pragma unroll
            for (int i = 0; i < 2; i++)
                ra::ldsm_x4(a[i], fa_ds.at(16 * i, 16 * kk));
#pragma unroll
            for (int n2 = 0; n2 < D / 64; n2++) {
                uint32_t bk[4];
                ra::ldsm_x4_t(bk, fa_kb.at(16 * kk, 16 * n2));
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    ra::mma_16816<T>(dq[i][2 * n2], a[i], bk[0], bk[1]);
                    ra::mma_16816<T>(dq[i][2 * n2 + 1], a[i], bk[2], bk[3]);
                }
            }
        }
        add_dq<D>(tgt.p + (*state).dq_off + cur.hg * tgt.head_stride, tgt.seq_stride, m0,
                  p.seqlen_q, dq);
        // dV += P^T dout, dK += dS^T Q: keys 32 wn + 16 i, columns (D / 2) wm + 16 n2
#pragma unroll
        for (int kq = 0; kq < kBlockM / 16; kq++) {
            uint32_t a[2][4];
#pragma unroll
            for (int i = 0; i < 2; i++)
                ra::ldsm_x4_t(a[i], fa_pt.at(16 * kq, 16 * i));
#pragma unroll
            for (int n2 = 0; n2 < D / 32; n2++) {
                uint32_t bo[4];
                ra::ldsm_x4_t(bo, fa_ob.at(16 * kq, 16 * n2));
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    ra::mma_16816<T>(dv[i][2 * n2], a[i], bo[0], bo[1]);
                    ra::mma_16816<T>(dv[i][2 * n2 + 1], a[i], bo[2], bo[3]);
                }
            }
#pragma unroll
            for (int i = 0; i < 2; i++)
                ra::ldsm_x4_t(a[i], fa_pt.at(16 * kq, 16 * i) + (L::kDS - L::kP));
#pragma unroll
            for (int n2 = 0; n2 < D / 32; n2++) {
                uint32_t bq[4];
                ra::ldsm_x4_t(bq, fa_ob.at(16 * kq, 16 * n2) - (L::kDO - L::kQ));
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    ra::mma_16816<T>(dk[i][2 * n2], a[i], bq[0], bq[1]);
                    ra::mma_16816<T>(dk[i][2 * n2 + 1], a[i], bq[2], bq[3]);
                }
            }
        }

        stage_stats(rows_next, buf ^ 1);  // read after the next barrier
        fa_q.shift(stage_step);
        fa_ob.shift(stage_step);
        stage_step = -stage_step;
        cur = nxt;
    }

    __syncthreads();  // every warp done with the tiles: the epilogue reuses them
    {
        const ra::KBlock blk = ra::k_block<kBlockN>(p, n_kblocks);
        store_dk_dv<T, D, M>(p, smem, dk, dv, wm, wn, blk.b, blk.hk, blk.k0);
    }
}

/* dq (T, or float32) = the float32 scratch (B, S_q, H, D) contiguous: one
 * thread per 8 elements, grid-stride. */
template <typename T>
__global__ void dq_convert_kernel(ra_attn_bwd_params p, const float *src) {
    const int64_t chunks = p.head_dim / 8;
    const int64_t n = p.batch * p.seqlen_q * p.heads * chunks;
    const bool f32 = p.grad_dtype == RA_FLOAT32;
    const bool vec = ra::bwd_fused::vec16(p.dq, f32 ? 4 : 2, p.dq_batch_stride, p.dq_seq_stride,
                                          p.dq_head_stride);
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t c8 = (idx % chunks) * 8, row = idx / chunks;
        const int64_t h = row % p.heads, s = (row / p.heads) % p.seqlen_q;
        const int64_t b = row / (p.heads * p.seqlen_q);
        const float4 *x4 = reinterpret_cast<const float4 *>(src + row * p.head_dim + c8);
        const float4 u = x4[0], v = x4[1];
        const float x[8] = {u.x, u.y, u.z, u.w, v.x, v.y, v.z, v.w};
        ra::bwd_fused::store8<T>(
            p.dq, b * p.dq_batch_stride + s * p.dq_seq_stride + h * p.dq_head_stride + c8, false,
            f32, vec, x);
    }
}

/* the fused kernel's shared memory for (D, M) */
size_t fused_smem(int64_t D, bool M) {
    if (D == 64) return M ? Layout<64, true>::kBytes : Layout<64, false>::kBytes;
    return M ? Layout<128, true>::kBytes : Layout<128, false>::kBytes;
}

template <typename T, int D, bool M>
ra_status launch_fused(const ra_attn_bwd_params &p, cudaStream_t s, const DqTarget &tgt) {
    const size_t smem = Layout<D, M>::kBytes;
    RA_CHECK(ra_set_smem(bwd_tc_kernel<T, D, M>, smem));
    const int64_t n_kblocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
    int64_t blocks = 0;
    RA_CHECK(ra_grid_1d(n_kblocks * p.heads_kv * p.batch, 1, &blocks));
    if (blocks == 0) return RA_OK;
    // grid: B * H_kv * ceil(S_k / 128) blocks of 256 threads;
    // k, v, dk, dv (B, S_k, H_kv, D), q, dout (B, S_q, H, D), dq target float32
    RA_LAUNCH((bwd_tc_kernel<T, D, M>), (unsigned)blocks, kThreads, smem, s)(p, n_kblocks, tgt,
                                                                           ra::branches_of(p));
    RA_CUDA_CHECK_LAUNCH("bwd_tc_kernel");
    return RA_OK;
}

template <typename T>
ra_status launch_fused_d(const ra_attn_bwd_params &p, cudaStream_t s, const DqTarget &tgt) {
    const bool m = ra::masked_variant(p);
    if (p.head_dim == 64)
        return m ? launch_fused<T, 64, true>(p, s, tgt) : launch_fused<T, 64, false>(p, s, tgt);
    return m ? launch_fused<T, 128, true>(p, s, tgt) : launch_fused<T, 128, false>(p, s, tgt);
}

template <typename T>
ra_status launch_convert(const ra_attn_bwd_params &p, cudaStream_t s, const float *src) {
    const int64_t n = p.batch * p.seqlen_q * p.heads * (p.head_dim / 8);
    int64_t blocks = (n + 255) / 256;
    if (blocks > 65536) blocks = 65536;
    // one thread per 8 elements of dq (B, S_q, H, D); src contiguous float32
    RA_LAUNCH((dq_convert_kernel<T>), (unsigned)blocks, 256, 0, s)(p, src);
    RA_CUDA_CHECK_LAUNCH("dq_convert_kernel");
    return RA_OK;
}

/* launch_fused_d as a DqRun */
ra_status run_fused(const ra_attn_bwd_params &p, cudaStream_t s, const DqTarget &tgt, void *ctx) {
    (void)ctx;
    return p.dtype == RA_BFLOAT16 ? launch_fused_d<ra::bf16_t>(p, s, tgt)
                                  : launch_fused_d<ra::half_t>(p, s, tgt);
}

}  // namespace

ra_status ra::bwd_fused::with_dq_target(const ra_attn_bwd_params &p, cudaStream_t s, DqRun run,
                                        void *ctx, bool *ran) {
    *ran = false;
    const bool bf16 = p.dtype == RA_BFLOAT16;
    if (p.accumulate) {
        // the ring's steps: dq is float32 already, added into in place
        const DqTarget tgt{(float *)p.dq, p.dq_batch_stride, p.dq_seq_stride, p.dq_head_stride};
        RA_CHECK(run(p, s, tgt, ctx));
        *ran = true;
        return RA_OK;
    }
    // a float32 scratch from the caching pool, released behind the stream:
    // the pool hands a freed block out again only to work queued after
    // this on ringattn's compute stream (csrc/core/cuda_rt.c), so another
    // stream (an XLA handler's) takes the split kernels instead
    int dev = 0;
    RA_CUDA_CHECK(cudaGetDevice(&dev));
    void *compute = nullptr;
    RA_CHECK(ra_cuda_compute_stream(dev, &compute));
    if ((cudaStream_t)compute != s) return RA_OK;
    const size_t bytes = (size_t)(p.batch * p.seqlen_q * p.heads * p.head_dim) * sizeof(float);
    void *scratch = nullptr;
    if (bytes > 0) RA_CHECK(ra_cuda_malloc(dev, bytes, &scratch));
    ra_status st = RA_OK;
    const DqTarget tgt{(float *)scratch, p.seqlen_q * p.heads * p.head_dim, p.heads * p.head_dim,
                       p.head_dim};
    cudaError_t e = bytes > 0 ? cudaMemsetAsync(scratch, 0, bytes, s) : cudaSuccess;
    if (e != cudaSuccess) {
        st = ra_cuda_status((int)e, "cudaMemsetAsync", __FILE__, __LINE__);
        goto done;
    }
    st = run(p, s, tgt, ctx);
    if (st == RA_OK && bytes > 0)
        st = bf16 ? launch_convert<ra::bf16_t>(p, s, (const float *)scratch)
                  : launch_convert<ra::half_t>(p, s, (const float *)scratch);
done:
    if (scratch != nullptr) {
        const ra_status fst = ra_cuda_free(dev, scratch, bytes);
        if (st == RA_OK) st = fst;
    }
    *ran = st == RA_OK;
    return st;
}

ra_status ra_bwd_tc_fused(const ra_attn_bwd_params &p, cudaStream_t s, bool *ran) {
    *ran = false;
    // shared memory: a device that grants a block less runs the split kernels
    size_t optin = 0;
    RA_CHECK(ra_smem_optin(&optin));
    if (optin < fused_smem(p.head_dim, ra::masked_variant(p))) return RA_OK;
    return ra::bwd_fused::with_dq_target(p, s, run_fused, nullptr, ran);
}
