/*
 * ffi_frame.c -- reading XLA FFI call frames (see ffi_frame.h).
 */
#include "xla/ffi_frame.h"

#include <stdio.h>
#include <string.h>

/* ---- the registration-time query ----------------------------------------- */

int ra_xla_metadata_query(ra_ffi_call_frame *frame) {
    ra_ffi_extension *ext = frame->extension_start;
    if (ext == NULL || ext->type != RA_FFI_EXTENSION_METADATA) return 0;
    ra_ffi_metadata_extension *me = (ra_ffi_metadata_extension *)ext;
    /* Too small a struct: leave the version 0.0, which XLA refuses with a
     * message naming both versions (there may be no API to make an error). */
    if (ext->struct_size < RA_FFI_STRUCT_SIZE(ra_ffi_metadata_extension,
                                              metadata) ||
        me->metadata == NULL ||
        me->metadata->struct_size < RA_FFI_STRUCT_SIZE(ra_ffi_metadata, traits))
        return 1;
    me->metadata->api_version.struct_size =
        RA_FFI_STRUCT_SIZE(ra_ffi_api_version, minor_version);
    me->metadata->api_version.extension_start = NULL;
    me->metadata->api_version.major_version = RA_FFI_API_MAJOR;
    me->metadata->api_version.minor_version = RA_FFI_API_MINOR;
    me->metadata->traits = 0;
    return 1;
}

/* ---- errors --------------------------------------------------------------- */

static int error_code(ra_status st) {
    switch (st) {
    case RA_ERR_VALUE:
    case RA_ERR_TYPE:
    case RA_ERR_OVERFLOW:
    case RA_ERR_BUFFER: return RA_FFI_ERR_INVALID_ARGUMENT;
    case RA_ERR_NOMEM: return RA_FFI_ERR_RESOURCE_EXHAUSTED;
    case RA_ERR_UNSUPPORTED: return RA_FFI_ERR_UNIMPLEMENTED;
    default: return RA_FFI_ERR_INTERNAL;
    }
}

ra_ffi_error *ra_xla_finish(const ra_xla_call *c, ra_status st) {
    if (st == RA_OK) return NULL;
    const ra_ffi_api *api = c->frame->api;
    if (api == NULL ||
        api->struct_size < RA_FFI_STRUCT_SIZE(ra_ffi_api, error_create) ||
        api->error_create == NULL)
        return NULL;  /* no way to report: cannot happen with a real XLA */
    char msg[1200];
    snprintf(msg, sizeof msg, "%s: %s", c->op, ra_last_error());
    ra_ffi_error_create_args a;
    memset(&a, 0, sizeof a);
    a.struct_size = RA_FFI_STRUCT_SIZE(ra_ffi_error_create_args, errc);
    a.message = msg;
    a.errc = error_code(st);
    return api->error_create(&a);
}

/* ---- setup ------------------------------------------------------------------ */

