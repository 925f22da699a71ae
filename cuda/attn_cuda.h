/*
 * attn_cuda.h -- the C entry points of ringattn's attention kernels (the
 * .cu files under cuda/), the one cuda/ header that C code includes.
 * csrc/attn/ fills a params struct after every argument check and calls
 * these through ra_cuda_run (attn_args.c) when the inputs are CUDA buffers.
 * cuda/ may use csrc/core/ (status, the CUDA runtime, the copy params) and
 * csrc/attn/attn_params.h, nothing else of csrc/.  `stream` is a cudaStream_t
 * passed as void* (ringattn's compute stream, ra_cuda_compute_stream).
 * Every launcher picks its kernel (tensor-core or generic) from the params,
 * checks what the kernels need, launches asynchronously and returns RA_OK,
 * or a status with ra_set_error's message.  Each launcher makes the device
 * that owns its output (or q) current for the launch and restores the
 * caller's device afterwards; `stream` must belong to that device.
 */
#ifndef RA_ATTN_CUDA_H
#define RA_ATTN_CUDA_H

#include "core/ra_common.h"
#include "attn/attn_params.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out, lse = attention(q, k, v) (or merged into the running state when
 * p->accumulate).  cuda/attn_fwd.cu */
ra_status ra_cuda_attn_fwd(const ra_attn_fwd_params *p, void *stream);

/* delta = rowsum(dout * out) in the acc dtype, (B, H, S_q) with the lse
 * strides.  cuda/attn_bwd.cu */
ra_status ra_cuda_attn_bwd_preprocess(const ra_attn_bwd_params *p,
                                      void *stream);

/* dq, dk, dv from q, k, v, dout, the final lse and delta (run the
 * preprocess first).  p->deterministic = 1: the same bits on every run (no
 * atomics); 0: the fused tensor-core kernel where it applies, whose dq is
 * added up by float32 atomics (its non-accumulated dq takes a scratch from
 * ringattn's caching pool, only on ringattn's compute stream; elsewhere the
 * deterministic kernels run).  cuda/attn_bwd.cu */
ra_status ra_cuda_attn_bwd(const ra_attn_bwd_params *p, void *stream);

/* LongNet dilated attention (positions strides 1, no masks): the forward
 * as ra_cuda_attn_fwd, the backward as ra_cuda_attn_bwd (delta computed
 * first), composed of the dense kernels.  cuda/attn_dilated.cu */
ra_status ra_cuda_dilated_fwd(const ra_attn_fwd_params *p,
                              const ra_dilated_config *cfg, void *stream);
ra_status ra_cuda_dilated_bwd(const ra_attn_bwd_params *p,
                              const ra_dilated_config *cfg, void *stream);

/* out, lse = LSE merge of (out1, lse1) and (out2, lse2).  cuda/merge.cu */
ra_status ra_cuda_merge(const ra_merge_params *p, void *stream);

/* Initialise a running forward state: out (acc dtype, BSHD strides) = 0 and
 * lse (acc dtype, (B, H, S) strides) = -inf.  cuda/merge.cu */
ra_status ra_cuda_fill_state(void *out, void *lse, ra_dtype acc_dtype,
                             int64_t batch, int64_t seqlen, int64_t heads,
                             int64_t head_dim, int64_t out_batch_stride,
                             int64_t out_seq_stride, int64_t out_head_stride,
                             int64_t lse_batch_stride, int64_t lse_head_stride,
                             int64_t lse_seq_stride, void *stream);

/* The tensor-core kernel family the dispatchers use on `device` (-1: the
 * current one): "sm90a" (wgmma/TMA, compute capability 9.0 with a build
 * for sm_90a) or "sm80" (mma.sync; RINGATTN_CUDA_KERNELS=sm80 forces it).
 * cuda/attn_family.cu */
ra_status ra_cuda_kernel_family(int device, const char **name);
/* whether the build has the sm_90a kernels */
int ra_cuda_built_sm90a(void);
/* forward calls so far that ran the sm90a, sm80 and generic kernels */
void ra_cuda_fwd_kernel_counts(unsigned long long out[3]);
/* backward calls so far that ran the sm90a, sm80 and generic kernels */
void ra_cuda_bwd_kernel_counts(unsigned long long out[3]);

#ifdef __cplusplus
}
#endif
#endif /* RA_ATTN_CUDA_H */
