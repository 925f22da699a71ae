/*
 * comm.h -- the communicator core, independent of Python.
 *
 * A communicator (ra_comm) joins `size` ranks.  Its one data primitive is
 * sendrecv: send a contiguous byte range to rank `dst` and receive one from
 * rank `src`, both at once, started asynchronously (a request) and waited
 * on with a deadline.  barrier and allgather are built on that primitive in
 * comm_core.c unless a backend brings its own.
 *
 * Layers (files of csrc/comm/, which uses csrc/core/ and nothing of attn/):
 *   comm.c          Python type Comm: argument checks, GIL handling,
 *                   dispatch through the vtable (comm_py.h shares it with
 *                   comm_request.c, Request, comm_create.c, ThreadsGroup
 *                   and the host_comm/nccl_comm constructors, and
 *                   comm_groups.c, Comm.split and Comm.alltoall)
 *   comm_core.c     failure state, deadlines, generic collectives
 *                   (barrier, allgather, alltoall from sendrecv)
 *   comm_split.c    sub-communicators: ra_comm_split
 *   comm_host.c     TCP backend ("host"): the vtable; comm_host_engine.c
 *                   its progress thread (frames matched by context);
 *                   comm_host_boot.c joins its full mesh
 *   comm_threads.c  in-process backend ("threads"); comm_threads_split.c
 *                   the splits on it and who left them; comm_threads_cuda.c
 *                   its device memory (a group with devices)
 *   comm_auth.c     SHA-256 / HMAC for the host handshake
 *   comm_nccl.c     NCCL backend ("nccl"), device pointers on a CUDA stream:
 *                   bootstrap, watchdog, close; comm_nccl_xfer.c one
 *                   transfer; nccl_loader.c opens libnccl
 *
 * Threading: every function here may run without the GIL.  Error text is
 * kept in the request or the communicator (not the thread-local last error)
 * while work happens on a progress thread; the functions a caller thread
 * calls copy it into ra_set_error() before returning a failing status.
 */
#ifndef RA_COMM_H
#define RA_COMM_H

#include <pthread.h>
#include <stdatomic.h>
#include "core/ra_common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RA_COMM_DEFAULT_TIMEOUT 300.0
#define RA_COMM_MSG_LEN 512
/* allgather items are small host values (shard lengths, pickled summaries) */
#define RA_ALLGATHER_MAX ((size_t)1 << 20)

/* What a transfer carries; the kind travels in the frame header so that a
 * barrier never matches a data transfer. */
typedef enum ra_xfer_kind {
    RA_XFER_DATA = 1,
    RA_XFER_BARRIER = 2,
    RA_XFER_GATHER = 3,
    RA_XFER_ALLTOALL = 4
} ra_xfer_kind;

/* The kind on the wire: the ra_xfer_kind in the low bits, and above them
 * the context of a split that shares its parent's transport (comm_split.c),
 * so that transfers of two communicators never match each other. */
#define RA_XFER_KIND_BITS 8
#define RA_XFER_KIND_MASK ((1 << RA_XFER_KIND_BITS) - 1)
#define RA_XFER_MAX_CONTEXT ((1u << (31 - RA_XFER_KIND_BITS)) - 1)

/* The context a wire kind carries (0: the transport's own communicator). */
static inline uint32_t ra_xfer_context(int kind) {
    return (uint32_t)kind >> RA_XFER_KIND_BITS;
}

/* One sendrecv: either side may be absent (peer < 0).  Pointers are host
 * memory for host/threads, device memory of `device_id` for nccl and for
 * threads with devices (device_type RA_DEV_CUDA; stream as for nccl, the
 * ordering in comm_threads_cuda.c).  nccl:
 * the transfer runs on the communicator's own stream after the work queued
 * so far on `stream` (a cudaStream_t; NULL = ringattn's compute stream of
 * the device), and waiting orders `stream` after the transfer.  Host
 * pointers (device_type RA_DEV_CPU) on nccl are staged through device
 * memory; comm_core.c's generic collectives use that. */
