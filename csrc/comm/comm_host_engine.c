/*
 * comm_host_engine.c -- the "host" backend's progress thread: every
 * transfer of one TCP transport (its own communicator's and its splits')
 * moves here, with non-blocking sockets and poll, many at once.
 *
 * Out: each connection sends one frame at a time (comm_host_internal.h):
 * first the CLOSE notices of splits this rank left, then the sends in the
 * order they were started.  A send never waits for its receiver, so a ring
 * where everybody sends first never deadlocks.
 *
 * In: every connection is read as frames arrive (a peer's ABORT is seen at
 * once, also between operations); comm_host_match.c says where a frame
 * goes, comm_host_split.c what leaving a split does.  A request that fails
 * alone (its split closed) is taken out of the thread's hands at once: a
 * send half-way through its frame finishes from a copy (the stream stays
 * whole and the caller's buffer is free), a receive half-way through
 * drops the rest.
 *
 * A peer that closes its connection between operations (nothing of ours
 * needs it: no frame half read, no receive posted, no send of ours queued
 * or on the wire) has left: its connection is marked gone and CLOSE
 * notices still for it are dropped, so a rank that finished first and
 * exited does not fail the others; an operation that needs it later fails.
 * Its last frame may be parked here, whole in the kernel's buffer, when
 * its end closes (or resets, answering a notice of ours): then only the
 * way out is gone, and the frame is read when its receive comes.
 * A failure (a mismatch, a dead connection, a peer's ABORT, a deadline the
 * waiter saw pass) fails the communicator: every request fails with the
 * first error, every peer whose stream is between frames gets an ABORT
 * frame with it, and every socket is shut down, so the failure and its
 * cause reach the other ranks at once.  close() stops the thread the same
 * way ("communicator is closed"), without the ABORT frames.
 */
#define _GNU_SOURCE
#include "comm/comm_host_internal.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

void ra_host_wake(host_impl *h) {
    char b = 1;
    if (h->wake[1] >= 0) {
        ssize_t rc = write(h->wake[1], &b, 1);
        (void)rc;
    }
}

/* ---- request bookkeeping (progress thread) ------------------------------ */

/* "rank R: op step S: " of an operation that exchanges with `peer` (the
 * one a connection error interrupts), or "rank R: ". */
void ra_host_peer_prefix(ra_comm *c, const host_peer *pe, char *pre,
                         size_t n) {
    const ra_req *r = pe->in_req ? pe->in_req : pe->rq_head ? pe->rq_head
                      : pe->out_req ? pe->out_req : pe->sq_head;
    if (r != NULL) ra_comm_prefix(pre, n, c->rank, r->op, r->x.step);
    else ra_snprintf(pre, n, "rank %d: ", c->rank);
}

static void finish(ra_comm *c, ra_req *r, ra_status st, const char *msg) {
    pthread_mutex_lock(&c->mu);
    ra_req_finish_locked(r, st, msg);
    pthread_mutex_unlock(&c->mu);
    ra_req_release(r);                 /* the backend's reference */
}

/* One side of r is done; the request finishes with its last side. */
void ra_host_side_done(ra_comm *c, ra_req *r, int send) {
    pthread_mutex_lock(&c->mu);
    if (send) r->send_done = 1;
    else r->recv_done = 1;
    int both = r->send_done && r->recv_done;
    if (both) ra_req_finish_locked(r, RA_OK, NULL);
    pthread_mutex_unlock(&c->mu);
    if (both) ra_req_release(r);
}

void ra_host_unexp_free(unexp_frame *u) {
    if (u == NULL) return;
    if (u->data != NULL) ra_host_free(u->data, (size_t)u->nbytes);
    ra_host_free(u, sizeof *u);
}

/* Take r out of the thread's hands and fail it.  A frame half-way through
 * goes on without r: the rest of its payload from a copy (out), or into
 * the sink (in).  Returns RA_ERR_NOMEM when the copy cannot be made (the
 * caller fails the transport: the stream cannot be finished). */
