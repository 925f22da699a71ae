/*
 * buffer.c -- ringattn.Buffer: an n-d strided view of host or device memory.
 *
 * Memory is either an ra_block ringattn allocated (host: ra_host_alloc,
 * device: ra_cuda_malloc; both counted in memory_stats) shared by reference
 * count between views and exported DLPack tensors, or memory borrowed from
 * another producer, kept alive through `owner`.  DLPack export/import lives
 * in dlpack.c, the NumPy bridge in ndarray.c, strided copies in copy_cpu.c.
 */
#include "core/buffer.h"

#include <stdatomic.h>
#include <string.h>
#include <structmember.h>

#include "core/copy.h"
#include "core/cuda_rt.h"
#include "core/module.h"
#include "core/ndarray.h"

PyTypeObject *ra_BufferType = NULL;

/* ---- blocks ------------------------------------------------------------ */

ra_block *ra_block_alloc(int device_type, int device_id, size_t nbytes,
                         int zero) {
    ra_block *b = (ra_block *)PyMem_RawMalloc(sizeof(ra_block));
    if (b == NULL) {
        ra_set_error(RA_ERR_NOMEM, "out of host memory");
        return NULL;
    }
    b->nbytes = nbytes;
    b->device_type = device_type;
    b->device_id = device_id;
    b->refcount = 1;
    b->ptr = NULL;
    if (device_type == RA_DEV_CPU) {
        b->ptr = zero ? ra_host_calloc(nbytes) : ra_host_alloc(nbytes);
        if (b->ptr == NULL) goto fail;
    } else if (device_type == RA_DEV_CUDA) {
        if (ra_cuda_malloc(device_id, nbytes, &b->ptr) != RA_OK) goto fail;
        if (zero && nbytes > 0 &&
            ra_cuda_memset_zero(device_id, b->ptr, nbytes) != RA_OK) {
            ra_cuda_free(device_id, b->ptr, nbytes);
            goto fail;
        }
    } else {
        ra_set_error(RA_ERR_VALUE, "cannot allocate on device type %d",
                     device_type);
        goto fail;
    }
    return b;
fail:
    PyMem_RawFree(b);
    return NULL;
}

void ra_block_incref(ra_block *b) {
    atomic_fetch_add_explicit((_Atomic int *)&b->refcount, 1,
                              memory_order_relaxed);
}

void ra_block_decref(ra_block *b) {
    if (b == NULL) return;
    if (atomic_fetch_sub_explicit((_Atomic int *)&b->refcount, 1,
                                  memory_order_acq_rel) != 1)
        return;
    if (b->device_type == RA_DEV_CPU)
        ra_host_free(b->ptr, b->nbytes);
    else if (b->device_type == RA_DEV_CUDA)
        ra_cuda_free(b->device_id, b->ptr, b->nbytes);
    PyMem_RawFree(b);
}

/* ---- helpers ----------------------------------------------------------- */

static void dl_dtype_of(ra_dtype t, DLDataType *out) {
    out->lanes = 1;
    switch (t) {
    case RA_FLOAT32: out->code = kDLFloat; out->bits = 32; break;
    case RA_FLOAT64: out->code = kDLFloat; out->bits = 64; break;
    case RA_FLOAT16: out->code = kDLFloat; out->bits = 16; break;
    case RA_BFLOAT16: out->code = kDLBfloat; out->bits = 16; break;
    default: out->code = kDLOpaqueHandle; out->bits = 8; break;
    }
}

ra_dtype ra_dtype_from_dl(DLDataType t) {
    if (t.lanes != 1) return RA_DTYPE_OTHER;
    if (t.code == kDLFloat) {
        if (t.bits == 32) return RA_FLOAT32;
        if (t.bits == 64) return RA_FLOAT64;
        if (t.bits == 16) return RA_FLOAT16;
    }
    if (t.code == kDLBfloat && t.bits == 16) return RA_BFLOAT16;
    return RA_DTYPE_OTHER;
}

