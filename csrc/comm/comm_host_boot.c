/*
 * comm_host_boot.c -- joining the "host" (TCP) backend's full mesh, on the
 * caller's thread (GIL released by comm.c):
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
 * listener goes on.  The transport over the finished mesh is comm_host.c.
 */
#define _GNU_SOURCE
#include "comm/comm_host_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define HELLO_MAGIC 0x52414831u      /* "RAH1" */
#define TABLE_MAGIC 0x52415431u      /* "RAT1" */
#define HANDSHAKE_TIMEOUT 5.0        /* per accepted connection, run
                                      * concurrently (accept_peers) */
#define HANDSHAKE_TRIES 4            /* connect + handshake attempts when
                                      * the listener closes on us (it drops
                                      * its oldest pending handshake when a
                                      * flood of connections fills it) */

/* ---- small socket helpers ---------------------------------------------- */

static int poll_ms(double deadline, int cap_ms) {
    double left = deadline - ra_now();
    if (left <= 0) return 0;
    double ms = left * 1000.0 + 1.0;
    return ms > cap_ms ? cap_ms : (int)ms;
}

static int set_socket_opts(int fd) {
    int one = 1;
    int fl = fcntl(fd, F_GETFL, 0);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) return -1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return 0;
}


io_result ra_host_io_all(int fd, void *buf, size_t n, int writing,
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

/* *closed = 1 when the failure was the listener closing the connection:
 * a wrong token or world size, or a handshake dropped to make room. */
static ra_status hs_connect(int fd, const char *token, int rank, int size,
                            int peer, double deadline, int *closed) {
    unsigned char hello[20], resp[56], conf[36], mac[32];
    int err;
    io_result r;
    *closed = 0;
    if ((r = ra_host_io_all(fd, hello, sizeof hello, 0, deadline, &err)) !=
        IO_OK)
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
    if ((r = ra_host_io_all(fd, resp, sizeof resp, 1, deadline, &err)) !=
            IO_OK ||
        (r = ra_host_io_all(fd, conf, sizeof conf, 0, deadline, &err)) !=
            IO_OK)
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
    *closed = r == IO_EOF;
    if (r == IO_EOF)
        ra_set_error(RA_ERR_COMM,
                     "rank %d: init: rank %d closed the connection during "
                     "the handshake %d times (a different RINGATTN_TOKEN or "
                     "world size, or more connections at once than its "
                     "listener holds)", rank, peer, HANDSHAKE_TRIES);
    else
        ra_set_error(r == IO_TIMEOUT ? RA_ERR_TIMEOUT : RA_ERR_COMM,
                     "rank %d: init: handshake with rank %d: %s", rank, peer,
                     io_what(r, err));
    return r == IO_TIMEOUT ? RA_ERR_TIMEOUT : RA_ERR_COMM;
}

/* Connect to `peer` and prove the token, until the deadline: a listener
 * that closes the connection mid-handshake is tried again a few times
 * (HANDSHAKE_TRIES) before that counts as a refusal. */
static ra_status join_peer(struct in_addr ip, int port, const char *token,
                           int rank, int size, int peer, double deadline,
                           int *out_fd) {
    ra_status st = RA_ERR_COMM;
    double pause = 0.05;
    for (int attempt = 0; attempt < HANDSHAKE_TRIES; attempt++) {
        int closed = 0;
        RA_CHECK(connect_retry(ip, port, rank, peer, deadline, out_fd));
        st = hs_connect(*out_fd, token, rank, size, peer, deadline, &closed);
        if (st == RA_OK) return RA_OK;
        close_fd(out_fd);
        if (!closed || ra_now() + pause >= deadline) return st;
        struct timespec ts = {0, (long)(pause * 1e9)};
        nanosleep(&ts, NULL);
        pause *= 2;
    }
    return st;
}

/* The accept side runs every pending handshake at once, each a small state
 * machine over its non-blocking socket, so that an idle or slow connection
 * (a port scanner, a stuck client) never delays the ranks behind it: it
 * only holds one of MAX_PENDING slots until its HANDSHAKE_TIMEOUT, and the
 * oldest unauthenticated one is dropped when a new connection needs a
 * slot. */
#define MAX_PENDING 64

typedef enum {
    HS_SEND_HELLO, /* hello: magic, nonce_a                  */
    HS_RECV_RESP,  /* rank, size, nonce_c, mac_c             */
    HS_SEND_CONF,  /* rank, mac_a                            */
    HS_RECV_REG    /* rank 0 only: the peer's listener port  */
} hs_phase;

typedef struct {
    int fd;
    hs_phase phase;
    size_t done;               /* bytes of the current message moved */
    unsigned char msg[56];     /* the current message                */
    unsigned char na[16];      /* our nonce                          */
    double deadline;           /* the handshake's                    */
    double started;
    struct in_addr ip;
    int peer;                  /* once authenticated, else -1        */
} hs_conn;

static const size_t hs_len[] = {20, 56, 36, 4};

static void hs_drop(hs_conn *h, int *n, int i) {
    close(h[i].fd);
    h[i] = h[--*n];
}

/* Start a handshake on a freshly accepted connection. */
static ra_status hs_begin(hs_conn *h, int fd, struct in_addr ip,
                          double deadline) {
    memset(h, 0, sizeof *h);
    h->fd = fd;
    h->ip = ip;
    h->peer = -1;
    h->started = ra_now();
    h->deadline = h->started + HANDSHAKE_TIMEOUT;
    if (h->deadline > deadline) h->deadline = deadline;
    h->phase = HS_SEND_HELLO;
    RA_CHECK(ra_random_bytes(h->na, 16));
    put32(h->msg, HELLO_MAGIC);
    memcpy(h->msg + 4, h->na, 16);
    return RA_OK;
}

typedef enum { HS_MORE, HS_DONE, HS_REFUSED, HS_FATAL } hs_step;

/* Move bytes of h's current message while the socket allows; on a
 * complete message, act on it.  HS_FATAL: the error is set. */
static hs_step hs_advance(hs_conn *h, const char *token, int rank,
                          int size, int registering) {
    for (;;) {
        int writing = h->phase == HS_SEND_HELLO || h->phase == HS_SEND_CONF;
        size_t want = hs_len[h->phase];
        while (h->done < want) {
            ssize_t k = writing ? send(h->fd, h->msg + h->done, want - h->done,
                                       MSG_NOSIGNAL | MSG_DONTWAIT)
                                : recv(h->fd, h->msg + h->done,
                                       want - h->done, MSG_DONTWAIT);
            if (k > 0) {
                h->done += (size_t)k;
                continue;
            }
            if (k < 0 && errno == EINTR) continue;
            if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
                return HS_MORE;
            if (h->phase == HS_RECV_REG) {   /* an authenticated rank */
                ra_set_error(RA_ERR_COMM,
                             "rank %d: init: registration of rank %d: %s",
                             rank, h->peer,
                             k == 0 ? "the peer closed the connection"
                                    : strerror(errno));
                return HS_FATAL;
            }
            return HS_REFUSED;
        }
        h->done = 0;
        switch (h->phase) {
        case HS_SEND_HELLO:
            h->phase = HS_RECV_RESP;
            break;
        case HS_RECV_RESP: {
            uint32_t prank = get32(h->msg), psize = get32(h->msg + 4);
            unsigned char mac[32];
            hs_mac(token, 'c', h->na, h->msg + 8, prank, psize, mac);
            if (!ra_consttime_eq(mac, h->msg + 24, 32)) return HS_REFUSED;
            /* authenticated but misconfigured: fatal */
            if ((int)psize != size) {
                ra_set_error(RA_ERR_COMM,
                             "rank %d: init: peer claims world size %u, "
                             "expected %d (it says it is rank %u)",
                             rank, psize, size, prank);
                return HS_FATAL;
            }
            if (prank >= (uint32_t)size) {
                ra_set_error(RA_ERR_COMM,
                             "rank %d: init: peer claims rank %u, out of "
                             "range for world size %d (ranks 0..%d)",
                             rank, prank, size, size - 1);
                return HS_FATAL;
            }
            h->peer = (int)prank;
            unsigned char nc[16];
            memcpy(nc, h->msg + 8, 16);
            put32(h->msg, (uint32_t)rank);
            hs_mac(token, 'a', h->na, nc, (uint32_t)rank, (uint32_t)size,
                   h->msg + 4);
            h->phase = HS_SEND_CONF;
            break;
        }
        case HS_SEND_CONF:
            if (!registering) return HS_DONE;
            h->phase = HS_RECV_REG;
            break;
        case HS_RECV_REG:
            return HS_DONE;
        }
    }
}

/* Accept authenticated connections until every rank in `want` (a flag per
 * rank, cleared as they arrive) connected.  ports: registration data read
 * from each (rank 0 only, else NULL). */
static ra_status accept_peers(int lfd, const char *token, int rank, int size,
                              int *want, int nwant, int *fds, int *ports,
                              struct in_addr *ips, double deadline) {
    hs_conn h[MAX_PENDING];
    struct pollfd pfd[MAX_PENDING + 1];
    int n = 0;
    ra_status st = RA_OK;
    while (nwant > 0) {
        double now = ra_now();
        for (int i = n - 1; i >= 0; i--)   /* handshakes out of time */
            if (now >= h[i].deadline && h[i].phase != HS_RECV_REG)
                hs_drop(h, &n, i);
        int ms = poll_ms(deadline, 1000);
        if (ms <= 0) {
            int missing = -1;
            for (int i = 0; i < size; i++)
                if (want[i]) { missing = i; break; }
            ra_set_error(RA_ERR_TIMEOUT,
                         "rank %d: init: timed out waiting for rank %d to "
                         "connect (%d rank(s) missing)", rank, missing,
                         nwant);
            st = RA_ERR_TIMEOUT;
            goto out;
        }
        for (int i = 0; i < n; i++) {
            int w = poll_ms(h[i].deadline, ms);
            if (h[i].phase != HS_RECV_REG && w < ms) ms = w < 1 ? 1 : w;
        }
        pfd[0] = (struct pollfd){lfd, POLLIN, 0};
        for (int i = 0; i < n; i++) {
            int writing = h[i].phase == HS_SEND_HELLO ||
                          h[i].phase == HS_SEND_CONF;
            pfd[i + 1] = (struct pollfd){h[i].fd, writing ? POLLOUT : POLLIN,
                                         0};
        }
        int npfd = n + 1;
        if (poll(pfd, (nfds_t)npfd, ms) <= 0) continue;
        /* pending handshakes first: the slots they free serve new ones */
        for (int i = npfd - 2; i >= 0; i--) {
            if (pfd[i + 1].revents == 0) continue;
            hs_step s = hs_advance(&h[i], token, rank, size, ports != NULL);
            if (s == HS_FATAL) {
                st = RA_ERR_COMM;
                goto out;
            }
            if (s == HS_REFUSED) {       /* refused; the listener goes on */
                hs_drop(h, &n, i);
                continue;
            }
            if (s == HS_MORE) continue;
            int peer = h[i].peer;
            if (peer == rank || !want[peer]) {
                ra_set_error(RA_ERR_COMM,
                             "rank %d: init: unexpected connection from rank "
                             "%d (two processes with the same rank?)", rank,
                             peer);
                st = RA_ERR_COMM;
                goto out;
            }
            if (ports != NULL) {
                ports[peer] = (int)get32(h[i].msg);
                ips[peer] = h[i].ip;
            }
            want[peer] = 0;
            fds[peer] = h[i].fd;
            h[i] = h[--n];                   /* the fd is the peer's now */
            nwant--;
        }
        if (!(pfd[0].revents & POLLIN)) continue;
        for (;;) {
            struct sockaddr_in sa;
            socklen_t sl = sizeof sa;
            int fd = accept4(lfd, (struct sockaddr *)&sa, &sl, SOCK_CLOEXEC);
            if (fd < 0) break;
            if (set_socket_opts(fd) < 0) {
                close(fd);
                continue;
            }
            if (n == MAX_PENDING) {     /* drop the oldest unauthenticated */
                int oldest = -1;
                for (int i = 0; i < n; i++)
                    if (h[i].peer < 0 &&
                        (oldest < 0 || h[i].started < h[oldest].started))
                        oldest = i;
                if (oldest < 0) {
                    close(fd);
                    continue;
                }
                hs_drop(h, &n, oldest);
            }
            st = hs_begin(&h[n], fd, sa.sin_addr, deadline);
            if (st != RA_OK) {
                close(fd);
                goto out;
            }
            n++;
        }
    }
out:
    while (n > 0) hs_drop(h, &n, n - 1);
    return st;
}

ra_status ra_host_bootstrap(int rank, int size, int *fds,
                            const char *master_addr, int port,
                            const char *token, double deadline) {
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
                                  fds, ports, ips, deadline), st, out);
        put32(table, TABLE_MAGIC);
        put32(table + 4, (uint32_t)size);
        for (int i = 0; i < size; i++) {
            memcpy(table + 8 + 8 * i, &ips[i], 4);
            put32(table + 12 + 8 * i, (uint32_t)ports[i]);
        }
        for (int i = 1; i < size; i++) {
            r = ra_host_io_all(fds[i], table, tlen, 1, deadline, &err);
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
    RA_CHECKGOTO(join_peer(master, port, token, rank, size, 0, deadline,
                           &fds[0]), st, out);
    struct sockaddr_in me;
    socklen_t sl = sizeof me;
    getsockname(fds[0], (struct sockaddr *)&me, &sl);
    RA_CHECKGOTO(listen_on(me.sin_addr, 0, size + 8, rank, &lfd, &lport), st,
                 out);
    unsigned char reg[4];
    put32(reg, (uint32_t)lport);
    if ((r = ra_host_io_all(fds[0], reg, 4, 1, deadline, &err)) != IO_OK ||
        (r = ra_host_io_all(fds[0], table, tlen, 0, deadline, &err)) !=
            IO_OK) {
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
        RA_CHECKGOTO(join_peer(ip, pport, token, rank, size, i, deadline,
                               &fds[i]), st, out);
    }
    for (int k = rank + 1; k < size; k++) want[k] = 1;
    RA_CHECKGOTO(accept_peers(lfd, token, rank, size, want, size - 1 - rank,
                              fds, NULL, NULL, deadline), st, out);
out:
    close_fd(&lfd);
    ra_host_free(table, tlen);
    ra_host_free(ips, sizeof(struct in_addr) * size);
    ra_host_free(ports, sizeof(int) * (size_t)size);
    ra_host_free(want, sizeof(int) * (size_t)size);
    return st;
}
