/*
 * device.h -- the CUDA kernel language on ringattn's emulated GPU (C++).
 *
 * Read through include/cuda_runtime.h by C++ code.  Kernels compiled by the
 * host compiler see the names nvcc gives them: __global__ and friends,
 * threadIdx / blockIdx / blockDim / gridDim, __syncthreads, __syncwarp, the
 * warp shuffles and votes, atomics, vector types, the fast-math intrinsics;
 * ra_emu::launch stands in for <<<...>>> (cuda/common.cuh's RA_LAUNCH).
 *
 * Everything that touches the emulator's own state is a call into simt.cpp,
 * which is not instrumented: kernel code is compiled with the thread
 * sanitizer's instrumentation and its hooks are the memory checker
 * (check.cpp), so an inline function here that read emulator memory would
 * be checked as if the kernel had read it.
 */
#ifndef RA_EMU_DEVICE_H
#define RA_EMU_DEVICE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ __attribute__((always_inline)) inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))
/* A static __shared__ variable of a kernel: one per OS thread running
 * blocks, which runs one block at a time, all of whose threads see it (the
 * checker treats it as shared memory).  `extern __shared__` (dynamic shared
 * memory) does not compile: kernels name it with ra::dynamic_smem(), as
 * cuda/common.cuh does on both builds. */
#define __shared__ static thread_local
#define __restrict__ __restrict
#define __CUDA_ARCH_EMULATED__ 900

/* ---- vector and index types ---------------------------------------------- */

struct uint3 { unsigned x, y, z; };
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

#define RA_EMU_VEC2(T, name, al)                                               \
    struct __attribute__((aligned(al))) name { T x, y; };                      \
    static inline name make_##name(T x, T y) { name v; v.x = x; v.y = y; return v; }
#define RA_EMU_VEC4(T, name, al)                                               \
    struct __attribute__((aligned(al))) name { T x, y, z, w; };                \
    static inline name make_##name(T x, T y, T z, T w) {                       \
        name v; v.x = x; v.y = y; v.z = z; v.w = w; return v;                  \
    }
RA_EMU_VEC2(float, float2, 8)
RA_EMU_VEC4(float, float4, 16)
RA_EMU_VEC2(double, double2, 16)
RA_EMU_VEC2(int, int2, 8)
RA_EMU_VEC4(int, int4, 16)
RA_EMU_VEC2(unsigned, uint2, 8)
RA_EMU_VEC4(unsigned, uint4, 16)
#undef RA_EMU_VEC2
#undef RA_EMU_VEC4

/* ---- the emulator's entry points (simt.cpp, ptx.cpp; not instrumented) --- */

extern "C" {
uint3 ra_emu_thread_idx(void) __attribute__((const));
uint3 ra_emu_block_idx(void) __attribute__((const));
dim3 ra_emu_block_dim(void) __attribute__((const));
dim3 ra_emu_grid_dim(void) __attribute__((const));
unsigned char *ra_emu_dynamic_smem(void) __attribute__((const));
unsigned ra_emu_cvta_shared(const void *p);
void ra_emu_syncthreads(void);
int ra_emu_syncthreads_count(int pred);
void ra_emu_syncwarp(unsigned mask);
unsigned ra_emu_activemask(void);
/* mode: 0 idx, 1 xor, 2 up, 3 down */
uint64_t ra_emu_shfl(unsigned mask, uint64_t value, int mode, int lane_arg, int width);
unsigned ra_emu_vote(unsigned mask, int pred, int mode); /* 0 any, 1 all, 2 ballot */
void ra_emu_threadfence(void);
void ra_emu_trap(void) __attribute__((noreturn));
/* atomics: op 0 add, 1 max, 2 min, 3 exch, 4 cas; kind 0 i32, 1 u32, 2 u64,
 * 3 f32, 4 f64 */
uint64_t ra_emu_atomic(void *p, int kind, int op, uint64_t value, uint64_t compare);
}

