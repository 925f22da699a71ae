/*
 * ptx_sm90.cuh -- the Hopper (sm_90a) building blocks of ringattn's
 * wgmma/TMA kernels, as thin wrappers over PTX (the real build) or calls
 * of the emulated GPU (RINGATTN_CUDA=emulate: csrc/emu/ptx_sm90.h), so one
 * kernel source serves both, as cuda/mma.cuh does for the mma.sync kernels:
 *
 *   smem_u32, make_desc      a shared-window address; a wgmma shared-memory
 *                            matrix descriptor (start, LBO, SBO, swizzle)
 *   wgmma_fence / commit / wait<N>, fence_operand
 *   wgmma_ss<N, T, TA, TB>   D(64 x N, f32) (+)= A(64 x 16) B(16 x N), A and
 *                            B from descriptors (TA/TB: M-/N-major)
 *   wgmma_rs<N, T, TB>       the same with A from registers
 *   mbar_*                   mbarrier init / arrive / expect_tx / waits
 *   tma_load_{1..5}d, tma_store_{1..5}d, tma_store_commit / wait<N>,
 *   bulk_load                cp.async.bulk(.tensor) with an mbarrier /
 *                            bulk groups
 *   fence_proxy_async, named_bar_sync / named_bar_arrive,
 *   setmaxnreg_inc / dec<N>, elect_sync / elect_one, stmatrix_x{1,2,4}{_trans}
 *
 * N is any multiple of 8 in 8..256; T is ra::half_t or ra::bf16_t.  The
 * register and shared-memory layouts are the PTX ISA's (csrc/emu/
 * ptx_wgmma.cpp spells them out; tests/emu/test_hopper.cpp checks them;
 * tools/ptx_conformance.cu compares the emulator with a real GPU).
 *
 * Asynchrony rules the kernels follow (the emulated GPU's checker reports
 * each break, except a missing fence after the first): wgmma_fence() before
 * the first wgmma and after any write of registers a wgmma uses; an accumulator (and A-fragment registers) is not
 * touched between its wgmma and the wgmma_wait<> that retires its group,
 * after which fence_operand(acc) keeps the compiler from moving accesses
 * across the wait; shared operands are not written before that wait; a
 * generic write read by wgmma or a bulk store needs fence_proxy_async()
 * between; a bulk load's destination is read only after a wait on its
 * mbarrier phase.
 *
 * Outside the emulator the asm needs sm_90a (__CUDA_ARCH_FEAT_SM90_ALL); on
 * any other device architecture the wrappers trap, so a file that includes
 * this header still compiles for every architecture of a build.
 */
#ifndef RA_HOPPER_PTX_SM90_CUH
#define RA_HOPPER_PTX_SM90_CUH

#include <cuda.h>   /* CUtensorMap (types only: nothing links libcuda) */

#include <type_traits>

#include "common.cuh"

#ifdef RA_CUDA_EMULATED
#include "emu/ptx_sm90.h"   /* the same operations on the emulated GPU (csrc/emu) */
#elif defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define RA_SM90_ASM 1
#endif

#if defined(RA_CUDA_EMULATED) || defined(RA_SM90_ASM)
#define RA_SM90_ONLY(asm_body) asm_body
#else
#define RA_SM90_ONLY(asm_body) __trap()
#endif