int ra_dtype_from_name(const char *name, ra_dtype *out) {
    static const struct { const char *n; ra_dtype t; } names[] = {
        {"float32", RA_FLOAT32}, {"float64", RA_FLOAT64},
        {"float16", RA_FLOAT16}, {"bfloat16", RA_BFLOAT16},
        {"f4", RA_FLOAT32},      {"f8", RA_FLOAT64},
        {"f2", RA_FLOAT16},      {"float", RA_FLOAT64},  /* as NumPy's */
        {"double", RA_FLOAT64},  {"half", RA_FLOAT16},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(name, names[i].n) == 0) {
            *out = names[i].t;
            return 1;
        }
    return 0;
}

int ra_dl_dtype_from_name(const char *name, DLDataType *out) {
    static const struct { const char *n; uint8_t code, bits; } ints[] = {
        {"int8", kDLInt, 8},    {"int16", kDLInt, 16},  {"int32", kDLInt, 32},
        {"int64", kDLInt, 64},  {"uint8", kDLUInt, 8},  {"uint16", kDLUInt, 16},
        {"uint32", kDLUInt, 32}, {"uint64", kDLUInt, 64},
    };
    ra_dtype t;
    if (ra_dtype_from_name(name, &t)) {
        dl_dtype_of(t, out);
        return 1;
    }
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        if (strcmp(name, ints[i].n) == 0) {
            out->code = ints[i].code;
            out->bits = ints[i].bits;
            out->lanes = 1;
            return 1;
        }
    return 0;
}

/* "float32", "int64", "bfloat16", ... for any DLPack type */
void ra_dl_dtype_name(DLDataType t, char *buf, size_t n) {
    const char *base;
    switch (t.code) {
    case kDLInt: base = "int"; break;
    case kDLUInt: base = "uint"; break;
    case kDLFloat: base = "float"; break;
    case kDLBfloat: base = "bfloat"; break;
    case kDLComplex: base = "complex"; break;
    case kDLBool: snprintf(buf, n, "bool"); return;
    default: base = "opaque"; break;
    }
    if (t.lanes != 1)
        snprintf(buf, n, "%s%dx%d", base, (int)t.bits, (int)t.lanes);
    else
        snprintf(buf, n, "%s%d", base, (int)t.bits);
}

size_t ra_buffer_elsize(const ra_buffer *b) {
    return ((size_t)b->dl_dtype.bits * b->dl_dtype.lanes + 7) / 8;
}

int64_t ra_buffer_numel(const ra_buffer *b) {
    int64_t n = 1;
    for (int i = 0; i < b->ndim; i++) n *= b->shape[i];
    return n;
}

int ra_buffer_is_contiguous(const ra_buffer *b) {
    int64_t expect = 1;
    for (int i = b->ndim - 1; i >= 0; i--) {
        if (b->shape[i] == 0) return 1;
        if (b->shape[i] != 1 && b->strides[i] != expect) return 0;
        expect *= b->shape[i];
    }
    return 1;
}

ra_buffer *ra_buffer_new_raw(void) {
    ra_buffer *b = PyObject_New(ra_buffer, ra_BufferType);
    if (b == NULL) return NULL;
    b->data = NULL;
    b->device_type = RA_DEV_CPU;
    b->device_id = 0;
    memset(&b->dl_dtype, 0, sizeof b->dl_dtype);
    b->dtype = RA_DTYPE_OTHER;
    b->ndim = 0;
    b->readonly = 0;
    b->block = NULL;
    b->owner = NULL;
    b->weakreflist = NULL;
    return b;
}

/* shape -> total bytes with overflow checks (element count and bytes must
 * both fit in int64). */
static ra_status checked_nbytes(int ndim, const int64_t *shape, size_t elsize,
                                size_t *nbytes) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) {
            ra_set_error(RA_ERR_VALUE,
                         "shape: expected non-negative sizes, got %lld at "
                         "dimension %d",
                         (long long)shape[i], i);
            return RA_ERR_VALUE;
        }
        if (!ra_mul_ok(n, shape[i], &n)) goto overflow;
    }
    int64_t bytes;
    if (!ra_mul_ok(n, (int64_t)elsize, &bytes)) goto overflow;
    *nbytes = (size_t)bytes;
    return RA_OK;