#define threadIdx (ra_emu_thread_idx())
#define blockIdx (ra_emu_block_idx())
#define blockDim (ra_emu_block_dim())
#define gridDim (ra_emu_grid_dim())
#define warpSize 32

static inline void __syncthreads(void) { ra_emu_syncthreads(); }
static inline int __syncthreads_count(int p) { return ra_emu_syncthreads_count(p); }
static inline int __syncthreads_or(int p) { return ra_emu_syncthreads_count(p) != 0; }
static inline int __syncthreads_and(int p) {
    return ra_emu_syncthreads_count(p) == (int)(blockDim.x * blockDim.y * blockDim.z);
}
static inline void __syncwarp(unsigned mask = 0xffffffffu) { ra_emu_syncwarp(mask); }
static inline unsigned __activemask(void) { return ra_emu_activemask(); }
static inline void __threadfence(void) { ra_emu_threadfence(); }
static inline void __threadfence_block(void) { ra_emu_threadfence(); }
static inline void __trap(void) { ra_emu_trap(); }
static inline unsigned __cvta_generic_to_shared(const void *p) { return ra_emu_cvta_shared(p); }

/* ---- warp shuffles and votes ---------------------------------------------- */

namespace ra_emu {
template <typename T> static inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                  "shuffle of a type wider than 8 bytes");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof(T));
    return u;
}
template <typename T> static inline T from_bits(uint64_t u) {
    T v;
    memcpy(&v, &u, sizeof(T));
    return v;
}
}  // namespace ra_emu

template <typename T>
static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return ra_emu::from_bits<T>(ra_emu_shfl(mask, ra_emu::to_bits(v), 0, src, width));
}
template <typename T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return ra_emu::from_bits<T>(ra_emu_shfl(mask, ra_emu::to_bits(v), 1, lane_mask, width));
}
template <typename T>
static inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return ra_emu::from_bits<T>(ra_emu_shfl(mask, ra_emu::to_bits(v), 2, (int)delta, width));
}
template <typename T>
static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return ra_emu::from_bits<T>(ra_emu_shfl(mask, ra_emu::to_bits(v), 3, (int)delta, width));
}
static inline int __any_sync(unsigned mask, int pred) { return (int)ra_emu_vote(mask, pred, 0); }
static inline int __all_sync(unsigned mask, int pred) { return (int)ra_emu_vote(mask, pred, 1); }
static inline unsigned __ballot_sync(unsigned mask, int pred) { return ra_emu_vote(mask, pred, 2); }

/* ---- atomics ------------------------------------------------------------------ */

static inline int atomicAdd(int *p, int v) {
    return (int)ra_emu_atomic(p, 0, 0, (uint64_t)(uint32_t)v, 0);
}
static inline unsigned atomicAdd(unsigned *p, unsigned v) {
    return (unsigned)ra_emu_atomic(p, 1, 0, v, 0);
}
static inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) {
    return (unsigned long long)ra_emu_atomic(p, 2, 0, v, 0);
}
static inline float atomicAdd(float *p, float v) {
    return ra_emu::from_bits<float>(ra_emu_atomic(p, 3, 0, ra_emu::to_bits(v), 0));
}
static inline double atomicAdd(double *p, double v) {
    return ra_emu::from_bits<double>(ra_emu_atomic(p, 4, 0, ra_emu::to_bits(v), 0));
}
static inline int atomicMax(int *p, int v) {
    return (int)ra_emu_atomic(p, 0, 1, (uint64_t)(uint32_t)v, 0);
}
static inline unsigned atomicMax(unsigned *p, unsigned v) {
    return (unsigned)ra_emu_atomic(p, 1, 1, v, 0);
}
static inline int atomicMin(int *p, int v) {
    return (int)ra_emu_atomic(p, 0, 2, (uint64_t)(uint32_t)v, 0);
}
static inline unsigned atomicMin(unsigned *p, unsigned v) {
    return (unsigned)ra_emu_atomic(p, 1, 2, v, 0);
}
static inline int atomicExch(int *p, int v) {
    return (int)ra_emu_atomic(p, 0, 3, (uint64_t)(uint32_t)v, 0);
}
static inline unsigned atomicExch(unsigned *p, unsigned v) {
    return (unsigned)ra_emu_atomic(p, 1, 3, v, 0);
}
static inline float atomicExch(float *p, float v) {
    return ra_emu::from_bits<float>(ra_emu_atomic(p, 3, 3, ra_emu::to_bits(v), 0));
}
static inline int atomicCAS(int *p, int cmp, int v) {
    return (int)ra_emu_atomic(p, 0, 4, (uint64_t)(uint32_t)v, (uint64_t)(uint32_t)cmp);
}
static inline unsigned atomicCAS(unsigned *p, unsigned cmp, unsigned v) {
    return (unsigned)ra_emu_atomic(p, 1, 4, v, cmp);
}
static inline unsigned long long atomicCAS(unsigned long long *p, unsigned long long cmp,
                                           unsigned long long v) {
    return (unsigned long long)ra_emu_atomic(p, 2, 4, v, cmp);
}