ra_status ra_host_drop_req(ra_comm *c, host_impl *h, ra_req *r,
                           const char *msg, int ctx_closed) {
    if (!r->send_done && r->x.dst >= 0) {
        host_peer *pe = &h->peers[r->x.dst];
        if (pe->out_req == r && pe->hout_sent == 0) {
            pe->out_active = 0;   /* not started: the peer never sees it */
            pe->out_req = NULL;
        } else if (pe->out_req == r) {
            if (pe->out_left > 0) {
                unsigned char *copy = ra_host_alloc((size_t)pe->out_left);
                if (copy == NULL) return RA_ERR_NOMEM;
                memcpy(copy, pe->out_data, (size_t)pe->out_left);
                pe->out_copy = copy;
                pe->out_copy_bytes = (size_t)pe->out_left;
                pe->out_data = copy;
            }
            pe->out_req = NULL;
        } else {
            ra_host_sq_unlink(pe, r);
        }
    }
    if (!r->recv_done && r->x.src >= 0) {
        host_peer *pe = &h->peers[r->x.src];
        if (pe->in_req == r) {
            pe->in_req = NULL;
            pe->in = IN_DISCARD;
        } else {
            ra_host_rq_unlink(pe, r);
        }
    }
    r->ctx_closed = ctx_closed;
    finish(c, r, RA_ERR_COMM, msg);
    return RA_OK;
}

/* Every request the thread holds of `context` (all when context is
 * UINT32_MAX), failed with "<its prefix>why" or `why` as it is (verbatim),
 * and the frames of that context that nobody took. */
ra_status ra_host_drop_context(ra_comm *c, host_impl *h, uint32_t context,
                               const char *why, int verbatim,
                               int ctx_closed) {
    for (;;) {
        ra_req *r = NULL;
        for (int i = 0; i < c->size && r == NULL; i++)
            r = ra_host_peer_req(&h->peers[i], context);
        if (r == NULL) break;
        char pre[128], msg[RA_COMM_MSG_LEN];
        ra_comm_prefix(pre, sizeof pre, c->rank, r->op, r->x.step);
        ra_snprintf(msg, sizeof msg, "%s%s", verbatim ? "" : pre, why);
        RA_CHECK(ra_host_drop_req(c, h, r, msg, ctx_closed));
    }
    for (int i = 0; i < c->size; i++) {
        host_peer *pe = &h->peers[i];
        unexp_frame **link = &pe->ux_head, *last = NULL;
        while (*link != NULL) {
            unexp_frame *u = *link;
            if (context != UINT32_MAX &&
                ra_xfer_context((int)u->kind) != context) {
                last = u;
                link = &u->next;
                continue;
            }
            *link = u->next;
            if (pe->in_unexp == u) {   /* still arriving: drop the rest */
                pe->in_unexp = NULL;
                pe->in = IN_DISCARD;
            }
            ra_host_unexp_free(u);
        }
        pe->ux_tail = last;
    }
    return RA_OK;
}

/* ---- the sockets -------------------------------------------------------- */

/* The connection to `peer` is gone (why: NULL when the peer closed it):
 * the error of the operation that needed it. */
static ra_status connection_lost(ra_comm *c, host_peer *pe, int peer,
                                 const char *why, char *msg, size_t n) {
    char pre[128];
    pe->broken = 1;
    ra_host_peer_prefix(c, pe, pre, sizeof pre);
    if (why == NULL)
        ra_snprintf(msg, n, "%speer rank %d closed the connection", pre, peer);
    else
        ra_snprintf(msg, n, "%sconnection to rank %d failed: %s", pre, peer,
                    why);
    return RA_ERR_COMM;
}

/* Something of ours needs what `pe` sends: a frame half read or parked, a
 * receive posted. */
static int in_busy(const host_peer *pe) {
    return pe->in != IN_HEADER || pe->hin_got > 0 || pe->rq_head != NULL;
}

/* Something of ours is for `pe`: a send queued or on the wire.  CLOSE
 * notices of splits this rank left do not count: a peer that closed its
 * connection has left every communicator of the transport, so they are
 * moot there. */
static int out_busy(const host_peer *pe) {
    return pe->sq_head != NULL || (pe->out_active && pe->out_req != NULL);
}

static int peer_busy(const host_peer *pe) {
    return in_busy(pe) || out_busy(pe);
}

static void out_frame_done(ra_comm *c, host_peer *pe);

/* The peer closed its end, and nothing of ours was for it: the notices
 * still for it (one may be half sent) are dropped, and nothing more is
 * sent.  What it sent before stays readable: its last frame may be parked
 * here, whole in the kernel's buffer, for a receive posted later. */
static void out_gone(ra_comm *c, host_peer *pe) {
    pe->out_gone = 1;
    if (pe->out_active) out_frame_done(c, pe);
    ra_host_notices_free(pe->notices);
    pe->notices = NULL;
}

