/*
 * fwd_epilogue.cuh -- the end of the Hopper forward for one consumer
 * thread's two rows: normalise O by the row sum, write out and lse, or
 * (p.accumulate) merge into the float32 running state (out, lse) in place
 * by the LSE rule (DESIGN.md section 3), exactly as the mma.sync kernel
 * does: old state weight e^(lse_old - lse_new), this call's part
 * e^(lse_part - lse_new) / l; a row this call adds nothing to (l = 0)
 * keeps its state untouched; an empty row of a plain call is (0, -inf);
 * a NaN l (a NaN score) is not empty and makes out and lse NaN.
 *
 * O's registers: o[4j + h] is row a (h < 2) or b (h >= 2), column
 * 8j + 2 (lane % 4) + (h & 1): each thread writes pairs of columns.
 */
#ifndef RA_HOPPER_FWD_EPILOGUE_CUH
#define RA_HOPPER_FWD_EPILOGUE_CUH

#include "hopper/fwd_softmax.cuh"

namespace ra {
namespace wg {

template <typename T, int D>
__device__ __forceinline__ void store_rows(const ra_attn_fwd_params &p, const QBlock &blk,
                                           const RowMasks &r, RowState st,
                                           const float (&o)[D / 2]) {
    const int t = threadIdx.x % 4;
    const int64_t b = blk.b, h = blk.h;
    st.reduce();
    const int64_t row_a = r.row_a, row_b = r.row_b;
    const bool ok_a = row_a < p.seqlen_q, ok_b = row_b < p.seqlen_q;
    // a NaN l (a NaN score: ex2(NaN) went into the sum) is not empty
    const bool empty_a = st.l_a == 0.f, empty_b = st.l_b == 0.f;
    const float inv_a = empty_a ? 0.f : 1.f / st.l_a, inv_b = empty_b ? 0.f : 1.f / st.l_b;
    const float lse_a = empty_a ? -CUDART_INF_F : (st.m_a + log2f(st.l_a)) * kLn2;
    const float lse_b = empty_b ? -CUDART_INF_F : (st.m_b + log2f(st.l_b)) * kLn2;
    float *lse_base = (float *)p.lse + b * p.lse_batch_stride + h * p.lse_head_stride;
    const int64_t orow_a = b * p.out_batch_stride + row_a * p.out_seq_stride + h * p.out_head_stride;
    const int64_t orow_b = orow_a + 8 * p.out_seq_stride;

    if (p.accumulate) {
        // out is the float32 running state; weights of old state and new part
        const float lo_a = ok_a ? lse_base[row_a * p.lse_seq_stride] : -CUDART_INF_F;
        const float lo_b = ok_b ? lse_base[row_b * p.lse_seq_stride] : -CUDART_INF_F;
        __syncwarp();  // the quad has read the old lse before lane t == 0 writes
        float w1_a = 1.f, w2_a = 0.f, w1_b = 1.f, w2_b = 0.f, ln_a = lo_a, ln_b = lo_b;
        if (!empty_a) {
            const float mm = fmaxf(lo_a, lse_a);
            const float e1 = __expf(lo_a - mm), e2 = __expf(lse_a - mm), sum = e1 + e2;
            w1_a = e1 / sum;
            w2_a = e2 / sum * inv_a;
            ln_a = mm + logf(sum);
        }
        if (!empty_b) {
            const float mm = fmaxf(lo_b, lse_b);
            const float e1 = __expf(lo_b - mm), e2 = __expf(lse_b - mm), sum = e1 + e2;
            w1_b = e1 / sum;
            w2_b = e2 / sum * inv_b;
            ln_b = mm + logf(sum);
        }
        float *out = (float *)p.out;
#pragma unroll
        for (int j = 0; j < D / 8; j++) {
            const int d = 8 * j + 2 * t;
            if (ok_a && !empty_a) {
                float2 *dst = reinterpret_cast<float2 *>(out + orow_a + d);
                const float2 old = w1_a != 0.f ? *dst : make_float2(0.f, 0.f);
                *dst = make_float2(w1_a * old.x + w2_a * o[4 * j], w1_a * old.y + w2_a * o[4 * j + 1]);
            }
            if (ok_b && !empty_b) {
                float2 *dst = reinterpret_cast<float2 *>(out + orow_b + d);
                const float2 old = w1_b != 0.f ? *dst : make_float2(0.f, 0.f);
                *dst = make_float2(w1_b * old.x + w2_b * o[4 * j + 2],
                                   w1_b * old.y + w2_b * o[4 * j + 3]);
            }
        }
        if (t == 0) {
            if (ok_a && !empty_a) lse_base[row_a * p.lse_seq_stride] = ln_a;
            if (ok_b && !empty_b) lse_base[row_b * p.lse_seq_stride] = ln_b;
        }
    } else {
        const bool out_f32 = p.out_dtype == RA_FLOAT32;
#pragma unroll
        for (int j = 0; j < D / 8; j++) {
            const int d = 8 * j + 2 * t;
            if (out_f32) {
                float *out = (float *)p.out;
                if (ok_a)
                    *reinterpret_cast<float2 *>(out + orow_a + d) =
                        make_float2(o[4 * j] * inv_a, o[4 * j + 1] * inv_a);
                if (ok_b)
                    *reinterpret_cast<float2 *>(out + orow_b + d) =
                        make_float2(o[4 * j + 2] * inv_b, o[4 * j + 3] * inv_b);
            } else {
                T *out = (T *)p.out;
                if (ok_a)
                    *reinterpret_cast<uint32_t *>(out + orow_a + d) =
                        pack2<T>(o[4 * j] * inv_a, o[4 * j + 1] * inv_a);
                if (ok_b)
                    *reinterpret_cast<uint32_t *>(out + orow_b + d) =
                        pack2<T>(o[4 * j + 2] * inv_b, o[4 * j + 3] * inv_b);
            }
        }
        if (t == 0) {
            if (ok_a) lse_base[row_a * p.lse_seq_stride] = lse_a;
            if (ok_b) lse_base[row_b * p.lse_seq_stride] = lse_b;
        }
    }
}

}  // namespace wg
}  // namespace ra

#endif /* RA_HOPPER_FWD_EPILOGUE_CUH */
