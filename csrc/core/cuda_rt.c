/*
 * cuda_rt.c -- ringattn's view of the CUDA runtime (see cuda_rt.h): is a
 * device usable and if not why, device memory through a caching pool, one
 * compute stream per device, DLPack stream ordering and byte copies.
 *
 * Built by the C compiler, not nvcc.  With RA_WITH_CUDA the CUDA runtime is
 * linked statically (libcudart_static) and nothing touches the driver until
 * one of these functions is called; without it every function is a stub
 * that says ringattn was built without CUDA.
 *
 * The caching pool: freed blocks go onto a per-device free list of their
 * size class (sizes rounded up to m * 2^e with m in 5..8, so at most 25%
 * is wasted) and are handed out again to requests of the same class.
 * RINGATTN_CUDA_CACHING=0 turns the pool off (plain cudaMalloc/cudaFree)
 * for compute-sanitizer runs.  memory_stats()["cuda"] counts the bytes
 * callers hold, not the cache.
 *
 * When may a freed block be handed out again?  The pool orders by streams
 * (free with stream ordering), which needs one invariant: every use of a
 * block ringattn allocated is ordered after ringattn's compute stream of
 * its device at the time of the use.  Kernels and copies run on that
 * stream; a DLPack consumer waits for it (ra_cuda_export_sync); the NCCL
 * communicator's stream waits for it before it touches a buffer.  A block
 * that only ringattn's streams touched is therefore safe to reuse as soon
 * as it is freed: the new work is queued after the old on the compute
 * stream, and the communicator hands its transfers back to that stream
 * (comm_nccl_xfer.c) before their buffers can be freed.  A block exported
 * through DLPack to another stream is different: the consumer may still
 * have reads queued there when it drops the tensor.  Such blocks are noted
 * at export (shared_blocks) and, when freed,
 *   - exported to a stream the legacy default stream synchronises with
 *     (the legacy stream itself, PyTorch's and CuPy's default; a
 *     per-thread default stream; any stream of the block's device made
 *     without cudaStreamNonBlocking): the compute stream waits for an
 *     event recorded on the legacy stream now, which comes after
 *     everything queued on those streams so far, so reuse is queued after
 *     the consumer's reads, with no host wait; the legacy stream is always
 *     valid, from any thread;
 *   - exported to a non-blocking stream (or to several streams, or with
 *     stream=-1): that stream may be gone by now, so no event can be
 *     recorded on it.  The block is returned with cudaFree, which
 *     synchronises the device (every stream's queued work finishes first),
 *     with the GIL released, and is not cached.
 * Recording an event per block at every free, or cudaFreeAsync on the
 * compute stream, would not be sound for the second case and adds nothing
 * for blocks only ringattn's streams used.  Memory ringattn borrowed from
 * other producers is the other direction: cuda_lifetime.c.
 */
#include "core/module.h"
#include "core/cuda_rt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RA_NO_CUDA_MSG                                                        \
    "ringattn was built without CUDA (set RINGATTN_CUDA=1 and install a "     \
    "CUDA toolkit)"

#ifdef RA_WITH_CUDA

#include <pthread.h>
#include <cuda_runtime.h>

#define RA_MAX_DEVICES RA_CUDA_MAX_DEVICES
#define RA_N_CLASSES 224

/* ---- error mapping: the one place cudaError_t becomes an ra_status ------ */

ra_status ra_cuda_status(int err, const char *what, const char *file,
                         int line) {
    cudaError_t e = (cudaError_t)err;
    if (e == cudaSuccess) return RA_OK;
    ra_status st = (e == cudaErrorMemoryAllocation) ? RA_ERR_NOMEM
                                                    : RA_ERR_CUDA;
    ra_set_error(st, "CUDA error in %s (%s:%d): %s (%s)", what, file, line,
                 cudaGetErrorString(e), cudaGetErrorName(e));
    return st;
}

