/*
 * dlpack.c -- Buffer <-> DLPack.
 *
 * Producer (__dlpack__): one PyMem_RawMalloc block holds the managed tensor
 * and its shape/strides; manager_ctx keeps the Buffer alive.  The deleter may
 * run on any thread: it takes the GIL to drop the Buffer, and at interpreter
 * shutdown it leaks rather than touch a dying interpreter.  Strides are
 * always filled.
 *
 * Consumer (ra_buffer_from_dlpack): asks for a versioned capsule, falls back
 * to the legacy one, checks the major version, device, dtype lanes, strides
 * and read-only flag, and renames the capsule to used_dltensor[_versioned]
 * only after every check passed.  The imported tensor's deleter runs exactly
 * once, when the last Buffer viewing it goes away.
 */
#include "core/buffer.h"

#include <stdio.h>
#include <string.h>

#include "core/cuda_rt.h"
#include "core/module.h"

/* ---- producer ---------------------------------------------------------- */

typedef struct {
    DLManagedTensorVersioned versioned;
    DLManagedTensor legacy;
    int is_versioned;
    int64_t shape[RA_MAX_NDIM];
    int64_t strides[RA_MAX_NDIM];
} ra_export_block;

static void export_release_ctx(void *ctx) {
    PyObject *owner = (PyObject *)ctx;
    if (owner == NULL) return;
    if (Py_IsInitialized() == 0
#if PY_VERSION_HEX >= 0x030D0000
        || Py_IsFinalizing()
#else
        || _Py_IsFinalizing()
#endif
    )
        return; /* leak rather than crash at shutdown */
    PyGILState_STATE g = PyGILState_Ensure();
    Py_DECREF(owner);
    PyGILState_Release(g);
}

static void export_deleter_versioned(DLManagedTensorVersioned *self) {
    ra_export_block *blk = (ra_export_block *)self;
    export_release_ctx(self->manager_ctx);
    PyMem_RawFree(blk);
}

static void export_deleter_legacy(DLManagedTensor *self) {
    ra_export_block *blk =
        (ra_export_block *)((char *)self - offsetof(ra_export_block, legacy));
    export_release_ctx(self->manager_ctx);
    PyMem_RawFree(blk);
}

static void capsule_destructor_versioned(PyObject *cap) {
    if (PyCapsule_IsValid(cap, "used_dltensor_versioned")) return;
    DLManagedTensorVersioned *mt = (DLManagedTensorVersioned *)
        PyCapsule_GetPointer(cap, "dltensor_versioned");
    if (mt == NULL) {
        PyErr_WriteUnraisable(cap);
        return;
    }
    if (mt->deleter) mt->deleter(mt);
}

static void capsule_destructor_legacy(PyObject *cap) {
    if (PyCapsule_IsValid(cap, "used_dltensor")) return;
    DLManagedTensor *mt =
        (DLManagedTensor *)PyCapsule_GetPointer(cap, "dltensor");
    if (mt == NULL) {
        PyErr_WriteUnraisable(cap);
        return;
    }
    if (mt->deleter) mt->deleter(mt);
}

/* Imported device memory (`owner` one of our import keepers, below)
 * handed on through DLPack to a consumer's stream: its release waits for
 * that stream too (ra_cuda_release_after).  The keeper's context holds the
 * widest RA_SHARED_* seen. */
static int is_import_keeper(PyObject *owner) {
    return owner != NULL &&
           (PyCapsule_IsValid(owner, "ringattn.dlpack_owner_versioned") ||
            PyCapsule_IsValid(owner, "ringattn.dlpack_owner"));
}

static void note_shared(PyObject *owner, int shared) {
    if (!is_import_keeper(owner)) return;
    intptr_t was = (intptr_t)PyCapsule_GetContext(owner);
    if (shared > was) (void)PyCapsule_SetContext(owner, (void *)(intptr_t)shared);
}

static int parse_version_tuple(PyObject *obj, long *major) {
    if (obj == NULL || obj == Py_None) {
        *major = -1;
        return 0;
    }
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 2) {
        PyErr_SetString(PyExc_TypeError,
                        "max_version: expected a tuple (major, minor)");
        return -1;
    }
    *major = PyLong_AsLong(PyTuple_GET_ITEM(obj, 0));
    if (*major == -1 && PyErr_Occurred()) return -1;
    return 0;
}