typedef struct ra_xfer {
    int kind;                 /* ra_xfer_kind */
    int64_t step;             /* ring step, checked against the peer's */
    const void *send;
    size_t send_nbytes;
    int dst;                  /* -1: nothing to send */
    void *recv;
    size_t recv_nbytes;
    int src;                  /* -1: nothing to receive */
    int device_type;          /* ra_device_type */
    int device_id;
    void *stream;
    /* The same operation's other direction with each peer, when known
     * (back_known; zeroed: unknown): the bytes this rank receives from dst
     * and the bytes it sends to src.  host carries the first in the frame
     * header and checks the peer's against the second, so that a size
     * mismatch fails both ranks, not only the receiver (comm_core.c fills
     * them for an all-to-all and for an exchange with one peer). */
    int back_known;
    size_t recv_from_dst;
    size_t send_to_src;
} ra_xfer;

typedef enum ra_req_state {
    RA_REQ_PENDING = 0,
    RA_REQ_DONE = 1,
    RA_REQ_FAILED = 2
} ra_req_state;

typedef struct ra_comm ra_comm;

/* One all-to-all: block i of `send` goes to rank i and block i of `recv`
 * comes from rank i (arrays of `size` entries; a block may be empty; the
 * sizes a pair exchanges must agree, and a mismatch fails both ranks
 * where the backend can see it).  Memory as in ra_xfer.  Receive blocks
 * may not overlap each other; a send block may overlap receive blocks (in
 * place, as MPI_IN_PLACE: what is sent is the send blocks' content at the
 * call): such blocks are copied aside first (ra_a2a_staged). */
typedef struct ra_a2a {
    const void *const *send;
    const size_t *send_nbytes;
    void *const *recv;
    const size_t *recv_nbytes;
    int device_type;          /* ra_device_type */
    int device_id;
    void *stream;             /* nccl: as ra_xfer.stream */
} ra_a2a;

/* A request in flight.  Owned by two parties (the caller and the backend
 * that progresses it); freed when both released it.  Memory comes from
 * PyMem_RawMalloc-compatible ra_host_alloc since threads without the GIL
 * touch it. */
typedef struct ra_req {
    ra_comm *comm;            /* where it runs: the transport of a split */
    ra_xfer x;
    const char *op;           /* "sendrecv", "barrier", "allgather",
                               * "alltoall" */
    double timeout;           /* seconds, for messages */
    double deadline;          /* absolute, ra_now() clock */
    _Atomic int state;        /* ra_req_state */
    ra_status status;
    char msg[RA_COMM_MSG_LEN];
    _Atomic int refs;
    struct ra_req *next;      /* backend queue link (threads: send queue) */
    struct ra_req *next_recv; /* threads: receive queue link */
    /* backend progress state */
    size_t sent, received;
    int send_done, recv_done;
    int copying;              /* threads: copies running outside the lock */
    int doomed;               /* threads: fail once the copies finished */
    /* failed because its split was closed, here or by a member: fails the
     * split on this rank, not the transport it shares (set before the
     * request finishes) */
    int ctx_closed;
    void *impl;               /* backend extra (nccl: CUDA event) */
} ra_req;

/* The backend vtable.  All functions run without the GIL.  Deadlines are
 * absolute times on the ra_now() clock.  A failing call returns a status
 * and leaves the message in the request (req-level calls) or calls
 * ra_comm_fail (comm-level), never ra_set_error from a foreign thread. */
