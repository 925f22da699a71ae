/*
 * smem_frag.cuh -- fragment loads from swizzled shared tiles with the
 * addresses computed once per thread, and float32 reductions into global
 * memory, for the tensor-core kernels that are written against them (the
 * fused backward, attn_bwd_fused*.cuh).
 *
 * Why: mma.cuh's frag_* helpers evaluate swz<D>(row, col) at every call,
 * and under register pressure the compiler re-derives those addresses in
 * every tile (today's kernels: ~5 integer instructions per ldmatrix).  Here
 * each lane computes, once, the byte offset of its ldmatrix row in the
 * 16 x 16 block at (0, 0) of a tile (LaneOff); the block at (row0, col0)
 * is then `row0 * row_bytes + (off ^ (col0 / 8) << 4)`: one XOR with an
 * immediate (shared by every block of the same column) and an immediate
 * that ptxas folds into the LDSM.
 *
 * Why that is exact: a tile of COLS 16-bit columns stores the 16-byte chunk
 * c of row r at chunk c ^ (r & 7) (mma.cuh's swz).  A lane's row inside a
 * block is lrow (0..15) and its chunk c0 + hi (c0 = col0 / 8 even, hi 0 or
 * 1); for row0 a multiple of 8, (row0 + lrow) & 7 = lrow & 7 and
 * (c0 + hi) ^ (lrow & 7) = c0 ^ (hi ^ (lrow & 7)), so the lane's chunk is
 * c0 ^ x with x = hi ^ (lrow & 7) fixed per lane.  The chunk field (bits 4
 * and up of the byte offset, below the row) of `off` holds x, and XOR-ing
 * c0 << 4 into it only changes that field.
 *
 *   saddr_t / saddr        a shared-memory address as ldmatrix takes it (a
 *                          32-bit shared address on the device, the pointer
 *                          on the emulated GPU)
 *   ldsm_x4 / ldsm_x4_t    ldmatrix .x4 (.trans) at such an address
 *   LaneOff<COLS>::a/nk/kn the three lane patterns:
 *     a   A of a row-major [m][k] tile (rows 0-15, lanes 16-31 at col + 8)
 *     nk  B of a [n][k] tile (mma.cuh frag_b_nk), and A of a [k][m] tile
 *         through ldsm_x4_t (the transposed operand: the matrices of A are
 *         (m lo, k lo), (m hi, k lo), (m lo, k hi), (m hi, k hi), stored as
 *         k rows x m columns in the same order as frag_b_nk's)
 *     kn  B of a [k][n] tile through ldsm_x4_t (mma.cuh frag_b_kn)
 *   tid_x                  threadIdx.x, not hoisted out of loops
 *   cp_async_rows          cp.async of a tile's rows, one swizzled offset
 *                          per thread
 *   red_add_f32x2          dst[0] += x, dst[1] += y in global float32
 *                          memory with no return value: one
 *                          red.global.add.v2.f32 on sm_90 (8 bytes per
 *                          lane), two red.global.add.f32 before
 */
#ifndef RA_SMEM_FRAG_CUH
#define RA_SMEM_FRAG_CUH

#include "mma.cuh"

namespace ra {

#ifdef RA_CUDA_EMULATED
typedef uintptr_t saddr_t;
__device__ __forceinline__ saddr_t saddr(const void *p) { return (uintptr_t)p; }
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], saddr_t a) {
    ra_emu_ldmatrix(r, (const void *)a, 4, 0);
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], saddr_t a) {
    ra_emu_ldmatrix(r, (const void *)a, 4, 1);
}
#else
typedef uint32_t saddr_t;
__device__ __forceinline__ saddr_t saddr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], saddr_t a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], saddr_t a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
#endif

/* threadIdx.x read where it is used: the compiler cannot hoist what is
 * derived from it out of a loop (under register pressure it hoists such
 * loop-invariant offsets and then spills them; recomputing a few integer
 * operations per tile costs less than a local-memory round trip). */
__device__ __forceinline__ int tid_x() {
#ifdef RA_CUDA_EMULATED
    return (int)threadIdx.x;
#else
    int t;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
    return t;
#endif
}

/* A lane's offset in swizzled tiles of COLS 16-bit columns (see the top). */
template <int COLS>
struct LaneOff {
    static constexpr int kRowBytes = COLS * 2;
    uint32_t off;

