/*
 * comm_host.c -- the "host" backend: TCP sockets between CPU ranks.
 *
 * Bootstrap: comm_host_boot.c joins the ranks into an authenticated full
 * mesh (one socket per peer) before the progress thread starts.
 *
 * Data: one progress thread per transport (comm_host_engine.c) moves every
 * transfer of the communicator and of its splits, many at once, in frames
 * that carry the communicator's context; this file is the vtable: starting
 * a request hands it to the thread, a split opens and closes its context
 * here (comm_split.c), close stops the thread and shuts the sockets.
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
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <linux/sockios.h>

/* How long close() waits at most for live peers to take what this rank
 * already sent (the communicator's timeout, if shorter). */
#define LINGER_MAX_S 10.0

/* ---- vtable ------------------------------------------------------------ */

static ra_status host_start(ra_comm *c, ra_req *r) {
    host_impl *h = c->impl;
    char msg[RA_COMM_MSG_LEN];
    pthread_mutex_lock(&c->mu);
    if (h->stop || atomic_load(&c->failed)) {
        char pre[128];
        ra_comm_prefix(pre, sizeof pre, c->rank, r->op, r->x.step);
        ra_snprintf(msg, sizeof msg, "%s%s", h->stop ? pre : "",
                    h->stop ? "communicator is closed" : c->fail_msg);
    } else if (!ra_host_split_refuse(c, r, msg, sizeof msg)) {
        r->next = NULL;
        if (h->submit_tail) h->submit_tail->next = r;
        else h->submit_head = r;
        h->submit_tail = r;
        pthread_mutex_unlock(&c->mu);
        ra_host_wake(h);
        return RA_OK;
    }
    ra_req_finish_locked(r, RA_ERR_COMM, msg);
    pthread_mutex_unlock(&c->mu);
    ra_req_release(r);
    return RA_ERR_COMM;
}

static void host_abort(ra_comm *c) {
    host_impl *h = c->impl;
    if (h != NULL) ra_host_wake(h);   /* it fails everything and tells why */
}

static void host_stall_hint(ra_comm *c, ra_req *r, int peer, char *buf,
                            size_t n) {
    host_impl *h = c->impl;
    if (h == NULL || peer < 0 || peer != r->x.src) return;
    int64_t other = atomic_load(&h->peers[peer].untaken);
    if (other >= 0 && other != (int64_t)ra_xfer_context(r->x.kind))
        ra_snprintf(buf, n, " (rank %d sent a message of another "
                    "communicator, which no receive here takes)", peer);
}

static void host_free_impl(ra_comm *c) {
    host_impl *h = c->impl;
    if (h == NULL) return;
    if (h->peers != NULL) {
        ra_host_engine_free(c);
        for (int i = 0; i < c->size; i++) close_fd(&h->peers[i].fd);
        ra_host_free(h->peers, sizeof(host_peer) * (size_t)c->size);
    }
    close_fd(&h->wake[0]);
    close_fd(&h->wake[1]);
    pthread_cond_destroy(&h->qcv);
    ra_host_free(h->sink, SINK_BYTES);
    ra_host_free(h, sizeof *h);
    c->impl = NULL;
}

/* The bytes of this rank's last sends may still sit in its kernel's queue
 * when it closes: a send is done once its frame is handed to the kernel, and
 * the receiver may post its receive later.  If the read side is shut, or the
 * socket closed with unread bytes from that peer (a frame nobody here takes,
 * a notice that came after the thread stopped), the kernel answers the
 * peer's next segment with a reset and drops that queue, and the peer's
 * receive fails half-way.  So a close that follows no failure first shuts
 * the write side only (the FIN goes after the data), then reads and drops
 * whatever arrives until every peer has acknowledged every byte sent to it
 * (SIOCOUTQ 0), has closed its end, or the deadline passed.  A dead peer
 * ends the wait at once (reset or EOF). */