/* ---- integer and float intrinsics ------------------------------------------ */

static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static inline int __clzll(long long x) {
    return x == 0 ? 64 : __builtin_clzll((unsigned long long)x);
}
static inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; i++) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
static inline float __uint_as_float(unsigned u) { return ra_emu::from_bits<float>(u); }
static inline unsigned __float_as_uint(float f) { return (unsigned)ra_emu::to_bits(f); }
static inline float __int_as_float(int u) { return ra_emu::from_bits<float>((uint32_t)u); }
static inline int __float_as_int(float f) { return (int)(uint32_t)ra_emu::to_bits(f); }
static inline double __longlong_as_double(long long u) {
    return ra_emu::from_bits<double>((uint64_t)u);
}
static inline long long __double_as_longlong(double d) {
    return (long long)ra_emu::to_bits(d);
}
template <typename T> static inline T __ldg(const T *p) { return *p; }

/* The device's fast approximations: ex2.approx / lg2.approx based, within a
 * few ulp of the exact function (libm's float functions stand in).  The C
 * library declares some of these names itself, so they are macros for
 * ra_emu_* functions here. */
static inline float ra_emu_expf(float x) { return exp2f(x * 1.4426950408889634f); }
static inline float ra_emu_logf(float x) { return log2f(x) * 0.6931471805599453f; }
static inline float ra_emu_log2f(float x) { return log2f(x); }
static inline float ra_emu_exp10f(float x) { return exp2f(x * 3.3219280948873623f); }
static inline float ra_emu_powf(float x, float y) { return exp2f(y * log2f(x)); }
static inline float ra_emu_sinf(float x) { return sinf(x); }
static inline float ra_emu_cosf(float x) { return cosf(x); }
static inline float ra_emu_tanf(float x) { return tanf(x); }
#define __expf ra_emu_expf
#define __logf ra_emu_logf
#define __log2f ra_emu_log2f
#define __exp10f ra_emu_exp10f
#define __powf ra_emu_powf
#define __sinf ra_emu_sinf
#define __cosf ra_emu_cosf
#define __tanf ra_emu_tanf
static inline float __fdividef(float x, float y) { return x / y; }
static inline float __frcp_rn(float x) { return 1.0f / x; }
static inline float __fsqrt_rn(float x) { return sqrtf(x); }
static inline float __saturatef(float x) { return x != x ? 0.f : x < 0.f ? 0.f : x > 1.f ? 1.f : x; }
static inline float __fmul_rn(float x, float y) { return x * y; }
static inline float __fadd_rn(float x, float y) { return x + y; }
static inline float __fmaf_rn(float x, float y, float z) { return fmaf(x, y, z); }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }

/* the device's integer and float min/max overloads */
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
static inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline long min(long a, long b) { return a < b ? a : b; }
static inline long max(long a, long b) { return a > b ? a : b; }
static inline unsigned long long min(unsigned long long a, unsigned long long b) {
    return a < b ? a : b;
}
static inline unsigned long long max(unsigned long long a, unsigned long long b) {
    return a > b ? a : b;
}
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }

