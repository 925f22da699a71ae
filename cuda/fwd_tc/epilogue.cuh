/*
 * fwd_tc/epilogue.cuh -- the tensor-core forward's results, per warp (its
 * 16 rows; this thread's rows g and g + 8 of them, O in C fragments):
 *   merge_running_state  p.accumulate: merge into the float32 running
 *                        (out, lse) by the LSE rule (ring steps)
 *   store_staged         16-bit out: O through the warp's own Q rows in
 *                        shared memory, then 16-byte stores, rows contiguous
 *   store_direct         float32 out, or 16-bit out whose rows are not
 *                        16-byte aligned: from the fragments
 *   store_lse
 * Rows past S_q are neither read nor written.
 */
#ifndef RA_FWD_TC_EPILOGUE_CUH
#define RA_FWD_TC_EPILOGUE_CUH

#include "mma.cuh"
#include "fwd_tc/traits.cuh"

namespace ra {
namespace fwd_tc {

/* blockIdx.x, read again rather than remembered: the epilogue recomputes
 * the block's (b, h, q0) from it, which frees their registers during the
 * key loop (at D 64 the loop fills the 128 that 2 blocks per SM allow, and
 * the compiler would keep them in local memory otherwise). */
__device__ __forceinline__ int64_t block_index_again() {
#ifdef RA_CUDA_EMULATED
    return (int64_t)blockIdx.x;
#else
    unsigned x;
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(x));
    return (int64_t)x;
#endif
}

/* This thread's two rows. */
struct Rows {
    int64_t row[2];      // query index of rows g and g + 8
    bool ok[2];          // row < S_q
    int64_t out_off[2];  // element offset of the row of out (b, row, h)
    float *lse[2];       // its lse
};

__device__ __forceinline__ Rows rows_of(const ra_attn_fwd_params &p, int64_t b, int64_t h,
                                        int64_t row_a) {
    Rows r;
    float *lse_base = (float *)p.lse + b * p.lse_batch_stride + h * p.lse_head_stride;
#pragma unroll
    for (int k = 0; k < 2; k++) {
        r.row[k] = row_a + 8 * k;
        r.ok[k] = r.row[k] < p.seqlen_q;
        r.out_off[k] = b * p.out_batch_stride + r.row[k] * p.out_seq_stride + h * p.out_head_stride;
        r.lse[k] = lse_base + r.row[k] * p.lse_seq_stride;
    }
    return r;
}

/* out (float32) and lse hold the running state of earlier key blocks: the
 * new part (o / l, lse) merges in with weights e^(lse_old - lse_new) and
 * e^(lse_part - lse_new).  An empty part leaves the row alone; an empty
 * old state (lse -inf) is replaced without reading out. */
template <int DT>
__device__ __forceinline__ void merge_running_state(const ra_attn_fwd_params &p,
                                                    const float (&o)[DT][4], const Rows &r,
                                                    const float (&l)[2], const float (&lse)[2]) {
    const int t = threadIdx.x % 4;
    float old[2], w1[2], w2[2], ln[2];
    bool live[2];
#pragma unroll
    for (int k = 0; k < 2; k++) old[k] = r.ok[k] ? *r.lse[k] : -CUDART_INF_F;
    __syncwarp();  // the quad has read the old lse before lane t == 0 writes
#pragma unroll
    for (int k = 0; k < 2; k++) {
        // a NaN l (a NaN score went into the sum) is not empty
        live[k] = r.ok[k] && l[k] != 0.f;
        w1[k] = 1.f;
        w2[k] = 0.f;
        ln[k] = old[k];
        if (l[k] != 0.f) {
            const float mm = fmaxf(old[k], lse[k]);
            const float e1 = __expf(old[k] - mm), e2 = __expf(lse[k] - mm), sum = e1 + e2;
            w1[k] = e1 / sum;
            w2[k] = e2 / sum / l[k];
            ln[k] = mm + logf(sum);
        }
    }
    float *out = (float *)p.out;
#pragma unroll
    for (int i = 0; i < DT; i++) {
        const int d = i * 8 + 2 * t;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            if (!live[k]) continue;
            float2 *dst = reinterpret_cast<float2 *>(out + r.out_off[k] + d);
            const float2 prev = w1[k] != 0.f ? *dst : make_float2(0.f, 0.f);
            *dst = make_float2(w1[k] * prev.x + w2[k] * o[i][2 * k],
                               w1[k] * prev.y + w2[k] * o[i][2 * k + 1]);
        }
    }
    if (t == 0) {
#pragma unroll
        for (int k = 0; k < 2; k++)
            if (live[k]) *r.lse[k] = ln[k];
    }
}