typedef struct ra_comm_vtable {
    const char *name;
    /* Device memory the backend moves: RA_DEV_CPU for host/threads
     * (CUDA host memory is accepted too), RA_DEV_CUDA for nccl and for
     * threads with devices. */
    int device_type;
    ra_status (*sendrecv_start)(ra_comm *c, ra_req *req);
    /* Wait until the request is done or failed, or the deadline passes;
     * on return the backend no longer touches the request's memory. */
    ra_status (*wait)(ra_comm *c, ra_req *req, double deadline);
    /* Optional; NULL = generic versions in comm_core.c. */
    ra_status (*barrier)(ra_comm *c, double timeout);
    ra_status (*allgather)(ra_comm *c, const void *in, size_t nbytes,
                           void **out, size_t *out_total, size_t *lens,
                           double timeout);
    /* Optional; NULL = pairwise sendrecv steps in comm_core.c.  Called
     * with the communicator usable and timeout > 0; on failure the
     * communicator is failed and the error set (ra_set_error). */
    ra_status (*alltoall)(ra_comm *c, const ra_a2a *a, double timeout);
    /* Wake every waiter and stop all transfers (the comm is already marked
     * failed); safe from any thread, repeatable. */
    void (*abort)(ra_comm *c);
    /* Stop: finish pending requests as failed, stop threads, shut the
     * transport down; bounded time; called once.  Other threads may still
     * call into the backend afterwards (and get "closed" errors). */
    void (*close)(ra_comm *c);
    /* Transports that splits share (host, threads; comm_split.c).  open:
     * the split `view` (context, members) starts on transport t, before
     * its first transfer.  close: it stops; its requests in flight on this
     * rank fail at once ("communicator is closed"), the other members are
     * told, and theirs fail too ("peer rank R closed this communicator"),
     * their splits failing with them; the transport and its other
     * communicators carry on.  Both once per split, without the GIL. */
    ra_status (*context_open)(ra_comm *t, ra_comm *view);
    void (*context_close)(ra_comm *t, ra_comm *view);
    /* Optional: r ran out of time waiting for `peer`; if that peer is in an
     * operation of another communicator with this rank (a split and its
     * parent used in another order), say so in buf (else leave it ""). */
    void (*stall_hint)(ra_comm *c, ra_req *r, int peer, char *buf,
                       size_t n);
    /* Free the backend state; called once, after close, when nobody uses
     * the communicator any more. */
    void (*destroy)(ra_comm *c);
} ra_comm_vtable;

struct ra_comm {
    const ra_comm_vtable *vt;
    int rank;
    int size;
    int device_id;
    double default_timeout;
    /* A split that runs on its parent's transport (host, threads;
     * comm_split.c): every transfer is started on `transport` with peers
     * mapped through members[] (ranks of `transport`) and the kind tagged
     * with `context`.  NULL for a communicator with a transport of its
     * own. */
    ra_comm *transport;
    int *members;
    uint32_t context;
    /* on a communicator with its own transport: the context the next
     * split may take (the ranks agree on the largest, comm_split.c); the
     * contexts below it were taken (host: one with no open split is closed) */
    _Atomic uint32_t next_context;
    /* under mu: the contexts that splits in progress on this rank proposed
     * or agreed on and have not opened yet (comm_split.c) */
    struct ra_ctx_claim *claims;
    pthread_mutex_t mu;       /* failure state, request completion */
    pthread_cond_t cv;
    _Atomic int failed;
    _Atomic int closed;
    char fail_msg[RA_COMM_MSG_LEN];
    _Atomic uint64_t bytes_sent;
    _Atomic uint64_t bytes_received;
    _Atomic uint64_t messages;
    void *impl;               /* backend state */
};

/* ---- comm_core.c ------------------------------------------------------- */

/* RINGATTN_TIMEOUT (seconds) or RA_COMM_DEFAULT_TIMEOUT. */
double ra_comm_env_timeout(void);
ra_status ra_comm_init_base(ra_comm *c, const ra_comm_vtable *vt, int rank,
                            int size, double timeout);
void ra_comm_destroy_base(ra_comm *c);

/* Record the first error (kept for "failed state" messages), mark the comm
 * failed and abort the backend.  Returns `st`. */
ra_status ra_comm_fail(ra_comm *c, ra_status st, const char *msg);
/* The same without calling the backend's abort (backends use it while
 * holding their own locks). */
void ra_comm_mark_failed(ra_comm *c, const char *msg);
/* RA_OK, or RA_ERR_COMM with "communicator is in a failed state" / "is
 * closed" set through ra_set_error. */