namespace ra {
namespace sm90 {

/* ---- addresses and matrix descriptors --------------------------------------- */

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* The descriptor's swizzle field (bits 62-63). */
enum Swizzle : uint32_t { SWIZZLE_NONE = 0, SWIZZLE_128B = 1, SWIZZLE_64B = 2, SWIZZLE_32B = 3 };

/* A shared-memory matrix descriptor for `tile`: leading-dimension and
 * stride-dimension byte offsets (multiples of 16), swizzle mode, base
 * offset 0 (swizzled tiles start on the pattern's boundary: 1024 bytes
 * for 128B, 512 for 64B, 256 for 32B). */
__device__ __forceinline__ uint64_t make_desc(const void *tile, uint32_t lbo, uint32_t sbo,
                                              Swizzle swizzle) {
    const uint32_t a = smem_u32(tile);
    return (uint64_t)((a & 0x3ffff) >> 4) | (uint64_t)((lbo & 0x3ffff) >> 4) << 16 |
           (uint64_t)((sbo & 0x3ffff) >> 4) << 32 | (uint64_t)swizzle << 62;
}

/* ---- wgmma ----------------------------------------------------------------------- */

__device__ __forceinline__ void wgmma_fence() {
#ifdef RA_CUDA_EMULATED
    ra_emu_wgmma_fence();
#else
    RA_SM90_ONLY(asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"));
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef RA_CUDA_EMULATED
    ra_emu_wgmma_commit();
#else
    RA_SM90_ONLY(asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"));
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    static_assert(N >= 0 && N <= 7, "wgmma.wait_group takes 0..7");
#ifdef RA_CUDA_EMULATED
    ra_emu_wgmma_wait(N);
#else
    RA_SM90_ONLY(asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"));
#endif
}
/* after a wgmma_wait<>: the accumulator's registers are not read or
 * written across the wait by the compiler */
template <int R>
__device__ __forceinline__ void fence_operand(float (&d)[R]) {
#ifndef RA_CUDA_EMULATED
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
#else
    (void)d;
#endif
}
/* the same for A-fragment registers (wgmma_rs), rows of 4 */
template <int R>
__device__ __forceinline__ void fence_operand(uint32_t (&a)[R][4]) {
#ifndef RA_CUDA_EMULATED
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) asm volatile("" : "+r"(a[i][j])::"memory");
#else
    (void)a;
#endif
}

#ifdef RA_SM90_ASM
/* The asm of wgmma.mma_async.m64n<N>k16.f32 for every N: accumulators are
 * operands %0..%(N/2 - 1); after them the descriptors (or the B descriptor
 * and the four A registers) and the scale-d predicate's source. */
#define RA_WGR_1 "%0, %1, %2, %3"
#define RA_WGR_2 RA_WGR_1 ", %4, %5, %6, %7"
#define RA_WGR_3 RA_WGR_2 ", %8, %9, %10, %11"
#define RA_WGR_4 RA_WGR_3 ", %12, %13, %14, %15"
#define RA_WGR_5 RA_WGR_4 ", %16, %17, %18, %19"
#define RA_WGR_6 RA_WGR_5 ", %20, %21, %22, %23"
#define RA_WGR_7 RA_WGR_6 ", %24, %25, %26, %27"
#define RA_WGR_8 RA_WGR_7 ", %28, %29, %30, %31"
#define RA_WGR_9 RA_WGR_8 ", %32, %33, %34, %35"
#define RA_WGR_10 RA_WGR_9 ", %36, %37, %38, %39"
#define RA_WGR_11 RA_WGR_10 ", %40, %41, %42, %43"
#define RA_WGR_12 RA_WGR_11 ", %44, %45, %46, %47"
#define RA_WGR_13 RA_WGR_12 ", %48, %49, %50, %51"
#define RA_WGR_14 RA_WGR_13 ", %52, %53, %54, %55"
#define RA_WGR_15 RA_WGR_14 ", %56, %57, %58, %59"
#define RA_WGR_16 RA_WGR_15 ", %60, %61, %62, %63"
#define RA_WGR_17 RA_WGR_16 ", %64, %65, %66, %67"
#define RA_WGR_18 RA_WGR_17 ", %68, %69, %70, %71"
#define RA_WGR_19 RA_WGR_18 ", %72, %73, %74, %75"
#define RA_WGR_20 RA_WGR_19 ", %76, %77, %78, %79"
#define RA_WGR_21 RA_WGR_20 ", %80, %81, %82, %83"
#define RA_WGR_22 RA_WGR_21 ", %84, %85, %86, %87"
#define RA_WGR_23 RA_WGR_22 ", %88, %89, %90, %91"
#define RA_WGR_24 RA_WGR_23 ", %92, %93, %94, %95"
#define RA_WGR_25 RA_WGR_24 ", %96, %97, %98, %99"
#define RA_WGR_26 RA_WGR_25 ", %100, %101, %102, %103"
#define RA_WGR_27 RA_WGR_26 ", %104, %105, %106, %107"
#define RA_WGR_28 RA_WGR_27 ", %108, %109, %110, %111"
#define RA_WGR_29 RA_WGR_28 ", %112, %113, %114, %115"
#define RA_WGR_30 RA_WGR_29 ", %116, %117, %118, %119"
#define RA_WGR_31 RA_WGR_30 ", %120, %121, %122, %123"
#define RA_WGR_32 RA_WGR_31 ", %124, %125, %126, %127"
#define RA_WGF_1(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
#define RA_WGF_2(d) RA_WGF_1(d), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define RA_WGF_3(d) RA_WGF_2(d), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
#define RA_WGF_4(d) RA_WGF_3(d), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define RA_WGF_5(d) RA_WGF_4(d), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19])
#define RA_WGF_6(d) RA_WGF_5(d), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
#define RA_WGF_7(d) RA_WGF_6(d), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27])
#define RA_WGF_8(d) RA_WGF_7(d), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define RA_WGF_9(d) RA_WGF_8(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35])
#define RA_WGF_10(d) RA_WGF_9(d), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
#define RA_WGF_11(d) RA_WGF_10(d), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43])
#define RA_WGF_12(d) RA_WGF_11(d), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
#define RA_WGF_13(d) RA_WGF_12(d), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51])
#define RA_WGF_14(d) RA_WGF_13(d), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55])
#define RA_WGF_15(d) RA_WGF_14(d), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59])
#define RA_WGF_16(d) RA_WGF_15(d), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define RA_WGF_17(d) RA_WGF_16(d), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67])
#define RA_WGF_18(d) RA_WGF_17(d), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71])
#define RA_WGF_19(d) RA_WGF_18(d), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75])
#define RA_WGF_20(d) RA_WGF_19(d), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
#define RA_WGF_21(d) RA_WGF_20(d), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83])
#define RA_WGF_22(d) RA_WGF_21(d), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
#define RA_WGF_23(d) RA_WGF_22(d), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91])
#define RA_WGF_24(d) RA_WGF_23(d), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
#define RA_WGF_25(d) RA_WGF_24(d), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99])
#define RA_WGF_26(d) RA_WGF_25(d), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103])
#define RA_WGF_27(d) RA_WGF_26(d), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107])
#define RA_WGF_28(d) RA_WGF_27(d), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111])
#define RA_WGF_29(d) RA_WGF_28(d), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115])
#define RA_WGF_30(d) RA_WGF_29(d), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119])
#define RA_WGF_31(d) RA_WGF_30(d), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123])
#define RA_WGF_32(d) RA_WGF_31(d), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

#define RA_WG_SS(N, K4, PA, PB, PS, TY, TA, TB)                                          \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #PS ", 0;\n"                       \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TY "." #TY " {"      \
                 RA_WGR_##K4 "}, %" #PA ", %" #PB ", p, 1, 1, " #TA ", " #TB ";\n}\n"    \
                 : RA_WGF_##K4(d) : "l"(da), "l"(db), "r"(sc))
#define RA_WG_RS(N, K4, PB, PS, P0, P1, P2, P3, TY, TB)                                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #PS ", 0;\n"                       \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TY "." #TY " {"      \
                 RA_WGR_##K4 "}, {%" #P0 ", %" #P1 ", %" #P2 ", %" #P3 "}, %" #PB        \
                 ", p, 1, 1, " #TB ";\n}\n"                                              \
                 : RA_WGF_##K4(d) : "l"(db), "r"(sc), "r"(a[0]), "r"(a[1]), "r"(a[2]),   \
                   "r"(a[3]))

template <int N> struct WgmmaAsm;
#define RA_WGMMA_N(N, K4, Q0, Q1, Q2, Q3, Q4, Q5)                                       \
    template <> struct WgmmaAsm<N> {                                                     \
        template <bool BF16, int TA, int TB>                                             \
        __device__ __forceinline__ static void ss(float *d, uint64_t da, uint64_t db,    \
                                                  uint32_t sc) {                         \
            if constexpr (!BF16 && !TA && !TB) RA_WG_SS(N, K4, Q0, Q1, Q2, f16, 0, 0);   \
            else if constexpr (!BF16 && !TA && TB) RA_WG_SS(N, K4, Q0, Q1, Q2, f16, 0, 1); \
            else if constexpr (!BF16 && TA && !TB) RA_WG_SS(N, K4, Q0, Q1, Q2, f16, 1, 0); \
            else if constexpr (!BF16 && TA && TB) RA_WG_SS(N, K4, Q0, Q1, Q2, f16, 1, 1); \
            else if constexpr (!TA && !TB) RA_WG_SS(N, K4, Q0, Q1, Q2, bf16, 0, 0);      \
            else if constexpr (!TA && TB) RA_WG_SS(N, K4, Q0, Q1, Q2, bf16, 0, 1);       \
            else if constexpr (TA && !TB) RA_WG_SS(N, K4, Q0, Q1, Q2, bf16, 1, 0);       \
            else RA_WG_SS(N, K4, Q0, Q1, Q2, bf16, 1, 1);                                 \
        }                                                                                \
        template <bool BF16, int TB>                                                     \
        __device__ __forceinline__ static void rs(float *d, const uint32_t *a,           \
                                                  uint64_t db, uint32_t sc) {            \
            if constexpr (!BF16 && !TB) RA_WG_RS(N, K4, Q0, Q1, Q2, Q3, Q4, Q5, f16, 0); \
            else if constexpr (!BF16) RA_WG_RS(N, K4, Q0, Q1, Q2, Q3, Q4, Q5, f16, 1);   \
            else if constexpr (!TB) RA_WG_RS(N, K4, Q0, Q1, Q2, Q3, Q4, Q5, bf16, 0);    \
            else RA_WG_RS(N, K4, Q0, Q1, Q2, Q3, Q4, Q5, bf16, 1);                        \
        }                                                                                \
    };
RA_WGMMA_N(8, 1, 4, 5, 6, 7, 8, 9)
RA_WGMMA_N(16, 2, 8, 9, 10, 11, 12, 13)
RA_WGMMA_N(24, 3, 12, 13, 14, 15, 16, 17)
RA_WGMMA_N(32, 4, 16, 17, 18, 19, 20, 21)
RA_WGMMA_N(40, 5, 20, 21, 22, 23, 24, 25)
RA_WGMMA_N(48, 6, 24, 25, 26, 27, 28, 29)
RA_WGMMA_N(56, 7, 28, 29, 30, 31, 32, 33)
RA_WGMMA_N(64, 8, 32, 33, 34, 35, 36, 37)
RA_WGMMA_N(72, 9, 36, 37, 38, 39, 40, 41)
RA_WGMMA_N(80, 10, 40, 41, 42, 43, 44, 45)
RA_WGMMA_N(88, 11, 44, 45, 46, 47, 48, 49)
RA_WGMMA_N(96, 12, 48, 49, 50, 51, 52, 53)
RA_WGMMA_N(104, 13, 52, 53, 54, 55, 56, 57)
RA_WGMMA_N(112, 14, 56, 57, 58, 59, 60, 61)
RA_WGMMA_N(120, 15, 60, 61, 62, 63, 64, 65)
RA_WGMMA_N(128, 16, 64, 65, 66, 67, 68, 69)
RA_WGMMA_N(136, 17, 68, 69, 70, 71, 72, 73)
RA_WGMMA_N(144, 18, 72, 73, 74, 75, 76, 77)
RA_WGMMA_N(152, 19, 76, 77, 78, 79, 80, 81)
RA_WGMMA_N(160, 20, 80, 81, 82, 83, 84, 85)
RA_WGMMA_N(168, 21, 84, 85, 86, 87, 88, 89)
RA_WGMMA_N(176, 22, 88, 89, 90, 91, 92, 93)
RA_WGMMA_N(184, 23, 92, 93, 94, 95, 96, 97)
RA_WGMMA_N(192, 24, 96, 97, 98, 99, 100, 101)
RA_WGMMA_N(200, 25, 100, 101, 102, 103, 104, 105)
RA_WGMMA_N(208, 26, 104, 105, 106, 107, 108, 109)
RA_WGMMA_N(216, 27, 108, 109, 110, 111, 112, 113)
RA_WGMMA_N(224, 28, 112, 113, 114, 115, 116, 117)
RA_WGMMA_N(232, 29, 116, 117, 118, 119, 120, 121)
RA_WGMMA_N(240, 30, 120, 121, 122, 123, 124, 125)
RA_WGMMA_N(248, 31, 124, 125, 126, 127, 128, 129)
RA_WGMMA_N(256, 32, 128, 129, 130, 131, 132, 133)
#undef RA_WGMMA_N
#endif /* RA_SM90_ASM */

template <typename T>
struct IsBf16 {
    static_assert(std::is_same<T, half_t>::value || std::is_same<T, bf16_t>::value,
                  "wgmma inputs are half_t or bf16_t");
    static constexpr bool value = std::is_same<T, bf16_t>::value;
};

/* d (N/2 floats per thread) = A B (+ d when accumulate); A from the
 * descriptor da (TA 1: M-major), B from db (TB 1: N-major). */
template <int N, typename T, int TA = 0, int TB = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t da, uint64_t db,
                                         bool accumulate) {
    static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma N: a multiple of 8 in 8..256");
#ifdef RA_CUDA_EMULATED
    ra_emu_wgmma(d, N, nullptr, da, db, IsBf16<T>::value, accumulate, 1, 1, TA, TB);
#else
    RA_SM90_ONLY((WgmmaAsm<N>::template ss<IsBf16<T>::value, TA, TB>(d, da, db, accumulate)));
#endif
}
/* the same with A from registers (the mma.m16n8k16 A fragment of rows
 * 16w..16w+15 in warp w of the warpgroup) */
template <int N, typename T, int TB = 0>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4],
                                         uint64_t db, bool accumulate) {
    static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma N: a multiple of 8 in 8..256");
#ifdef RA_CUDA_EMULATED
    ra_emu_wgmma(d, N, a, 0, db, IsBf16<T>::value, accumulate, 1, 1, 0, TB);
#else
    RA_SM90_ONLY((WgmmaAsm<N>::template rs<IsBf16<T>::value, TB>(d, a, db, accumulate)));
#endif
}

