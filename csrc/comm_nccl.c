/*
 * comm_nccl.c -- the "nccl" backend: one NCCL communicator per rank moving
 * CUDA device memory on its own stream.
 *
 * Loading.  libnccl is opened with dlopen at first use, never linked, so
 * importing ringattn works where NCCL is missing.  Tried in order:
 * $RINGATTN_NCCL_LIBRARY, "libnccl.so.2", then a path the Python layer
 * found (the NVIDIA pip wheel's nvidia/nccl/lib/libnccl.so.2).
 *
 * Bootstrap.  An explicit 128-byte unique id, or the host rendezvous: a
 * "host" communicator (ringattn's TCP transport, comm_host.c) over which
 * rank 0 hands its id to the others.  That host communicator stays inside
 * the NCCL one and serves barrier/allgather.  Without it, barrier/allgather
 * are comm_core.c's generic versions on top of sendrecv, whose host memory
 * is staged through device scratch ("staged" transfers, waited on by the
 * host).  ncclCommInitRankConfig runs non-blocking and is polled against
 * the deadline; on timeout the half-made communicator is aborted.
 *
 * A ring step.  sendrecv_start makes the communicator's stream wait for the
 * caller's stream (ringattn's compute stream: the kernels that wrote the
 * send block or still read the receive block), then issues
 *     ncclGroupStart(); ncclSend(dst); ncclRecv(src); ncclGroupEnd();
 * lets the non-blocking communicator settle (ncclInProgress -> success) and
 * records a completion event.  A send to self is a device-to-device copy on
 * the same stream.  wait() makes the compute stream wait for the completion
 * event: the host never blocks on a transfer.
 *
 * Failure.  A watchdog thread per communicator polls the completion events
 * and ncclCommGetAsyncError.  A transfer not done by its deadline, or an
 * asynchronous NCCL error, aborts the NCCL communicator (which stops its
 * kernels, so streams waiting on it move on) and fails ours: every later
 * call raises CommError naming rank, peer, op and step.
 *
 * Locks.  issue_mu serialises whole operations (a non-blocking NCCL
 * communicator must settle before the next call); nccl_mu guards every
 * single NCCL call and the handle (the watchdog and abort come from other
 * threads); lock guards the op list and the event pool.  Nesting:
 * issue_mu -> nccl_mu, and lock -> c->mu; lock and nccl_mu never nest.
 */
#include "comm.h"
#include "cuda_rt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RA_NCCL_NO_CUDA_MSG                                                   \
    "ringattn was built without CUDA: the nccl backend needs a CUDA build "   \
    "(RINGATTN_CUDA=1 with a CUDA toolkit)"

#ifdef RA_WITH_CUDA

#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <time.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include "../cuda/attn_cuda.h"

_Static_assert(NCCL_UNIQUE_ID_BYTES == RA_NCCL_ID_BYTES,
               "RA_NCCL_ID_BYTES must match NCCL_UNIQUE_ID_BYTES");

#define POOL_MAX 64              /* completion events kept for reuse */
#define WATCH_BUSY_S 0.001       /* watchdog period with transfers in flight */
#define WATCH_IDLE_S 0.2         /* and without */

/* ---- the NCCL library, resolved at run time ----------------------------- */

typedef struct nccl_api {
    __typeof__(ncclGetVersion) *GetVersion;
    __typeof__(ncclGetUniqueId) *GetUniqueId;
    __typeof__(ncclCommInitRankConfig) *CommInitRankConfig;
    __typeof__(ncclCommGetAsyncError) *CommGetAsyncError;
    __typeof__(ncclCommAbort) *CommAbort;
    __typeof__(ncclCommFinalize) *CommFinalize;
    __typeof__(ncclCommDestroy) *CommDestroy;
    __typeof__(ncclGroupStart) *GroupStart;
    __typeof__(ncclGroupEnd) *GroupEnd;
    __typeof__(ncclSend) *Send;
    __typeof__(ncclRecv) *Recv;
    __typeof__(ncclGetErrorString) *GetErrorString;
    __typeof__(ncclGetLastError) *GetLastError;   /* optional (NCCL < 2.13) */
} nccl_api;

static pthread_mutex_t api_mu = PTHREAD_MUTEX_INITIALIZER;
static nccl_api api;
static void *api_handle;

/* Resolve every symbol of `h` into *a; on a missing one name it in `why`. */
static int resolve_api(void *h, nccl_api *a, char *why, size_t n) {
    struct { const char *name; void **slot; int required; } syms[] = {
        {"ncclGetVersion", (void **)&a->GetVersion, 1},
        {"ncclGetUniqueId", (void **)&a->GetUniqueId, 1},
        {"ncclCommInitRankConfig", (void **)&a->CommInitRankConfig, 1},
        {"ncclCommGetAsyncError", (void **)&a->CommGetAsyncError, 1},
        {"ncclCommAbort", (void **)&a->CommAbort, 1},
        {"ncclCommFinalize", (void **)&a->CommFinalize, 1},
        {"ncclCommDestroy", (void **)&a->CommDestroy, 1},
        {"ncclGroupStart", (void **)&a->GroupStart, 1},
        {"ncclGroupEnd", (void **)&a->GroupEnd, 1},
        {"ncclSend", (void **)&a->Send, 1},
        {"ncclRecv", (void **)&a->Recv, 1},
        {"ncclGetErrorString", (void **)&a->GetErrorString, 1},
        {"ncclGetLastError", (void **)&a->GetLastError, 0},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        *syms[i].slot = dlsym(h, syms[i].name);
        if (*syms[i].slot == NULL && syms[i].required) {
            snprintf(why, n, "has no symbol %s (NCCL >= 2.14 is needed)",
                     syms[i].name);
            return -1;
        }
    }
    return 0;
}

