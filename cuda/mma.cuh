/*
 * mma.cuh -- the sm_80+ tensor-core building blocks of ringattn's fast
 * kernels, as thin wrappers over PTX:
 *   cp_async<N>     N-byte global -> shared copy, N = 16 (cp_async16) or 4
 *                   (zero-fills when !valid)
 *   ldmatrix_x4     four 8x8 16-bit matrices from shared memory into the
 *                   mma fragment layout (optionally transposed)
 *   mma_16816       D(16x8, f32) += A(16x16) * B(16x8), f16 or bf16 inputs
 *   ex2_approx      2^x by the MUFU unit (ex2.approx.ftz.f32), without the
 *                   denormal guard exp2f() compiles to
 * and the XOR swizzle used for every shared tile whose rows are 64 or 128
 * 16-bit elements: the 16-byte chunk c of row r lives at chunk c ^ (r & 7),
 * so the 8 row addresses of one ldmatrix matrix (same c, 8 consecutive r)
 * fall into 8 different bank groups.
 *
 * Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4):
 *   A regs a0..a3: (row g, cols 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)
 *   B regs b0, b1: (k 2t..2t+1, col g), (k 2t+8.., col g)
 *   C regs c0..c3: (row g, cols 2t, 2t+1), (row g+8, cols 2t, 2t+1)
 */
#ifndef RA_MMA_CUH
#define RA_MMA_CUH

#include "common.cuh"

#ifdef RA_CUDA_EMULATED
#include "emu/ptx.h"   /* the same operations on the emulated GPU (csrc/emu) */
#endif

