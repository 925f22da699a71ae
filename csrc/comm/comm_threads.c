/*
 * comm_threads.c -- the "threads" backend: ranks are threads of this
 * process sharing one group.
 *
 * For every ordered pair (src, dst) the group keeps a FIFO of posted sends
 * and a FIFO of posted receives.  Starting a sendrecv posts its send and its
 * receive; whenever a send meets the oldest receive of its pair and its
 * context (or the other way round) the rank that arrived second copies the
 * bytes directly from the sender's buffer into the receiver's, with no lock
 * held, and both requests advance.  Posting never blocks, so a ring where
 * every rank sends first cannot deadlock.  Kind, step and size are checked
 * when the pair meets.  Deadlines are the waiters' (comm_core.c).
 *
 * Contexts: a split of a rank's communicator (comm_split.c) posts here with
 * its context in the kind, and only requests of one context meet, so the
 * communicators of a group run independently (from different threads).
 * comm_threads_split.c keeps the splits and who left them (closed, or
 * failed because a member they exchanged with left).
 *
 * Device memory: a group made with devices (one CUDA device per rank)
 * moves device memory instead, with the same queues and matching; only the
 * copy differs: it is queued on the GPU, ordered with events on the ranks'
 * streams (comm_threads_cuda.c).
 *
 * Failures: a rank whose communicator fails (or closes) is marked dead;
 * every request posted by it or waiting on it fails at once, and the ranks
 * that were waiting on it fail in turn, so one failing thread stops the
 * group without anybody waiting for a timeout.  Lock order: group lock,
 * then a communicator's lock.
 */
#include "comm/comm_threads_internal.h"

#include <stdio.h>
#include <string.h>


/* ---- queues ------------------------------------------------------------ */

static void push_send(ra_tgroup *g, int src, int dst, ra_req *r) {
    ra_req **p = &g->sendq[src * g->size + dst];
    while (*p) p = &(*p)->next;
    r->next = NULL;
    *p = r;
}

static void push_recv(ra_tgroup *g, int src, int dst, ra_req *r) {
    ra_req **p = &g->recvq[src * g->size + dst];
    while (*p) p = &(*p)->next_recv;
    r->next_recv = NULL;
    *p = r;
}

/* The oldest posted send (receive) of the pair in `context`, taken out. */
static ra_req *take_send(ra_tgroup *g, int src, int dst, uint32_t context) {
    ra_req **p = &g->sendq[src * g->size + dst];
    while (*p && ra_xfer_context((*p)->x.kind) != context) p = &(*p)->next;
    ra_req *r = *p;
    if (r) *p = r->next;
    return r;
}

static ra_req *take_recv(ra_tgroup *g, int src, int dst, uint32_t context) {
    ra_req **p = &g->recvq[src * g->size + dst];
    while (*p && ra_xfer_context((*p)->x.kind) != context)
        p = &(*p)->next_recv;
    ra_req *r = *p;
    if (r) *p = r->next_recv;
    return r;
}

/* Take r out of whichever queues hold it. */
static void unlink_req(ra_tgroup *g, ra_req *r) {
    int me = r->comm->rank;
    if (r->x.dst >= 0 && r->x.dst != me) {
        ra_req **p = &g->sendq[me * g->size + r->x.dst];
        while (*p && *p != r) p = &(*p)->next;
        if (*p) *p = r->next;
    }
    if (r->x.src >= 0 && r->x.src != me) {
        ra_req **p = &g->recvq[r->x.src * g->size + me];
        while (*p && *p != r) p = &(*p)->next_recv;
        if (*p) *p = r->next_recv;
    }
}

/* ---- completion -------------------------------------------------------- */

/* Finish r if nothing copies into or out of it any more.  Drops the
 * backend's reference when it finishes.  Group lock held. */
static void maybe_finish(ra_req *r) {
    if (r->copying > 0 || atomic_load(&r->state) != RA_REQ_PENDING) return;
    ra_comm *c = r->comm;
    if (r->doomed || (r->send_done && r->recv_done)) {
        ra_tcuda_req_done(r);
        pthread_mutex_lock(&c->mu);
        ra_req_finish_locked(r, r->doomed ? r->status : RA_OK, r->msg);
        pthread_mutex_unlock(&c->mu);
        ra_req_release(r);
    }
}

