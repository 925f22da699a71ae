/*
 * comm_host_internal.h -- what the two halves of the "host" (TCP) backend
 * share: comm_host_boot.c (rendezvous, handshake, full mesh) and
 * comm_host.c (framed transport, progress thread, vtable).  Not part of
 * the communicator API (comm.h).
 */
#ifndef RA_COMM_HOST_INTERNAL_H
#define RA_COMM_HOST_INTERNAL_H

#include <stdint.h>
#include <unistd.h>
#include "comm/comm.h"

/* ---- little-endian wire integers and fds ------------------------------- */

static inline void put32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static inline void put64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static inline uint32_t get32(const unsigned char *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static inline uint64_t get64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static inline void close_fd(int *fd) {
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
}

/* ---- comm_host_boot.c --------------------------------------------------- */

typedef enum { IO_OK = 0, IO_EOF, IO_ERR, IO_TIMEOUT } io_result;

/* Move exactly n bytes of a non-blocking socket before `deadline` (the
 * bootstrap, and the small ABORT reason); *err: errno on IO_ERR/IO_EOF. */
io_result ra_host_io_all(int fd, void *buf, size_t n, int writing,
                         double deadline, int *err);

/* Join the full mesh: fds[i] (size entries, -1 on entry) gets an
 * authenticated connection to every other rank.  On failure the error is
 * set and the fds made so far are left for the caller to close. */
ra_status ra_host_bootstrap(int rank, int size, int *fds,
                            const char *master_addr, int port,
                            const char *token, double deadline);

#endif /* RA_COMM_HOST_INTERNAL_H */
