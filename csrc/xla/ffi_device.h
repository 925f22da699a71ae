/*
 * ffi_device.h -- what a handler runs, on the platform of its call: the
 * CPU kernels on XLA's host buffers, or the CUDA launchers on XLA's device
 * buffers and the stream XLA gave the call (never ringattn's own stream or
 * memory pool).  Without CUDA in the build, the CUDA side reports
 * RA_ERR_UNSUPPORTED (its targets are then never registered anyway).
 */
#ifndef RA_XLA_FFI_DEVICE_H
#define RA_XLA_FFI_DEVICE_H

#include "attn/attn_params.h"
#include "xla/ffi_frame.h"

ra_status ra_xla_run_fwd(const ra_xla_call *c, const ra_attn_fwd_params *p);
ra_status ra_xla_run_bwd_preprocess(const ra_xla_call *c,
                                    const ra_attn_bwd_params *p);
ra_status ra_xla_run_bwd(const ra_xla_call *c, const ra_attn_bwd_params *p);
ra_status ra_xla_run_merge(const ra_xla_call *c, const ra_merge_params *p);
/* dilated kernels exist on the CPU only */
ra_status ra_xla_run_dilated_fwd(const ra_xla_call *c,
                                 const ra_attn_fwd_params *p,
                                 const ra_dilated_config *cfg);
ra_status ra_xla_run_dilated_bwd(const ra_xla_call *c,
                                 const ra_attn_bwd_params *p,
                                 const ra_dilated_config *cfg);

/* A dense running state (out, lse) of `rows` (b, s, h) rows of head_dim
 * values each := (0, -inf).  out: (B, S, H, D), lse: (B, H, S), acc dtype. */
ra_status ra_xla_fill_state(const ra_xla_call *c, void *out, void *lse,
                            ra_dtype acc, int64_t batch, int64_t seqlen,
                            int64_t heads, int64_t head_dim);
ra_status ra_xla_zero(const ra_xla_call *c, void *ptr, size_t nbytes);
ra_status ra_xla_copy(const ra_xla_call *c, void *dst, const void *src,
                      size_t nbytes);
/* nbytes of an operand into host memory: a plain copy on the CPU; on
 * CUDA a copy on the call's stream and a wait for it. */
ra_status ra_xla_to_host(const ra_xla_call *c, void *dst, const void *src,
                         size_t nbytes);
/* n integers of an operand (int64 if wide, else int32) into host memory as
 * int64 (on CUDA: a copy on the call's stream and a wait for it); n <= 64. */
ra_status ra_xla_read_ints(const ra_xla_call *c, const void *src, int wide,
                           int64_t *dst, int64_t n);

#endif /* RA_XLA_FFI_DEVICE_H */