ra_status ra_xla_begin(ra_xla_call *c, ra_ffi_call_frame *frame,
                       const char *op, int device_type, int nargs_min,
                       int nargs_max, int nrets) {
    memset(c, 0, sizeof *c);
    c->frame = frame;
    c->op = op;
    c->device_type = device_type;
    if (frame->struct_size < RA_FFI_STRUCT_SIZE(ra_ffi_call_frame, attrs)) {
        ra_set_error(RA_ERR_INTERNAL,
                     "XLA passed a call frame of %zu bytes, expected at least "
                     "%zu (incompatible jaxlib)",
                     frame->struct_size,
                     RA_FFI_STRUCT_SIZE(ra_ffi_call_frame, attrs));
        return RA_ERR_INTERNAL;
    }
    if (frame->stage != RA_FFI_STAGE_EXECUTE) {
        ra_set_error(RA_ERR_INTERNAL, "called at execution stage %d, expected %d",
                     frame->stage, RA_FFI_STAGE_EXECUTE);
        return RA_ERR_INTERNAL;
    }
    if (frame->args.size < nargs_min || frame->args.size > nargs_max) {
        ra_set_error(RA_ERR_VALUE, "expected %d to %d operands, got %lld",
                     nargs_min, nargs_max, (long long)frame->args.size);
        return RA_ERR_VALUE;
    }
    if (frame->rets.size != nrets) {
        ra_set_error(RA_ERR_VALUE, "expected %d results, got %lld", nrets,
                     (long long)frame->rets.size);
        return RA_ERR_VALUE;
    }
    if (device_type == RA_DEV_CUDA) {
        const ra_ffi_api *api = frame->api;
        if (api == NULL ||
            api->struct_size < RA_FFI_STRUCT_SIZE(ra_ffi_api, stream_get) ||
            api->stream_get == NULL) {
            ra_set_error(RA_ERR_INTERNAL, "XLA's API has no stream getter");
            return RA_ERR_INTERNAL;
        }
        ra_ffi_stream_get_args sa;
        memset(&sa, 0, sizeof sa);
        sa.struct_size = RA_FFI_STRUCT_SIZE(ra_ffi_stream_get_args, stream);
        sa.ctx = frame->ctx;
        ra_ffi_error *err = api->stream_get(&sa);
        if (err != NULL) {
            /* XLA's error object is XLA's to free; it only says "no
             * stream", which is what we report. */
            ra_set_error(RA_ERR_INTERNAL, "XLA gave no CUDA stream for this call");
            return RA_ERR_INTERNAL;
        }
        c->stream = sa.stream;
    }
    return RA_OK;
}

/* ---- tensors ---------------------------------------------------------------- */

static ra_dtype float_dtype(int ffi_dtype) {
    switch (ffi_dtype) {
    case RA_FFI_F32: return RA_FLOAT32;
    case RA_FFI_F64: return RA_FLOAT64;
    case RA_FFI_F16: return RA_FLOAT16;
    case RA_FFI_BF16: return RA_BFLOAT16;
    default: return RA_DTYPE_OTHER;
    }
}

static ra_status load(const ra_xla_call *c, void **list, int *types,
                      int64_t size, int i, int kind, const char *name,
                      int core, ra_xla_tensor *t) {
    memset(t, 0, sizeof *t);
    t->name = name;
    if (i >= size || types[i] != kind) {
        ra_set_error(RA_ERR_VALUE, "%s: expected an array operand", name);
        return RA_ERR_VALUE;
    }
    ra_ffi_buffer *b = (ra_ffi_buffer *)list[i];
    (void)c;
    if (b == NULL ||
        b->struct_size < RA_FFI_STRUCT_SIZE(ra_ffi_buffer, dims)) {
        ra_set_error(RA_ERR_INTERNAL, "%s: malformed XLA buffer", name);
        return RA_ERR_INTERNAL;
    }
    if (b->rank < core || b->rank > core + RA_XLA_MAX_LEAD) {
        ra_set_error(RA_ERR_VALUE,
                     "%s: expected %d dimensions (plus at most %d vmap "
                     "dimensions in front), got %lld",
                     name, core, RA_XLA_MAX_LEAD, (long long)b->rank);
        return RA_ERR_VALUE;
    }
    t->data = b->data;
    t->ffi_dtype = b->dtype;
    t->dtype = float_dtype(b->dtype);
    t->core = core;
    t->lead = (int)b->rank - core;
    t->dims = b->dims;
    return RA_OK;
}

ra_status ra_xla_arg(const ra_xla_call *c, int i, const char *name, int core,
                     ra_xla_tensor *t) {
    const ra_ffi_args *a = &c->frame->args;
    return load(c, a->args, a->types, a->size, i, RA_FFI_ARG_BUFFER, name, core,
                t);
}

ra_status ra_xla_ret(const ra_xla_call *c, int i, const char *name, int core,
                     ra_xla_tensor *t) {
    const ra_ffi_rets *r = &c->frame->rets;
    return load(c, r->rets, r->types, r->size, i, RA_FFI_RET_BUFFER, name, core,
                t);
}

int64_t ra_xla_core_numel(const ra_xla_tensor *t) {
    int64_t n = 1;
    for (int j = 0; j < t->core; j++) n *= ra_xla_dim(t, j);
    return n;
}

