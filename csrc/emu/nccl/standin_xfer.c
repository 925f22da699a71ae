/*
 * standin_xfer.c -- ncclSend/ncclRecv and ncclGroupStart/End of ringattn's
 * stand-in NCCL.
 *
 * At call time a send or receive is checked (a live, ready communicator;
 * the peer; the datatype; a buffer of device memory of the communicator's
 * device for all its bytes; the stream's device) and, inside a group,
 * collected on the calling thread (groups nest; the outermost
 * ncclGroupEnd issues).  Issuing gives every message its sequence number
 * per (peer, direction) and queues ONE stream operation per (communicator,
 * stream) through the emulated runtime's enqueue: the bytes are read and
 * written when the stream reaches it, not at call time.
 *
 * The operation (run_op, on the stream's worker thread) moves all of its
 * messages at once over non-blocking sockets and poll, so a ring step's
 * send to r+1 and receive from r-1 of any size, or an all-to-all, cannot
 * deadlock.  Messages to or from one peer go in sequence order (their
 * `turn`), also across streams.  Sends to self are copied to the matching
 * receive from self, which must be in the same group.  Whatever goes wrong
 * (a peer's EOF, a malformed frame, a size mismatch) becomes the
 * communicator's async error and the operation ends; so does an abort,
 * which the operation sees within milliseconds through the wake pipe.  The
 * stream itself never gets an error: it moves on, as after an NCCL abort.
 */
#define _GNU_SOURCE
#include "emu/nccl/standin.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

typedef struct si_call {
    ncclComm_t comm;
    void *stream;
    int peer;
    int is_send;
    char *buf;
    size_t nbytes;
} si_call;

typedef struct si_item {
    int peer, is_send;
    char *buf;
    size_t nbytes;
    uint64_t seq;
    int match;                    /* self receive: index of its send */
    int done;
    si_frame hdr;                 /* sent, or being received */
    size_t hdr_done, body_done;
} si_item;

typedef struct si_op {
    ncclComm_t comm;
    int n;
    struct pollfd *pfd;           /* n + 1 */
    int *which;                   /* pfd index -> item */
    si_item items[];
} si_op;

static __thread int group_depth;
static __thread ncclResult_t group_error;
static __thread char group_error_text[320];   /* the failed call's */
static __thread si_call *group_calls;
static __thread size_t group_n, group_cap;

/* ---- the stream operation -------------------------------------------------- */

static int lost(ncclComm_t c, const si_item *it, int err) {
    const char *dir = it->is_send ? "send to" : "receive from";
    if (err == 0)
        si_comm_set_error(c, ncclRemoteError, "rank %d: rank %d closed the "
                          "connection during a %s it of %zu bytes (did it "
                          "exit or abort?)", c->rank, it->peer, dir,
                          it->nbytes);
    else
        si_comm_set_error(c, err == EPIPE || err == ECONNRESET
                                 ? ncclRemoteError : ncclSystemError,
                          "rank %d: %s rank %d (%zu bytes) failed: %s",
                          c->rank, dir, it->peer, it->nbytes, strerror(err));
    return -1;
}

static void item_done(ncclComm_t c, si_item *it) {
    it->done = 1;
    atomic_store(it->is_send ? &c->send_turn[it->peer]
                             : &c->recv_turn[it->peer], it->seq + 1);
}

/* Write as much of a send as the socket takes: 0, or -1 (error set). */
static int step_send(ncclComm_t c, si_item *it) {
    int fd = c->fds[it->peer];
    while (!it->done) {
        struct iovec iov[2];
        int n = 0;
        if (it->hdr_done < sizeof it->hdr)
            iov[n++] = (struct iovec){(char *)&it->hdr + it->hdr_done,
                                      sizeof it->hdr - it->hdr_done};
        if (it->body_done < it->nbytes)
            iov[n++] = (struct iovec){it->buf + it->body_done,
                                      it->nbytes - it->body_done};
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t k = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            return lost(c, it, errno);
        }
        size_t h = sizeof it->hdr - it->hdr_done;
        if ((size_t)k <= h) {
            it->hdr_done += (size_t)k;
        } else {
            it->hdr_done = sizeof it->hdr;
            it->body_done += (size_t)k - h;
        }
        if (it->hdr_done == sizeof it->hdr && it->body_done == it->nbytes)
            item_done(c, it);
    }
    return 0;
}

