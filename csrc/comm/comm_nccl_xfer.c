/*
 * comm_nccl_xfer.c -- one "nccl" transfer from issue to completion.
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
 * An all-to-all is one op too: the block to self is a device copy on the
 * comm stream, and every other block one ncclSend/ncclRecv of a single
 * group (blocks of 0 bytes are left out on both sides, which agree on the
 * sizes), with one completion event.  In place (send blocks that overlap
 * receive blocks), those send blocks are first copied into the op's
 * scratch on the comm stream, which NCCL then sends from.
 *
 * Staged transfers carry host memory (comm_core.c's generic barrier and
 * allgather) through device scratch; the waiting caller polls their event
 * and copies the received bytes out.  Device transfers are retired by the
 * watchdog (comm_nccl.c) once their event completed.
 *
 * Memory and streams (cuda_rt.c's caching pool relies on this): the comm
 * stream touches no buffer before it waited for the compute stream (device
 * transfers wait for the caller's stream, staged ones for the compute
 * stream, whose scratch block may have been in use there until its free),
 * and every op, however it ends, hands its completion back to the compute
 * stream before its buffers or scratch can be freed and reused: wait()
 * does so for the caller's stream, and retiring an op (success, failure,
 * abort) makes the compute stream wait for it too.  After an abort NCCL's
 * kernels exit, so that wait ends.
 */
#include "comm/comm_nccl_internal.h"
#include "core/cuda_rt.h"

#include <stdio.h>
#include <string.h>

#ifdef RA_WITH_NCCL

#include <errno.h>
#include <sched.h>
#include <time.h>

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

/* Take nc->nccl_mu with the NCCL handle alive: 0, or -1 with the lock
 * released and `err` saying the communicator was aborted. */
static int lock_live(nccl_state *nc, char *err, size_t n) {
    pthread_mutex_lock(&nc->nccl_mu);
    if (nc->nccl != NULL) return 0;
    pthread_mutex_unlock(&nc->nccl_mu);
    ra_snprintf(err, n, "the NCCL communicator was aborted");
    return -1;
}

