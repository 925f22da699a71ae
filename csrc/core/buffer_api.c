/*
 * buffer_api.c -- module-level functions around Buffer: empty/zeros (owned
 * memory on the host or a CUDA device), from_dlpack (zero-copy import of any
 * array), and the allocation statistics behind ra.memory_stats().
 */
#include "core/buffer.h"
#include "core/cuda_rt.h"
#include "core/module.h"
#include "core/ndarray.h"

/* ---- module functions -------------------------------------------------- */

/* shape: a sequence of ints, or one int (as NumPy takes it) */
static int parse_shape(PyObject *obj, int *ndim, int64_t *shape) {
    PyObject *seq;
    if (PyIndex_Check(obj) && !PyBool_Check(obj) && !PySequence_Check(obj)) {
        PyObject *one = PyNumber_Index(obj);
        seq = one != NULL ? PyTuple_Pack(1, one) : NULL;
        Py_XDECREF(one);
    } else {
        seq = PySequence_Fast(obj, "shape: expected an int or a sequence of "
                                   "ints");
    }
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > RA_MAX_NDIM) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError,
                     "shape: expected at most %d dimensions, got %zd",
                     RA_MAX_NDIM, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        /* ints and NumPy integers (anything with __index__ but a bool) */
        PyObject *idx = PyBool_Check(item) || !PyIndex_Check(item)
                            ? NULL
                            : PyNumber_Index(item);
        if (idx == NULL) {
            Py_DECREF(seq);
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "shape: expected ints, got %.100s at position %zd",
                         Py_TYPE(item)->tp_name, i);
            return -1;
        }
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
        Py_DECREF(idx);
        if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
            Py_DECREF(seq);
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError,
                         "shape: size at position %zd does not fit in 64 bits",
                         i);
            return -1;
        }
        if (v < 0) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError,
                         "shape: expected non-negative sizes, got %lld at "
                         "position %zd",
                         v, i);
            return -1;
        }
        shape[i] = v;
    }
    *ndim = (int)n;
    Py_DECREF(seq);
    return 0;
}

static PyObject *make_buffer(PyObject *args, PyObject *kwds, int zero) {
    static char *kwlist[] = {"shape", "dtype", "device_type", "device_id", NULL};
    PyObject *shape_obj, *dtype_obj = NULL;
    int device_type = RA_DEV_CPU, device_id = 0;
    int ndim;
    int64_t shape[RA_MAX_NDIM];
    DLDataType t = {kDLFloat, 32, 1};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|Oii", kwlist, &shape_obj,
                                     &dtype_obj, &device_type, &device_id))
        return NULL;
    if (parse_shape(shape_obj, &ndim, shape) < 0) return NULL;
    if (dtype_obj != NULL && dtype_obj != Py_None &&
        !ra_dtype_arg(dtype_obj, "dtype", 0, &t))
        return NULL;
    if (device_type != RA_DEV_CPU && device_type != RA_DEV_CUDA) {
        PyErr_Format(PyExc_ValueError,
                     "device: expected cpu (1) or cuda (2), got device type %d",
                     device_type);
        return NULL;
    }
    if (device_type == RA_DEV_CUDA) {
        const char *why = NULL;
        int available;
        Py_BEGIN_ALLOW_THREADS     /* the first probe initialises the driver */
        available = ra_cuda_available(&why);
        Py_END_ALLOW_THREADS
        if (!available) {
            PyErr_Format(PyExc_RuntimeError,
                         "device: a CUDA buffer, but no CUDA device is "
                         "usable: %s",
                         why ? why : "unknown reason");
            return NULL;
        }
        const int count = ra_cuda_device_count();
        if (device_id < 0 || device_id >= count) {
            PyErr_Format(PyExc_ValueError,
                         "device: expected a CUDA device index 0..%d, got %d",
                         count - 1, device_id);
            return NULL;
        }
    }
    return (PyObject *)ra_buffer_empty_dl(ndim, shape, t, device_type,
                                          device_id, zero);
}

static PyObject *mod_empty(PyObject *m, PyObject *args, PyObject *kwds) {
    (void)m;
    return make_buffer(args, kwds, 0);
}

static PyObject *mod_zeros(PyObject *m, PyObject *args, PyObject *kwds) {
    (void)m;
    return make_buffer(args, kwds, 1);
}

static PyObject *mod_from_dlpack(PyObject *m, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"obj", "name", NULL};
    PyObject *obj;
    const char *name = "obj";
    (void)m;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|s:from_dlpack", kwlist,
                                     &obj, &name))
        return NULL;
    return (PyObject *)ra_buffer_from_object(obj, name, -1);
}

static PyObject *mod_memory_stats(PyObject *m, PyObject *unused) {
    static const char *kinds[RA_MEMKIND_COUNT] = {"cpu", "cuda"};
    (void)m;
    (void)unused;
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    for (int k = 0; k < RA_MEMKIND_COUNT; k++) {
        int64_t cur, peak, n;
        ra_memstats_get(k, &cur, &peak, &n);
        PyObject *e = Py_BuildValue("{s:L,s:L,s:L}", "current", (long long)cur,
                                    "peak", (long long)peak, "allocations",
                                    (long long)n);
        if (e == NULL || PyDict_SetItemString(d, kinds[k], e) < 0) {
            Py_XDECREF(e);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(e);
    }
    return d;
}

static PyObject *mod_reset_peak(PyObject *m, PyObject *unused) {
    (void)m;
    (void)unused;
    for (int k = 0; k < RA_MEMKIND_COUNT; k++) ra_memstats_reset_peak(k);
    Py_RETURN_NONE;
}

/* add_(dst, src): dst += src */
static PyObject *mod_add_(PyObject *m, PyObject *args) {
    (void)m;
    PyObject *dst_obj, *src_obj;
    if (!PyArg_ParseTuple(args, "OO:add_", &dst_obj, &src_obj)) return NULL;
    ra_buffer *dst = ra_buffer_from_object(dst_obj, "dst", -1);
    if (dst == NULL) return NULL;
    ra_buffer *src = ra_buffer_from_object(src_obj, "src", -1);
    if (src == NULL) {
        Py_DECREF(dst);
        return NULL;
    }
    ra_status st = ra_buffer_copy_mode(dst, src, 1);
    Py_DECREF(src);
    if (st != RA_OK) {
        Py_DECREF(dst);
        return ra_raise(st);
    }
    return (PyObject *)dst;
}

PyMethodDef ra_buffer_functions[] = {
    {"add_", mod_add_, METH_VARARGS,
     "add_(dst, src) -> dst: dst += src elementwise (same shape, one device, "
     "float dtypes; float32 sums, float64 when a side is float64)"},
    {"empty", (PyCFunction)(void (*)(void))mod_empty,
     METH_VARARGS | METH_KEYWORDS,
     "empty(shape, dtype='float32', device_type=1, device_id=0) -> Buffer"},
    {"zeros", (PyCFunction)(void (*)(void))mod_zeros,
     METH_VARARGS | METH_KEYWORDS,
     "zeros(shape, dtype='float32', device_type=1, device_id=0) -> Buffer"},
    {"from_dlpack", (PyCFunction)(void (*)(void))mod_from_dlpack,
     METH_VARARGS | METH_KEYWORDS,
     "from_dlpack(obj, name='obj') -> Buffer viewing obj's memory"},
    {"memory_stats", mod_memory_stats, METH_NOARGS,
     "bytes ringattn allocated, per device kind: current, peak, allocations"},
    {"reset_peak_memory_stats", mod_reset_peak, METH_NOARGS,
     "set every peak to the current value"},
    {NULL, NULL, 0, NULL},
};

