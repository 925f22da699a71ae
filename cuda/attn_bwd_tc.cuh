/*
 * attn_bwd_tc.cuh -- what the two tensor-core backward kernels share
 * (attn_bwd_tc_dkdv.cu, attn_bwd_tc_dq.cu): the block shape, the softmax
 * row statistics in the form the kernels use them, and the store of a pair
 * of float32 accumulators into a gradient; and what the two dq passes
 * (attn_bwd_tc_dq.cu, hopper/attn_bwd_wg_dq.cu) share: their rows and the
 * P/dS step on a fragment (dq_rows, dq_p_ds).
 *
 * Both kernels recompute P = exp(scale * q.k - lse) in log2 units, as the
 * forward does: P = exp2(x), x = s * scale * log2(e) - lse * log2(e) (with
 * a softcap c: x = c * log2(e) * tanh(s * scale / c) - lse * log2(e)),
 * under the exponent rule of mask.cuh: x clamped to <= 0 (with huge but
 * finite scores, 1e9, the recomputed score and the stored lse round
 * differently by many units, and an unclamped exp2 would overflow to inf),
 * and an x within 16 ulps of |lse log2 e| >= 2^13 below 0 read as 0.
 *
 * What that guarantees: P <= 1 and finite gradients for any finite scores;
 * P exact (1 for a row's dominant key, not 2^-ulps) wherever the score
 * recomputed here is within 16 ulps of the one the forward turned into lse.
 * The dq pass computes S = Q K^T with the forward's very fragments and
 * k-step order, so only the rounding of lse (stored, converted to log2
 * units, merged over ring steps) separates them; the dk/dv pass computes
 * S^T = K Q^T, the same products over the same k-steps with the operands'
 * roles swapped in the mma, which the PTX ISA does not promise rounds alike
 * -- there the guarantee is finiteness, and exactness as far as the
 * hardware rounds both orientations within the band.
 *
 * A query row that must contribute nothing (past S_q, or a final lse of
 * -inf because it saw no key) gets the log2 lse +inf (band 0), so its P is
 * exp2(-inf) = 0 and its dS is 0 * (dP - 0) = 0: never NaN.
 */
#ifndef RA_ATTN_BWD_TC_CUH
#define RA_ATTN_BWD_TC_CUH

#include "attn_kernels.cuh"
#include "mma.cuh"

