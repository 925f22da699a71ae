/*
 * comm_host_internal.h -- what the parts of the "host" (TCP) backend
 * share: comm_host_boot.c (rendezvous, handshake, full mesh),
 * comm_host_engine.c (the progress thread: frames, matching) and
 * comm_host.c (the vtable: start, close, splits).  Not part of the
 * communicator API (comm.h).
 */
#ifndef RA_COMM_HOST_INTERNAL_H
#define RA_COMM_HOST_INTERNAL_H

#include <stdint.h>
#include <unistd.h>
#include "comm/comm.h"

/* ---- little-endian wire integers and fds -------------------------------- */

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

/* ---- the transport (comm_host.c, comm_host_engine.c) -------------------- */

/* Frame header, little-endian, FRAME_HDR bytes:
 *   magic u32 | kind u32 | step i64 | nbytes u64 | back u64
 * kind: a data frame's wire kind (ra_xfer kind | context << 8), FRAME_ABORT
 * (payload: why the sender failed) or FRAME_CLOSE | context << 8 (the
 * sender left that split: no payload when it closed it, else why its copy
 * failed).  back: the bytes the sender receives from this rank in the same
 * operation (ra_xfer.recv_from_dst), or NO_BACK. */
#define FRAME_MAGIC 0x52414632u      /* "RAF2" */
#define FRAME_HDR 32
#define FRAME_ABORT 9
#define FRAME_CLOSE 10
#define NO_BACK UINT64_MAX
#define IO_CHUNK ((size_t)4 << 20)   /* bytes per send()/recv() call */

/* A frame that arrived before a receive of its context from its sender was
 * posted (kept so that communicators never wait on each other). */
typedef struct unexp_frame {
    uint32_t kind;
    int64_t step;
    uint64_t nbytes, back;
    unsigned char *data;
    uint64_t got;             /* complete when got == nbytes */
    struct unexp_frame *next;
} unexp_frame;

typedef enum {
    IN_HEADER = 0,            /* reading a header */
    IN_REQ,                   /* payload into a posted receive */
    IN_UNEXP,                 /* payload into an unexp_frame */
    IN_DISCARD,               /* payload of a closed split: dropped */
    IN_NOTICE,                /* a FRAME_CLOSE's reason, into notice_in */
    IN_PARKED                 /* header read, nobody receives from this
                               * peer: left in the socket (back-pressure)
                               * until a receive from it is posted */
} in_state;

/* One connection, as the progress thread sees it. */
typedef struct host_peer {
    int fd;                   /* -1 for self */
    int broken;               /* known dead: not polled any more */
    int out_gone;             /* the peer closed its end: nothing more goes
                               * to it, but what it sent before (a frame
                               * parked here) may still be read */
    /* out: one frame at a time; CLOSE notices first, then sends in order */
    ra_req *sq_head, *sq_tail;          /* sends waiting (r->next) */
    struct host_notice *notices;        /* FRAME_CLOSEs to send */
    int out_active;
    unsigned char hout[FRAME_HDR];
    size_t hout_sent;
    ra_req *out_req;          /* whose payload this is, or NULL */
    const unsigned char *out_data;
    uint64_t out_left;
    unsigned char *out_copy;  /* the rest of a dropped request's payload,
                               * or a notice's reason */
    size_t out_copy_bytes;
    /* in */
    unsigned char hin[FRAME_HDR];
    size_t hin_got;
    in_state in;
    ra_req *in_req;
    unexp_frame *in_unexp;
    uint64_t in_left;
    ra_req *rq_head, *rq_tail;          /* receives waiting (r->next_recv) */
    unexp_frame *ux_head, *ux_tail;
    char notice_in[RA_COMM_MSG_LEN];
    /* the context of a frame from this peer that no receive took yet, or
     * -1 (for the timeout message of a waiter, which reads it) */
    _Atomic int64_t untaken;
} host_peer;

/* Nothing more can be sent to `pe`: its connection is dead, or the peer
 * closed its end. */
static inline int ra_host_out_closed(const host_peer *pe) {
    return pe->broken || pe->out_gone;
}