ra_status ra_xla_check_dims(const ra_xla_tensor *t, const int64_t *want,
                            const char *doc) {
    for (int j = 0; j < t->core; j++) {
        if (ra_xla_dim(t, j) != want[j]) {
            char got[160], exp[160];
            int g = 0, e = 0;
            for (int i = 0; i < t->core; i++) {
                g += snprintf(got + g, sizeof got - (size_t)g, "%s%lld",
                              i ? ", " : "", (long long)ra_xla_dim(t, i));
                e += snprintf(exp + e, sizeof exp - (size_t)e, "%s%lld",
                              i ? ", " : "", (long long)want[i]);
            }
            ra_set_error(RA_ERR_VALUE, "%s: expected shape (%s) %s, got (%s)",
                         t->name, exp, doc, got);
            return RA_ERR_VALUE;
        }
    }
    return RA_OK;
}

ra_status ra_xla_check_dtype(const ra_xla_tensor *t, ra_dtype want,
                             const char *why) {
    if (t->dtype != want) {
        ra_set_error(RA_ERR_TYPE, "%s: expected dtype %s (%s), got %s", t->name,
                     ra_dtype_name(want), why,
                     t->dtype == RA_DTYPE_OTHER ? "a non-float type"
                                                : ra_dtype_name(t->dtype));
        return RA_ERR_TYPE;
    }
    return RA_OK;
}

/* ---- leading (vmap) dims ------------------------------------------------------ */

ra_status ra_xla_lead_plan(ra_xla_lead *l, const ra_xla_tensor *ref,
                           const ra_xla_tensor *ts, int n) {
    memset(l, 0, sizeof *l);
    l->lead = ref->lead;
    l->count = 1;
    l->folded = 1;
    for (int i = 0; i < l->lead; i++) {
        l->shape[i] = ref->dims[i];
        l->count *= ref->dims[i];
    }
    for (int k = 0; k < n; k++) {
        const ra_xla_tensor *t = &ts[k];
        if (t->lead != l->lead) {
            ra_set_error(RA_ERR_VALUE,
                         "%s: expected %d vmap dimensions in front of its %d, "
                         "got %d",
                         t->name, l->lead, t->core, t->lead);
            return RA_ERR_VALUE;
        }
        for (int i = 0; i < l->lead; i++) {
            if (t->dims[i] == l->shape[i]) continue;
            if (t->dims[i] != 1) {
                ra_set_error(RA_ERR_VALUE,
                             "%s: vmap dimension %d is %lld, expected %lld or 1",
                             t->name, i, (long long)t->dims[i],
                             (long long)l->shape[i]);
                return RA_ERR_VALUE;
            }
            l->folded = 0;
        }
    }
    return RA_OK;
}

int64_t ra_xla_lead_offset(const ra_xla_lead *l, const ra_xla_tensor *t,
                           int64_t idx) {
    int64_t off = 0, stride = ra_xla_core_numel(t);
    for (int i = l->lead - 1; i >= 0; i--) {
        const int64_t coord = idx % l->shape[i];
        idx /= l->shape[i];
        if (t->dims[i] != 1) off += coord * stride;
        stride *= t->dims[i];
    }
    return off;
}

/* Bytes per element: the float types', else by XLA's integer type. */
static size_t elem_size(const ra_xla_tensor *t) {
    if (t->dtype != RA_DTYPE_OTHER) return ra_dtype_size(t->dtype);
    switch (t->ffi_dtype) {
    case RA_FFI_PRED:
    case RA_FFI_S8:
    case RA_FFI_U8: return 1;
    case RA_FFI_S16:
    case RA_FFI_U16: return 2;
    case RA_FFI_S32:
    case RA_FFI_U32: return 4;
    default: return 8;
    }
}

char *ra_xla_item(const ra_xla_lead *l, const ra_xla_tensor *t, int64_t idx,
                  int whole) {
    const size_t es = elem_size(t);
    const int64_t off = whole ? 0 : ra_xla_lead_offset(l, t, idx);
    return (char *)t->data + (size_t)off * es;
}

int ra_xla_lead_shared(const ra_xla_tensor *t) {
    for (int i = 0; i < t->lead; i++)
        if (t->dims[i] != 1) return 0;
    return 1;
}

/* ---- attributes ------------------------------------------------------------- */

