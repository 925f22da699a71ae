/*
 * cuda_lifetime.c -- the stream-ordered lifetime of device memory ringattn
 * borrowed (see cuda_rt.h, ra_cuda_release_after).
 *
 * An array imported through DLPack is used by work ringattn queued on its
 * compute stream (and by the NCCL communicator's stream, which hands every
 * transfer back to the compute stream before its buffers go: see
 * comm_nccl_xfer.c).  When ringattn lets go of it (the last Buffer viewing
 * it is gone) that work may not have run yet: giving the producer its
 * memory back then lets its allocator hand the memory to a new array,
 * written on the producer's stream, while a kernel still reads or writes
 * the old one.  So the release is ordered like the work:
 *
 *   - an event is recorded on the compute stream of the array's device,
 *     and the release (the producer's DLPack deleter) waits in a FIFO per
 *     device until it completed;
 *   - the device's legacy default stream waits for that event, so the
 *     producer's default stream (PyTorch's and CuPy's), and every stream
 *     that synchronises with it (per-thread default streams, streams made
 *     without cudaStreamNonBlocking), is ordered after ringattn's work on
 *     the array: it reads what ringattn wrote there and overwrites what
 *     ringattn read only afterwards.
 *
 * A Buffer viewing the array may have been exported through DLPack again
 * (ra.from_dlpack(x) handed to another framework): that consumer's stream
 * may read it too.  When the legacy stream synchronises with that stream,
 * the event is recorded once more on the legacy stream after its wait;
 * for any other stream the device is synchronised first (the rule of
 * cuda_rt.c's pool for exported blocks).
 *
 * Nobody waits on the host for it.  The FIFOs are polled at the next call
 * into ringattn (ra_buffer_from_object), after ra_cuda_synchronize and
 * empty_cache, and drained at exit (an atexit function: the host waits for
 * the events then, once).  Events on one stream complete in order, so there
 * is one FIFO per device and stream (compute, legacy) and a poll stops at
 * a FIFO's first pending entry.  When an event cannot be
 * recorded (out of resources, a device fault) the compute stream is
 * synchronised instead and the release runs at once; so it does while the
 * interpreter finalises, when no later poll would come.
 *
 * Releases run with the GIL held (DLPack deleters may need it) and the
 * caller's exception saved around them.  The FIFO nodes come from
 * PyMem_RawMalloc and are guarded by their own mutex.
 */
#include "core/module.h"
#include "core/cuda_rt.h"

#include <stdatomic.h>

typedef void (*ra_release_fn)(void *arg);

/* Run one release with the GIL held, whatever exception is pending kept
 * aside (a deleter may run Python code). */
static void run_release(ra_release_fn release, void *arg) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    release(arg);
    if (PyErr_Occurred()) PyErr_WriteUnraisable(NULL);
    PyErr_Restore(et, ev, tb);
}

