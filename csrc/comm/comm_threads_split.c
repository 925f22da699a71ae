/*
 * comm_threads_split.c -- the splits that run on a threads group
 * (comm_split.c): their members, the members' communicators, and who left.
 *
 * A split's transfers go through the group's queues tagged with its
 * context, and comm_threads.c matches only within a context, so the
 * communicators of a group never see each other's messages.  A member
 * leaves a split when it closes its communicator, or when an operation of
 * its fails because it exchanges with a member that left (its copy of the
 * split then fails: "peer rank R closed this communicator", "peer rank R
 * failed: ...").  Leaving fails the member's own requests of the split and
 * every other member's request that exchanges with it, whose members leave
 * in turn: whoever waits on a departed member learns at once, while
 * members that exchange only among themselves carry on (a rank that
 * finished a collective may close its split while the others finish
 * theirs).  The group and its other communicators are untouched.
 */
#include "comm/comm_threads_internal.h"

#include <string.h>

/* A member that left a split. */
typedef struct tleft {
    int rank;                 /* group rank */
    int closed;               /* it closed its communicator (else failed) */
    int todo;                 /* the requests it ends are still to fail */
    char why[RA_COMM_MSG_LEN];        /* failed: its message */
    struct tleft *next;
} tleft;

/* Two splits with one context number have disjoint members (a rank's
 * contexts are unique), so (context, member) finds a split. */
struct tsplit {
    uint32_t context;
    int size;
    int *members;             /* group ranks, by rank in the split */
    ra_comm **views;          /* the members' communicators, by rank in the
                               * split; NULL before open and after close */
    int nclosed;              /* members that closed theirs */
    tleft *left;
    struct tsplit *next;
};

static int split_index(const tsplit *s, int rank) {
    for (int i = 0; i < s->size; i++)
        if (s->members[i] == rank) return i;
    return -1;
}

static tsplit *find_split(ra_tgroup *g, uint32_t context, int rank) {
    for (tsplit *s = g->splits; s != NULL; s = s->next)
        if (s->context == context && split_index(s, rank) >= 0) return s;
    return NULL;
}

static tleft *find_left(const tsplit *s, int rank) {
    for (tleft *d = s->left; d != NULL; d = d->next)
        if (d->rank == rank) return d;
    return NULL;
}

static void split_free(tsplit *s) {
    while (s->left != NULL) {
        tleft *d = s->left;
        s->left = d->next;
        ra_host_free(d, sizeof *d);
    }
    ra_host_free(s->members, sizeof(int) * (size_t)s->size);
    ra_host_free(s->views, sizeof(ra_comm *) * (size_t)s->size);
    ra_host_free(s, sizeof *s);
}

/* `rank` leaves s; a failed member's communicator fails with `why`.  Its
 * requests are failed by settle_locked.  NULL when out of memory (the
 * others then wait for their deadline). */
static tleft *add_left(tsplit *s, int rank, int closed, const char *why) {
    tleft *d = ra_host_calloc(sizeof *d);
    if (d == NULL) return NULL;
    d->rank = rank;
    d->closed = closed;
    d->todo = 1;
    ra_snprintf(d->why, sizeof d->why, "%s", why);
    d->next = s->left;
    s->left = d;
    int i = split_index(s, rank);
    if (!closed && s->views[i] != NULL) ra_comm_mark_failed(s->views[i], why);
    return d;
}

/* The posted request of s that ends with departed member d: its own, or
 * another member's exchange with it; NULL when none is left.  Only row d
 * and column d of the queue matrices hold them. */
static ra_req *victim_of(ra_tgroup *g, const tsplit *s, int d) {
    int n = g->size;
    for (int x = 0; x < n; x++) {
        ra_req *heads[4] = {g->sendq[d * n + x], g->sendq[x * n + d],
                            g->recvq[d * n + x], g->recvq[x * n + d]};
        for (int k = 0; k < 4; k++)
            for (ra_req *r = heads[k]; r != NULL;
                 r = k < 2 ? r->next : r->next_recv)
                if (ra_xfer_context(r->x.kind) == s->context &&
                    split_index(s, r->comm->rank) >= 0)
                    return r;
    }
    return NULL;
}

