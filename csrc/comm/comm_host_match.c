/*
 * comm_host_match.c -- where an arriving frame of a "host" transport goes
 * (the progress thread, comm_host_engine.c, reads the bytes).
 *
 * A frame's header names its context (the communicator it belongs to); it
 * goes to the oldest receive of that context posted for its sender, after
 * a check of kind, step and size (and of `back`, the size the sender
 * expects in return, so that both ranks see a size mismatch).  A frame
 * whose receive is not posted yet stays in the socket (back-pressure, as
 * in a ring that runs ahead) unless another communicator receives from
 * that sender meanwhile: then it is read into a buffer of its own
 * (unexp_frame) and handed over when its receive is posted, so that
 * communicators used from different threads never wait on each other.
 * Frames of a split this rank left are dropped.  ABORT frames fail the
 * transport; CLOSE notices say a member left a split (comm_host_split.c).
 */
#include "comm/comm_host_internal.h"

#include <stdio.h>
#include <string.h>

#define ABORT_REASON_MAX 1024

static const char *kind_name(uint32_t k) {
    switch (k & RA_XFER_KIND_MASK) {   /* above: a split's context */
    case RA_XFER_DATA: return "sendrecv";
    case RA_XFER_BARRIER: return "barrier";
    case RA_XFER_GATHER: return "allgather";
    case RA_XFER_ALLTOALL: return "alltoall";
    case FRAME_ABORT: return "abort";
    case FRAME_CLOSE: return "close";
    default: return "unknown";
    }
}

/* Does a frame of (kind, step, nbytes, back) from `src` fit receive r
 * (same context)?  RA_OK, or RA_ERR_COMM with msg. */
static ra_status check_frame(ra_comm *c, const ra_req *r, int src,
                             uint32_t kind, int64_t step, uint64_t nbytes,
                             uint64_t back, char *msg, size_t n) {
    char pre[128];
    ra_comm_prefix(pre, sizeof pre, c->rank, r->op, r->x.step);
    if (kind != (uint32_t)r->x.kind) {
        ra_snprintf(msg, n, "%soperation mismatch: rank %d sent a %s message "
                    "while this rank expects %s", pre, src, kind_name(kind),
                    kind_name((uint32_t)r->x.kind));
        return RA_ERR_COMM;
    }
    if (step != r->x.step) {
        ra_snprintf(msg, n, "%sstep mismatch: rank %d sent step %lld, this "
                    "rank expects step %lld", pre, src, (long long)step,
                    (long long)r->x.step);
        return RA_ERR_COMM;
    }
    if (nbytes != (uint64_t)r->x.recv_nbytes) {
        ra_snprintf(msg, n, "%ssize mismatch: rank %d sends %llu bytes but "
                    "the receive buffer holds %zu bytes", pre, src,
                    (unsigned long long)nbytes, r->x.recv_nbytes);
        return RA_ERR_COMM;
    }
    if (back != NO_BACK && r->x.back_known && back != r->x.send_to_src) {
        ra_snprintf(msg, n, "%ssize mismatch: this rank sends %zu bytes to "
                    "rank %d but rank %d's receive buffer holds %llu bytes",
                    pre, r->x.send_to_src, src, src,
                    (unsigned long long)back);
        return RA_ERR_COMM;
    }
    return RA_OK;
}

/* A complete unexp_frame meets its receive r: check, copy, done. */
static ra_status deliver(ra_comm *c, int src, unexp_frame *u, ra_req *r,
                         char *msg, size_t n) {
    RA_CHECK(check_frame(c, r, src, u->kind, u->step, u->nbytes, u->back,
                         msg, n));
    if (u->nbytes > 0) memcpy(r->x.recv, u->data, (size_t)u->nbytes);
    r->received = (size_t)u->nbytes;
    ra_host_side_done(c, r, 0);
    return RA_OK;
}

/* Whether frames of `context` are wanted here: a live communicator, or
 * one not open here yet (a split in progress agreed on it, or it lies past
 * next_context), yes; a split this rank left (its copy failed, or it
 * closed it: a context below next_context with no split), no. */