static int finalizing(void) {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

#ifdef RA_WITH_CUDA

#include <pthread.h>
#include <cuda_runtime.h>

#define EVENT_POOL 64        /* completed events kept per device for reuse */

typedef struct pending {
    cudaEvent_t event;       /* recorded on the compute stream at the release */
    int device;
    ra_release_fn release;
    void *arg;
    struct pending *next;
} pending;

/* FIFO 2 d: events recorded on device d's compute stream; 2 d + 1: on its
 * legacy default stream (RA_SHARED_LEGACY) */
#define N_FIFOS (2 * RA_CUDA_MAX_DEVICES)

static pthread_mutex_t lifetime_lock = PTHREAD_MUTEX_INITIALIZER;
static pending *fifo_head[N_FIFOS], *fifo_tail[N_FIFOS];
static cudaEvent_t event_pool[RA_CUDA_MAX_DEVICES][EVENT_POOL];
static int event_pool_n[RA_CUDA_MAX_DEVICES];
static _Atomic long n_pending;

/* An event of `device` (current) from the pool or new; NULL on failure. */
static cudaEvent_t event_get(int device) {
    cudaEvent_t ev = NULL;
    pthread_mutex_lock(&lifetime_lock);
    if (event_pool_n[device] > 0) ev = event_pool[device][--event_pool_n[device]];
    pthread_mutex_unlock(&lifetime_lock);
    if (ev == NULL &&
        cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
        (void)cudaGetLastError();
        ev = NULL;
    }
    return ev;
}

/* Give back a completed event (re-recording it later is legal). */
static void event_put(int device, cudaEvent_t ev) {
    if (ev == NULL) return;
    pthread_mutex_lock(&lifetime_lock);
    if (event_pool_n[device] < EVENT_POOL) {
        event_pool[device][event_pool_n[device]++] = ev;
        ev = NULL;
    }
    pthread_mutex_unlock(&lifetime_lock);
    if (ev != NULL) (void)cudaEventDestroy(ev);
}

/* Record `ev` on the compute stream `s` of the current device and make the
 * legacy default stream wait for it; with `shared` (RA_SHARED_LEGACY) then
 * record `ev` again on the legacy stream, after that wait: it completes
 * once ringattn's work and what the streams the legacy stream
 * synchronises with queued so far are done. */
static cudaError_t mark_last_use(cudaEvent_t ev, cudaStream_t s, int shared) {
    cudaError_t e = cudaEventRecord(ev, s);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(cudaStreamLegacy, ev, 0);
    if (e == cudaSuccess && shared == RA_SHARED_LEGACY)
        e = cudaEventRecord(ev, cudaStreamLegacy);
    return e;
}

void ra_cuda_release_after(int device, int shared, void (*release)(void *),
                           void *arg) {
    void *stream = NULL;
    int prev = 0;
    if (device < 0 || device >= RA_CUDA_MAX_DEVICES ||
        ra_cuda_compute_stream(device, &stream) != RA_OK ||
        ra_cuda_enter_device(device, &prev) != RA_OK) {
        /* no usable device: nothing of ringattn's can run there */
        ra_clear_error();
        run_release(release, arg);
        return;
    }
    /* handed on to streams ringattn cannot name: wait for the device */
    const int unknown = shared == RA_SHARED_UNKNOWN;
    cudaEvent_t ev = finalizing() || unknown ? NULL : event_get(device);
    pending *p = ev != NULL ? (pending *)PyMem_RawMalloc(sizeof *p) : NULL;
    if (p != NULL &&
        mark_last_use(ev, (cudaStream_t)stream, shared) == cudaSuccess) {
        p->event = ev;
        p->device = device;
        p->release = release;
        p->arg = arg;
        p->next = NULL;
        const int f = 2 * device + (shared == RA_SHARED_LEGACY);
        pthread_mutex_lock(&lifetime_lock);
        if (fifo_tail[f] != NULL)
            fifo_tail[f]->next = p;
        else
            fifo_head[f] = p;
        fifo_tail[f] = p;
        atomic_fetch_add(&n_pending, 1);
        pthread_mutex_unlock(&lifetime_lock);
        ra_cuda_leave_device(device, prev);
        return;
    }
    /* no event: wait for the work here (a fault ends the wait too) */
    (void)cudaGetLastError();
    PyMem_RawFree(p);
    if (ev != NULL) (void)cudaEventDestroy(ev);
    Py_BEGIN_ALLOW_THREADS
    if ((unknown ? cudaDeviceSynchronize()
                 : cudaStreamSynchronize((cudaStream_t)stream)) != cudaSuccess)
        (void)cudaGetLastError();
    Py_END_ALLOW_THREADS
    ra_cuda_leave_device(device, prev);
    run_release(release, arg);
}

/* Take the entries whose event completed off the FIFOs (all of them with
 * `wait`, after waiting for each with the GIL released); returns them as
 * a list in release order. */
static pending *take_done(int wait) {
    pending *done = NULL, **tail = &done;
    pthread_mutex_lock(&lifetime_lock);
    for (int f = 0; f < N_FIFOS; f++) {
        while (fifo_head[f] != NULL) {
            pending *p = fifo_head[f];
            if (!wait) {
                cudaError_t e = cudaEventQuery(p->event);
                if (e == cudaErrorNotReady) break;
                /* done, or an error (a faulted device runs nothing more) */
                if (e != cudaSuccess) (void)cudaGetLastError();
            }
            fifo_head[f] = p->next;
            if (fifo_head[f] == NULL) fifo_tail[f] = NULL;
            p->next = NULL;
            *tail = p;
            tail = &p->next;
            atomic_fetch_sub(&n_pending, 1);
        }
    }
    pthread_mutex_unlock(&lifetime_lock);
    if (wait && done != NULL) {
        Py_BEGIN_ALLOW_THREADS
        for (pending *p = done; p != NULL; p = p->next)
            if (cudaEventSynchronize(p->event) != cudaSuccess)
                (void)cudaGetLastError();
        Py_END_ALLOW_THREADS
    }
    return done;
}

static void release_list(pending *p) {
    while (p != NULL) {
        pending *next = p->next;
        run_release(p->release, p->arg);
        event_put(p->device, p->event);
        PyMem_RawFree(p);
        p = next;
    }
}

void ra_cuda_poll_releases(void) {
    if (atomic_load(&n_pending) == 0) return;
    release_list(take_done(0));
}

void ra_cuda_drain_releases(void) {
    if (atomic_load(&n_pending) == 0) return;
    release_list(take_done(1));
}

long ra_cuda_pending_releases(void) { return atomic_load(&n_pending); }

#else /* !RA_WITH_CUDA: no device work exists, so nothing waits */

void ra_cuda_release_after(int device, int shared, void (*release)(void *),
                           void *arg) {
    (void)device; (void)shared;
    run_release(release, arg);
}
void ra_cuda_poll_releases(void) {}
void ra_cuda_drain_releases(void) {}
long ra_cuda_pending_releases(void) { return 0; }

#endif /* RA_WITH_CUDA */

/* ---- Python hooks ---------------------------------------------------- */

static PyObject *py_pending_releases(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyLong_FromLong(ra_cuda_pending_releases());
}

static PyObject *py_release_all(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    ra_cuda_drain_releases();
    Py_RETURN_NONE;
}

static PyMethodDef lifetime_methods[] = {
    {"cuda_pending_releases", py_pending_releases, METH_NOARGS,
     "cuda_pending_releases() -> int: borrowed device arrays ringattn let "
     "go of whose producers get them back once ringattn's stream work on "
     "them has completed."},
    {"cuda_release_all", py_release_all, METH_NOARGS,
     "cuda_release_all(): wait for that work and give every such array "
     "back (run at exit)."},
    {NULL, NULL, 0, NULL}};

int ra_cuda_lifetime_exec(PyObject *m) {
    if (PyModule_AddFunctions(m, lifetime_methods) < 0) return -1;
    /* drain at exit, before the interpreter finalises */
    PyObject *fn = PyObject_GetAttrString(m, "cuda_release_all");
    if (fn == NULL) return -1;
    PyObject *atexit = PyImport_ImportModule("atexit");
    PyObject *r = atexit != NULL
                      ? PyObject_CallMethod(atexit, "register", "O", fn)
                      : NULL;
    Py_XDECREF(atexit);
    Py_DECREF(fn);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}
