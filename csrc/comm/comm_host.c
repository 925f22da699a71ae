/*
 * comm_host.c -- the "host" backend: TCP sockets between CPU ranks.
 *
 * Bootstrap: comm_host_boot.c joins the ranks into an authenticated full
 * mesh (one socket per peer) before this file's progress thread starts.
 *
 * Data: one progress thread per communicator runs the requests of a FIFO
 * queue, one at a time, each moving its send and its receive at once with
 * non-blocking sockets and poll, so a ring where everybody sends first
 * never deadlocks whatever the size.  A frame is a 24-byte header (magic,
 * kind, step, nbytes) followed by nbytes of payload streamed in bounded
 * chunks; the receiver checks kind, step and size against its own request
 * before reading any payload.  When the communicator fails, the progress
 * thread sends an ABORT frame carrying the first error to every peer whose
 * outgoing stream is between frames, then shuts every socket down, so the
 * failure and its cause reach the other ranks at once.
 */
#define _GNU_SOURCE
#include "comm/comm_host_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define FRAME_MAGIC 0x52414631u      /* "RAF1" */
#define FRAME_HDR 24
#define FRAME_ABORT 9                /* kind: the sender failed */
#define IO_CHUNK ((size_t)4 << 20)   /* bytes per send()/recv() call */
#define ABORT_REASON_MAX 1024

typedef struct host_impl {
    int *fds;                 /* per rank; -1 for self */
    int *out_midframe;        /* our stream to rank i is inside a frame */
    int *broken;              /* connection known dead */
    int wake[2];              /* pipe: wakes the progress thread's poll */
    pthread_t thread;
    int thread_started;
    pthread_cond_t qcv;       /* progress thread waits for work (c->mu) */
    ra_req *head, *tail;      /* queue, under c->mu */
    int stop;                 /* under c->mu */
    int failure_handled;      /* progress thread only */
} host_impl;

/* ---- progress thread --------------------------------------------------- */

static void wake_thread(host_impl *h) {
    char b = 1;
    if (h->wake[1] >= 0) {
        ssize_t rc = write(h->wake[1], &b, 1);
        (void)rc;
    }
}

static const char *kind_name(uint32_t k) {
    if (k == FRAME_ABORT) return "abort";
    switch (k & RA_XFER_KIND_MASK) {   /* above: a split's context */
    case RA_XFER_DATA: return "sendrecv";
    case RA_XFER_BARRIER: return "barrier";
    case RA_XFER_GATHER: return "allgather";
    case RA_XFER_ALLTOALL: return "alltoall";
    default: return "unknown";
    }
}

typedef struct xfer_state {
    unsigned char hout[FRAME_HDR];
    size_t hout_sent;
    unsigned char hin[FRAME_HDR];
    size_t hin_got;
} xfer_state;

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

/* One step of the receive side.  Returns RA_OK (progress or would block)
 * or an error with `msg` filled. */
