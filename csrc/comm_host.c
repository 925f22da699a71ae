/*
 * comm_host.c -- the "host" backend: TCP sockets between CPU ranks.
 *
 * Bootstrap (on the caller's thread, GIL released by comm.c):
 *   1. rank 0 listens on (master_addr, port); rank j > 0 connects to it
 *      (retrying until rank 0 is up), proves the token, and registers the
 *      port of its own listener (bound on the address it reached rank 0
 *      from);
 *   2. once every rank registered, rank 0 sends the address table back;
 *   3. rank j connects to every rank 0 < i < j and accepts every k > j, so
 *      the ranks form a full mesh (the connection to rank 0 is the one
 *      made in step 1).
 * Every connection runs a challenge-response over HMAC-SHA256 keyed with
 * the token, both ways; a connection that fails it is closed and the
 * listener goes on.
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
#include "comm.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define FRAME_MAGIC 0x52414631u      /* "RAF1" */
#define HELLO_MAGIC 0x52414831u      /* "RAH1" */
#define TABLE_MAGIC 0x52415431u      /* "RAT1" */
#define FRAME_HDR 24
#define FRAME_ABORT 9                /* kind: the sender failed */
#define IO_CHUNK ((size_t)4 << 20)   /* bytes per send()/recv() call */
#define ABORT_REASON_MAX 1024
#define HANDSHAKE_TIMEOUT 5.0        /* per accepted connection */

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

/* ---- small socket helpers ---------------------------------------------- */

static void put32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static void put64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static uint32_t get32(const unsigned char *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static uint64_t get64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static int poll_ms(double deadline, int cap_ms) {
    double left = deadline - ra_now();
    if (left <= 0) return 0;
    double ms = left * 1000.0 + 1.0;
    return ms > cap_ms ? cap_ms : (int)ms;
}

static void close_fd(int *fd) {
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
}

static int set_socket_opts(int fd) {
    int one = 1;
    int fl = fcntl(fd, F_GETFL, 0);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) return -1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return 0;
}

typedef enum { IO_OK = 0, IO_EOF, IO_ERR, IO_TIMEOUT } io_result;

/* Move exactly n bytes (bootstrap only) before `deadline`. */
static io_result io_all(int fd, void *buf, size_t n, int writing,
                        double deadline, int *err) {
    unsigned char *p = buf;
    size_t done = 0;
    *err = 0;
    while (done < n) {
        ssize_t k = writing
                        ? send(fd, p + done, n - done,
                               MSG_NOSIGNAL | MSG_DONTWAIT)
                        : recv(fd, p + done, n - done, MSG_DONTWAIT);
        if (k > 0) {
            done += (size_t)k;
            continue;
        }
        if (k == 0 && !writing) return IO_EOF;
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
            *err = errno;
            return (errno == EPIPE || errno == ECONNRESET) ? IO_EOF : IO_ERR;
        }
        int ms = poll_ms(deadline, 1000);
        if (ms <= 0) return IO_TIMEOUT;
        struct pollfd pfd = {fd, writing ? POLLOUT : POLLIN, 0};
        if (poll(&pfd, 1, ms) < 0 && errno != EINTR) {
            *err = errno;
            return IO_ERR;
        }
    }
    return IO_OK;
}

static const char *io_what(io_result r, int err) {
    switch (r) {
    case IO_EOF: return "the peer closed the connection";
    case IO_TIMEOUT: return "timed out";
    default: return err ? strerror(err) : "I/O error";
    }
}

static ra_status resolve_ipv4(const char *host, struct in_addr *out,
                              int rank) {
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(host, NULL, &hints, &res);
    if (rc != 0 || res == NULL) {
        ra_set_error(RA_ERR_COMM,
                     "rank %d: init: cannot resolve master_addr '%s': %s",
                     rank, host, gai_strerror(rc));
        return RA_ERR_COMM;
    }
    *out = ((struct sockaddr_in *)res->ai_addr)->sin_addr;
    freeaddrinfo(res);
    return RA_OK;
}

static ra_status listen_on(struct in_addr ip, int port, int backlog,
                           int rank, int *out_fd, int *out_port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        ra_set_error(RA_ERR_COMM, "rank %d: init: socket: %s", rank,
                     strerror(errno));
        return RA_ERR_COMM;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr = ip;
    sa.sin_port = htons((uint16_t)port);
    char ipstr[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &ip, ipstr, sizeof ipstr);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 ||
        listen(fd, backlog) < 0 || set_socket_opts(fd) < 0) {
        ra_set_error(RA_ERR_COMM, "rank %d: init: cannot listen on %s:%d: %s",
                     rank, ipstr, port, strerror(errno));
        close(fd);
        return RA_ERR_COMM;
    }
    socklen_t len = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &len);
    *out_fd = fd;
    *out_port = ntohs(sa.sin_port);
    return RA_OK;
}