static int find_attr(const ra_xla_call *c, const char *name) {
    const ra_ffi_attrs *a = &c->frame->attrs;
    const size_t len = strlen(name);
    for (int64_t i = 0; i < a->size; i++) {
        const ra_ffi_bytespan *s = a->names[i];
        if (s != NULL && s->len == len && memcmp(s->ptr, name, len) == 0)
            return (int)i;
    }
    return -1;
}

static int int_value(int dtype, const void *p, int64_t *out) {
    switch (dtype) {
    case RA_FFI_PRED: *out = *(const uint8_t *)p != 0; return 1;
    case RA_FFI_S8: *out = *(const int8_t *)p; return 1;
    case RA_FFI_S16: *out = *(const int16_t *)p; return 1;
    case RA_FFI_S32: *out = *(const int32_t *)p; return 1;
    case RA_FFI_S64: *out = *(const int64_t *)p; return 1;
    case RA_FFI_U8: *out = *(const uint8_t *)p; return 1;
    case RA_FFI_U16: *out = *(const uint16_t *)p; return 1;
    case RA_FFI_U32: *out = *(const uint32_t *)p; return 1;
    default: return 0;
    }
}

ra_status ra_xla_attr_int(const ra_xla_call *c, const char *name,
                          int64_t *value, int *present) {
    int i = find_attr(c, name);
    *present = i >= 0;
    if (i < 0) return RA_OK;
    const ra_ffi_attrs *a = &c->frame->attrs;
    const ra_ffi_scalar *s = (const ra_ffi_scalar *)a->attrs[i];
    if (a->types[i] != RA_FFI_ATTR_SCALAR || !int_value(s->dtype, s->value, value)) {
        ra_set_error(RA_ERR_TYPE, "%s: expected an integer or bool attribute", name);
        return RA_ERR_TYPE;
    }
    return RA_OK;
}

ra_status ra_xla_attr_f64(const ra_xla_call *c, const char *name,
                          double *value, int *present) {
    int i = find_attr(c, name);
    *present = i >= 0;
    if (i < 0) return RA_OK;
    const ra_ffi_attrs *a = &c->frame->attrs;
    const ra_ffi_scalar *s = (const ra_ffi_scalar *)a->attrs[i];
    if (a->types[i] == RA_FFI_ATTR_SCALAR && s->dtype == RA_FFI_F64) {
        *value = *(const double *)s->value;
        return RA_OK;
    }
    if (a->types[i] == RA_FFI_ATTR_SCALAR && s->dtype == RA_FFI_F32) {
        *value = *(const float *)s->value;
        return RA_OK;
    }
    ra_set_error(RA_ERR_TYPE, "%s: expected a float attribute", name);
    return RA_ERR_TYPE;
}

ra_status ra_xla_attr_ints(const ra_xla_call *c, const char *name,
                           int64_t *values, int cap, int *n) {
    int i = find_attr(c, name);
    *n = 0;
    if (i < 0) {
        ra_set_error(RA_ERR_VALUE, "%s: missing attribute", name);
        return RA_ERR_VALUE;
    }
    const ra_ffi_attrs *a = &c->frame->attrs;
    const ra_ffi_array *arr = (const ra_ffi_array *)a->attrs[i];
    if (a->types[i] != RA_FFI_ATTR_ARRAY || arr->size > (size_t)cap) {
        ra_set_error(RA_ERR_VALUE, "%s: expected an array of at most %d integers",
                     name, cap);
        return RA_ERR_VALUE;
    }
    const size_t es = arr->dtype == RA_FFI_S64 || arr->dtype == RA_FFI_U64 ? 8
                      : arr->dtype == RA_FFI_S32 || arr->dtype == RA_FFI_U32 ? 4
                                                                             : 0;
    for (size_t j = 0; j < arr->size; j++) {
        if (es == 0 || !int_value(arr->dtype == RA_FFI_U64 ? RA_FFI_S64 : arr->dtype,
                                  (const char *)arr->data + j * es, &values[j])) {
            ra_set_error(RA_ERR_TYPE, "%s: expected an array of integers", name);
            return RA_ERR_TYPE;
        }
    }
    *n = (int)arr->size;
    return RA_OK;
}
