/*
 * standin_wire.c -- the stand-in NCCL's connections: the rendezvous names,
 * connecting every pair of ranks, and the hello both ends check (see
 * standin.h for the protocol).  Every wait here polls the communicator's
 * wake pipe too, so an abort ends init within milliseconds; a peer that
 * never comes is waited for until then (as NCCL's init waits until its
 * owner gives up).
 */
#define _GNU_SOURCE
#include "emu/nccl/standin.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define SI_SOCKBUF (1 << 20)       /* socket buffer we ask for, bytes */

unsigned si_sockaddr(const uint8_t name[SI_NAME_BYTES], int rank,
                     struct sockaddr_un *sa) {
    static const char hex[] = "0123456789abcdef";
    char text[2 * SI_NAME_BYTES + 1];
    for (int i = 0; i < SI_NAME_BYTES; i++) {
        text[2 * i] = hex[name[i] >> 4];
        text[2 * i + 1] = hex[name[i] & 15];
    }
    text[2 * SI_NAME_BYTES] = '\0';
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    /* abstract namespace: sun_path[0] == 0, nothing on the filesystem */
    int k = snprintf(sa->sun_path + 1, sizeof sa->sun_path - 1,
                     "ringattn-emu-nccl-%s-%d", text, rank);
    return (unsigned)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)k);
}

int si_nap(ncclComm_t c, int ms) {
    struct pollfd p = {.fd = c->wake[0], .events = POLLIN};
    if (poll(&p, 1, ms) < 0 && errno != EINTR) return atomic_load(&c->aborted);
    return atomic_load(&c->aborted);
}

