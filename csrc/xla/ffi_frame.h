/*
 * ffi_frame.h -- reading an XLA FFI call frame: the registration-time
 * metadata query, buffers (with the leading dims jax.vmap adds), named
 * attributes, and the one mapping of an ra_status to an FFI error.
 *
 * Everything here returns an ra_status and leaves a message naming the
 * argument with ra_set_error(); the handler turns that into an XLA error in
 * one place (ra_xla_finish).  Python-free: handlers run on XLA's threads.
 */
#ifndef RA_XLA_FFI_FRAME_H
#define RA_XLA_FFI_FRAME_H

#include "core/ra_common.h"
#include "xla/xla_ffi.h"

#define RA_XLA_MAX_LEAD 8     /* leading (vmap) dims a handler accepts */

/* One call: the frame, the platform it runs on and, on CUDA, XLA's stream. */
typedef struct ra_xla_call {
    ra_ffi_call_frame *frame;
    const char *op;             /* the target's name, for messages */
    int device_type;            /* RA_DEV_CPU or RA_DEV_CUDA */
    void *stream;               /* cudaStream_t of this execution (CUDA) */
    ra_ffi_error *xla_error;    /* an error an XLA API call returned: ours
                                   to hand back as the call's result */
} ra_xla_call;

/* A buffer argument or result.  `core` is the rank the operation works on
 * (4 for (B, S, H, D), 3 for (B, H, S), 2 for position tables); the
 * `lead` dims in front of it are vmap's batch dims. */
typedef struct ra_xla_tensor {
    const char *name;
    void *data;
    ra_dtype dtype;             /* RA_DTYPE_OTHER when not a float type */
    int ffi_dtype;
    int core, lead;
    const int64_t *dims;        /* lead + core entries */
} ra_xla_tensor;

/* The leading dims of a call: the results' (every input has each leading
 * dim either equal or 1, as jax.vmap's expand_dims method makes them).
 * `folded`: every float tensor has all of them, so they merge into the
 * batch dim and one kernel call covers the whole batch. */
typedef struct ra_xla_lead {
    int lead;
    int64_t shape[RA_XLA_MAX_LEAD];
    int64_t count;
    int folded;
} ra_xla_lead;

/* 1 if `frame` is XLA's metadata query (answered here: the caller returns
 * NULL), 0 for an execution. */
int ra_xla_metadata_query(ra_ffi_call_frame *frame);

/* Set up `c` for an execution: stage, argument/result counts, and on CUDA
 * the stream.  nargs_min..nargs_max arguments, nrets results. */
ra_status ra_xla_begin(ra_xla_call *c, ra_ffi_call_frame *frame,
                       const char *op, int device_type, int nargs_min,
                       int nargs_max, int nrets);

/* The handler's return value: NULL for RA_OK; else the error an XLA API
 * call gave us (c->xla_error, passed on as it is, never dropped), or a new
 * XLA error carrying "<target name>: " + ra_last_error().  A failed call is
 * never reported as a success: if XLA's API cannot make an error (no real
 * XLA does that), the message goes to stderr and the process aborts rather
 * than hand XLA unwritten results. */
ra_ffi_error *ra_xla_finish(const ra_xla_call *c, ra_status st);

/* Argument i / result i as a tensor of `core` dims (plus leading dims). */
ra_status ra_xla_arg(const ra_xla_call *c, int i, const char *name, int core,
                     ra_xla_tensor *t);
ra_status ra_xla_ret(const ra_xla_call *c, int i, const char *name, int core,
                     ra_xla_tensor *t);
/* Core dim j of t. */
static inline int64_t ra_xla_dim(const ra_xla_tensor *t, int j) {
    return t->dims[t->lead + j];
}
/* Elements of one leading index (the product of the core dims). */
int64_t ra_xla_core_numel(const ra_xla_tensor *t);
/* Check t's core dims against want[0..core-1] (doc names them). */
ra_status ra_xla_check_dims(const ra_xla_tensor *t, const int64_t *want,
                            const char *doc);
/* Check t has dtype `want` (why says where that comes from). */
ra_status ra_xla_check_dtype(const ra_xla_tensor *t, ra_dtype want,
                             const char *why);

/* The call's leading dims from its operands ins[0..nin) and results
 * rets[0..nret), checked before any work: every tensor has the same number
 * of them; each operand has each leading dim equal to the call's or 1
 * (vmap's expand_dims), and each result exactly the call's -- the kernels
 * write one value per leading index, so a result with a 1 there (or any
 * other size) would be written past or overwritten.  The call's dim is the
 * operands' size other than 1, else the results'. */
ra_status ra_xla_lead_plan(ra_xla_lead *l, const ra_xla_tensor *ins, int nin,
                           const ra_xla_tensor *rets, int nret);
/* One more operand t of the call (an optional one, read after the plan):
 * its leading dims are each the call's or 1; *full = 1 if all are the
 * call's (full may be NULL). */
ra_status ra_xla_lead_check(const ra_xla_lead *l, const ra_xla_tensor *t,
                            int *full);
/* Element offset of leading index `idx` (row-major over l->shape) in t. */
int64_t ra_xla_lead_offset(const ra_xla_lead *l, const ra_xla_tensor *t,
                           int64_t idx);
/* Address of leading index idx of t; whole = 1: the start of t (one call
 * covers every leading index). */
char *ra_xla_item(const ra_xla_lead *l, const ra_xla_tensor *t, int64_t idx,
                  int whole);
/* 1 if every leading dim of t is 1 (shared by the whole batch). */
int ra_xla_lead_shared(const ra_xla_tensor *t);

/* Attributes by name.  Absent: *present = 0 and the value is untouched. */
ra_status ra_xla_attr_int(const ra_xla_call *c, const char *name,
                          int64_t *value, int *present);
ra_status ra_xla_attr_f64(const ra_xla_call *c, const char *name,
                          double *value, int *present);
/* A 1-d int array attribute of at most `cap` values; *n its length. */
ra_status ra_xla_attr_ints(const ra_xla_call *c, const char *name,
                           int64_t *values, int cap, int *n);

#endif /* RA_XLA_FFI_FRAME_H */