void ra_tgroup_fail_req(ra_tgroup *g, ra_req *r, ra_status st,
                        const char *msg) {
    unlink_req(g, r);
    if (r->doomed || atomic_load(&r->state) != RA_REQ_PENDING) return;
    r->doomed = 1;
    r->status = st;
    ra_snprintf(r->msg, sizeof r->msg, "%s", msg);
    maybe_finish(r);
}

/* Mark rank d dead (message already in DEAD_MSG(g, d)); fail its requests
 * and those waiting on it; then do the same for the ranks that failed
 * because of it.  Group lock held. */
static void kill_rank_locked(ra_tgroup *g, int d) {
    if (g->dead[d]) return;
    g->dead[d] = 1;
    if (g->comms[d] != NULL) ra_comm_mark_failed(g->comms[d], DEAD_MSG(g, d));
    int n = g->size;
    for (;;) {
        ra_req *victim = NULL;
        /* queue i = src * n + dst; only a side still pending counts */
        for (int i = 0; i < n * n && victim == NULL; i++) {
            int qsrc = i / n, qdst = i % n;
            if (qsrc != d && qdst != d) continue;
            if (g->sendq[i] != NULL) victim = g->sendq[i];
            else if (g->recvq[i] != NULL) victim = g->recvq[i];
        }
        if (victim == NULL) break;
        int owner = victim->comm->rank;
        if (owner == d) {
            ra_tgroup_fail_req(g, victim, RA_ERR_COMM, DEAD_MSG(g, d));
            continue;
        }
        char pre[128], msg[RA_COMM_MSG_LEN];
        ra_comm_prefix(pre, sizeof pre, owner, victim->op, victim->x.step);
        ra_snprintf(msg, sizeof msg, "%speer rank %d failed: %s", pre, d,
                    DEAD_MSG(g, d));
        ra_tgroup_fail_req(g, victim, RA_ERR_COMM, msg);
        if (!g->dead[owner] && !g->pending_kill[owner]) {
            ra_snprintf(DEAD_MSG(g, owner), RA_COMM_MSG_LEN, "%s", msg);
            g->pending_kill[owner] = 1;
        }
    }
    for (int x = 0; x < n; x++) {
        if (g->pending_kill[x]) {
            g->pending_kill[x] = 0;
            kill_rank_locked(g, x);
        }
    }
}

/* ---- matching ---------------------------------------------------------- */

typedef struct copy_job {
    ra_req *from, *to;
    ra_status st;             /* device copies: how queueing it went */
    char msg[RA_COMM_MSG_LEN];
} copy_job;

/* Record a copy and pin both requests at once: a mismatch found later in
 * the same start (the other direction of a two-rank exchange) then only
 * dooms them, and they finish after the copy, not while it still runs
 * into their buffers.  Group lock held. */
static void add_job(copy_job *jobs, int *njobs, ra_req *from, ra_req *to) {
    from->copying++;
    to->copying++;
    jobs[*njobs].from = from;
    jobs[*njobs].to = to;
    jobs[*njobs].st = RA_OK;
    (*njobs)++;
}

/* Fail a sender/receiver pair (each with its own side's message) and kill
 * both ranks.  Group lock held. */
static void fail_pair_locked(ra_tgroup *g, ra_req *s, ra_req *r,
                             ra_status st, const char *ms, const char *mr) {
    int a = s->comm->rank, b = r->comm->rank;
    ra_tgroup_fail_req(g, s, st, ms);
    ra_tgroup_fail_req(g, r, st, mr);
    if (!g->dead[a]) {
        ra_snprintf(DEAD_MSG(g, a), RA_COMM_MSG_LEN, "%s", ms);
        kill_rank_locked(g, a);
    }
    if (!g->dead[b]) {
        ra_snprintf(DEAD_MSG(g, b), RA_COMM_MSG_LEN, "%s", mr);
        kill_rank_locked(g, b);
    }
}

/* Check a meeting sender/receiver pair; on mismatch fail both with a
 * message from each side's point of view and kill both ranks. */
