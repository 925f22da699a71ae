/*
 * attn_args.c -- argument checks shared by every attention entry point.
 * All run before any work; each names the argument, the expected and the
 * actual value.
 */
#include <math.h>
#include <string.h>

#include "attn/attn_args.h"
#include "core/cuda_rt.h"
#include "core/module.h"
#ifdef RA_WITH_CUDA
#include "attn_cuda.h"
#endif

/* ---- argument checking -------------------------------------------------- */



void release_args(tensor_arg *a, int n) {
    for (int i = 0; i < n; i++) Py_CLEAR(a[i].buf);
}

int dtype_error_expecting(const char *name, ra_buffer *b,
                          const char *expected) {
    char dt[32];
    ra_dl_dtype_name(b->dl_dtype, dt, sizeof dt);
    PyErr_Format(PyExc_TypeError, "%s: expected %s, got %s", name, expected,
                 dt);
    return -1;
}

int dtype_error(const char *name, ra_buffer *b) {
    return dtype_error_expecting(
        name, b, "a float32, float64, float16 or bfloat16 array");
}

/* Convert `obj` into a Buffer with a float dtype and `ndim` dimensions
 * whose last dimension is contiguous (copying if it is not). */
static int load_tensor_ex(tensor_arg *a, PyObject *obj, const char *name,
                          int ndim, const char *dims_doc, int allow_copy) {
    a->name = name;
    a->buf = ra_buffer_from_object(obj, name, -1);
    if (a->buf == NULL) return -1;
    ra_buffer *b = a->buf;
    if (b->dtype == RA_DTYPE_OTHER) return dtype_error(name, b);
    if (b->ndim != ndim) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected %d dimensions %s, got %d", name, ndim,
                     dims_doc, b->ndim);
        return -1;
    }
    if (b->device_type != RA_DEV_CPU && b->device_type != RA_DEV_CUDA) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected host or CUDA device memory, got DLPack "
                     "device type %d",
                     name, b->device_type);
        return -1;
    }
    for (int i = 0; i < ndim; i++) {
        if (b->shape[i] > 1 && b->strides[i] < 0) {
            /* negative strides are fine for the kernels, but keep sanity:
             * copy to a fresh layout so every offset is non-negative */
            goto copy;
        }
    }
    if (b->shape[ndim - 1] > 1 && b->strides[ndim - 1] != 1) goto copy;
    return 0;
copy:
    if (!allow_copy) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected an output whose last dimension is "
                     "contiguous and whose strides are non-negative",
                     name);
        return -1;
    }
    return replace_with_copy(a);
}

int replace_with_copy(tensor_arg *a) {
    ra_buffer *b = a->buf;
    ra_buffer *c = ra_buffer_empty(b->ndim, b->shape, b->dtype, b->device_type,
                                   b->device_id, 0);
    if (c == NULL) return -1;
    ra_status st = ra_buffer_copy_into(c, b);
    if (st != RA_OK) {
        Py_DECREF(c);
        ra_raise(st);
        return -1;
    }
    Py_DECREF(b);
    a->buf = c;
    return 0;
}

int load_tensor(tensor_arg *a, PyObject *obj, const char *name,
                       int ndim, const char *dims_doc) {
    return load_tensor_ex(a, obj, name, ndim, dims_doc, 1);
}

int load_output(tensor_arg *a, PyObject *obj, const char *name,
                       int ndim, const char *dims_doc) {
    return load_tensor_ex(a, obj, name, ndim, dims_doc, 0);
}

int check_same_dtype(tensor_arg *ref, tensor_arg *a) {
    if (a->buf->dtype != ref->buf->dtype) {
        PyErr_Format(PyExc_TypeError,
                     "%s: expected dtype %s (the dtype of %s), got %s",
                     a->name, ra_dtype_name(ref->buf->dtype), ref->name,
                     ra_dtype_name(a->buf->dtype));
        return -1;
    }
    return 0;
}

