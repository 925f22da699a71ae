/*
 * attn_mask_args.c -- the mask keywords of attn_fwd / attn_bwd (DESIGN 2,
 * "Masks") checked and turned into an ra_attn_mask, before any work:
 *
 *   segment_ids     (B, S_q) integer array, any strides
 *   kv_segment_ids  (B, S_k) integer array; defaults to segment_ids (which
 *                   then needs S_q == S_k); without segment_ids an error
 *   window          (left, right): ints >= 0 or None (that side unbounded);
 *                   None: no window
 *   softcap         float > 0 and finite, or None
 *
 * The kernels read int32 ids.  int32 arrays are used in place; every other
 * integer dtype is converted here, in one place, into a fresh int32 Buffer
 * on the same device, and a value outside int32 is a ValueError naming it.
 */
#include <math.h>
#include <string.h>

#include "attn/attn_args.h"
#include "core/cuda_rt.h"
#include "core/module.h"

/* A window side beyond this reaches every position ringattn can index
 * (sequences and ring offsets stay far below 2^62), so it is unbounded;
 * keeping sides this small keeps position +- side inside int64. */
#define RA_WINDOW_UNBOUNDED_FROM ((int64_t)1 << 62)

static int is_integer_dtype(DLDataType t) {
    return t.lanes == 1 && (t.code == kDLInt || t.code == kDLUInt) &&
           (t.bits == 8 || t.bits == 16 || t.bits == 32 || t.bits == 64);
}

/* element (b, i) of an integer array as int64; uint64 values above
 * INT64_MAX read as -1 (outside int32 either way) */
static int64_t int_at(const char *base, DLDataType t, int64_t off) {
    const char *p = base + off * (int64_t)(t.bits / 8);
    if (t.code == kDLInt) {
        switch (t.bits) {
        case 8: { int8_t v; memcpy(&v, p, 1); return v; }
        case 16: { int16_t v; memcpy(&v, p, 2); return v; }
        case 32: { int32_t v; memcpy(&v, p, 4); return v; }
        default: { int64_t v; memcpy(&v, p, 8); return v; }
        }
    }
    switch (t.bits) {
    case 8: { uint8_t v; memcpy(&v, p, 1); return v; }
    case 16: { uint16_t v; memcpy(&v, p, 2); return v; }
    case 32: { uint32_t v; memcpy(&v, p, 4); return v; }
    default: {
        uint64_t v;
        memcpy(&v, p, 8);
        return v > (uint64_t)INT64_MAX ? -1 : (int64_t)v;
    }
    }
}

/* host ids (B, S) with element strides bs, ss -> compact int32; -1 with a
 * ValueError naming the first value outside int32 */
static int convert_ids(const char *src, DLDataType t, int64_t B, int64_t S,
                       int64_t bs, int64_t ss, int32_t *dst,
                       const char *name) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < S; i++) {
            const int64_t x = int_at(src, t, b * bs + i * ss);
            const int huge = t.code == kDLUInt && t.bits == 64 && x < 0;
            if (huge || x < INT32_MIN || x > INT32_MAX) {
                char dt[32];
                ra_dl_dtype_name(t, dt, sizeof dt);
                PyErr_Format(PyExc_ValueError,
                             "%s: expected ids that fit in int32, got %s%lld "
                             "(%s) at [%lld, %lld]",
                             name, huge ? "more than " : "",
                             huge ? (long long)INT64_MAX : (long long)x, dt,
                             (long long)b, (long long)i);
                return -1;
            }
            dst[b * S + i] = (int32_t)x;
        }
    return 0;
}

/* The span of elements a strided (B, S) array touches, relative to its
 * element [0, 0]: [lo, lo + n). */
static void strided_span(const ra_buffer *b, int64_t *lo, int64_t *n) {
    int64_t first = 0, last = 0;
    for (int i = 0; i < b->ndim; i++) {
        if (b->shape[i] == 0) {
            *lo = 0;
            *n = 0;
            return;
        }
        const int64_t reach = b->strides[i] * (b->shape[i] - 1);
        if (reach < 0) first += reach;
        else last += reach;
    }
    *lo = first;
    *n = last - first + 1;
}