/* The frame header of a receive, checked before any payload is read. */
static int check_frame(ncclComm_t c, const si_item *it) {
    const si_frame *f = &it->hdr;
    if (f->magic != SI_FRAME_MAGIC || f->kind != SI_FRAME_DATA) {
        si_comm_set_error(c, ncclRemoteError, "rank %d: malformed frame from "
                          "rank %d (magic 0x%08x, kind %u): not ringattn's "
                          "stand-in NCCL, or the stream is corrupt", c->rank,
                          it->peer, f->magic, f->kind);
        return -1;
    }
    if (f->seq != it->seq) {
        si_comm_set_error(c, ncclRemoteError, "rank %d: rank %d sent message "
                          "%llu where message %llu was due", c->rank,
                          it->peer, (unsigned long long)f->seq,
                          (unsigned long long)it->seq);
        return -1;
    }
    if (f->nbytes != (uint64_t)it->nbytes) {
        si_comm_set_error(c, ncclInvalidUsage, "rank %d: size mismatch: rank "
                          "%d sends %llu bytes but the matching ncclRecv "
                          "(message %llu from it) takes %zu bytes", c->rank,
                          it->peer, (unsigned long long)f->nbytes,
                          (unsigned long long)it->seq, it->nbytes);
        return -1;
    }
    return 0;
}

/* Read as much of a receive as the socket has: 0, or -1 (error set). */
static int step_recv(ncclComm_t c, si_item *it) {
    const ra_emu_rt_table *t = atomic_load(&si_rt);
    int fd = c->fds[it->peer];
    while (!it->done) {
        ssize_t k;
        int in_hdr = it->hdr_done < sizeof it->hdr;
        if (in_hdr)
            k = recv(fd, (char *)&it->hdr + it->hdr_done,
                     sizeof it->hdr - it->hdr_done, MSG_DONTWAIT);
        else
            k = recv(fd, it->buf + it->body_done, it->nbytes - it->body_done,
                     MSG_DONTWAIT);
        if (k == 0) return lost(c, it, 0);
        if (k < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            return lost(c, it, errno);
        }
        if (in_hdr) {
            it->hdr_done += (size_t)k;
            if (it->hdr_done == sizeof it->hdr && check_frame(c, it) != 0)
                return -1;
        } else {
            it->body_done += (size_t)k;
        }
        if (it->hdr_done == sizeof it->hdr && it->body_done == it->nbytes) {
            if (it->nbytes > 0) t->mark_init(it->buf, it->nbytes);
            item_done(c, it);
        }
    }
    return 0;
}

static int failed_or_aborted(ncclComm_t c) {
    return atomic_load(&c->aborted) || si_is_error(atomic_load(&c->state));
}

/* Move every message of `op`; returns when all are done, on an error (the
 * communicator's async error) or on abort. */
static void progress(si_op *op) {
    const ra_emu_rt_table *t = atomic_load(&si_rt);
    ncclComm_t c = op->comm;
    for (int i = 0; i < op->n; i++) {
        si_item *it = &op->items[i];
        if (it->peer != c->rank) continue;
        if (!it->is_send) {
            const si_item *src = &op->items[it->match];
            if (it->nbytes > 0) {
                memmove(it->buf, src->buf, it->nbytes);
                t->mark_init(it->buf, it->nbytes);
            }
        }
        it->done = 1;
    }
    for (;;) {
        int np = 0, waiting = 0, left = 0;
        for (int i = 0; i < op->n; i++) {
            si_item *it = &op->items[i];
            if (it->done) continue;
            left++;
            _Atomic uint64_t *turn = it->is_send ? &c->send_turn[it->peer]
                                                 : &c->recv_turn[it->peer];
            if (atomic_load(turn) != it->seq) {   /* an earlier message */
                waiting = 1;
                continue;
            }
            op->pfd[np] = (struct pollfd){.fd = c->fds[it->peer],
                                          .events = it->is_send ? POLLOUT
                                                                : POLLIN};
            op->which[np++] = i;
        }
        if (left == 0) return;
        op->pfd[np] = (struct pollfd){.fd = c->wake[0], .events = POLLIN};
        int k = poll(op->pfd, (nfds_t)np + 1, waiting ? 1 : 200);
        if (k < 0 && errno != EINTR) {
            si_comm_set_error(c, ncclSystemError, "rank %d: poll: %s",
                              c->rank, strerror(errno));
            return;
        }
        if (failed_or_aborted(c)) return;
        for (int p = 0; p < np && k > 0; p++) {
            if (op->pfd[p].revents == 0) continue;
            si_item *it = &op->items[op->which[p]];
            if ((it->is_send ? step_send(c, it) : step_recv(c, it)) != 0)
                return;
        }
    }
}