/* Connect, retrying while nobody listens yet, until the deadline. */
static ra_status connect_retry(struct in_addr ip, int port, int rank,
                               int peer, double deadline, int *out_fd) {
    char ipstr[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &ip, ipstr, sizeof ipstr);
    double pause = 0.02;
    int last_err = 0;
    while (ra_now() < deadline) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || set_socket_opts(fd) < 0) {
            ra_set_error(RA_ERR_COMM, "rank %d: init: socket: %s", rank,
                         strerror(errno));
            if (fd >= 0) close(fd);
            return RA_ERR_COMM;
        }
        struct sockaddr_in sa;
        memset(&sa, 0, sizeof sa);
        sa.sin_family = AF_INET;
        sa.sin_addr = ip;
        sa.sin_port = htons((uint16_t)port);
        int rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
        if (rc < 0 && errno == EINPROGRESS) {
            struct pollfd pfd = {fd, POLLOUT, 0};
            int n;
            do {
                n = poll(&pfd, 1, poll_ms(deadline, 1000));
            } while (n < 0 && errno == EINTR);
            int soerr = 0;
            socklen_t sl = sizeof soerr;
            if (n > 0 &&
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) == 0 &&
                soerr == 0)
                rc = 0;
            else
                errno = n > 0 ? soerr : ETIMEDOUT;
        }
        if (rc == 0) {
            *out_fd = fd;
            return RA_OK;
        }
        last_err = errno;
        close(fd);
        struct timespec ts = {0, (long)(pause * 1e9)};
        nanosleep(&ts, NULL);
        if (pause < 0.5) pause *= 2;
    }
    ra_set_error(RA_ERR_TIMEOUT,
                 "rank %d: init: timed out connecting to rank %d at %s:%d "
                 "(%s)", rank, peer, ipstr, port,
                 last_err ? strerror(last_err) : "no answer");
    return RA_ERR_TIMEOUT;
}

/* ---- handshake --------------------------------------------------------- */
/* acceptor -> connector: HELLO magic, nonce_a[16]                 (20 B)
 * connector -> acceptor: rank, size, nonce_c[16], mac_c[32]      (56 B)
 * acceptor -> connector: rank, mac_a[32]                          (36 B)
 * mac_x = HMAC(token, tag_x | nonce_a | nonce_c | rank_x | size) */

static void hs_mac(const char *token, char tag, const unsigned char *na,
                   const unsigned char *nc, uint32_t rank, uint32_t size,
                   unsigned char mac[32]) {
    unsigned char msg[1 + 16 + 16 + 8];
    msg[0] = (unsigned char)tag;
    memcpy(msg + 1, na, 16);
    memcpy(msg + 17, nc, 16);
    put32(msg + 33, rank);
    put32(msg + 37, size);
    ra_hmac_sha256(token, strlen(token), msg, sizeof msg, mac);
}

/* Accept side.  Returns RA_OK and the peer's rank, or RA_ERR_COMM when the
 * peer failed the check (the caller drops the connection and goes on). */
static ra_status hs_accept(int fd, const char *token, int rank, int size,
                           double deadline, int *peer_rank, char *why,
                           size_t whylen) {
    unsigned char hello[20], resp[56], conf[36], na[16], mac[32];
    int err;
    io_result r;
    RA_CHECK(ra_random_bytes(na, 16));
    put32(hello, HELLO_MAGIC);
    memcpy(hello + 4, na, 16);
    if ((r = io_all(fd, hello, sizeof hello, 1, deadline, &err)) != IO_OK ||
        (r = io_all(fd, resp, sizeof resp, 0, deadline, &err)) != IO_OK) {
        snprintf(why, whylen, "handshake: %s", io_what(r, err));
        return RA_ERR_COMM;
    }
    uint32_t prank = get32(resp), psize = get32(resp + 4);
    hs_mac(token, 'c', na, resp + 8, prank, psize, mac);
    if (!ra_consttime_eq(mac, resp + 24, 32)) {
        snprintf(why, whylen, "wrong token");
        return RA_ERR_COMM;
    }
    if ((int)psize != size || (int)prank < 0 || (int)prank >= size) {
        snprintf(why, whylen, "peer claims rank %u of world size %u, "
                 "expected world size %d", prank, psize, size);
        return RA_ERR_VALUE;   /* authenticated but misconfigured: fatal */
    }
    put32(conf, (uint32_t)rank);
    hs_mac(token, 'a', na, resp + 8, (uint32_t)rank, (uint32_t)size,
           conf + 4);
    if ((r = io_all(fd, conf, sizeof conf, 1, deadline, &err)) != IO_OK) {
        snprintf(why, whylen, "handshake: %s", io_what(r, err));
        return RA_ERR_COMM;
    }
    *peer_rank = (int)prank;
    return RA_OK;
}