/* Open NCCL once per process; later calls return at once. */
static ra_status nccl_load(const char *fallback) {
    pthread_mutex_lock(&api_mu);
    if (api_handle != NULL) {
        pthread_mutex_unlock(&api_mu);
        return RA_OK;
    }
    const char *env = getenv("RINGATTN_NCCL_LIBRARY");
    const char *candidates[3] = {env, "libnccl.so.2", fallback};
    char tried[1024] = "";
    size_t used = 0;
    for (int i = 0; i < 3; i++) {
        const char *path = candidates[i];
        if (path == NULL || *path == '\0') continue;
        char why[256];
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (h == NULL) {
            const char *e = dlerror();
            snprintf(why, sizeof why, "%s", e ? e : "cannot be opened");
        } else {
            nccl_api a;
            memset(&a, 0, sizeof a);
            if (resolve_api(h, &a, why, sizeof why) == 0) {
                api = a;
                api_handle = h;
                pthread_mutex_unlock(&api_mu);
                return RA_OK;
            }
            dlclose(h);
        }
        int k = snprintf(tried + used, sizeof tried - used, "%s%s: %s",
                         used ? "; " : "", path, why);
        if (k > 0) used += (size_t)k;
        if (used >= sizeof tried) used = sizeof tried - 1;
    }
    pthread_mutex_unlock(&api_mu);
    ra_set_error(RA_ERR_NCCL,
                 "cannot load NCCL for the 'nccl' backend; tried %s. Install "
                 "it (e.g. pip install nvidia-nccl-cu12) or set "
                 "RINGATTN_NCCL_LIBRARY to the path of libnccl.so.2",
                 used ? tried : "nothing (no candidate path)");
    return RA_ERR_NCCL;
}

/* "<error string> (<NCCL's last error>)" of `r`. */
static void nccl_describe(ncclResult_t r, ncclComm_t comm, char *buf,
                          size_t n) {
    const char *what = api.GetErrorString(r);
    const char *last = api.GetLastError ? api.GetLastError(comm) : NULL;
    if (last != NULL && *last != '\0')
        snprintf(buf, n, "%s (%s)", what ? what : "unknown", last);
    else
        snprintf(buf, n, "%s", what ? what : "unknown NCCL error");
}

ra_status ra_nccl_version(const char *library, int *major, int *minor,
                          int *patch) {
    RA_CHECK(nccl_load(library));
    int code = 0;
    ncclResult_t r = api.GetVersion(&code);
    if (r != ncclSuccess) {
        char d[256];
        nccl_describe(r, NULL, d, sizeof d);
        ra_set_error(RA_ERR_NCCL, "ncclGetVersion failed: %s", d);
        return RA_ERR_NCCL;
    }
    /* NCCL_VERSION(X, Y, Z): X*1000 + Y*100 + Z before 2.9, X*10000 +
     * Y*100 + Z since */
    if (code >= 10000) {
        *major = code / 10000;
        *minor = (code % 10000) / 100;
    } else {
        *major = code / 1000;
        *minor = (code % 1000) / 100;
    }
    *patch = code % 100;
    return RA_OK;
}

ra_status ra_nccl_unique_id(const char *library,
                            unsigned char out[RA_NCCL_ID_BYTES]) {
    RA_CHECK(nccl_load(library));
    ncclUniqueId id;
    ncclResult_t r = api.GetUniqueId(&id);
    if (r != ncclSuccess) {
        char d[256];
        nccl_describe(r, NULL, d, sizeof d);
        ra_set_error(RA_ERR_NCCL, "ncclGetUniqueId failed: %s", d);
        return RA_ERR_NCCL;
    }
    memcpy(out, id.internal, RA_NCCL_ID_BYTES);
    return RA_OK;
}

/* ---- communicator state ------------------------------------------------- */

typedef struct nccl_op {
    ra_req *req;              /* the backend's reference */
    cudaEvent_t done;         /* recorded on the comm stream after the op */
    int staged;               /* host memory through device scratch */
    void *scratch;            /* staged: send bytes, then recv bytes */
    size_t scratch_bytes;
    struct nccl_op *next;
} nccl_op;

typedef struct nccl_state {
    ra_comm *c;
    int device;
    ncclComm_t nccl;          /* NULL once aborted or destroyed */
    cudaStream_t stream;      /* the communicator's own stream */
    cudaEvent_t ready;        /* caller's stream -> comm stream */
    ra_comm *host;            /* bootstrap and small collectives, or NULL */
    pthread_mutex_t issue_mu, nccl_mu, lock;
    pthread_cond_t cv;        /* wakes the watchdog */
    int sync_ready;           /* the three mutexes and cv exist */
    nccl_op *ops;             /* in flight */
    cudaEvent_t pool[POOL_MAX];
    int npool;
    pthread_t watchdog;
    int watchdog_running;
    int stop;                 /* under lock */
} nccl_state;

