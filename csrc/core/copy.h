/*
 * copy.h -- strided n-d copy with dtype conversion (float types only; on
 * the host also elements of one other type copied as they are).  Used
 * to make inputs contiguous, to cast accumulators to the output dtype and to
 * stage ring blocks; with `accumulate`, dst += src (float types), which
 * sums the gradients of kv heads that Ulysses replicated.  CPU version in
 * copy_cpu.c, CUDA in cuda/copy.cu.
 */
#ifndef RA_COPY_H
#define RA_COPY_H

#include "core/ra_common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RA_COPY_MAX_NDIM 8

typedef struct ra_copy_params {
    int ndim;
    int64_t shape[RA_COPY_MAX_NDIM];
    const void *src;
    int64_t src_strides[RA_COPY_MAX_NDIM];   /* elements */
    ra_dtype src_dtype;
    void *dst;
    int64_t dst_strides[RA_COPY_MAX_NDIM];   /* elements */
    ra_dtype dst_dtype;
    /* RA_DTYPE_OTHER on both sides (integer ids, say): the bytes of one
     * element, copied unchanged; the host copy only */
    size_t other_elsize;
    int num_threads;
    /* dst = dst + src instead of dst = src (float dtypes; the sum in
     * float32, or float64 when either side is float64) */
    int accumulate;
} ra_copy_params;

ra_status ra_cpu_copy(const ra_copy_params *p);
#ifdef RA_WITH_CUDA
/* The same on a CUDA device, queued on `stream` (a cudaStream_t) of the
 * current device.  cuda/copy.cu */
ra_status ra_cuda_copy(const ra_copy_params *p, void *stream);
#endif
/* float <-> half/bfloat16 scalar conversions (round to nearest even) */
float ra_half_to_float(uint16_t h);
uint16_t ra_float_to_half(float f);
float ra_bf16_to_float(uint16_t h);
uint16_t ra_float_to_bf16(float f);

#ifdef __cplusplus
}
#endif
#endif /* RA_COPY_H */
