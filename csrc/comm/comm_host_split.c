/*
 * comm_host_split.c -- the splits that run on a "host" transport
 * (comm_split.c): which are open on this rank, which members left them,
 * and what leaving means.
 *
 * A split opens here before its first transfer; frames of its context
 * that arrive earlier wait for it (comm_host_engine.c).  A member leaves a
 * split when it closes its communicator, or when an operation of its fails
 * because it exchanged with a member that left (its copy of the split then
 * fails: "peer rank R closed this communicator", "peer rank R failed:
 * ...").  Leaving fails the member's own requests of the split at once
 * (a send half-way through its frame finishes from a copy, a receive
 * drops the rest), and sends each other member a notice (FRAME_CLOSE, with
 * the reason when its copy failed); a member that hears of it fails its
 * requests that exchange with the one that left, and if there were any,
 * leaves in turn.  So whoever waits on a departed member learns at once,
 * while members that exchange only among themselves carry on (a rank that
 * finished a collective may close its split while the others finish
 * theirs).  The transport and its other communicators are untouched.
 */
#include "comm/comm_host_internal.h"

#include <stdio.h>
#include <string.h>

/* ---- the registry (c->mu held) ------------------------------------------ */

host_split *ra_host_find_split(host_impl *h, uint32_t context) {
    for (host_split *s = h->splits; s != NULL; s = s->next)
        if (s->context == context) return s;
    return NULL;
}

host_gone *ra_host_find_gone(const host_split *s, int rank) {
    for (host_gone *d = s->gone; d != NULL; d = d->next)
        if (d->rank == rank) return d;
    return NULL;
}

void ra_host_split_free(host_split *s) {
    while (s->gone != NULL) {
        host_gone *d = s->gone;
        s->gone = d->next;
        ra_host_free(d, sizeof *d);
    }
    ra_host_free(s, sizeof *s);
}

host_leave *ra_host_fail_split_locked(host_split *s, const char *why) {
    if (s->failed || s->view == NULL) return NULL;
    s->failed = 1;
    ra_snprintf(s->why, sizeof s->why, "%s", why);
    ra_comm_mark_failed(s->view, why);
    host_leave *k = ra_host_calloc(sizeof *k);
    int *members = ra_host_alloc(sizeof(int) * (size_t)s->view->size);
    if (k == NULL || members == NULL) {
        /* the members then wait for their deadline */
        if (members != NULL)
            ra_host_free(members, sizeof(int) * (size_t)s->view->size);
        if (k != NULL) ra_host_free(k, sizeof *k);
        return NULL;
    }
    memcpy(members, s->view->members, sizeof(int) * (size_t)s->view->size);
    k->context = s->context;
    k->members = members;
    k->nmembers = s->view->size;
    ra_snprintf(k->why, sizeof k->why, "%s", why);
    return k;
}

/* ---- open, close (callers' threads) ------------------------------------- */

ra_status ra_host_context_open(ra_comm *t, ra_comm *view) {
    host_impl *h = t->impl;
    ra_status st = RA_OK;
    pthread_mutex_lock(&t->mu);
    /* there already when a member left it before it opened here */
    host_split *s = ra_host_find_split(h, view->context);
    if (s == NULL) {
        s = ra_host_calloc(sizeof *s);
        if (s == NULL) {
            st = RA_ERR_NOMEM;
            goto out;
        }
        s->context = view->context;
        s->next = h->splits;
        h->splits = s;
    }
    s->view = view;
    /* frames of contexts below next_context with no split are dropped */
    ra_comm_context_taken(t, view->context);
out:
    pthread_mutex_unlock(&t->mu);
    return st;
}