static int run_op(void *arg) {
    si_op *op = (si_op *)arg;
    ncclComm_t c = op->comm;
    pthread_mutex_lock(&c->mu);
    int go = !failed_or_aborted(c);
    if (go) c->running++;
    pthread_mutex_unlock(&c->mu);
    if (go) progress(op);
    pthread_mutex_lock(&c->mu);
    if (go) c->running--;
    c->outstanding--;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    si_comm_unref(c);
    free(op);
    return 0;   /* the stream moves on; errors are the communicator's */
}

/* ---- issue ------------------------------------------------------------------- */

/* Pair each receive from self with the send to self of the same rank in
 * calls[0..n) (same communicator): k-th with k-th, same size and stream. */
static ncclResult_t pair_self(si_call *calls, size_t n, ncclComm_t c) {
    size_t sends = 0, recvs = 0;
    for (size_t i = 0; i < n; i++) {
        if (calls[i].comm != c || calls[i].peer != c->rank) continue;
        if (calls[i].is_send) {
            sends++;
            continue;
        }
        size_t k = recvs++, seen = 0;
        size_t j = 0;
        for (; j < n; j++)
            if (calls[j].comm == c && calls[j].peer == c->rank &&
                calls[j].is_send && seen++ == k)
                break;
        if (j == n) continue;   /* counted below */
        if (calls[j].nbytes != calls[i].nbytes || calls[j].stream !=
                                                      calls[i].stream)
            return si_fail(ncclInvalidUsage, "rank %d: the send to self and "
                           "the receive from self differ in size (%zu, %zu "
                           "bytes) or stream", c->rank, calls[j].nbytes,
                           calls[i].nbytes);
    }
    if (sends != recvs)
        return si_fail(ncclInvalidUsage, "rank %d: %zu sends to self but %zu "
                       "receives from self: each needs its partner in the "
                       "same group", c->rank, sends, recvs);
    return ncclSuccess;
}

/* Queue calls[0..n) that share `comm` and `stream` as one operation. */
static ncclResult_t enqueue_op(const si_call *calls, size_t n) {
    const ra_emu_rt_table *t = atomic_load(&si_rt);
    ncclComm_t c = calls[0].comm;
    /* one block: the op, its items, then poll's arrays */
    size_t items = sizeof(si_op) + n * sizeof(si_item);
    si_op *op = calloc(1, items + (n + 1) * (sizeof(struct pollfd) +
                                             sizeof(int)));
    if (op == NULL)
        return si_fail(ncclSystemError, "rank %d: out of host memory",
                       c->rank);
    op->pfd = (struct pollfd *)((char *)op + items);
    op->which = (int *)(op->pfd + n + 1);
    op->comm = c;
    op->n = (int)n;
    size_t ks = 0, kr = 0;
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < n; i++) {
        si_item *it = &op->items[i];
        it->peer = calls[i].peer;
        it->is_send = calls[i].is_send;
        it->buf = calls[i].buf;
        it->nbytes = calls[i].nbytes;
        it->match = -1;
        if (it->peer == c->rank) {
            /* self: the k-th receive takes the k-th send (pair_self
             * checked that they pair up); `which` is scratch until run */
            if (it->is_send) op->which[ks++] = (int)i;
            continue;
        }
        it->seq = it->is_send ? c->send_issued[it->peer]++
                              : c->recv_issued[it->peer]++;
        it->hdr = (si_frame){SI_FRAME_MAGIC, SI_FRAME_DATA, it->seq,
                             (uint64_t)it->nbytes};
    }
    for (size_t i = 0; i < n; i++)
        if (op->items[i].peer == c->rank && !op->items[i].is_send)
            op->items[i].match = op->which[kr++];
    c->outstanding++;
    c->refs++;
    pthread_mutex_unlock(&c->mu);
    int e = t->enqueue(calls[0].stream, run_op, op);
    if (e != 0) {
        /* the sequence numbers are spent: the communicator cannot go on */
        si_comm_set_error(c, ncclUnhandledCudaError, "rank %d: the emulated "
                          "runtime refused the stream operation (CUDA error "
                          "%d)", c->rank, e);
        pthread_mutex_lock(&c->mu);
        c->outstanding--;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        si_comm_unref(c);
        free(op);
        return si_fail(ncclUnhandledCudaError, "rank %d: enqueue on the "
                       "stream failed (CUDA error %d)", c->rank, e);
    }
    return ncclSuccess;
}