namespace ra {
namespace bwd_tc {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;

/* lse * log2(e) of query row i of one (b, h), or +inf for a row that
 * contributes nothing; its delta, or 0 for such a row; and the band of the
 * exponent rule for that lse (mask.cuh band_of, 0 unless |lse2| >= 2^13).
 * lse and delta are float32 (B, H, S_q) with the lse strides; `off` =
 * b * batch + h * head. */
__device__ __forceinline__ void row_stats(const ra_attn_bwd_params &p, int64_t off, int64_t i,
                                          float *lse2, float *delta, float *band) {
    float l2 = CUDART_INF_F, dl = 0.f;
    if (i < p.seqlen_q) {
        const int64_t li = off + i * p.lse_seq_stride;
        const float l = ((const float *)p.lse)[li];
        if (l != -CUDART_INF_F) {
            l2 = l * kLog2e;
            dl = ((const float *)p.delta)[li];
        }
    }
    *lse2 = l2;
    *delta = dl;
    *band = band_of(l2);
}

/* Elements off and off + 1 of a gradient: added into float32 when
 * accumulate, else stored as float32 (f32) or as T. */
template <typename T>
__device__ __forceinline__ void store_grad2(void *grad, int64_t off, bool accumulate, bool f32,
                                            float x, float y) {
    if (accumulate) {
        float2 *dst = reinterpret_cast<float2 *>((float *)grad + off);
        const float2 old = *dst;
        *dst = make_float2(old.x + x, old.y + y);
    } else if (f32) {
        *reinterpret_cast<float2 *>((float *)grad + off) = make_float2(x, y);
    } else {
        *reinterpret_cast<uint32_t *>((T *)grad + off) = pack2<T>(x, y);
    }
}

/* ---- the dq passes' P/dS step (attn_bwd_tc_dq.cu, hopper/attn_bwd_wg_dq.cu) ---- */

/* What a dq pass's thread knows of its two query rows (a, and b = a + 8)
 * and of its block of rows [q0, q0 + rows): the rows' statistics
 * (row_stats) and positions; with M the keys each row sees (causal and the
 * window), the keys [blk_lo, blk_hi] every row of the block sees, the
 * rows' document ids and the softcap's factors (cap_in 0: none). */
struct DqRows {
    int64_t row_a, qpos_a, qpos_b, qpos_first;
    float lse2_a, lse2_b, delta_a, delta_b, band_a, band_b;
    Span seen_a, seen_b;
    int64_t blk_lo, blk_hi;
    int32_t qid_a, qid_b;
    float cap_in, cap_out;
};

template <bool M>
__device__ __forceinline__ DqRows dq_rows(const ra_attn_bwd_params &p, int64_t b, int64_t h,
                                          int64_t q0, int64_t rows, int64_t row_a) {
    DqRows r{};
    r.row_a = row_a;
    const int64_t row_b = row_a + 8;
    r.qpos_a = p.q_pos_offset + row_a * p.q_pos_stride;
    r.qpos_b = p.q_pos_offset + row_b * p.q_pos_stride;
    r.qpos_first = p.q_pos_offset + q0 * p.q_pos_stride;
    const int64_t stat_off = b * p.lse_batch_stride + h * p.lse_head_stride;
    row_stats(p, stat_off, row_a, &r.lse2_a, &r.delta_a, &r.band_a);
    row_stats(p, stat_off, row_b, &r.lse2_b, &r.delta_b, &r.band_b);
    if constexpr (M) {
        r.seen_a = keys_seen_by(p, r.qpos_a);
        r.seen_b = keys_seen_by(p, r.qpos_b);
        const int64_t q_end = q0 + rows < p.seqlen_q ? q0 + rows : p.seqlen_q;
        r.blk_lo = keys_seen_by(p, p.q_pos_offset + (q_end - 1) * p.q_pos_stride).lo;
        r.blk_hi = keys_seen_by(p, r.qpos_first).hi;
        if (mask_docs(p.mask)) {
            const SegIds qids = q_seg_ids(p.mask, b);
            r.qid_a = row_a < p.seqlen_q ? qids.at(row_a) : 0;
            r.qid_b = row_b < p.seqlen_q ? qids.at(row_b) : 0;
        }
        if (p.mask.softcap > 0) {
            r.cap_in = (float)(p.scale / p.mask.softcap);
            r.cap_out = (float)(p.mask.softcap * (double)kLog2e);
        }
    }
    return r;
}

/* P and dS = P (dP - delta) (unscaled: the pass multiplies dq by the scale
 * at the end) in place of dP, on a 16-row x 8 NT-key fragment of keys
 * k0.. (of the block's [.., kend)): S(i, e) and DP(i, e) are element e of
 * n-tile i, row a (e < 2) or b, key k0 + 8 i + 2 t + (e & 1).  Pairs a mask
 * hides get 0: causal (without M), with M each row's span and, where the
 * tile's ids are not all the block's one id (same false), the keys' ids
 * (ids, by column); a softcap recomputes the capped score as the forward
 * did and multiplies dS by 1 - u^2.  With M and br.n != 0 the branch rule
 * of dilated attention after (mask.cuh branch_rule_fix; no softcap with
 * branches), h the query head. */
template <bool M, int NT, typename SF, typename DF>
__device__ __forceinline__ void dq_p_ds(const ra_attn_bwd_params &p, const DqRows &r,
                                        const Branches &br, SF S, DF DP, int64_t k0,
                                        int64_t kend, bool same, const int32_t *ids, int64_t h) {
    const int t = threadIdx.x % 4;
    const float sl2 = (float)p.scale * kLog2e;
    constexpr int64_t kN = 8 * NT;
    if constexpr (M) {
        const bool docs = mask_docs(p.mask);
        const bool capped = r.cap_in != 0.f;
        const bool full = k0 + kN <= kend && p.k_pos_offset + k0 * p.k_pos_stride >= r.blk_lo &&
                          p.k_pos_offset + (k0 + kN - 1) * p.k_pos_stride <= r.blk_hi && same;
        const bool doc_test = docs && !same;
#pragma unroll
        for (int i = 0; i < NT; i++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                // the forward's score in log2 units, and d score / d (scale q.k)
                float xa, xb, ca = 1.f, cb = 1.f;
                if (capped) {
                    const float ua = tanh_acc(S(i, e) * r.cap_in);
                    const float ub = tanh_acc(S(i, 2 + e) * r.cap_in);
                    xa = ua * r.cap_out;
                    xb = ub * r.cap_out;
                    ca = 1.f - ua * ua;
                    cb = 1.f - ub * ub;
                } else {
                    xa = S(i, e) * sl2;
                    xb = S(i, 2 + e) * sl2;
                }
                float pa = exp2f(bwd_exponent(xa - r.lse2_a, r.band_a));
                float pb = exp2f(bwd_exponent(xb - r.lse2_b, r.band_b));
                if (!full) {
                    const int col = i * 8 + 2 * t + e;
                    const int64_t key = k0 + col;
                    const int64_t kpos = p.k_pos_offset + key * p.k_pos_stride;
                    const bool in = key < kend;
                    const int32_t kid = doc_test ? ids[col] : 0;
                    if (!in || !in_span(r.seen_a, kpos) || (doc_test && kid != r.qid_a)) pa = 0.f;
                    if (!in || !in_span(r.seen_b, kpos) || (doc_test && kid != r.qid_b)) pb = 0.f;
                }
                DP(i, e) = pa * (DP(i, e) - r.delta_a) * ca;
                DP(i, 2 + e) = pb * (DP(i, 2 + e) - r.delta_b) * cb;
            }
        }
        if (br.n != 0) {
            // snapped as the pass above decided, from the same score; a
            // hidden pair's dS is 0 whatever it is scaled by
            branch_rule_fix<NT * 4>(
                br,
                [&](int k) {
                    const bool a = (k % 4) < 2;
                    return S(k / 4, k % 4) * sl2 - (a ? r.lse2_a : r.lse2_b) >=
                           (a ? r.band_a : r.band_b);
                },
                [&](int k, int64_t *hq, int64_t *qp, int64_t *kp) {
                    *hq = br.head0 + br.head_stride * h;
                    *qp = (k % 4) < 2 ? r.qpos_a : r.qpos_b;
                    *kp = p.k_pos_offset + (k0 + (k / 4) * 8 + 2 * t + (k & 1)) * p.k_pos_stride;
                },
                [&](int k, float f) {
#pragma unroll
                    for (int kk = 0; kk < NT * 4; kk++)
                        if (kk == k) DP(kk / 4, kk % 4) *= f;
                });
        }
    } else {
        (void)br;
        (void)same;
        (void)ids;
        (void)h;
        const bool full = k0 + kN <= kend &&
                          (!p.causal || p.k_pos_offset + (k0 + kN - 1) * p.k_pos_stride <=
                                            r.qpos_first);
#pragma unroll
        for (int i = 0; i < NT; i++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float pa = exp2f(bwd_exponent(S(i, e) * sl2 - r.lse2_a, r.band_a));
                float pb = exp2f(bwd_exponent(S(i, 2 + e) * sl2 - r.lse2_b, r.band_b));
                if (!full) {
                    const int64_t key = k0 + i * 8 + 2 * t + e;
                    const int64_t kpos = p.k_pos_offset + key * p.k_pos_stride;
                    const bool in = key < kend;
                    if (!in || (p.causal && kpos > r.qpos_a)) pa = 0.f;
                    if (!in || (p.causal && kpos > r.qpos_b)) pb = 0.f;
                }
                DP(i, e) = pa * (DP(i, e) - r.delta_a);
                DP(i, 2 + e) = pb * (DP(i, 2 + e) - r.delta_b);
            }
        }
    }
}

}  // namespace bwd_tc
}  // namespace ra

#endif /* RA_ATTN_BWD_TC_CUH */