int check_same_device(tensor_arg *ref, tensor_arg *a) {
    if (a->buf->device_type != ref->buf->device_type ||
        a->buf->device_id != ref->buf->device_id) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected the device of %s (%s:%d), got %s:%d "
                     "(mixed devices)",
                     a->name, ref->name, ra_device_name(ref->buf->device_type),
                     ref->buf->device_id, ra_device_name(a->buf->device_type),
                     a->buf->device_id);
        return -1;
    }
    return 0;
}

int check_dim(tensor_arg *a, int dim, const char *what, int64_t want,
                     const char *source) {
    if (a->buf->shape[dim] != want) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected %s %lld (from %s) at dimension %d, got %lld",
                     a->name, what, (long long)want, source, dim,
                     (long long)a->buf->shape[dim]);
        return -1;
    }
    return 0;
}

int check_writable(tensor_arg *a) {
    if (a->buf->readonly) {
        PyErr_Format(PyExc_ValueError, "%s: expected a writable array, got a "
                                       "read-only one",
                     a->name);
        return -1;
    }
    return 0;
}

int check_shape3(tensor_arg *a, int64_t d0, int64_t d1, int64_t d2,
                        const char *doc) {
    if (a->buf->shape[0] != d0 || a->buf->shape[1] != d1 ||
        a->buf->shape[2] != d2) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected shape (%lld, %lld, %lld) %s, got (%lld, "
                     "%lld, %lld)",
                     a->name, (long long)d0, (long long)d1, (long long)d2, doc,
                     (long long)a->buf->shape[0], (long long)a->buf->shape[1],
                     (long long)a->buf->shape[2]);
        return -1;
    }
    return 0;
}

int check_shape4_like(tensor_arg *a, tensor_arg *ref) {
    for (int i = 0; i < 4; i++)
        if (a->buf->shape[i] != ref->buf->shape[i]) {
            PyErr_Format(PyExc_ValueError,
                         "%s: expected the shape of %s (%lld, %lld, %lld, "
                         "%lld), got (%lld, %lld, %lld, %lld)",
                         a->name, ref->name, (long long)ref->buf->shape[0],
                         (long long)ref->buf->shape[1],
                         (long long)ref->buf->shape[2],
                         (long long)ref->buf->shape[3],
                         (long long)a->buf->shape[0], (long long)a->buf->shape[1],
                         (long long)a->buf->shape[2], (long long)a->buf->shape[3]);
            return -1;
        }
    return 0;
}

int check_acc_dtype(tensor_arg *a, ra_dtype want, const char *why) {
    if (a->buf->dtype != want) {
        PyErr_Format(PyExc_TypeError, "%s: expected dtype %s (%s), got %s",
                     a->name, ra_dtype_name(want), why,
                     ra_dtype_name(a->buf->dtype));
        return -1;
    }
    return 0;
}



const char *BSHD = "(batch, seq, heads, head_dim)";
const char *BHS = "(batch, heads, seq_q)";

int check_qkv(tensor_arg *q, tensor_arg *k, tensor_arg *v,
                     qkv_dims *d) {
    if (check_same_dtype(q, k) < 0 || check_same_dtype(q, v) < 0) return -1;
    if (check_same_device(q, k) < 0 || check_same_device(q, v) < 0) return -1;
    d->B = q->buf->shape[0];
    d->Sq = q->buf->shape[1];
    d->H = q->buf->shape[2];
    d->D = q->buf->shape[3];
    d->Sk = k->buf->shape[1];
    d->Hkv = k->buf->shape[2];
    d->dtype = q->buf->dtype;
    d->device_type = q->buf->device_type;
    d->device_id = q->buf->device_id;
    if (check_dim(k, 0, "batch size", d->B, "q") < 0) return -1;
    if (check_dim(v, 0, "batch size", d->B, "q") < 0) return -1;
    if (check_dim(k, 3, "head_dim", d->D, "q") < 0) return -1;
    if (check_dim(v, 3, "head_dim", d->D, "q") < 0) return -1;
    if (check_dim(v, 1, "sequence length", d->Sk, "k") < 0) return -1;
    if (check_dim(v, 2, "kv heads", d->Hkv, "k") < 0) return -1;
    if (d->D < 1 || d->D > RA_MAX_HEAD_DIM) {
        PyErr_Format(PyExc_ValueError,
                     "q: expected head_dim between 1 and %d, got %lld",
                     RA_MAX_HEAD_DIM, (long long)d->D);
        return -1;
    }
    if (d->Hkv < 1 || d->H < 1 || d->H % d->Hkv != 0) {
        PyErr_Format(PyExc_ValueError,
                     "k: expected a number of kv heads that divides the %lld "
                     "query heads of q, got %lld",
                     (long long)d->H, (long long)d->Hkv);
        return -1;
    }
    return 0;
}

