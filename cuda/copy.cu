/*
 * copy.cu -- strided n-d copy with a float dtype cast (ra_copy_params).
 *
 * dst[idx] = cast(src[idx]) for every index idx of `shape` (ndim <= 8), or
 * with p.accumulate dst[idx] = cast(dst[idx] + src[idx]) (float32 sum, or
 * float64 when a side is float64, as on the host),
 * element strides on both sides (any sign, any order).  Conversions go
 * through double, so float32/float64 are exact and float16/bfloat16 round
 * to nearest even.  src and dst must not overlap.
 *
 * Launch: 256 threads per block, one thread per element, grid-stride over
 * the row-major linear index; the index is decomposed innermost-first.
 */
#include "core/copy.h"
#include "common.cuh"

namespace {

template <typename S, typename D>
__global__ void copy_kernel(ra_copy_params p, int64_t total) {
    const S *src = (const S *)p.src;
    D *dst = (D *)p.dst;
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t lin = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
         lin < total; lin += step) {
        int64_t rem = lin, so = 0, dof = 0;
        for (int k = p.ndim - 1; k >= 0; k--) {
            const int64_t c = rem % p.shape[k];
            rem /= p.shape[k];
            so += c * p.src_strides[k];
            dof += c * p.dst_strides[k];
        }
        double v = (double)ra::to_acc(src[so]);
        if (p.accumulate) {
            v += (double)ra::to_acc(dst[dof]);
            if (sizeof(S) < 8 && sizeof(D) < 8) v = (double)(float)v;
        }
        dst[dof] = ra::from_acc<D>(v);
    }
}

template <typename S>
ra_status launch_to(const ra_copy_params *p, int64_t total, cudaStream_t s) {
    int64_t blocks = (total + 255) / 256;
    if (blocks > 65536) blocks = 65536;
    switch (p->dst_dtype) {
    case RA_FLOAT32: RA_LAUNCH((copy_kernel<S, float>), (unsigned)blocks, 256, 0, s)(*p, total); break;
    case RA_FLOAT64: RA_LAUNCH((copy_kernel<S, double>), (unsigned)blocks, 256, 0, s)(*p, total); break;
    case RA_FLOAT16: RA_LAUNCH((copy_kernel<S, ra::half_t>), (unsigned)blocks, 256, 0, s)(*p, total); break;
    case RA_BFLOAT16: RA_LAUNCH((copy_kernel<S, ra::bf16_t>), (unsigned)blocks, 256, 0, s)(*p, total); break;
    default:
        ra_set_error(RA_ERR_TYPE, "copy: unsupported destination dtype %s",
                     ra_dtype_name(p->dst_dtype));
        return RA_ERR_TYPE;
    }
    RA_CUDA_CHECK_LAUNCH("copy_kernel");
    return RA_OK;
}

}  // namespace

extern "C" ra_status ra_cuda_copy(const ra_copy_params *p, void *stream) {
    if (p->ndim < 0 || p->ndim > RA_COPY_MAX_NDIM) {
        ra_set_error(RA_ERR_VALUE, "copy: ndim %d outside [0, %d]", p->ndim,
                     RA_COPY_MAX_NDIM);
        return RA_ERR_VALUE;
    }
    int64_t total = 1;
    for (int k = 0; k < p->ndim; k++) {
        if (p->shape[k] < 0 || !ra_mul_ok(total, p->shape[k], &total)) {
            ra_set_error(RA_ERR_OVERFLOW, "copy: bad or overflowing shape");
            return RA_ERR_OVERFLOW;
        }
    }
    if (total == 0) return RA_OK;
    cudaStream_t s = (cudaStream_t)stream;
    RaDeviceGuard guard;
    RA_CHECK(guard.enter_for(p->dst));
    switch (p->src_dtype) {
    case RA_FLOAT32: return launch_to<float>(p, total, s);
    case RA_FLOAT64: return launch_to<double>(p, total, s);
    case RA_FLOAT16: return launch_to<ra::half_t>(p, total, s);
    case RA_BFLOAT16: return launch_to<ra::bf16_t>(p, total, s);
    default:
        ra_set_error(RA_ERR_TYPE, "copy: unsupported source dtype %s",
                     ra_dtype_name(p->src_dtype));
        return RA_ERR_TYPE;
    }
}
