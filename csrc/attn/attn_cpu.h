/*
 * attn_cpu.h -- CPU attention kernels (blocked, flash-style; OpenMP threads;
 * SIMD chosen at run time).  All are safe to call without the GIL.  They
 * take scratch memory from ra_host_alloc so memory_stats() counts it.
 */
#ifndef RA_ATTN_CPU_H
#define RA_ATTN_CPU_H

#include "attn/attn_params.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out, lse = attention(q, k, v), or merged into the running state when
 * p->accumulate. */
ra_status ra_cpu_attn_fwd(const ra_attn_fwd_params *p);

/* delta[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d]  (acc dtype) */
ra_status ra_cpu_attn_bwd_preprocess(const ra_attn_bwd_params *p);

/* dq, dk, dv from q, k, v, dout, lse, delta (out is not read here). */
ra_status ra_cpu_attn_bwd(const ra_attn_bwd_params *p);

/* LSE merge of two partial results. */
ra_status ra_cpu_merge(const ra_merge_params *p);

/* Dilated attention (local): q, k, v with S_q == S_k, positions 0..S-1
 * (q_pos_* and k_pos_* give the global positions of the rows when used over the
 * ring).  Same params as the dense kernels; the config selects the sparsity. */
ra_status ra_cpu_dilated_fwd(const ra_attn_fwd_params *p,
                             const ra_dilated_config *cfg);
ra_status ra_cpu_dilated_bwd(const ra_attn_bwd_params *p,
                             const ra_dilated_config *cfg);

/* Name of the SIMD level the dispatcher chose ("avx512", "avx2", "generic"). */
const char *ra_cpu_simd_level(void);

#ifdef __cplusplus
}
#endif
#endif /* RA_ATTN_CPU_H */
