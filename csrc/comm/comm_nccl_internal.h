/*
 * comm_nccl_internal.h -- the "nccl" backend's state, shared by its two
 * halves: comm_nccl.c (bootstrap, watchdog, abort, close) and
 * comm_nccl_xfer.c (one transfer from issue to completion).  Not part of
 * the communicator API (comm.h).
 *
 * Locks.  issue_mu serialises whole operations (a non-blocking NCCL
 * communicator must settle before the next call); nccl_mu guards every
 * single NCCL call and the handle (the watchdog and abort come from other
 * threads); lock guards the op list and the event pool.  Nesting:
 * issue_mu -> nccl_mu, and lock -> c->mu; lock and nccl_mu never nest.
 */
#ifndef RA_COMM_NCCL_INTERNAL_H
#define RA_COMM_NCCL_INTERNAL_H

#include "comm/nccl_loader.h"   /* comm.h, and the stubs' message without CUDA */

#include <stdio.h>

#ifdef RA_WITH_NCCL

#include <cuda_runtime.h>

#define POOL_MAX 64              /* completion events kept for reuse */

typedef struct nccl_op {
    ra_req *req;              /* the backend's reference */
    cudaEvent_t done;         /* recorded on the comm stream after the op */
    int staged;               /* host memory through device scratch */
    void *scratch;            /* staged: send bytes, then recv bytes */
    size_t scratch_bytes;
    struct nccl_op *next;
} nccl_op;

typedef struct nccl_state {
    ra_comm *c;
    int device;
    ncclComm_t nccl;          /* NULL once aborted or destroyed */
    cudaStream_t stream;      /* the communicator's own stream */
    cudaEvent_t ready;        /* caller's stream -> comm stream */
    ra_comm *host;            /* bootstrap and small collectives, or NULL */
    pthread_mutex_t issue_mu, nccl_mu, lock;
    pthread_cond_t cv;        /* wakes the watchdog */
    int sync_ready;           /* the three mutexes and cv exist */
    nccl_op *ops;             /* in flight */
    cudaEvent_t pool[POOL_MAX];
    int npool;
    pthread_t watchdog;
    int watchdog_running;
    int stop;                 /* under lock */
} nccl_state;

static inline int op_peer(const ra_req *r) {
    return r->x.src >= 0 ? r->x.src : r->x.dst;
}

/* "rank N", or for an all-to-all (no single peer) "its peers" */
static inline const char *op_peer_text(const ra_req *r, char *buf,
                                       size_t n) {
    if (op_peer(r) < 0)
        snprintf(buf, n, "its peers");
    else
        snprintf(buf, n, "rank %d", op_peer(r));
    return buf;
}

/* ---- comm_nccl_xfer.c --------------------------------------------------- */

/* Wait until the non-blocking communicator left ncclInProgress.  On failure
 * `err` says why (without prefix). */
ra_status ra_nccl_settle(nccl_state *nc, double deadline, double timeout,
                         char *err, size_t n);
/* Finish the op's request with `st` (if still pending), drop the backend's
 * reference and free the op.  Caller holds nc->lock, op is unlinked. */
void ra_nccl_op_retire_locked(nccl_state *nc, nccl_op *op, ra_status st,
                              const char *msg);
/* Fail every op still listed (abort, close). */
void ra_nccl_fail_all_ops(nccl_state *nc, const char *msg);
/* The vtable's sendrecv_start, wait and alltoall. */
ra_status ra_nccl_sendrecv_start(ra_comm *c, ra_req *r);
ra_status ra_nccl_wait(ra_comm *c, ra_req *r, double deadline);
ra_status ra_nccl_alltoall(ra_comm *c, const ra_a2a *a, double timeout);

#endif /* RA_WITH_NCCL */
#endif /* RA_COMM_NCCL_INTERNAL_H */