/* The peer closed its connection between operations: it is gone for good. */
static void peer_left(ra_comm *c, host_peer *pe) {
    out_gone(c, pe);
    pe->broken = 1;
}

/* Read what `src` sent.  RA_OK (progress, or it would block) or an error
 * with msg. */
static ra_status pump_in(ra_comm *c, host_impl *h, int src, char *msg,
                         size_t n) {
    host_peer *pe = &h->peers[src];
    for (;;) {
        if (pe->in == IN_PARKED || pe->broken) return RA_OK;
        if (pe->in != IN_HEADER && pe->in_left == 0) {
            RA_CHECK(ra_host_frame_done(c, h, src, msg, n));
            continue;
        }
        void *buf;
        size_t want;
        if (pe->in == IN_HEADER) {
            buf = pe->hin + pe->hin_got;
            want = FRAME_HDR - pe->hin_got;
        } else {
            want = pe->in_left > IO_CHUNK ? IO_CHUNK : (size_t)pe->in_left;
            if (pe->in == IN_REQ) {
                buf = (char *)pe->in_req->x.recv + pe->in_req->received;
            } else if (pe->in == IN_UNEXP) {
                buf = pe->in_unexp->data + pe->in_unexp->got;
            } else if (pe->in == IN_NOTICE) {
                buf = pe->notice_in + (get64(pe->hin + 16) - pe->in_left);
            } else {
                buf = h->sink;
                if (want > SINK_BYTES) want = SINK_BYTES;
            }
        }
        ssize_t k = recv(pe->fd, buf, want, MSG_DONTWAIT);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return RA_OK;
        if (k <= 0) {
            int eof = k == 0 || errno == ECONNRESET;
            const char *why = eof ? NULL : strerror(errno);
            if (!peer_busy(pe)) {          /* it left between operations */
                peer_left(c, pe);
                return RA_OK;
            }
            return connection_lost(c, pe, src, why, msg, n);
        }
        if (pe->in == IN_HEADER) {
            pe->hin_got += (size_t)k;
            if (pe->hin_got == FRAME_HDR)
                RA_CHECK(ra_host_header_done(c, h, src, msg, n));
            continue;
        }
        pe->in_left -= (uint64_t)k;
        if (pe->in == IN_REQ) pe->in_req->received += (size_t)k;
        else if (pe->in == IN_UNEXP) pe->in_unexp->got += (uint64_t)k;
        atomic_fetch_add(&c->bytes_received, (uint64_t)k);
    }
}

/* Start the next frame to `dst`, if there is one: 1 when started. */
static int next_frame(host_peer *pe) {
    uint32_t kind;
    int64_t step = 0;
    uint64_t nbytes = 0, back = NO_BACK;
    if (pe->notices != NULL) {
        host_notice *t = pe->notices;
        pe->notices = t->next;
        kind = FRAME_CLOSE | (t->context << RA_XFER_KIND_BITS);
        nbytes = t->why_bytes;
        pe->out_req = NULL;
        pe->out_copy = (unsigned char *)t->why;   /* freed with the frame */
        pe->out_copy_bytes = t->why_bytes;
        pe->out_data = pe->out_copy;
        ra_host_free(t, sizeof *t);
    } else if (pe->sq_head != NULL) {
        ra_req *r = pe->sq_head;
        pe->sq_head = r->next;
        if (pe->sq_head == NULL) pe->sq_tail = NULL;
        kind = (uint32_t)r->x.kind;
        step = r->x.step;
        nbytes = r->x.send_nbytes;
        if (r->x.back_known) back = r->x.recv_from_dst;
        pe->out_req = r;
        pe->out_data = r->x.send;
    } else {
        return 0;
    }
    put32(pe->hout, FRAME_MAGIC);
    put32(pe->hout + 4, kind);
    put64(pe->hout + 8, (uint64_t)step);
    put64(pe->hout + 16, nbytes);
    put64(pe->hout + 24, back);
    pe->hout_sent = 0;
    pe->out_left = nbytes;
    pe->out_active = 1;
    return 1;
}

static void out_frame_done(ra_comm *c, host_peer *pe) {
    ra_req *r = pe->out_req;
    pe->out_active = 0;
    pe->out_req = NULL;
    pe->out_data = NULL;
    if (pe->out_copy != NULL) {
        ra_host_free(pe->out_copy, pe->out_copy_bytes);
        pe->out_copy = NULL;
    }
    if (r != NULL) {
        atomic_fetch_add(&c->messages, 1);
        ra_host_side_done(c, r, 1);
    }
}