/* A FRAME_CLOSE to send: this rank left the split of `context`. */
typedef struct host_notice {
    uint32_t context;
    char *why;                /* NULL: closed; else why it failed here */
    size_t why_bytes;
    struct host_notice *next;
} host_notice;

/* A member that left a split: closed it, or its copy failed (why). */
typedef struct host_gone {
    int rank;                 /* transport rank */
    int closed;
    char why[RA_COMM_MSG_LEN];
    struct host_gone *next;
} host_gone;

/* A split on this transport, by context (comm_split.c).  A split opens
 * here before its first transfer; a member may leave it before (view
 * NULL until it opens).  An operation that exchanges with a member that
 * left fails, and so does this rank's copy (failed, why): it leaves too. */
typedef struct host_split {
    uint32_t context;
    ra_comm *view;
    int failed;
    char why[RA_COMM_MSG_LEN];
    host_gone *gone;
    struct host_split *next;
} host_split;

/* This rank leaves a split (closed it, or its copy failed), for the
 * progress thread: fail its requests, tell its members. */
typedef struct host_leave {
    uint32_t context;
    int nmembers;
    int *members;             /* transport ranks */
    int closed;
    char why[RA_COMM_MSG_LEN];        /* failed: the message */
    struct host_leave *next;
} host_leave;

typedef struct host_impl {
    host_peer *peers;         /* by rank */
    int wake[2];              /* pipe: wakes the progress thread's poll */
    pthread_t thread;
    int thread_started;
    pthread_cond_t qcv;       /* a failed thread waits here for stop */
    /* under c->mu */
    ra_req *submit_head, *submit_tail;  /* started, not yet taken (next) */
    host_leave *leaving;                /* newest first */
    host_split *splits;
    int stop;
    /* progress thread only */
    ra_req *failing;          /* taken when the transport failed (next) */
    int failure_handled;
    unsigned char *sink;      /* SINK_BYTES: dropped payloads */
} host_impl;

#define SINK_BYTES ((size_t)64 << 10)

/* ---- request queues of a peer (progress thread) ------------------------- */

static inline void ra_host_sq_push(host_peer *pe, ra_req *r) {
    r->next = NULL;
    if (pe->sq_tail) pe->sq_tail->next = r;
    else pe->sq_head = r;
    pe->sq_tail = r;
}

static inline void ra_host_rq_push(host_peer *pe, ra_req *r) {
    r->next_recv = NULL;
    if (pe->rq_tail) pe->rq_tail->next_recv = r;
    else pe->rq_head = r;
    pe->rq_tail = r;
}

static inline int ra_host_sq_unlink(host_peer *pe, ra_req *r) {
    ra_req *prev = NULL;
    for (ra_req *q = pe->sq_head; q != NULL; prev = q, q = q->next) {
        if (q != r) continue;
        if (prev) prev->next = q->next;
        else pe->sq_head = q->next;
        if (pe->sq_tail == q) pe->sq_tail = prev;
        return 1;
    }
    return 0;
}

static inline int ra_host_rq_unlink(host_peer *pe, ra_req *r) {
    ra_req *prev = NULL;
    for (ra_req *q = pe->rq_head; q != NULL; prev = q, q = q->next_recv) {
        if (q != r) continue;
        if (prev) prev->next_recv = q->next_recv;
        else pe->rq_head = q->next_recv;
        if (pe->rq_tail == q) pe->rq_tail = prev;
        return 1;
    }
    return 0;
}

/* A request of `context` (any: UINT32_MAX) that the thread holds for this
 * peer: its frame in or out, or waiting to send or receive; NULL if none. */
static inline ra_req *ra_host_peer_req(const host_peer *pe,
                                       uint32_t context) {
    ra_req *const heads[4] = {pe->out_req, pe->in_req, pe->sq_head,
                              pe->rq_head};
    for (int k = 0; k < 4; k++)
        for (ra_req *q = heads[k]; q != NULL;
             q = k == 2 ? q->next : k == 3 ? q->next_recv : NULL)
            if (context == UINT32_MAX ||
                ra_xfer_context(q->x.kind) == context)
                return q;
    return NULL;
}