static ra_status recv_some(ra_comm *c, host_impl *h, ra_req *r,
                           xfer_state *xs, const char *pre, char *msg,
                           size_t mlen) {
    int src = r->x.src, fd = h->fds[src];
    for (;;) {
        ssize_t k;
        if (xs->hin_got < FRAME_HDR) {
            k = recv(fd, xs->hin + xs->hin_got, FRAME_HDR - xs->hin_got,
                     MSG_DONTWAIT);
        } else {
            size_t left = r->x.recv_nbytes - r->received;
            if (left == 0) break;
            if (left > IO_CHUNK) left = IO_CHUNK;
            k = recv(fd, (char *)r->x.recv + r->received, left, MSG_DONTWAIT);
        }
        if (k == 0) {
            h->broken[src] = 1;
            ra_snprintf(msg, mlen, "%speer rank %d closed the connection", pre,
                        src);
            return RA_ERR_COMM;
        }
        if (k < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return RA_OK;
            h->broken[src] = 1;
            if (errno == ECONNRESET)
                ra_snprintf(msg, mlen, "%speer rank %d closed the connection",
                            pre, src);
            else
                ra_snprintf(msg, mlen, "%sconnection to rank %d failed: %s",
                            pre, src, strerror(errno));
            return RA_ERR_COMM;
        }
        if (xs->hin_got < FRAME_HDR) {
            xs->hin_got += (size_t)k;
            if (xs->hin_got < FRAME_HDR) continue;
            uint32_t magic = get32(xs->hin), kind = get32(xs->hin + 4);
            int64_t step = (int64_t)get64(xs->hin + 8);
            uint64_t n = get64(xs->hin + 16);
            if (magic != FRAME_MAGIC) {
                ra_snprintf(msg, mlen,
                            "%scorrupt frame from rank %d (bad magic)", pre,
                            src);
                return RA_ERR_COMM;
            }
            if (kind == FRAME_ABORT) {
                char why[ABORT_REASON_MAX + 1];
                read_abort_reason(fd, n, why, sizeof why, 360);
                h->broken[src] = 1;
                ra_snprintf(msg, mlen, "%speer rank %d failed: %s", pre, src,
                            why);
                return RA_ERR_COMM;
            }
            if (kind != (uint32_t)r->x.kind &&
                (kind & RA_XFER_KIND_MASK) ==
                    ((uint32_t)r->x.kind & RA_XFER_KIND_MASK)) {
                ra_snprintf(msg, mlen,
                         "%scommunicator mismatch: rank %d sent a %s message "
                         "of another communicator (context %u, this one "
                         "%u)", pre, src, kind_name(kind),
                         kind >> RA_XFER_KIND_BITS,
                         (uint32_t)r->x.kind >> RA_XFER_KIND_BITS);
                return RA_ERR_COMM;
            }
            if (kind != (uint32_t)r->x.kind) {
                ra_snprintf(msg, mlen,
                            "%soperation mismatch: rank %d sent a %s message "
                            "while this rank expects %s", pre, src,
                            kind_name(kind), kind_name((uint32_t)r->x.kind));
                return RA_ERR_COMM;
            }
            if (step != r->x.step) {
                ra_snprintf(msg, mlen,
                            "%sstep mismatch: rank %d sent step %lld, this "
                            "rank expects step %lld", pre, src, (long long)step,
                            (long long)r->x.step);
                return RA_ERR_COMM;
            }
            if (n != (uint64_t)r->x.recv_nbytes) {
                ra_snprintf(msg, mlen,
                            "%ssize mismatch: rank %d sends %llu bytes but the "
                            "receive buffer holds %zu bytes", pre, src,
                            (unsigned long long)n, r->x.recv_nbytes);
                return RA_ERR_COMM;
            }
        } else {
            r->received += (size_t)k;
            atomic_fetch_add(&c->bytes_received, (uint64_t)k);
        }
    }
    return RA_OK;
}