void ra_host_context_close(ra_comm *t, ra_comm *view) {
    host_impl *h = t->impl;
    if (h == NULL) return;
    host_leave *k = ra_host_calloc(sizeof *k);
    int *members = ra_host_alloc(sizeof(int) * (size_t)view->size);
    pthread_mutex_lock(&t->mu);
    int failed = 0;
    for (host_split **link = &h->splits; *link != NULL;
         link = &(*link)->next) {
        if ((*link)->context != view->context) continue;
        host_split *s = *link;
        failed = s->failed;
        *link = s->next;
        ra_host_split_free(s);
        break;
    }
    /* for the progress thread: fail its requests, tell the members (a copy
     * that failed told them already; a transport that stopped or failed
     * failed every request) */
    int queued = k != NULL && members != NULL && !failed &&
                 h->thread_started && !h->stop && !atomic_load(&t->failed);
    if (queued) {
        memcpy(members, view->members, sizeof(int) * (size_t)view->size);
        k->context = view->context;
        k->members = members;
        k->nmembers = view->size;
        k->closed = 1;
        k->next = h->leaving;
        h->leaving = k;
    }
    pthread_mutex_unlock(&t->mu);
    if (queued) {
        ra_host_wake(h);
        return;
    }
    if (members != NULL)
        ra_host_free(members, sizeof(int) * (size_t)view->size);
    if (k != NULL) ra_host_free(k, sizeof *k);
}

int ra_host_split_refuse(ra_comm *c, ra_req *r, char *msg, size_t n) {
    host_impl *h = c->impl;
    uint32_t context = ra_xfer_context(r->x.kind);
    if (context == 0) return 0;
    char pre[128];
    ra_comm_prefix(pre, sizeof pre, c->rank, r->op, r->x.step);
    host_split *s = ra_host_find_split(h, context);
    host_gone *d = NULL;
    if (s != NULL && !s->failed) {
        /* a receive from a member that left may still find its last frame
         * here (the progress thread decides: ra_host_recv_refuse) */
        if (r->x.dst >= 0) d = ra_host_find_gone(s, r->x.dst);
        if (d == NULL) return 0;
    }
    if (s == NULL)
        ra_snprintf(msg, n, "%scommunicator is closed", pre);
    else if (s->failed)
        ra_snprintf(msg, n, "%s", s->why);
    else
        ra_comm_departed_msg(pre, d->rank, d->closed, d->why, msg, n);
    r->ctx_closed = 1;
    host_leave *k = d != NULL ? ra_host_fail_split_locked(s, msg) : NULL;
    if (k != NULL) {             /* the progress thread tells the members */
        k->next = h->leaving;
        h->leaving = k;
        ra_host_wake(h);
    }
    return 1;
}

/* ---- departures (progress thread) --------------------------------------- */

/* Tell the members of k's split that this rank left it. */
static void queue_notices(ra_comm *c, host_impl *h, const host_leave *k) {
    size_t len = k->closed ? 0 : strlen(k->why);
    for (int i = 0; i < k->nmembers; i++) {
        host_peer *pe = &h->peers[k->members[i]];
        if (k->members[i] == c->rank || pe->fd < 0 || ra_host_out_closed(pe))
            continue;
        host_notice *t = ra_host_calloc(sizeof *t);
        char *why = len > 0 ? ra_host_alloc(len) : NULL;
        if (t == NULL || (len > 0 && why == NULL)) {
            if (t != NULL) ra_host_free(t, sizeof *t);
            continue;          /* that member waits for its deadline */
        }
        if (len > 0) memcpy(why, k->why, len);
        t->context = k->context;
        t->why = why;
        t->why_bytes = len;
        host_notice **link = &pe->notices;     /* in order */
        while (*link != NULL) link = &(*link)->next;
        *link = t;
    }
}

/* This rank left a split (closed it, or its copy failed on a caller's
 * thread): fail its requests, tell its members. */
ra_status ra_host_leave(ra_comm *c, host_impl *h, const host_leave *k) {
    if (k->closed)
        RA_CHECK(ra_host_drop_context(c, h, k->context,
                                      "communicator is closed", 0, 1));
    else
        RA_CHECK(ra_host_drop_context(c, h, k->context, k->why, 1, 1));
    queue_notices(c, h, k);
    return RA_OK;
}

void ra_host_leaving_free(host_leave *k) {
    while (k != NULL) {
        host_leave *next = k->next;
        ra_host_free(k->members, sizeof(int) * (size_t)k->nmembers);
        ra_host_free(k, sizeof *k);
        k = next;
    }
}