void dims_of_rows(const ra_buffer *rows, ra_dtype dtype, qkv_dims *d) {
    d->B = rows->shape[0];
    d->Sq = rows->shape[1];
    d->H = rows->shape[2];
    d->D = rows->shape[3];
    d->Sk = 0;
    d->Hkv = d->H;
    d->dtype = dtype;
    d->device_type = rows->device_type;
    d->device_id = rows->device_id;
}

int parse_scale(PyObject *obj, int64_t D, double *scale) {
    if (obj == NULL || obj == Py_None) {
        *scale = 1.0 / sqrt((double)D);
        return 0;
    }
    double s = PyFloat_AsDouble(obj);
    if (s == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "scale: expected a float or None, got %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (!isfinite(s)) {
        PyErr_Format(PyExc_ValueError, "scale: expected a finite number, got %R",
                     obj);
        return -1;
    }
    *scale = s;
    return 0;
}

int parse_num_threads(PyObject *obj, int *num_threads) {
    *num_threads = 0;
    if (obj == NULL || obj == Py_None) return 0;
    if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "num_threads: expected an int or None, got %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) return -1;
    int overflow = 0;
    const long long n = PyLong_AsLongLongAndOverflow(idx, &overflow);
    Py_DECREF(idx);
    if (n == -1 && PyErr_Occurred()) return -1;
    /* beyond int64 is out of range too: checked as -1 */
    ra_status st = ra_check_num_threads(overflow ? -1 : n);
    if (st != RA_OK) {
        PyErr_Format(PyExc_ValueError,
                     "num_threads: expected None or 0 (the default: "
                     "RINGATTN_NUM_THREADS, else OpenMP's) or 1..%d, got %R",
                     RA_MAX_THREADS, obj);
        return -1;
    }
    *num_threads = (int)n;
    return 0;
}

ra_view view_of(const ra_buffer *b) {
    ra_view v = {NULL, 0, 0, 0};
    if (b != NULL) {
        v.data = b->data;
        v.s0 = b->strides[0];
        v.s1 = b->strides[1];
        v.s2 = b->strides[2];
    }
    return v;
}

ra_attn_call call_of(const qkv_dims *d, double scale, int causal,
                     const int64_t pos[4], const ra_attn_mask *mask,
                     int accumulate, int num_threads) {
    ra_attn_call c = {d->dtype, d->B, d->Sq, d->Sk, d->H, d->Hkv, d->D,
                      scale, causal, pos[0], pos[1], pos[2], pos[3], mask,
                      accumulate, num_threads};
    return c;
}

/* One position keyword: None (or absent) -> dflt; else an int inside
 * +-2^60 (a larger one is a ValueError naming it, not an OverflowError). */
static int position_int(PyObject *obj, const char *name, int64_t dflt,
                        int64_t *out) {
    if (obj == NULL || obj == Py_None) {
        *out = dflt;
        return 0;
    }
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: expected an int, got %.100s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
    Py_DECREF(idx);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected an int within +-2^60 (positions stay "
                     "inside that bound), got %R",
                     name, obj);
        return -1;
    }
    *out = v;
    return 0;
}