static int new_socket(void) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd >= 0) {
        int sz = SI_SOCKBUF;
        (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
        (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
    }
    return fd;
}

ncclResult_t si_listen(ncclComm_t c) {
    struct sockaddr_un sa;
    unsigned len = si_sockaddr(c->name, c->rank, &sa);
    int fd = new_socket();
    if (fd < 0)
        return si_fail(ncclSystemError, "rank %d: socket: %s", c->rank,
                       strerror(errno));
    if (bind(fd, (struct sockaddr *)&sa, len) != 0) {
        int e = errno;
        close(fd);
        if (e == EADDRINUSE)
            return si_fail(ncclInvalidUsage, "rank %d: another process "
                           "already joined this unique id as rank %d (each "
                           "rank must be unique)", c->rank, c->rank);
        return si_fail(ncclSystemError, "rank %d: bind: %s", c->rank,
                       strerror(e));
    }
    if (listen(fd, 128) != 0) {
        int e = errno;
        close(fd);
        return si_fail(ncclSystemError, "rank %d: listen: %s", c->rank,
                       strerror(e));
    }
    c->listen_fd = fd;
    return ncclSuccess;
}

/* All n bytes of buf to or from fd; waits for the socket or the abort.
 * 0, or -1 with the communicator's error set (`what` names the step). */
static int io_all(ncclComm_t c, int fd, void *buf, size_t n, int writing,
                  int peer, const char *what) {
    char *p = (char *)buf;
    size_t done = 0;
    while (done < n) {
        ssize_t k = writing ? send(fd, p + done, n - done,
                                   MSG_NOSIGNAL | MSG_DONTWAIT)
                            : recv(fd, p + done, n - done, MSG_DONTWAIT);
        if (k > 0) {
            done += (size_t)k;
            continue;
        }
        if (k == 0 && !writing) {
            si_comm_set_error(c, ncclRemoteError, "rank %d: rank %d closed "
                              "the connection during %s (did it exit?)",
                              c->rank, peer, what);
            return -1;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
            si_comm_set_error(c, errno == EPIPE || errno == ECONNRESET
                                     ? ncclRemoteError : ncclSystemError,
                              "rank %d: %s with rank %d failed: %s", c->rank,
                              what, peer, strerror(errno));
            return -1;
        }
        struct pollfd pf[2] = {
            {.fd = fd, .events = writing ? POLLOUT : POLLIN},
            {.fd = c->wake[0], .events = POLLIN},
        };
        if (poll(pf, 2, 100) < 0 && errno != EINTR) {
            si_comm_set_error(c, ncclSystemError, "rank %d: poll: %s",
                              c->rank, strerror(errno));
            return -1;
        }
        if (atomic_load(&c->aborted)) {
            si_comm_set_error(c, ncclSystemError, "rank %d: the communicator "
                              "was aborted during init", c->rank);
            return -1;
        }
    }
    return 0;
}

static void hello_fill(ncclComm_t c, int to, si_hello *h) {
    memset(h, 0, sizeof *h);
    h->magic = SI_HELLO_MAGIC;
    h->version = SI_WIRE_VERSION;
    h->world = (uint32_t)c->world;
    h->from = (uint32_t)c->rank;
    h->to = (uint32_t)to;
    h->device = c->device;
    memcpy(h->name, c->name, SI_NAME_BYTES);
    memcpy(h->secret, c->secret, SI_SECRET_BYTES);
}

/* Check a hello received on a connection; `expect_from` is the rank the
 * connector reached (-1: an accepted connection, any higher rank).  0 and
 * the sender's rank in *from, or -1 with the error set. */
static int hello_check(ncclComm_t c, const si_hello *h, int expect_from,
                       int *from) {
    unsigned diff = 0;
    for (int i = 0; i < SI_SECRET_BYTES; i++) diff |= h->secret[i] ^ c->secret[i];
    if (h->magic != SI_HELLO_MAGIC || h->version != SI_WIRE_VERSION ||
        memcmp(h->name, c->name, SI_NAME_BYTES) != 0 || diff != 0) {
        si_comm_set_error(c, ncclRemoteError, "rank %d: a connection to this "
                          "unique id's rendezvous sent a bad hello (not a "
                          "rank of this communicator, or another wire "
                          "version)", c->rank);
        return -1;
    }
    if (h->world != (uint32_t)c->world) {
        si_comm_set_error(c, ncclInvalidUsage, "rank %d: rank %u joined with "
                          "world size %u but this rank has %d", c->rank,
                          h->from, h->world, c->world);
        return -1;
    }
    int lo = expect_from >= 0 ? expect_from : c->rank + 1;
    int hi = expect_from >= 0 ? expect_from : c->world - 1;
    if (h->to != (uint32_t)c->rank || h->from < (uint32_t)lo ||
        h->from > (uint32_t)hi) {
        si_comm_set_error(c, ncclInvalidUsage, "rank %d: a peer claims to be "
                          "rank %u reaching rank %u (expected rank %d..%d "
                          "reaching %d)", c->rank, h->from, h->to, lo, hi,
                          c->rank);
        return -1;
    }
    if (c->fds[h->from] >= 0) {
        si_comm_set_error(c, ncclInvalidUsage, "rank %d: two processes joined "
                          "as rank %u (each rank must be unique)", c->rank,
                          h->from);
        return -1;
    }
    if (h->device < 0 || h->device >= RA_EMU_MAX_DEVICES) {
        si_comm_set_error(c, ncclRemoteError, "rank %d: rank %u sent device "
                          "%d", c->rank, h->from, (int)h->device);
        return -1;
    }
    *from = (int)h->from;
    return 0;
}

/* Only this user's processes may join. */
static int same_user(int fd) {
    struct ucred cr;
    socklen_t len = sizeof cr;
    return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0 &&
           cr.uid == geteuid();
}

/* Connect to rank j (lower than ours), retrying until it listens. */
static int connect_to(ncclComm_t c, int j) {
    struct sockaddr_un sa;
    unsigned len = si_sockaddr(c->name, j, &sa);
    int nap = 1;
    for (;;) {
        int fd = new_socket();
        if (fd < 0) {
            si_comm_set_error(c, ncclSystemError, "rank %d: socket: %s",
                              c->rank, strerror(errno));
            return -1;
        }
        int e = connect(fd, (struct sockaddr *)&sa, len) == 0 ? 0 : errno;
        if (e == EINPROGRESS) {
            /* Unix sockets rarely get here: wait for the outcome */
            struct pollfd pf = {.fd = fd, .events = POLLOUT};
            socklen_t el = sizeof e;
            (void)poll(&pf, 1, 1000);
            if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el) != 0) e = errno;
        }
        if (e == 0) {
            if (same_user(fd)) return fd;
            /* the name is held by another user's process: never send it
             * the secret */
            close(fd);
            si_comm_set_error(c, ncclSystemError, "rank %d: rank %d's "
                              "rendezvous name is held by another user's "
                              "process", c->rank, j);
            return -1;
        }
        close(fd);
        if (e != ECONNREFUSED && e != ENOENT && e != EAGAIN &&
            e != EINPROGRESS) {
            si_comm_set_error(c, ncclSystemError, "rank %d: connect to rank "
                              "%d: %s", c->rank, j, strerror(e));
            return -1;
        }
        /* rank j has not bound its name yet (or its backlog is full) */
        if (si_nap(c, nap)) {
            si_comm_set_error(c, ncclSystemError, "rank %d: aborted while "
                              "waiting for rank %d to join", c->rank, j);
            return -1;
        }
        if (nap < 20) nap *= 2;
    }
}