void ra_host_notices_free(host_notice *t) {
    while (t != NULL) {
        host_notice *next = t->next;
        if (t->why != NULL) ra_host_free(t->why, t->why_bytes);
        ra_host_free(t, sizeof *t);
        t = next;
    }
}


/* This rank's copy of the split of `context` fails (why): it leaves. */
static ra_status fail_here(ra_comm *c, host_impl *h, uint32_t context,
                           const char *why) {
    pthread_mutex_lock(&c->mu);
    host_split *s = ra_host_find_split(h, context);
    host_leave *k = s != NULL ? ra_host_fail_split_locked(s, why) : NULL;
    pthread_mutex_unlock(&c->mu);
    if (k == NULL) return RA_OK;
    ra_status st = ra_host_drop_context(c, h, context, why, 1, 1);
    if (st == RA_OK) queue_notices(c, h, k);
    ra_host_free(k->members, sizeof(int) * (size_t)k->nmembers);
    ra_host_free(k, sizeof *k);
    return st;
}

/* Rank `src` left the split of `context` (closed it, or failed: why).  The
 * operations here that exchange with it fail, and with them this rank's
 * copy of the split (which tells the other members in turn). */
ra_status ra_host_peer_left(ra_comm *c, host_impl *h, int src,
                            uint32_t context, int closed, const char *why) {
    pthread_mutex_lock(&c->mu);
    host_split *s = ra_host_find_split(h, context);
    if (s == NULL && (context >= atomic_load(&c->next_context) ||
                      ra_comm_context_pending(c, context))) {
        /* not open here yet: it opens knowing */
        s = ra_host_calloc(sizeof *s);
        if (s != NULL) {
            s->context = context;
            s->next = h->splits;
            h->splits = s;
        }
    }
    host_gone *d = s != NULL ? ra_host_find_gone(s, src) : NULL;
    if (s != NULL && d == NULL && (d = ra_host_calloc(sizeof *d)) != NULL) {
        d->rank = src;
        d->closed = closed;
        ra_snprintf(d->why, sizeof d->why, "%s", why);
        d->next = s->gone;
        s->gone = d;
    }
    int live = s != NULL && s->view != NULL && !s->failed && d != NULL;
    host_gone gone;
    if (live) gone = *d;
    pthread_mutex_unlock(&c->mu);
    if (!live) return RA_OK;
    /* this rank's requests of the split with `src`: sends to it, receives
     * from it */
    host_peer *pe = &h->peers[src];
    char first[RA_COMM_MSG_LEN] = "";
    for (;;) {
        ra_req *r = ra_host_peer_req(pe, context);
        if (r == NULL) break;
        char pre[128], msg[RA_COMM_MSG_LEN];
        ra_comm_prefix(pre, sizeof pre, c->rank, r->op, r->x.step);
        ra_comm_departed_msg(pre, gone.rank, gone.closed, gone.why, msg,
                             sizeof msg);
        if (first[0] == '\0') ra_snprintf(first, sizeof first, "%s", msg);
        RA_CHECK(ra_host_drop_req(c, h, r, msg, 1));
    }
    if (first[0] == '\0') return RA_OK;
    return fail_here(c, h, context, first);
}

int ra_host_recv_refuse(ra_comm *c, host_impl *h, ra_req *r,
                        ra_status *st) {
    uint32_t context = ra_xfer_context(r->x.kind);
    *st = RA_OK;
    if (context == 0) return 0;
    pthread_mutex_lock(&c->mu);
    host_split *s = ra_host_find_split(h, context);
    host_gone *d = s != NULL && !s->failed ? ra_host_find_gone(s, r->x.src)
                                           : NULL;
    host_gone gone;
    if (d != NULL) gone = *d;
    pthread_mutex_unlock(&c->mu);
    if (d == NULL) return 0;
    char pre[128], msg[RA_COMM_MSG_LEN];
    ra_comm_prefix(pre, sizeof pre, c->rank, r->op, r->x.step);
    ra_comm_departed_msg(pre, gone.rank, gone.closed, gone.why, msg,
                         sizeof msg);
    *st = ra_host_drop_req(c, h, r, msg, 1);
    if (*st == RA_OK) *st = fail_here(c, h, context, msg);
    return 1;
}