/* q's and k's positions inside the bound (ra_check_positions) */
static int check_position_bounds(const int64_t pos[4], const qkv_dims *d) {
    ra_status st = ra_check_positions("q_pos_offset", pos[0], "q_pos_stride",
                                      pos[1], d->Sq);
    if (st == RA_OK)
        st = ra_check_positions("k_pos_offset", pos[2], "k_pos_stride",
                                pos[3], d->Sk);
    if (st != RA_OK) {
        ra_raise(st);
        return -1;
    }
    return 0;
}

int parse_positions(PyObject *qoff, PyObject *qstride, PyObject *koff,
                    PyObject *kstride, const qkv_dims *d, int64_t out[4]) {
    /* default q offset: bottom-right alignment */
    if (position_int(qoff, "q_pos_offset", d->Sk - d->Sq, &out[0]) < 0 ||
        position_int(qstride, "q_pos_stride", 1, &out[1]) < 0 ||
        position_int(koff, "k_pos_offset", 0, &out[2]) < 0 ||
        position_int(kstride, "k_pos_stride", 1, &out[3]) < 0)
        return -1;
    return check_position_bounds(out, d);
}

int parse_dilated_positions(PyObject *qoff, PyObject *koff, const qkv_dims *d,
                            int64_t out[4]) {
    if (position_int(qoff, "q_pos_offset", 0, &out[0]) < 0 ||
        position_int(koff, "k_pos_offset", 0, &out[2]) < 0)
        return -1;
    out[1] = 1;
    out[3] = 1;
    if ((qoff == NULL || qoff == Py_None) && out[2] == 0 && d->Sq != d->Sk) {
        PyErr_Format(PyExc_ValueError,
                     "k: dilated attention expects the sequence length of q "
                     "(%lld), got %lld",
                     (long long)d->Sq, (long long)d->Sk);
        return -1;
    }
    return check_position_bounds(out, d);
}

/* dilated configuration from two Python sequences */
int ra_parse_dilated(PyObject *segs, PyObject *rates,
                     ra_dilated_config *cfg) {
    PyObject *s = PySequence_Fast(segs, "segment_lengths: expected a sequence "
                                        "of positive ints");
    if (s == NULL) return -1;
    PyObject *r = PySequence_Fast(rates, "dilation_rates: expected a sequence "
                                         "of positive ints");
    if (r == NULL) {
        Py_DECREF(s);
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(s);
    int rc = -1;
    if (n != PySequence_Fast_GET_SIZE(r)) {
        PyErr_Format(PyExc_ValueError,
                     "dilation_rates: expected %zd values (one per segment "
                     "length), got %zd",
                     n, PySequence_Fast_GET_SIZE(r));
        goto done;
    }
    if (n < 1 || n > RA_MAX_BRANCHES) {
        PyErr_Format(PyExc_ValueError,
                     "segment_lengths: expected 1 to %d branches, got %zd",
                     RA_MAX_BRANCHES, n);
        goto done;
    }
    cfg->n_branches = (int)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair[2] = {PySequence_Fast_GET_ITEM(s, i),
                             PySequence_Fast_GET_ITEM(r, i)};
        const char *names[2] = {"segment_lengths", "dilation_rates"};
        int64_t vals[2];
        for (int j = 0; j < 2; j++) {
            if (!PyLong_Check(pair[j]) || PyBool_Check(pair[j])) {
                PyErr_Format(PyExc_ValueError,
                             "%s: expected positive ints, got %.100s at "
                             "position %zd",
                             names[j], Py_TYPE(pair[j])->tp_name, i);
                goto done;
            }
            int overflow = 0;
            long long x = PyLong_AsLongLongAndOverflow(pair[j], &overflow);
            if (overflow || x < 1) {
                PyErr_Format(PyExc_ValueError,
                             "%s: expected positive ints, got %R at position "
                             "%zd",
                             names[j], pair[j], i);
                goto done;
            }
            vals[j] = x;
        }
        cfg->segment_lengths[i] = vals[0];
        cfg->dilation_rates[i] = vals[1];
    }
    rc = 0;
done:
    Py_DECREF(s);
    Py_DECREF(r);
    return rc;
}