#define CUDA_CHECK(call)                                                      \
    do {                                                                      \
        cudaError_t ra_cu_e_ = (call);                                        \
        if (ra_cu_e_ != cudaSuccess)                                          \
            return ra_cuda_status((int)ra_cu_e_, #call, __FILE__, __LINE__);  \
    } while (0)
#define CUDA_CHECKGOTO(call, st, label)                                       \
    do {                                                                      \
        cudaError_t ra_cu_e_ = (call);                                        \
        if (ra_cu_e_ != cudaSuccess) {                                        \
            (st) = ra_cuda_status((int)ra_cu_e_, #call, __FILE__, __LINE__);  \
            goto label;                                                       \
        }                                                                     \
    } while (0)

/* ---- availability ------------------------------------------------------ */

static pthread_once_t avail_once = PTHREAD_ONCE_INIT;
static int avail_count;          /* usable devices, 0 when unavailable */
static char avail_why[512];

static void probe_devices(void) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        snprintf(avail_why, sizeof avail_why,
                 "no usable CUDA driver or device: %s (%s)",
                 cudaGetErrorString(e), cudaGetErrorName(e));
        (void)cudaGetLastError();
        avail_count = 0;
        return;
    }
    if (n <= 0) {
        snprintf(avail_why, sizeof avail_why, "no CUDA device found");
        avail_count = 0;
        return;
    }
    /* The kernels are compiled for compute capability 8.0 and newer. */
    int usable = 0;
    for (int d = 0; d < n; d++) {
        int major = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                   d) == cudaSuccess && major >= 8)
            usable++;
    }
    (void)cudaGetLastError();
    if (usable == 0) {
        snprintf(avail_why, sizeof avail_why,
                 "found %d CUDA device(s) but none has compute capability "
                 ">= 8.0, which ringattn's kernels need", n);
        avail_count = 0;
        return;
    }
    avail_count = n > RA_MAX_DEVICES ? RA_MAX_DEVICES : n;
    avail_why[0] = '\0';
}

int ra_cuda_available(const char **why) {
    pthread_once(&avail_once, probe_devices);
    if (why != NULL) *why = avail_count > 0 ? "" : avail_why;
    return avail_count > 0;
}

int ra_cuda_built(void) { return 1; }

int ra_cuda_device_count(void) {
    return ra_cuda_available(NULL) ? avail_count : 0;
}

static ra_status check_device(int device) {
    const char *why = NULL;
    if (!ra_cuda_available(&why)) {
        ra_set_error(RA_ERR_UNSUPPORTED, "CUDA is not available: %s", why);
        return RA_ERR_UNSUPPORTED;
    }
    if (device < 0 || device >= avail_count) {
        ra_set_error(RA_ERR_VALUE, "CUDA device %d out of range [0, %d)",
                     device, avail_count);
        return RA_ERR_VALUE;
    }
    return RA_OK;
}

/* Make `device` current, remembering the caller's device in *prev so that
 * restore_device puts it back (other libraries share this thread). */
static ra_status enter_device(int device, int *prev) {
    RA_CHECK(check_device(device));
    CUDA_CHECK(cudaGetDevice(prev));
    if (*prev != device) CUDA_CHECK(cudaSetDevice(device));
    return RA_OK;
}

static void restore_device(int device, int prev) {
    if (prev != device) (void)cudaSetDevice(prev);
}

ra_status ra_cuda_enter_device(int device, int *prev) {
    return enter_device(device, prev);
}

void ra_cuda_leave_device(int device, int prev) {
    restore_device(device, prev);
}

/* ---- caching pool ------------------------------------------------------ */

typedef struct free_block {
    void *ptr;
    struct free_block *next;
} free_block;

/* A block exported through DLPack to a stream other than the compute
 * stream: its pointer and 1 when the legacy default stream synchronises
 * with that stream, or RA_STREAM_UNKNOWN when it does not, or for several
 * streams. */
typedef struct shared_block {
    void *ptr;
    intptr_t stream;
    struct shared_block *next;
} shared_block;

#define RA_SHARED_BUCKETS 256
#define RA_STREAM_UNKNOWN ((intptr_t)-1)

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static free_block *pool_free[RA_MAX_DEVICES][RA_N_CLASSES];
static shared_block *shared_blocks[RA_SHARED_BUCKETS];   /* under pool_lock */
static int caching_mode = -1;    /* -1 unknown, 0 off, 1 on (under lock) */

static size_t shared_bucket(const void *ptr) {
    return ((uintptr_t)ptr >> 9) % RA_SHARED_BUCKETS;
}

/* Note that `ptr` was exported to `stream` (pool_lock held).  A second
 * stream makes it "unknown": the free then synchronises the device. */
