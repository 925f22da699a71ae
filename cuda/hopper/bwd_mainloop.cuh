/*
 * bwd_mainloop.cuh -- the Hopper backward's pipeline (attn_bwd_wg.cu): the
 * producer warp's loads and the consumers' products on them.
 *
 * Barriers (bwd_traits.cuh):
 *   full_kv     K and V of the block, once (the leader arrives with the
 *               copies' bytes expected; a block that no query sees loads
 *               nothing and never waits on it)
 *   full[s]     Q and dout of the stage's tile (their bytes) and its rows'
 *               statistics (written by the producer lanes before the
 *               leader's arrive)
 *   empty[s]    one arrival per consumer warp (8) once the warp is done
 *               with the stage (its products retired, its reads of the
 *               statistics made)
 * The producer waits for empty with the parity of the round before (a
 * fresh barrier passes parity 1 at once), the consumers for full with the
 * round's own.
 *
 * Products of consumer warpgroup c on the tile in stage s (every 16-bit
 * tile in shared memory is 128-byte rows with the 128-byte swizzle; the
 * descriptors as the forward's, fwd_mainloop.cuh):
 *   S^T  (64 keys x 64 queries) = K_c Q^T      A: K rows 64 c.., K-major;
 *                                              B: Q, K-major
 *   dP^T (64 x 64)              = V_c dout^T   the same with V and dout
 *   dV_c (64 x D) += P^T dout                  A: P^T from registers;
 *                                              B: dout, N-major
 *   dK_c (64 x D) += dS^T Q                    A: dS^T from registers
 *   dQ (64 queries x columns (D / 2) c..) = dS K over all 128 keys
 *                                              A: both consumers' dS^T as
 *                                              stored, M-major; B: K,
 *                                              N-major
 */
#ifndef RA_HOPPER_BWD_MAINLOOP_CUH
#define RA_HOPPER_BWD_MAINLOOP_CUH

#include "hopper/bwd_traits.cuh"