/* Issue calls[0..n): one operation per (communicator, stream), in the
 * order of their first call.  ncclInProgress if a communicator is
 * non-blocking (it then reports ncclInProgress once more). */
static ncclResult_t issue(si_call *calls, size_t n) {
    ncclResult_t r = ncclSuccess;
    int in_progress = 0;
    for (size_t i = 0; i < n; i++) {
        size_t j;
        for (j = 0; j < i; j++)
            if (calls[j].comm == calls[i].comm) break;
        if (j == i && (r = pair_self(calls, n, calls[i].comm)) != ncclSuccess)
            return r;
    }
    /* stable partition: calls of one (comm, stream) together, in order */
    si_call *sorted = malloc(n * sizeof *sorted);
    char *taken = calloc(n, 1);
    if (sorted == NULL || taken == NULL) {
        free(sorted);
        free(taken);
        return si_fail(ncclSystemError, "out of host memory");
    }
    size_t m = 0;
    for (size_t i = 0; i < n && r == ncclSuccess; i++) {
        if (taken[i]) continue;
        size_t first = m;
        for (size_t j = i; j < n; j++)
            if (!taken[j] && calls[j].comm == calls[i].comm &&
                calls[j].stream == calls[i].stream) {
                sorted[m++] = calls[j];
                taken[j] = 1;
            }
        r = enqueue_op(sorted + first, m - first);
        if (!calls[i].comm->blocking) {
            atomic_store(&calls[i].comm->settle_once, 1);
            in_progress = 1;
        }
    }
    free(sorted);
    free(taken);
    return r != ncclSuccess ? r : in_progress ? ncclInProgress : ncclSuccess;
}

/* ---- the API -------------------------------------------------------------------- */

static size_t type_size(ncclDataType_t t) {
    switch (t) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2:
        return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
    }
}