/* double -> float rounded toward zero */
static inline float __double2float_rz(double x) {
    float f = (float)x;
    if (x != x || isinf(x)) return f;
    if (isinf(f)) return x > 0 ? 3.4028234663852886e38f : -3.4028234663852886e38f;
    if (fabs((double)f) > fabs(x)) f = nextafterf(f, 0.0f);
    return f;
}
static inline float __double2float_rn(double x) { return (float)x; }
static inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
static inline int __float2int_rz(float x) { return (int)x; }
static inline int __float2int_rd(float x) { return (int)floorf(x); }
static inline int __float2int_ru(float x) { return (int)ceilf(x); }

/* ---- launch ----------------------------------------------------------------- */

extern "C" cudaError_t raEmuLaunchKernel(const void *func, const char *name,
                                         const char *site, unsigned gx, unsigned gy,
                                         unsigned gz, unsigned bx, unsigned by,
                                         unsigned bz, size_t smem, cudaStream_t stream,
                                         void (*thunk)(void *), void *args,
                                         void (*free_args)(void *));

namespace ra_emu {

/* The kernel and its arguments, copied at the launch as a call would
 * convert them; thunk calls the kernel on a fiber's stack (so the kernel's
 * parameters live there, as a GPU thread's do in its own space). */
template <typename... P>
struct Pack {
    void (*kernel)(P...);
    std::tuple<typename std::decay<P>::type...> args;
};

template <typename... P>
__attribute__((no_sanitize("thread"))) void run_pack(void *p) {
    /* Kernel arguments are trivially copyable (as CUDA requires): copy the
     * pack onto this thread's stack with memcpy (not instrumented), so that
     * the kernel's argument reads are reads of the thread's own memory. */
    static_assert((std::is_trivially_copyable<typename std::decay<P>::type>::value && ...),
                  "kernel arguments must be trivially copyable");
    alignas(Pack<P...>) unsigned char local[sizeof(Pack<P...>)];
    memcpy(local, p, sizeof local);
    Pack<P...> *pk = reinterpret_cast<Pack<P...> *>(local);
    std::apply(pk->kernel, pk->args);
}
template <typename... P>
__attribute__((no_sanitize("thread"))) void free_pack(void *p) {
    delete static_cast<Pack<P...> *>(p);
}

template <typename... P>
struct Launcher {
    void (*kernel)(P...);
    const char *name, *site;
    dim3 grid, block;
    size_t smem;
    cudaStream_t stream;

    template <typename... A>
    __attribute__((no_sanitize("thread"))) cudaError_t operator()(A &&...a) const {
        static_assert(sizeof...(A) == sizeof...(P), "kernel launched with the wrong number of arguments");
        Pack<P...> *pk = new Pack<P...>{kernel, std::tuple<typename std::decay<P>::type...>(
                                                    std::forward<A>(a)...)};
        return raEmuLaunchKernel((const void *)kernel, name, site, grid.x, grid.y, grid.z,
                                 block.x, block.y, block.z, smem, stream, &run_pack<P...>, pk,
                                 &free_pack<P...>);
    }
};

template <typename... P>
static inline Launcher<P...> launch(void (*kernel)(P...), const char *name, const char *site,
                                    dim3 grid, dim3 block, size_t smem = 0,
                                    cudaStream_t stream = 0) {
    return Launcher<P...>{kernel, name, site, grid, block, smem, stream};
}

}  // namespace ra_emu

#define RA_EMU_STR2(x) #x
#define RA_EMU_STR(x) RA_EMU_STR2(x)
#define RA_EMU_LAUNCH(kernel, grid, block, smem, stream)                          \
    ra_emu::launch(kernel, #kernel, __FILE__ ":" RA_EMU_STR(__LINE__), grid, block, smem, stream)

#endif /* RA_EMU_DEVICE_H */