/* The oldest posted receive of `context` from this peer, or NULL. */
static inline ra_req *ra_host_rq_find(host_peer *pe, uint32_t context) {
    for (ra_req *q = pe->rq_head; q != NULL; q = q->next_recv)
        if (ra_xfer_context(q->x.kind) == context) return q;
    return NULL;
}

/* ---- comm_host_engine.c: the progress thread ---------------------------- */

void *ra_host_progress(void *arg);            /* arg: the ra_comm */
void ra_host_wake(host_impl *h);
/* Free what the thread left (after it stopped). */
void ra_host_engine_free(ra_comm *c);
/* Progress thread: take r out of the thread's hands and fail it with msg
 * (a frame half-way through finishes without it).  RA_ERR_NOMEM when the
 * rest of its payload cannot be copied (the transport must fail). */
ra_status ra_host_drop_req(ra_comm *c, host_impl *h, ra_req *r,
                           const char *msg, int ctx_closed);
/* Progress thread: every request of `context` (all: UINT32_MAX) failed with
 * "<its prefix>why", or why as it is (verbatim), and the frames of that
 * context that nobody took. */
ra_status ra_host_drop_context(ra_comm *c, host_impl *h, uint32_t context,
                               const char *why, int verbatim,
                               int ctx_closed);
/* Progress thread: one side of r is done (it finishes with its last);
 * "rank R: op step S: " of an operation with that peer, or "rank R: ". */
void ra_host_side_done(ra_comm *c, ra_req *r, int send);
void ra_host_unexp_free(unexp_frame *u);
void ra_host_peer_prefix(ra_comm *c, const host_peer *pe, char *pre,
                         size_t n);

/* ---- comm_host_match.c: arriving frames (progress thread) --------------- */

/* A whole header (pe->hin) / frame arrived from src; the header in pe->hin
 * of a data frame (parked or new) is routed to its receive.  RA_OK, or an
 * error that fails the transport, with msg. */
ra_status ra_host_header_done(ra_comm *c, host_impl *h, int src, char *msg,
                              size_t n);
ra_status ra_host_frame_done(ra_comm *c, host_impl *h, int src, char *msg,
                             size_t n);
ra_status ra_host_route_frame(ra_comm *c, host_impl *h, int src, char *msg,
                              size_t n);
/* Post r's receive: it takes the oldest whole frame of its context that
 * came before it, or waits in line. */
ra_status ra_host_post_recv(ra_comm *c, host_impl *h, ra_req *r, char *msg,
                            size_t n);

/* ---- comm_host_split.c: splits on the transport ------------------------- */

/* The registry (c->mu held). */
host_split *ra_host_find_split(host_impl *h, uint32_t context);
host_gone *ra_host_find_gone(const host_split *s, int rank);
void ra_host_split_free(host_split *s);
/* This rank's copy of split s fails with `why` (c->mu held): the leave to
 * hand to the progress thread, or NULL (nothing to tell). */
host_leave *ra_host_fail_split_locked(host_split *s, const char *why);
/* The vtable's context_open / context_close. */
ra_status ra_host_context_open(ra_comm *t, ra_comm *view);
void ra_host_context_close(ra_comm *t, ra_comm *view);
/* host_start (c->mu held): 1 when r, of a split, cannot run (closed here,
 * its copy failed, or it sends to a member that left: then this rank
 * leaves the split too), with msg. */
int ra_host_split_refuse(ra_comm *c, ra_req *r, char *msg, size_t n);
/* Progress thread, posting r's receive when no frame of its came: 1 when
 * its sender left the split (r failed, this rank leaves; *st: RA_OK, or
 * the error that fails the transport). */
int ra_host_recv_refuse(ra_comm *c, host_impl *h, ra_req *r, ra_status *st);
/* Progress thread: rank src left the split of `context`; this rank left
 * one (k); the leaves' and notices' lists freed. */
ra_status ra_host_peer_left(ra_comm *c, host_impl *h, int src,
                            uint32_t context, int closed, const char *why);
ra_status ra_host_leave(ra_comm *c, host_impl *h, const host_leave *k);
void ra_host_leaving_free(host_leave *k);
void ra_host_notices_free(host_notice *t);

#endif /* RA_COMM_HOST_INTERNAL_H */