namespace ra {
namespace wgb {

/* ---- the producer ------------------------------------------------------------- */

/* The leader's arrive on `bar` expecting two tiles of `half` bytes per
 * 64-column half, and their copies (rows r0.. of head h of batch row b):
 * x from map xm, y from map ym. */
template <int D>
__device__ __forceinline__ void load_two(uint64_t *bar, int half, unsigned char *x,
                                         const CUtensorMap *xm, unsigned char *y,
                                         const CUtensorMap *ym, int64_t r0, int64_t h,
                                         int32_t b) {
    sm90::mbar_arrive_expect_tx(bar, 2u * (uint32_t)(Smem<D>::kHalves * half));
#pragma unroll
    for (int hf = 0; hf < Smem<D>::kHalves; hf++) {
        sm90::tma_load_4d(x + hf * half, xm, bar, hf * 64, (int32_t)r0, (int32_t)h, b);
        sm90::tma_load_4d(y + hf * half, ym, bar, hf * 64, (int32_t)r0, (int32_t)h, b);
    }
}

/* The leader's copies of the block's K and V (rows k0.. of kv head hk),
 * completing full_kv. */
template <int D>
__device__ __forceinline__ void load_kv(const BwdArgs &a, const Buffers<D> &buf, int32_t b,
                                        int64_t hk, int64_t k0) {
    sm90::tma_prefetch_map(&a.q_map);
    sm90::tma_prefetch_map(&a.do_map);
    load_two<D>(buf.full_kv(), kKHalfBytes, buf.k(), &a.k_map, buf.v(), &a.v_map, k0, hk, b);
}

/* The leader's copies of Q and dout (rows m0.. of query head h) into stage
 * s, completing full[s]. */
template <int D>
__device__ __forceinline__ void load_tile(const BwdArgs &a, const Buffers<D> &buf, int s,
                                          int32_t b, int64_t h, int64_t m0) {
    load_two<D>(buf.full(s), kQHalfBytes, buf.q(s), &a.q_map, buf.dout(s), &a.do_map, m0, h, b);
}

/* Row m0 + r's lse and delta (query head h; none past S_q) and id as the
 * stage's RowStats r. */
__device__ __forceinline__ void stage_row(const ra_attn_bwd_params &p, bwd_fused::RowStats *out,
                                          int64_t b, int64_t h, int64_t row, int32_t qid,
                                          float scale) {
    bwd_fused::RowLoad rl{-CUDART_INF_F, 0.f, qid};
    if (row < p.seqlen_q) {
        const int64_t at = b * p.lse_batch_stride + h * p.lse_head_stride + row * p.lse_seq_stride;
        rl.lse = ((const float *)p.lse)[at];
        rl.delta = ((const float *)p.delta)[at];
    }
    bwd_fused::row_stats_of(rl, scale, out);
}

/* Run by every lane of the producer warp: K, V once, then per tile of the
 * walk Q and dout of (b, head h0 + walk.head(t), rows m0..) and the rows'
 * lse and delta. */
template <int D>
__device__ void produce(const BwdArgs &a, const Buffers<D> &buf, const Walk &w, int64_t b,
                        int64_t hk, int64_t h0, int64_t k0) {
    const ra_attn_bwd_params &p = a.p;
    const int lane = threadIdx.x % 32;
    const bool leader = sm90::elect_one();
    const float scale = (float)p.scale;
    const int32_t cb = (int32_t)b;
    if (w.n_tiles == 0) return;
    if (leader) load_kv<D>(a, buf, cb, hk, k0);
    Stage st{0, 0};
    for (int32_t t = 0; t < w.n_tiles; t++) {
        const int s = st.index;
        const int64_t h = h0 + w.head(t), m0 = w.m0(t);
        sm90::mbar_wait(buf.empty(s), st.phase ^ 1u);
        for (int r = lane; r < kBlockM; r += 32)
            stage_row(p, buf.stats(s) + r, b, h, m0 + r, 0, scale);
        __syncwarp();   // the lanes' statistics before the leader's arrive releases them
        if (leader) load_tile<D>(a, buf, s, cb, h, m0);
        st.advance();
    }
}

/* The masked variant's producer (documents, windows, softcap, branches):
 * the block's query range [w.i_begin, ..) is the window's (block_queries
 * with M), and with documents only the 64-row tiles holding an id of the
 * block's keys are loaded (WarpDocTiles).  The walk is tile by tile, every
 * head of the group on a tile before the next (the document test once per
 * tile); each stage carries its TileMeta, and a stage whose meta has m0 =
 * -1 (a plain arrive, no copies) ends the block.  K and V are loaded only
 * once a tile is found: a block that no query sees ends at once. */
template <int D>
__device__ void produce_masked(const BwdArgs &a, const Buffers<D> &buf, const Walk &w, int64_t b,
                               int64_t hk, int64_t group, int64_t k0) {
    const ra_attn_bwd_params &p = a.p;
    const int lane = threadIdx.x % 32;
    const bool leader = sm90::elect_one();
    const float scale = (float)p.scale;
    const int32_t cb = (int32_t)b;
    const bool docs = mask_docs(p.mask);
    const int64_t i_end = (int64_t)w.i_begin + (int64_t)w.n_m * kBlockM < p.seqlen_q
                              ? (int64_t)w.i_begin + (int64_t)w.n_m * kBlockM
                              : p.seqlen_q;
    WarpDocTiles<kBlockM> tiles;
    SegIds qids{};
    if (docs) {
        const int64_t k_end = k0 + kBlockN < p.seqlen_k ? k0 + kBlockN : p.seqlen_k;
        qids = q_seg_ids(p.mask, b);
        tiles.init(kv_seg_ids(p.mask, b), k0, k_end, qids, w.i_begin, i_end);
    }
    Stage st{0, 0};
    bool kv_loaded = false;
    for (int32_t t = 0;;) {
        Hit hit{t, false};
        if (docs) hit = tiles.next(t, w.n_m);
        if (hit.tile >= w.n_m) break;
        const int32_t m0 = w.i_begin + (int32_t)hit.tile * kBlockM;
        if (leader && !kv_loaded) load_kv<D>(a, buf, cb, hk, k0);
        kv_loaded = true;
        // the tile's rows' ids, the same for every head
        int32_t id0 = 0, id1 = 0;
        if (docs) {
            const int64_t r0 = (int64_t)m0 + lane;
            if (r0 < p.seqlen_q) id0 = qids.at(r0);
            if (r0 + 32 < p.seqlen_q) id1 = qids.at(r0 + 32);
        }
        for (int32_t hh = 0; hh < (int32_t)group; hh++) {
            const int s = st.index;
            const int64_t h = hk * group + hh;
            sm90::mbar_wait(buf.empty(s), st.phase ^ 1u);
            stage_row(p, buf.stats(s) + lane, b, h, (int64_t)m0 + lane, id0, scale);
            stage_row(p, buf.stats(s) + 32 + lane, b, h, (int64_t)m0 + 32 + lane, id1, scale);
            if (leader) *buf.meta(s) = TileMeta{m0, hh, hit.same ? 1 : 0, 0};
            __syncwarp();   // the lanes' statistics before the leader's arrive releases them
            if (leader) load_tile<D>(a, buf, s, cb, h, m0);
            st.advance();
        }
        t = (int32_t)hit.tile + 1;
    }
    // the end of the block: a stage with m0 = -1 and no copies
    const int s = st.index;
    sm90::mbar_wait(buf.empty(s), st.phase ^ 1u);
    if (leader) {
        *buf.meta(s) = TileMeta{-1, 0, 0, 0};
        sm90::mbar_arrive(buf.full(s));
    }
}

/* ---- the consumers' products ------------------------------------------------------ */

/* Each batch opens with its own wgmma.fence in the same basic block as its
 * wgmma and fences its operand registers (fwd_mainloop.cuh says why). */

/* acc (64 x NQ) = X_c Y^T: X the 128-row tile x (K or V; rows 64 c..), Y
 * NQ rows of a 64-row tile from y (Q or dout), both K-major over D. */
template <typename T, int D, int NQ>
__device__ __forceinline__ void issue_xyt(float (&acc)[NQ / 2], const unsigned char *x,
                                          const unsigned char *y, int c) {
    const unsigned char *xc = x + c * kKeysPerWg * 128;
    sm90::fence_operand(acc);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        const int col = (kk % 4) * 32;
        const uint64_t da = sm90::make_desc(xc + (kk / 4) * kKHalfBytes + col, 16, kAtomBytes,
                                            sm90::SWIZZLE_128B);
        const uint64_t db = sm90::make_desc(y + (kk / 4) * kQHalfBytes + col, 16, kAtomBytes,
                                            sm90::SWIZZLE_128B);
        sm90::wgmma_ss<NQ, T, 0, 0>(acc, da, db, kk > 0);
    }
    sm90::wgmma_commit();
    sm90::fence_operand(acc);
}

/* dv += P^T dout and dk += dS^T Q, one group: A from registers (pa, dsa:
 * k-step kk = queries 16 kk .. 16 kk + 15), B the 64-row tiles, N-major
 * (a row is one query, D along it; the second half LBO away). */
template <typename T, int D>
__device__ __forceinline__ void issue_dkdv(float (&dv)[D / 2], float (&dk)[D / 2],
                                           uint32_t (&pa)[kBlockM / 16][4],
                                           uint32_t (&dsa)[kBlockM / 16][4],
                                           const unsigned char *dout, const unsigned char *q) {
    sm90::fence_operand(dv);
    sm90::fence_operand(dk);
    sm90::fence_operand(pa);
    sm90::fence_operand(dsa);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; kk++) {
        const uint64_t db = sm90::make_desc(dout + kk * 2 * kAtomBytes, kQHalfBytes, kAtomBytes,
                                            sm90::SWIZZLE_128B);
        sm90::wgmma_rs<D, T, 1>(dv, pa[kk], db, true);
    }
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; kk++) {
        const uint64_t db = sm90::make_desc(q + kk * 2 * kAtomBytes, kQHalfBytes, kAtomBytes,
                                            sm90::SWIZZLE_128B);
        sm90::wgmma_rs<D, T, 1>(dk, dsa[kk], db, true);
    }
    sm90::wgmma_commit();
    sm90::fence_operand(dv);
    sm90::fence_operand(dk);
    sm90::fence_operand(pa);
    sm90::fence_operand(dsa);
}