static int check_pair(ra_tgroup *g, ra_req *s, ra_req *r) {
    int a = s->comm->rank, b = r->comm->rank;
    char pre_s[128], pre_r[128], ms[RA_COMM_MSG_LEN], mr[RA_COMM_MSG_LEN];
    ra_comm_prefix(pre_s, sizeof pre_s, a, s->op, s->x.step);
    ra_comm_prefix(pre_r, sizeof pre_r, b, r->op, r->x.step);
    if (s->x.kind != r->x.kind) {   /* one context: another operation */
        ra_snprintf(ms, sizeof ms, "%soperation mismatch: rank %d is in %s",
                    pre_s, b, r->op);
        ra_snprintf(mr, sizeof mr, "%soperation mismatch: rank %d is in %s",
                    pre_r, a, s->op);
    } else if (s->x.step != r->x.step) {
        ra_snprintf(ms, sizeof ms, "%sstep mismatch: rank %d expects step %lld",
                    pre_s, b, (long long)r->x.step);
        ra_snprintf(mr, sizeof mr,
                    "%sstep mismatch: rank %d sent step %lld, this rank "
                    "expects step %lld", pre_r, a, (long long)s->x.step,
                    (long long)r->x.step);
    } else if (s->x.send_nbytes != r->x.recv_nbytes) {
        ra_snprintf(ms, sizeof ms,
                    "%ssize mismatch: this rank sends %zu bytes but rank %d's "
                    "receive buffer holds %zu bytes", pre_s, s->x.send_nbytes,
                    b, r->x.recv_nbytes);
        ra_snprintf(mr, sizeof mr,
                    "%ssize mismatch: rank %d sends %zu bytes but the receive "
                    "buffer holds %zu bytes", pre_r, a, s->x.send_nbytes,
                    r->x.recv_nbytes);
    } else {
        return 1;
    }
    fail_pair_locked(g, s, r, RA_ERR_COMM, ms, mr);
    return 0;
}