static int shared_note_locked(void *ptr, intptr_t stream) {
    shared_block **head = &shared_blocks[shared_bucket(ptr)];
    for (shared_block *e = *head; e != NULL; e = e->next)
        if (e->ptr == ptr) {
            if (e->stream != stream) e->stream = RA_STREAM_UNKNOWN;
            return 0;
        }
    shared_block *e = (shared_block *)malloc(sizeof *e);
    if (e == NULL) return -1;
    e->ptr = ptr;
    e->stream = stream;
    e->next = *head;
    *head = e;
    return 0;
}

/* Forget `ptr`; 1 and its stream in *stream if it was noted (pool_lock
 * held). */
static int shared_take_locked(void *ptr, intptr_t *stream) {
    for (shared_block **link = &shared_blocks[shared_bucket(ptr)];
         *link != NULL; link = &(*link)->next)
        if ((*link)->ptr == ptr) {
            shared_block *e = *link;
            *stream = e->stream;
            *link = e->next;
            free(e);
            return 1;
        }
    return 0;
}

static int caching_enabled(void) {
    pthread_mutex_lock(&pool_lock);
    if (caching_mode < 0) {
        const char *env = getenv("RINGATTN_CUDA_CACHING");
        caching_mode = !(env != NULL && strcmp(env, "0") == 0);
    }
    int on = caching_mode;
    pthread_mutex_unlock(&pool_lock);
    return on;
}

/* Size class of a request: its rounded size and the free-list index. */
static size_t size_class(size_t n, int *index) {
    if (n <= 512) {
        *index = 0;
        return 512;
    }
    int e = 63 - __builtin_clzll((unsigned long long)(n - 1)); /* >= 9 */
    size_t quarter = (size_t)1 << (e - 2);
    size_t rounded = (n + quarter - 1) / quarter;      /* 5..8 */
    *index = 1 + (e - 9) * 4 + (int)(rounded - 5);
    return rounded * quarter;
}

/* Take every cached block of `device` (or of all devices when < 0) out of
 * the pool into lists[d], one list per device.  Called with pool_lock
 * held; release_detached() gives them to the driver after the unlock. */
static void detach_cached_locked(int device, free_block *lists[]) {
    for (int d = 0; d < RA_MAX_DEVICES; d++) {
        lists[d] = NULL;
        if (device >= 0 && d != device) continue;
        for (int c = 0; c < RA_N_CLASSES; c++) {
            free_block *b = pool_free[d][c];
            pool_free[d][c] = NULL;
            while (b != NULL) {
                free_block *next = b->next;
                b->next = lists[d];
                lists[d] = b;
                b = next;
            }
        }
    }
}

/* cudaFree the detached blocks, each with its own device current (freeing
 * with another device current would create a context there), without
 * pool_lock and with the GIL released (cudaFree waits for the device's
 * queued work, which may wait on a host callback that needs the GIL).
 * The caller's current device is kept. */
static void release_detached(free_block *lists[]) {
    int any = 0;
    for (int d = 0; d < RA_MAX_DEVICES; d++) any |= lists[d] != NULL;
    if (!any) return;
    PyThreadState *ts = PyGILState_Check() ? PyEval_SaveThread() : NULL;
    int prev = -1;
    if (cudaGetDevice(&prev) != cudaSuccess) {
        (void)cudaGetLastError();
        prev = -1;
    }
    int cur = prev;
    for (int d = 0; d < RA_MAX_DEVICES; d++) {
        if (lists[d] == NULL) continue;
        if (d != cur) {
            if (cudaSetDevice(d) == cudaSuccess) cur = d;
            else (void)cudaGetLastError();
        }
        for (free_block *b = lists[d], *next; b != NULL; b = next) {
            next = b->next;
            if (cudaFree(b->ptr) != cudaSuccess) (void)cudaGetLastError();
            free(b);
        }
    }
    if (prev >= 0 && cur != prev) (void)cudaSetDevice(prev);
    if (ts != NULL) PyEval_RestoreThread(ts);
}