namespace ra {

/* N-byte global -> shared copy, zero-filling when !valid: 16 bytes past L1
 * (cp.async.cg), 4 through it (cp.async.ca: .cg takes only 16; a strided
 * int32 such as a key's segment id, in its tile's commit group) */
template <int N>
__device__ __forceinline__ void cp_async(void *smem, const void *gmem, bool valid) {
    static_assert(N == 4 || N == 16, "cp.async of 4 or 16 bytes");
#ifdef RA_CUDA_EMULATED
    ra_emu_cp_async(smem, gmem, N, valid ? N : 0);
#else
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    const int n = valid ? N : 0;
    if constexpr (N == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
#endif
}
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid) {
    cp_async<16>(smem, gmem, valid);
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef RA_CUDA_EMULATED
    ra_emu_cp_async_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef RA_CUDA_EMULATED
    ra_emu_cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void *smem) {
#ifdef RA_CUDA_EMULATED
    ra_emu_ldmatrix(r, smem, 4, 0);
#else
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
#endif
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void *smem) {
#ifdef RA_CUDA_EMULATED
    ra_emu_ldmatrix(r, smem, 4, 1);
#else
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
#endif
}

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4],
                                          uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<half_t>(float (&c)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
#ifdef RA_CUDA_EMULATED
    ra_emu_mma_m16n8k16(c, a, b0, b1, 0);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
template <>
__device__ __forceinline__ void mma_16816<bf16_t>(float (&c)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
#ifdef RA_CUDA_EMULATED
    ra_emu_mma_m16n8k16(c, a, b0, b1, 1);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

/* 2^x as ex2.approx.ftz.f32: one MUFU.EX2, where exp2f() adds a compare
 * and two multiplies to keep subnormal results.  Subnormal inputs and
 * results are flushed to zero (after the row max is subtracted the
 * argument is <= 0, and a probability below 2^-126 is 0 in 16 bits anyway);
 * 2^-inf = 0, 2^NaN = NaN.  Relative error 2^-22 on the device; the
 * emulated GPU computes exp2f and flushes the same way. */
__device__ __forceinline__ float ex2_approx(float x) {
#ifdef RA_CUDA_EMULATED
    const float r = exp2f(x);
    return r < 1.17549435e-38f ? 0.0f : r;
#else
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
#endif
}

/* two floats -> one register of two 16-bit values, x in the low half */
template <typename T> __device__ __forceinline__ uint32_t pack2(float x, float y);
template <> __device__ __forceinline__ uint32_t pack2<half_t>(float x, float y) {
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t *>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<bf16_t>(float x, float y) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t *>(&h);
}

/* element offset of (row, col) in a swizzled tile of D 16-bit columns */
template <int D>
__device__ __forceinline__ int swz(int row, int col) {
    return row * D + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

/* cp.async a ROWS x D tile of 16-bit elements into a swizzled shared tile:
 * global rows row0 .. row0 + ROWS - 1 of a (seq, D) matrix `g` with row
 * stride `ld` (elements); rows >= limit are zero-filled.  THREADS threads
 * (threadIdx.x < THREADS) each issue ROWS * D / 8 / THREADS 16-byte copies. */
template <typename T, int D, int ROWS, int THREADS>
__device__ __forceinline__ void cp_async_tile(T *smem, const T *g, int64_t ld,
                                              int64_t row0, int64_t limit) {
    constexpr int kChunks = D / 8;  // 16-byte chunks per row
    static_assert((ROWS * kChunks) % THREADS == 0, "tile must split evenly over threads");
#pragma unroll
    for (int it = 0; it < ROWS * kChunks / THREADS; it++) {
        const int idx = threadIdx.x + it * THREADS;
        const int r = idx / kChunks, c = idx % kChunks;
        const int64_t row = row0 + r;
        const bool ok = row < limit;
        const T *src = ok ? g + row * ld + c * 8 : g;
        cp_async16(smem + swz<D>(r, c * 8), src, ok);
    }
}

/* Fragment loads from swizzled tiles of D columns (one warp, all lanes):
 *   frag_a      A of the 16 x 16 block at (row0, col0) of a row-major tile
 *   frag_b_nk   B of two n-tiles (n0 .. n0 + 15, k0 .. k0 + 15) from a tile
 *               stored [n][k] (n = tile row): b[0], b[1] for n0 .. n0 + 7,
 *               b[2], b[3] for n0 + 8 .. n0 + 15
 *   frag_b_kn   the same from a tile stored [k][n] (k = tile row), through
 *               ldmatrix.trans */
template <int D>
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const void *tile, int row0, int col0) {
    const int lane = threadIdx.x % 32;
    // lanes 0-15: rows 0-15 at col0; lanes 16-31: rows 0-15 at col0 + 8
    ldmatrix_x4(a, (const uint16_t *)tile + swz<D>(row0 + (lane % 16), col0 + (lane / 16) * 8));
}
template <int D>
__device__ __forceinline__ void frag_b_nk(uint32_t (&b)[4], const void *tile, int n0, int k0) {
    const int lane = threadIdx.x % 32;
    // matrices: (n 0-7, k lo), (n 0-7, k hi), (n 8-15, k lo), (n 8-15, k hi)
    ldmatrix_x4(b, (const uint16_t *)tile +
                       swz<D>(n0 + (lane % 8) + (lane / 16) * 8, k0 + ((lane / 8) % 2) * 8));
}
template <int D>
__device__ __forceinline__ void frag_b_kn(uint32_t (&b)[4], const void *tile, int k0, int n0) {
    const int lane = threadIdx.x % 32;
    // matrices (transposed): (k lo, n 0-7), (k hi, n 0-7), (k lo, n 8-15), (k hi, n 8-15)
    ldmatrix_x4_trans(b, (const uint16_t *)tile +
                             swz<D>(k0 + (lane % 8) + ((lane / 8) % 2) * 8, n0 + (lane / 16) * 8));
}

/* The C fragments of two adjacent n-tiles (16 columns) as one 16-bit A
 * fragment whose k runs over those 16 columns. */
template <typename T>
__device__ __forceinline__ void a_from_c(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
    a[0] = pack2<T>(c0[0], c0[1]);
    a[1] = pack2<T>(c0[2], c0[3]);
    a[2] = pack2<T>(c1[0], c1[1]);
    a[3] = pack2<T>(c1[2], c1[3]);
}

/* A float accumulator row block of N columns, n-tiles of 8 back to back
 * (4 registers each: mma.sync's C layout, also each 8-column slice of a
 * wgmma accumulator), as N / 16 16-bit A fragments: k-step kk covers
 * columns 16 kk .. 16 kk + 15, the pair of n-tiles 2 kk, 2 kk + 1 (a_from_c
 * on each pair).  The Hopper forward packs P this way, the Hopper backward
 * P^T, dS^T and dS. */
template <typename T, int N>
__device__ __forceinline__ void a_from_acc(uint32_t (*a)[4], const float (&x)[N / 2]) {
#pragma unroll
    for (int kk = 0; kk < N / 16; kk++) {
        a[kk][0] = pack2<T>(x[8 * kk], x[8 * kk + 1]);
        a[kk][1] = pack2<T>(x[8 * kk + 2], x[8 * kk + 3]);
        a[kk][2] = pack2<T>(x[8 * kk + 4], x[8 * kk + 5]);
        a[kk][3] = pack2<T>(x[8 * kk + 6], x[8 * kk + 7]);
    }
}

}  // namespace ra

#endif /* RA_MMA_CUH */