overflow:
    ra_set_error(RA_ERR_OVERFLOW,
                 "shape: the byte size of the requested array overflows a "
                 "64-bit integer");
    return RA_ERR_OVERFLOW;
}

static int same_dl_dtype(DLDataType a, DLDataType b) {
    return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

ra_buffer *ra_buffer_empty(int ndim, const int64_t *shape, ra_dtype dtype,
                           int device_type, int device_id, int zero) {
    DLDataType dl;
    dl_dtype_of(dtype, &dl);
    return ra_buffer_empty_dl(ndim, shape, dl, device_type, device_id, zero);
}

ra_buffer *ra_buffer_empty_dl(int ndim, const int64_t *shape, DLDataType dl,
                              int device_type, int device_id, int zero) {
    if (ndim < 0 || ndim > RA_MAX_NDIM) {
        ra_raise_msg(RA_ERR_VALUE, "shape: too many dimensions");
        return NULL;
    }
    size_t nbytes;
    ra_status st = checked_nbytes(
        ndim, shape, ((size_t)dl.bits * dl.lanes + 7) / 8, &nbytes);
    if (st != RA_OK) {
        ra_raise(st);
        return NULL;
    }
    ra_buffer *b = ra_buffer_new_raw();
    if (b == NULL) return NULL;
    ra_block *blk;
    Py_BEGIN_ALLOW_THREADS
    blk = ra_block_alloc(device_type, device_id, nbytes, zero);
    Py_END_ALLOW_THREADS
    if (blk == NULL) {
        Py_DECREF(b);
        ra_raise(RA_ERR_NOMEM);
        return NULL;
    }
    b->block = blk;
    b->data = blk->ptr;
    b->device_type = device_type;
    b->device_id = device_id;
    b->dl_dtype = dl;
    b->dtype = ra_dtype_from_dl(dl);
    b->ndim = ndim;
    int64_t stride = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        b->shape[i] = shape[i];
        b->strides[i] = stride;
        stride *= shape[i] > 0 ? shape[i] : 1;
    }
    return b;
}

ra_buffer *ra_buffer_view(ra_buffer *base, void *data, int ndim,
                          const int64_t *shape, const int64_t *strides) {
    ra_buffer *b = ra_buffer_new_raw();
    if (b == NULL) return NULL;
    b->data = data;
    b->device_type = base->device_type;
    b->device_id = base->device_id;
    b->dl_dtype = base->dl_dtype;
    b->dtype = base->dtype;
    b->readonly = base->readonly;
    b->ndim = ndim;
    for (int i = 0; i < ndim; i++) {
        b->shape[i] = shape[i];
        b->strides[i] = strides[i];
    }
    if (base->block != NULL) {
        ra_block_incref(base->block);
        b->block = base->block;
    }
    Py_XINCREF(base->owner);
    b->owner = base->owner;
    return b;
}

ra_buffer *ra_buffer_from_object(PyObject *obj, const char *name,
                                 intptr_t stream) {
    if (obj == NULL || obj == Py_None) {
        PyErr_Format(PyExc_TypeError,
                     "%s: expected an array (NumPy, JAX, CuPy, PyTorch or "
                     "any object with __dlpack__), got None",
                     name);
        return NULL;
    }
    /* a call into ringattn: borrowed arrays whose work completed go back */
    ra_cuda_poll_releases();
    if (ra_Buffer_Check(obj)) {
        Py_INCREF(obj);
        return (ra_buffer *)obj;
    }
    if (ra_is_ndarray(obj)) return ra_buffer_from_ndarray(obj, name);
    if (PyObject_HasAttrString(obj, "__dlpack__"))
        return ra_buffer_from_dlpack(obj, name, stream);
    PyErr_Format(PyExc_TypeError,
                 "%s: expected an array (NumPy, JAX, CuPy, PyTorch or any "
                 "object with __dlpack__), got %.200s",
                 name, Py_TYPE(obj)->tp_name);
    return NULL;
}

