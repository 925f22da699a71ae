/*
 * comm_threads_internal.h -- what the two halves of the "threads" backend
 * share: comm_threads.c (the group: queues, matching, copies, dead ranks)
 * and comm_threads_split.c (the splits that run on a group and who left
 * them).  Not part of the communicator API (comm.h).  Lock order: group
 * lock, then a communicator's lock.
 */
#ifndef RA_COMM_THREADS_INTERNAL_H
#define RA_COMM_THREADS_INTERNAL_H

#include "comm/comm.h"

typedef struct tsplit tsplit;

struct ra_tgroup {
    int size;
    double timeout;
    _Atomic int refs;
    pthread_mutex_t mu;
    int *taken;
    ra_comm **comms;          /* live communicators by rank (or NULL) */
    int *dead;
    int *pending_kill;
    char *dead_msg;           /* size x RA_COMM_MSG_LEN */
    ra_req **sendq;           /* [src * size + dst] heads, linked by next */
    ra_req **recvq;           /* [src * size + dst] heads, by next_recv */
    tsplit *splits;           /* comm_threads_split.c */
    int *devices;             /* CUDA device of each rank, or NULL: host */
    void **copy_streams;      /* with devices: each rank's copy stream */
    unsigned char *direct;    /* [a * size + b]: a device or peer copy
                               * between ranks a and b (else staged) */
    struct tstage *stages;    /* per receiving rank: pinned staging */
};

#define DEAD_MSG(g, r) ((g)->dead_msg + (size_t)(r) * RA_COMM_MSG_LEN)

/* comm_threads.c: take r out of its queues and fail it (finishing once no
 * copy runs into or out of it).  Group lock held. */
void ra_tgroup_fail_req(ra_tgroup *g, ra_req *r, ra_status st,
                        const char *msg);

/* ---- comm_threads_split.c (group lock held unless said) ---------------- */

/* 1 when request q (not posted yet) of a split cannot run: its rank left
 * the split, or a peer it exchanges with did (then its rank leaves it too:
 * its copy of the split fails, and so do the others' requests with it);
 * msg says why.  0 for the group's own communicator and a split in use. */
int ra_tsplit_refuse(ra_tgroup *g, ra_req *q, char *msg, size_t n);
/* The vtable's context_open / context_close (take the group lock). */
ra_status ra_tsplit_open(ra_comm *t, ra_comm *view);
void ra_tsplit_close(ra_comm *t, ra_comm *view);
/* Free every split (the group is going). */
void ra_tsplit_free_all(ra_tgroup *g);

/* ---- comm_threads_cuda.c: device memory (group with devices) ---------- */

/* Check g->devices against the devices there are; enable peer access
 * between them where the devices allow it; make each rank's copy stream
 * (on its device). */
ra_status ra_tcuda_group_init(ra_tgroup *g);
void ra_tcuda_group_free(ra_tgroup *g);
/* Before q is queued (no lock held): record its ready event on its stream
 * (q->impl); the message of a failure in err. */
ra_status ra_tcuda_post(ra_req *q, char *err, size_t n);
/* Queue the copy of from's send block into to's receive block and order
 * both ranks' streams after it (no lock held; both pinned by copying). */
ra_status ra_tcuda_copy(ra_tgroup *g, ra_req *from, ra_req *to, char *err,
                        size_t n);
/* q finished: free its CUDA state (group lock held). */
void ra_tcuda_req_done(ra_req *q);

#endif /* RA_COMM_THREADS_INTERNAL_H */
