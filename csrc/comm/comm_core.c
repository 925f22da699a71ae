/*
 * comm_core.c -- what every communicator backend shares: the failure state
 * ("after an error the communicator refuses all work"), requests and their
 * deadlines, local copies to self, barrier/allgather/alltoall built from
 * sendrecv, and the hand-over of a split's transfers to the transport it
 * shares (ra_comm.transport, comm_split.c).  Python-free; runs without the
 * GIL.
 */
#include "comm/comm.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

double ra_comm_env_timeout(void) {
    const char *env = getenv("RINGATTN_TIMEOUT");
    if (env != NULL && *env != '\0') {
        char *end = NULL;
        double t = strtod(env, &end);
        if (end != env && t > 0 && isfinite(t)) return t;
    }
    return RA_COMM_DEFAULT_TIMEOUT;
}

ra_status ra_comm_init_base(ra_comm *c, const ra_comm_vtable *vt, int rank,
                            int size, double timeout) {
    memset(c, 0, sizeof *c);
    c->vt = vt;
    c->rank = rank;
    c->size = size;
    c->default_timeout = timeout > 0 ? timeout : ra_comm_env_timeout();
    atomic_store(&c->next_context, 1);    /* 0: the transport's own */
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) != 0) {
        ra_set_error(RA_ERR_SYSTEM, "pthread_condattr_init failed");
        return RA_ERR_SYSTEM;
    }
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(&c->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (rc != 0 || pthread_mutex_init(&c->mu, NULL) != 0) {
        ra_set_error(RA_ERR_SYSTEM, "cannot create communicator lock");
        return RA_ERR_SYSTEM;
    }
    return RA_OK;
}

void ra_comm_destroy_base(ra_comm *c) {
    ra_comm_claims_free(c);
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
}

void ra_comm_departed_msg(const char *pre, int peer, int closed,
                          const char *why, char *msg, size_t n) {
    if (closed)
        ra_snprintf(msg, n, "%speer rank %d closed this communicator", pre,
                    peer);
    else
        ra_snprintf(msg, n, "%speer rank %d failed: %s", pre, peer, why);
}

void ra_comm_prefix(char *buf, size_t n, int rank, const char *op,
                    int64_t step) {
    if (step >= 0)
        ra_snprintf(buf, n, "rank %d: %s step %lld: ", rank, op,
                    (long long)step);
    else
        ra_snprintf(buf, n, "rank %d: %s: ", rank, op);
}

