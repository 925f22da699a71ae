/*
 * attn_bwd_fused_ds.cuh -- the fused backward's P/dS step: from one
 * thread's fragments of S = Q K^T and dP = dout V^T over a 64 x 128 tile,
 *   P  = exp2(S * scale * log2 e - lse * log2 e)  (the exponent rule of
 *        mask.cuh, ra::bwd_exponent, then ex2.approx), 0 where a mask hides
 *        the pair,
 *   dS = P (dP - delta) * scale   (with a softcap c also times 1 - u^2,
 *        u = tanh(s * scale / c), the forward's very tanh),
 * both written to shared memory as 16-bit [query][key] tiles for the
 * products that follow.  The softmax scale rides in FFMAs: the exponent is
 * fma(s, scale log2 e, -lse log2 e) and dS is P * fma(dP, scale,
 * -delta scale), so dK and dQ need no scaling afterwards.  What the rule
 * guarantees (finite gradients for any finite scores, P exact where the
 * recomputed score matches the forward's): attn_bwd_tc.cuh; S here is
 * Q K^T with the forward's fragments and k-steps, as in dq_tc.
 *
 * Fragment geometry (attn_bwd_fused.cuh phase 1): the thread (warp w, g =
 * lane / 4, t = lane % 4) holds, of the m-tile i (16 rows), rows
 * 32 (w / 4) + 16 i + 8 h + g of the tile and keys 32 (w % 4) + 8 j + 2 t +
 * (e & 1) of the block, as s[j][2 h + (e & 1)].
 */
#ifndef RA_ATTN_BWD_FUSED_DS_CUH
#define RA_ATTN_BWD_FUSED_DS_CUH

#include "attn_bwd_fused.cuh"