/* ---- mbarriers --------------------------------------------------------------------- */

__device__ __forceinline__ void mbar_init(uint64_t *bar, unsigned count) {
#ifdef RA_CUDA_EMULATED
    ra_emu_mbar_init(bar, count);
#else
    RA_SM90_ONLY(asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)),
                              "r"(count) : "memory"));
#endif
}
/* makes the inits visible (to the async proxy too); a __syncthreads or
 * barrier must still follow before other threads use the barriers */
__device__ __forceinline__ void mbar_init_fence() {
#ifndef RA_CUDA_EMULATED
    RA_SM90_ONLY(asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"));
#endif
}
__device__ __forceinline__ void mbar_inval(uint64_t *bar) {
#ifdef RA_CUDA_EMULATED
    ra_emu_mbar_inval(bar);
#else
    RA_SM90_ONLY(asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar))
                              : "memory"));
#endif
}
__device__ __forceinline__ uint64_t mbar_arrive(uint64_t *bar) {
    uint64_t state = 0;
#ifdef RA_CUDA_EMULATED
    state = ra_emu_mbar_arrive(bar, 1, 0);
#else
    RA_SM90_ONLY(asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];\n"
                              : "=l"(state) : "r"(smem_u32(bar)) : "memory"));
#endif
    return state;
}
/* arrive and add `bytes` to the phase's expected transaction bytes */
__device__ __forceinline__ uint64_t mbar_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
    uint64_t state = 0;