ra_status ra_comm_check_usable(ra_comm *c, const char *op);
/* The caller's abort: fail with `reason` and wake everyone. */
void ra_comm_abort(ra_comm *c, const char *reason);
/* Close once; bounded time even with dead peers. */
void ra_comm_close(ra_comm *c);
/* Wait until r finished or `until` passed, without failing anything;
 * 1 when finished.  Lets the Python layer wait in slices and still see
 * signals. */
int ra_req_wait_done(ra_req *r, double until);
/* Close, then free the struct (allocated by the backend with
 * ra_host_alloc(sizeof(ra_comm))). */
void ra_comm_free(ra_comm *c);

/* Requests.  new: refs = 2 (caller + backend). */
ra_req *ra_req_new(ra_comm *c, const ra_xfer *x, const char *op,
                   double timeout);
void ra_req_release(ra_req *r);
/* Backends finish requests with these (caller holds c->mu for _locked). */
void ra_req_finish_locked(ra_req *r, ra_status st, const char *msg);

/* Start (checks usability, local self copy, dispatch), wait, and both. */
ra_status ra_comm_start(ra_comm *c, const ra_xfer *x, const char *op,
                        double timeout, ra_req **out);
ra_status ra_comm_wait(ra_req *r, double timeout);   /* timeout<0: none */
/* Wait until an absolute deadline; msg_timeout is the number of seconds a
 * timeout message reports. */
ra_status ra_comm_wait_until(ra_req *r, double deadline, double msg_timeout);
int ra_comm_test(ra_req *r);                         /* 1 when finished */
ra_status ra_comm_sendrecv(ra_comm *c, const ra_xfer *x, const char *op,
                           double timeout);
ra_status ra_comm_barrier(ra_comm *c, double timeout);
/* out: one ra_host_alloc block holding all items back to back (free with
 * ra_host_free(*out, *out_total)); lens[size]. */
ra_status ra_comm_allgather(ra_comm *c, const void *in, size_t nbytes,
                            void **out, size_t *out_total, size_t *lens,
                            double timeout);

/* Every block of `a` to its rank and from it, under one deadline; the
 * backend's own all-to-all or pairwise sendrecv steps (step s: send to
 * rank + s, receive from rank - s).  Overlapping receive blocks are a
 * ValueError naming them, before any communication. */
ra_status ra_comm_alltoall(ra_comm *c, const ra_a2a *a, double timeout);
/* The pairwise steps alone (every block but the one to itself), memory as
 * in ra_xfer: a backend's alltoall that moves its own block and in-place
 * blocks itself (threads on CUDA devices) calls it for the rest. */
ra_status ra_comm_alltoall_steps(ra_comm *c, const ra_a2a *a,
                                 double timeout);
/* The block to itself must fit its receive block exactly: a ValueError
 * naming both sizes otherwise (every backend's alltoall checks it first). */
ra_status ra_comm_alltoall_check_self(const ra_comm *c, const ra_a2a *a);
/* staged[i] = 1 for the send blocks that overlap a receive block (other
 * than the block to itself being its own receive block exactly), which
 * must be copied aside before anything is received; returns their bytes
 * in all.  RA_ERR_VALUE (set, naming them) when two receive blocks
 * overlap.  staged: `size` entries. */
ra_status ra_a2a_staged(int rank, int size, const ra_a2a *a,
                        unsigned char *staged, size_t *staged_bytes);
/* 1 when c, or the transport it runs on, has failed. */
int ra_comm_is_failed(ra_comm *c);
/* A split took `context` on transport t: t's next_context moves past it
 * (comm_split.c; a backend's context_open). */
void ra_comm_context_taken(ra_comm *t, uint32_t context);

/* Why an operation (prefix `pre`) that exchanges with rank `peer` fails
 * once that peer left its split: "peer rank R closed this communicator",
 * or "peer rank R failed: <why>" (host, threads). */
void ra_comm_departed_msg(const char *pre, int peer, int closed,
                          const char *why, char *msg, size_t n);

/* "rank R: op step S: " prefix for messages */
void ra_comm_prefix(char *buf, size_t n, int rank, const char *op,
                    int64_t step);

/* ---- comm_split.c ------------------------------------------------------ */