ra_status ra_cuda_malloc(int device, size_t nbytes, void **ptr) {
    *ptr = NULL;
    int prev = 0;
    RA_CHECK(enter_device(device, &prev));
    ra_status st = RA_OK;
    int cls = 0;
    size_t want = nbytes;
    if (caching_enabled()) {
        want = size_class(nbytes == 0 ? 1 : nbytes, &cls);
        if (cls >= RA_N_CLASSES) {
            ra_set_error(RA_ERR_NOMEM, "CUDA allocation of %zu bytes is too "
                         "large", nbytes);
            st = RA_ERR_NOMEM;
            goto exit;
        }
        pthread_mutex_lock(&pool_lock);
        free_block *b = pool_free[device][cls];
        if (b != NULL) {
            pool_free[device][cls] = b->next;
            *ptr = b->ptr;
            free(b);
        }
        pthread_mutex_unlock(&pool_lock);
        if (*ptr != NULL) goto counted;
    } else if (want == 0) {
        want = 1;
    }
    cudaError_t e = cudaMalloc(ptr, want);
    if (e == cudaErrorMemoryAllocation) {
        /* Out of memory: hand the cache back to the driver and retry once. */
        free_block *lists[RA_MAX_DEVICES];
        (void)cudaGetLastError();
        pthread_mutex_lock(&pool_lock);
        detach_cached_locked(device, lists);
        pthread_mutex_unlock(&pool_lock);
        release_detached(lists);
        e = cudaMalloc(ptr, want);
    }
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        *ptr = NULL;
        st = (e == cudaErrorMemoryAllocation) ? RA_ERR_NOMEM : RA_ERR_CUDA;
        ra_set_error(st, "CUDA allocation of %zu bytes on device %d failed: "
                     "%s", nbytes, device, cudaGetErrorString(e));
        goto exit;
    }
counted:
    ra_memstats_add(RA_MEMKIND_CUDA, (int64_t)nbytes);
exit:
    restore_device(device, prev);
    return st;
}

/* cudaFree, which first waits for all work queued on the device, with the
 * GIL released when this thread holds it (a consumer's queued work may wait
 * on a host callback that needs it). */
static cudaError_t free_synchronising(void *ptr) {
    PyThreadState *ts = PyGILState_Check() ? PyEval_SaveThread() : NULL;
    cudaError_t e = cudaFree(ptr);
    if (ts != NULL) PyEval_RestoreThread(ts);
    return e;
}

/* Order the compute stream of the current device (`s`) after the work
 * queued so far on the legacy default stream and on every stream it
 * synchronises with. */
static cudaError_t wait_for_legacy_stream(cudaStream_t s) {
    cudaEvent_t ev = NULL;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e != cudaSuccess) return e;
    e = cudaEventRecord(ev, cudaStreamLegacy);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(s, ev, 0);
    (void)cudaEventDestroy(ev);    /* the wait keeps what it needs */
    return e;
}

ra_status ra_cuda_free(int device, void *ptr, size_t nbytes) {
    if (ptr == NULL) return RA_OK;
    int prev = 0;
    /* first the device: a failure here leaves the export record in place */
    RA_CHECK(enter_device(device, &prev));
    intptr_t consumer = 0;
    pthread_mutex_lock(&pool_lock);
    const int shared = shared_take_locked(ptr, &consumer);
    pthread_mutex_unlock(&pool_lock);
    const int caching = caching_enabled();
    void *compute = NULL;
    if (shared && caching && consumer != RA_STREAM_UNKNOWN &&
        ra_cuda_compute_stream(device, &compute) != RA_OK)
        consumer = RA_STREAM_UNKNOWN;
    ra_status st = RA_OK;
    if (shared && caching && consumer != RA_STREAM_UNKNOWN &&
        wait_for_legacy_stream((cudaStream_t)compute) != cudaSuccess) {
        (void)cudaGetLastError();
        consumer = RA_STREAM_UNKNOWN;      /* fall back to synchronising */
    }
    if (shared && (!caching || consumer == RA_STREAM_UNKNOWN)) {
        /* maybe still read on a stream we cannot name: see the top */
        CUDA_CHECKGOTO(free_synchronising(ptr), st, exit);
    } else if (caching) {
        int cls = 0;
        (void)size_class(nbytes == 0 ? 1 : nbytes, &cls);
        free_block *b = (free_block *)malloc(sizeof *b);
        if (b != NULL && cls < RA_N_CLASSES) {
            b->ptr = ptr;
            pthread_mutex_lock(&pool_lock);
            b->next = pool_free[device][cls];
            pool_free[device][cls] = b;
            pthread_mutex_unlock(&pool_lock);
        } else {
            free(b);
            CUDA_CHECKGOTO(cudaFree(ptr), st, exit);
        }
    } else {
        CUDA_CHECKGOTO(cudaFree(ptr), st, exit);
    }
exit:
    /* counted as given back even when cudaFree failed: ringattn no longer
     * holds the block either way */
    ra_memstats_add(RA_MEMKIND_CUDA, -(int64_t)nbytes);
    restore_device(device, prev);
    return st;
}