    __device__ __forceinline__ static LaneOff make(int lrow, int hi) {
        return LaneOff{(uint32_t)(lrow * kRowBytes) | (uint32_t)((hi ^ (lrow & 7)) << 4)};
    }
    __device__ __forceinline__ static LaneOff a(int lane) { return make(lane % 16, lane / 16); }
    __device__ __forceinline__ static LaneOff nk(int lane) {
        return make(lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
    }
    __device__ __forceinline__ static LaneOff kn(int lane) {
        return make(lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
    }
    /* byte offset of this lane's row of the 16 x 16 block at (row0, col0):
     * row0 a multiple of 8, col0 of 16 */
    __device__ __forceinline__ uint32_t at(int row0, int col0) const {
        return (uint32_t)(row0 * kRowBytes) + (off ^ (uint32_t)((col0 / 8) << 4));
    }
};

/* The addresses one lane needs for every block of one operand: the
 * lane's row of block (row_base + row_imm, 8 (c_base + c_imm)) of the tile
 * at `tile` is x[(c_imm & 7) / 2] + row_imm * row bytes + (c_imm & 8) * 16,
 * for any c_imm (even) whose bits are disjoint from c_base's (then chunk
 * c_base + c_imm = c_base ^ c_imm, the XOR with the lane's bits lands in
 * x, and a c_imm bit 3 is a plain +128 bytes because c_base and x < 8 leave
 * it clear).  At most four registers per operand (the c_imm & 7 an operand
 * uses), the rest immediates ptxas folds into the LDSM; shift() moves them
 * all (a double-buffered tile's other stage). */
template <int COLS>
struct FragAddr {
    saddr_t x[4];

    __device__ __forceinline__ static FragAddr make(saddr_t tile, LaneOff<COLS> lo, int row_base,
                                                    int c_base) {
        FragAddr f;
        const saddr_t base = tile + (saddr_t)(row_base * LaneOff<COLS>::kRowBytes);
        const uint32_t o = lo.off ^ (uint32_t)(c_base << 4);
#pragma unroll
        for (int k = 0; k < 4; k++) f.x[k] = base + (saddr_t)(o ^ (uint32_t)(k << 5));
        return f;
    }
    __device__ __forceinline__ saddr_t at(int row_imm, int col_imm) const {
        const int c = col_imm / 8;
        return x[(c & 7) / 2] + (saddr_t)(row_imm * LaneOff<COLS>::kRowBytes + (c & 8) * 16);
    }
    __device__ __forceinline__ void shift(int bytes) {
#pragma unroll
        for (int k = 0; k < 4; k++) x[k] += (saddr_t)(intptr_t)bytes;
    }
};

/* cp.async rows row0 .. row0 + ROWS - 1 of a (seq, D) matrix `g` (row
 * stride ld elements; rows >= limit zero-filled) into a swizzled tile at
 * `smem` (mma.cuh swz), THREADS threads: thread `tid` copies chunk
 * tid % (D / 8) of every (THREADS / (D / 8))-th row from tid / (D / 8), a
 * multiple of 8 rows apart, so its swizzled offset is one value plus
 * immediates (pass tid_x() inside a loop). */
template <typename T, int D, int ROWS, int THREADS>
__device__ __forceinline__ void cp_async_rows(unsigned char *smem, const T *g, int64_t ld,
                                              int64_t row0, int64_t limit, int tid) {
    constexpr int kC = D / 8, kStep = THREADS / kC;
    static_assert(kStep % 8 == 0 && ROWS % kStep == 0, "rows split evenly, 8-row aligned");
    const int c = tid % kC, r0 = tid / kC;
    unsigned char *dst = smem + r0 * D * 2 + ((c ^ (r0 & 7)) << 4);
    const int64_t row = row0 + r0;
    const T *src = g + row * ld + c * 8;  // then a 64-bit add per copy, not a multiply
    const int64_t step = kStep * ld;
#pragma unroll
    for (int it = 0; it < ROWS / kStep; it++) {
        const bool ok = row + it * kStep < limit;
        cp_async16(dst + it * kStep * D * 2, ok ? src + it * step : g, ok);
    }
}

__device__ __forceinline__ void red_add_f32x2(float *dst, float x, float y) {
#if defined(RA_CUDA_EMULATED)
    atomicAdd(dst, x);
    atomicAdd(dst + 1, y);
#elif __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(x), "f"(y)
                 : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(dst), "f"(x) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(dst + 1), "f"(y) : "memory");
#endif
}

}  // namespace ra

#endif /* RA_SMEM_FRAG_CUH */