namespace ra {
namespace bwd_fused {

/* One query row's lse, delta (float32, as stored) and document id, loaded
 * a tile ahead; lse -inf for a row past S_q or one that saw no key. */
struct RowLoad {
    float lse, delta;
    int32_t qid;
};

/* The row's statistics as the step reads them (attn_bwd_tc.cuh row_stats):
 * lse log2 e, or +inf for a row that contributes nothing (then delta 0);
 * the band of the exponent rule; delta times the softmax scale. */
__device__ __forceinline__ void row_stats_of(const RowLoad &r, float scale, RowStats *out) {
    const bool live = r.lse != -CUDART_INF_F;
    RowStats s;
    s.lse2 = live ? r.lse * bwd_tc::kLog2e : CUDART_INF_F;
    s.band = band_of(s.lse2);
    s.dls = live ? r.delta * scale : 0.f;
    s.qid = r.qid;
    *out = s;
}

/* What the step needs to know of one tile. */
struct TileCtx {
    int64_t m0;          // first query row of the tile
    int64_t k0;          // first key of the block
    bool full;           // every (row, key) pair of the tile is visible
    bool doc_test;       // M: compare the query and key document ids
    const RowStats *rows;  // the tile's rows' statistics (and with M their ids)
    const int32_t *kid;    // M: ids of the block's keys
};

/* The keys [lo, hi) of the block (indices from k0, clamped to [0, 128])
 * that query row m0 + rr may see: below S_k, and with the causal rule (or
 * with M the causal rule and the window) the span of its position -- the
 * element test of tiles not known to be fully visible becomes two int
 * compares per element (and with documents an id compare).  The rows past
 * S_q need none: their lse2 is +inf, so their P is 0. */
struct KeyRange { int lo, hi; };
template <bool M>
__device__ __forceinline__ KeyRange keys_of_row(const ra_attn_bwd_params &p, const TileCtx &c,
                                                int rr) {
    const int64_t qpos = p.q_pos_offset + (c.m0 + rr) * p.q_pos_stride;
    int64_t lo = 0, hi = p.seqlen_k;
    if constexpr (M) {
        const Span sp = keys_seen_by(p, qpos);
        lo = count_below_sat(sp.lo, p.k_pos_offset, p.k_pos_stride, p.seqlen_k);
        hi = count_upto_sat(sp.hi, p.k_pos_offset, p.k_pos_stride, p.seqlen_k);
    } else {
        if (p.causal) hi = count_upto(qpos, p.k_pos_offset, p.k_pos_stride, p.seqlen_k);
    }
    lo -= c.k0;
    hi -= c.k0;
    return KeyRange{(int)(lo < 0 ? 0 : lo > kBlockN ? kBlockN : lo),
                    (int)(hi < 0 ? 0 : hi > kBlockN ? kBlockN : hi)};
}

/* The step for the 16 rows 32 wm + 16 i + (0..15) of warp (wm, wn) =
 * (w / 4, w % 4) of phase 1 (s[j][e], dp[j][e]: the m-tile i of its fragments); s becomes P,
 * dp becomes dS, and both are stored at sp, sds (64 x 128 16-bit tiles,
 * swizzled). */
template <typename T, bool M>
__device__ __forceinline__ void p_ds_rows(const ra_attn_bwd_params &p, const TileCtx &c, int i,
                                          float (&s)[4][4], float (&dp)[4][4],
                                          unsigned char *sp, unsigned char *sds, float sl2,
                                          float scale, float cap_in, float cap_out) {
    const int tid = tid_x(), wm = tid / 128, wn = (tid / 32) % 4;
    const int g = (tid % 32) / 4, t = tid % 4;
    // the rows' statistics: rows 32 wm + 16 i + 8 h + g
    float l2[2], bd[2], dl[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int rr = 32 * wm + 16 * i + 8 * h + g;
        const RowStats rs = c.rows[rr];
        l2[h] = rs.lse2;
        bd[h] = rs.band;
        dl[h] = rs.dls;
    }
    const bool capped = M && cap_in != 0.f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int h = e / 2;
            float x, f = 1.f;  // the exponent; d score / d (scale q.k)
            if (capped) {
                const float u = tanh_acc(s[j][e] * cap_in);
                x = fmaf(u, cap_out, -l2[h]);
                f = 1.f - u * u;
            } else {
                x = fmaf(s[j][e], sl2, -l2[h]);
            }
            const float pe = ex2_approx(bwd_exponent(x, bd[h]));
            s[j][e] = pe;
            const float d = pe * fmaf(dp[j][e], scale, -dl[h]);
            dp[j][e] = M ? d * f : d;
        }
    }
    if (!c.full) {
        // hidden pairs (outside the rows' key ranges, or another document)
        // get P = dS = 0
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int rr = 32 * wm + 16 * i + 8 * h + g;
            const KeyRange kr = keys_of_row<M>(p, c, rr);
            const int32_t qid = M && c.doc_test ? c.rows[rr].qid : 0;
#pragma unroll
            for (int j = 0; j < 4; j++) {
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; e++) {
                    const int cc = 32 * wn + 8 * j + 2 * t + (e & 1);
                    bool vis = kr.lo <= cc && cc < kr.hi;
                    if (M && c.doc_test) vis = vis && c.kid[cc] == qid;
                    if (!vis) {
                        s[j][e] = 0.f;
                        dp[j][e] = 0.f;
                    }
                }
            }
        }
    }
    // 32-bit stores of (row, keys 2t, 2t + 1): row & 7 = g, chunk (4 wn + j) ^ g;
    // the 8 rows x 4 lanes of one store hit 32 distinct banks
    const uint32_t st0 = (uint32_t)((32 * wm + g) * 256 + (((4 * wn) ^ g) << 4) + 4 * t);
#pragma unroll
    for (int h = 0; h < 2; h++) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint32_t off = (st0 ^ (uint32_t)(j << 4)) + (uint32_t)((16 * i + 8 * h) * 256);
            *reinterpret_cast<uint32_t *>(sp + off) = pack2<T>(s[j][2 * h], s[j][2 * h + 1]);
            *reinterpret_cast<uint32_t *>(sds + off) = pack2<T>(dp[j][2 * h], dp[j][2 * h + 1]);
        }
    }
}

}  // namespace bwd_fused
}  // namespace ra

#endif /* RA_ATTN_BWD_FUSED_DS_CUH */