static void sleep_s(double s) {
    struct timespec ts;
    ts.tv_sec = (time_t)s;
    ts.tv_nsec = (long)((s - (double)ts.tv_sec) * 1e9);
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Polling back-off: yield first, then 50 us, then 1 ms naps. */
static void backoff(int *spins) {
    int s = (*spins)++;
    if (s < 64)
        sched_yield();
    else
        sleep_s(s < 1000 ? 50e-6 : 1e-3);
}

static void timespec_in(double seconds, struct timespec *ts) {
    double when = ra_now() + seconds;   /* CLOCK_MONOTONIC, like nc->cv */
    double whole = floor(when);
    ts->tv_sec = (time_t)whole;
    ts->tv_nsec = (long)((when - whole) * 1e9);
    if (ts->tv_nsec >= 1000000000L) ts->tv_nsec = 999999999L;
}

/* Wait until the non-blocking communicator left ncclInProgress.  On failure
 * `err` says why (without prefix). */
static ra_status nccl_settle(nccl_state *nc, double deadline, double timeout,
                             char *err, size_t n) {
    int spins = 0;
    for (;;) {
        ncclResult_t state = ncclInProgress, r;
        char d[256] = "";
        pthread_mutex_lock(&nc->nccl_mu);
        if (nc->nccl == NULL) {
            pthread_mutex_unlock(&nc->nccl_mu);
            snprintf(err, n, "the NCCL communicator was aborted");
            return RA_ERR_COMM;
        }
        r = api.CommGetAsyncError(nc->nccl, &state);
        if (r != ncclSuccess)
            nccl_describe(r, nc->nccl, d, sizeof d);
        else if (state != ncclSuccess && state != ncclInProgress)
            nccl_describe(state, nc->nccl, d, sizeof d);
        pthread_mutex_unlock(&nc->nccl_mu);
        if (r != ncclSuccess) {
            snprintf(err, n, "ncclCommGetAsyncError failed: %s", d);
            return RA_ERR_NCCL;
        }
        if (state == ncclSuccess) return RA_OK;
        if (state != ncclInProgress) {
            snprintf(err, n, "NCCL error: %s", d);
            return RA_ERR_NCCL;
        }
        if (ra_now() >= deadline) {
            snprintf(err, n, "timed out after %.1f s", timeout);
            return RA_ERR_TIMEOUT;
        }
        backoff(&spins);
    }
}

/* A completion event from the pool (device entered by the caller). */
static ra_status event_get(nccl_state *nc, cudaEvent_t *ev) {
    *ev = NULL;
    pthread_mutex_lock(&nc->lock);
    if (nc->npool > 0) *ev = nc->pool[--nc->npool];
    pthread_mutex_unlock(&nc->lock);
    if (*ev != NULL) return RA_OK;
    cudaError_t e = cudaEventCreateWithFlags(ev, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        *ev = NULL;
        return ra_cuda_status((int)e, "cudaEventCreateWithFlags", __FILE__,
                              __LINE__);
    }
    return RA_OK;
}

/* Give an event back (caller holds nc->lock).  Re-recording a pending
 * event is legal, and streams already waiting on it keep their snapshot. */
static void event_put_locked(nccl_state *nc, cudaEvent_t ev) {
    if (ev == NULL) return;
    if (nc->npool < POOL_MAX)
        nc->pool[nc->npool++] = ev;
    else
        (void)cudaEventDestroy(ev);
}

/* Finish the op's request with `st` (if still pending), drop the backend's
 * reference and free the op.  Caller holds nc->lock, op is unlinked. */
static void op_retire_locked(nccl_state *nc, nccl_op *op, ra_status st,
                             const char *msg) {
    ra_comm *c = nc->c;
    pthread_mutex_lock(&c->mu);
    op->req->impl = NULL;
    ra_req_finish_locked(op->req, st, msg);
    pthread_mutex_unlock(&c->mu);
    ra_req_release(op->req);
    if (op->scratch != NULL)
        (void)ra_cuda_free(nc->device, op->scratch, op->scratch_bytes);
    event_put_locked(nc, op->done);
    ra_host_free(op, sizeof *op);
}

/* Fail every op still listed (abort, close). */
static void fail_all_ops(nccl_state *nc, const char *msg) {
    pthread_mutex_lock(&nc->lock);
    nccl_op *op = nc->ops;
    nc->ops = NULL;
    while (op != NULL) {
        nccl_op *next = op->next;
        op_retire_locked(nc, op, RA_ERR_COMM, msg);
        op = next;
    }
    pthread_mutex_unlock(&nc->lock);
}

static int op_peer(const ra_req *r) {
    return r->x.src >= 0 ? r->x.src : r->x.dst;
}

/* ---- watchdog ----------------------------------------------------------- */

static void *watchdog_main(void *arg) {
    nccl_state *nc = (nccl_state *)arg;
    ra_comm *c = nc->c;
    (void)cudaSetDevice(nc->device);   /* our own thread */
    pthread_mutex_lock(&nc->lock);
    while (!nc->stop) {
        ra_status fst = RA_OK;
        char msg[RA_COMM_MSG_LEN] = "", pre[128];
        const ra_req *oldest = NULL;
        int64_t o_step = -1;
        const char *o_op = "sendrecv";
        int o_peer = -1;
        nccl_op **link = &nc->ops;
        while (*link != NULL) {
            nccl_op *op = *link;
            if (op->staged) {          /* the waiting caller drives these */
                link = &op->next;
                continue;
            }
            cudaError_t q = cudaEventQuery(op->done);
            if (q == cudaSuccess) {
                *link = op->next;
                op_retire_locked(nc, op, RA_OK, NULL);
                continue;
            }
            ra_comm_prefix(pre, sizeof pre, c->rank, op->req->op,
                           op->req->x.step);
            if (q != cudaErrorNotReady) {
                (void)cudaGetLastError();
                fst = RA_ERR_CUDA;
                snprintf(msg, sizeof msg,
                         "%sCUDA error while the transfer with rank %d ran: "
                         "%s", pre, op_peer(op->req), cudaGetErrorString(q));
                break;
            }
            if (ra_now() >= op->req->deadline) {
                fst = RA_ERR_TIMEOUT;
                snprintf(msg, sizeof msg,
                         "%stimed out after %.1f s waiting for rank %d (the "
                         "NCCL transfer did not complete)", pre,
                         op->req->timeout, op_peer(op->req));
                break;
            }
            oldest = op->req;
            o_step = op->req->x.step;
            o_op = op->req->op;
            o_peer = op_peer(op->req);
            link = &op->next;
        }
        int busy = nc->ops != NULL;
        pthread_mutex_unlock(&nc->lock);
        if (fst == RA_OK && busy) {
            ncclResult_t state = ncclSuccess;
            char d[256] = "";
            pthread_mutex_lock(&nc->nccl_mu);
            if (nc->nccl != NULL &&
                api.CommGetAsyncError(nc->nccl, &state) == ncclSuccess &&
                state != ncclSuccess && state != ncclInProgress)
                nccl_describe(state, nc->nccl, d, sizeof d);
            else
                state = ncclSuccess;
            pthread_mutex_unlock(&nc->nccl_mu);
            if (state != ncclSuccess) {
                fst = RA_ERR_NCCL;
                ra_comm_prefix(pre, sizeof pre, c->rank, o_op, o_step);
                if (oldest != NULL)
                    snprintf(msg, sizeof msg,
                             "%sNCCL error in the transfer with rank %d: %s",
                             pre, o_peer, d);
                else
                    snprintf(msg, sizeof msg, "%sNCCL error: %s", pre, d);
            }
        }
        if (fst != RA_OK) ra_comm_fail(c, fst, msg);
        pthread_mutex_lock(&nc->lock);
        if (nc->stop) break;
        struct timespec ts;
        timespec_in(nc->ops != NULL ? WATCH_BUSY_S : WATCH_IDLE_S, &ts);
        pthread_cond_timedwait(&nc->cv, &nc->lock, &ts);
    }
    pthread_mutex_unlock(&nc->lock);
    return NULL;
}

/* ---- vtable ------------------------------------------------------------- */

/* Fail `r` at start: finish it, drop the backend's reference. */
static ra_status start_fail(ra_comm *c, ra_req *r, ra_status st,
                            const char *msg) {
    pthread_mutex_lock(&c->mu);
    ra_req_finish_locked(r, st, msg);
    pthread_mutex_unlock(&c->mu);
    ra_req_release(r);
    return st;
}

/* Enqueue the transfer of `r` on the comm stream; `op` gets its event.
 * Runs with issue_mu held and the device entered. */
static ra_status issue(nccl_state *nc, ra_req *r, nccl_op *op, char *err,
                       size_t n) {
    ra_comm *c = nc->c;
    ra_xfer *x = &r->x;
    ra_status st = RA_OK;
    cudaError_t e;
    const void *send = x->send;
    void *recv = x->recv;
#define ISSUE_CUDA(call)                                                      \
    do {                                                                      \
        e = (call);                                                           \
        if (e != cudaSuccess) {                                               \
            st = ra_cuda_status((int)e, #call, __FILE__, __LINE__);           \
            snprintf(err, n, "%s", ra_last_error());                          \
            return st;                                                        \
        }                                                                     \
    } while (0)
    st = event_get(nc, &op->done);
    if (st != RA_OK) {
        snprintf(err, n, "%s", ra_last_error());
        return st;
    }
    if (op->staged) {
        /* small host values (generic barrier/allgather): copy in, and out
         * again when the caller waits */
        op->scratch_bytes = x->send_nbytes + x->recv_nbytes;
        if (op->scratch_bytes == 0) op->scratch_bytes = 1;
        st = ra_cuda_malloc(nc->device, op->scratch_bytes, &op->scratch);
        if (st != RA_OK) {
            op->scratch = NULL;
            snprintf(err, n, "%s", ra_last_error());
            return st;
        }
        send = op->scratch;
        recv = (char *)op->scratch + x->send_nbytes;
        if (x->dst >= 0 && x->send_nbytes > 0)
            ISSUE_CUDA(cudaMemcpyAsync(op->scratch, x->send, x->send_nbytes,
                                       cudaMemcpyHostToDevice, nc->stream));
    } else {
        void *caller = x->stream;
        if (caller == NULL) {
            st = ra_cuda_compute_stream(nc->device, &caller);
            if (st != RA_OK) {
                snprintf(err, n, "%s", ra_last_error());
                return st;
            }
        }
        /* the kernels that wrote the send block, or still read the receive
         * block, run before the transfer */
        ISSUE_CUDA(cudaEventRecord(nc->ready, (cudaStream_t)caller));
        ISSUE_CUDA(cudaStreamWaitEvent(nc->stream, nc->ready, 0));
    }
    if (x->dst == c->rank) {
        if (x->send_nbytes > 0 && send != recv)
            ISSUE_CUDA(cudaMemcpyAsync(recv, send, x->send_nbytes,
                                       cudaMemcpyDeviceToDevice, nc->stream));
    } else {
        ncclResult_t r1 = ncclSuccess, r2 = ncclSuccess, r3, r0;
        char d[256] = "";
        pthread_mutex_lock(&nc->nccl_mu);
        if (nc->nccl == NULL) {
            pthread_mutex_unlock(&nc->nccl_mu);
            snprintf(err, n, "the NCCL communicator was aborted");
            return RA_ERR_COMM;
        }
        r0 = api.GroupStart();
        if (r0 == ncclSuccess && x->dst >= 0)
            r1 = api.Send(send, x->send_nbytes, ncclUint8, x->dst, nc->nccl,
                          nc->stream);
        if (r0 == ncclSuccess && x->src >= 0)
            r2 = api.Recv(recv, x->recv_nbytes, ncclUint8, x->src, nc->nccl,
                          nc->stream);
        /* always close a group that was opened */
        r3 = r0 == ncclSuccess ? api.GroupEnd() : r0;
        ncclResult_t bad = r0 != ncclSuccess ? r0
                           : r1 != ncclSuccess && r1 != ncclInProgress ? r1
                           : r2 != ncclSuccess && r2 != ncclInProgress ? r2
                           : r3;
        if (bad != ncclSuccess && bad != ncclInProgress)
            nccl_describe(bad, nc->nccl, d, sizeof d);
        pthread_mutex_unlock(&nc->nccl_mu);
        if (bad != ncclSuccess && bad != ncclInProgress) {
            snprintf(err, n, "NCCL error with rank %d: %s", op_peer(r), d);
            return RA_ERR_NCCL;
        }
        /* on a non-blocking communicator the kernels may not be on the
         * stream yet: the completion event must come after them */
        if (bad == ncclInProgress) {
            char why[256];
            st = nccl_settle(nc, r->deadline, r->timeout, why, sizeof why);
            if (st != RA_OK) {
                snprintf(err, n, "%s while starting the transfer with rank %d",
                         why, op_peer(r));
                return st;
            }
        }
    }
    ISSUE_CUDA(cudaEventRecord(op->done, nc->stream));
#undef ISSUE_CUDA
    return RA_OK;
}

static ra_status nccl_sendrecv_start(ra_comm *c, ra_req *r) {
    nccl_state *nc = (nccl_state *)c->impl;
    ra_xfer *x = &r->x;
    char pre[128], err[RA_COMM_MSG_LEN - 128], msg[RA_COMM_MSG_LEN];
    ra_comm_prefix(pre, sizeof pre, c->rank, r->op, x->step);
    int staged = x->device_type != RA_DEV_CUDA;
    if (x->dst == c->rank && x->send_nbytes != x->recv_nbytes) {
        snprintf(msg, sizeof msg,
                 "%ssize mismatch: rank %d sends %zu bytes but the receive "
                 "buffer holds %zu bytes", pre, c->rank, x->send_nbytes,
                 x->recv_nbytes);
        return start_fail(c, r, RA_ERR_VALUE, msg);
    }
    if (!staged && x->device_id != nc->device) {
        snprintf(msg, sizeof msg,
                 "%sbuffers are on CUDA device %d but this communicator "
                 "uses device %d", pre, x->device_id, nc->device);
        return start_fail(c, r, RA_ERR_VALUE, msg);
    }
    nccl_op *op = ra_host_calloc(sizeof *op);
    if (op == NULL) {
        snprintf(msg, sizeof msg, "%sout of host memory", pre);
        return start_fail(c, r, RA_ERR_NOMEM, msg);
    }
    op->req = r;
    op->staged = staged;
    int prev = 0;
    ra_status st;
    pthread_mutex_lock(&nc->issue_mu);
    st = ra_cuda_enter_device(nc->device, &prev);
    if (st == RA_OK) {
        st = issue(nc, r, op, err, sizeof err);
        ra_cuda_leave_device(nc->device, prev);
    } else {
        snprintf(err, sizeof err, "%s", ra_last_error());
    }
    pthread_mutex_unlock(&nc->issue_mu);
    if (st != RA_OK) {
        snprintf(msg, sizeof msg, "%s%s", pre, err);
        pthread_mutex_lock(&nc->lock);
        if (op->scratch != NULL)
            (void)ra_cuda_free(nc->device, op->scratch, op->scratch_bytes);
        event_put_locked(nc, op->done);
        pthread_mutex_unlock(&nc->lock);
        ra_host_free(op, sizeof *op);
        return start_fail(c, r, st, msg);
    }
    atomic_fetch_add(&c->messages, 1);
    if (x->dst >= 0 && x->dst != c->rank)
        atomic_fetch_add(&c->bytes_sent, (uint64_t)x->send_nbytes);
    if (x->src >= 0 && x->src != c->rank)
        atomic_fetch_add(&c->bytes_received, (uint64_t)x->recv_nbytes);
    pthread_mutex_lock(&nc->lock);
    if (atomic_load(&c->failed)) {
        /* an abort drained the list while we issued: fail it now */
        pthread_mutex_lock(&c->mu);
        snprintf(msg, sizeof msg, "%s", c->fail_msg);
        pthread_mutex_unlock(&c->mu);
        op_retire_locked(nc, op, RA_ERR_COMM, msg);
    } else {
        r->impl = op;
        op->next = nc->ops;
        nc->ops = op;
        pthread_cond_signal(&nc->cv);
    }
    pthread_mutex_unlock(&nc->lock);
    return RA_OK;
}

/* Device transfer: order the caller's stream after it and call it done
 * (for the host).  Staged transfer: poll its event until `deadline`, then
 * copy the received bytes out. */
static ra_status nccl_wait(ra_comm *c, ra_req *r, double deadline) {
    nccl_state *nc = (nccl_state *)c->impl;
    int spins = 0;
    for (;;) {
        if (atomic_load(&r->state) != RA_REQ_PENDING) return r->status;
        pthread_mutex_lock(&nc->lock);
        nccl_op *op = (nccl_op *)r->impl;
        if (op == NULL) {                      /* retired meanwhile */
            pthread_mutex_unlock(&nc->lock);
            continue;
        }
        if (!op->staged) {
            void *caller = r->x.stream;
            ra_status st = RA_OK;
            int prev = 0;
            if (caller == NULL)
                st = ra_cuda_compute_stream(nc->device, &caller);
            if (st == RA_OK) st = ra_cuda_enter_device(nc->device, &prev);
            if (st == RA_OK) {
                cudaError_t e =
                    cudaStreamWaitEvent((cudaStream_t)caller, op->done, 0);
                if (e != cudaSuccess)
                    st = ra_cuda_status((int)e, "cudaStreamWaitEvent",
                                        __FILE__, __LINE__);
                ra_cuda_leave_device(nc->device, prev);
            }
            pthread_mutex_lock(&c->mu);
            if (st == RA_OK) {
                ra_req_finish_locked(r, RA_OK, NULL);
            } else {
                char pre[128], msg[RA_COMM_MSG_LEN];
                ra_comm_prefix(pre, sizeof pre, c->rank, r->op, r->x.step);
                snprintf(msg, sizeof msg, "%s%s", pre, ra_last_error());
                ra_req_finish_locked(r, st, msg);
            }
            pthread_mutex_unlock(&c->mu);
            pthread_mutex_unlock(&nc->lock);
            return r->status;
        }
        cudaError_t q = cudaEventQuery(op->done);
        if (q == cudaErrorNotReady) {
            pthread_mutex_unlock(&nc->lock);
            if (ra_now() >= deadline) return RA_ERR_TIMEOUT;
            backoff(&spins);
            continue;
        }
        /* done (or broken): unlink, then copy out without the lock */
        for (nccl_op **link = &nc->ops; *link != NULL; link = &(*link)->next)
            if (*link == op) {
                *link = op->next;
                break;
            }
        pthread_mutex_unlock(&nc->lock);
        ra_status st = RA_OK;
        char msg[RA_COMM_MSG_LEN] = "";
        if (q == cudaSuccess && r->x.src >= 0 && r->x.recv_nbytes > 0) {
            int prev = 0;
            st = ra_cuda_enter_device(nc->device, &prev);
            if (st == RA_OK) {
                cudaError_t e = cudaMemcpy(
                    r->x.recv, (char *)op->scratch + r->x.send_nbytes,
                    r->x.recv_nbytes, cudaMemcpyDeviceToHost);
                if (e != cudaSuccess)
                    st = ra_cuda_status((int)e, "cudaMemcpy", __FILE__,
                                        __LINE__);
                ra_cuda_leave_device(nc->device, prev);
            }
        } else if (q != cudaSuccess) {
            (void)cudaGetLastError();
            st = ra_cuda_status((int)q, "cudaEventQuery", __FILE__, __LINE__);
        }
        if (st != RA_OK) {
            char pre[128];
            ra_comm_prefix(pre, sizeof pre, c->rank, r->op, r->x.step);
            snprintf(msg, sizeof msg, "%s%s", pre, ra_last_error());
        }
        pthread_mutex_lock(&nc->lock);
        op_retire_locked(nc, op, st, msg);
        pthread_mutex_unlock(&nc->lock);
        return r->status;
    }
}

/* A host collective failed: fail this communicator too, keep the message. */
static ra_status host_result(ra_comm *c, ra_status st) {
    if (st == RA_OK) return RA_OK;
    char msg[RA_COMM_MSG_LEN];
    snprintf(msg, sizeof msg, "%s", ra_last_error());
    if (st != RA_ERR_VALUE) ra_comm_fail(c, st, msg);
    ra_set_error(st, "%s", msg);
    return st;
}

static ra_status nccl_host_barrier(ra_comm *c, double timeout) {
    RA_CHECK(ra_comm_check_usable(c, "barrier"));
    nccl_state *nc = (nccl_state *)c->impl;
    return host_result(c, ra_comm_barrier(nc->host, timeout));
}

static ra_status nccl_host_allgather(ra_comm *c, const void *in,
                                     size_t nbytes, void **out,
                                     size_t *out_total, size_t *lens,
                                     double timeout) {
    RA_CHECK(ra_comm_check_usable(c, "allgather"));
    nccl_state *nc = (nccl_state *)c->impl;
    return host_result(c, ra_comm_allgather(nc->host, in, nbytes, out,
                                            out_total, lens, timeout));
}

static void nccl_abort(ra_comm *c) {
    nccl_state *nc = (nccl_state *)c->impl;
    char msg[RA_COMM_MSG_LEN];
    int prev = 0;
    int entered = ra_cuda_enter_device(nc->device, &prev) == RA_OK;
    pthread_mutex_lock(&nc->nccl_mu);
    if (nc->nccl != NULL) {
        /* stops NCCL's kernels: streams waiting on them move on */
        (void)api.CommAbort(nc->nccl);
        nc->nccl = NULL;
    }
    pthread_mutex_unlock(&nc->nccl_mu);
    pthread_mutex_lock(&c->mu);
    snprintf(msg, sizeof msg, "%s", c->fail_msg);
    pthread_mutex_unlock(&c->mu);
    fail_all_ops(nc, msg);
    /* the host transport tells the peers at once */
    if (nc->host != NULL) ra_comm_fail(nc->host, RA_ERR_COMM, msg);
    if (entered) ra_cuda_leave_device(nc->device, prev);
}

static void stop_watchdog(nccl_state *nc) {
    if (!nc->watchdog_running) return;
    pthread_mutex_lock(&nc->lock);
    nc->stop = 1;
    pthread_cond_signal(&nc->cv);
    pthread_mutex_unlock(&nc->lock);
    pthread_join(nc->watchdog, NULL);
    nc->watchdog_running = 0;
}

static void nccl_close(ra_comm *c) {
    nccl_state *nc = (nccl_state *)c->impl;
    char pre[128], msg[RA_COMM_MSG_LEN];
    stop_watchdog(nc);
    int prev = 0;
    int entered = ra_cuda_enter_device(nc->device, &prev) == RA_OK;
    pthread_mutex_lock(&nc->issue_mu);
    if (nc->nccl != NULL && !atomic_load(&c->failed)) {
        /* healthy: flush what is in flight, then free NCCL's resources */
        ncclResult_t r;
        pthread_mutex_lock(&nc->nccl_mu);
        r = api.CommFinalize(nc->nccl);
        pthread_mutex_unlock(&nc->nccl_mu);
        char why[256];
        if ((r == ncclSuccess || r == ncclInProgress) &&
            nccl_settle(nc, ra_now() + c->default_timeout, c->default_timeout,
                        why, sizeof why) == RA_OK) {
            pthread_mutex_lock(&nc->nccl_mu);
            (void)api.CommDestroy(nc->nccl);
            nc->nccl = NULL;
            pthread_mutex_unlock(&nc->nccl_mu);
        }
    }
    pthread_mutex_lock(&nc->nccl_mu);
    if (nc->nccl != NULL) {      /* failed, or finalize did not finish */
        (void)api.CommAbort(nc->nccl);
        nc->nccl = NULL;
    }
    pthread_mutex_unlock(&nc->nccl_mu);
    pthread_mutex_unlock(&nc->issue_mu);
    /* what already completed counts as done; the rest failed */
    ra_comm_prefix(pre, sizeof pre, c->rank, "close", -1);
    snprintf(msg, sizeof msg, "%scommunicator closed before the transfer "
             "completed", pre);
    pthread_mutex_lock(&nc->lock);
    nccl_op *op = nc->ops;
    nc->ops = NULL;
    while (op != NULL) {
        nccl_op *next = op->next;
        int ok = !op->staged && cudaEventQuery(op->done) == cudaSuccess;
        (void)cudaGetLastError();
        op_retire_locked(nc, op, ok ? RA_OK : RA_ERR_COMM, msg);
        op = next;
    }
    pthread_mutex_unlock(&nc->lock);
    if (nc->host != NULL) ra_comm_close(nc->host);
    if (entered) ra_cuda_leave_device(nc->device, prev);
}

/* Free everything; safe on a partly built state (constructor failures). */
static void nccl_state_free(nccl_state *nc) {
    if (nc == NULL) return;
    stop_watchdog(nc);
    int prev = 0;
    int entered = ra_cuda_enter_device(nc->device, &prev) == RA_OK;
    if (nc->nccl != NULL) (void)api.CommAbort(nc->nccl);
    for (int i = nc->npool - 1; i >= 0; i--) (void)cudaEventDestroy(nc->pool[i]);
    if (nc->ready != NULL) (void)cudaEventDestroy(nc->ready);
    if (nc->stream != NULL) (void)cudaStreamDestroy(nc->stream);
    if (entered) ra_cuda_leave_device(nc->device, prev);
    if (nc->host != NULL) ra_comm_free(nc->host);
    if (nc->sync_ready) {
        pthread_cond_destroy(&nc->cv);
        pthread_mutex_destroy(&nc->lock);
        pthread_mutex_destroy(&nc->nccl_mu);
        pthread_mutex_destroy(&nc->issue_mu);
    }
    ra_host_free(nc, sizeof *nc);
}

static void nccl_destroy(ra_comm *c) {
    nccl_state_free((nccl_state *)c->impl);
    c->impl = NULL;
}

/* With a host communicator: its barrier/allgather.  Without: comm_core.c's
 * generic ones over staged sendrecv. */
static const ra_comm_vtable nccl_vtable_host = {
    .name = "nccl",
    .device_type = RA_DEV_CUDA,
    .sendrecv_start = nccl_sendrecv_start,
    .wait = nccl_wait,
    .barrier = nccl_host_barrier,
    .allgather = nccl_host_allgather,
    .abort = nccl_abort,
    .close = nccl_close,
    .destroy = nccl_destroy,
};

static const ra_comm_vtable nccl_vtable_plain = {
    .name = "nccl",
    .device_type = RA_DEV_CUDA,
    .sendrecv_start = nccl_sendrecv_start,
    .wait = nccl_wait,
    .barrier = NULL,
    .allgather = NULL,
    .abort = nccl_abort,
    .close = nccl_close,
    .destroy = nccl_destroy,
};

/* ---- construction ------------------------------------------------------- */

static ra_status sync_init(nccl_state *nc) {
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) != 0) goto fail;
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(&nc->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (rc != 0) goto fail;
    if (pthread_mutex_init(&nc->issue_mu, NULL) != 0) goto fail_cv;
    if (pthread_mutex_init(&nc->nccl_mu, NULL) != 0) goto fail_issue;
    if (pthread_mutex_init(&nc->lock, NULL) != 0) goto fail_nccl;
    nc->sync_ready = 1;
    return RA_OK;
fail_nccl:
    pthread_mutex_destroy(&nc->nccl_mu);
fail_issue:
    pthread_mutex_destroy(&nc->issue_mu);
fail_cv:
    pthread_cond_destroy(&nc->cv);
fail:
    ra_set_error(RA_ERR_SYSTEM, "cannot create the nccl communicator's locks");
    return RA_ERR_SYSTEM;
}

/* Rank 0's unique id to every rank over the host communicator. */
static ra_status share_unique_id(ra_comm *host, int rank, const char *library,
                                 double timeout, ncclUniqueId *id) {
    unsigned char mine[RA_NCCL_ID_BYTES];
    size_t n = 0;
    if (rank == 0) {
        RA_CHECK(ra_nccl_unique_id(library, mine));
        n = sizeof mine;
    }
    void *all = NULL;
    size_t total = 0;
    size_t *lens = ra_host_calloc(sizeof(size_t) * (size_t)host->size);
    if (lens == NULL) return RA_ERR_NOMEM;
    ra_status st = ra_comm_allgather(host, mine, n, &all, &total, lens,
                                     timeout);
    if (st == RA_OK && lens[0] != RA_NCCL_ID_BYTES) {
        ra_set_error(RA_ERR_COMM,
                     "rank %d: nccl bootstrap: rank 0 sent %zu bytes, "
                     "expected a %d-byte NCCL unique id", rank, lens[0],
                     RA_NCCL_ID_BYTES);
        st = RA_ERR_COMM;
    }
    if (st == RA_OK) memcpy(id->internal, all, RA_NCCL_ID_BYTES);
    if (all != NULL) ra_host_free(all, total);
    ra_host_free(lens, sizeof(size_t) * (size_t)host->size);
    return st;
}

ra_status ra_nccl_comm_create(const ra_nccl_options *o, ra_comm **out) {
    *out = NULL;
    double timeout = o->timeout > 0 ? o->timeout : ra_comm_env_timeout();
    double deadline = ra_now() + timeout;
    ra_status st;
    int prev = 0;
    ra_comm *c = NULL;
    nccl_state *nc = NULL;
    ncclUniqueId id;
    char d[256];
    /* a usable device first (the clearest error), then the library */
    RA_CHECK(ra_cuda_enter_device(o->device, &prev));
    RA_CHECKGOTO(nccl_load(o->library), st, leave);
    nc = ra_host_calloc(sizeof *nc);
    c = ra_host_calloc(sizeof *c);
    if (nc == NULL || c == NULL) {
        st = RA_ERR_NOMEM;
        goto fail;
    }
    nc->device = o->device;
    RA_CHECKGOTO(sync_init(nc), st, fail);
    if (o->unique_id != NULL) {
        memcpy(id.internal, o->unique_id, RA_NCCL_ID_BYTES);
    } else if (o->size == 1) {
        ncclResult_t r = api.GetUniqueId(&id);
        if (r != ncclSuccess) {
            nccl_describe(r, NULL, d, sizeof d);
            ra_set_error(RA_ERR_NCCL, "ncclGetUniqueId failed: %s", d);
            st = RA_ERR_NCCL;
            goto fail;
        }
    } else {
        RA_CHECKGOTO(ra_host_comm_create(o->rank, o->size, o->master_addr,
                                         o->master_port, o->token, timeout,
                                         &nc->host), st, fail);
        RA_CHECKGOTO(share_unique_id(nc->host, o->rank, o->library,
                                     deadline - ra_now(), &id), st, fail);
    }
    RA_CHECKGOTO(ra_comm_init_base(c, nc->host ? &nccl_vtable_host
                                               : &nccl_vtable_plain,
                                   o->rank, o->size, timeout), st, fail);
    c->device_id = o->device;
    c->impl = nc;
    nc->c = c;
    {
        cudaError_t e = cudaStreamCreateWithFlags(&nc->stream,
                                                  cudaStreamNonBlocking);
        if (e == cudaSuccess)
            e = cudaEventCreateWithFlags(&nc->ready, cudaEventDisableTiming);
        if (e != cudaSuccess) {
            st = ra_cuda_status((int)e, "creating the nccl stream", __FILE__,
                                __LINE__);
            goto fail_base;
        }
    }
    {
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        ncclResult_t r = api.CommInitRankConfig(&nc->nccl, o->size, id,
                                                o->rank, &config);
        if (r != ncclSuccess && r != ncclInProgress) {
            nccl_describe(r, nc->nccl, d, sizeof d);
            ra_set_error(RA_ERR_NCCL, "rank %d: nccl init (world size %d, "
                         "device %d): %s", o->rank, o->size, o->device, d);
            st = RA_ERR_NCCL;
            goto fail_base;
        }
        char why[256];
        st = nccl_settle(nc, deadline, timeout, why, sizeof why);
        if (st != RA_OK) {
            ra_set_error(st, "rank %d: nccl init (world size %d, device %d): "
                         "%s%s", o->rank, o->size, o->device, why,
                         st == RA_ERR_TIMEOUT
                             ? " waiting for the other ranks to join"
                             : "");
            goto fail_base;   /* nccl_state_free aborts the handle */
        }
    }
    if (pthread_create(&nc->watchdog, NULL, watchdog_main, nc) != 0) {
        ra_set_error(RA_ERR_SYSTEM, "cannot start the nccl watchdog thread");
        st = RA_ERR_SYSTEM;
        goto fail_base;
    }
    nc->watchdog_running = 1;
    ra_cuda_leave_device(o->device, prev);
    *out = c;
    return RA_OK;
fail_base:
    ra_comm_destroy_base(c);
fail:
    {
        /* keep the message: teardown may call CUDA */
        char msg[RA_COMM_MSG_LEN];
        snprintf(msg, sizeof msg, "%s", ra_last_error());
        nccl_state_free(nc);
        if (c != NULL) ra_host_free(c, sizeof *c);
        ra_set_error(st, "%s", msg);
    }
leave:
    ra_cuda_leave_device(o->device, prev);
    return st;
}

#else /* !RA_WITH_CUDA */

static ra_status nccl_unsupported(void) {
    ra_set_error(RA_ERR_UNSUPPORTED, "%s", RA_NCCL_NO_CUDA_MSG);
    return RA_ERR_UNSUPPORTED;
}

ra_status ra_nccl_version(const char *library, int *major, int *minor,
                          int *patch) {
    (void)library;
    *major = *minor = *patch = 0;
    return nccl_unsupported();
}

ra_status ra_nccl_unique_id(const char *library,
                            unsigned char out[RA_NCCL_ID_BYTES]) {
    (void)library;
    (void)out;
    return nccl_unsupported();
}

ra_status ra_nccl_comm_create(const ra_nccl_options *o, ra_comm **out) {
    (void)o;
    *out = NULL;
    return nccl_unsupported();
}

#endif /* RA_WITH_CUDA */
