/*
 * comm_nccl.c -- the "nccl" backend: one NCCL communicator per rank moving
 * CUDA device memory on its own stream.  This file makes, watches and
 * closes it; nccl_loader.c opens the library, comm_nccl_xfer.c moves the
 * bytes of one transfer, comm_nccl_internal.h holds the shared state and
 * its lock order.
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
 * Failure.  A watchdog thread per communicator polls the completion events
 * and ncclCommGetAsyncError.  A transfer not done by its deadline, or an
 * asynchronous NCCL error, aborts the NCCL communicator (which stops its
 * kernels, so streams waiting on it move on) and fails ours: every later
 * call raises CommError naming rank, peer, op and step.
 */
#include "comm/comm_nccl_internal.h"
#include "core/cuda_rt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef RA_WITH_NCCL

#include <math.h>
#include <time.h>

#define WATCH_BUSY_S 0.001       /* watchdog period with transfers in flight */
#define WATCH_IDLE_S 0.2         /* and without */

static void timespec_in(double seconds, struct timespec *ts) {
    double when = ra_now() + seconds;   /* CLOCK_MONOTONIC, like nc->cv */
    double whole = floor(when);
    ts->tv_sec = (time_t)whole;
    ts->tv_nsec = (long)((when - whole) * 1e9);
    if (ts->tv_nsec >= 1000000000L) ts->tv_nsec = 999999999L;
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
        char o_peer[32] = "", peer[32];
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
                ra_nccl_op_retire_locked(nc, op, RA_OK, NULL);
                continue;
            }
            ra_comm_prefix(pre, sizeof pre, c->rank, op->req->op,
                           op->req->x.step);
            if (q != cudaErrorNotReady) {
                (void)cudaGetLastError();
                fst = RA_ERR_CUDA;
                ra_snprintf(msg, sizeof msg,
                         "%sCUDA error while the transfer with %s ran: %s",
                         pre, op_peer_text(op->req, peer, sizeof peer),
                         cudaGetErrorString(q));
                break;
            }
            if (ra_now() >= op->req->deadline) {
                fst = RA_ERR_TIMEOUT;
                ra_snprintf(msg, sizeof msg,
                         "%stimed out after %.1f s waiting for %s (the "
                         "NCCL transfer did not complete)", pre,
                         op->req->timeout,
                         op_peer_text(op->req, peer, sizeof peer));
                break;
            }
            oldest = op->req;
            o_step = op->req->x.step;
            o_op = op->req->op;
            op_peer_text(op->req, o_peer, sizeof o_peer);
            link = &op->next;
        }
        int busy = nc->ops != NULL;
        pthread_mutex_unlock(&nc->lock);
        if (fst == RA_OK && busy) {
            ncclResult_t state = ncclSuccess;
            char d[256] = "";
            pthread_mutex_lock(&nc->nccl_mu);
            if (nc->nccl != NULL &&
                ra_nccl_lib.CommGetAsyncError(nc->nccl, &state) ==
                    ncclSuccess &&
                state != ncclSuccess && state != ncclInProgress)
                ra_nccl_describe(state, nc->nccl, d, sizeof d);
            else
                state = ncclSuccess;
            pthread_mutex_unlock(&nc->nccl_mu);
            if (state != ncclSuccess) {
                fst = RA_ERR_NCCL;
                ra_comm_prefix(pre, sizeof pre, c->rank, o_op, o_step);
                if (oldest != NULL)
                    ra_snprintf(msg, sizeof msg,
                             "%sNCCL error in the transfer with %s: %s",
                             pre, o_peer, d);
                else
                    ra_snprintf(msg, sizeof msg, "%sNCCL error: %s", pre, d);
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

/* A host collective failed: fail this communicator too, keep the message. */
static ra_status host_result(ra_comm *c, ra_status st) {
    if (st == RA_OK) return RA_OK;
    char msg[RA_COMM_MSG_LEN];
    ra_snprintf(msg, sizeof msg, "%s", ra_last_error());
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
        (void)ra_nccl_lib.CommAbort(nc->nccl);
        nc->nccl = NULL;
    }
    pthread_mutex_unlock(&nc->nccl_mu);
    pthread_mutex_lock(&c->mu);
    ra_snprintf(msg, sizeof msg, "%s", c->fail_msg);
    pthread_mutex_unlock(&c->mu);
    ra_nccl_fail_all_ops(nc, msg);
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
        r = ra_nccl_lib.CommFinalize(nc->nccl);
        pthread_mutex_unlock(&nc->nccl_mu);
        char why[256];
        if ((r == ncclSuccess || r == ncclInProgress) &&
            ra_nccl_settle(nc, ra_now() + c->default_timeout,
                           c->default_timeout, why, sizeof why) == RA_OK) {
            pthread_mutex_lock(&nc->nccl_mu);
            (void)ra_nccl_lib.CommDestroy(nc->nccl);
            nc->nccl = NULL;
            pthread_mutex_unlock(&nc->nccl_mu);
        }
    }
    pthread_mutex_lock(&nc->nccl_mu);
    if (nc->nccl != NULL) {      /* failed, or finalize did not finish */
        (void)ra_nccl_lib.CommAbort(nc->nccl);
        nc->nccl = NULL;
    }
    pthread_mutex_unlock(&nc->nccl_mu);
    pthread_mutex_unlock(&nc->issue_mu);
    /* what already completed counts as done; the rest failed */
    ra_comm_prefix(pre, sizeof pre, c->rank, "close", -1);
    ra_snprintf(msg, sizeof msg, "%scommunicator closed before the transfer "
                "completed", pre);
    pthread_mutex_lock(&nc->lock);
    nccl_op *op = nc->ops;
    nc->ops = NULL;
    while (op != NULL) {
        nccl_op *next = op->next;
        int ok = !op->staged && cudaEventQuery(op->done) == cudaSuccess;
        (void)cudaGetLastError();
        ra_nccl_op_retire_locked(nc, op, ok ? RA_OK : RA_ERR_COMM, msg);
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
    if (nc->nccl != NULL) (void)ra_nccl_lib.CommAbort(nc->nccl);
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
    .sendrecv_start = ra_nccl_sendrecv_start,
    .wait = ra_nccl_wait,
    .barrier = nccl_host_barrier,
    .allgather = nccl_host_allgather,
    .alltoall = ra_nccl_alltoall,
    .abort = nccl_abort,
    .close = nccl_close,
    .destroy = nccl_destroy,
};

static const ra_comm_vtable nccl_vtable_plain = {
    .name = "nccl",
    .device_type = RA_DEV_CUDA,
    .sendrecv_start = ra_nccl_sendrecv_start,
    .wait = ra_nccl_wait,
    .barrier = NULL,
    .allgather = NULL,
    .alltoall = ra_nccl_alltoall,
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
    RA_CHECKGOTO(ra_nccl_load(o->library), st, leave);
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
        ncclResult_t r = ra_nccl_lib.GetUniqueId(&id);
        if (r != ncclSuccess) {
            ra_nccl_describe(r, NULL, d, sizeof d);
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
        ncclResult_t r = ra_nccl_lib.CommInitRankConfig(&nc->nccl, o->size, id,
                                                o->rank, &config);
        if (r != ncclSuccess && r != ncclInProgress) {
            ra_nccl_describe(r, nc->nccl, d, sizeof d);
            ra_set_error(RA_ERR_NCCL, "rank %d: nccl init (world size %d, "
                         "device %d): %s", o->rank, o->size, o->device, d);
            st = RA_ERR_NCCL;
            goto fail_base;
        }
        char why[256];
        st = ra_nccl_settle(nc, deadline, timeout, why, sizeof why);
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
        ra_snprintf(msg, sizeof msg, "%s", ra_last_error());
        nccl_state_free(nc);
        if (c != NULL) ra_host_free(c, sizeof *c);
        ra_set_error(st, "%s", msg);
    }
leave:
    ra_cuda_leave_device(o->device, prev);
    return st;
}

#else /* !RA_WITH_NCCL */

ra_status ra_nccl_comm_create(const ra_nccl_options *o, ra_comm **out) {
    (void)o;
    *out = NULL;
    return ra_nccl_unsupported();
}

#endif /* RA_WITH_NCCL */