/* Send what waits for `dst` until the socket is full. */
static ra_status pump_out(ra_comm *c, host_impl *h, int dst, char *msg,
                          size_t n) {
    host_peer *pe = &h->peers[dst];
    for (;;) {
        if (ra_host_out_closed(pe)) return RA_OK;
        if (!pe->out_active && !next_frame(pe)) return RA_OK;
        ssize_t k;
        int in_hdr = pe->hout_sent < FRAME_HDR;
        if (in_hdr) {
            k = send(pe->fd, pe->hout + pe->hout_sent,
                     FRAME_HDR - pe->hout_sent, MSG_NOSIGNAL | MSG_DONTWAIT);
        } else if (pe->out_left > 0) {
            size_t want = pe->out_left > IO_CHUNK ? IO_CHUNK
                                                  : (size_t)pe->out_left;
            k = send(pe->fd, pe->out_data, want, MSG_NOSIGNAL | MSG_DONTWAIT);
        } else {
            out_frame_done(c, pe);
            continue;
        }
        if (k < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return RA_OK;
            int closed = errno == EPIPE || errno == ECONNRESET;
            if (closed && !out_busy(pe)) {     /* only a notice was for it */
                if (in_busy(pe)) out_gone(c, pe);
                else peer_left(c, pe);
                return RA_OK;
            }
            return connection_lost(c, pe, dst, closed ? NULL : strerror(errno),
                                   msg, n);
        }
        if (in_hdr) {
            pe->hout_sent += (size_t)k;
        } else {
            pe->out_data += k;
            pe->out_left -= (uint64_t)k;
            if (pe->out_req != NULL) pe->out_req->sent += (size_t)k;
            atomic_fetch_add(&c->bytes_sent, (uint64_t)k);
        }
    }
}

/* ---- work from the callers ---------------------------------------------- */

/* A started request: its send in line for its peer, its receive matched
 * with a frame that already came, or posted. */
static void fail_later(host_impl *h, ra_req *r) {
    r->next = h->failing;      /* failed with the transport */
    h->failing = r;
}

static ra_status take_request(ra_comm *c, host_impl *h, ra_req *r, char *msg,
                              size_t n) {
    int bad = r->x.dst >= 0 && ra_host_out_closed(&h->peers[r->x.dst]) ? r->x.dst
              : r->x.src >= 0 && h->peers[r->x.src].broken ? r->x.src : -1;
    if (bad >= 0) {
        char pre[128];
        ra_comm_prefix(pre, sizeof pre, c->rank, r->op, r->x.step);
        ra_snprintf(msg, n, "%speer rank %d closed the connection", pre, bad);
        fail_later(h, r);
        return RA_ERR_COMM;
    }
    if (r->x.dst >= 0) ra_host_sq_push(&h->peers[r->x.dst], r);
    if (r->x.src < 0) return RA_OK;
    ra_status st = ra_host_post_recv(c, h, r, msg, n);
    /* failed: in line for its peer (failed there), or here */
    if (st != RA_OK && r->x.dst < 0) fail_later(h, r);
    return st;
}

/* ---- failure ------------------------------------------------------------ */

/* After a failure: tell every reachable peer why, then shut all sockets. */
static void handle_failure(ra_comm *c, host_impl *h) {
    if (h->failure_handled) return;
    h->failure_handled = 1;
    char reason[RA_COMM_MSG_LEN];
    pthread_mutex_lock(&c->mu);
    ra_snprintf(reason, sizeof reason, "%s", c->fail_msg);
    pthread_mutex_unlock(&c->mu);
    size_t n = strlen(reason);
    unsigned char frame[FRAME_HDR + RA_COMM_MSG_LEN];
    put32(frame, FRAME_MAGIC);
    put32(frame + 4, FRAME_ABORT);
    put64(frame + 8, (uint64_t)(int64_t)-1);
    put64(frame + 16, n);
    put64(frame + 24, NO_BACK);
    memcpy(frame + FRAME_HDR, reason, n);
    for (int i = 0; i < c->size; i++) {
        host_peer *pe = &h->peers[i];
        if (pe->fd < 0) continue;
        int midframe = pe->out_active && pe->hout_sent > 0;
        if (!midframe && !ra_host_out_closed(pe)) {
            ssize_t rc = send(pe->fd, frame, FRAME_HDR + n,
                              MSG_NOSIGNAL | MSG_DONTWAIT);
            (void)rc;
        }
        shutdown(pe->fd, SHUT_RDWR);
    }
}

