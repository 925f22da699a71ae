/*
 * fwd_mainloop.cuh -- the Hopper forward's pipeline: what the producer
 * warp loads (the key tiles a block sees, Q once, K and V per tile by bulk
 * tensor copies completing on mbarriers) and the consumers' matrix
 * products on them (S = Q K^T and O += P V by wgmma, operands read through
 * shared-memory descriptors of the 128-byte swizzle the copies write).
 *
 * The ring of stages (fwd_traits.cuh): the i-th tile goes to stage
 * i % kStages.  K and V of a stage have their own barriers, because a
 * consumer is done with K[j] (after S_j) one tile before it is done with
 * V[j] (after P_j V_j, issued with S_{j+1}):
 *   full_k[s]   the producer arrives once with the copy's bytes expected
 *               (arrive.expect_tx); the copies complete the bytes; with it
 *               the stage's meta (and document ids), written before the
 *               arrive; a meta of k0 = -1 (a plain arrive) ends the block
 *   full_v[s]   the same for V
 *   empty_k[s], empty_v[s]   one arrival per consumer warp (8) once the
 *               warp's products (and its reads of ids and meta) are done
 * The producer waits for empty with the parity of the round before (a
 * fresh barrier passes parity 1 at once), the consumers for full with the
 * round's own.
 */
#ifndef RA_HOPPER_FWD_MAINLOOP_CUH
#define RA_HOPPER_FWD_MAINLOOP_CUH

#include "hopper/fwd_traits.cuh"
#include "mask.cuh"

