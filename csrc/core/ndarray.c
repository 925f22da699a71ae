/*
 * ndarray.c -- the NumPy bridge of Buffer, and the only file that uses the
 * NumPy C API.  Built against NumPy >= 2 headers with a 1.22 target so the
 * same binary runs on NumPy 1.x and 2.x.
 *
 * NumPy arrays are wrapped directly (not through __dlpack__) because NumPy
 * cannot export ml_dtypes' bfloat16 through DLPack, and because wrapping is
 * cheaper.  Byte strides that are not whole elements, and non-native byte
 * order, are refused with a clear error rather than mis-read.
 */
#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#define NPY_TARGET_VERSION NPY_1_22_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL ra_ARRAY_API
#include "core/ndarray.h"

#include <numpy/arrayobject.h>
#include <string.h>

#include "core/module.h"

int ra_ndarray_init(void) {
    import_array1(-1);
    return 0;
}

int ra_is_ndarray(PyObject *obj) { return PyArray_Check(obj); }

/* our own names first (NumPy does not know "bfloat16" without ml_dtypes),
 * then whatever np.dtype() makes of obj, by its name */
static int known_dtype(PyObject *obj, int float_only, DLDataType *out) {
    if (PyUnicode_Check(obj)) {
        const char *s = PyUnicode_AsUTF8(obj);
        if (s == NULL) {
            PyErr_Clear();
            return 0;
        }
        if (ra_dl_dtype_from_name(s, out))
            return !float_only || ra_dtype_from_dl(*out) != RA_DTYPE_OTHER;
    }
    PyArray_Descr *descr = NULL;
    if (obj == Py_None || !PyArray_DescrConverter2(obj, &descr) ||
        descr == NULL) {
        PyErr_Clear();
        return 0;
    }
    PyObject *name = PyObject_GetAttrString((PyObject *)descr, "name");
    Py_DECREF(descr);
    const char *s = name != NULL ? PyUnicode_AsUTF8(name) : NULL;
    int ok = s != NULL && ra_dl_dtype_from_name(s, out) &&
             (!float_only || ra_dtype_from_dl(*out) != RA_DTYPE_OTHER);
    Py_XDECREF(name);
    PyErr_Clear();
    return ok;
}

int ra_dtype_arg(PyObject *obj, const char *arg, int float_only,
                 DLDataType *out) {
    if (known_dtype(obj, float_only, out)) return 1;
    PyErr_Format(PyExc_TypeError,
                 "%s: expected one of float32, float64, float16, bfloat16%s "
                 "(a name, a NumPy dtype or scalar type), got %.200R",
                 arg,
                 float_only ? "" : ", int8, int16, int32, int64, uint8, "
                                   "uint16, uint32, uint64",
                 obj);
    return 0;
}

static int is_bfloat16_descr(PyArray_Descr *d) {
    if (d->kind != 'V') return 0;
    PyTypeObject *tp = d->typeobj;
    if (tp == NULL) return 0;
    const char *name = strrchr(tp->tp_name, '.');
    name = name ? name + 1 : tp->tp_name;
    return strcmp(name, "bfloat16") == 0;
}

ra_buffer *ra_buffer_from_ndarray(PyObject *obj, const char *name) {
    PyArrayObject *arr = (PyArrayObject *)obj;
    PyArray_Descr *d = PyArray_DESCR(arr);
    int nd = PyArray_NDIM(arr);
    npy_intp itemsize = PyArray_ITEMSIZE(arr);
    DLDataType dt;
    dt.lanes = 1;

    if (nd > RA_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected at most %d dimensions, got %d", name,
                     RA_MAX_NDIM, nd);
        return NULL;
    }
    if (is_bfloat16_descr(d) && itemsize == 2) {
        dt.code = kDLBfloat;
    } else {
        switch (d->kind) {
        case 'f': dt.code = kDLFloat; break;
        case 'i': dt.code = kDLInt; break;
        case 'u': dt.code = kDLUInt; break;
        case 'b': dt.code = kDLBool; break;
        case 'c': dt.code = kDLComplex; break;
        default:
            PyErr_Format(PyExc_TypeError,
                         "%s: expected a numeric array, got NumPy dtype %S",
                         name, (PyObject *)d);
            return NULL;
        }
        if (itemsize * 8 > 255) {   /* DLPack counts bits in a uint8 */
            PyErr_Format(PyExc_TypeError,
                         "%s: unsupported NumPy dtype %S (%lld-byte items; "
                         "DLPack describes at most 31 bytes)",
                         name, (PyObject *)d, (long long)itemsize);
            return NULL;
        }
        if (d->kind == 'f' && itemsize != 2 && itemsize != 4 && itemsize != 8) {
            PyErr_Format(PyExc_TypeError,
                         "%s: expected float16, float32 or float64, got NumPy "
                         "dtype %S",
                         name, (PyObject *)d);
            return NULL;
        }
    }
    dt.bits = (uint8_t)(itemsize * 8);
    if (!PyArray_ISNOTSWAPPED(arr)) {
        PyErr_Format(PyExc_TypeError,
                     "%s: arrays in non-native byte order are not supported "
                     "(use arr.astype(arr.dtype.newbyteorder('=')))",
                     name);
        return NULL;
    }
    ra_buffer *b = ra_buffer_new_raw();
    if (b == NULL) return NULL;
    b->data = PyArray_DATA(arr);
    b->device_type = RA_DEV_CPU;
    b->device_id = 0;
    b->dl_dtype = dt;
    b->dtype = ra_dtype_from_dl(dt);
    b->ndim = nd;
    b->readonly = !PyArray_ISWRITEABLE(arr);
    const npy_intp *dims = PyArray_DIMS(arr);
    const npy_intp *strides = PyArray_STRIDES(arr);
    for (int i = 0; i < nd; i++) {
        b->shape[i] = dims[i];
        if (dims[i] > 1 && strides[i] % itemsize != 0) {
            PyErr_Format(PyExc_ValueError,
                         "%s: byte stride %lld of dimension %d is not a "
                         "multiple of the item size %lld; make the array "
                         "contiguous first",
                         name, (long long)strides[i], i, (long long)itemsize);
            Py_DECREF(b);
            return NULL;
        }
        b->strides[i] = dims[i] > 1 ? strides[i] / itemsize : 0;
    }
    /* size-1 dimensions get the compact stride so contiguity checks work */
    {
        int64_t s = 1;
        for (int i = nd - 1; i >= 0; i--) {
            if (b->shape[i] <= 1) b->strides[i] = s;
            s *= b->shape[i] > 0 ? b->shape[i] : 1;
        }
    }
    Py_INCREF(obj);
    b->owner = obj;
    return b;
}

