/*
 * cuda_emu.c -- what Python sees of the emulated GPU (RINGATTN_CUDA=emulate,
 * csrc/emu): whether this build runs on it, and the reports of its memory
 * checker and SIMT layer (for tests: a report also fails the kernel that
 * made it, as a device fault would).  In other builds cuda_emulated() is
 * False and there are no reports.
 *
 * The emulated build also has test hooks: the count of host
 * synchronisations (emu_host_syncs), lazy stream mode switched at run time
 * (emu_lazy), and the raw CUDA runtime calls a foreign framework would make
 * on its own stream and memory (emu_rt_*: tests/foreign_arrays.py builds
 * its stand-in for PyTorch's caching allocator from them).  Pointers and
 * stream handles are Python ints; nothing here is counted in
 * memory_stats().
 */
#include "core/module.h"
#include "core/cuda_rt.h"

#ifdef RA_CUDA_EMULATED
#include <cuda_runtime.h>

#include "emu/emu.h"
#endif

int ra_cuda_emulated(void) {
#ifdef RA_CUDA_EMULATED
    return 1;
#else
    return 0;
#endif
}

static PyObject *py_cuda_emulated(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyBool_FromLong(ra_cuda_emulated());
}

static PyObject *py_emu_reports(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
#ifdef RA_CUDA_EMULATED
    const char *text = ra_emu_reports_text();
    return PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
#else
    return PyUnicode_FromString("");
#endif
}

static PyObject *py_emu_reports_clear(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
#ifdef RA_CUDA_EMULATED
    ra_emu_reports_clear();
#endif
    Py_RETURN_NONE;
}

#ifdef RA_CUDA_EMULATED

static PyObject *py_emu_host_syncs(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyLong_FromUnsignedLongLong(
        (unsigned long long)ra_emu_host_syncs());
}

/* emu_lazy(on=None) -> bool: lazy mode as it was; `on` sets it */
static PyObject *py_emu_lazy(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *on = Py_None;
    if (!PyArg_ParseTuple(args, "|O:emu_lazy", &on)) return NULL;
    int want = -1;
    if (on != Py_None && (want = PyObject_IsTrue(on)) < 0) return NULL;
    int prev;
    Py_BEGIN_ALLOW_THREADS
    prev = ra_emu_set_lazy(want);
    Py_END_ALLOW_THREADS
    if (prev < 0) return ra_raise_msg(RA_ERR_CUDA, "the emulated GPU did not start");
    return PyBool_FromLong(prev);
}

/* a cudaError_t as the usual exception, naming the call */
static PyObject *rt_error(cudaError_t e, const char *what) {
    (void)cudaGetLastError();
    return ra_raise(ra_cuda_status((int)e, what, __FILE__, __LINE__));
}

static int as_ptr(PyObject *o, void **out) {
    *out = PyLong_AsVoidPtr(o);
    return *out == NULL && PyErr_Occurred() ? 0 : 1;
}

/* emu_rt_stream_create(device, blocking) -> handle: a stream of its own
 * (cudaStreamNonBlocking unless blocking) */
static PyObject *py_rt_stream_create(PyObject *self, PyObject *args) {
    (void)self;
    int device, blocking;
    if (!PyArg_ParseTuple(args, "ip:emu_rt_stream_create", &device, &blocking))
        return NULL;
    cudaStream_t s = NULL;
    int prev = 0;
    ra_status st = ra_cuda_enter_device(device, &prev);
    if (st != RA_OK) return ra_raise(st);
    cudaError_t e = cudaStreamCreateWithFlags(
        &s, blocking ? cudaStreamDefault : cudaStreamNonBlocking);
    ra_cuda_leave_device(device, prev);
    if (e != cudaSuccess) return rt_error(e, "cudaStreamCreateWithFlags");
    return PyLong_FromVoidPtr((void *)s);
}