/* ---- strided copy between buffers (Buffer.copy_, astype, staging) ------ */

#ifdef RA_WITH_CUDA
/* cuda/copy.cu's launcher in the shape ra_cuda_launch takes */
static ra_status copy_on_stream(const void *params, void *stream) {
    return ra_cuda_copy((const ra_copy_params *)params, stream);
}
#else
#define copy_on_stream NULL /* ra_cuda_launch refuses without CUDA */
#endif

ra_status ra_buffer_raw_contiguous(const ra_buffer *dst, const ra_buffer *src,
                                   const char *kind) {
    if (ra_buffer_is_contiguous(dst) && ra_buffer_is_contiguous(src))
        return RA_OK;
    ra_set_error(RA_ERR_UNSUPPORTED,
                 "copy: a %s copy of a non-float dtype needs contiguous "
                 "source and destination",
                 kind);
    return RA_ERR_UNSUPPORTED;
}

ra_status ra_buffer_copy_into(ra_buffer *dst, ra_buffer *src) {
    return ra_buffer_copy_mode(dst, src, 0);
}

ra_status ra_buffer_copy_mode(ra_buffer *dst, ra_buffer *src,
                              int accumulate) {
    if (dst->readonly) {
        ra_set_error(RA_ERR_VALUE, "copy: the destination is read-only");
        return RA_ERR_VALUE;
    }
    /* one non-float type on both sides: the elements as they are */
    const int raw = dst->dtype == RA_DTYPE_OTHER &&
                    src->dtype == RA_DTYPE_OTHER &&
                    same_dl_dtype(dst->dl_dtype, src->dl_dtype);
    if ((!raw || accumulate) &&
        (dst->dtype == RA_DTYPE_OTHER || src->dtype == RA_DTYPE_OTHER)) {
        char dn[32], sn[32];
        ra_dl_dtype_name(dst->dl_dtype, dn, sizeof dn);
        ra_dl_dtype_name(src->dl_dtype, sn, sizeof sn);
        ra_set_error(RA_ERR_TYPE,
                     "copy: expected float32, float64, float16 or bfloat16 "
                     "buffers, or one other dtype on both sides; got %s from "
                     "%s",
                     dn, sn);
        return RA_ERR_TYPE;
    }
    if (dst->ndim != src->ndim) goto shape_mismatch;
    for (int i = 0; i < dst->ndim; i++)
        if (dst->shape[i] != src->shape[i]) goto shape_mismatch;
    const int same_memory =
        (ra_buffer_on_host(dst) && ra_buffer_on_host(src)) ||
        (dst->device_type == src->device_type &&
         dst->device_id == src->device_id);
    if (!same_memory && accumulate) {
        ra_set_error(RA_ERR_VALUE, "add: both buffers must be on one device");
        return RA_ERR_VALUE;
    }
    if (!same_memory) return ra_buffer_copy_across(dst, src, raw);
    if (ra_buffer_overlaps(dst, src))
        return ra_buffer_copy_overlapping(dst, src);
    ra_copy_params p;
    memset(&p, 0, sizeof p);
    p.ndim = dst->ndim;
    for (int i = 0; i < dst->ndim; i++) {
        p.shape[i] = dst->shape[i];
        p.src_strides[i] = src->strides[i];
        p.dst_strides[i] = dst->strides[i];
    }
    p.src = src->data;
    p.dst = dst->data;
    p.src_dtype = src->dtype;
    p.dst_dtype = dst->dtype;
    p.other_elsize = raw ? ra_buffer_elsize(dst) : 0;
    p.accumulate = accumulate;
    ra_status st;
    if (raw && dst->device_type == RA_DEV_CUDA) {
        /* the CUDA copy kernel converts floats; other elements move as
         * bytes */
        RA_CHECK(ra_buffer_raw_contiguous(dst, src, "CUDA"));
        const size_t nbytes =
            (size_t)ra_buffer_numel(dst) * ra_buffer_elsize(dst);
        if (nbytes == 0) return RA_OK;
        Py_BEGIN_ALLOW_THREADS
        st = ra_cuda_memcpy(dst->device_id, dst->data, 1, src->data, 1, nbytes,
                            0);
        Py_END_ALLOW_THREADS
    } else if (dst->device_type == RA_DEV_CUDA) {
        st = ra_cuda_launch(dst->device_id, copy_on_stream, &p);
    } else {
        Py_BEGIN_ALLOW_THREADS
        st = ra_cpu_copy(&p);
        Py_END_ALLOW_THREADS
    }
    return st;
shape_mismatch:
    ra_set_error(RA_ERR_VALUE, "copy: source and destination shapes differ");
    return RA_ERR_VALUE;
}