PyObject *ra_buffer_dlpack(PyObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None,
             *copy = Py_None;
    ra_buffer *b = (ra_buffer *)self;
    ra_buffer *src = b;
    long major;
    int want_copy = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$OOOO:__dlpack__", kwlist,
                                     &stream, &max_version, &dl_device, &copy))
        return NULL;
    if (parse_version_tuple(max_version, &major) < 0) return NULL;
    if (copy != Py_None) {
        want_copy = PyObject_IsTrue(copy);
        if (want_copy < 0) return NULL;
    }
    if (dl_device != Py_None) {
        int dt, di;
        if (!PyArg_ParseTuple(dl_device, "ii", &dt, &di)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_BufferError,
                            "dl_device: expected (device_type, device_id)");
            return NULL;
        }
        if (dt != b->device_type || di != b->device_id) {
            PyErr_Format(PyExc_BufferError,
                         "dl_device: ringattn.Buffer lives on device (%d, %d) "
                         "and exports only there, got (%d, %d)",
                         b->device_type, b->device_id, dt, di);
            return NULL;
        }
    }
    intptr_t consumer = 1; /* None: the legacy default stream */
    if (b->device_type == RA_DEV_CUDA) {
        if (stream != Py_None) {
            consumer = (intptr_t)PyLong_AsLongLong(stream);
            if (consumer == -1 && PyErr_Occurred()) return NULL;
        }
    } else if (stream != Py_None) {
        long long s = PyLong_AsLongLong(stream);
        if (s == -1 && PyErr_Occurred()) return NULL;
        /* the array API allows only None for CPU; -1 means "no sync" */
        if (s != -1) {
            PyErr_Format(PyExc_BufferError,
                         "stream: expected None for a CPU buffer, got %lld", s);
            return NULL;
        }
    }
    if (major < 1 && b->readonly) {
        PyErr_SetString(PyExc_BufferError,
                        "cannot export a read-only buffer as a legacy DLPack "
                        "capsule (it cannot signal read-only); ask for "
                        "max_version=(1, 0)");
        return NULL;
    }
    if (want_copy) {
        if (b->dtype == RA_DTYPE_OTHER) {
            PyErr_SetString(PyExc_BufferError,
                            "copy=True is supported for float buffers only");
            return NULL;
        }
        PyObject *name = PyUnicode_FromString(ra_dtype_name(b->dtype));
        if (name == NULL) return NULL;
        src = (ra_buffer *)PyObject_CallMethod(self, "astype", "O", name);
        Py_DECREF(name);
        if (src == NULL) return NULL;
    } else {
        Py_INCREF(src);
    }
    if (src->device_type == RA_DEV_CUDA) {
        /* after the copy above was queued: the consumer waits for it too */
        ra_status st;
        int shared = RA_SHARED_NONE;
        Py_BEGIN_ALLOW_THREADS
        st = ra_cuda_export_sync(src->device_id,
                                 src->block ? src->block->ptr : NULL,
                                 consumer, &shared);
        Py_END_ALLOW_THREADS
        if (st != RA_OK) {
            Py_DECREF(src);
            return ra_raise(st);
        }
        if (src->block == NULL) note_shared(src->owner, shared);
    }

    ra_export_block *blk =
        (ra_export_block *)PyMem_RawCalloc(1, sizeof(ra_export_block));
    if (blk == NULL) {
        Py_DECREF(src);
        return PyErr_NoMemory();
    }
    DLTensor *t = major >= 1 ? &blk->versioned.dl_tensor : &blk->legacy.dl_tensor;
    t->data = src->data;
    t->device.device_type = src->device_type;
    t->device.device_id = src->device_id;
    t->ndim = src->ndim;
    t->dtype = src->dl_dtype;
    for (int i = 0; i < src->ndim; i++) {
        blk->shape[i] = src->shape[i];
        blk->strides[i] = src->strides[i];
    }
    t->shape = blk->shape;
    t->strides = blk->strides;
    t->byte_offset = 0;

    PyObject *cap;
    if (major >= 1) {
        blk->is_versioned = 1;
        blk->versioned.version.major = RA_DLPACK_MAJOR;
        blk->versioned.version.minor = RA_DLPACK_MINOR;
        blk->versioned.manager_ctx = src;
        blk->versioned.deleter = export_deleter_versioned;
        blk->versioned.flags = 0;
        if (src->readonly) blk->versioned.flags |= DLPACK_FLAG_BITMASK_READ_ONLY;
        if (want_copy) blk->versioned.flags |= DLPACK_FLAG_BITMASK_IS_COPIED;
        cap = PyCapsule_New(&blk->versioned, "dltensor_versioned",
                            capsule_destructor_versioned);
    } else {
        blk->legacy.manager_ctx = src;
        blk->legacy.deleter = export_deleter_legacy;
        cap = PyCapsule_New(&blk->legacy, "dltensor", capsule_destructor_legacy);
    }
    if (cap == NULL) {
        Py_DECREF(src);
        PyMem_RawFree(blk);
        return NULL;
    }
    return cap;
}