/* Stopped or failed: every request fails; a failure is told to the peers. */
static void wind_down(ra_comm *c, host_impl *h, ra_req *submitted,
                      host_leave *leaving) {
    int failed = atomic_load(&c->failed);
    char why[RA_COMM_MSG_LEN];
    pthread_mutex_lock(&c->mu);
    ra_snprintf(why, sizeof why, "%s", failed ? c->fail_msg : "");
    pthread_mutex_unlock(&c->mu);
    ra_req *lists[2] = {submitted, h->failing};
    h->failing = NULL;
    for (int k = 0; k < 2; k++)
        for (ra_req *r = lists[k]; r != NULL;) {
            ra_req *next = r->next;
            char pre[128], msg[RA_COMM_MSG_LEN];
            ra_comm_prefix(pre, sizeof pre, c->rank, r->op, r->x.step);
            ra_snprintf(msg, sizeof msg, "%s%s", failed ? "" : pre,
                        failed ? why : "communicator is closed");
            finish(c, r, RA_ERR_COMM, msg);
            r = next;
        }
    ra_host_leaving_free(leaving);
    /* no frame continues: the streams end here */
    for (int i = 0; i < c->size; i++) {
        host_peer *pe = &h->peers[i];
        if (pe->out_req != NULL) {
            ra_host_sq_push(pe, pe->out_req);   /* failed below with the rest */
            pe->out_req = NULL;
        }
        if (pe->in_req != NULL) {
            ra_host_rq_push(pe, pe->in_req);
            pe->in_req = NULL;
        }
        pe->in = IN_DISCARD;
    }
    for (;;) {
        ra_req *r = NULL;
        for (int i = 0; i < c->size && r == NULL; i++)
            r = h->peers[i].sq_head ? h->peers[i].sq_head
                                    : h->peers[i].rq_head;
        if (r == NULL) break;
        for (int i = 0; i < c->size; i++) {
            ra_host_sq_unlink(&h->peers[i], r);
            ra_host_rq_unlink(&h->peers[i], r);
        }
        char pre[128], msg[RA_COMM_MSG_LEN];
        ra_comm_prefix(pre, sizeof pre, c->rank, r->op, r->x.step);
        ra_snprintf(msg, sizeof msg, "%s%s", failed ? "" : pre,
                    failed ? why : "communicator is closed");
        finish(c, r, RA_ERR_COMM, msg);
    }
    if (failed) handle_failure(c, h);
}

/* ---- the thread --------------------------------------------------------- */

static ra_status one_round(ra_comm *c, host_impl *h, ra_req *submitted,
                           host_leave *leaving, struct pollfd *pfd,
                           int *who, char *msg, size_t n) {
    ra_status st = RA_OK;
    for (ra_req *r = submitted; r != NULL;) {
        ra_req *next = r->next;
        if (st == RA_OK) st = take_request(c, h, r, msg, n);
        else fail_later(h, r);
        r = next;
    }
    for (host_leave *k = leaving; k != NULL && st == RA_OK; k = k->next) {
        st = ra_host_leave(c, h, k);
        if (st == RA_ERR_NOMEM)
            ra_snprintf(msg, n, "rank %d: leaving a communicator: out of "
                        "memory", c->rank);
    }
    ra_host_leaving_free(leaving);
    RA_CHECK(st);
    /* parked frames: a receive from their sender may be posted now (read
     * what is there at once: an empty payload gets no more POLLIN) */
    for (int i = 0; i < c->size; i++) {
        if (h->peers[i].in != IN_PARKED) continue;
        RA_CHECK(ra_host_route_frame(c, h, i, msg, n));
        RA_CHECK(pump_in(c, h, i, msg, n));
    }
    int np = 0;
    pfd[np++] = (struct pollfd){h->wake[0], POLLIN, 0};
    for (int i = 0; i < c->size; i++) {
        host_peer *pe = &h->peers[i];
        if (pe->fd < 0 || pe->broken) continue;
        /* a parked frame of a peer that closed its end waits for its
         * receive, unpolled (its socket would report the hang-up at once,
         * again and again) */
        if (pe->in == IN_PARKED && pe->out_gone) continue;
        short ev = pe->in == IN_PARKED ? 0 : POLLIN;
        if (!pe->out_gone &&
            (pe->out_active || pe->notices != NULL || pe->sq_head != NULL))
            ev |= POLLOUT;
        who[np] = i;
        pfd[np++] = (struct pollfd){pe->fd, ev, 0};
    }
    for (int i = 0; i < c->size; i++) {
        host_peer *pe = &h->peers[i];
        int64_t ctx = pe->in == IN_PARKED
                          ? (int64_t)ra_xfer_context((int)get32(pe->hin + 4))
                      : pe->ux_head ? (int64_t)ra_xfer_context(
                                          (int)pe->ux_head->kind)
                                    : -1;
        atomic_store(&pe->untaken, ctx);
    }
    int rc = poll(pfd, (nfds_t)np, 1000);
    if (rc < 0) {
        if (errno == EINTR) return RA_OK;
        ra_snprintf(msg, n, "rank %d: poll failed: %s", c->rank,
                    strerror(errno));
        return RA_ERR_COMM;
    }
    if (pfd[0].revents) {
        char drain[64];
        while (read(h->wake[0], drain, sizeof drain) > 0) {
        }
    }
    for (int k = 1; k < np; k++) {
        if (pfd[k].revents == 0) continue;
        int i = who[k];
        host_peer *pe = &h->peers[i];
        if (pe->in == IN_PARKED && (pfd[k].revents & (POLLHUP | POLLERR))) {
            /* the peer closed its end after its last frame: that frame
             * is still read when its receive comes (and fails then if it
             * came short); a send of ours for the peer fails now */
            if (out_busy(pe)) return connection_lost(c, pe, i, NULL, msg, n);
            out_gone(c, pe);
            continue;
        }
        if (pfd[k].revents & (POLLIN | POLLHUP | POLLERR))
            RA_CHECK(pump_in(c, h, i, msg, n));
        if (pfd[k].revents & (POLLOUT | POLLERR))
            RA_CHECK(pump_out(c, h, i, msg, n));
    }
    return RA_OK;
}

