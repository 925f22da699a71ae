/*
 * ffi_device.c -- the kernels and small memory operations of the XLA
 * handlers, on the CPU or on the CUDA stream of the call (ffi_device.h).
 *
 * CUDA work goes on XLA's stream only, into XLA's buffers: nothing here
 * allocates device memory or touches ringattn's compute stream, so XLA's
 * own ordering of the stream covers every read and write.  The device that
 * owns the output is made current around each operation and the caller's
 * restored afterwards (the launchers do the same for kernels).
 */
#include "xla/ffi_device.h"

#include <math.h>
#include <string.h>

#include "attn/attn_cpu.h"

#ifdef RA_WITH_CUDA
#include <cuda_runtime.h>
#include "attn_cuda.h"
#include "core/cuda_rt.h"

#define XLA_CUDA_CHECK(call)                                                  \
    do {                                                                      \
        cudaError_t ra_xe_ = (call);                                          \
        if (ra_xe_ != cudaSuccess)                                            \
            return ra_cuda_status((int)ra_xe_, #call, __FILE__, __LINE__);    \
    } while (0)

/* Make the device owning `ptr` current; *prev keeps the caller's. */
static ra_status enter_device_of(const void *ptr, int *dev, int *prev) {
    struct cudaPointerAttributes attr;
    XLA_CUDA_CHECK(cudaPointerGetAttributes(&attr, ptr));
    XLA_CUDA_CHECK(cudaGetDevice(prev));
    *dev = attr.device;
    if (*dev >= 0 && *dev != *prev) XLA_CUDA_CHECK(cudaSetDevice(*dev));
    return RA_OK;
}

/* Restore the caller's device; st: the operation's status, which a
 * failure to restore never hides (and which never hides that failure). */
static ra_status leave_device(int dev, int prev, ra_status st) {
    if (dev < 0 || dev == prev) return st;
    cudaError_t e = cudaSetDevice(prev);
    if (st != RA_OK || e == cudaSuccess) return st;
    return ra_cuda_status((int)e, "cudaSetDevice (restoring the caller's device)",
                          __FILE__, __LINE__);
}
#endif

#ifndef RA_WITH_CUDA
static ra_status no_cuda(void) {
    ra_set_error(RA_ERR_UNSUPPORTED,
                 "ringattn was built without CUDA: no CUDA handlers");
    return RA_ERR_UNSUPPORTED;
}
#endif

static int on_cuda(const ra_xla_call *c) { return c->device_type == RA_DEV_CUDA; }

ra_status ra_xla_run_fwd(const ra_xla_call *c, const ra_attn_fwd_params *p) {
    if (!on_cuda(c)) return ra_cpu_attn_fwd(p);
#ifdef RA_WITH_CUDA
    return ra_cuda_attn_fwd(p, c->stream);
#else
    return no_cuda();
#endif
}

ra_status ra_xla_run_bwd_preprocess(const ra_xla_call *c,
                                    const ra_attn_bwd_params *p) {
    if (!on_cuda(c)) return ra_cpu_attn_bwd_preprocess(p);
#ifdef RA_WITH_CUDA
    return ra_cuda_attn_bwd_preprocess(p, c->stream);
#else
    return no_cuda();
#endif
}

ra_status ra_xla_run_bwd(const ra_xla_call *c, const ra_attn_bwd_params *p) {
    if (!on_cuda(c)) return ra_cpu_attn_bwd(p);
#ifdef RA_WITH_CUDA
    return ra_cuda_attn_bwd(p, c->stream);
#else
    return no_cuda();
#endif
}

ra_status ra_xla_run_merge(const ra_xla_call *c, const ra_merge_params *p) {
    if (!on_cuda(c)) return ra_cpu_merge(p);
#ifdef RA_WITH_CUDA
    return ra_cuda_merge(p, c->stream);
#else
    return no_cuda();
#endif
}

static ra_status dilated_cpu_only(void) {
    ra_set_error(RA_ERR_UNSUPPORTED,
                 "dilated attention runs on the CPU only for now");
    return RA_ERR_UNSUPPORTED;
}

ra_status ra_xla_run_dilated_fwd(const ra_xla_call *c,
                                 const ra_attn_fwd_params *p,
                                 const ra_dilated_config *cfg) {
    return on_cuda(c) ? dilated_cpu_only() : ra_cpu_dilated_fwd(p, cfg);
}

ra_status ra_xla_run_dilated_bwd(const ra_xla_call *c,
                                 const ra_attn_bwd_params *p,
                                 const ra_dilated_config *cfg) {
    return on_cuda(c) ? dilated_cpu_only() : ra_cpu_dilated_bwd(p, cfg);
}

ra_status ra_xla_fill_state(const ra_xla_call *c, void *out, void *lse,
                            ra_dtype acc, int64_t batch, int64_t seqlen,
                            int64_t heads, int64_t head_dim) {
    const int64_t rows = batch * seqlen * heads;
    if (rows == 0) return RA_OK;
    if (on_cuda(c)) {
#ifdef RA_WITH_CUDA
        /* (B, S, H, D) and (B, H, S), dense */
        return ra_cuda_fill_state(out, lse, acc, batch, seqlen, heads, head_dim,
                                  seqlen * heads * head_dim, heads * head_dim,
                                  head_dim, heads * seqlen, seqlen, 1,
                                  c->stream);
#else
        return no_cuda();
#endif
    }
    memset(out, 0, (size_t)(rows * head_dim) * ra_dtype_size(acc));
    for (int64_t i = 0; i < rows; i++) {
        if (acc == RA_FLOAT64)
            ((double *)lse)[i] = -INFINITY;
        else
            ((float *)lse)[i] = -INFINITY;
    }
    return RA_OK;
}

ra_status ra_xla_zero(const ra_xla_call *c, void *ptr, size_t nbytes) {
    if (nbytes == 0) return RA_OK;
    if (!on_cuda(c)) {
        memset(ptr, 0, nbytes);
        return RA_OK;
    }
#ifdef RA_WITH_CUDA
    int dev = -1, prev = -1;
    RA_CHECK(enter_device_of(ptr, &dev, &prev));
    cudaError_t e = cudaMemsetAsync(ptr, 0, nbytes, (cudaStream_t)c->stream);
    return leave_device(dev, prev,
                        ra_cuda_status((int)e, "cudaMemsetAsync", __FILE__,
                                       __LINE__));
#else
    return no_cuda();
#endif
}

/* nbytes from src to dst: memmove on the CPU; on CUDA one cudaMemcpyAsync
 * on the call's stream, on the device that owns the device side, waited
 * for when to_host (the host side is then the caller's to free) */
static ra_status move_bytes(const ra_xla_call *c, void *dst, const void *src,
                            size_t nbytes, int to_host) {
    if (nbytes == 0 || dst == src) return RA_OK;
    if (!on_cuda(c)) {
        memmove(dst, src, nbytes);
        return RA_OK;
    }
#ifdef RA_WITH_CUDA
    int dev = -1, prev = -1;
    RA_CHECK(enter_device_of(to_host ? src : dst, &dev, &prev));
    cudaError_t e = cudaMemcpyAsync(
        dst, src, nbytes,
        to_host ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice,
        (cudaStream_t)c->stream);
    if (e == cudaSuccess && to_host)
        e = cudaStreamSynchronize((cudaStream_t)c->stream);
    return leave_device(dev, prev,
                        ra_cuda_status((int)e,
                                       to_host ? "cudaMemcpyAsync (to the host)"
                                               : "cudaMemcpyAsync",
                                       __FILE__, __LINE__));
#else
    return no_cuda();
#endif
}

ra_status ra_xla_copy(const ra_xla_call *c, void *dst, const void *src,
                      size_t nbytes) {
    return move_bytes(c, dst, src, nbytes, 0);
}

ra_status ra_xla_to_host(const ra_xla_call *c, void *dst, const void *src,
                         size_t nbytes) {
    return move_bytes(c, dst, src, nbytes, 1);
}

ra_status ra_xla_read_ints(const ra_xla_call *c, const void *src, int wide,
                           int64_t *dst, int64_t n) {
    const size_t es = wide ? 8 : 4, nbytes = (size_t)n * es;
    int64_t raw[64];
    if (n <= 0) return RA_OK;
    if (n > 64) {
        ra_set_error(RA_ERR_INTERNAL, "reading %lld integers, at most 64",
                     (long long)n);
        return RA_ERR_INTERNAL;
    }
    /* The positions of a ring block depend on the rank, a value XLA holds
     * on the device; the launch parameters need them on the host. */
    RA_CHECK(ra_xla_to_host(c, raw, src, nbytes));
    for (int64_t i = 0; i < n; i++)
        dst[i] = wide ? raw[i] : (int64_t)((const int32_t *)raw)[i];
    return RA_OK;
}