/* out = o * inv per row, from the fragments: float2 (float32 out: every
 * 32-byte sector whole) or 2 x 16 bits. */
template <typename T, int DT>
__device__ __forceinline__ void store_direct(const ra_attn_fwd_params &p, const float (&o)[DT][4],
                                             const Rows &r, const float (&inv)[2]) {
    const int t = threadIdx.x % 4;
    const bool out_f32 = p.out_dtype == RA_FLOAT32;
#pragma unroll
    for (int i = 0; i < DT; i++) {
        const int d = i * 8 + 2 * t;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            if (!r.ok[k]) continue;
            const float x = o[i][2 * k] * inv[k], y = o[i][2 * k + 1] * inv[k];
            if (out_f32)
                *reinterpret_cast<float2 *>((float *)p.out + r.out_off[k] + d) = make_float2(x, y);
            else
                *reinterpret_cast<uint32_t *>((T *)p.out + r.out_off[k] + d) = pack2<T>(x, y);
        }
    }
}

/* 16-bit out through shared memory: the warp writes its 16 rows, o * inv
 * rounded, into its own Q rows (no other warp reads them: no block
 * barrier), swizzled so that the quad's 4-byte writes of 8 rows hit 32
 * different banks; then each lane stores whole 16-byte chunks, a row's
 * chunks from consecutive lanes (full 32-byte sectors; the fragments'
 * 4-byte stores used half of each).  `q_row0`: the warp's first row. */
template <typename T, class Tr>
__device__ __forceinline__ void store_staged(const ra_attn_fwd_params &p,
                                             const float (&o)[Tr::D / 8][4], const Rows &r,
                                             const float (&inv)[2], unsigned char *smem, int warp,
                                             int64_t b, int64_t h, int64_t q_row0) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    unsigned char *tile = smem + (uint32_t)warp * 16 * Tr::kRowBytes;
    __syncwarp();  // every lane's ldmatrix reads of these rows are done
#pragma unroll
    for (int i = 0; i < Tr::D / 8; i++) {
        const uint32_t col = 16u * (uint32_t)(i ^ g) + 4u * (uint32_t)t;
#pragma unroll
        for (int k = 0; k < 2; k++)
            *reinterpret_cast<uint32_t *>(tile + (g + 8 * k) * Tr::kRowBytes + col) =
                pack2<T>(o[i][2 * k] * inv[k], o[i][2 * k + 1] * inv[k]);
    }
    __syncwarp();
    T *out = (T *)p.out + b * p.out_batch_stride + h * p.out_head_stride;
    constexpr int kPerLane = 16 * Tr::kChunks / 32;
#pragma unroll
    for (int it = 0; it < kPerLane; it++) {
        const int idx = lane + 32 * it, row = idx / Tr::kChunks, c = idx % Tr::kChunks;
        const int64_t q = q_row0 + row;
        if (q < p.seqlen_q)
            *reinterpret_cast<uint4 *>(out + q * p.out_seq_stride + 8 * c) =
                *reinterpret_cast<const uint4 *>(tile + row * Tr::kRowBytes +
                                                 16 * (c ^ (row & 7)));
    }
}

__device__ __forceinline__ void store_lse(const Rows &r, const float (&lse)[2]) {
    if (threadIdx.x % 4 == 0) {
#pragma unroll
        for (int k = 0; k < 2; k++)
            if (r.ok[k]) *r.lse[k] = lse[k];
    }
}

}  // namespace fwd_tc
}  // namespace ra

#endif /* RA_FWD_TC_EPILOGUE_CUH */