static int compute_stream_exists(int device);

void ra_cuda_empty_cache(void) {
    if (!ra_cuda_available(NULL)) return;
    int prev = 0;
    if (cudaGetDevice(&prev) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    /* Pending kernels may still use cached blocks: finish them first, on
     * the devices ringattn ran on (synchronising the others would create a
     * context, and memory, on every GPU of the machine). */
    for (int d = 0; d < avail_count; d++)
        if (compute_stream_exists(d)) (void)ra_cuda_synchronize(d);
    free_block *lists[RA_MAX_DEVICES];
    pthread_mutex_lock(&pool_lock);
    detach_cached_locked(-1, lists);
    pthread_mutex_unlock(&pool_lock);
    release_detached(lists);
    (void)cudaSetDevice(prev);
}

/* ---- compute streams --------------------------------------------------- */

static pthread_mutex_t stream_lock = PTHREAD_MUTEX_INITIALIZER;
static cudaStream_t compute_streams[RA_MAX_DEVICES];

static int compute_stream_exists(int device) {
    pthread_mutex_lock(&stream_lock);
    int exists = compute_streams[device] != NULL;
    pthread_mutex_unlock(&stream_lock);
    return exists;
}

ra_status ra_cuda_compute_stream(int device, void **stream) {
    *stream = NULL;
    RA_CHECK(check_device(device));
    ra_status st = RA_OK;
    pthread_mutex_lock(&stream_lock);
    if (compute_streams[device] == NULL) {
        int prev = 0;
        st = enter_device(device, &prev);
        if (st == RA_OK) {
            cudaStream_t s = NULL;
            cudaError_t e =
                cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
            if (e != cudaSuccess)
                st = ra_cuda_status((int)e, "cudaStreamCreateWithFlags",
                                    __FILE__, __LINE__);
            else
                compute_streams[device] = s;
            restore_device(device, prev);
        }
    }
    *stream = (void *)compute_streams[device];
    pthread_mutex_unlock(&stream_lock);
    return st;
}

ra_status ra_cuda_memset_zero(int device, void *ptr, size_t nbytes) {
    if (nbytes == 0) return RA_OK;
    void *s = NULL;
    RA_CHECK(ra_cuda_compute_stream(device, &s));
    int prev = 0;
    RA_CHECK(enter_device(device, &prev));
    ra_status st = RA_OK;
    CUDA_CHECKGOTO(cudaMemsetAsync(ptr, 0, nbytes, (cudaStream_t)s), st,
                   exit);
exit:
    restore_device(device, prev);
    return st;
}

/* 1 when the legacy default stream of `device` (current) synchronises
 * with `consumer`: work queued there now comes before the legacy stream's
 * next operation.  The legacy stream itself, and the device's blocking
 * streams (per-thread default streams are blocking). */
static int ordered_by_legacy(int device, cudaStream_t consumer) {
    if (consumer == cudaStreamLegacy) return 1;
#if CUDART_VERSION >= 12080
    unsigned flags = 0;
    int owner = -1;
    if (cudaStreamGetFlags(consumer, &flags) != cudaSuccess ||
        cudaStreamGetDevice(consumer, &owner) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return owner == device && !(flags & cudaStreamNonBlocking);
#else
    (void)device;
    return 0;     /* no cudaStreamGetDevice: the free synchronises */
#endif
}

/* DLPack stream numbering: -1 = no synchronisation wanted, 1 = the legacy
 * default stream, 2 = the per-thread default stream, anything else is a
 * cudaStream_t.  0 is ambiguous in the protocol; it is treated as legacy. */
ra_status ra_cuda_export_sync(int device, void *block,
                              intptr_t consumer_stream, int *shared) {
    void *s = NULL;
    *shared = RA_SHARED_NONE;
    RA_CHECK(ra_cuda_compute_stream(device, &s));
    cudaStream_t consumer;
    if (consumer_stream == 0 || consumer_stream == 1)
        consumer = cudaStreamLegacy;
    else if (consumer_stream == 2)
        consumer = cudaStreamPerThread;
    else
        consumer = (cudaStream_t)consumer_stream;
    if (consumer == (cudaStream_t)s) return RA_OK;
    int prev = 0;
    RA_CHECK(enter_device(device, &prev));
    ra_status st = RA_OK;
    cudaEvent_t ev = NULL;
    *shared = consumer_stream != -1 && ordered_by_legacy(device, consumer)
                  ? RA_SHARED_LEGACY
                  : RA_SHARED_UNKNOWN;
    if (block != NULL) {
        /* read outside the compute stream from now on: the free must wait
         * for the consumer (see the top of this file) */
        const intptr_t how = *shared == RA_SHARED_LEGACY ? (intptr_t)1
                                                         : RA_STREAM_UNKNOWN;
        pthread_mutex_lock(&pool_lock);
        int bad = shared_note_locked(block, how);
        pthread_mutex_unlock(&pool_lock);
        if (bad) {
            ra_set_error(RA_ERR_NOMEM, "out of host memory");
            st = RA_ERR_NOMEM;
            goto exit;
        }
    }
    if (consumer_stream == -1) goto exit;   /* the consumer syncs itself */
    CUDA_CHECKGOTO(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), st,
                   exit);
    CUDA_CHECKGOTO(cudaEventRecord(ev, (cudaStream_t)s), st, exit);
    CUDA_CHECKGOTO(cudaStreamWaitEvent(consumer, ev, 0), st, exit);
exit:
    /* Destroying a recorded event is fine: the wait keeps its own ref. */
    if (ev != NULL) (void)cudaEventDestroy(ev);
    restore_device(device, prev);
    return st;
}

ra_status ra_cuda_memcpy(int device, void *dst, int dst_is_device,
                         const void *src, int src_is_device, size_t nbytes,
                         int sync) {
    if (nbytes == 0) return RA_OK;
    void *s = NULL;
    RA_CHECK(ra_cuda_compute_stream(device, &s));
    int prev = 0;
    RA_CHECK(enter_device(device, &prev));
    ra_status st = RA_OK;
    enum cudaMemcpyKind kind =
        dst_is_device ? (src_is_device ? cudaMemcpyDeviceToDevice
                                       : cudaMemcpyHostToDevice)
                      : (src_is_device ? cudaMemcpyDeviceToHost
                                       : cudaMemcpyHostToHost);
    CUDA_CHECKGOTO(cudaMemcpyAsync(dst, src, nbytes, kind, (cudaStream_t)s),
                   st, exit);
    if (sync) CUDA_CHECKGOTO(cudaStreamSynchronize((cudaStream_t)s), st, exit);
exit:
    restore_device(device, prev);
    return st;
}

ra_status ra_cuda_launch(int device, ra_cuda_launcher launch,
                         const void *params) {
    void *stream = NULL;
    int prev = -1;
    ra_status st = ra_cuda_compute_stream(device, &stream);
    if (st != RA_OK) return st;
    Py_BEGIN_ALLOW_THREADS
    st = ra_cuda_enter_device(device, &prev);
    if (st == RA_OK) {
        st = launch(params, stream);
        ra_cuda_leave_device(device, prev);
    }
    Py_END_ALLOW_THREADS
    return st;
}

ra_status ra_cuda_synchronize(int device) {
    void *s = NULL;
    RA_CHECK(ra_cuda_compute_stream(device, &s));
    int prev = 0;
    RA_CHECK(enter_device(device, &prev));
    ra_status st = RA_OK;
    CUDA_CHECKGOTO(cudaStreamSynchronize((cudaStream_t)s), st, exit);
exit:
    restore_device(device, prev);
    return st;
}

#else /* !RA_WITH_CUDA: every entry point says why it cannot work */

static ra_status no_cuda(void) {
    ra_set_error(RA_ERR_UNSUPPORTED, "%s", RA_NO_CUDA_MSG);
    return RA_ERR_UNSUPPORTED;
}

ra_status ra_cuda_status(int err, const char *what, const char *file,
                         int line) {
    (void)err; (void)what; (void)file; (void)line;
    return no_cuda();
}

ra_status ra_cuda_enter_device(int device, int *prev) {
    (void)device;
    *prev = 0;
    return no_cuda();
}
void ra_cuda_leave_device(int device, int prev) {
    (void)device; (void)prev;
}

int ra_cuda_available(const char **why) {
    if (why != NULL) *why = RA_NO_CUDA_MSG;
    return 0;
}
int ra_cuda_built(void) { return 0; }
int ra_cuda_device_count(void) { return 0; }

ra_status ra_cuda_malloc(int device, size_t nbytes, void **ptr) {
    (void)device; (void)nbytes;
    *ptr = NULL;
    return no_cuda();
}
ra_status ra_cuda_free(int device, void *ptr, size_t nbytes) {
    (void)device; (void)ptr; (void)nbytes;
    return no_cuda();
}
ra_status ra_cuda_memset_zero(int device, void *ptr, size_t nbytes) {
    (void)device; (void)ptr; (void)nbytes;
    return no_cuda();
}
void ra_cuda_empty_cache(void) {}
ra_status ra_cuda_compute_stream(int device, void **stream) {
    (void)device;
    *stream = NULL;
    return no_cuda();
}
ra_status ra_cuda_export_sync(int device, void *block,
                              intptr_t consumer_stream, int *shared) {
    (void)device; (void)block; (void)consumer_stream;
    *shared = RA_SHARED_NONE;
    return no_cuda();
}
ra_status ra_cuda_memcpy(int device, void *dst, int dst_is_device,
                         const void *src, int src_is_device, size_t nbytes,
                         int sync) {
    (void)device; (void)dst; (void)dst_is_device; (void)src;
    (void)src_is_device; (void)nbytes; (void)sync;
    return no_cuda();
}
ra_status ra_cuda_synchronize(int device) {
    (void)device;
    return no_cuda();
}
ra_status ra_cuda_launch(int device, ra_cuda_launcher launch,
                         const void *params) {
    (void)device; (void)launch; (void)params;
    ra_set_error(RA_ERR_UNSUPPORTED,
                 "the inputs live on a CUDA device but ringattn was built "
                 "without CUDA");
    return RA_ERR_UNSUPPORTED;
}

#endif /* RA_WITH_CUDA */

/* ---- Python hooks: ringattn._C.cuda_* ---------------------------------- */

static PyObject *py_cuda_available(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    const char *why = NULL;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = ra_cuda_available(&why);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(Os)", ok ? Py_True : Py_False,
                         why != NULL ? why : "");
}