PyObject *ra_buffer_dlpack_device(PyObject *self, PyObject *unused) {
    ra_buffer *b = (ra_buffer *)self;
    (void)unused;
    return Py_BuildValue("(ii)", b->device_type, b->device_id);
}

/* ---- consumer ---------------------------------------------------------- */

/* Keeper of an imported tensor: a capsule whose destructor gives the
 * tensor back to its producer (its deleter, called once).  Device memory
 * goes back only once ringattn's stream work on it has completed
 * (ra_cuda_release_after): the producer's allocator may hand it to a new
 * array at once.  Host memory (pinned included: ringattn's copies of it
 * are finished on return) goes back now.  The keeper's context: how far
 * the memory was handed on (note_shared). */
typedef struct {
    void *mt;
    void (*versioned)(DLManagedTensorVersioned *);   /* one of the two */
    void (*legacy)(DLManagedTensor *);
} deleter_call;

static void run_deleter(void *arg) {
    deleter_call *c = (deleter_call *)arg;
    if (c->versioned != NULL)
        c->versioned((DLManagedTensorVersioned *)c->mt);
    else
        c->legacy((DLManagedTensor *)c->mt);
    PyMem_RawFree(c);
}

/* Everything is read from the tensor now: a producer with no deleter may
 * free it as soon as it is not used (and then there is nothing to call). */
static void give_back(PyObject *keeper, const DLTensor *t, deleter_call call) {
    if (call.versioned == NULL && call.legacy == NULL) return;
    const int on_device = t->device.device_type == kDLCUDA ||
                          t->device.device_type == kDLCUDAManaged;
    deleter_call *c = (deleter_call *)PyMem_RawMalloc(sizeof *c);
    if (c != NULL) *c = call;
    if (c != NULL && on_device) {
        /* the context of a valid capsule: no error, NULL is none */
        const int shared = (int)(intptr_t)PyCapsule_GetContext(keeper);
        ra_cuda_release_after(t->device.device_id, shared, run_deleter, c);
        return;
    }
    if (c == NULL && on_device) {
        /* no memory for the record: wait for the device here */
        const int device = t->device.device_id;
        Py_BEGIN_ALLOW_THREADS
        (void)ra_cuda_synchronize(device);
        ra_clear_error();
        Py_END_ALLOW_THREADS
    }
    /* a deleter may run Python code: not with an exception pending */
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    if (c != NULL)
        run_deleter(c);
    else if (call.versioned != NULL)
        call.versioned((DLManagedTensorVersioned *)call.mt);
    else
        call.legacy((DLManagedTensor *)call.mt);
    if (PyErr_Occurred()) PyErr_WriteUnraisable(NULL);
    PyErr_Restore(et, ev, tb);
}

static void owner_destructor_versioned(PyObject *cap) {
    DLManagedTensorVersioned *mt = (DLManagedTensorVersioned *)
        PyCapsule_GetPointer(cap, "ringattn.dlpack_owner_versioned");
    if (mt != NULL)
        give_back(cap, &mt->dl_tensor, (deleter_call){mt, mt->deleter, NULL});
}