/* emu_rt_malloc(device, nbytes) -> pointer */
static PyObject *py_rt_malloc(PyObject *self, PyObject *args) {
    (void)self;
    int device;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "in:emu_rt_malloc", &device, &n)) return NULL;
    void *p = NULL;
    int prev = 0;
    ra_status st = ra_cuda_enter_device(device, &prev);
    if (st != RA_OK) return ra_raise(st);
    cudaError_t e = cudaMalloc(&p, (size_t)(n > 0 ? n : 1));
    ra_cuda_leave_device(device, prev);
    if (e != cudaSuccess) return rt_error(e, "cudaMalloc");
    return PyLong_FromVoidPtr(p);
}

/* emu_rt_free(pointer): cudaFree (waits for the device, as the real one) */
static PyObject *py_rt_free(PyObject *self, PyObject *arg) {
    (void)self;
    void *p;
    if (!as_ptr(arg, &p)) return NULL;
    cudaError_t e;
    Py_BEGIN_ALLOW_THREADS
    e = cudaFree(p);
    Py_END_ALLOW_THREADS
    if (e != cudaSuccess) return rt_error(e, "cudaFree");
    Py_RETURN_NONE;
}

/* emu_rt_upload(pointer, data, stream): cudaMemcpyAsync host -> device of
 * a bytes-like object on `stream` (pageable: copied aside at the call) */
static PyObject *py_rt_upload(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *po, *so;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "Oy*O:emu_rt_upload", &po, &data, &so))
        return NULL;
    void *p, *s;
    PyObject *res = NULL;
    if (as_ptr(po, &p) && as_ptr(so, &s)) {
        cudaError_t e = cudaMemcpyAsync(p, data.buf, (size_t)data.len,
                                        cudaMemcpyHostToDevice,
                                        (cudaStream_t)s);
        res = e == cudaSuccess ? Py_NewRef(Py_None)
                               : rt_error(e, "cudaMemcpyAsync");
    }
    PyBuffer_Release(&data);
    return res;
}

/* emu_rt_download(pointer, nbytes, stream) -> bytes: device -> pageable
 * host on `stream` (returns once the copy is done) */
static PyObject *py_rt_download(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *po, *so;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OnO:emu_rt_download", &po, &n, &so))
        return NULL;
    void *p, *s;
    if (!as_ptr(po, &p) || !as_ptr(so, &s)) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL) return NULL;
    cudaError_t e;
    char *dst = PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    e = cudaMemcpyAsync(dst, p, (size_t)n, cudaMemcpyDeviceToHost,
                        (cudaStream_t)s);
    Py_END_ALLOW_THREADS
    if (e != cudaSuccess) {
        Py_DECREF(out);
        return rt_error(e, "cudaMemcpyAsync");
    }
    return out;
}

/* emu_rt_copy(dst, src, nbytes, stream): device -> device on `stream` */
static PyObject *py_rt_copy(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *dobj, *sobj, *stobj;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OOnO:emu_rt_copy", &dobj, &sobj, &n, &stobj))
        return NULL;
    void *d, *src, *s;
    if (!as_ptr(dobj, &d) || !as_ptr(sobj, &src) || !as_ptr(stobj, &s))
        return NULL;
    cudaError_t e = cudaMemcpyAsync(d, src, (size_t)n,
                                    cudaMemcpyDeviceToDevice, (cudaStream_t)s);
    if (e != cudaSuccess) return rt_error(e, "cudaMemcpyAsync");
    Py_RETURN_NONE;
}

/* emu_rt_stream_synchronize(stream) */
static PyObject *py_rt_stream_sync(PyObject *self, PyObject *arg) {
    (void)self;
    void *s;
    if (!as_ptr(arg, &s)) return NULL;
    cudaError_t e;
    Py_BEGIN_ALLOW_THREADS
    e = cudaStreamSynchronize((cudaStream_t)s);
    Py_END_ALLOW_THREADS
    if (e != cudaSuccess) return rt_error(e, "cudaStreamSynchronize");
    Py_RETURN_NONE;
}