static PyObject *py_cuda_built(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyBool_FromLong(ra_cuda_built());
}

static PyObject *py_cuda_device_count(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    int n;
    Py_BEGIN_ALLOW_THREADS
    n = ra_cuda_device_count();
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(n);
}

static PyObject *py_cuda_empty_cache(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    Py_BEGIN_ALLOW_THREADS
    ra_cuda_empty_cache();
    Py_END_ALLOW_THREADS
    /* the streams are idle: borrowed arrays go back to their producers */
    ra_cuda_poll_releases();
    Py_RETURN_NONE;
}

static PyObject *py_cuda_synchronize(PyObject *self, PyObject *arg) {
    (void)self;
    int device = (int)PyLong_AsLong(arg);
    if (device == -1 && PyErr_Occurred()) return NULL;
    ra_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ra_cuda_synchronize(device);
    Py_END_ALLOW_THREADS
    if (st != RA_OK) return ra_raise(st);
    ra_cuda_poll_releases();
    Py_RETURN_NONE;
}

static PyMethodDef cuda_methods[] = {
    {"cuda_available", py_cuda_available, METH_NOARGS,
     "cuda_available() -> (bool, reason): whether CUDA kernels can run."},
    {"cuda_built", py_cuda_built, METH_NOARGS,
     "cuda_built() -> bool: whether ringattn was compiled with CUDA."},
    {"cuda_device_count", py_cuda_device_count, METH_NOARGS,
     "cuda_device_count() -> int: usable CUDA devices (0 if none)."},
    {"cuda_empty_cache", py_cuda_empty_cache, METH_NOARGS,
     "cuda_empty_cache(): give cached device blocks back to the driver."},
    {"cuda_synchronize", py_cuda_synchronize, METH_O,
     "cuda_synchronize(device): wait for ringattn's stream on device; "
     "the borrowed arrays it was done with go back to their producers."},
    {NULL, NULL, 0, NULL}};

int ra_cuda_exec(PyObject *m, ra_module_state *st) {
    (void)st;
    if (PyModule_AddFunctions(m, cuda_methods) < 0) return -1;
    if (ra_cuda_lifetime_exec(m) < 0) return -1;
    return ra_cuda_emu_exec(m);
}
