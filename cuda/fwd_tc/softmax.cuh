/*
 * fwd_tc/softmax.cuh -- the online softmax of the tensor-core forward, per
 * thread for its two rows of the warp's 16 (g = lane / 4 and g + 8; the 4
 * lanes of a quad share a row and reduce over shuffles).
 *
 * Scores s arrive raw (q.k, or soft-capped and already in log2 units); `mul`
 * takes them to log2 units (scale * log2 e, or 1 when capped).  A row keeps
 * a pivot m (raw units) and exponentiates P = 2^(s mul - m mul) with one
 * FFMA and one MUFU.EX2 per element (ex2.approx: no exp2f denormal guard).
 * The pivot moves only when a tile's max exceeds it by more than
 * kRescaleAbove in log2 units (lazy rescale: O and l are multiplied by
 * 2^(old - new) then, a warp-uniform cold branch); otherwise P <= 2^8.
 * A pivot too large for the fold (|m mul| >= kFoldBelow: huge scores) is
 * subtracted from the raw scores first, in a cold pass, so that the row's
 * maximum still gives exactly 2^0.  Rows with no visible key keep m = -inf,
 * l = 0; a NaN score makes P, so l, NaN.
 */
#ifndef RA_FWD_TC_SOFTMAX_CUH
#define RA_FWD_TC_SOFTMAX_CUH

#include "mma.cuh"
#include "fwd_tc/traits.cuh"

namespace ra {
namespace fwd_tc {

struct RowState {
    float m[2];    // pivot, raw units (-inf: no visible key so far)
    float off[2];  // m * mul when it folds into the FFMA, else 0
    float l[2];    // this lane's part of the row sums of P
    bool any_sub;  // some row of the warp does not fold (warp-uniform)

    __device__ __forceinline__ void init() {
        m[0] = m[1] = -CUDART_INF_F;
        off[0] = off[1] = l[0] = l[1] = 0.f;
        any_sub = false;
    }

    /* what a row subtracts from its raw scores: m when it does not fold
     * (off is then 0), else 0 (a folded m = 0 subtracts its 0 harmlessly) */
    __device__ __forceinline__ float sub(int r) const {
        return off[r] == 0.f && m[r] != -CUDART_INF_F ? m[r] : 0.f;
    }

    /* One key tile: s (16 x NK per warp, C fragments) becomes P in place;
     * o (the warp's 16 x D accumulator) is rescaled when a pivot moves. */
    template <int NT, int DT>
    __device__ __forceinline__ void step(float (&s)[NT][4], float (&o)[DT][4], float mul) {
        // row max: kChains interleaved chains per row (a chain of 2 NT
        // dependent FMNMX would be the single warp's longest wait), then
        // over the quad
        constexpr int kChains = NT >= 4 ? 4 : NT;
        float mx[2][kChains];
#pragma unroll
        for (int c = 0; c < kChains; c++) {
            mx[0][c] = fmaxf(s[c][0], s[c][1]);
            mx[1][c] = fmaxf(s[c][2], s[c][3]);
        }
#pragma unroll
        for (int i = kChains; i < NT; i++) {
            mx[0][i % kChains] = fmaxf(mx[0][i % kChains], fmaxf(s[i][0], s[i][1]));
            mx[1][i % kChains] = fmaxf(mx[1][i % kChains], fmaxf(s[i][2], s[i][3]));
        }
#pragma unroll
        for (int w = kChains / 2; w >= 1; w /= 2) {
#pragma unroll
            for (int c = 0; c < w; c++) {
                mx[0][c] = fmaxf(mx[0][c], mx[0][c + w]);
                mx[1][c] = fmaxf(mx[1][c], mx[1][c + w]);
            }
        }
        float tmax[2] = {mx[0][0], mx[1][0]};
#pragma unroll
        for (int r = 0; r < 2; r++) {
            tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 1));
            tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 2));
        }
        // (tmax - m) in raw units first: exact near m, whatever m's size
        const bool grow = (tmax[0] - m[0]) * mul > kRescaleAbove ||
                          (tmax[1] - m[1]) * mul > kRescaleAbove;
        const bool any_grow = __any_sync(0xffffffffu, grow);
        if (any_grow || any_sub) {  // rare: one branch on the common path
            if (any_grow) move_pivots(tmax, o, mul);
            if (any_sub) {
                const float sub0 = sub(0), sub1 = sub(1);
#pragma unroll
                for (int i = 0; i < NT; i++) {
                    s[i][0] -= sub0;
                    s[i][1] -= sub0;
                    s[i][2] -= sub1;
                    s[i][3] -= sub1;
                }
            }
        }
        // P = 2^(s mul - off): one FFMA and one MUFU.EX2 per element; the
        // row sums in two chains each
        float sum[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
        for (int i = 0; i < NT; i++) {
            s[i][0] = ex2_approx(fmaf(s[i][0], mul, -off[0]));
            s[i][1] = ex2_approx(fmaf(s[i][1], mul, -off[0]));
            s[i][2] = ex2_approx(fmaf(s[i][2], mul, -off[1]));
            s[i][3] = ex2_approx(fmaf(s[i][3], mul, -off[1]));
            sum[0][i & 1] += s[i][0] + s[i][1];
            sum[1][i & 1] += s[i][2] + s[i][3];
        }
        l[0] += sum[0][0] + sum[0][1];
        l[1] += sum[1][0] + sum[1][1];
    }

    /* Every row of the warp takes max(m, its tile max) as its pivot (a row
     * whose max did not grow keeps m: factor 1). */
    template <int DT>
    __device__ __forceinline__ void move_pivots(const float (&mx)[2], float (&o)[DT][4],
                                                float mul) {
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float mn = fmaxf(m[r], mx[r]);
            // -inf -> -inf (nothing visible yet) would be NaN: factor 1
            alpha[r] = mn == -CUDART_INF_F ? 1.f : ex2_approx((m[r] - mn) * mul);
            m[r] = mn;
            l[r] *= alpha[r];
            const float ms = mn * mul;
            off[r] = fabsf(ms) < kFoldBelow ? ms : 0.f;
        }
#pragma unroll
        for (int i = 0; i < DT; i++) {
            o[i][0] *= alpha[0];
            o[i][1] *= alpha[0];
            o[i][2] *= alpha[1];
            o[i][3] *= alpha[1];
        }
        any_sub = __any_sync(0xffffffffu, sub(0) != 0.f || sub(1) != 0.f);
    }

    /* After the last tile: the quad's row sums and lse (natural log; -inf
     * for an empty row; NaN when a NaN score went into l). */
    __device__ __forceinline__ void finish(float (&lse)[2], float mul) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
            lse[r] = l[r] == 0.f ? -CUDART_INF_F : (m[r] * mul + log2f(l[r])) * kLn2;
        }
    }
};

}  // namespace fwd_tc
}  // namespace ra

#endif /* RA_FWD_TC_SOFTMAX_CUH */