static int context_wanted(ra_comm *c, host_impl *h, uint32_t context) {
    if (context == 0) return 1;
    pthread_mutex_lock(&c->mu);
    host_split *s = ra_host_find_split(h, context);
    int wanted = s != NULL ? !s->failed
                           : context >= atomic_load(&c->next_context) ||
                                 ra_comm_context_pending(c, context);
    pthread_mutex_unlock(&c->mu);
    return wanted;
}

/* The header in pe->hin is a data frame (checked): decide where its
 * payload goes.  Also re-run for a parked frame when receives change. */
ra_status ra_host_route_frame(ra_comm *c, host_impl *h, int src, char *msg,
                              size_t n) {
    host_peer *pe = &h->peers[src];
    uint32_t kind = get32(pe->hin + 4);
    int64_t step = (int64_t)get64(pe->hin + 8);
    uint64_t nbytes = get64(pe->hin + 16), back = get64(pe->hin + 24);
    uint32_t context = ra_xfer_context((int)kind);
    pe->in_left = nbytes;
    if (!context_wanted(c, h, context)) {
        pe->in = IN_DISCARD;
        return RA_OK;
    }
    ra_req *r = ra_host_rq_find(pe, context);
    if (r != NULL) {
        RA_CHECK(check_frame(c, r, src, kind, step, nbytes, back, msg, n));
        ra_host_rq_unlink(pe, r);
        pe->in_req = r;
        pe->in = IN_REQ;
        return RA_OK;
    }
    if (pe->rq_head == NULL) {         /* nobody waits on this peer */
        pe->in = IN_PARKED;
        return RA_OK;
    }
    unexp_frame *u = ra_host_calloc(sizeof *u);
    if (u != NULL && nbytes > 0) {
        u->data = nbytes <= SIZE_MAX ? ra_host_alloc((size_t)nbytes) : NULL;
        if (u->data == NULL) {
            ra_host_free(u, sizeof *u);
            u = NULL;
        }
    }
    if (u == NULL) {
        ra_snprintf(msg, n, "rank %d: cannot hold a message of %llu bytes "
                    "from rank %d until its receive is posted: out of "
                    "memory", c->rank, (unsigned long long)nbytes, src);
        return RA_ERR_NOMEM;
    }
    u->kind = kind;
    u->step = step;
    u->nbytes = nbytes;
    u->back = back;
    if (pe->ux_tail) pe->ux_tail->next = u;
    else pe->ux_head = u;
    pe->ux_tail = u;
    pe->in_unexp = u;
    pe->in = IN_UNEXP;
    return RA_OK;
}

/* Read a peer's ABORT reason (small; sent in one piece) for the message:
 * at most `keep` bytes of it, cut on a UTF-8 character boundary (other
 * bytes a peer sends stay: the Python boundary decodes with replacement). */
static void read_abort_reason(int fd, uint64_t n, char *out, size_t outlen,
                              size_t keep) {
    char buf[ABORT_REASON_MAX + 1];
    if (n > ABORT_REASON_MAX) n = ABORT_REASON_MAX;
    int err;
    if (ra_host_io_all(fd, buf, (size_t)n, 0, ra_now() + 1.0, &err) != IO_OK)
        n = 0;
    buf[n] = '\0';
    if (strlen(buf) > keep) buf[ra_utf8_cut(buf, keep)] = '\0';
    ra_snprintf(out, outlen, "%s", n ? buf : "(no reason given)");
}

