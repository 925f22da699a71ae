/*
 * ffi_handlers.h -- the bodies of ringattn's XLA FFI handlers, one per
 * custom-call target (ffi_fwd.c, ffi_bwd.c, ffi_ids.c).  Each reads its
 * call (set up
 * by ra_xla_begin), checks every operand, fills the kernel params and runs
 * the kernels on the call's platform.  ffi_targets.c wraps them into the
 * plain C handlers XLA calls, one per target and platform.
 */
#ifndef RA_XLA_FFI_HANDLERS_H
#define RA_XLA_FFI_HANDLERS_H

#include "xla/ffi_args.h"

ra_status ra_xla_attn_fwd(ra_xla_call *c);
ra_status ra_xla_attn_fwd_acc(ra_xla_call *c);
ra_status ra_xla_dilated_fwd(ra_xla_call *c);
ra_status ra_xla_merge(ra_xla_call *c);
ra_status ra_xla_bwd_preprocess(ra_xla_call *c);
ra_status ra_xla_attn_bwd(ra_xla_call *c);
ra_status ra_xla_attn_bwd_acc(ra_xla_call *c);
ra_status ra_xla_dilated_bwd(ra_xla_call *c);
/* the run-time range check of 64-bit (or uint32) segment ids (ffi_ids.c) */
ra_status ra_xla_ids_check(ra_xla_call *c);

/* segment_lengths / dilation_rates attributes, and S_q == S_k (ffi_fwd.c) */
ra_status ra_xla_read_dilated(const ra_xla_call *c, const ra_xla_qkv *d,
                              ra_dilated_config *cfg);

#endif /* RA_XLA_FFI_HANDLERS_H */