/* a->buf (integer, not int32) replaced by an int32 copy on its device */
static int ids_to_int32(tensor_arg *a) {
    ra_buffer *src = a->buf;
    const DLDataType i32 = {kDLInt, 32, 1};
    const int64_t B = src->shape[0], S = src->shape[1];
    ra_buffer *dst = ra_buffer_empty_dl(2, src->shape, i32, src->device_type,
                                        src->device_id, 0);
    if (dst == NULL) return -1;
    int rc = -1;
    if (src->device_type != RA_DEV_CUDA) {
        rc = convert_ids((const char *)src->data, src->dl_dtype, B, S,
                         src->strides[0], src->strides[1],
                         (int32_t *)dst->data, a->name);
    } else {
        /* stage the span the ids occupy on the host, convert, copy back */
        const size_t es = ra_buffer_elsize(src);
        int64_t lo, n;
        strided_span(src, &lo, &n);
        char *host = NULL;
        int32_t *ids = NULL;
        ra_status st = RA_OK;
        if (n > 0) {
            host = (char *)ra_host_alloc((size_t)n * es);
            ids = (int32_t *)ra_host_alloc((size_t)(B * S) * sizeof(int32_t));
            if (host == NULL || ids == NULL) {
                st = RA_ERR_NOMEM;
            } else {
                Py_BEGIN_ALLOW_THREADS
                st = ra_cuda_memcpy(src->device_id, host, 0,
                                    (const char *)src->data + lo * (int64_t)es,
                                    1, (size_t)n * es, 1);
                Py_END_ALLOW_THREADS
            }
            if (st == RA_OK) {
                rc = convert_ids(host - lo * (int64_t)es, src->dl_dtype, B, S,
                                 src->strides[0], src->strides[1], ids,
                                 a->name);
                if (rc == 0) {
                    Py_BEGIN_ALLOW_THREADS
                    st = ra_cuda_memcpy(dst->device_id, dst->data, 1, ids, 0,
                                        (size_t)(B * S) * sizeof(int32_t), 1);
                    Py_END_ALLOW_THREADS
                    if (st != RA_OK) rc = -1;
                }
            } else {
                rc = -1;
            }
            if (st != RA_OK) ra_raise(st);
        } else {
            rc = 0;
        }
        ra_host_free(ids, (size_t)(B * S) * sizeof(int32_t));
        ra_host_free(host, (size_t)(n > 0 ? n : 0) * es);
    }
    if (rc < 0) {
        Py_DECREF(dst);
        return -1;
    }
    Py_DECREF(src);
    a->buf = dst;
    return 0;
}

/* ids of shape (B, S) on q's device, as int32 */
static int load_ids(tensor_arg *a, PyObject *obj, const char *name,
                    int64_t S, const char *seq_doc, const qkv_dims *d) {
    a->name = name;
    a->buf = ra_buffer_from_object(obj, name, -1);
    if (a->buf == NULL) return -1;
    ra_buffer *b = a->buf;
    if (!is_integer_dtype(b->dl_dtype))
        return dtype_error_expecting(name, b,
                                     "an integer array (int32, or integers "
                                     "that fit in int32)");
    if (b->ndim != 2 || b->shape[0] != d->B || b->shape[1] != S) {
        char shape[96] = "";
        size_t used = 0;
        for (int i = 0; i < b->ndim && used < sizeof shape; i++)
            used += (size_t)snprintf(shape + used, sizeof shape - used,
                                     i ? ", %lld" : "%lld",
                                     (long long)b->shape[i]);
        PyErr_Format(PyExc_ValueError,
                     "%s: expected shape (%lld, %lld) (batch, %s), got (%s%s)",
                     name, (long long)d->B, (long long)S, seq_doc, shape,
                     b->ndim == 1 ? "," : "");
        return -1;
    }
    if (b->device_type != d->device_type || b->device_id != d->device_id) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected the device of q (%s:%d), got %s:%d (mixed "
                     "devices)",
                     name, ra_device_name(d->device_type), d->device_id,
                     ra_device_name(b->device_type), b->device_id);
        return -1;
    }
    if (b->dl_dtype.code == kDLInt && b->dl_dtype.bits == 32) return 0;
    return ids_to_int32(a);
}

/* one side of the window: None -> -1 (unbounded), an int >= 0 -> itself */
static int window_side(PyObject *obj, const char *side, PyObject *window,
                       int64_t *out) {
    if (obj == Py_None) {
        *out = -1;
        return 0;
    }
    if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "window: expected (left, right) with ints >= 0 or None, "
                     "got %.100s %s in %R",
                     Py_TYPE(obj)->tp_name, side, window);
        return -1;
    }
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
    Py_DECREF(idx);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow < 0 || (overflow == 0 && v < 0)) {
        PyErr_Format(PyExc_ValueError,
                     "window: expected %s >= 0 or None, got %R", side, obj);
        return -1;
    }
    *out = (overflow > 0 || v >= RA_WINDOW_UNBOUNDED_FROM) ? -1 : (int64_t)v;
    return 0;
}