static ra_status threads_start(ra_comm *c, ra_req *q) {
    ra_tgroup *g = c->impl;
    int me = c->rank, dst = q->x.dst, src = q->x.src;
    copy_job jobs[2];
    int njobs = 0;
    char pre[128], msg[RA_COMM_MSG_LEN];
    ra_comm_prefix(pre, sizeof pre, me, q->op, q->x.step);
    ra_status pst = RA_OK;
    if (q->x.device_type == RA_DEV_CUDA) {
        /* its ready event, before any peer can meet it */
        char why[RA_COMM_MSG_LEN];
        pst = ra_tcuda_post(q, why, sizeof why);
        if (pst != RA_OK) ra_snprintf(msg, sizeof msg, "%s%s", pre, why);
    }
    pthread_mutex_lock(&g->mu);
    int bad = g->dead[me] ? me : (dst >= 0 && g->dead[dst]) ? dst
                               : (src >= 0 && g->dead[src]) ? src : -1;
    uint32_t context = ra_xfer_context(q->x.kind);
    if (pst != RA_OK) {
        ra_tgroup_fail_req(g, q, pst, msg);
        pthread_mutex_unlock(&g->mu);
        ra_snprintf(q->msg, sizeof q->msg, "%s", msg);
        return pst;
    }
    if (bad >= 0 || ra_tsplit_refuse(g, q, msg, sizeof msg)) {
        if (bad == me)
            ra_snprintf(msg, sizeof msg, "%s", DEAD_MSG(g, me));
        else if (bad >= 0)
            ra_snprintf(msg, sizeof msg, "%speer rank %d failed: %s", pre, bad,
                        DEAD_MSG(g, bad));
        ra_tgroup_fail_req(g, q, RA_ERR_COMM, msg);
        pthread_mutex_unlock(&g->mu);
        ra_snprintf(q->msg, sizeof q->msg, "%s", msg);
        return RA_ERR_COMM;
    }
    if (dst >= 0) {
        ra_req *r = take_recv(g, me, dst, context);
        if (r == NULL) {
            push_send(g, me, dst, q);
        } else if (check_pair(g, q, r)) {
            add_job(jobs, &njobs, q, r);
        }
    }
    if (src >= 0 && !q->doomed) {
        ra_req *s = take_send(g, src, me, context);
        if (s == NULL) {
            push_recv(g, src, me, q);
        } else if (check_pair(g, s, q)) {
            add_job(jobs, &njobs, s, q);
        }
    }
    pthread_mutex_unlock(&g->mu);

    for (int i = 0; i < njobs; i++) {
        size_t n = jobs[i].from->x.send_nbytes;
        if (jobs[i].to->x.device_type == RA_DEV_CUDA)
            jobs[i].st = ra_tcuda_copy(g, jobs[i].from, jobs[i].to,
                                       jobs[i].msg, sizeof jobs[i].msg);
        else if (n > 0)
            memcpy(jobs[i].to->x.recv, jobs[i].from->x.send, n);
        atomic_fetch_add(&jobs[i].from->comm->bytes_sent, n);
        atomic_fetch_add(&jobs[i].from->comm->messages, 1);
        atomic_fetch_add(&jobs[i].to->comm->bytes_received, n);
    }

    pthread_mutex_lock(&g->mu);
    for (int i = 0; i < njobs; i++) {
        ra_req *s = jobs[i].from, *r = jobs[i].to;
        s->send_done = 1;
        r->recv_done = 1;
        s->copying--;
        r->copying--;
        if (jobs[i].st != RA_OK) {
            char ms[RA_COMM_MSG_LEN], mr[RA_COMM_MSG_LEN], pre[128];
            ra_comm_prefix(pre, sizeof pre, s->comm->rank, s->op, s->x.step);
            ra_snprintf(ms, sizeof ms, "%sdevice copy to rank %d failed: %s",
                        pre, r->comm->rank, jobs[i].msg);
            ra_comm_prefix(pre, sizeof pre, r->comm->rank, r->op, r->x.step);
            ra_snprintf(mr, sizeof mr, "%sdevice copy from rank %d failed: "
                        "%s", pre, s->comm->rank, jobs[i].msg);
            fail_pair_locked(g, s, r, jobs[i].st, ms, mr);
        }
    }
    /* finish each request once: a finished request may be freed by its
     * waiter at once (with two ranks, the peer's request can sit in both
     * jobs) */
    ra_req *touched[4];
    int ntouched = 0;
    for (int i = 0; i < njobs; i++) {
        ra_req *pair[2] = {jobs[i].from, jobs[i].to};
        for (int k = 0; k < 2; k++) {
            int seen = 0;
            for (int j = 0; j < ntouched; j++) seen |= touched[j] == pair[k];
            if (!seen) touched[ntouched++] = pair[k];
        }
    }
    for (int i = 0; i < ntouched; i++) maybe_finish(touched[i]);
    /* a mismatch found while posting fails q (already reported in q) */
    pthread_mutex_unlock(&g->mu);
    return RA_OK;
}

static void threads_stall_hint(ra_comm *c, ra_req *r, int peer, char *buf,
                               size_t n) {
    ra_tgroup *g = c->impl;
    if (g == NULL || peer < 0) return;
    uint32_t context = ra_xfer_context(r->x.kind);
    int me = c->rank, size = g->size;
    pthread_mutex_lock(&g->mu);
    /* the peer's send to this rank, or its receive from it, elsewhere */
    const ra_req *other = NULL;
    for (const ra_req *q = g->sendq[peer * size + me]; q && !other;
         q = q->next)
        if (ra_xfer_context(q->x.kind) != context) other = q;
    for (const ra_req *q = g->recvq[me * size + peer]; q && !other;
         q = q->next_recv)
        if (ra_xfer_context(q->x.kind) != context) other = q;
    if (other != NULL)
        ra_snprintf(buf, n, " (rank %d is in a %s of another communicator "
                    "with this rank)", peer, other->op);
    pthread_mutex_unlock(&g->mu);
}

static void threads_abort(ra_comm *c) {
    ra_tgroup *g = c->impl;
    if (g == NULL) return;
    pthread_mutex_lock(&g->mu);
    if (!g->dead[c->rank]) {
        pthread_mutex_lock(&c->mu);
        ra_snprintf(DEAD_MSG(g, c->rank), RA_COMM_MSG_LEN, "%s", c->fail_msg);
        pthread_mutex_unlock(&c->mu);
        kill_rank_locked(g, c->rank);
    }
    pthread_mutex_unlock(&g->mu);
}

