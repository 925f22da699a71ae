/*
 * ffi_ids.c -- the handler of ringattn_ids_check: the run-time half of the
 * range check of segment ids of a type wider than int32 (int64 and uint64
 * with jax_enable_x64, uint32), which the kernels read as int32.
 *
 *   operand 0: the ids cast to int32 (..., B, S), any leading dims
 *   operand 1: report (..., 4) int32: [values outside int32 on every device
 *              of the call's ring (on this one alone outside a ring), on
 *              this device, and the batch and row of its first]
 *   result 0:  operand 0 (aliased; copied if XLA gives another buffer)
 *   attribute `which`: 0 segment_ids, 1 kv_segment_ids (for the message)
 *
 * Inside jax.jit the ids are not known when the call is traced, so the JAX
 * side (ringattn/jax_ffi.py) counts the values outside int32 in the program
 * and this handler refuses to pass the cast ids on when any exist: ids 0
 * and 2**32 never become one document.  In a ring every device's count is
 * summed first, so every device stops here, none waiting in a collective.
 * On CUDA the report is read on the host (a copy on XLA's stream, waited
 * for): 64-bit ids cost one such wait per call.
 */
#include <string.h>

#include "xla/ffi_device.h"
#include "xla/ffi_handlers.h"

ra_status ra_xla_ids_check(ra_xla_call *c) {
    static const char *names[2] = {"segment_ids", "kv_segment_ids"};
    int64_t which = 0;
    int present = 0;
    RA_CHECK(ra_xla_attr_int(c, "which", &which, &present));
    const char *name = names[which == 1];
    ra_xla_tensor ids, report, out;
    RA_CHECK(ra_xla_arg(c, 0, name, 2, &ids));
    RA_CHECK(ra_xla_arg(c, 1, "report", 1, &report));
    RA_CHECK(ra_xla_ret(c, 0, name, 2, &out));
    int64_t n = 1, rows = 1;
    int ok = ids.ffi_dtype == RA_FFI_S32 && out.ffi_dtype == RA_FFI_S32 &&
             report.ffi_dtype == RA_FFI_S32 && ra_xla_dim(&report, 0) == 4 &&
             ids.lead == out.lead && report.lead == ids.lead;
    for (int i = 0; ok && i < ids.lead + ids.core; i++) {
        ok = ids.dims[i] == out.dims[i];
        n *= ids.dims[i];
    }
    for (int i = 0; ok && i < report.lead; i++) {
        ok = report.dims[i] == ids.dims[i];
        rows *= report.dims[i];
    }
    if (!ok) {
        ra_set_error(RA_ERR_VALUE,
                     "%s: expected int32 ids, an int32 report (..., 4) and an "
                     "int32 result of the ids' shape",
                     name);
        return RA_ERR_VALUE;
    }
    const size_t bytes = (size_t)rows * 4 * sizeof(int32_t);
    int32_t *r = (int32_t *)ra_host_alloc(bytes);
    if (r == NULL) return RA_ERR_NOMEM;
    ra_status st = ra_xla_to_host(c, r, report.data, bytes);
    for (int64_t i = 0; st == RA_OK && i < rows; i++) {
        const int32_t *x = r + 4 * i;
        if (x[0] == 0) continue;
        if (x[1] > 0)
            ra_set_error(RA_ERR_VALUE,
                         "%s: expected ids that fit in int32, got %d outside "
                         "it (the first at [%d, %d])",
                         name, (int)x[1], (int)x[2], (int)x[3]);
        else
            ra_set_error(RA_ERR_VALUE,
                         "%s: expected ids that fit in int32, got %d outside "
                         "it on another device of the ring",
                         name, (int)x[0]);
        st = RA_ERR_VALUE;
    }
    ra_host_free(r, bytes);
    if (st == RA_OK)
        st = ra_xla_copy(c, out.data, ids.data, (size_t)n * sizeof(int32_t));
    return st;
}