void ra_comm_mark_failed(ra_comm *c, const char *msg) {
    pthread_mutex_lock(&c->mu);
    if (!atomic_load(&c->failed)) {
        ra_snprintf(c->fail_msg, sizeof c->fail_msg, "%s", msg);
        atomic_store(&c->failed, 1);
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

ra_status ra_comm_fail(ra_comm *c, ra_status st, const char *msg) {
    ra_comm_mark_failed(c, msg);
    if (c->vt->abort != NULL && !atomic_load(&c->closed)) c->vt->abort(c);
    return st;
}

ra_status ra_comm_check_usable(ra_comm *c, const char *op) {
    /* a split is usable while the transport it runs on is */
    if (c->transport != NULL) RA_CHECK(ra_comm_check_usable(c->transport, op));
    if (atomic_load(&c->closed)) {
        ra_set_error(RA_ERR_COMM, "rank %d: %s: communicator is closed",
                     c->rank, op);
        return RA_ERR_COMM;
    }
    if (atomic_load(&c->failed)) {
        pthread_mutex_lock(&c->mu);
        ra_set_error(RA_ERR_COMM,
                     "rank %d: %s: communicator is in a failed state: %s",
                     c->rank, op, c->fail_msg);
        pthread_mutex_unlock(&c->mu);
        return RA_ERR_COMM;
    }
    return RA_OK;
}

int ra_comm_is_failed(ra_comm *c) {
    return atomic_load(&c->failed) ||
           (c->transport != NULL && atomic_load(&c->transport->failed));
}

void ra_comm_context_taken(ra_comm *t, uint32_t context) {
    /* only ever forward, also when splits open at the same time */
    uint32_t next = atomic_load(&t->next_context);
    while (next <= context &&
           !atomic_compare_exchange_weak(&t->next_context, &next,
                                         context + 1)) {
    }
}

void ra_comm_abort(ra_comm *c, const char *reason) {
    char msg[RA_COMM_MSG_LEN];
    if (reason != NULL && *reason != '\0')
        ra_snprintf(msg, sizeof msg, "rank %d: aborted: %s", c->rank, reason);
    else
        ra_snprintf(msg, sizeof msg, "rank %d: aborted by the caller", c->rank);
    ra_comm_fail(c, RA_ERR_COMM, msg);
}

void ra_comm_close(ra_comm *c) {
    if (atomic_exchange(&c->closed, 1)) return;
    if (c->vt->close != NULL) c->vt->close(c);
    pthread_mutex_lock(&c->mu);
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

void ra_comm_free(ra_comm *c) {
    if (c == NULL) return;
    ra_comm_close(c);
    if (c->vt->destroy != NULL) c->vt->destroy(c);
    ra_comm_destroy_base(c);
    ra_host_free(c, sizeof *c);
}

/* ---- requests ---------------------------------------------------------- */

ra_req *ra_req_new(ra_comm *c, const ra_xfer *x, const char *op,
                   double timeout) {
    ra_req *r = ra_host_calloc(sizeof *r);
    if (r == NULL) return NULL;
    r->comm = c;
    r->x = *x;
    r->op = op;
    r->timeout = timeout;
    r->deadline = ra_now() + timeout;
    atomic_store(&r->state, RA_REQ_PENDING);
    atomic_store(&r->refs, 2);
    r->send_done = x->dst < 0;
    r->recv_done = x->src < 0;
    return r;
}

void ra_req_release(ra_req *r) {
    if (r == NULL) return;
    if (atomic_fetch_sub(&r->refs, 1) == 1) ra_host_free(r, sizeof *r);
}

void ra_req_finish_locked(ra_req *r, ra_status st, const char *msg) {
    if (atomic_load(&r->state) != RA_REQ_PENDING) return;
    r->status = st;
    if (st != RA_OK && msg != r->msg)
        ra_snprintf(r->msg, sizeof r->msg, "%s", msg ? msg : "failed");
    atomic_store(&r->state, st == RA_OK ? RA_REQ_DONE : RA_REQ_FAILED);
    pthread_cond_broadcast(&r->comm->cv);
}

static void req_fail_now(ra_req *r, ra_status st, const char *msg) {
    pthread_mutex_lock(&r->comm->mu);
    ra_req_finish_locked(r, st, msg);
    pthread_mutex_unlock(&r->comm->mu);
}

/* dst == src == rank on a host backend: a plain copy, done at start. */
static ra_status self_copy(ra_comm *c, ra_req *r) {
    char pre[128];
    ra_comm_prefix(pre, sizeof pre, c->rank, r->op, r->x.step);
    if (r->x.dst != c->rank || r->x.src != c->rank) {
        char msg[RA_COMM_MSG_LEN];
        ra_snprintf(msg, sizeof msg,
                    "%sa send to self needs a receive from self "
                    "(dst=%d, src=%d)", pre, r->x.dst, r->x.src);
        req_fail_now(r, RA_ERR_VALUE, msg);
        return RA_ERR_VALUE;
    }
    if (r->x.send_nbytes != r->x.recv_nbytes) {
        char msg[RA_COMM_MSG_LEN];
        ra_snprintf(msg, sizeof msg,
                    "%ssize mismatch: rank %d sends %zu bytes but the receive "
                    "buffer holds %zu bytes", pre, c->rank, r->x.send_nbytes,
                    r->x.recv_nbytes);
        req_fail_now(r, RA_ERR_COMM, msg);
        return RA_ERR_COMM;
    }
    if (r->x.send_nbytes > 0 && r->x.send != r->x.recv)
        memmove(r->x.recv, r->x.send, r->x.send_nbytes);
    atomic_fetch_add(&c->messages, 1);
    req_fail_now(r, RA_OK, NULL);
    return RA_OK;
}

/* Make and start the request of transfer x on t (a communicator, or the
 * transport a split runs on: x then in t's ranks and the split's context). */
static ra_status start_request(ra_comm *t, const ra_xfer *x, const char *op,
                               double msg_timeout, double deadline, int local,
                               ra_req **out) {
    ra_req *r = ra_req_new(t, x, op, msg_timeout);
    if (r == NULL) return RA_ERR_NOMEM;
    r->deadline = deadline;
    ra_status st;
    if (local) {
        st = self_copy(t, r);
        ra_req_release(r);    /* the backend's reference */
    } else if (x->dst < 0 && x->src < 0) {
        req_fail_now(r, RA_OK, NULL);
        ra_req_release(r);
        st = RA_OK;
    } else {
        st = t->vt->sendrecv_start(t, r);  /* takes the backend reference */
    }
    if (st != RA_OK) {
        ra_set_error(st, "%s", r->msg);
        /* a closed split fails alone (the backend failed it) */
        if (st != RA_ERR_VALUE && !r->ctx_closed) ra_comm_fail(t, st, r->msg);
        ra_req_release(r);
        return st;
    }
    *out = r;
    return RA_OK;
}

static ra_status start_deadline(ra_comm *c, const ra_xfer *x, const char *op,
                                double msg_timeout, double deadline,
                                ra_req **out) {
    *out = NULL;
    RA_CHECK(ra_comm_check_usable(c, op));
    if (x->dst < -1 || x->dst >= c->size || x->src < -1 ||
        x->src >= c->size) {
        ra_set_error(RA_ERR_VALUE,
                     "rank %d: %s: peer out of range: dst=%d, src=%d, "
                     "expected -1 or 0..%d", c->rank, op, x->dst, x->src,
                     c->size - 1);
        return RA_ERR_VALUE;
    }
    ra_xfer y = *x;
    if (!y.back_known && y.dst >= 0 && y.dst == y.src) {
        /* one peer both ways: each side knows what the other expects */
        y.back_known = 1;
        y.recv_from_dst = y.recv_nbytes;
        y.send_to_src = y.send_nbytes;
    }
    int local = (x->dst == c->rank || x->src == c->rank) &&
                c->vt->device_type != RA_DEV_CUDA;
    if (c->transport == NULL || local || (x->dst < 0 && x->src < 0))
        return start_request(c, &y, op, msg_timeout, deadline, local, out);
    /* a split: the same transfer between the members' ranks of the
     * transport, tagged with the split's context */
    RA_CHECK(ra_comm_check_usable(c->transport, op));
    y.dst = x->dst < 0 ? -1 : c->members[x->dst];
    y.src = x->src < 0 ? -1 : c->members[x->src];
    y.kind = (x->kind & RA_XFER_KIND_MASK) |
             (int)(c->context << RA_XFER_KIND_BITS);
    if (x->dst >= 0) atomic_fetch_add(&c->bytes_sent, x->send_nbytes);
    if (x->src >= 0) atomic_fetch_add(&c->bytes_received, x->recv_nbytes);
    atomic_fetch_add(&c->messages, 1);
    return start_request(c->transport, &y, op, msg_timeout, deadline, 0, out);
}

ra_status ra_comm_start(ra_comm *c, const ra_xfer *x, const char *op,
                        double timeout, ra_req **out) {
    if (!(timeout > 0)) timeout = c->default_timeout;
    return start_deadline(c, x, op, timeout, ra_now() + timeout, out);
}

static void timespec_at(double when, struct timespec *ts) {
    /* `when` is on the ra_now() (CLOCK_MONOTONIC) clock, like the cv */
    double s = floor(when);
    ts->tv_sec = (time_t)s;
    ts->tv_nsec = (long)((when - s) * 1e9);
    if (ts->tv_nsec >= 1000000000L) ts->tv_nsec = 999999999L;
}

/* Wait for `r` until `deadline`; on timeout fail the comm (which stops the
 * backend touching r) and report which peer we were waiting for. */
static ra_status wait_deadline(ra_req *r, double deadline,
                               double msg_timeout) {
    ra_comm *c = r->comm;
    ra_status st;
    if (c->vt->wait != NULL) {
        st = c->vt->wait(c, r, deadline);
        if (st != RA_ERR_TIMEOUT) goto done;
    } else {
        pthread_mutex_lock(&c->mu);
        while (atomic_load(&r->state) == RA_REQ_PENDING) {
            double now = ra_now();
            if (now >= deadline) break;
            struct timespec ts;
            timespec_at(deadline, &ts);
            pthread_cond_timedwait(&c->cv, &c->mu, &ts);
        }
        int pending = atomic_load(&r->state) == RA_REQ_PENDING;
        pthread_mutex_unlock(&c->mu);
        if (!pending) goto finished;
    }
    {
        /* timed out */
        char pre[128], msg[RA_COMM_MSG_LEN], hint[192] = "";
        ra_comm_prefix(pre, sizeof pre, c->rank, r->op, r->x.step);
        pthread_mutex_lock(&c->mu);
        int peer = !r->recv_done ? r->x.src : r->x.dst;
        pthread_mutex_unlock(&c->mu);
        if (c->vt->stall_hint != NULL)
            c->vt->stall_hint(c, r, peer, hint, sizeof hint);
        ra_snprintf(msg, sizeof msg,
                    "%stimed out after %.1f s waiting for rank %d%s", pre,
                    msg_timeout, peer, hint);
        ra_comm_fail(c, RA_ERR_TIMEOUT, msg);
        /* the backend finishes every pending request promptly on abort */
        pthread_mutex_lock(&c->mu);
        while (atomic_load(&r->state) == RA_REQ_PENDING) {
            struct timespec ts;
            timespec_at(ra_now() + 0.1, &ts);
            pthread_cond_timedwait(&c->cv, &c->mu, &ts);
        }
        pthread_mutex_unlock(&c->mu);
        ra_set_error(RA_ERR_TIMEOUT, "%s", msg);
        return RA_ERR_TIMEOUT;
    }
finished:
    st = r->status;
done:
    if (atomic_load(&r->state) == RA_REQ_FAILED) {
        st = r->status != RA_OK ? r->status : RA_ERR_COMM;
        ra_set_error(st, "%s", r->msg);
        /* a closed split fails alone (the backend failed it) */
        if (!r->ctx_closed) ra_comm_fail(c, st, r->msg);
        return st;
    }
    return st;
}

ra_status ra_comm_wait_until(ra_req *r, double deadline,
                             double msg_timeout) {
    if (deadline > r->deadline) {
        deadline = r->deadline;
        msg_timeout = r->timeout;
    }
    return wait_deadline(r, deadline, msg_timeout);
}

ra_status ra_comm_wait(ra_req *r, double timeout) {
    double deadline = r->deadline, msg_timeout = r->timeout;
    if (timeout > 0 && ra_now() + timeout < deadline) {
        deadline = ra_now() + timeout;
        msg_timeout = timeout;
    }
    return wait_deadline(r, deadline, msg_timeout);
}

int ra_req_wait_done(ra_req *r, double until) {
    ra_comm *c = r->comm;
    if (c->vt->wait != NULL) {
        /* the backend's own wait, bounded by the slice; running out of the
         * slice is not a failure here */
        (void)c->vt->wait(c, r, until);
        return atomic_load(&r->state) != RA_REQ_PENDING;
    }
    pthread_mutex_lock(&c->mu);
    while (atomic_load(&r->state) == RA_REQ_PENDING && ra_now() < until) {
        struct timespec ts;
        timespec_at(until, &ts);
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
    }
    int done = atomic_load(&r->state) != RA_REQ_PENDING;
    pthread_mutex_unlock(&c->mu);
    return done;
}

int ra_comm_test(ra_req *r) {
    return atomic_load(&r->state) != RA_REQ_PENDING;
}

ra_status ra_comm_sendrecv(ra_comm *c, const ra_xfer *x, const char *op,
                           double timeout) {
    ra_req *r = NULL;
    RA_CHECK(ra_comm_start(c, x, op, timeout, &r));
    ra_status st = ra_comm_wait(r, -1);
    ra_req_release(r);
    return st;
}

/* ---- collectives from sendrecv ----------------------------------------- */

static ra_status step_until(ra_comm *c, const ra_xfer *x, const char *op,
                            double timeout, double deadline) {
    ra_req *r = NULL;
    RA_CHECK(start_deadline(c, x, op, timeout, deadline, &r));
    ra_status st = wait_deadline(r, deadline, timeout);
    ra_req_release(r);
    return st;
}

static ra_xfer host_xfer(ra_comm *c, int kind, int64_t step) {
    ra_xfer x;
    memset(&x, 0, sizeof x);
    x.kind = kind;
    x.step = step;
    x.dst = x.src = -1;
    x.device_type = RA_DEV_CPU;
    x.device_id = c->device_id;
    return x;
}

ra_status ra_comm_barrier(ra_comm *c, double timeout) {
    if (c->vt->barrier != NULL) return c->vt->barrier(c, timeout);
    RA_CHECK(ra_comm_check_usable(c, "barrier"));
    if (!(timeout > 0)) timeout = c->default_timeout;
    double deadline = ra_now() + timeout;
    /* dissemination: after round k every rank has heard (transitively)
     * from 2^(k+1) ranks */
    unsigned char token = 0, sink = 0;
    int64_t round = 0;
    for (int dist = 1; dist < c->size; dist <<= 1, round++) {
        ra_xfer x = host_xfer(c, RA_XFER_BARRIER, round);
        x.send = &token;
        x.send_nbytes = 1;
        x.dst = (c->rank + dist) % c->size;
        x.recv = &sink;
        x.recv_nbytes = 1;
        x.src = (c->rank - dist + c->size) % c->size;
        RA_CHECK(step_until(c, &x, "barrier", timeout, deadline));
    }
    return RA_OK;
}

ra_status ra_comm_allgather(ra_comm *c, const void *in, size_t nbytes,
                            void **out, size_t *out_total, size_t *lens,
                            double timeout) {
    *out = NULL;
    *out_total = 0;
    if (c->vt->allgather != NULL)
        return c->vt->allgather(c, in, nbytes, out, out_total, lens, timeout);
    RA_CHECK(ra_comm_check_usable(c, "allgather"));
    if (nbytes > RA_ALLGATHER_MAX) {
        ra_set_error(RA_ERR_VALUE,
                     "rank %d: allgather: item of %zu bytes exceeds the "
                     "limit of %zu bytes", c->rank, nbytes, RA_ALLGATHER_MAX);
        return RA_ERR_VALUE;
    }
    if (!(timeout > 0)) timeout = c->default_timeout;
    double deadline = ra_now() + timeout;
    int p = c->size, me = c->rank;
    int next = (me + 1) % p, prev = (me - 1 + p) % p;
    ra_status st = RA_OK;
    uint64_t *len64 = ra_host_calloc(sizeof(uint64_t) * (size_t)p);
    size_t *offs = ra_host_calloc(sizeof(size_t) * (size_t)(p + 1));
    unsigned char *all = NULL;
    size_t total = 0;
    if (len64 == NULL || offs == NULL) {
        st = RA_ERR_NOMEM;
        goto fail;
    }
    len64[me] = nbytes;
    /* ring pass 1: lengths; in step s rank r forwards item r - s */
    for (int s = 0; s < p - 1; s++) {
        ra_xfer x = host_xfer(c, RA_XFER_GATHER, s);
        x.send = &len64[(me - s + p) % p];
        x.send_nbytes = sizeof(uint64_t);
        x.dst = next;
        x.recv = &len64[(me - s - 1 + 2 * p) % p];
        x.recv_nbytes = sizeof(uint64_t);
        x.src = prev;
        RA_CHECKGOTO(step_until(c, &x, "allgather", timeout, deadline), st,
                     fail);
    }
    for (int i = 0; i < p; i++) {
        if (len64[i] > RA_ALLGATHER_MAX) {
            char msg[RA_COMM_MSG_LEN];
            ra_snprintf(msg, sizeof msg,
                        "rank %d: allgather: rank %d announced %llu bytes, "
                        "more than the limit of %zu", me, i,
                        (unsigned long long)len64[i], RA_ALLGATHER_MAX);
            ra_set_error(RA_ERR_COMM, "%s", msg);
            st = ra_comm_fail(c, RA_ERR_COMM, msg);
            goto fail;
        }
        offs[i] = total;
        total += (size_t)len64[i];
    }
    offs[p] = total;
    all = ra_host_alloc(total);
    if (all == NULL) {
        st = RA_ERR_NOMEM;
        goto fail;
    }
    if (nbytes > 0) memcpy(all + offs[me], in, nbytes);
    /* ring pass 2: the items themselves */
    for (int s = 0; s < p - 1; s++) {
        int si = (me - s + p) % p, ri = (me - s - 1 + 2 * p) % p;
        ra_xfer x = host_xfer(c, RA_XFER_GATHER, p - 1 + s);
        x.send = all + offs[si];
        x.send_nbytes = (size_t)len64[si];
        x.dst = next;
        x.recv = all + offs[ri];
        x.recv_nbytes = (size_t)len64[ri];
        x.src = prev;
        RA_CHECKGOTO(step_until(c, &x, "allgather", timeout, deadline), st,
                     fail);
    }
    for (int i = 0; i < p; i++) lens[i] = (size_t)len64[i];
    *out = all;
    *out_total = total;
    all = NULL;
fail:
    if (all != NULL) ra_host_free(all, total);
    ra_host_free(offs, sizeof(size_t) * (size_t)(p + 1));
    ra_host_free(len64, sizeof(uint64_t) * (size_t)p);
    return st;
}

/* Pairwise steps: in step s every rank sends its block for rank + s and
 * receives the block of rank - s, so each step is a shift that never
 * deadlocks; all steps are started at once and waited on under one
 * deadline. */
ra_status ra_comm_alltoall_steps(ra_comm *c, const ra_a2a *a,
                                 double timeout) {
    int p = c->size, me = c->rank;
    double deadline = ra_now() + timeout;
    if (p == 1) return RA_OK;
    ra_req **reqs = ra_host_calloc(sizeof(ra_req *) * (size_t)p);
    if (reqs == NULL) return RA_ERR_NOMEM;
    ra_status st = RA_OK;
    char first[RA_COMM_MSG_LEN] = "";
    for (int s = 1; s < p && st == RA_OK; s++) {
        int dst = (me + s) % p, src = (me - s + p) % p;
        ra_xfer x;
        memset(&x, 0, sizeof x);
        x.kind = RA_XFER_ALLTOALL;
        x.step = s;
        x.send = a->send[dst];
        x.send_nbytes = a->send_nbytes[dst];
        x.dst = dst;
        x.recv = a->recv[src];
        x.recv_nbytes = a->recv_nbytes[src];
        x.src = src;
        x.back_known = 1;
        x.recv_from_dst = a->recv_nbytes[dst];
        x.send_to_src = a->send_nbytes[src];
        x.device_type = a->device_type;
        x.device_id = a->device_id;
        x.stream = a->stream;
        st = start_deadline(c, &x, "alltoall", timeout, deadline, &reqs[s]);
        if (st != RA_OK) ra_snprintf(first, sizeof first, "%s", ra_last_error());
    }
    /* wait for every started step, also after a failure (which fails the
     * communicator, so the others finish at once): their memory is the
     * caller's */
    for (int s = 1; s < p; s++) {
        if (reqs[s] == NULL) continue;
        ra_status ws = wait_deadline(reqs[s], deadline, timeout);
        if (ws != RA_OK && st == RA_OK) {
            st = ws;
            ra_snprintf(first, sizeof first, "%s", ra_last_error());
        }
        ra_req_release(reqs[s]);
    }
    ra_host_free(reqs, sizeof(ra_req *) * (size_t)p);
    if (st != RA_OK) ra_set_error(st, "%s", first);
    return st;
}

ra_status ra_comm_alltoall_check_self(const ra_comm *c, const ra_a2a *a) {
    int me = c->rank;
    if (a->send_nbytes[me] == a->recv_nbytes[me]) return RA_OK;
    ra_set_error(RA_ERR_VALUE,
                 "rank %d: alltoall: the block to itself has %zu bytes "
                 "but its receive block holds %zu bytes", me,
                 a->send_nbytes[me], a->recv_nbytes[me]);
    return RA_ERR_VALUE;
}

/* Host memory: the block to self is a copy, the rest pairwise steps. */
static ra_status generic_alltoall(ra_comm *c, const ra_a2a *a,
                                  double timeout) {
    int me = c->rank;
    ra_status st = ra_comm_alltoall_check_self(c, a);
    if (st != RA_OK) return st;
    if (a->send_nbytes[me] > 0 && a->send[me] != a->recv[me])
        memmove(a->recv[me], a->send[me], a->send_nbytes[me]);
    return ra_comm_alltoall_steps(c, a, timeout);
}

/* ---- in-place blocks ----------------------------------------------------- */

typedef struct block {
    uintptr_t lo, hi;         /* [lo, hi) */
    int index;
} block;

static int by_start(const void *a, const void *b) {
    const block *x = a, *y = b;
    if (x->lo != y->lo) return x->lo < y->lo ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

ra_status ra_a2a_staged(int rank, int size, const ra_a2a *a,
                        unsigned char *staged, size_t *staged_bytes) {
    *staged_bytes = 0;
    memset(staged, 0, (size_t)size);
    block *recv = ra_host_alloc(sizeof(block) * (size_t)size);
    if (recv == NULL) return RA_ERR_NOMEM;
    int n = 0;
    for (int j = 0; j < size; j++)
        if (a->recv_nbytes[j] > 0)
            recv[n++] = (block){(uintptr_t)a->recv[j],
                                (uintptr_t)a->recv[j] + a->recv_nbytes[j], j};
    qsort(recv, (size_t)n, sizeof *recv, by_start);
    ra_status st = RA_OK;
    for (int k = 1; k < n; k++) {
        if (recv[k].lo < recv[k - 1].hi) {
            int i = recv[k - 1].index, j = recv[k].index;
            ra_set_error(RA_ERR_VALUE, "rank %d: alltoall: recvs[%d] and "
                         "recvs[%d] overlap (each block is written by its "
                         "own rank)", rank, i < j ? i : j, i < j ? j : i);
            st = RA_ERR_VALUE;
            goto done;
        }
    }
    /* sorted, disjoint receive blocks: the last one starting before a send
     * block ends is the only one that can overlap it */
    for (int i = 0; i < size; i++) {
        size_t len = a->send_nbytes[i];
        if (len == 0) continue;
        uintptr_t lo = (uintptr_t)a->send[i], hi = lo + len;
        int left = 0, right = n;          /* first block with start >= hi */
        while (left < right) {
            int mid = (left + right) / 2;
            if (recv[mid].lo < hi) left = mid + 1;
            else right = mid;
        }
        if (left == 0 || recv[left - 1].hi <= lo) continue;
        const block *b = &recv[left - 1];
        /* the block to itself in its own receive block: a plain no-op */
        if (i == rank && b->index == rank && b->lo == lo && b->hi == hi)
            continue;
        staged[i] = 1;
        *staged_bytes += len;
    }
done:
    ra_host_free(recv, sizeof(block) * (size_t)size);
    return st;
}

/* Host memory in place: the send blocks that overlap receive blocks are
 * copied aside, then exchanged from there. */
static ra_status host_alltoall(ra_comm *c, const ra_a2a *a, double timeout) {
    int p = c->size;
    size_t total = 0;
    unsigned char *staged = ra_host_alloc((size_t)p);
    if (staged == NULL) return RA_ERR_NOMEM;
    ra_status st = ra_a2a_staged(c->rank, p, a, staged, &total);
    if (st != RA_OK || total == 0) {
        if (st == RA_OK) st = generic_alltoall(c, a, timeout);
        ra_host_free(staged, (size_t)p);
        return st;
    }
    unsigned char *copy = ra_host_alloc(total);
    const void **send = ra_host_alloc(sizeof(void *) * (size_t)p);
    if (copy == NULL || send == NULL) {
        ra_set_error(RA_ERR_NOMEM, "rank %d: alltoall: cannot set %zu bytes "
                     "of in-place send blocks aside", c->rank, total);
        st = RA_ERR_NOMEM;
        goto done;
    }
    size_t off = 0;
    for (int i = 0; i < p; i++) {
        send[i] = a->send[i];
        if (!staged[i]) continue;
        memcpy(copy + off, a->send[i], a->send_nbytes[i]);
        send[i] = copy + off;
        off += a->send_nbytes[i];
    }
    ra_a2a b = *a;
    b.send = send;
    st = generic_alltoall(c, &b, timeout);
done:
    ra_host_free(send, sizeof(void *) * (size_t)p);
    ra_host_free(copy, total);
    ra_host_free(staged, (size_t)p);
    return st;
}

ra_status ra_comm_alltoall(ra_comm *c, const ra_a2a *a, double timeout) {
    RA_CHECK(ra_comm_check_usable(c, "alltoall"));
    if (!(timeout > 0)) timeout = c->default_timeout;
    /* nccl: device memory, set aside on the device by the backend */
    if (c->vt->alltoall != NULL) return c->vt->alltoall(c, a, timeout);
    return host_alltoall(c, a, timeout);
}