static void threads_close(ra_comm *c) {
    ra_tgroup *g = c->impl;
    if (g == NULL) return;
    int me = c->rank, n = g->size;
    pthread_mutex_lock(&g->mu);
    if (!g->dead[me]) {
        /* what it has in flight itself (another thread's operation) */
        for (int x = 0; x < n; x++) {
            ra_req *r;
            while ((r = g->sendq[me * n + x]) != NULL ||
                   (r = g->recvq[x * n + me]) != NULL) {
                char pre[128], msg[RA_COMM_MSG_LEN];
                ra_comm_prefix(pre, sizeof pre, me, r->op, r->x.step);
                ra_snprintf(msg, sizeof msg, "%scommunicator is closed", pre);
                ra_tgroup_fail_req(g, r, RA_ERR_COMM, msg);
            }
        }
        /* and the peers that wait on it */
        ra_snprintf(DEAD_MSG(g, me), RA_COMM_MSG_LEN,
                    "rank %d closed its communicator", me);
        kill_rank_locked(g, me);
    }
    g->comms[me] = NULL;
    pthread_mutex_unlock(&g->mu);
}

static void threads_destroy(ra_comm *c) {
    ra_tgroup *g = c->impl;
    c->impl = NULL;
    ra_tgroup_decref(g);
}

static const ra_comm_vtable threads_vtable = {
    .name = "threads",
    .device_type = RA_DEV_CPU,
    .sendrecv_start = threads_start,
    .wait = NULL,
    .barrier = NULL,
    .allgather = NULL,
    .abort = threads_abort,
    .close = threads_close,
    .destroy = threads_destroy,
    .context_open = ra_tsplit_open,
    .context_close = ra_tsplit_close,
    .stall_hint = threads_stall_hint,
};

/* ranks with a CUDA device each: the same transport on device memory */
static const ra_comm_vtable threads_cuda_vtable = {
    .name = "threads",
    .device_type = RA_DEV_CUDA,
    .sendrecv_start = threads_start,
    .wait = NULL,
    .barrier = NULL,
    .allgather = NULL,
    .alltoall = ra_tcuda_alltoall,
    .abort = threads_abort,
    .close = threads_close,
    .destroy = threads_destroy,
    .context_open = ra_tsplit_open,
    .context_close = ra_tsplit_close,
    .stall_hint = threads_stall_hint,
};

/* ---- group ------------------------------------------------------------- */

static void group_free(ra_tgroup *g) {
    size_t n = (size_t)g->size;
    ra_tsplit_free_all(g);
    if (g->copy_streams != NULL) ra_tcuda_group_free(g);
    ra_host_free(g->devices, sizeof(int) * n);
    ra_host_free(g->copy_streams, sizeof(void *) * n);
    ra_host_free(g->taken, sizeof(int) * n);
    ra_host_free(g->comms, sizeof(ra_comm *) * n);
    ra_host_free(g->dead, sizeof(int) * n);
    ra_host_free(g->pending_kill, sizeof(int) * n);
    ra_host_free(g->dead_msg, RA_COMM_MSG_LEN * n);
    ra_host_free(g->sendq, sizeof(ra_req *) * n * n);
    ra_host_free(g->recvq, sizeof(ra_req *) * n * n);
    pthread_mutex_destroy(&g->mu);
    ra_host_free(g, sizeof *g);
}

ra_status ra_tgroup_create(int size, double timeout, ra_tgroup **out) {
    return ra_tgroup_create_devices(size, timeout, NULL, out);
}

