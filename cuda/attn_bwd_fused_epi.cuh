/*
 * attn_bwd_fused_epi.cuh -- the fused backward's epilogue: the dQ part of
 * each tile added into float32 memory by red.global.add, and at the end
 * the block's dK and dV (float32 fragments spread over its 8 warps)
 * staged through shared memory and written row by row, 8 elements per
 * thread: 16-byte stores of 16-bit gradients, float4 loads/stores of
 * float32 ones (added to when accumulating), where the gradient's base and
 * strides allow 16-byte vectors (else 4- or 8-byte pairs, which the
 * tensor-core eligibility guarantees).  Fragment stores of pairs used half
 * of each 32-byte sector (the H100 profile of today's kernels).
 */
#ifndef RA_ATTN_BWD_FUSED_EPI_CUH
#define RA_ATTN_BWD_FUSED_EPI_CUH

#include "attn_bwd_fused.cuh"

namespace ra {
namespace bwd_fused {

/* Eight consecutive elements of a gradient row at element offset `off`
 * from src (float32): added into float32 (acc), stored as float32 (f32),
 * else as T; vec: off is a multiple of 8 elements from a 16-byte aligned
 * base, so 16-byte vectors are aligned. */
template <typename T>
__device__ __forceinline__ void store8(void *grad, int64_t off, bool acc, bool f32, bool vec,
                                       const float (&x)[8]) {
    if (acc || f32) {
        float *d = (float *)grad + off;
        if (vec) {
#pragma unroll
            for (int q = 0; q < 2; q++) {
                float4 v = make_float4(x[4 * q], x[4 * q + 1], x[4 * q + 2], x[4 * q + 3]);
                if (acc) {
                    const float4 o = reinterpret_cast<const float4 *>(d)[q];
                    v.x += o.x; v.y += o.y; v.z += o.z; v.w += o.w;
                }
                reinterpret_cast<float4 *>(d)[q] = v;
            }
        } else {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                float2 v = make_float2(x[2 * q], x[2 * q + 1]);
                if (acc) {
                    const float2 o = reinterpret_cast<const float2 *>(d)[q];
                    v.x += o.x; v.y += o.y;
                }
                reinterpret_cast<float2 *>(d)[q] = v;
            }
        }
    } else {
        uint32_t w[4];
#pragma unroll
        for (int q = 0; q < 4; q++) w[q] = pack2<T>(x[2 * q], x[2 * q + 1]);
        T *d = (T *)grad + off;
        if (vec) {
            *reinterpret_cast<uint4 *>(d) = make_uint4(w[0], w[1], w[2], w[3]);
        } else {
#pragma unroll
            for (int q = 0; q < 4; q++) reinterpret_cast<uint32_t *>(d)[q] = w[q];
        }
    }
}

/* Whether a gradient's rows take 16-byte vectors: base 16-byte aligned and
 * every stride a multiple of 16 bytes (head_dim is 64 or 128). */
__host__ __device__ __forceinline__ bool vec16(const void *grad, size_t esize, int64_t bs,
                                               int64_t ss, int64_t hs) {
    const int64_t n = (int64_t)(16 / esize);
    return ((uintptr_t)grad % 16) == 0 && bs % n == 0 && ss % n == 0 && hs % n == 0;
}

/* The dQ part of one tile (warp (wm, wn) = (w / 4, w % 4) of phase 4: rows 32 wm + 16 i + 8 h
 * + g of the tile, columns (D / 4) wn + 8 n + 2 t) added into the rows of
 * one (b, h) of the target (`bh`, row stride `ss`) from row_base on; rows
 * at or past S_q are not written. */
template <int D>
__device__ __forceinline__ void add_dq(float *bh, int64_t ss, int64_t row_base, int64_t s_q,
                                       const float (&dq)[2][D / 32][4]) {
    const int tid = tid_x(), wm = tid / 128, wn = (tid / 32) % 4;
    const int g = (tid % 32) / 4, t = tid % 4;
#pragma unroll
    for (int i = 0; i < 2; i++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int64_t rr = 32 * wm + 16 * i + 8 * h + g;
            if (row_base + rr < s_q) {
                float *dst = bh + (row_base + rr) * ss + (D / 4) * wn + 2 * t;
#pragma unroll
                for (int n = 0; n < D / 32; n++)
                    red_add_f32x2(dst + 8 * n, dq[i][n][2 * h], dq[i][n][2 * h + 1]);
            }
        }
    }
}