static ra_status send_some(ra_comm *c, host_impl *h, ra_req *r,
                           xfer_state *xs, const char *pre, char *msg,
                           size_t mlen) {
    int dst = r->x.dst, fd = h->fds[dst];
    for (;;) {
        ssize_t k;
        int in_hdr = xs->hout_sent < FRAME_HDR;
        if (in_hdr) {
            k = send(fd, xs->hout + xs->hout_sent, FRAME_HDR - xs->hout_sent,
                     MSG_NOSIGNAL | MSG_DONTWAIT);
        } else {
            size_t left = r->x.send_nbytes - r->sent;
            if (left == 0) break;
            if (left > IO_CHUNK) left = IO_CHUNK;
            k = send(fd, (const char *)r->x.send + r->sent, left,
                     MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        if (k < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return RA_OK;
            h->broken[dst] = 1;
            if (errno == EPIPE || errno == ECONNRESET)
                ra_snprintf(msg, mlen, "%speer rank %d closed the connection",
                            pre, dst);
            else
                ra_snprintf(msg, mlen, "%sconnection to rank %d failed: %s",
                            pre, dst, strerror(errno));
            return RA_ERR_COMM;
        }
        h->out_midframe[dst] = 1;
        if (in_hdr) {
            xs->hout_sent += (size_t)k;
        } else {
            r->sent += (size_t)k;
            atomic_fetch_add(&c->bytes_sent, (uint64_t)k);
        }
    }
    h->out_midframe[dst] = 0;
    return RA_OK;
}

static ra_status run_request(ra_comm *c, host_impl *h, ra_req *r, char *msg,
                             size_t mlen) {
    char pre[128];
    ra_comm_prefix(pre, sizeof pre, c->rank, r->op, r->x.step);
    xfer_state xs;
    memset(&xs, 0, sizeof xs);
    put32(xs.hout, FRAME_MAGIC);
    put32(xs.hout + 4, (uint32_t)r->x.kind);
    put64(xs.hout + 8, (uint64_t)r->x.step);
    put64(xs.hout + 16, (uint64_t)r->x.send_nbytes);
    int send_done = r->x.dst < 0, recv_done = r->x.src < 0;
    while (!send_done || !recv_done) {
        if (atomic_load(&c->failed)) {
            pthread_mutex_lock(&c->mu);
            ra_snprintf(msg, mlen, "%s", c->fail_msg);
            pthread_mutex_unlock(&c->mu);
            return RA_ERR_COMM;
        }
        struct pollfd pfd[3];
        int n = 0;
        pfd[n++] = (struct pollfd){h->wake[0], POLLIN, 0};
        int ifd = -1, ofd = -1;
        if (!recv_done) {
            ifd = n;
            pfd[n++] = (struct pollfd){h->fds[r->x.src], POLLIN, 0};
        }
        if (!send_done) {
            if (ifd >= 0 && r->x.dst == r->x.src) {
                ofd = ifd;
                pfd[ifd].events |= POLLOUT;
            } else {
                ofd = n;
                pfd[n++] = (struct pollfd){h->fds[r->x.dst], POLLOUT, 0};
            }
        }
        int rc = poll(pfd, (nfds_t)n, 1000);
        if (rc < 0) {
            if (errno == EINTR) continue;
            ra_snprintf(msg, mlen, "%spoll failed: %s", pre, strerror(errno));
            return RA_ERR_COMM;
        }
        if (pfd[0].revents) {
            char drain[64];
            while (read(h->wake[0], drain, sizeof drain) > 0) {
            }
        }
        if (ifd >= 0 && pfd[ifd].revents) {
            RA_CHECK(recv_some(c, h, r, &xs, pre, msg, mlen));
            if (xs.hin_got == FRAME_HDR && r->received == r->x.recv_nbytes) {
                recv_done = 1;
                pthread_mutex_lock(&c->mu);
                r->recv_done = 1;
                pthread_mutex_unlock(&c->mu);
            }
        }
        if (ofd >= 0 && !send_done &&
            (pfd[ofd].revents & (POLLOUT | POLLERR | POLLHUP))) {
            RA_CHECK(send_some(c, h, r, &xs, pre, msg, mlen));
            if (xs.hout_sent == FRAME_HDR && r->sent == r->x.send_nbytes) {
                send_done = 1;
                atomic_fetch_add(&c->messages, 1);
                pthread_mutex_lock(&c->mu);
                r->send_done = 1;
                pthread_mutex_unlock(&c->mu);
            }
        }
    }
    return RA_OK;
}

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
    memcpy(frame + FRAME_HDR, reason, n);
    for (int i = 0; i < c->size; i++) {
        if (h->fds[i] < 0) continue;
        if (!h->out_midframe[i] && !h->broken[i]) {
            ssize_t rc = send(h->fds[i], frame, FRAME_HDR + n,
                              MSG_NOSIGNAL | MSG_DONTWAIT);
            (void)rc;
        }
        shutdown(h->fds[i], SHUT_RDWR);
    }
}

static void *progress_main(void *arg) {
    ra_comm *c = arg;
    host_impl *h = c->impl;
    char msg[RA_COMM_MSG_LEN];
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (h->head == NULL && !h->stop && !atomic_load(&c->failed))
            pthread_cond_wait(&h->qcv, &c->mu);
        if (atomic_load(&c->failed) || h->stop) {
            /* finish whatever is queued; nothing will run any more */
            const char *why = atomic_load(&c->failed)
                                  ? c->fail_msg : "communicator closed";
            while (h->head != NULL) {
                ra_req *r = h->head;
                h->head = r->next;
                ra_req_finish_locked(r, RA_ERR_COMM, why);
                ra_req_release(r);
            }
            h->tail = NULL;
            if (atomic_load(&c->failed) && !h->failure_handled) {
                pthread_mutex_unlock(&c->mu);
                handle_failure(c, h);
                pthread_mutex_lock(&c->mu);
            }
            if (h->stop) break;
            pthread_cond_wait(&h->qcv, &c->mu);
            continue;
        }
        ra_req *r = h->head;
        pthread_mutex_unlock(&c->mu);
        ra_status st = run_request(c, h, r, msg, sizeof msg);
        if (st != RA_OK) ra_comm_fail(c, st, msg);
        pthread_mutex_lock(&c->mu);
        h->head = r->next;
        if (h->head == NULL) h->tail = NULL;
        ra_req_finish_locked(r, st, msg);
        ra_req_release(r);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* ---- vtable ------------------------------------------------------------ */

static ra_status host_start(ra_comm *c, ra_req *r) {
    host_impl *h = c->impl;
    pthread_mutex_lock(&c->mu);
    if (h->stop || atomic_load(&c->failed)) {
        ra_req_finish_locked(r, RA_ERR_COMM,
                             h->stop ? "communicator closed" : c->fail_msg);
        pthread_mutex_unlock(&c->mu);
        ra_req_release(r);
        return RA_ERR_COMM;
    }
    r->next = NULL;
    if (h->tail) h->tail->next = r;
    else h->head = r;
    h->tail = r;
    pthread_cond_signal(&h->qcv);
    pthread_mutex_unlock(&c->mu);
    return RA_OK;
}

static void host_abort(ra_comm *c) {
    host_impl *h = c->impl;
    if (h == NULL) return;
    pthread_cond_broadcast(&h->qcv);
    wake_thread(h);
}

static void host_free_impl(ra_comm *c) {
    host_impl *h = c->impl;
    if (h == NULL) return;
    for (int i = 0; i < c->size; i++) close_fd(&h->fds[i]);
    close_fd(&h->wake[0]);
    close_fd(&h->wake[1]);
    pthread_cond_destroy(&h->qcv);
    ra_host_free(h->fds, sizeof(int) * (size_t)c->size);
    ra_host_free(h->out_midframe, sizeof(int) * (size_t)c->size);
    ra_host_free(h->broken, sizeof(int) * (size_t)c->size);
    ra_host_free(h, sizeof *h);
    c->impl = NULL;
}

static void host_close(ra_comm *c) {
    host_impl *h = c->impl;
    if (h == NULL) return;
    if (h->thread_started) {
        pthread_mutex_lock(&c->mu);
        h->stop = 1;
        pthread_cond_broadcast(&h->qcv);
        pthread_mutex_unlock(&c->mu);
        wake_thread(h);
        /* the thread leaves at once: it never blocks outside poll and
         * the wake pipe interrupts that */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 10;
        if (pthread_timedjoin_np(h->thread, NULL, &ts) != 0) {
            /* should never happen; leak rather than free under it */
            pthread_detach(h->thread);
            c->impl = NULL;
            return;
        }
        h->thread_started = 0;
    } else {
        pthread_mutex_lock(&c->mu);
        h->stop = 1;
        pthread_mutex_unlock(&c->mu);
    }
    for (int i = 0; i < c->size; i++)
        if (h->fds[i] >= 0) shutdown(h->fds[i], SHUT_RDWR);
}

static const ra_comm_vtable host_vtable = {
    .name = "host",
    .device_type = RA_DEV_CPU,
    .sendrecv_start = host_start,
    .wait = NULL,
    .barrier = NULL,
    .allgather = NULL,
    .abort = host_abort,
    .close = host_close,
    .destroy = host_free_impl,
};

ra_status ra_host_comm_create(int rank, int size, const char *master_addr,
                              int port, const char *token, double timeout,
                              ra_comm **out) {
    *out = NULL;
    if (size < 1 || rank < 0 || rank >= size) {
        ra_set_error(RA_ERR_VALUE, "rank must be in [0, %d), got %d", size,
                     rank);
        return RA_ERR_VALUE;
    }
    if (size > 1 && (token == NULL || *token == '\0')) {
        ra_set_error(RA_ERR_VALUE, "token must be a non-empty string when "
                     "world_size > 1");
        return RA_ERR_VALUE;
    }
    if (size > 1 && (port <= 0 || port > 65535)) {
        ra_set_error(RA_ERR_VALUE, "master_port must be in 1..65535, got %d",
                     port);
        return RA_ERR_VALUE;
    }
    ra_status st = RA_OK;
    ra_comm *c = ra_host_calloc(sizeof *c);
    if (c == NULL) return RA_ERR_NOMEM;
    RA_CHECKGOTO(ra_comm_init_base(c, &host_vtable, rank, size, timeout), st,
                 fail_base);
    host_impl *h = ra_host_calloc(sizeof *h);
    if (h == NULL) {
        st = RA_ERR_NOMEM;
        goto fail_impl;
    }
    c->impl = h;
    h->wake[0] = h->wake[1] = -1;
    pthread_cond_init(&h->qcv, NULL);
    h->fds = ra_host_alloc(sizeof(int) * (size_t)size);
    h->out_midframe = ra_host_calloc(sizeof(int) * (size_t)size);
    h->broken = ra_host_calloc(sizeof(int) * (size_t)size);
    if (!h->fds || !h->out_midframe || !h->broken) {
        st = RA_ERR_NOMEM;
        goto fail_impl;
    }
    for (int i = 0; i < size; i++) h->fds[i] = -1;
    if (pipe2(h->wake, O_NONBLOCK | O_CLOEXEC) < 0) {
        ra_set_error(RA_ERR_SYSTEM, "pipe2: %s", strerror(errno));
        st = RA_ERR_SYSTEM;
        goto fail_impl;
    }
    if (size > 1) {
        double deadline = ra_now() + c->default_timeout;
        RA_CHECKGOTO(ra_host_bootstrap(rank, size, h->fds,
                                       master_addr ? master_addr
                                                   : "127.0.0.1",
                                       port, token, deadline), st, fail_impl);
        /* the progress thread takes no signals: Python handles them */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        int rc = pthread_create(&h->thread, NULL, progress_main, c);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (rc != 0) {
            ra_set_error(RA_ERR_SYSTEM, "cannot start the progress thread: %s",
                         strerror(rc));
            st = RA_ERR_SYSTEM;
            goto fail_impl;
        }
        h->thread_started = 1;
    }
    *out = c;
    return RA_OK;
fail_impl:
    host_free_impl(c);
    ra_comm_destroy_base(c);
fail_base:
    ra_host_free(c, sizeof *c);
    return st;
}
