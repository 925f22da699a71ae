/*
 * common.cuh -- helpers shared by ringattn's CUDA kernels: checked CUDA
 * calls and launches, element conversions for the four float dtypes, and
 * the accumulator type of each (double for double, float otherwise).
 */
#ifndef RA_CUDA_COMMON_CUH
#define RA_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math_constants.h>
#include <stdint.h>

#include "core/cuda_rt.h"
#include "attn_cuda.h"

/* Return the mapped status of a failing CUDA call. */
#define RA_CUDA_CHECK(call)                                                   \
    do {                                                                      \
        cudaError_t ra_cu_e_ = (call);                                        \
        if (ra_cu_e_ != cudaSuccess)                                          \
            return ra_cuda_status((int)ra_cu_e_, #call, __FILE__, __LINE__);  \
    } while (0)

/* Launch `kernel` (a __global__ function; parenthesise a template id):
 *   RA_LAUNCH((my_kernel<T, D>), grid, block, smem, stream)(args...);
 * is kernel<<<grid, block, smem, stream>>>(args...) on nvcc, and on the
 * emulated GPU (RINGATTN_CUDA=emulate, csrc/emu) the launch template that
 * queues the same kernel on the emulated stream. */
#ifdef RA_CUDA_EMULATED
#define RA_LAUNCH(kernel, grid, block, smem, stream) RA_EMU_LAUNCH(kernel, grid, block, smem, stream)
#else
#define RA_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#endif

/* After a launch: report a bad configuration or a missing kernel image
 * (asynchronous faults surface at the next synchronising call). */
#define RA_CUDA_CHECK_LAUNCH(name)                                            \
    do {                                                                      \
        cudaError_t ra_cu_e_ = cudaGetLastError();                            \
        if (ra_cu_e_ != cudaSuccess)                                          \
            return ra_cuda_status((int)ra_cu_e_, "launch of " name,           \
                                  __FILE__, __LINE__);                        \
    } while (0)

namespace ra {

typedef __half half_t;
typedef __nv_bfloat16 bf16_t;

/* The block's dynamic shared memory (the launch's smem bytes), aligned to
 * 128 bytes: what an `extern __shared__` array names inside a kernel. */
#ifdef RA_CUDA_EMULATED
__device__ __forceinline__ unsigned char *dynamic_smem() { return ra_emu_dynamic_smem(); }
#else
extern __shared__ __align__(128) unsigned char dynamic_smem_[];
__device__ __forceinline__ unsigned char *dynamic_smem() { return dynamic_smem_; }
#endif

/* accumulator type */
template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

/* element -> accumulator */
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(half_t x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(bf16_t x) {
    return __bfloat162float(x);
}

/* accumulator -> element (round to nearest even) */
template <typename T> __device__ __forceinline__ T from_acc(double x);
template <> __device__ __forceinline__ float from_acc<float>(double x) {
    return (float)x;
}
template <> __device__ __forceinline__ double from_acc<double>(double x) {
    return x;
}
/* double -> float rounded to odd (truncate, set the lowest bit if anything
 * was cut off), so that rounding it to 16 bits rounds the double once */
__device__ __forceinline__ float round_to_odd(double x) {
    const float t = __double2float_rz(x);
    if (!((double)t != x) || x != x || isinf(t)) return t;
    return __uint_as_float(__float_as_uint(t) | 1u);
}
template <> __device__ __forceinline__ half_t from_acc<half_t>(double x) {
    return __float2half_rn(round_to_odd(x));
}
template <> __device__ __forceinline__ bf16_t from_acc<bf16_t>(double x) {
    return __float2bfloat16_rn(round_to_odd(x));
}
template <typename T> __device__ __forceinline__ T from_accf(float x);
template <> __device__ __forceinline__ float from_accf<float>(float x) {
    return x;
}
template <> __device__ __forceinline__ double from_accf<double>(float x) {
    return (double)x;
}
template <> __device__ __forceinline__ half_t from_accf<half_t>(float x) {
    return __float2half_rn(x);
}
template <> __device__ __forceinline__ bf16_t from_accf<bf16_t>(float x) {
    return __float2bfloat16_rn(x);
}

/* Load/store of an element whose dtype is only known at run time
 * (outputs that may be the input dtype or the accumulator dtype). */
__device__ __forceinline__ double load_dyn(const void *p, int64_t i,
                                           ra_dtype t) {
    switch (t) {
    case RA_FLOAT32: return (double)((const float *)p)[i];
    case RA_FLOAT64: return ((const double *)p)[i];
    case RA_FLOAT16: return (double)__half2float(((const half_t *)p)[i]);
    default: return (double)__bfloat162float(((const bf16_t *)p)[i]);
    }
}

__device__ __forceinline__ void store_dyn(void *p, int64_t i, ra_dtype t,
                                          double x) {
    switch (t) {
    case RA_FLOAT32: ((float *)p)[i] = (float)x; break;
    case RA_FLOAT64: ((double *)p)[i] = x; break;
    case RA_FLOAT16: ((half_t *)p)[i] = __float2half_rn((float)x); break;
    default: ((bf16_t *)p)[i] = __float2bfloat16_rn((float)x); break;
    }
}

/* An input dtype known only at run time, read into accumulator type A: the
 * masked generic kernels serve float32, float16 and bfloat16 with one
 * instantiation on Dyn<float> (one fewer set of kernels to compile). */
template <typename A> struct Dyn {};
template <typename A> struct Acc<Dyn<A>> { typedef A type; };

__device__ __forceinline__ float load_dyn_f(const void *p, int64_t i, ra_dtype t) {
    switch (t) {
    case RA_FLOAT32: return ((const float *)p)[i];
    case RA_FLOAT16: return __half2float(((const half_t *)p)[i]);
    default: return __bfloat162float(((const bf16_t *)p)[i]);
    }
}

/* The rows of one (b, h) of an input tensor of element type T: base +
 * b_off + h_off elements; x[i] is element i in the accumulator type.
 * For Dyn<float> the element type is the run-time dtype t. */
template <typename T> struct In {
    const T *p;
    __device__ __forceinline__ In(const void *base, int64_t b_off, int64_t h_off, ra_dtype)
        : p((const T *)base + b_off + h_off) {}
    __device__ __forceinline__ typename Acc<T>::type operator[](int64_t i) const {
        return to_acc(p[i]);
    }
};
template <> struct In<Dyn<float>> {
    const void *base;
    int64_t off;
    ra_dtype t;
    __device__ __forceinline__ In(const void *base_, int64_t b_off, int64_t h_off, ra_dtype t_)
        : base(base_), off(b_off + h_off), t(t_) {}
    __device__ __forceinline__ float operator[](int64_t i) const {
        return load_dyn_f(base, off + i, t);
    }
};

template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() {
    return -CUDART_INF_F;
}
template <> __device__ __forceinline__ double neg_inf<double>() {
    return -CUDART_INF;
}
template <typename A> __device__ __forceinline__ A nan_acc();
template <> __device__ __forceinline__ float nan_acc<float>() {
    return CUDART_NAN_F;
}
template <> __device__ __forceinline__ double nan_acc<double>() {
    return CUDART_NAN;
}

__device__ __forceinline__ float exp_acc(float x) { return __expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }

template <typename A>
__device__ __forceinline__ A warp_max(A x) {
    for (int o = 16; o > 0; o >>= 1) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
template <typename A>
__device__ __forceinline__ A warp_sum(A x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* Positions are affine, pos(i) = off + i * stride with stride >= 1, so they
 * increase along the sequence.  count_upto: how many of the n indices have
 * pos(i) <= pos (the keys a causal query at pos sees, ...); count_below:
 * how many have pos(i) < pos, i.e. the first index at or past pos.  pos
 * must be a position near the sequence (pos - off must not overflow);
 * count_upto_sat / count_below_sat (mask.cuh) take any int64. */
__host__ __device__ __forceinline__ int64_t count_upto(int64_t pos, int64_t off,
                                                       int64_t stride, int64_t n) {
    if (pos < off) return 0;
    const int64_t c = (pos - off) / stride + 1;
    return c < n ? c : n;
}
__host__ __device__ __forceinline__ int64_t count_below(int64_t pos, int64_t off,
                                                        int64_t stride, int64_t n) {
    if (pos <= off) return 0;
    const int64_t i = (pos - off + stride - 1) / stride;
    return i < n ? i : n;
}

/* The causal rule pos_k(j) <= pos_q(i) by index: the keys [0, end) query
 * q_last can see, and the first query that can see key k_first. */
__host__ __device__ __forceinline__ int64_t causal_key_end(
    int64_t q_last, int64_t q_pos_offset, int64_t q_pos_stride,
    int64_t k_pos_offset, int64_t k_pos_stride, int64_t seqlen_k) {
    return count_upto(q_pos_offset + q_last * q_pos_stride, k_pos_offset, k_pos_stride,
                      seqlen_k);
}
__host__ __device__ __forceinline__ int64_t causal_query_begin(
    int64_t k_first, int64_t q_pos_offset, int64_t q_pos_stride,
    int64_t k_pos_offset, int64_t k_pos_stride, int64_t seqlen_q) {
    return count_below(k_pos_offset + k_first * k_pos_stride, q_pos_offset, q_pos_stride,
                       seqlen_q);
}

/* Grid-stride loop of one warp per row of a (B, S, H, ...) tensor, row =
 * (b * S + s) * H + h: every lane of the warp that owns a row calls
 * body(b, s, h).  Blocks of whole warps; any grid size covers every row. */
template <typename F>
__device__ __forceinline__ void for_each_row_warp(int64_t batch, int64_t seqlen,
                                                  int64_t heads, F body) {
    const int64_t rows = batch * seqlen * heads;
    const int64_t warps_total = (int64_t)gridDim.x * (blockDim.x / 32);
    for (int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
         row < rows; row += warps_total) {
        const int64_t h = row % heads;
        const int64_t s = (row / heads) % seqlen;
        const int64_t b = row / (heads * seqlen);
        body(b, s, h);
    }
}

}  // namespace ra

/* Launch on the device that owns `ptr`: the launchers are called from C
 * with ringattn's stream of that device, which only accepts launches while
 * its device is current.  Restores the caller's device when it goes out of
 * scope (other libraries share the thread). */
class RaDeviceGuard {
  public:
    RaDeviceGuard() : prev_(-1), dev_(-1) {}
    ~RaDeviceGuard() {
        if (prev_ >= 0 && prev_ != dev_) (void)cudaSetDevice(prev_);
    }
    ra_status enter_for(const void *ptr) {
        if (ptr == nullptr) return RA_OK;  // an empty tensor: no device to find
        cudaPointerAttributes attr;
        RA_CUDA_CHECK(cudaPointerGetAttributes(&attr, ptr));
        if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
            return RA_OK;  // host memory: leave the current device alone
        RA_CUDA_CHECK(cudaGetDevice(&prev_));
        dev_ = attr.device;
        if (prev_ != dev_) RA_CUDA_CHECK(cudaSetDevice(dev_));
        return RA_OK;
    }

  private:
    int prev_, dev_;
};

/* The most dynamic shared memory a block of the current device may opt in
 * to (launchers pick a kernel that fits it). */
static inline ra_status ra_smem_optin(size_t *bytes) {
    int dev = 0, optin = 0;
    RA_CUDA_CHECK(cudaGetDevice(&dev));
    RA_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    *bytes = (size_t)optin;
    return RA_OK;
}

/* Grant a kernel more than 48 KiB of dynamic shared memory when it asks. */
template <typename K>
static inline ra_status ra_set_smem(K kernel, size_t smem) {
    if (smem > 48 * 1024) {
        size_t optin = 0;
        RA_CHECK(ra_smem_optin(&optin));
        if (optin < smem) {
            ra_set_error(RA_ERR_UNSUPPORTED,
                         "kernel needs %zu bytes of shared memory, device "
                         "allows %zu", smem, optin);
            return RA_ERR_UNSUPPORTED;
        }
        RA_CUDA_CHECK(cudaFuncSetAttribute(
            kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    }
    return RA_OK;
}

#endif /* RA_CUDA_COMMON_CUH */