/* emu_rt_stream_wait(waiter, producer): `waiter` waits for the work queued
 * so far on `producer` (an event recorded there), the DLPack handshake */
static PyObject *py_rt_stream_wait(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *wo, *po;
    if (!PyArg_ParseTuple(args, "OO:emu_rt_stream_wait", &wo, &po)) return NULL;
    void *w, *p;
    if (!as_ptr(wo, &w) || !as_ptr(po, &p)) return NULL;
    int device = 0;
    cudaError_t e = cudaStreamGetDevice((cudaStream_t)p, &device);
    if (e != cudaSuccess) return rt_error(e, "cudaStreamGetDevice");
    int prev = 0;
    ra_status st = ra_cuda_enter_device(device, &prev);
    if (st != RA_OK) return ra_raise(st);
    cudaEvent_t ev = NULL;
    const char *what = "cudaEventCreateWithFlags";
    e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e == cudaSuccess) {
        what = "cudaEventRecord";
        e = cudaEventRecord(ev, (cudaStream_t)p);
    }
    if (e == cudaSuccess) {
        what = "cudaStreamWaitEvent";
        e = cudaStreamWaitEvent((cudaStream_t)w, ev, 0);
    }
    if (ev != NULL) (void)cudaEventDestroy(ev);
    ra_cuda_leave_device(device, prev);
    if (e != cudaSuccess) return rt_error(e, what);
    Py_RETURN_NONE;
}

#endif /* RA_CUDA_EMULATED */

static PyMethodDef emu_methods[] = {
    {"cuda_emulated", py_cuda_emulated, METH_NOARGS,
     "cuda_emulated() -> bool: whether the CUDA part runs on ringattn's "
     "emulated GPU."},
    {"emu_reports", py_emu_reports, METH_NOARGS,
     "emu_reports() -> str: what the emulated GPU's checker reported, one "
     "line per report ('' in other builds)."},
    {"emu_reports_clear", py_emu_reports_clear, METH_NOARGS,
     "emu_reports_clear(): forget the emulated GPU's reports."},
#ifdef RA_CUDA_EMULATED
    {"emu_host_syncs", py_emu_host_syncs, METH_NOARGS,
     "emu_host_syncs() -> int: how many times the host has waited for the "
     "emulated device so far (stream, device and event synchronisations, "
     "cudaFree, blocking copies)."},
    {"emu_lazy", py_emu_lazy, METH_VARARGS,
     "emu_lazy(on=None) -> bool: whether lazy stream mode was on; True or "
     "False switches it from now on (RINGATTN_EMU_LAZY at run time)."},
    {"emu_rt_stream_create", py_rt_stream_create, METH_VARARGS,
     "emu_rt_stream_create(device, blocking) -> stream handle"},
    {"emu_rt_malloc", py_rt_malloc, METH_VARARGS,
     "emu_rt_malloc(device, nbytes) -> pointer (cudaMalloc)"},
    {"emu_rt_free", py_rt_free, METH_O, "emu_rt_free(pointer) (cudaFree)"},
    {"emu_rt_upload", py_rt_upload, METH_VARARGS,
     "emu_rt_upload(pointer, data, stream): host -> device, asynchronous"},
    {"emu_rt_download", py_rt_download, METH_VARARGS,
     "emu_rt_download(pointer, nbytes, stream) -> bytes, once copied"},
    {"emu_rt_copy", py_rt_copy, METH_VARARGS,
     "emu_rt_copy(dst, src, nbytes, stream): device -> device, asynchronous"},
    {"emu_rt_stream_synchronize", py_rt_stream_sync, METH_O,
     "emu_rt_stream_synchronize(stream)"},
    {"emu_rt_stream_wait", py_rt_stream_wait, METH_VARARGS,
     "emu_rt_stream_wait(waiter, producer): waiter waits for producer's work "
     "so far"},
#endif
    {NULL, NULL, 0, NULL}};

int ra_cuda_emu_exec(PyObject *m) {
    return PyModule_AddFunctions(m, emu_methods);
}