/* dq (64 queries x D / 2 columns: consumer c's half of D) = dS K over the
 * block's 128 keys: A = dS^T as both consumers stored it (ds: consumer 0's
 * tile, consumer 1's right after; rows are keys, the 64 queries along
 * them: M-major; k-step kk = keys 16 kk.. = 2 atoms), B = K rows 16 kk..,
 * columns (D / 2) c.. (N-major: at D 128 the half c, at D 64 the 64-byte
 * column offset 64 c inside the swizzled rows). */
template <typename T, int D>
__device__ __forceinline__ void issue_dq(float (&dq)[D / 4], const unsigned char *ds,
                                         const unsigned char *k, int c) {
    const unsigned char *kc = k + (D == 128 ? c * kKHalfBytes : c * 64);
    sm90::fence_operand(dq);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; kk++) {
        const uint64_t da = sm90::make_desc(ds + kk * 2 * kAtomBytes, kDsBytes, kAtomBytes,
                                            sm90::SWIZZLE_128B);
        const uint64_t db = sm90::make_desc(kc + kk * 2 * kAtomBytes, kKHalfBytes, kAtomBytes,
                                            sm90::SWIZZLE_128B);
        sm90::wgmma_ss<D / 2, T, 1, 1>(dq, da, db, kk > 0);
    }
    sm90::wgmma_commit();
    sm90::fence_operand(dq);
}

/* A consumer warp is done with stage s: one arrival per warp. */
__device__ __forceinline__ void release(uint64_t *bar) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) sm90::mbar_arrive(bar);
}

}  // namespace wgb
}  // namespace ra

#endif /* RA_HOPPER_BWD_MAINLOOP_CUH */