static int parse_window(PyObject *obj, ra_attn_mask *m) {
    if (obj == NULL || obj == Py_None) return 0;
    if (!(PyTuple_Check(obj) || PyList_Check(obj)) || PySequence_Size(obj) != 2) {
        PyErr_Format(PyExc_TypeError,
                     "window: expected (left, right) with ints >= 0 or None, "
                     "or None, got %.100s %R",
                     Py_TYPE(obj)->tp_name, obj);
        return -1;
    }
    PyObject *seq = PySequence_Fast(obj, "window");
    if (seq == NULL) return -1;
    int64_t left, right;
    int rc = window_side(PySequence_Fast_GET_ITEM(seq, 0), "left", obj, &left);
    if (rc == 0)
        rc = window_side(PySequence_Fast_GET_ITEM(seq, 1), "right", obj,
                         &right);
    Py_DECREF(seq);
    if (rc < 0) return -1;
    if (left >= 0 || right >= 0) {    /* (None, None) narrows nothing */
        m->has_window = 1;
        m->window_left = left;
        m->window_right = right;
    }
    return 0;
}

static int parse_softcap(PyObject *obj, ra_attn_mask *m) {
    if (obj == NULL || obj == Py_None) return 0;
    double c = -1.0;
    if (!PyBool_Check(obj)) c = PyFloat_AsDouble(obj);
    if (PyBool_Check(obj) || (c == -1.0 && PyErr_Occurred())) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "softcap: expected a float > 0 or None, got %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (!(c > 0.0) || !RA_SOFTCAP_OK(c)) {
        PyErr_Format(PyExc_ValueError,
                     "softcap: expected a float in [1e-30, 1e+30] or None, "
                     "got %R",
                     obj);
        return -1;
    }
    m->softcap = c;
    return 0;
}

int parse_masks(const mask_kwargs *kw, const qkv_dims *d, tensor_arg ids[2],
                ra_attn_mask *m) {
    memset(m, 0, sizeof *m);
    PyObject *q_ids = kw->segment_ids, *kv_ids = kw->kv_segment_ids;
    if (q_ids == Py_None) q_ids = NULL;
    if (kv_ids == Py_None) kv_ids = NULL;
    if (kv_ids != NULL && q_ids == NULL) {
        PyErr_SetString(PyExc_ValueError,
                        "kv_segment_ids: given without segment_ids (pass the "
                        "queries' ids too)");
        return -1;
    }
    if (q_ids != NULL) {
        if (load_ids(&ids[0], q_ids, "segment_ids", d->Sq, "seq_q", d) < 0)
            return -1;
        if (kv_ids == NULL && d->Sq != d->Sk) {
            PyErr_Format(PyExc_ValueError,
                         "kv_segment_ids: needed when q and k differ in "
                         "length (S_q %lld, S_k %lld); segment_ids alone "
                         "serve both only when they are equal",
                         (long long)d->Sq, (long long)d->Sk);
            return -1;
        }
        if (kv_ids != NULL) {
            if (load_ids(&ids[1], kv_ids, "kv_segment_ids", d->Sk, "seq_k",
                         d) < 0)
                return -1;
        } else {
            ids[1].name = "kv_segment_ids";
            ids[1].buf = ids[0].buf;
            Py_INCREF(ids[1].buf);
        }
        m->q_segment_ids = (const int32_t *)ids[0].buf->data;
        m->q_seg_batch_stride = ids[0].buf->strides[0];
        m->q_seg_seq_stride = ids[0].buf->strides[1];
        m->kv_segment_ids = (const int32_t *)ids[1].buf->data;
        m->kv_seg_batch_stride = ids[1].buf->strides[0];
        m->kv_seg_seq_stride = ids[1].buf->strides[1];
    }
    if (parse_window(kw->window, m) < 0) return -1;
    if (parse_softcap(kw->softcap, m) < 0) return -1;
    return 0;
}

int mask_is_set(const ra_attn_mask *m) {
    return m->q_segment_ids != NULL || m->has_window || m->softcap > 0;
}