static void linger(ra_comm *c, host_impl *h) {
    double limit = c->default_timeout < LINGER_MAX_S ? c->default_timeout
                                                     : LINGER_MAX_S;
    double deadline = ra_now() + limit;
    int n = c->size;
    unsigned char *waiting = ra_host_calloc((size_t)n);
    struct pollfd *pfd = ra_host_calloc(sizeof *pfd * (size_t)n);
    for (int i = 0; i < n; i++) {
        host_peer *pe = &h->peers[i];
        int live = pe->fd >= 0 && !ra_host_out_closed(pe);
        if (live) shutdown(pe->fd, SHUT_WR);
        if (waiting != NULL) waiting[i] = (unsigned char)live;
    }
    if (waiting == NULL || pfd == NULL) goto out;
    for (;;) {
        int np = 0;
        for (int i = 0; i < n; i++) {
            if (!waiting[i]) continue;
            int fd = h->peers[i].fd;
            for (;;) {              /* drop what came: nobody reads it now */
                ssize_t k = recv(fd, h->sink, SINK_BYTES, MSG_DONTWAIT);
                if (k > 0) continue;
                if (k < 0 && errno == EINTR) continue;
                if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK))
                    waiting[i] = 0;  /* the peer closed, or the link died */
                break;
            }
            int queued = 0;
            if (waiting[i] && (ioctl(fd, SIOCOUTQ, &queued) != 0 ||
                               queued == 0))
                waiting[i] = 0;      /* all acknowledged (or unknowable) */
            if (waiting[i]) pfd[np++] = (struct pollfd){fd, POLLIN, 0};
        }
        double left = deadline - ra_now();
        if (np == 0 || left <= 0) break;
        /* acknowledgements wake nobody: poll in short slices */
        int ms = left < 0.005 ? (int)(left * 1000) + 1 : 5;
        if (poll(pfd, (nfds_t)np, ms) < 0 && errno != EINTR) break;
    }
out:
    ra_host_free(pfd, sizeof *pfd * (size_t)n);
    ra_host_free(waiting, (size_t)n);
}

static void host_close(ra_comm *c) {
    host_impl *h = c->impl;
    if (h == NULL) return;
    pthread_mutex_lock(&c->mu);
    h->stop = 1;
    pthread_cond_broadcast(&h->qcv);
    pthread_mutex_unlock(&c->mu);
    if (h->thread_started) {
        ra_host_wake(h);
        /* the thread leaves at once: it fails what is in flight, it never
         * blocks outside poll, and the wake pipe interrupts that */
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
    }
    if (!atomic_load(&c->failed)) linger(c, h);
    for (int i = 0; i < c->size; i++)
        if (h->peers[i].fd >= 0) shutdown(h->peers[i].fd, SHUT_RDWR);
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
    .context_open = ra_host_context_open,
    .context_close = ra_host_context_close,
    .stall_hint = host_stall_hint,
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
    h->peers = ra_host_calloc(sizeof(host_peer) * (size_t)size);
    h->sink = ra_host_alloc(SINK_BYTES);
    int *fds = ra_host_alloc(sizeof(int) * (size_t)size);
    if (!h->peers || !h->sink || !fds) {
        if (fds != NULL) ra_host_free(fds, sizeof(int) * (size_t)size);
        st = RA_ERR_NOMEM;
        goto fail_impl;
    }
    for (int i = 0; i < size; i++) {
        h->peers[i].fd = fds[i] = -1;
        atomic_store(&h->peers[i].untaken, -1);
    }
    if (pipe2(h->wake, O_NONBLOCK | O_CLOEXEC) < 0) {
        ra_set_error(RA_ERR_SYSTEM, "pipe2: %s", strerror(errno));
        st = RA_ERR_SYSTEM;
        ra_host_free(fds, sizeof(int) * (size_t)size);
        goto fail_impl;
    }
    if (size > 1) {
        double deadline = ra_now() + c->default_timeout;
        st = ra_host_bootstrap(rank, size, fds,
                               master_addr ? master_addr : "127.0.0.1", port,
                               token, deadline);
        for (int i = 0; i < size; i++) h->peers[i].fd = fds[i];
    }
    ra_host_free(fds, sizeof(int) * (size_t)size);
    if (st != RA_OK) goto fail_impl;
    if (size > 1) {
        /* the progress thread takes no signals: Python handles them */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        int rc = pthread_create(&h->thread, NULL, ra_host_progress, c);
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