namespace ra {
namespace wg {

/* The kernel's argument: the forward's params and the tensor maps of q, k
 * and v (each (B, S, H, D) as a 4-D map, innermost first: D, S, H, B; box
 * 64 x 128 rows x 1 x 1, 128-byte swizzle), made on the host per call. */
struct FwdArgs {
    CUtensorMap q_map, k_map, v_map;
    ra_attn_fwd_params p;
    int64_t n_qblocks;
};

/* ---- the producer --------------------------------------------------------- */

/* The key tiles block (b, h, q0) visits, tiles of kBlockK keys from kbegin
 * up to kend (block_keys), and with documents only those that hold an id
 * of the block's rows.  Run by every lane of the producer warp. */
template <int D, bool M>
__device__ void produce(const FwdArgs &a, const Buffers<D> &buf, const QBlock &blk,
                        int64_t kbegin, int64_t kend) {
    const ra_attn_fwd_params &p = a.p;
    const int lane = threadIdx.x % 32;
    const bool leader = sm90::elect_one();
    constexpr uint32_t kTileBytes = (uint32_t)Smem<D>::kTileBytes;
    const int64_t m_tiles = kend > kbegin ? (kend - kbegin + kBlockK - 1) / kBlockK : 0;
    const bool docs = M && mask_docs(p.mask);
    WarpDocTiles<kBlockK> walk;
    SegIds kids{};
    if constexpr (M) {
        if (docs) {
            const int64_t q_end = blk.q0 + kBlockQ < p.seqlen_q ? blk.q0 + kBlockQ : p.seqlen_q;
            kids = kv_seg_ids(p.mask, blk.b);
            walk.init(q_seg_ids(p.mask, blk.b), blk.q0, q_end, kids, kbegin, kend);
        }
    }
    const int32_t cb = (int32_t)blk.b, ch = (int32_t)blk.h, chk = (int32_t)blk.hk;
    if (leader) {
        sm90::tma_prefetch_map(&a.q_map);
        sm90::tma_prefetch_map(&a.k_map);
        sm90::tma_prefetch_map(&a.v_map);
    }
    Stage st{0, 0};
    bool q_loaded = false;
    int64_t t = 0;
    for (;;) {
        Hit hit{t, true};
        if constexpr (M) {
            if (docs) hit = walk.next(t, m_tiles);
        }
        const bool end = hit.tile >= m_tiles;
        const int s = st.index;
        sm90::mbar_wait(&buf.empty_k[s], st.phase ^ 1u);
        if (end) {
            if (leader) {
                buf.meta[s] = TileMeta{-1, 0};
                sm90::mbar_arrive(&buf.full_k[s]);
            }
            break;
        }
        const int64_t k0 = kbegin + hit.tile * kBlockK;
        if (docs) {
            for (int r = lane; r < kBlockK; r += 32) {
                const int64_t key = k0 + r;
                buf.ids[s * kBlockK + r] = key < kend ? kids.at(key) : 0;
            }
        }
        __syncwarp();   // the lanes' ids before the leader's arrive releases them
        if (leader) {
            buf.meta[s] = TileMeta{(int32_t)k0, hit.same ? 1 : 0};
            if (!q_loaded) {
                sm90::mbar_arrive_expect_tx(buf.full_q, kTileBytes);
#pragma unroll
                for (int hf = 0; hf < Smem<D>::kHalves; hf++)
                    sm90::tma_load_4d(buf.q() + hf * kHalfBytes, &a.q_map, buf.full_q, hf * 64,
                                      (int32_t)blk.q0, ch, cb);
            }
            sm90::mbar_arrive_expect_tx(&buf.full_k[s], kTileBytes);
#pragma unroll
            for (int hf = 0; hf < Smem<D>::kHalves; hf++)
                sm90::tma_load_4d(buf.k(s) + hf * kHalfBytes, &a.k_map, &buf.full_k[s], hf * 64,
                                  (int32_t)k0, chk, cb);
        }
        q_loaded = true;
        sm90::mbar_wait(&buf.empty_v[s], st.phase ^ 1u);
        if (leader) {
            sm90::mbar_arrive_expect_tx(&buf.full_v[s], kTileBytes);
#pragma unroll
            for (int hf = 0; hf < Smem<D>::kHalves; hf++)
                sm90::tma_load_4d(buf.v(s) + hf * kHalfBytes, &a.v_map, &buf.full_v[s], hf * 64,
                                  (int32_t)k0, chk, cb);
        }
        st.advance();
        t = hit.tile + 1;
    }
}

/* ---- the consumers' products ---------------------------------------------- */

/* A stage's meta as the compiler sees it: warp-uniform (lane 0's), so the
 * branches on it keep the wgmma under them asynchronous (a wgmma in a
 * branch the compiler thinks divergent is serialised behind an injected
 * warpgroup.arrive: ptxas C7520).  Also the deterministic dq pass's
 * (attn_bwd_wg_dq.cu), whose stages carry the same meta. */
__device__ __forceinline__ TileMeta uniform(TileMeta m) {
    return TileMeta{__shfl_sync(0xffffffffu, m.k0, 0), __shfl_sync(0xffffffffu, m.same, 0)};
}

/* Each batch opens with its own wgmma.fence in the same basic block as its
 * wgmma (a fence before a branch or a wait loop does not count for ptxas,
 * which then injects one and serialises the wgmma: C7519/C7520), and the
 * operand fences around it keep the compiler from moving accesses of the
 * registers into the window between issue and wait (C7514). */

/* S (64 x 128, float32, the wgmma accumulator layout) = Q K^T for
 * consumer warpgroup c's 64 rows and the keys in stage s: A = Q rows
 * 64c.., B = K (both K-major: a row holds 64 of its D elements per half,
 * the k-step advances 32 bytes within a half, then to the next half). */
template <typename T, int D>
__device__ __forceinline__ void issue_s(float (&s)[kBlockK / 2], const Buffers<D> &buf, int c,
                                        int stage) {
    const unsigned char *q = buf.q() + c * kRowsPerWg * 128;
    const unsigned char *k = buf.k(stage);
    sm90::fence_operand(s);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        const int off = (kk / 4) * kHalfBytes + (kk % 4) * 32;
        const uint64_t da = sm90::make_desc(q + off, 16, kAtomBytes, sm90::SWIZZLE_128B);
        const uint64_t db = sm90::make_desc(k + off, 16, kAtomBytes, sm90::SWIZZLE_128B);
        sm90::wgmma_ss<kBlockK, T, 0, 0>(s, da, db, kk > 0);
    }
    sm90::wgmma_commit();
    sm90::fence_operand(s);
}

/* O (64 x D) += P V: A = P from registers (pa[kk]: keys 16 kk .. 16 kk + 15
 * as the mma A fragment), B = V of stage s, N-major (a row of V is one key,
 * D along it: the k-step advances 16 keys = 2 atoms; the second 64-column
 * half is LBO = kHalfBytes away). */
template <typename T, int D>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const uint32_t (&pa)[kBlockK / 16][4],
                                         const Buffers<D> &buf, int stage) {
    const unsigned char *v = buf.v(stage);
    sm90::fence_operand(o);
    sm90::fence_operand(const_cast<uint32_t (&)[kBlockK / 16][4]>(pa));
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; kk++) {
        const uint64_t db = sm90::make_desc(v + kk * 2 * kAtomBytes, kHalfBytes, kAtomBytes,
                                            sm90::SWIZZLE_128B);
        sm90::wgmma_rs<D, T, 1>(o, pa[kk], db, true);
    }
    sm90::wgmma_commit();
    sm90::fence_operand(o);
    sm90::fence_operand(const_cast<uint32_t (&)[kBlockK / 16][4]>(pa));
}

/* A consumer warp is done with a buffer of stage s (its products retired,
 * its reads of the stage's ids and meta made): one arrival per warp. */
__device__ __forceinline__ void release(uint64_t *bar) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) sm90::mbar_arrive(bar);
}

/* The ping-pong between the two consumer warpgroups: c issues its
 * products only while it holds turn c, and hands the turn over once they
 * are issued, so one warpgroup's softmax runs under the other's products.
 * Turn c is named barrier kTurnBarrier0 + c over both warpgroups (256
 * threads): c waits (bar.sync, 128 threads) until the other arrives
 * (bar.arrive, 128).  Warpgroup 1 first arrives at turn 0 (warpgroup 0
 * starts), and does not hand over after its last products; warpgroup 0
 * always does.  Both take n_tiles + 1 turns, so every arrival meets a
 * wait. */
__device__ __forceinline__ void turn_begin(int c, bool first) {
    if (c == 1 && first) sm90::named_bar_arrive(kTurnBarrier0, 2 * kWarpgroupThreads);
    sm90::named_bar_sync(kTurnBarrier0 + c, 2 * kWarpgroupThreads);
}
__device__ __forceinline__ void turn_end(int c, bool last) {
    if (c == 0 || !last) sm90::named_bar_arrive(kTurnBarrier0 + (c ^ 1), 2 * kWarpgroupThreads);
}

}  // namespace wg
}  // namespace ra

#endif /* RA_HOPPER_FWD_MAINLOOP_CUH */