static void owner_destructor_legacy(PyObject *cap) {
    DLManagedTensor *mt = (DLManagedTensor *)PyCapsule_GetPointer(
        cap, "ringattn.dlpack_owner");
    if (mt != NULL)
        give_back(cap, &mt->dl_tensor, (deleter_call){mt, NULL, mt->deleter});
}

/* The current exception as a BufferError "<name>: <what>: <type>: <text>"
 * (the original one chained as __cause__).  Returns NULL. */
static void *named_buffer_error(const char *name, const char *what) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyErr_NormalizeException(&et, &ev, &tb);
    if (tb != NULL && ev != NULL) PyException_SetTraceback(ev, tb);
    PyErr_Format(PyExc_BufferError, "%s: %s: %.100s: %S", name, what,
                 et ? ((PyTypeObject *)et)->tp_name : "error",
                 ev ? ev : Py_None);
    if (ev != NULL) {
        PyObject *nt, *nv, *ntb;
        PyErr_Fetch(&nt, &nv, &ntb);
        PyErr_NormalizeException(&nt, &nv, &ntb);
        PyException_SetCause(nv, ev);     /* steals ev */
        ev = NULL;
        PyErr_Restore(nt, nv, ntb);
    }
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(tb);
    return NULL;
}

/* The producer's exception from calling `method`, named as above. */
static void *producer_error(const char *name, PyObject *obj,
                            const char *method) {
    char what[200];
    snprintf(what, sizeof what, "%s of the %.100s failed", method,
             Py_TYPE(obj)->tp_name);
    return named_buffer_error(name, what);
}

static PyObject *call_dlpack(PyObject *obj, PyObject *stream_arg,
                             int *versioned_asked) {
    PyObject *meth = PyObject_GetAttrString(obj, "__dlpack__");
    if (meth == NULL) return NULL;
    PyObject *args = PyTuple_New(0);
    PyObject *kw = PyDict_New();
    PyObject *res = NULL;
    if (args == NULL || kw == NULL) goto done;
    if (stream_arg != NULL && PyDict_SetItemString(kw, "stream", stream_arg) < 0)
        goto done;
    PyObject *ver = Py_BuildValue("(ii)", RA_DLPACK_MAJOR, RA_DLPACK_MINOR);
    if (ver == NULL) goto done;
    int rc = PyDict_SetItemString(kw, "max_version", ver);
    Py_DECREF(ver);
    if (rc < 0) goto done;
    *versioned_asked = 1;
    res = PyObject_Call(meth, args, kw);
    if (res == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        /* a producer older than DLPack 1.0 does not know max_version */
        PyErr_Clear();
        *versioned_asked = 0;
        if (PyDict_DelItemString(kw, "max_version") < 0) goto done;
        res = PyObject_Call(meth, args, kw);
    }
done:
    Py_XDECREF(args);
    Py_XDECREF(kw);
    Py_DECREF(meth);
    return res;
}