static ra_status hs_connect(int fd, const char *token, int rank, int size,
                            int peer, double deadline) {
    unsigned char hello[20], resp[56], conf[36], mac[32];
    int err;
    io_result r;
    if ((r = io_all(fd, hello, sizeof hello, 0, deadline, &err)) != IO_OK)
        goto io_fail;
    if (get32(hello) != HELLO_MAGIC) {
        ra_set_error(RA_ERR_COMM,
                     "rank %d: init: rank %d's address answers with a "
                     "foreign protocol", rank, peer);
        return RA_ERR_COMM;
    }
    put32(resp, (uint32_t)rank);
    put32(resp + 4, (uint32_t)size);
    RA_CHECK(ra_random_bytes(resp + 8, 16));
    hs_mac(token, 'c', hello + 4, resp + 8, (uint32_t)rank, (uint32_t)size,
           resp + 24);
    if ((r = io_all(fd, resp, sizeof resp, 1, deadline, &err)) != IO_OK ||
        (r = io_all(fd, conf, sizeof conf, 0, deadline, &err)) != IO_OK)
        goto io_fail;
    hs_mac(token, 'a', hello + 4, resp + 8, get32(conf), (uint32_t)size, mac);
    if (!ra_consttime_eq(mac, conf + 4, 32) || (int)get32(conf) != peer) {
        ra_set_error(RA_ERR_COMM,
                     "rank %d: init: rank %d failed the token check "
                     "(a different job or a different RINGATTN_TOKEN)",
                     rank, peer);
        return RA_ERR_COMM;
    }
    return RA_OK;
io_fail:
    if (r == IO_EOF)
        ra_set_error(RA_ERR_COMM,
                     "rank %d: init: rank %d refused the connection "
                     "(wrong token or a different world size?)", rank, peer);
    else
        ra_set_error(r == IO_TIMEOUT ? RA_ERR_TIMEOUT : RA_ERR_COMM,
                     "rank %d: init: handshake with rank %d: %s", rank, peer,
                     io_what(r, err));
    return r == IO_TIMEOUT ? RA_ERR_TIMEOUT : RA_ERR_COMM;
}

/* Accept authenticated connections until every rank in `want` (a flag per
 * rank, cleared as they arrive) connected.  ports: registration data read
 * from each (rank 0 only, else NULL). */
static ra_status accept_peers(int lfd, const char *token, int rank, int size,
                              int *want, int nwant, int *fds, int *ports,
                              struct in_addr *ips, double deadline) {
    while (nwant > 0) {
        struct pollfd pfd = {lfd, POLLIN, 0};
        int ms = poll_ms(deadline, 1000);
        if (ms <= 0) {
            int missing = -1;
            for (int i = 0; i < size; i++)
                if (want[i]) { missing = i; break; }
            ra_set_error(RA_ERR_TIMEOUT,
                         "rank %d: init: timed out waiting for rank %d to "
                         "connect (%d rank(s) missing)", rank, missing,
                         nwant);
            return RA_ERR_TIMEOUT;
        }
        if (poll(&pfd, 1, ms) <= 0) continue;
        struct sockaddr_in sa;
        socklen_t sl = sizeof sa;
        int fd = accept4(lfd, (struct sockaddr *)&sa, &sl, SOCK_CLOEXEC);
        if (fd < 0) continue;
        if (set_socket_opts(fd) < 0) {
            close(fd);
            continue;
        }
        double hs_deadline = ra_now() + HANDSHAKE_TIMEOUT;
        if (hs_deadline > deadline) hs_deadline = deadline;
        int peer = -1;
        char why[256] = "";
        ra_status st = hs_accept(fd, token, rank, size, hs_deadline, &peer,
                                 why, sizeof why);
        if (st == RA_ERR_VALUE) {
            close(fd);
            ra_set_error(RA_ERR_COMM, "rank %d: init: %s", rank, why);
            return RA_ERR_COMM;
        }
        if (st != RA_OK) {       /* refused; the listener goes on */
            close(fd);
            continue;
        }
        if (peer == rank || !want[peer]) {
            close(fd);
            ra_set_error(RA_ERR_COMM,
                         "rank %d: init: unexpected connection from rank %d "
                         "(two processes with the same rank?)", rank, peer);
            return RA_ERR_COMM;
        }
        if (ports != NULL) {
            unsigned char reg[4];
            int err;
            io_result r = io_all(fd, reg, 4, 0, deadline, &err);
            if (r != IO_OK) {
                close(fd);
                ra_set_error(RA_ERR_COMM,
                             "rank %d: init: registration of rank %d: %s",
                             rank, peer, io_what(r, err));
                return RA_ERR_COMM;
            }
            ports[peer] = (int)get32(reg);
            ips[peer] = sa.sin_addr;
        }
        want[peer] = 0;
        fds[peer] = fd;
        nwant--;
    }
    return RA_OK;
}