#ifdef RA_CUDA_EMULATED
    state = ra_emu_mbar_arrive(bar, 1, bytes);
#else
    RA_SM90_ONLY(asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;\n"
                              : "=l"(state) : "r"(smem_u32(bar)), "r"(bytes) : "memory"));
#endif
    return state;
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, uint32_t bytes) {
#ifdef RA_CUDA_EMULATED
    ra_emu_mbar_expect_tx(bar, bytes);
#else
    RA_SM90_ONLY(asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n"
                              ::"r"(smem_u32(bar)), "r"(bytes) : "memory"));
#endif
}
/* whether the phase of `parity` has completed (the current phase when its
 * parity is `parity`, else the one before); try_wait may wait a while */
__device__ __forceinline__ bool mbar_try_wait(uint64_t *bar, uint32_t parity) {
    uint32_t done = 0;
#ifdef RA_CUDA_EMULATED
    done = (uint32_t)ra_emu_mbar_wait(bar, parity, 0);
#else
    RA_SM90_ONLY(asm volatile("{\n.reg .pred p;\n"
                              "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                              "selp.u32 %0, 1, 0, p;\n}\n"
                              : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory"));
#endif
    return done != 0;
}
__device__ __forceinline__ bool mbar_test_wait(uint64_t *bar, uint32_t parity) {
    uint32_t done = 0;
#ifdef RA_CUDA_EMULATED
    done = (uint32_t)ra_emu_mbar_wait(bar, parity, 1);
#else
    RA_SM90_ONLY(asm volatile("{\n.reg .pred p;\n"
                              "mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                              "selp.u32 %0, 1, 0, p;\n}\n"
                              : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory"));
#endif
    return done != 0;
}
/* wait until the phase of `parity` has completed */
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}

/* ---- bulk copies (TMA) --------------------------------------------------------------- */

#ifdef RA_CUDA_EMULATED
#define RA_TMA_LOAD(rank, ...)                                                           \
    do {                                                                                 \
        const int32_t c_[rank] = {__VA_ARGS__};                                          \
        ra_emu_tma_load(dst, map, c_, rank, bar);                                        \
    } while (0)
#define RA_TMA_STORE(rank, ...)                                                          \
    do {                                                                                 \
        const int32_t c_[rank] = {__VA_ARGS__};                                          \
        ra_emu_tma_store(map, c_, rank, src);                                            \
    } while (0)
#endif

/* a box of `map` at coordinates (c0, ...) into dst (128-byte aligned),
 * completing `bar`'s transaction bytes */
__device__ __forceinline__ void tma_load_1d(void *dst, const CUtensorMap *map, uint64_t *bar,
                                            int c0) {
#ifdef RA_CUDA_EMULATED
    RA_TMA_LOAD(1, c0);
#else
    RA_SM90_ONLY(asm volatile(
        "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3}], [%2];\n" ::"r"(smem_u32(dst)), "l"(map), "r"(smem_u32(bar)),
        "r"(c0) : "memory"));
#endif
}
__device__ __forceinline__ void tma_load_2d(void *dst, const CUtensorMap *map, uint64_t *bar,
                                            int c0, int c1) {
#ifdef RA_CUDA_EMULATED
    RA_TMA_LOAD(2, c0, c1);
#else
    RA_SM90_ONLY(asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(smem_u32(dst)), "l"(map), "r"(smem_u32(bar)),
        "r"(c0), "r"(c1) : "memory"));
#endif
}
__device__ __forceinline__ void tma_load_3d(void *dst, const CUtensorMap *map, uint64_t *bar,
                                            int c0, int c1, int c2) {
#ifdef RA_CUDA_EMULATED
    RA_TMA_LOAD(3, c0, c1, c2);
#else
    RA_SM90_ONLY(asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(smem_u32(dst)), "l"(map),
        "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2) : "memory"));
#endif
}
__device__ __forceinline__ void tma_load_4d(void *dst, const CUtensorMap *map, uint64_t *bar,
                                            int c0, int c1, int c2, int c3) {
#ifdef RA_CUDA_EMULATED
    RA_TMA_LOAD(4, c0, c1, c2, c3);
#else
    RA_SM90_ONLY(asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem_u32(dst)), "l"(map),
        "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory"));