/* A whole frame arrived from `src`. */
ra_status ra_host_frame_done(ra_comm *c, host_impl *h, int src, char *msg,
                             size_t n) {
    host_peer *pe = &h->peers[src];
    in_state was = pe->in;
    ra_req *r = pe->in_req;
    unexp_frame *u = pe->in_unexp;
    pe->in = IN_HEADER;
    pe->hin_got = 0;
    pe->in_req = NULL;
    pe->in_unexp = NULL;
    if (was == IN_REQ) {
        ra_host_side_done(c, r, 0);
    } else if (was == IN_NOTICE) {
        uint64_t len = get64(pe->hin + 16);
        pe->notice_in[len] = '\0';
        uint32_t context = ra_xfer_context((int)get32(pe->hin + 4));
        return ra_host_peer_left(c, h, src, context, 0, pe->notice_in);
    } else if (was == IN_UNEXP) {
        /* a receive of its context may have been posted meanwhile */
        ra_req *q = ra_host_rq_find(pe, ra_xfer_context((int)u->kind));
        if (q == NULL) return RA_OK;
        ra_host_rq_unlink(pe, q);
        unexp_frame **link = &pe->ux_head, *last = NULL;
        while (*link != u) {
            last = *link;
            link = &(*link)->next;
        }
        *link = u->next;
        if (pe->ux_tail == u) pe->ux_tail = last;
        ra_status st = deliver(c, src, u, q, msg, n);
        ra_host_unexp_free(u);
        return st;
    }
    return RA_OK;
}

/* A whole header arrived from `src`. */
ra_status ra_host_header_done(ra_comm *c, host_impl *h, int src, char *msg,
                              size_t n) {
    host_peer *pe = &h->peers[src];
    uint32_t magic = get32(pe->hin), kind = get32(pe->hin + 4);
    uint64_t nbytes = get64(pe->hin + 16);
    uint32_t low = kind & RA_XFER_KIND_MASK;
    char pre[128];
    ra_host_peer_prefix(c, pe, pre, sizeof pre);
    if (magic != FRAME_MAGIC ||
        (kind == FRAME_ABORT ? 0
         : low == FRAME_CLOSE ? nbytes >= RA_COMM_MSG_LEN
                              : low < RA_XFER_DATA || low > RA_XFER_ALLTOALL)) {
        ra_snprintf(msg, n, "%scorrupt frame from rank %d (bad %s)", pre, src,
                    magic != FRAME_MAGIC ? "magic" : "kind");
        return RA_ERR_COMM;
    }
    if (kind == FRAME_ABORT) {
        char why[ABORT_REASON_MAX + 1];
        read_abort_reason(pe->fd, nbytes, why, sizeof why, 360);
        pe->broken = 1;
        ra_snprintf(msg, n, "%speer rank %d failed: %s", pre, src, why);
        return RA_ERR_COMM;
    }
    if (low == FRAME_CLOSE) {
        if (nbytes == 0) {     /* it closed the split */
            pe->hin_got = 0;
            return ra_host_peer_left(c, h, src, ra_xfer_context((int)kind), 1,
                                     "");
        }
        pe->in = IN_NOTICE;    /* its copy failed: why follows */
        pe->in_left = nbytes;
        return RA_OK;
    }
    return ra_host_route_frame(c, h, src, msg, n);
}

/* ---- receives ----------------------------------------------------------- */

ra_status ra_host_post_recv(ra_comm *c, host_impl *h, ra_req *r, char *msg,
                            size_t n) {
    host_peer *pe = &h->peers[r->x.src];
    uint32_t context = ra_xfer_context(r->x.kind);
    if (ra_host_rq_find(pe, context) == NULL) {
        /* the oldest whole frame of its context that nobody took */
        unexp_frame **link = &pe->ux_head, *last = NULL;
        for (; *link != NULL; last = *link, link = &(*link)->next) {
            unexp_frame *u = *link;
            if (ra_xfer_context((int)u->kind) != context) continue;
            if (u->got < u->nbytes || pe->in_unexp == u) break;  /* arriving */
            *link = u->next;
            if (pe->ux_tail == u) pe->ux_tail = last;
            ra_status st = deliver(c, r->x.src, u, r, msg, n);
            ra_host_unexp_free(u);
            return st;
        }
    }
    /* its sender left the split: nothing more comes (its last frames came
     * before its notice) */
    ra_status st;
    if (ra_host_recv_refuse(c, h, r, &st)) {
        if (st != RA_OK)
            ra_snprintf(msg, n, "rank %d: leaving a communicator: out of "
                        "memory", c->rank);
        return st;
    }
    ra_host_rq_push(pe, r);    /* a parked frame finds it in route_frame */
    return RA_OK;
}