static ra_status bootstrap(ra_comm *c, host_impl *h, const char *master_addr,
                           int port, const char *token, double deadline) {
    int rank = c->rank, size = c->size;
    ra_status st = RA_OK;
    int lfd = -1, lport = 0;
    struct in_addr master;
    int *want = ra_host_calloc(sizeof(int) * (size_t)size);
    int *ports = ra_host_calloc(sizeof(int) * (size_t)size);
    struct in_addr *ips = ra_host_calloc(sizeof(struct in_addr) * size);
    size_t tlen = 8 + 8 * (size_t)size;
    unsigned char *table = ra_host_alloc(tlen);
    if (!want || !ports || !ips || !table) {
        st = RA_ERR_NOMEM;
        goto out;
    }
    RA_CHECKGOTO(resolve_ipv4(master_addr, &master, rank), st, out);
    int err;
    io_result r;
    if (rank == 0) {
        RA_CHECKGOTO(listen_on(master, port, size + 8, rank, &lfd, &lport),
                     st, out);
        for (int i = 1; i < size; i++) want[i] = 1;
        RA_CHECKGOTO(accept_peers(lfd, token, rank, size, want, size - 1,
                                  h->fds, ports, ips, deadline), st, out);
        put32(table, TABLE_MAGIC);
        put32(table + 4, (uint32_t)size);
        for (int i = 0; i < size; i++) {
            memcpy(table + 8 + 8 * i, &ips[i], 4);
            put32(table + 12 + 8 * i, (uint32_t)ports[i]);
        }
        for (int i = 1; i < size; i++) {
            r = io_all(h->fds[i], table, tlen, 1, deadline, &err);
            if (r != IO_OK) {
                ra_set_error(RA_ERR_COMM,
                             "rank 0: init: sending the address table to "
                             "rank %d: %s", i, io_what(r, err));
                st = RA_ERR_COMM;
                goto out;
            }
        }
        goto out;
    }
    /* rank > 0: register with rank 0 */
    RA_CHECKGOTO(connect_retry(master, port, rank, 0, deadline, &h->fds[0]),
                 st, out);
    RA_CHECKGOTO(hs_connect(h->fds[0], token, rank, size, 0, deadline), st,
                 out);
    struct sockaddr_in me;
    socklen_t sl = sizeof me;
    getsockname(h->fds[0], (struct sockaddr *)&me, &sl);
    RA_CHECKGOTO(listen_on(me.sin_addr, 0, size + 8, rank, &lfd, &lport), st,
                 out);
    unsigned char reg[4];
    put32(reg, (uint32_t)lport);
    if ((r = io_all(h->fds[0], reg, 4, 1, deadline, &err)) != IO_OK ||
        (r = io_all(h->fds[0], table, tlen, 0, deadline, &err)) != IO_OK) {
        ra_set_error(r == IO_TIMEOUT ? RA_ERR_TIMEOUT : RA_ERR_COMM,
                     "rank %d: init: waiting for the address table from "
                     "rank 0: %s", rank, io_what(r, err));
        st = r == IO_TIMEOUT ? RA_ERR_TIMEOUT : RA_ERR_COMM;
        goto out;
    }
    if (get32(table) != TABLE_MAGIC || (int)get32(table + 4) != size) {
        ra_set_error(RA_ERR_COMM, "rank %d: init: bad address table from "
                     "rank 0", rank);
        st = RA_ERR_COMM;
        goto out;
    }
    for (int i = 1; i < rank; i++) {
        struct in_addr ip;
        memcpy(&ip, table + 8 + 8 * i, 4);
        int pport = (int)get32(table + 12 + 8 * i);
        RA_CHECKGOTO(connect_retry(ip, pport, rank, i, deadline, &h->fds[i]),
                     st, out);
        RA_CHECKGOTO(hs_connect(h->fds[i], token, rank, size, i, deadline),
                     st, out);
    }
    for (int k = rank + 1; k < size; k++) want[k] = 1;
    RA_CHECKGOTO(accept_peers(lfd, token, rank, size, want, size - 1 - rank,
                              h->fds, NULL, NULL, deadline), st, out);
out:
    close_fd(&lfd);
    ra_host_free(table, tlen);
    ra_host_free(ips, sizeof(struct in_addr) * size);
    ra_host_free(ports, sizeof(int) * (size_t)size);
    ra_host_free(want, sizeof(int) * (size_t)size);
    return st;
}