#endif
}
__device__ __forceinline__ void tma_load_5d(void *dst, const CUtensorMap *map, uint64_t *bar,
                                            int c0, int c1, int c2, int c3, int c4) {
#ifdef RA_CUDA_EMULATED
    RA_TMA_LOAD(5, c0, c1, c2, c3, c4);
#else
    RA_SM90_ONLY(asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n" ::"r"(smem_u32(dst)), "l"(map),
        "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4) : "memory"));
#endif
}

/* the box at (c0, ...) of `map` from src (128-byte aligned; generic writes
 * of it need fence_proxy_async() first), in the thread's current bulk group */
__device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, const void *src, int c0,
                                             int c1) {
#ifdef RA_CUDA_EMULATED
    RA_TMA_STORE(2, c0, c1);
#else
    RA_SM90_ONLY(asm volatile(
        "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n"
        ::"l"(map), "r"(smem_u32(src)), "r"(c0), "r"(c1) : "memory"));
#endif
}
__device__ __forceinline__ void tma_store_3d(const CUtensorMap *map, const void *src, int c0,
                                             int c1, int c2) {
#ifdef RA_CUDA_EMULATED
    RA_TMA_STORE(3, c0, c1, c2);
#else
    RA_SM90_ONLY(asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n"
        ::"l"(map), "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2) : "memory"));
#endif
}
__device__ __forceinline__ void tma_store_4d(const CUtensorMap *map, const void *src, int c0,
                                             int c1, int c2, int c3) {
#ifdef RA_CUDA_EMULATED
    RA_TMA_STORE(4, c0, c1, c2, c3);
#else
    RA_SM90_ONLY(asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
        ::"l"(map), "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory"));
#endif
}
__device__ __forceinline__ void tma_store_1d(const CUtensorMap *map, const void *src, int c0) {
#ifdef RA_CUDA_EMULATED
    RA_TMA_STORE(1, c0);
#else
    RA_SM90_ONLY(asm volatile("cp.async.bulk.tensor.1d.global.shared::cta.bulk_group [%0, {%2}], [%1];\n"
                              ::"l"(map), "r"(smem_u32(src)), "r"(c0) : "memory"));
#endif
}
__device__ __forceinline__ void tma_store_5d(const CUtensorMap *map, const void *src, int c0,
                                             int c1, int c2, int c3, int c4) {
#ifdef RA_CUDA_EMULATED
    RA_TMA_STORE(5, c0, c1, c2, c3, c4);
#else
    RA_SM90_ONLY(asm volatile(
        "cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];\n"
        ::"l"(map), "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4) : "memory"));
#endif
}
__device__ __forceinline__ void tma_store_commit() {
#ifdef RA_CUDA_EMULATED
    ra_emu_bulk_commit();
#else
    RA_SM90_ONLY(asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"));
#endif
}
/* every bulk group but the newest N has read its shared source */
template <int N>
__device__ __forceinline__ void tma_store_wait_read() {
#ifdef RA_CUDA_EMULATED
    ra_emu_bulk_wait(N, 1);
#else
    RA_SM90_ONLY(asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"));
#endif
}
/* ... and written global memory */
template <int N>
__device__ __forceinline__ void tma_store_wait() {
#ifdef RA_CUDA_EMULATED
    ra_emu_bulk_wait(N, 0);
#else
    RA_SM90_ONLY(asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"));
#endif
}
/* `bytes` (a multiple of 16) from global src to shared dst, both 16-byte
 * aligned, completing `bar`'s transaction bytes */
__device__ __forceinline__ void bulk_load(void *dst, const void *src, uint32_t bytes,
                                          uint64_t *bar) {
#ifdef RA_CUDA_EMULATED
    ra_emu_bulk_load(dst, src, bytes, bar);
#else
    RA_SM90_ONLY(asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
        ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory"));
#endif
}
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap *map) {
#ifdef RA_CUDA_EMULATED
    (void)map;
#else
    RA_SM90_ONLY(asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory"));
#endif
}

/* ---- fences, barriers, registers, election, stmatrix ------------------------------------ */

/* order this thread's generic shared-memory writes before later reads by
 * the async proxy (wgmma operands, bulk stores) */
__device__ __forceinline__ void fence_proxy_async() {
#ifdef RA_CUDA_EMULATED
    ra_emu_fence_proxy_async();
#else
    RA_SM90_ONLY(asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"));
#endif
}
/* named barrier `id` (1..15) of `count` threads (a multiple of 32) */
__device__ __forceinline__ void named_bar_sync(uint32_t id, uint32_t count) {
#ifdef RA_CUDA_EMULATED
    ra_emu_named_barrier(id, count, 0);
#else
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void named_bar_arrive(uint32_t id, uint32_t count) {
#ifdef RA_CUDA_EMULATED
    ra_emu_named_barrier(id, count, 1);
#else
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
#endif
}
/* the warpgroup's per-thread register count (a multiple of 8 in 24..256),
 * every thread of the warpgroup with the same N */
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg: a multiple of 8 in 24..256");
#ifdef RA_CUDA_EMULATED
    ra_emu_setmaxnreg(N, 1);
#else
    RA_SM90_ONLY(asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)));
#endif
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg: a multiple of 8 in 24..256");
#ifdef RA_CUDA_EMULATED
    ra_emu_setmaxnreg(N, 0);
#else
    RA_SM90_ONLY(asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)));
#endif
}
/* elect.sync over the lanes of `mask` (every one of them must call it):
 * whether this lane leads; *lane: the leader */
__device__ __forceinline__ bool elect_sync(uint32_t mask, uint32_t *lane = nullptr) {
    uint32_t leader = 0, is = 0;
#ifdef RA_CUDA_EMULATED
    int me = 0;
    leader = ra_emu_elect(mask, &me);
    is = (uint32_t)me;
#else
    RA_SM90_ONLY(asm volatile("{\n.reg .pred p;\nelect.sync %0|p, %2;\nselp.u32 %1, 1, 0, p;\n}\n"
                              : "=r"(leader), "=r"(is) : "r"(mask)));
#endif
    if (lane != nullptr) *lane = leader;
    return is != 0;
}
__device__ __forceinline__ bool elect_one(uint32_t *lane = nullptr) {
    return elect_sync(0xffffffffu, lane);
}

/* stmatrix: lane 8i + j gives the address of row j of matrix i (16-byte
 * aligned); register i holds, of matrix i, row lane/4, columns
 * 2(lane%4) and 2(lane%4)+1 (the transpose with _trans) */
#ifdef RA_CUDA_EMULATED
#define RA_STMATRIX(num, trans) ra_emu_stmatrix(row, r, num, trans)
#else
#define RA_STMATRIX_ASM(shape, regs, ...)                                               \
    RA_SM90_ONLY(asm volatile("stmatrix.sync.aligned.m8n8." shape ".shared.b16 [%0], {" regs \
                              "};\n" ::"r"(smem_u32(row)), __VA_ARGS__ : "memory"))
#endif
__device__ __forceinline__ void stmatrix_x1(void *row, const uint32_t (&r)[1]) {
#ifdef RA_CUDA_EMULATED
    RA_STMATRIX(1, 0);
#else
    RA_STMATRIX_ASM("x1", "%1", "r"(r[0]));
#endif
}
__device__ __forceinline__ void stmatrix_x2(void *row, const uint32_t (&r)[2]) {
#ifdef RA_CUDA_EMULATED
    RA_STMATRIX(2, 0);
#else
    RA_STMATRIX_ASM("x2", "%1, %2", "r"(r[0]), "r"(r[1]));
#endif
}
__device__ __forceinline__ void stmatrix_x4(void *row, const uint32_t (&r)[4]) {
#ifdef RA_CUDA_EMULATED
    RA_STMATRIX(4, 0);
#else
    RA_STMATRIX_ASM("x4", "%1, %2, %3, %4", "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]));
#endif
}
__device__ __forceinline__ void stmatrix_x4_trans(void *row, const uint32_t (&r)[4]) {
#ifdef RA_CUDA_EMULATED
    RA_STMATRIX(4, 1);
#else
    RA_STMATRIX_ASM("x4.trans", "%1, %2, %3, %4", "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]));
#endif
}

}  // namespace sm90
}  // namespace ra

#endif /* RA_HOPPER_PTX_SM90_CUH */