/* Collective over c: the ranks that pass the same color >= 0 form a new
 * communicator, ranked by (key, rank in c); color < 0: this rank joins
 * none (*out = NULL).  host/threads: the new communicator runs on c's
 * transport (ra_comm.transport); nccl: a new NCCL communicator from a
 * fresh unique id that the group's first rank hands out over c.  The new
 * one has c's default timeout; `timeout` bounds the split. */
ra_status ra_comm_split(ra_comm *c, int color, int key, double timeout,
                        ra_comm **out);
/* 1 when a split in progress on this rank agreed on `context` and has not
 * opened it on transport t yet (its messages may come already).  t->mu
 * held. */
int ra_comm_context_pending(ra_comm *t, uint32_t context);
/* Free t's claims (none are left once no split runs). */
void ra_comm_claims_free(ra_comm *t);

/* ---- backends ---------------------------------------------------------- */

/* comm_host.c: TCP.  Rank 0 serves the rendezvous on (master_addr, port).
 * token: shared secret (any bytes, may be empty only when size == 1). */
ra_status ra_host_comm_create(int rank, int size, const char *master_addr,
                              int port, const char *token, double timeout,
                              ra_comm **out);

/* comm_threads.c: ranks are threads of this process sharing a group. */
typedef struct ra_tgroup ra_tgroup;
ra_status ra_tgroup_create(int size, double timeout, ra_tgroup **out);
/* The same with one CUDA device per rank (devices[size], copied; several
 * ranks may share one): the ranks then move CUDA device memory of their
 * device (comm_threads_cuda.c), host memory only for barrier/allgather. */
ra_status ra_tgroup_create_devices(int size, double timeout,
                                   const int *devices, ra_tgroup **out);
/* devices[rank] of a group made with devices, or -1 */
int ra_tgroup_device(const ra_tgroup *g, int rank);
/* 1 when copies from rank a to rank b of a group with devices go through
 * pinned host memory (their devices allow no peer access), else 0 */
int ra_tgroup_staged(const ra_tgroup *g, int a, int b);
/* The all-to-all of a group with devices (its communicators and their
 * splits): the block to itself and in-place blocks on the device, the rest
 * pairwise (comm_threads_cuda.c). */
ra_status ra_tcuda_alltoall(ra_comm *c, const ra_a2a *a, double timeout);
void ra_tgroup_incref(ra_tgroup *g);
void ra_tgroup_decref(ra_tgroup *g);
int ra_tgroup_size(const ra_tgroup *g);
/* Each rank may be taken once. */
ra_status ra_tgroup_comm(ra_tgroup *g, int rank, ra_comm **out);
void ra_tgroup_abort(ra_tgroup *g, const char *reason);

/* comm_nccl.c: NCCL, loaded with dlopen at first use.  Without CUDA in the
 * build every function returns RA_ERR_UNSUPPORTED. */
#define RA_NCCL_ID_BYTES 128
typedef struct ra_nccl_options {
    int rank, size;
    int device;                       /* CUDA device of this rank */
    const unsigned char *unique_id;   /* RA_NCCL_ID_BYTES, or NULL: rank 0
                                       * makes one and hands it out over a
                                       * host communicator (size > 1) */
    const char *master_addr;          /* host rendezvous (unique_id NULL) */
    int master_port;
    const char *token;
    const char *library;              /* last libnccl path to try, or NULL */
    double timeout;                   /* <= 0: RINGATTN_TIMEOUT */
} ra_nccl_options;
ra_status ra_nccl_comm_create(const ra_nccl_options *o, ra_comm **out);
ra_status ra_nccl_unique_id(const char *library,
                            unsigned char out[RA_NCCL_ID_BYTES]);
ra_status ra_nccl_version(const char *library, int *major, int *minor,
                          int *patch);

/* comm_auth.c */
void ra_sha256(const void *data, size_t n, unsigned char out[32]);
void ra_hmac_sha256(const void *key, size_t keylen, const void *msg,
                    size_t msglen, unsigned char out[32]);
int ra_consttime_eq(const void *a, const void *b, size_t n);
ra_status ra_random_bytes(void *buf, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* RA_COMM_H */
