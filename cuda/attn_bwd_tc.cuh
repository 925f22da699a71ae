/*
 * attn_bwd_tc.cuh -- what the two tensor-core backward kernels share
 * (attn_bwd_tc_dkdv.cu, attn_bwd_tc_dq.cu): the block shape, the softmax
 * row statistics in the form the kernels use them, and the store of a pair
 * of float32 accumulators into a gradient.
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

}  // namespace bwd_tc
}  // namespace ra

#endif /* RA_ATTN_BWD_TC_CUH */