void *ra_host_progress(void *arg) {
    ra_comm *c = arg;
    host_impl *h = c->impl;
    char msg[RA_COMM_MSG_LEN];
    struct pollfd *pfd = ra_host_alloc(sizeof *pfd * (size_t)(c->size + 1));
    int *who = ra_host_alloc(sizeof(int) * (size_t)(c->size + 1));
    if (pfd == NULL || who == NULL)
        ra_comm_fail(c, RA_ERR_NOMEM, "host transport: out of memory");
    for (;;) {
        pthread_mutex_lock(&c->mu);
        ra_req *submitted = h->submit_head;
        host_leave *leaving = h->leaving;
        h->submit_head = h->submit_tail = NULL;
        h->leaving = NULL;
        int stop = h->stop, failed = atomic_load(&c->failed);
        pthread_mutex_unlock(&c->mu);
        if (stop || failed) {
            wind_down(c, h, submitted, leaving);
            pthread_mutex_lock(&c->mu);
            /* nothing runs any more (starts fail at once): wait for close */
            while (!h->stop) pthread_cond_wait(&h->qcv, &c->mu);
            int late = h->submit_head != NULL || h->leaving != NULL;
            pthread_mutex_unlock(&c->mu);
            if (!late) break;
            continue;             /* started before the failure: fail them */
        }
        /* leaving list came newest first: oldest first is clearer */
        host_leave *ordered = NULL;
        while (leaving != NULL) {
            host_leave *next = leaving->next;
            leaving->next = ordered;
            ordered = leaving;
            leaving = next;
        }
        ra_status st = one_round(c, h, submitted, ordered, pfd, who, msg,
                                 sizeof msg);
        if (st != RA_OK) ra_comm_fail(c, st, msg);
    }
    ra_host_free(pfd, sizeof *pfd * (size_t)(c->size + 1));
    ra_host_free(who, sizeof(int) * (size_t)(c->size + 1));
    return NULL;
}

void ra_host_engine_free(ra_comm *c) {
    host_impl *h = c->impl;
    ra_host_leaving_free(h->leaving);
    h->leaving = NULL;
    while (h->splits != NULL) {
        host_split *s = h->splits;
        h->splits = s->next;
        ra_host_split_free(s);
    }
    for (int i = 0; i < c->size; i++) {
        host_peer *pe = &h->peers[i];
        while (pe->ux_head != NULL) {
            unexp_frame *u = pe->ux_head;
            pe->ux_head = u->next;
            ra_host_unexp_free(u);
        }
        if (pe->out_copy != NULL)
            ra_host_free(pe->out_copy, pe->out_copy_bytes);
        ra_host_notices_free(pe->notices);
    }
}