/* Allocate an output like `shape` on the inputs' device. */
ra_buffer *alloc_out(int ndim, const int64_t *shape, ra_dtype t,
                            const qkv_dims *d, int zero) {
    return ra_buffer_empty(ndim, shape, t, d->device_type, d->device_id, zero);
}



int load_bhs(tensor_arg *a, PyObject *obj, const char *name, const qkv_dims *d,
             int writable) {
    a->name = name;
    a->buf = ra_buffer_from_object(obj, name, -1);
    if (a->buf == NULL) return -1;
    if (a->buf->dtype == RA_DTYPE_OTHER) return dtype_error(name, a->buf);
    if (a->buf->ndim != 3) {
        PyErr_Format(PyExc_ValueError, "%s: expected 3 dimensions %s, got %d",
                     name, BHS, a->buf->ndim);
        return -1;
    }
    if (check_shape3(a, d->B, d->H, d->Sq, BHS) < 0) return -1;
    if (check_acc_dtype(a, ra_acc_dtype(d->dtype),
                        "float32, or float64 for float64 inputs") < 0)
        return -1;
    if (a->buf->device_type != d->device_type ||
        a->buf->device_id != d->device_id) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected the device of q (%s:%d), got %s:%d (mixed "
                     "devices)",
                     name, ra_device_name(d->device_type), d->device_id,
                     ra_device_name(a->buf->device_type), a->buf->device_id);
        return -1;
    }
    if (writable && check_writable(a) < 0) return -1;
    return 0;
}

/* one ra_cuda_run call, as ra_cuda_launch passes it to launch_call */
typedef struct {
    ra_cuda_op op;
    const void *params;
} cuda_call;

#ifdef RA_WITH_CUDA
/* the extern "C" launcher of call->op, on `stream` */
static ra_status launch_call(const void *arg, void *stream) {
    const cuda_call *call = (const cuda_call *)arg;
    const void *params = call->params;
    ra_status st;
    switch (call->op) {
    case RA_CUDA_FWD:
        st = ra_cuda_attn_fwd((const ra_attn_fwd_params *)params, stream);
        break;
    case RA_CUDA_BWD_PRE:
        st = ra_cuda_attn_bwd_preprocess((const ra_attn_bwd_params *)params,
                                         stream);
        break;
    case RA_CUDA_BWD:
        st = ra_cuda_attn_bwd((const ra_attn_bwd_params *)params, stream);
        break;
    case RA_CUDA_MERGE:
        st = ra_cuda_merge((const ra_merge_params *)params, stream);
        break;
    case RA_CUDA_DILATED_FWD: {
        const ra_dilated_call *d = (const ra_dilated_call *)params;
        st = ra_cuda_dilated_fwd((const ra_attn_fwd_params *)d->params, d->cfg, stream);
        break;
    }
    case RA_CUDA_DILATED_BWD: {
        const ra_dilated_call *d = (const ra_dilated_call *)params;
        st = ra_cuda_dilated_bwd((const ra_attn_bwd_params *)d->params, d->cfg, stream);
        break;
    }
    case RA_CUDA_STATE: {
        const ra_state_params *s = (const ra_state_params *)params;
        st = ra_cuda_fill_state(s->out, s->lse, s->acc, s->batch, s->seqlen,
                                s->heads, s->head_dim, s->out_batch_stride,
                                s->out_seq_stride, s->out_head_stride,
                                s->lse_batch_stride, s->lse_head_stride,
                                s->lse_seq_stride, stream);
        break;
    }
    default:
        ra_set_error(RA_ERR_INTERNAL, "unknown CUDA operation %d",
                     (int)call->op);
        st = RA_ERR_INTERNAL;
    }
    return st;
}
#else
#define launch_call NULL /* ra_cuda_launch refuses without CUDA */
#endif

ra_status ra_cuda_run(int device, ra_cuda_op op, const void *params) {
    cuda_call call = {op, params};
    return ra_cuda_launch(device, launch_call, &call);
}