/* dK and dV of the block: the fragments (warp (wm, wn) of phase 3: keys
 * 32 wn + 16 i + 8 h + g, columns (D / 2) wm + 8 n + 2 t) into float32 rows
 * of shared memory, then out, 8 elements per thread and step.  The caller
 * has synchronised the block (every warp is done with the tiles). */
template <typename T, int D, bool M>
__device__ __forceinline__ void store_dk_dv(const ra_attn_bwd_params &p, unsigned char *smem,
                                            const float (&dk)[2][D / 16][4],
                                            const float (&dv)[2][D / 16][4], int wm, int wn,
                                            int64_t b, int64_t hk, int64_t k0) {
    typedef Layout<D, M> L;
    constexpr int S = L::kEpiStride;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float *ek = reinterpret_cast<float *>(smem + L::kEpiDK);
    float *ev = reinterpret_cast<float *>(smem + L::kEpiDV);
#pragma unroll
    for (int i = 0; i < 2; i++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = 32 * wn + 16 * i + 8 * h + g;
#pragma unroll
            for (int n = 0; n < D / 16; n++) {
                const int col = (D / 2) * wm + 8 * n + 2 * t;
                *reinterpret_cast<float2 *>(ek + row * S + col) =
                    make_float2(dk[i][n][2 * h], dk[i][n][2 * h + 1]);
                *reinterpret_cast<float2 *>(ev + row * S + col) =
                    make_float2(dv[i][n][2 * h], dv[i][n][2 * h + 1]);
            }
        }
    }
    __syncthreads();
    const bool acc = p.accumulate != 0, f32 = p.grad_dtype == RA_FLOAT32;
    const size_t es = f32 ? 4 : 2;
    const bool vk = vec16(p.dk, es, p.dk_batch_stride, p.dk_seq_stride, p.dk_head_stride);
    const bool vv = vec16(p.dv, es, p.dv_batch_stride, p.dv_seq_stride, p.dv_head_stride);
    constexpr int kChunks = D / 8;  // 8-element chunks per row
#pragma unroll 2
    for (int idx = threadIdx.x; idx < kBlockN * kChunks; idx += kThreads) {
        const int row = idx / kChunks, c8 = (idx % kChunks) * 8;
        const int64_t key = k0 + row;
        if (key >= p.seqlen_k) continue;
        float x[8], y[8];
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const float4 a = *reinterpret_cast<const float4 *>(ek + row * S + c8 + 4 * q);
            const float4 v = *reinterpret_cast<const float4 *>(ev + row * S + c8 + 4 * q);
            x[4 * q] = a.x; x[4 * q + 1] = a.y; x[4 * q + 2] = a.z; x[4 * q + 3] = a.w;
            y[4 * q] = v.x; y[4 * q + 1] = v.y; y[4 * q + 2] = v.z; y[4 * q + 3] = v.w;
        }
        store8<T>(p.dk, b * p.dk_batch_stride + key * p.dk_seq_stride + hk * p.dk_head_stride + c8,
                  acc, f32, vk, x);
        store8<T>(p.dv, b * p.dv_batch_stride + key * p.dv_seq_stride + hk * p.dv_head_stride + c8,
                  acc, f32, vv, y);
    }
}

}  // namespace bwd_fused
}  // namespace ra

#endif /* RA_ATTN_BWD_FUSED_EPI_CUH */