static PyArray_Descr *descr_for(ra_buffer *b) {
    DLDataType t = b->dl_dtype;
    if (t.lanes != 1) goto unsupported;
    if (t.code == kDLBfloat && t.bits == 16) {
        PyObject *mod = PyImport_ImportModule("ml_dtypes");
        if (mod == NULL) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError,
                            "bfloat16 NumPy arrays need the ml_dtypes package "
                            "(pip install ml_dtypes)");
            return NULL;
        }
        PyObject *tp = PyObject_GetAttrString(mod, "bfloat16");
        Py_DECREF(mod);
        if (tp == NULL) return NULL;
        PyArray_Descr *d = NULL;
        int ok = PyArray_DescrConverter(tp, &d);
        Py_DECREF(tp);
        return ok ? d : NULL;
    }
    int typenum = -1;
    switch (t.code) {
    case kDLFloat:
        typenum = t.bits == 16 ? NPY_FLOAT16 : t.bits == 32 ? NPY_FLOAT32
                : t.bits == 64 ? NPY_FLOAT64 : -1;
        break;
    case kDLInt:
        typenum = t.bits == 8 ? NPY_INT8 : t.bits == 16 ? NPY_INT16
                : t.bits == 32 ? NPY_INT32 : t.bits == 64 ? NPY_INT64 : -1;
        break;
    case kDLUInt:
        typenum = t.bits == 8 ? NPY_UINT8 : t.bits == 16 ? NPY_UINT16
                : t.bits == 32 ? NPY_UINT32 : t.bits == 64 ? NPY_UINT64 : -1;
        break;
    case kDLBool: typenum = t.bits == 8 ? NPY_BOOL : -1; break;
    case kDLComplex:
        typenum = t.bits == 64 ? NPY_COMPLEX64 : t.bits == 128 ? NPY_COMPLEX128
                                                               : -1;
        break;
    default: break;
    }
    if (typenum >= 0) return PyArray_DescrFromType(typenum);
unsupported:
    PyErr_SetString(PyExc_TypeError,
                    "the buffer's dtype has no NumPy equivalent");
    return NULL;
}

PyObject *ra_buffer_to_ndarray(ra_buffer *b) {
    if (b->device_type != RA_DEV_CPU && b->device_type != RA_DEV_CUDA_HOST) {
        PyErr_SetString(PyExc_TypeError,
                        "numpy(): the buffer lives on a CUDA device; copy it "
                        "to the host first");
        return NULL;
    }
    PyArray_Descr *d = descr_for(b);
    if (d == NULL) return NULL;
    npy_intp dims[RA_MAX_NDIM], strides[RA_MAX_NDIM];
    npy_intp itemsize = (npy_intp)ra_buffer_elsize(b);
    for (int i = 0; i < b->ndim; i++) {
        dims[i] = (npy_intp)b->shape[i];
        strides[i] = (npy_intp)(b->strides[i] * itemsize);
    }
    int flags = b->readonly ? 0 : NPY_ARRAY_WRITEABLE;
    /* PyArray_NewFromDescr steals the descr reference */
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, d, b->ndim, dims,
                                         strides, b->data, flags, NULL);
    if (arr == NULL) return NULL;
    Py_INCREF(b);
    if (PyArray_SetBaseObject((PyArrayObject *)arr, (PyObject *)b) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}