/* ---- the Python type --------------------------------------------------- */

static void buffer_dealloc(PyObject *self) {
    ra_buffer *b = (ra_buffer *)self;
    PyTypeObject *tp = Py_TYPE(self);
    if (b->weakreflist != NULL) PyObject_ClearWeakRefs(self);
    ra_block *blk = b->block;
    b->block = NULL;
    if (blk != NULL) {
        if (blk->device_type == RA_DEV_CUDA) {
            /* freeing device memory may synchronise: drop the GIL */
            Py_BEGIN_ALLOW_THREADS
            ra_block_decref(blk);
            Py_END_ALLOW_THREADS
        } else {
            ra_block_decref(blk);
        }
    }
    Py_CLEAR(b->owner);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *buffer_new(PyTypeObject *type, PyObject *args,
                            PyObject *kwds) {
    static char *kwlist[] = {"obj", NULL};
    PyObject *obj;
    (void)type;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Buffer", kwlist, &obj))
        return NULL;
    return (PyObject *)ra_buffer_from_object(obj, "obj", -1);
}

static PyObject *buffer_get_shape(PyObject *self, void *c) {
    ra_buffer *b = (ra_buffer *)self;
    (void)c;
    PyObject *t = PyTuple_New(b->ndim);
    if (t == NULL) return NULL;
    for (int i = 0; i < b->ndim; i++)
        PyTuple_SET_ITEM(t, i, PyLong_FromLongLong(b->shape[i]));
    return t;
}

static PyObject *buffer_get_strides(PyObject *self, void *c) {
    ra_buffer *b = (ra_buffer *)self;
    (void)c;
    PyObject *t = PyTuple_New(b->ndim);
    if (t == NULL) return NULL;
    for (int i = 0; i < b->ndim; i++)
        PyTuple_SET_ITEM(t, i, PyLong_FromLongLong(b->strides[i]));
    return t;
}

static PyObject *buffer_get_dtype(PyObject *self, void *c) {
    ra_buffer *b = (ra_buffer *)self;
    char name[32];
    (void)c;
    if (b->dl_dtype.code == kDLBfloat && b->dl_dtype.bits == 16 &&
        b->dl_dtype.lanes == 1)
        return PyUnicode_FromString("bfloat16");
    ra_dl_dtype_name(b->dl_dtype, name, sizeof name);
    return PyUnicode_FromString(name);
}

const char *ra_device_name(int device_type) {
    switch (device_type) {
    case RA_DEV_CPU: return "cpu";
    case RA_DEV_CUDA: return "cuda";
    case RA_DEV_CUDA_HOST: return "cuda_host";
    case RA_DEV_CUDA_MANAGED: return "cuda_managed";
    default: return "other";
    }
}

static PyObject *buffer_get_device(PyObject *self, void *c) {
    ra_buffer *b = (ra_buffer *)self;
    (void)c;
    return Py_BuildValue("(si)", ra_device_name(b->device_type), b->device_id);
}

static PyObject *buffer_get_ndim(PyObject *self, void *c) {
    (void)c;
    return PyLong_FromLong(((ra_buffer *)self)->ndim);
}

static PyObject *buffer_get_nbytes(PyObject *self, void *c) {
    ra_buffer *b = (ra_buffer *)self;
    (void)c;
    return PyLong_FromLongLong(ra_buffer_numel(b) *
                               (int64_t)ra_buffer_elsize(b));
}

static PyObject *buffer_get_itemsize(PyObject *self, void *c) {
    (void)c;
    return PyLong_FromSize_t(ra_buffer_elsize((ra_buffer *)self));
}

static PyObject *buffer_get_data_ptr(PyObject *self, void *c) {
    (void)c;
    return PyLong_FromVoidPtr(((ra_buffer *)self)->data);
}

static PyObject *buffer_get_readonly(PyObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(((ra_buffer *)self)->readonly);
}

static PyObject *buffer_get_contiguous(PyObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(ra_buffer_is_contiguous((ra_buffer *)self));
}

static PyObject *buffer_get_owns(PyObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(((ra_buffer *)self)->block != NULL);
}

static PyGetSetDef buffer_getset[] = {
    {"shape", buffer_get_shape, NULL, "tuple of sizes", NULL},
    {"strides", buffer_get_strides, NULL, "tuple of strides in elements", NULL},
    {"dtype", buffer_get_dtype, NULL, "element type name, e.g. 'float32'",
     NULL},
    {"device", buffer_get_device, NULL, "(kind, index), e.g. ('cpu', 0)", NULL},
    {"ndim", buffer_get_ndim, NULL, "number of dimensions", NULL},
    {"nbytes", buffer_get_nbytes, NULL, "bytes spanned by the elements", NULL},
    {"itemsize", buffer_get_itemsize, NULL, "bytes per element", NULL},
    {"data_ptr", buffer_get_data_ptr, NULL, "address of element [0,...,0]",
     NULL},
    {"readonly", buffer_get_readonly, NULL, "True if writes are refused", NULL},
    {"is_contiguous", buffer_get_contiguous, NULL, "row-major compact", NULL},
    {"owns_memory", buffer_get_owns, NULL,
     "True if ringattn allocated the memory", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *buffer_numpy(PyObject *self, PyObject *unused) {
    (void)unused;
    return ra_buffer_to_ndarray((ra_buffer *)self);
}

/* narrow(axis, start, length, step=1): view of rows start, start+step, ...
 * (length of them) along axis */
static PyObject *buffer_narrow(PyObject *self, PyObject *args) {
    ra_buffer *b = (ra_buffer *)self;
    int axis;
    long long start, length, step = 1;
    if (!PyArg_ParseTuple(args, "iLL|L:narrow", &axis, &start, &length, &step))
        return NULL;
    if (axis < 0) axis += b->ndim;
    if (axis < 0 || axis >= b->ndim) {
        PyErr_Format(PyExc_ValueError,
                     "axis: expected -%d <= axis < %d, got %d", b->ndim,
                     b->ndim, axis);
        return NULL;
    }
    if (step < 1) {
        PyErr_Format(PyExc_ValueError, "step: expected >= 1, got %lld", step);
        return NULL;
    }
    long long last = length > 0 ? start + (length - 1) * step : start - 1;
    if (start < 0 || length < 0 || (length > 0 && last >= b->shape[axis]) ||
        (length == 0 && start > b->shape[axis])) {
        PyErr_Format(PyExc_ValueError,
                     "narrow: rows start=%lld length=%lld step=%lld do not fit "
                     "in a dimension of size %lld",
                     start, length, step, (long long)b->shape[axis]);
        return NULL;
    }
    int64_t shape[RA_MAX_NDIM], strides[RA_MAX_NDIM];
    memcpy(shape, b->shape, sizeof shape);
    memcpy(strides, b->strides, sizeof strides);
    shape[axis] = length;
    strides[axis] = length > 1 ? b->strides[axis] * step : b->strides[axis];
    char *data = (char *)b->data;
    if (length > 0)
        data += (int64_t)start * b->strides[axis] *
                (int64_t)ra_buffer_elsize(b);
    return (PyObject *)ra_buffer_view(b, data, b->ndim, shape, strides);
}

/* reshape(shape): only for contiguous buffers */
static PyObject *buffer_reshape(PyObject *self, PyObject *arg) {
    ra_buffer *b = (ra_buffer *)self;
    int64_t shape[RA_MAX_NDIM], strides[RA_MAX_NDIM];
    PyObject *seq = PySequence_Fast(arg, "reshape: expected a sequence of ints");
    if (seq == NULL) return NULL;
    Py_ssize_t nd = PySequence_Fast_GET_SIZE(seq);
    if (nd > RA_MAX_NDIM) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "reshape: at most %d dimensions",
                     RA_MAX_NDIM);
        return NULL;
    }
    int64_t n = 1;
    for (Py_ssize_t i = 0; i < nd; i++) {
        shape[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (shape[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        if (shape[i] < 0 || !ra_mul_ok(n, shape[i], &n)) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "reshape: invalid shape");
            return NULL;
        }
    }
    Py_DECREF(seq);
    if (n != ra_buffer_numel(b)) {
        PyErr_Format(PyExc_ValueError,
                     "reshape: expected a shape with %lld elements, got %lld",
                     (long long)ra_buffer_numel(b), (long long)n);
        return NULL;
    }
    if (!ra_buffer_is_contiguous(b)) {
        PyErr_SetString(PyExc_ValueError,
                        "reshape: the buffer is not contiguous");
        return NULL;
    }
    int64_t s = 1;
    for (Py_ssize_t i = nd - 1; i >= 0; i--) {
        strides[i] = s;
        s *= shape[i] > 0 ? shape[i] : 1;
    }
    return (PyObject *)ra_buffer_view(b, b->data, (int)nd, shape, strides);
}

/* copy_(src): copy src (same shape, same device; float dtypes converted,
 * or one other dtype on both sides) into self */
static PyObject *buffer_copy_(PyObject *self, PyObject *arg) {
    ra_buffer *dst = (ra_buffer *)self;
    ra_buffer *src = ra_buffer_from_object(arg, "src", -1);
    if (src == NULL) return NULL;
    ra_status st = ra_buffer_copy_into(dst, src);
    Py_DECREF(src);
    if (st != RA_OK) return ra_raise(st);
    Py_INCREF(self);
    return self;
}

/* astype(dtype): new contiguous buffer with the elements converted */
static PyObject *buffer_astype(PyObject *self, PyObject *arg) {
    ra_buffer *b = (ra_buffer *)self;
    DLDataType dl;
    if (!ra_dtype_arg(arg, "dtype", 1, &dl)) return NULL;
    ra_buffer *out = ra_buffer_empty(b->ndim, b->shape, ra_dtype_from_dl(dl),
                                     b->device_type, b->device_id, 0);
    if (out == NULL) return NULL;
    ra_status st = ra_buffer_copy_into(out, b);
    if (st != RA_OK) {
        Py_DECREF(out);
        return ra_raise(st);
    }
    return (PyObject *)out;
}

static PyObject *buffer_zero_(PyObject *self, PyObject *unused) {
    ra_buffer *b = (ra_buffer *)self;
    (void)unused;
    if (b->readonly) {
        PyErr_SetString(PyExc_ValueError, "zero_: the buffer is read-only");
        return NULL;
    }
    if (!ra_buffer_is_contiguous(b)) {
        PyErr_SetString(PyExc_ValueError, "zero_: the buffer is not contiguous");
        return NULL;
    }
    size_t nbytes = (size_t)ra_buffer_numel(b) * ra_buffer_elsize(b);
    ra_status st = RA_OK;
    if (nbytes > 0) {
        Py_BEGIN_ALLOW_THREADS
        if (b->device_type == RA_DEV_CUDA)
            st = ra_cuda_memset_zero(b->device_id, b->data, nbytes);
        else
            memset(b->data, 0, nbytes);
        Py_END_ALLOW_THREADS
    }
    if (st != RA_OK) return ra_raise(st);
    Py_INCREF(self);
    return self;
}

static PyObject *buffer_reduce(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyErr_SetString(PyExc_TypeError,
                    "ringattn.Buffer cannot be pickled (it wraps memory); "
                    "convert it with numpy.from_dlpack first");
    return NULL;
}

static PyObject *buffer_repr(PyObject *self) {
    ra_buffer *b = (ra_buffer *)self;
    char shape[256];
    char dt[32];
    size_t pos = 0;
    shape[0] = '\0';
    for (int i = 0; i < b->ndim && pos < sizeof shape - 24; i++)
        pos += (size_t)snprintf(shape + pos, sizeof shape - pos, "%s%lld",
                                i ? ", " : "", (long long)b->shape[i]);
    if (b->dl_dtype.code == kDLBfloat && b->dl_dtype.bits == 16)
        snprintf(dt, sizeof dt, "bfloat16");
    else
        ra_dl_dtype_name(b->dl_dtype, dt, sizeof dt);
    return PyUnicode_FromFormat("ringattn.Buffer(shape=(%s%s), dtype=%s, "
                                "device=%s:%d)",
                                shape, b->ndim == 1 ? "," : "", dt,
                                b->device_type == RA_DEV_CUDA ? "cuda" : "cpu",
                                b->device_id);
}

static PyMethodDef buffer_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))ra_buffer_dlpack,
     METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None)"
     "\n\nExport as a DLPack capsule (versioned when max_version >= (1, 0))."},
    {"__dlpack_device__", ra_buffer_dlpack_device, METH_NOARGS,
     "(device_type, device_id) as DLPack codes"},
    {"numpy", buffer_numpy, METH_NOARGS,
     "A NumPy array viewing the same host memory (bfloat16 via ml_dtypes)."},
    {"narrow", buffer_narrow, METH_VARARGS,
     "narrow(axis, start, length, step=1) -> view of rows start, start+step, "
     "... (length of them) on axis"},
    {"reshape", buffer_reshape, METH_O, "reshape(shape) of a contiguous buffer"},
    {"copy_", buffer_copy_, METH_O,
     "copy_(src): copy src (same shape) into self: float dtypes are "
     "converted; other dtypes (integer ids) must match.  Within one device, "
     "or between the host and a CUDA device (then finished on return)"},
    {"astype", buffer_astype, METH_O,
     "astype(dtype) -> new contiguous buffer with converted elements"},
    {"zero_", buffer_zero_, METH_NOARGS, "fill a contiguous buffer with zeros"},
    {"__reduce__", buffer_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef buffer_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(ra_buffer, weakreflist),
     READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot buffer_slots[] = {
    {Py_tp_dealloc, buffer_dealloc},
    {Py_tp_new, buffer_new},
    {Py_tp_repr, buffer_repr},
    {Py_tp_getset, buffer_getset},
    {Py_tp_methods, buffer_methods},
    {Py_tp_members, buffer_members},
    {Py_tp_doc,
     "Buffer(obj)\n\nAn n-d strided view of host or device memory, owned by "
     "ringattn or borrowed zero-copy from any DLPack producer or NumPy array. "
     "Exports DLPack (__dlpack__, __dlpack_device__)."},
    {0, NULL},
};

static PyType_Spec buffer_spec = {
    .name = "ringattn.Buffer",
    .basicsize = sizeof(ra_buffer),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = buffer_slots,
};

int ra_buffer_exec(PyObject *m, ra_module_state *st) {
    st->BufferType =
        (PyTypeObject *)PyType_FromModuleAndSpec(m, &buffer_spec, NULL);
    if (st->BufferType == NULL) return -1;
    ra_BufferType = st->BufferType;
    if (PyModule_AddType(m, st->BufferType) < 0) return -1;
    return PyModule_AddFunctions(m, ra_buffer_functions);
}