/* Accept the next connection from a higher rank and check its hello. */
static int accept_one(ncclComm_t c) {
    for (;;) {
        int fd = accept4(c->listen_fd, NULL, NULL,
                         SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                si_comm_set_error(c, ncclSystemError, "rank %d: accept: %s",
                                  c->rank, strerror(errno));
                return -1;
            }
            struct pollfd pf[2] = {
                {.fd = c->listen_fd, .events = POLLIN},
                {.fd = c->wake[0], .events = POLLIN},
            };
            (void)poll(pf, 2, 100);
            if (atomic_load(&c->aborted)) {
                si_comm_set_error(c, ncclSystemError, "rank %d: aborted "
                                  "while waiting for higher ranks to join",
                                  c->rank);
                return -1;
            }
            continue;
        }
        if (!same_user(fd)) {       /* another user's process: ignore it */
            close(fd);
            continue;
        }
        int sz = SI_SOCKBUF;
        (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
        (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
        si_hello in, out;
        int from = -1;
        if (io_all(c, fd, &in, sizeof in, 0, -1, "the hello") != 0 ||
            hello_check(c, &in, -1, &from) != 0) {
            close(fd);
            return -1;
        }
        hello_fill(c, from, &out);
        if (io_all(c, fd, &out, sizeof out, 1, from, "the hello") != 0) {
            close(fd);
            return -1;
        }
        pthread_mutex_lock(&c->mu);
        c->fds[from] = fd;
        c->peer_device[from] = in.device;
        pthread_mutex_unlock(&c->mu);
        return 0;
    }
}

ncclResult_t si_connect_all(ncclComm_t c) {
    for (int j = 0; j < c->rank; j++) {
        int fd = connect_to(c, j);
        if (fd < 0) goto fail;
        si_hello out, in;
        int from = -1;
        hello_fill(c, j, &out);
        if (io_all(c, fd, &out, sizeof out, 1, j, "the hello") != 0 ||
            io_all(c, fd, &in, sizeof in, 0, j, "the hello") != 0 ||
            hello_check(c, &in, j, &from) != 0) {
            close(fd);
            goto fail;
        }
        pthread_mutex_lock(&c->mu);
        c->fds[j] = fd;
        c->peer_device[j] = in.device;
        pthread_mutex_unlock(&c->mu);
    }
    for (int k = c->rank + 1; k < c->world; k++)
        if (accept_one(c) != 0) goto fail;
    if (!c->multi_rank)
        for (int j = 0; j < c->world; j++)
            if (j != c->rank && c->peer_device[j] == c->device) {
                si_comm_set_error(c, ncclInvalidUsage, "rank %d: duplicate "
                                  "GPU: ranks %d and %d are both on emulated "
                                  "CUDA device %d; ranks may share a device "
                                  "only with NCCL_MULTI_RANK_GPU_ENABLE=1",
                                  c->rank, c->rank < j ? c->rank : j,
                                  c->rank < j ? j : c->rank, c->device);
                goto fail;
            }
    return ncclSuccess;
fail: {
        int st = atomic_load(&c->state);
        return si_is_error(st) ? (ncclResult_t)st : ncclSystemError;
    }
}