/* Fail what the departures of s end, until no departure is left to do. */
static void settle_locked(ra_tgroup *g, tsplit *s) {
    for (;;) {
        tleft *d = s->left;
        while (d != NULL && !d->todo) d = d->next;
        if (d == NULL) return;
        d->todo = 0;
        ra_req *r;
        while ((r = victim_of(g, s, d->rank)) != NULL) {
            int owner = r->comm->rank;
            char pre[128], msg[RA_COMM_MSG_LEN];
            ra_comm_prefix(pre, sizeof pre, owner, r->op, r->x.step);
            if (owner != d->rank)
                ra_comm_departed_msg(pre, d->rank, d->closed, d->why, msg,
                                     sizeof msg);
            else if (d->closed)
                ra_snprintf(msg, sizeof msg, "%scommunicator is closed", pre);
            else
                ra_snprintf(msg, sizeof msg, "%s", d->why);
            r->ctx_closed = 1;
            ra_tgroup_fail_req(g, r, RA_ERR_COMM, msg);
            if (owner != d->rank && find_left(s, owner) == NULL)
                add_left(s, owner, 0, msg);
        }
    }
}

int ra_tsplit_refuse(ra_tgroup *g, ra_req *q, char *msg, size_t n) {
    uint32_t context = ra_xfer_context(q->x.kind);
    if (context == 0) return 0;
    int me = q->comm->rank;
    char pre[128];
    ra_comm_prefix(pre, sizeof pre, me, q->op, q->x.step);
    tsplit *s = find_split(g, context, me);
    tleft *mine = s != NULL ? find_left(s, me) : NULL;
    if (s == NULL || mine != NULL) {    /* no longer known: all closed it */
        if (mine != NULL && !mine->closed)
            ra_snprintf(msg, n, "%s", mine->why);
        else
            ra_snprintf(msg, n, "%scommunicator is closed", pre);
        q->ctx_closed = 1;
        return 1;
    }
    tleft *peer = q->x.dst >= 0 ? find_left(s, q->x.dst) : NULL;
    if (peer == NULL && q->x.src >= 0) peer = find_left(s, q->x.src);
    if (peer == NULL) return 0;
    ra_comm_departed_msg(pre, peer->rank, peer->closed, peer->why, msg, n);
    q->ctx_closed = 1;
    if (add_left(s, me, 0, msg) != NULL) settle_locked(g, s);
    return 1;
}

ra_status ra_tsplit_open(ra_comm *t, ra_comm *view) {
    ra_tgroup *g = t->impl;
    ra_status st = RA_OK;
    pthread_mutex_lock(&g->mu);
    tsplit *s = find_split(g, view->context, t->rank);
    if (s == NULL) {
        s = ra_host_calloc(sizeof *s);
        if (s == NULL) {
            st = RA_ERR_NOMEM;
            goto out;
        }
        s->size = view->size;
        s->members = ra_host_alloc(sizeof(int) * (size_t)view->size);
        s->views = ra_host_calloc(sizeof(ra_comm *) * (size_t)view->size);
        if (s->members == NULL || s->views == NULL) {
            split_free(s);
            st = RA_ERR_NOMEM;
            goto out;
        }
        s->context = view->context;
        memcpy(s->members, view->members, sizeof(int) * (size_t)view->size);
        s->next = g->splits;
        g->splits = s;
    }
    s->views[view->rank] = view;
    ra_comm_context_taken(t, view->context);
out:
    pthread_mutex_unlock(&g->mu);
    return st;
}

void ra_tsplit_close(ra_comm *t, ra_comm *view) {
    ra_tgroup *g = t->impl;
    if (g == NULL) return;
    pthread_mutex_lock(&g->mu);
    tsplit **link = &g->splits;
    while (*link != NULL && ((*link)->context != view->context ||
                             split_index(*link, t->rank) < 0))
        link = &(*link)->next;
    tsplit *s = *link;
    if (s != NULL) {
        s->views[view->rank] = NULL;
        s->nclosed++;
        if (find_left(s, t->rank) == NULL &&
            add_left(s, t->rank, 1, "") != NULL)
            settle_locked(g, s);
        if (s->nclosed == s->size) {   /* nobody can use it any more */
            *link = s->next;
            split_free(s);
        }
    }
    pthread_mutex_unlock(&g->mu);
}

void ra_tsplit_free_all(ra_tgroup *g) {
    while (g->splits != NULL) {        /* splits some member never closed */
        tsplit *s = g->splits;
        g->splits = s->next;
        split_free(s);
    }
}