ra_buffer *ra_buffer_from_dlpack(PyObject *obj, const char *name,
                                 intptr_t stream) {
    int dev_type = RA_DEV_CPU, dev_id = 0;
    PyObject *stream_arg = NULL;
    int versioned_asked = 0;

    if (PyObject_HasAttrString(obj, "__dlpack_device__")) {
        PyObject *d = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
        if (d == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception) ||
                PyErr_ExceptionMatches(PyExc_MemoryError))
                return NULL;
            return producer_error(name, obj, "__dlpack_device__");
        }
        int ok = PyArg_ParseTuple(d, "ii", &dev_type, &dev_id);
        Py_DECREF(d);
        if (!ok) {
            PyErr_Clear();
            PyErr_Format(PyExc_BufferError,
                         "%s: __dlpack_device__ did not return (type, id)",
                         name);
            return NULL;
        }
    }
    if (dev_type == RA_DEV_CUDA) {
        if (stream < 0) {
            void *s = NULL;
            ra_status st = ra_cuda_compute_stream(dev_id, &s);
            if (st != RA_OK) {
                char what[160];
                ra_raise(st);
                snprintf(what, sizeof what, "the %.100s lives on CUDA device %d",
                         Py_TYPE(obj)->tp_name, dev_id);
                return named_buffer_error(name, what);
            }
            stream = (intptr_t)s;
            if (stream == 0) stream = 1; /* legacy default stream */
        }
        stream_arg = PyLong_FromVoidPtr((void *)stream);
        if (stream_arg == NULL) return NULL;
    }

    PyObject *cap = call_dlpack(obj, stream_arg, &versioned_asked);
    Py_XDECREF(stream_arg);
    if (cap == NULL) {
        if (PyErr_ExceptionMatches(PyExc_BufferError) ||
            PyErr_ExceptionMatches(PyExc_TypeError) ||
            PyErr_ExceptionMatches(PyExc_RuntimeError))
            return producer_error(name, obj, "__dlpack__");
        return NULL;
    }

    DLTensor *t = NULL;
    void *managed = NULL;
    int is_versioned = 0, readonly = 0;
    if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        DLManagedTensorVersioned *mt = (DLManagedTensorVersioned *)
            PyCapsule_GetPointer(cap, "dltensor_versioned");
        if (mt->version.major != RA_DLPACK_MAJOR) {
            PyErr_Format(PyExc_BufferError,
                         "%s: unsupported DLPack major version %u (expected "
                         "%d)",
                         name, mt->version.major, RA_DLPACK_MAJOR);
            Py_DECREF(cap);
            return NULL;
        }
        t = &mt->dl_tensor;
        managed = mt;
        is_versioned = 1;
        readonly = (mt->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
    } else if (PyCapsule_IsValid(cap, "dltensor")) {
        DLManagedTensor *mt =
            (DLManagedTensor *)PyCapsule_GetPointer(cap, "dltensor");
        t = &mt->dl_tensor;
        managed = mt;
    } else {
        PyErr_Format(PyExc_BufferError,
                     "%s: __dlpack__ returned %.100s, not an unused DLPack "
                     "capsule",
                     name, Py_TYPE(cap)->tp_name);
        Py_DECREF(cap);
        return NULL;
    }
    (void)versioned_asked;

    if (t->ndim < 0 || t->ndim > RA_MAX_NDIM) {
        PyErr_Format(PyExc_BufferError,
                     "%s: expected at most %d dimensions, got %d", name,
                     RA_MAX_NDIM, (int)t->ndim);
        goto fail;
    }
    if (t->ndim > 0 && t->shape == NULL) {
        PyErr_Format(PyExc_BufferError,
                     "%s: the DLPack tensor has %d dimensions but no shape "
                     "(NULL)", name, (int)t->ndim);
        goto fail;
    }
    if (t->byte_offset > (uint64_t)INT64_MAX) {
        PyErr_Format(PyExc_BufferError,
                     "%s: expected a DLPack byte_offset below 2**63, got %llu",
                     name, (unsigned long long)t->byte_offset);
        goto fail;
    }
    if (t->dtype.lanes != 1) {
        PyErr_Format(PyExc_BufferError,
                     "%s: vector dtypes (lanes=%u) are not supported", name,
                     (unsigned)t->dtype.lanes);
        goto fail;
    }
    if (t->dtype.bits == 0 || t->dtype.bits % 8 != 0) {
        PyErr_Format(PyExc_BufferError,
                     "%s: sub-byte dtypes (%u bits) are not supported", name,
                     (unsigned)t->dtype.bits);
        goto fail;
    }
    switch (t->device.device_type) {
    case kDLCPU:
    case kDLCUDA:
    case kDLCUDAHost:
    case kDLCUDAManaged: break;
    default:
        PyErr_Format(PyExc_BufferError,
                     "%s: DLPack device type %d is not supported (expected "
                     "CPU or CUDA)",
                     name, (int)t->device.device_type);
        goto fail;
    }

    ra_buffer *b = ra_buffer_new_raw();
    if (b == NULL) goto fail;
    b->device_type = t->device.device_type == kDLCUDAHost ||
                             t->device.device_type == kDLCUDAManaged
                         ? (t->device.device_type == kDLCUDAHost ? RA_DEV_CUDA_HOST
                                                                 : RA_DEV_CUDA_MANAGED)
                         : t->device.device_type;
    b->device_id = t->device.device_id;
    b->dl_dtype = t->dtype;
    b->dtype = ra_dtype_from_dl(t->dtype);
    b->ndim = t->ndim;
    b->readonly = readonly;
    {
        /* shape and strides must describe elements whose byte offsets fit
         * in int64 and whose addresses neither wrap around nor start at
         * NULL; anything else is refused rather than mis-read */
        int64_t stride = 1, numel = 1, lo = 0, hi = 0;
        const int64_t es = (int64_t)(t->dtype.bits / 8);
        int ok = 1;
        for (int i = t->ndim - 1; i >= 0 && ok; i--) {
            if (t->shape[i] < 0) {
                PyErr_Format(PyExc_BufferError,
                             "%s: negative size %lld in the DLPack shape at "
                             "dimension %d", name, (long long)t->shape[i], i);
                Py_DECREF(b);
                goto fail;
            }
            b->shape[i] = t->shape[i];
            b->strides[i] = t->strides != NULL ? t->strides[i] : stride;
            ok = ra_mul_ok(numel, t->shape[i], &numel);
            if (ok && t->shape[i] > 1) {
                int64_t ext;      /* element offset of the last index */
                ok = ra_mul_ok(b->strides[i], t->shape[i] - 1, &ext) &&
                     !__builtin_add_overflow(ext < 0 ? lo : hi, ext,
                                             ext < 0 ? &lo : &hi);
            }
            if (ok && t->shape[i] > 0 && !ra_mul_ok(stride, t->shape[i], &stride))
                stride = INT64_MAX; /* only a compact-stride default */
        }
        int64_t bytes, lo_bytes = 0, hi_bytes = 0, end;
        if (ok)
            ok = ra_mul_ok(numel, es, &bytes) && ra_mul_ok(lo, es, &lo_bytes) &&
                 ra_mul_ok(hi, es, &hi_bytes) &&
                 !__builtin_add_overflow(hi_bytes, es, &hi_bytes) &&
                 !__builtin_add_overflow(hi_bytes, (int64_t)t->byte_offset,
                                         &end);
        if (!ok) {
            PyErr_Format(PyExc_BufferError,
                         "%s: the DLPack shape/strides describe more than "
                         "2**63 bytes",
                         name);
            Py_DECREF(b);
            goto fail;
        }
        /* first: the address of index 0; below it by `below` bytes the
         * lowest element (negative strides), above it `hi_bytes` */
        uintptr_t base = (uintptr_t)t->data, first,
                  below = (uintptr_t)0 - (uintptr_t)lo_bytes;
        if (numel > 0 &&
            (t->data == NULL ||
             __builtin_add_overflow(base, (uintptr_t)t->byte_offset, &first) ||
             first <= below ||
             UINTPTR_MAX - first < (uintptr_t)hi_bytes)) {
            PyErr_Format(PyExc_BufferError,
                         "%s: the DLPack data pointer %p with byte_offset "
                         "%llu does not address %lld elements (NULL or "
                         "wrapping around)", name, t->data,
                         (unsigned long long)t->byte_offset,
                         (long long)numel);
            Py_DECREF(b);
            goto fail;
        }
        b->data = (void *)(base + (uintptr_t)t->byte_offset);
    }
    PyObject *owner =
        is_versioned
            ? PyCapsule_New(managed, "ringattn.dlpack_owner_versioned",
                            owner_destructor_versioned)
            : PyCapsule_New(managed, "ringattn.dlpack_owner",
                            owner_destructor_legacy);
    if (owner == NULL) {
        Py_DECREF(b);
        goto fail;
    }
    /* success: the capsule is consumed; from now on `owner` deletes it */
    if (PyCapsule_SetName(cap, is_versioned ? "used_dltensor_versioned"
                                            : "used_dltensor") < 0) {
        /* cannot happen for a valid capsule; undo ownership */
        PyCapsule_SetDestructor(owner, NULL);
        Py_DECREF(owner);
        Py_DECREF(b);
        goto fail;
    }
    b->owner = owner;
    Py_DECREF(cap);
    return b;
fail:
    Py_DECREF(cap); /* unconsumed: its own destructor calls the deleter */
    return NULL;
}