ra_status ra_nccl_settle(nccl_state *nc, double deadline, double timeout,
                         char *err, size_t n) {
    int spins = 0;
    for (;;) {
        ncclResult_t state = ncclInProgress, r;
        char d[256] = "";
        if (lock_live(nc, err, n) < 0) return RA_ERR_COMM;
        r = ra_nccl_lib.CommGetAsyncError(nc->nccl, &state);
        if (r != ncclSuccess)
            ra_nccl_describe(r, nc->nccl, d, sizeof d);
        else if (state != ncclSuccess && state != ncclInProgress)
            ra_nccl_describe(state, nc->nccl, d, sizeof d);
        pthread_mutex_unlock(&nc->nccl_mu);
        if (r != ncclSuccess) {
            ra_snprintf(err, n, "ncclCommGetAsyncError failed: %s", d);
            return RA_ERR_NCCL;
        }
        if (state == ncclSuccess) return RA_OK;
        if (state != ncclInProgress) {
            ra_snprintf(err, n, "NCCL error: %s", d);
            return RA_ERR_NCCL;
        }
        if (ra_now() >= deadline) {
            ra_snprintf(err, n, "timed out after %.1f s", timeout);
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

/* Make the compute stream wait for `op`'s completion event (recorded on
 * the comm stream), so that memory the op used is not reused before the
 * comm stream is done with it.  Errors are left to the next CUDA call. */
static void compute_waits_for(nccl_state *nc, cudaEvent_t done) {
    void *compute = NULL;
    if (done == NULL || ra_cuda_compute_stream(nc->device, &compute) != RA_OK)
        return;
    if (cudaStreamWaitEvent((cudaStream_t)compute, done, 0) != cudaSuccess)
        (void)cudaGetLastError();
}

void ra_nccl_op_retire_locked(nccl_state *nc, nccl_op *op, ra_status st,
                              const char *msg) {
    ra_comm *c = nc->c;
    compute_waits_for(nc, op->done);
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

void ra_nccl_fail_all_ops(nccl_state *nc, const char *msg) {
    pthread_mutex_lock(&nc->lock);
    nccl_op *op = nc->ops;
    nc->ops = NULL;
    while (op != NULL) {
        nccl_op *next = op->next;
        ra_nccl_op_retire_locked(nc, op, RA_ERR_COMM, msg);
        op = next;
    }
    pthread_mutex_unlock(&nc->lock);
}

/* ---- issue and wait ----------------------------------------------------- */

/* Fail `r` at start: finish it, drop the backend's reference. */
static ra_status start_fail(ra_comm *c, ra_req *r, ra_status st,
                            const char *msg) {
    pthread_mutex_lock(&c->mu);
    ra_req_finish_locked(r, st, msg);
    pthread_mutex_unlock(&c->mu);
    ra_req_release(r);
    return st;
}

/* The NCCL calls of an all-to-all, between GroupStart and GroupEnd
 * (caller holds nccl_mu with the handle alive). */
static ncclResult_t group_alltoall(nccl_state *nc, const ra_a2a *a) {
    ra_comm *c = nc->c;
    ncclResult_t r = ncclSuccess;
    for (int i = 0; i < c->size && (r == ncclSuccess ||
                                    r == ncclInProgress); i++) {
        if (i == c->rank) continue;
        if (a->send_nbytes[i] > 0)
            r = ra_nccl_lib.Send(a->send[i], a->send_nbytes[i], ncclUint8, i,
                                 nc->nccl, nc->stream);
        if ((r == ncclSuccess || r == ncclInProgress) &&
            a->recv_nbytes[i] > 0)
            r = ra_nccl_lib.Recv(a->recv[i], a->recv_nbytes[i], ncclUint8, i,
                                 nc->nccl, nc->stream);
    }
    return r;
}

/* The send and receive of a sendrecv (caller holds nccl_mu). */
static ncclResult_t group_sendrecv(nccl_state *nc, const ra_xfer *x,
                                   const void *send, void *recv) {
    ncclResult_t r = ncclSuccess;
    if (x->dst >= 0)
        r = ra_nccl_lib.Send(send, x->send_nbytes, ncclUint8, x->dst,
                             nc->nccl, nc->stream);
    if ((r == ncclSuccess || r == ncclInProgress) && x->src >= 0)
        r = ra_nccl_lib.Recv(recv, x->recv_nbytes, ncclUint8, x->src,
                             nc->nccl, nc->stream);
    return r;
}

/* One NCCL group on the comm stream: the sendrecv of `r` (send/recv: its
 * device pointers) or the all-to-all `a2a`.  On a non-blocking
 * communicator the kernels may not be on the stream when GroupEnd
 * returns: the group settles first, so the completion event comes after
 * them. */
static ra_status issue_group(nccl_state *nc, ra_req *r, const void *send,
                             void *recv, const ra_a2a *a2a, char *err,
                             size_t n) {
    char peer[32], d[256] = "";
    op_peer_text(r, peer, sizeof peer);
    if (lock_live(nc, err, n) < 0) return RA_ERR_COMM;
    ncclResult_t r0 = ra_nccl_lib.GroupStart(), r1 = ncclSuccess, r2;
    if (r0 == ncclSuccess)
        r1 = a2a != NULL ? group_alltoall(nc, a2a)
                         : group_sendrecv(nc, &r->x, send, recv);
    /* always close a group that was opened */
    r2 = r0 == ncclSuccess ? ra_nccl_lib.GroupEnd() : r0;
    ncclResult_t bad = r0 != ncclSuccess ? r0
                       : r1 != ncclSuccess && r1 != ncclInProgress ? r1
                       : r2;
    if (bad != ncclSuccess && bad != ncclInProgress)
        ra_nccl_describe(bad, nc->nccl, d, sizeof d);
    pthread_mutex_unlock(&nc->nccl_mu);
    if (bad != ncclSuccess && bad != ncclInProgress) {
        ra_snprintf(err, n, "NCCL error with %s: %s", peer, d);
        return RA_ERR_NCCL;
    }
    if (bad == ncclInProgress) {
        char why[256];
        ra_status st = ra_nccl_settle(nc, r->deadline, r->timeout, why,
                                      sizeof why);
        if (st != RA_OK) {
            ra_snprintf(err, n, "%s while starting the transfer with %s", why,
                     peer);
            return st;
        }
    }
    return RA_OK;
}

/* The all-to-all a2a on the comm stream (after it waited for the caller's
 * stream): send blocks that overlap receive blocks (in place) copied aside
 * into op's scratch first, then the block to itself, then one group. */
static ra_status issue_alltoall(nccl_state *nc, ra_req *r, nccl_op *op,
                                const ra_a2a *a2a, char *err, size_t n) {
    ra_comm *c = nc->c;
    const int me = c->rank, p = c->size;
    unsigned char *staged = ra_host_alloc((size_t)p);
    const void **send = ra_host_alloc(sizeof(void *) * (size_t)p);
    ra_status st = RA_OK;
    cudaError_t e = cudaSuccess;
    size_t total = 0, off = 0;
    if (staged == NULL || send == NULL) {
        st = RA_ERR_NOMEM;
        goto done;
    }
    RA_CHECKGOTO(ra_a2a_staged(me, p, a2a, staged, &total), st, done);
    if (total > 0) {
        RA_CHECKGOTO(ra_cuda_malloc(nc->device, total, &op->scratch), st,
                     done);
        op->scratch_bytes = total;
        /* the scratch block may have served the compute stream until its
         * free: the comm stream waits for that stream too */
        void *compute = NULL;
        RA_CHECKGOTO(ra_cuda_compute_stream(nc->device, &compute), st, done);
        if (compute != r->x.stream &&
            ((e = cudaEventRecord(nc->ready, (cudaStream_t)compute)) !=
                 cudaSuccess ||
             (e = cudaStreamWaitEvent(nc->stream, nc->ready, 0)) !=
                 cudaSuccess)) {
            st = ra_cuda_status((int)e, "cudaStreamWaitEvent", __FILE__,
                                __LINE__);
            goto done;
        }
    }
    ra_a2a b = *a2a;
    for (int i = 0; i < p; i++) {
        send[i] = a2a->send[i];
        if (!staged[i]) continue;
        send[i] = (unsigned char *)op->scratch + off;
        e = cudaMemcpyAsync((void *)send[i], a2a->send[i],
                            a2a->send_nbytes[i], cudaMemcpyDeviceToDevice,
                            nc->stream);
        if (e != cudaSuccess) break;
        off += a2a->send_nbytes[i];
    }
    b.send = send;
    if (e == cudaSuccess && b.send_nbytes[me] > 0 && b.send[me] != b.recv[me])
        e = cudaMemcpyAsync(b.recv[me], b.send[me], b.send_nbytes[me],
                            cudaMemcpyDeviceToDevice, nc->stream);
    if (e != cudaSuccess) {
        st = ra_cuda_status((int)e, "cudaMemcpyAsync", __FILE__, __LINE__);
        goto done;
    }
    st = issue_group(nc, r, NULL, NULL, &b, err, n);
    if (st != RA_OK) goto out;      /* err says why */
done:
    if (st != RA_OK) ra_snprintf(err, n, "%s", ra_last_error());
out:
    ra_host_free(send, sizeof(void *) * (size_t)p);
    ra_host_free(staged, (size_t)p);
    return st;
}

/* Enqueue the transfer of `r` (or the all-to-all `a2a`) on the comm
 * stream; `op` gets its event.  Runs with issue_mu held and the device
 * entered. */
static ra_status issue(nccl_state *nc, ra_req *r, nccl_op *op,
                       const ra_a2a *a2a, char *err, size_t n) {
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
            ra_snprintf(err, n, "%s", ra_last_error());                       \
            return st;                                                        \
        }                                                                     \
    } while (0)
    st = event_get(nc, &op->done);
    if (st != RA_OK) {
        ra_snprintf(err, n, "%s", ra_last_error());
        return st;
    }
    /* the comm stream first waits for the work that came before: on the
     * caller's stream (device transfers: the kernels that wrote the send
     * block or still read the receive block), or on the compute stream
     * (staged: the scratch block may have served it until its free) */
    void *before = op->staged ? NULL : x->stream;
    if (before == NULL) {
        st = ra_cuda_compute_stream(nc->device, &before);
        if (st != RA_OK) {
            ra_snprintf(err, n, "%s", ra_last_error());
            return st;
        }
    }
    ISSUE_CUDA(cudaEventRecord(nc->ready, (cudaStream_t)before));
    ISSUE_CUDA(cudaStreamWaitEvent(nc->stream, nc->ready, 0));
    if (op->staged) {
        /* small host values (generic barrier/allgather): copy in, and out
         * again when the caller waits */
        op->scratch_bytes = x->send_nbytes + x->recv_nbytes;
        if (op->scratch_bytes == 0) op->scratch_bytes = 1;
        st = ra_cuda_malloc(nc->device, op->scratch_bytes, &op->scratch);
        if (st != RA_OK) {
            op->scratch = NULL;
            ra_snprintf(err, n, "%s", ra_last_error());
            return st;
        }
        send = op->scratch;
        recv = (char *)op->scratch + x->send_nbytes;
        if (x->dst >= 0 && x->send_nbytes > 0)
            ISSUE_CUDA(cudaMemcpyAsync(op->scratch, x->send, x->send_nbytes,
                                       cudaMemcpyHostToDevice, nc->stream));
    }
    if (a2a != NULL) {
        RA_CHECK(issue_alltoall(nc, r, op, a2a, err, n));
    } else if (x->dst == c->rank) {
        if (x->send_nbytes > 0 && send != recv)
            ISSUE_CUDA(cudaMemcpyAsync(recv, send, x->send_nbytes,
                                       cudaMemcpyDeviceToDevice, nc->stream));
    } else {
        RA_CHECK(issue_group(nc, r, send, recv, NULL, err, n));
    }
    ISSUE_CUDA(cudaEventRecord(op->done, nc->stream));
#undef ISSUE_CUDA
    return RA_OK;
}

/* Issue `r` (a sendrecv, or the all-to-all `a2a`) and list it for the
 * watchdog; on failure `r` is finished with the message.  Takes the
 * backend's reference of r. */
static ra_status start_op(ra_comm *c, ra_req *r, const ra_a2a *a2a) {
    nccl_state *nc = (nccl_state *)c->impl;
    ra_xfer *x = &r->x;
    char pre[128], err[RA_COMM_MSG_LEN - 128], msg[RA_COMM_MSG_LEN];
    ra_comm_prefix(pre, sizeof pre, c->rank, r->op, x->step);
    int staged = x->device_type != RA_DEV_CUDA;
    if (x->dst == c->rank && x->send_nbytes != x->recv_nbytes) {
        ra_snprintf(msg, sizeof msg,
                    "%ssize mismatch: rank %d sends %zu bytes but the receive "
                    "buffer holds %zu bytes", pre, c->rank, x->send_nbytes,
                    x->recv_nbytes);
        return start_fail(c, r, RA_ERR_VALUE, msg);
    }
    if (!staged && x->device_id != nc->device) {
        ra_snprintf(msg, sizeof msg,
                    "%sbuffers are on CUDA device %d but this communicator "
                    "uses device %d", pre, x->device_id, nc->device);
        return start_fail(c, r, RA_ERR_VALUE, msg);
    }
    nccl_op *op = ra_host_calloc(sizeof *op);
    if (op == NULL) {
        ra_snprintf(msg, sizeof msg, "%sout of host memory", pre);
        return start_fail(c, r, RA_ERR_NOMEM, msg);
    }
    op->req = r;
    op->staged = staged;
    int prev = 0;
    ra_status st;
    pthread_mutex_lock(&nc->issue_mu);
    st = ra_cuda_enter_device(nc->device, &prev);
    if (st == RA_OK) {
        st = issue(nc, r, op, a2a, err, sizeof err);
        ra_cuda_leave_device(nc->device, prev);
    } else {
        ra_snprintf(err, sizeof err, "%s", ra_last_error());
    }
    pthread_mutex_unlock(&nc->issue_mu);
    if (st != RA_OK) {
        ra_snprintf(msg, sizeof msg, "%s%s", pre, err);
        /* part of the op may be queued on the comm stream: mark its end and
         * let the compute stream wait for it before the scratch is reused */
        if (op->done != NULL &&
            cudaEventRecord(op->done, nc->stream) == cudaSuccess)
            compute_waits_for(nc, op->done);
        (void)cudaGetLastError();
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
    for (int i = 0; a2a != NULL && i < c->size; i++) {
        if (i == c->rank) continue;
        atomic_fetch_add(&c->bytes_sent, (uint64_t)a2a->send_nbytes[i]);
        atomic_fetch_add(&c->bytes_received, (uint64_t)a2a->recv_nbytes[i]);
    }
    pthread_mutex_lock(&nc->lock);
    if (atomic_load(&c->failed)) {
        /* an abort drained the list while we issued: fail it now */
        pthread_mutex_lock(&c->mu);
        ra_snprintf(msg, sizeof msg, "%s", c->fail_msg);
        pthread_mutex_unlock(&c->mu);
        ra_nccl_op_retire_locked(nc, op, RA_ERR_COMM, msg);
    } else {
        r->impl = op;
        op->next = nc->ops;
        nc->ops = op;
        pthread_cond_signal(&nc->cv);
    }
    pthread_mutex_unlock(&nc->lock);
    return RA_OK;
}

ra_status ra_nccl_sendrecv_start(ra_comm *c, ra_req *r) {
    return start_op(c, r, NULL);
}

ra_status ra_nccl_alltoall(ra_comm *c, const ra_a2a *a, double timeout) {
    char pre[128];
    ra_comm_prefix(pre, sizeof pre, c->rank, "alltoall", -1);
    if (a->device_type != RA_DEV_CUDA) {
        ra_set_error(RA_ERR_VALUE, "%sthe nccl backend moves CUDA device "
                     "memory, got host memory", pre);
        return RA_ERR_VALUE;
    }
    {
        /* overlapping receive blocks: a ValueError before anything moves
         * (issue_alltoall sets in-place send blocks aside) */
        size_t total = 0;
        unsigned char *staged = ra_host_alloc((size_t)c->size);
        if (staged == NULL) return RA_ERR_NOMEM;
        ra_status st = ra_a2a_staged(c->rank, c->size, a, staged, &total);
        ra_host_free(staged, (size_t)c->size);
        RA_CHECK(st);
    }
    ra_xfer x;
    memset(&x, 0, sizeof x);
    x.kind = RA_XFER_ALLTOALL;
    x.step = -1;
    x.dst = x.src = -1;            /* every peer: see op_peer */
    x.device_type = RA_DEV_CUDA;
    x.device_id = a->device_id;
    x.stream = a->stream;
    ra_req *r = ra_req_new(c, &x, "alltoall", timeout);
    if (r == NULL) return RA_ERR_NOMEM;
    ra_status st = start_op(c, r, a);     /* takes the backend reference */
    if (st == RA_OK) st = ra_nccl_wait(c, r, r->deadline);
    if (atomic_load(&r->state) == RA_REQ_FAILED || st != RA_OK) {
        if (st == RA_OK) st = r->status != RA_OK ? r->status : RA_ERR_COMM;
        char msg[RA_COMM_MSG_LEN];
        ra_snprintf(msg, sizeof msg, "%s", r->msg[0] ? r->msg : "failed");
        if (st != RA_ERR_VALUE) ra_comm_fail(c, st, msg);
        ra_set_error(st, "%s", msg);
    }
    ra_req_release(r);
    return st;
}

/* Device transfer: order the caller's stream after it and call it done
 * (for the host).  Staged transfer: poll its event until `deadline`, then
 * copy the received bytes out. */
ra_status ra_nccl_wait(ra_comm *c, ra_req *r, double deadline) {
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
                ra_snprintf(msg, sizeof msg, "%s%s", pre, ra_last_error());
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
            ra_snprintf(msg, sizeof msg, "%s%s", pre, ra_last_error());
        }
        pthread_mutex_lock(&nc->lock);
        ra_nccl_op_retire_locked(nc, op, st, msg);
        pthread_mutex_unlock(&nc->lock);
        return r->status;
    }
}

#endif /* RA_WITH_NCCL: without it the backend is comm_nccl.c's stubs */