/* ---- progress thread --------------------------------------------------- */

static void wake_thread(host_impl *h) {
    char b = 1;
    if (h->wake[1] >= 0) {
        ssize_t rc = write(h->wake[1], &b, 1);
        (void)rc;
    }
}

static const char *kind_name(uint32_t k) {
    switch (k) {
    case RA_XFER_DATA: return "sendrecv";
    case RA_XFER_BARRIER: return "barrier";
    case RA_XFER_GATHER: return "allgather";
    case FRAME_ABORT: return "abort";
    default: return "unknown";
    }
}

typedef struct xfer_state {
    unsigned char hout[FRAME_HDR];
    size_t hout_sent;
    unsigned char hin[FRAME_HDR];
    size_t hin_got;
} xfer_state;

/* Read a peer's ABORT reason (small; sent in one piece) for the message. */
static void read_abort_reason(int fd, uint64_t n, char *out, size_t outlen) {
    char buf[ABORT_REASON_MAX + 1];
    if (n > ABORT_REASON_MAX) n = ABORT_REASON_MAX;
    int err;
    if (io_all(fd, buf, (size_t)n, 0, ra_now() + 1.0, &err) != IO_OK) n = 0;
    buf[n] = '\0';
    snprintf(out, outlen, "%s", n ? buf : "(no reason given)");
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
            snprintf(msg, mlen, "%speer rank %d closed the connection", pre,
                     src);
            return RA_ERR_COMM;
        }
        if (k < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return RA_OK;
            h->broken[src] = 1;
            if (errno == ECONNRESET)
                snprintf(msg, mlen, "%speer rank %d closed the connection",
                         pre, src);
            else
                snprintf(msg, mlen, "%sconnection to rank %d failed: %s",
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
                snprintf(msg, mlen, "%scorrupt frame from rank %d (bad magic)",
                         pre, src);
                return RA_ERR_COMM;
            }
            if (kind == FRAME_ABORT) {
                char why[ABORT_REASON_MAX + 1];
                read_abort_reason(fd, n, why, sizeof why);
                h->broken[src] = 1;
                snprintf(msg, mlen, "%speer rank %d failed: %.360s", pre,
                         src, why);
                return RA_ERR_COMM;
            }
            if (kind != (uint32_t)r->x.kind) {
                snprintf(msg, mlen,
                         "%soperation mismatch: rank %d sent a %s message "
                         "while this rank expects %s", pre, src,
                         kind_name(kind), kind_name((uint32_t)r->x.kind));
                return RA_ERR_COMM;
            }
            if (step != r->x.step) {
                snprintf(msg, mlen,
                         "%sstep mismatch: rank %d sent step %lld, this rank "
                         "expects step %lld", pre, src, (long long)step,
                         (long long)r->x.step);
                return RA_ERR_COMM;
            }
            if (n != (uint64_t)r->x.recv_nbytes) {
                snprintf(msg, mlen,
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
                snprintf(msg, mlen, "%speer rank %d closed the connection",
                         pre, dst);
            else
                snprintf(msg, mlen, "%sconnection to rank %d failed: %s",
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
            snprintf(msg, mlen, "%s", c->fail_msg);
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
            snprintf(msg, mlen, "%spoll failed: %s", pre, strerror(errno));
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
    snprintf(reason, sizeof reason, "%s", c->fail_msg);
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
        RA_CHECKGOTO(bootstrap(c, h, master_addr ? master_addr : "127.0.0.1",
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