ra_status ra_tgroup_create_devices(int size, double timeout,
                                   const int *devices, ra_tgroup **out) {
    *out = NULL;
    if (size < 1 || size > 4096) {
        ra_set_error(RA_ERR_VALUE, "size must be in 1..4096, got %d", size);
        return RA_ERR_VALUE;
    }
    ra_tgroup *g = ra_host_calloc(sizeof *g);
    if (g == NULL) return RA_ERR_NOMEM;
    size_t n = (size_t)size;
    g->size = size;
    g->timeout = timeout > 0 ? timeout : ra_comm_env_timeout();
    atomic_store(&g->refs, 1);
    pthread_mutex_init(&g->mu, NULL);
    g->taken = ra_host_calloc(sizeof(int) * n);
    g->comms = ra_host_calloc(sizeof(ra_comm *) * n);
    g->dead = ra_host_calloc(sizeof(int) * n);
    g->pending_kill = ra_host_calloc(sizeof(int) * n);
    g->dead_msg = ra_host_calloc(RA_COMM_MSG_LEN * n);
    g->sendq = ra_host_calloc(sizeof(ra_req *) * n * n);
    g->recvq = ra_host_calloc(sizeof(ra_req *) * n * n);
    if (!g->taken || !g->comms || !g->dead || !g->pending_kill ||
        !g->dead_msg || !g->sendq || !g->recvq) {
        group_free(g);
        return RA_ERR_NOMEM;
    }
    if (devices != NULL) {
        g->devices = ra_host_alloc(sizeof(int) * n);
        g->copy_streams = ra_host_calloc(sizeof(void *) * n);
        if (g->devices == NULL || g->copy_streams == NULL) {
            group_free(g);
            return RA_ERR_NOMEM;
        }
        memcpy(g->devices, devices, sizeof(int) * n);
        ra_status st = ra_tcuda_group_init(g);
        if (st != RA_OK) {
            group_free(g);
            return st;
        }
    }
    *out = g;
    return RA_OK;
}

int ra_tgroup_staged(const ra_tgroup *g, int a, int b) {
    if (g->direct == NULL || a < 0 || b < 0 || a >= g->size || b >= g->size)
        return 0;
    return !g->direct[(size_t)a * (size_t)g->size + (size_t)b];
}

int ra_tgroup_device(const ra_tgroup *g, int rank) {
    return g->devices != NULL && rank >= 0 && rank < g->size
               ? g->devices[rank] : -1;
}

void ra_tgroup_incref(ra_tgroup *g) { atomic_fetch_add(&g->refs, 1); }

void ra_tgroup_decref(ra_tgroup *g) {
    if (g != NULL && atomic_fetch_sub(&g->refs, 1) == 1) group_free(g);
}

int ra_tgroup_size(const ra_tgroup *g) { return g->size; }

ra_status ra_tgroup_comm(ra_tgroup *g, int rank, ra_comm **out) {
    *out = NULL;
    if (rank < 0 || rank >= g->size) {
        ra_set_error(RA_ERR_VALUE, "rank must be in [0, %d), got %d",
                     g->size, rank);
        return RA_ERR_VALUE;
    }
    ra_comm *c = ra_host_calloc(sizeof *c);
    if (c == NULL) return RA_ERR_NOMEM;
    ra_status st = ra_comm_init_base(
        c, g->devices != NULL ? &threads_cuda_vtable : &threads_vtable, rank,
        g->size, g->timeout);
    if (st != RA_OK) {
        ra_host_free(c, sizeof *c);
        return st;
    }
    if (g->devices != NULL) c->device_id = g->devices[rank];
    pthread_mutex_lock(&g->mu);
    if (g->taken[rank]) {
        pthread_mutex_unlock(&g->mu);
        ra_comm_destroy_base(c);
        ra_host_free(c, sizeof *c);
        ra_set_error(RA_ERR_VALUE,
                     "rank %d of this group already has a communicator", rank);
        return RA_ERR_VALUE;
    }
    g->taken[rank] = 1;
    g->comms[rank] = c;
    ra_tgroup_incref(g);
    c->impl = g;
    if (g->dead[rank]) ra_comm_mark_failed(c, DEAD_MSG(g, rank));
    pthread_mutex_unlock(&g->mu);
    *out = c;
    return RA_OK;
}

void ra_tgroup_abort(ra_tgroup *g, const char *reason) {
    pthread_mutex_lock(&g->mu);
    for (int r = 0; r < g->size; r++) {
        if (g->dead[r]) continue;
        ra_snprintf(DEAD_MSG(g, r), RA_COMM_MSG_LEN, "rank %d: aborted: %s", r,
                    reason && *reason ? reason : "the group was aborted");
        kill_rank_locked(g, r);
    }
    pthread_mutex_unlock(&g->mu);
}