/* Every check of a send/recv at call time, into *call. */
static ncclResult_t check_call(const char *fn, const void *buf, size_t count,
                               ncclDataType_t dt, int peer, ncclComm_t comm,
                               void *stream, int is_send, si_call *call) {
    const ra_emu_rt_table *t = atomic_load(&si_rt);
    ncclResult_t r = si_check_comm(comm, fn);
    if (r != ncclSuccess) return r;
    int st = atomic_load(&comm->state);
    if (st == ncclInProgress)
        return si_fail(ncclInvalidUsage, "%s: rank %d: the communicator is "
                       "still initialising (poll ncclCommGetAsyncError until "
                       "ncclSuccess first)", fn, comm->rank);
    if (si_is_error(st))
        return si_fail((ncclResult_t)st, "%s: %s", fn, comm->err);
    if (peer < 0 || peer >= comm->world)
        return si_fail(ncclInvalidArgument, "%s: rank %d: peer %d is not in "
                       "[0, %d)", fn, comm->rank, peer, comm->world);
    size_t es = type_size(dt);
    if (es == 0)
        return si_fail(ncclInvalidArgument, "%s: invalid datatype %d", fn,
                       (int)dt);
    if (count > SIZE_MAX / es)
        return si_fail(ncclInvalidArgument, "%s: count %zu overflows", fn,
                       count);
    size_t nbytes = count * es;
    if (nbytes > 0) {
        int dev = t->device_of(buf, nbytes);
        if (dev != comm->device)
            return si_fail(ncclInvalidArgument, "%s: rank %d: %s buffer %p "
                           "(%zu bytes) is %s; it must be device memory of "
                           "emulated CUDA device %d", fn, comm->rank,
                           is_send ? "send" : "receive", buf, nbytes,
                           dev < 0 ? "not (all) device memory"
                                   : "another device's memory",
                           comm->device);
    }
    /* the runtime resolves the default handles to the current device's */
    int sd = t->stream_device(stream);
    if (sd != comm->device)
        return si_fail(ncclInvalidArgument, "%s: rank %d: stream %p %s (the "
                       "communicator's device is %d)", fn, comm->rank, stream,
                       sd < 0 ? "is not a stream" : "belongs to another device",
                       comm->device);
    *call = (si_call){comm, stream, peer, is_send, (char *)buf, nbytes};
    return ncclSuccess;
}

static ncclResult_t add_call(const char *fn, const void *buf, size_t count,
                             ncclDataType_t dt, int peer, ncclComm_t comm,
                             cudaStream_t stream, int is_send) {
    si_clear_error();
    si_call call;
    ncclResult_t r = check_call(fn, buf, count, dt, peer, comm,
                                (void *)stream, is_send, &call);
    if (r != ncclSuccess) {
        if (group_depth > 0 && group_error == ncclSuccess) {
            group_error = r;
            snprintf(group_error_text, sizeof group_error_text, "%s",
                     ncclGetLastError(NULL));
        }
        return r;
    }
    if (group_depth == 0) {
        if (peer == comm->rank)
            return si_fail(ncclInvalidUsage, "%s: rank %d: a send to self "
                           "and its receive must be in one group", fn,
                           comm->rank);
        return issue(&call, 1);
    }
    if (group_n == group_cap) {
        size_t cap = group_cap ? 2 * group_cap : 16;
        si_call *grown = realloc(group_calls, cap * sizeof *grown);
        if (grown == NULL) {
            r = si_fail(ncclSystemError, "%s: out of host memory", fn);
            if (group_error == ncclSuccess) {
                group_error = r;
                snprintf(group_error_text, sizeof group_error_text, "%s",
                         ncclGetLastError(NULL));
            }
            return r;
        }
        group_calls = grown;
        group_cap = cap;
    }
    group_calls[group_n++] = call;
    return ncclSuccess;
}

SI_EXPORT ncclResult_t ncclSend(const void *sendbuff, size_t count,
                                ncclDataType_t datatype, int peer,
                                ncclComm_t comm, cudaStream_t stream) {
    return add_call("ncclSend", sendbuff, count, datatype, peer, comm, stream,
                    1);
}

SI_EXPORT ncclResult_t ncclRecv(void *recvbuff, size_t count,
                                ncclDataType_t datatype, int peer,
                                ncclComm_t comm, cudaStream_t stream) {
    return add_call("ncclRecv", recvbuff, count, datatype, peer, comm, stream,
                    0);
}

SI_EXPORT ncclResult_t ncclGroupStart(void) {
    si_clear_error();
    group_depth++;
    return ncclSuccess;
}

SI_EXPORT ncclResult_t ncclGroupEnd(void) {
    si_clear_error();
    if (group_depth == 0)
        return si_fail(ncclInvalidUsage, "ncclGroupEnd without "
                       "ncclGroupStart");
    if (--group_depth > 0) return ncclSuccess;
    ncclResult_t r = group_error;
    if (r != ncclSuccess)
        si_fail(r, "ncclGroupEnd: nothing of the group was issued: %s",
                group_error_text);
    else if (group_n > 0)
        r = issue(group_calls, group_n);
    free(group_calls);
    group_calls = NULL;
    group_n = group_cap = 0;
    group_error = ncclSuccess;
    return r;
}
