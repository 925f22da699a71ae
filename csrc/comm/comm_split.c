/*
 * comm_split.c -- sub-communicators: ra_comm_split(c, color, key).
 *
 * Collective over c.  Every rank sends one fixed-size record (below) with
 * one allgather; the ranks whose color matches form the new communicator,
 * ranked by (key, rank in c).  Nothing received is evaluated: a record of
 * another size or magic, or a peer's field out of range, is a CommError
 * naming the rank that sent it.
 *
 * host, threads: the new communicator runs on c's transport (the sockets,
 * the threads group): ra_comm.transport points at it, members[] maps the
 * new ranks to the transport's, and every transfer carries the split's
 * context in its kind, and the transport matches a receive only with a
 * message of its own context: communicators on one transport never see
 * each other's messages, and may run at the same time (from different
 * threads).  The context must be the same on every member and unique
 * among the communicators any two ranks share: each rank proposes its
 * transport's next_context, all take the largest, and every member
 * checks that no split of another communicator on its transport took it
 * meanwhile (a second exchange, below: splits of different communicators
 * may run at the same time); the transport's next_context then moves past
 * it.  After a split every member holds the same next_context, so a later
 * split that includes two ranks gives them a context neither has used.
 * A failure of the split fails the transport (and so every
 * communicator on it); aborting a split aborts the transport; closing one
 * leaves the transport open: the transport's context_close fails the
 * split's transfers in flight and tells its other members, whose copies
 * of the split then fail ("peer rank R closed this communicator").
 *
 * nccl: a new NCCL communicator.  The group's first rank makes a fresh
 * unique id and hands it to the others in a second allgather over c; the
 * members then join with ncclCommInitRankConfig (comm_nccl.c).  With
 * NCCL_COMM_ID set NCCL derives every id from that one address, so two
 * groups would meet there: the split refuses it.
 *
 * Record (little-endian, RECORD_BYTES): magic "RAS1" | color i32 (-1: no
 * group) | key i32 | proposed context u32; then (host, threads) a verdict
 * (VERDICT_BYTES): magic "RAV1" | 0 taken, 1 claimed, 2 gave up.
 */
#include "comm/comm.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RECORD_MAGIC "RAS1"
#define RECORD_BYTES 16

static void put_u32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static uint32_t get_u32(const unsigned char *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}

typedef struct split_entry {
    int rank;                 /* in c */
    int color, key;
    uint32_t context;
} split_entry;

/* ---- the split's communicator on its parent's transport ----------------- */

static void view_abort(ra_comm *c) {
    /* the peers learn through the transport */
    char msg[RA_COMM_MSG_LEN];
    pthread_mutex_lock(&c->mu);
    ra_snprintf(msg, sizeof msg, "%s", c->fail_msg);
    pthread_mutex_unlock(&c->mu);
    if (!atomic_load(&c->transport->closed))
        ra_comm_fail(c->transport, RA_ERR_COMM, msg);
}

static void view_close(ra_comm *c) {
    /* the transport stays open for its other communicators */
    ra_comm *t = c->transport;
    if (t->vt->context_close != NULL) t->vt->context_close(t, c);
}

static void view_destroy(ra_comm *c) {
    ra_host_free(c->members, sizeof(int) * (size_t)c->size);
    c->members = NULL;
}

/* sendrecv_start is never called: comm_core.c starts a split's transfers
 * on its transport */
static ra_status view_unreachable(ra_comm *c, ra_req *r) {
    (void)c;
    ra_snprintf(r->msg, sizeof r->msg, "internal error: a split's transfer "
             "reached its own backend");
    return RA_ERR_INTERNAL;
}

#define VIEW_VTABLE(backend, device, a2a)                                     \
    {                                                                         \
        .name = backend, .device_type = device,                               \
        .sendrecv_start = view_unreachable, .wait = NULL, .barrier = NULL,   \
        .allgather = NULL, .alltoall = a2a, .abort = view_abort,              \
        .close = view_close, .destroy = view_destroy,                         \
        .context_open = NULL, .context_close = NULL,                          \
    }

static const ra_comm_vtable view_vtables[] = {
    VIEW_VTABLE("host", RA_DEV_CPU, NULL),
    VIEW_VTABLE("threads", RA_DEV_CPU, NULL),
    VIEW_VTABLE("threads", RA_DEV_CUDA, ra_tcuda_alltoall),
};

static const ra_comm_vtable *view_vtable(const ra_comm_vtable *root) {
    for (size_t i = 0; i < sizeof view_vtables / sizeof view_vtables[0]; i++)
        if (strcmp(view_vtables[i].name, root->name) == 0 &&
            view_vtables[i].device_type == root->device_type)
            return &view_vtables[i];
    return NULL;
}

/* members: ranks of c, in the new order; mapped to the transport's. */
static ra_status make_view(ra_comm *c, const int *members, int size,
                           int new_rank, uint32_t context, ra_comm **out) {
    ra_comm *root = c->transport != NULL ? c->transport : c;
    const ra_comm_vtable *vt = view_vtable(root->vt);
    if (vt == NULL) {
        ra_set_error(RA_ERR_UNSUPPORTED, "rank %d: split: the '%s' backend "
                     "cannot share its transport", c->rank, root->vt->name);
        return RA_ERR_UNSUPPORTED;
    }
    ra_comm *v = ra_host_calloc(sizeof *v);
    int *map = ra_host_alloc(sizeof(int) * (size_t)size);
    ra_status st = RA_OK;
    if (v == NULL || map == NULL) {
        st = RA_ERR_NOMEM;
        goto fail;
    }
    for (int i = 0; i < size; i++)
        map[i] = c->transport != NULL ? c->members[members[i]] : members[i];
    RA_CHECKGOTO(ra_comm_init_base(v, vt, new_rank, size,
                                   c->default_timeout), st, fail);
    v->device_id = c->device_id;
    v->transport = root;
    v->members = map;
    v->context = context;
    /* known to the transport before its first transfer (which also moves
     * the transport's next_context past it) */
    if (root->vt->context_open != NULL &&
        (st = root->vt->context_open(root, v)) != RA_OK) {
        ra_comm_destroy_base(v);
        goto fail;
    }
    *out = v;
    return RA_OK;
fail:
    ra_host_free(map, sizeof(int) * (size_t)size);
    ra_host_free(v, sizeof *v);
    return st;
}

/* ---- records ------------------------------------------------------------ */

/* Fail the split with a CommError about a peer's record. */
static ra_status bad_record(ra_comm *c, int from, const char *why) {
    char msg[RA_COMM_MSG_LEN];
    ra_snprintf(msg, sizeof msg, "rank %d: split: rank %d sent a malformed "
             "record (%s); is every rank running the same ringattn?",
             c->rank, from, why);
    ra_set_error(RA_ERR_COMM, "%s", msg);
    return ra_comm_fail(c, RA_ERR_COMM, msg);
}

/* Every rank's entry from the allgathered records. */
static ra_status read_records(ra_comm *c, const unsigned char *all,
                              const size_t *lens, split_entry *e) {
    size_t off = 0;
    for (int i = 0; i < c->size; i++) {
        const unsigned char *rec = all + off;
        off += lens[i];
        if (lens[i] != RECORD_BYTES) return bad_record(c, i, "wrong size");
        if (memcmp(rec, RECORD_MAGIC, 4) != 0)
            return bad_record(c, i, "bad magic");
        e[i].rank = i;
        e[i].color = (int32_t)get_u32(rec + 4);
        e[i].key = (int32_t)get_u32(rec + 8);
        e[i].context = get_u32(rec + 12);
        if (e[i].color < -1) return bad_record(c, i, "negative color");
        if (e[i].context == 0 || e[i].context > RA_XFER_MAX_CONTEXT)
            return bad_record(c, i, "context out of range");
    }
    return RA_OK;
}

static int by_key_then_rank(const void *a, const void *b) {
    const split_entry *x = a, *y = b;
    if (x->key != y->key) return x->key < y->key ? -1 : 1;
    return (x->rank > y->rank) - (x->rank < y->rank);
}

/* ---- nccl --------------------------------------------------------------- */

/* The group's first rank makes a unique id; a second allgather over c
 * hands it to the others.  Every rank of c takes part (an empty item when
 * it leads no group of two or more, or could not make an id: then the
 * members fail naming it, and it reports its own error). */
static ra_status share_group_id(ra_comm *c, const int *members, int size,
                                int new_rank, double timeout,
                                unsigned char id[RA_NCCL_ID_BYTES]) {
    unsigned char mine[RA_NCCL_ID_BYTES];
    size_t n = 0;
    ra_status own = RA_OK;
    char own_msg[RA_COMM_MSG_LEN] = "";
    if (new_rank == 0 && size > 1) {
        own = ra_nccl_unique_id(NULL, mine);
        if (own == RA_OK)
            n = sizeof mine;
        else
            ra_snprintf(own_msg, sizeof own_msg, "%s", ra_last_error());
    }
    void *all = NULL;
    size_t total = 0;
    size_t *lens = ra_host_calloc(sizeof(size_t) * (size_t)c->size);
    if (lens == NULL) return RA_ERR_NOMEM;
    ra_status st = ra_comm_allgather(c, mine, n, &all, &total, lens, timeout);
    if (st == RA_OK && own != RA_OK) {
        ra_set_error(own, "%s", own_msg);
        st = own;
    } else if (st == RA_OK && size > 1) {
        int leader = members[0];
        size_t off = 0;
        for (int i = 0; i < leader; i++) off += lens[i];
        if (lens[leader] != RA_NCCL_ID_BYTES)
            st = bad_record(c, leader, "no NCCL unique id from the first "
                                       "rank of its group");
        else
            memcpy(id, (unsigned char *)all + off, RA_NCCL_ID_BYTES);
    }
    if (all != NULL) ra_host_free(all, total);
    ra_host_free(lens, sizeof(size_t) * (size_t)c->size);
    return st;
}

/* Two groups with more than one rank each would derive one id from
 * NCCL_COMM_ID. */
static ra_status check_nccl_comm_id(ra_comm *c, const split_entry *sorted) {
    const char *env = getenv("NCCL_COMM_ID");
    if (env == NULL || *env == '\0') return RA_OK;
    int groups = 0;
    for (int i = 0; i < c->size;) {
        int j = i;
        while (j < c->size && sorted[j].color == sorted[i].color) j++;
        if (sorted[i].color >= 0 && j - i > 1) groups++;
        i = j;
    }
    if (groups <= 1) return RA_OK;
    ra_set_error(RA_ERR_VALUE, "rank %d: split: NCCL_COMM_ID is set, so NCCL "
                 "would give the %d new communicators one rendezvous; unset "
                 "it (ringattn shares fresh unique ids itself)", c->rank,
                 groups);
    return RA_ERR_VALUE;
}

static int by_color(const void *a, const void *b) {
    const split_entry *x = a, *y = b;
    if (x->color != y->color) return x->color < y->color ? -1 : 1;
    return (x->rank > y->rank) - (x->rank < y->rank);
}

/* ---- the context (host, threads) ---------------------------------------- */

/* Two splits of different communicators on one transport may run at the
 * same time on a rank (from two threads), and reach the ranks in other
 * orders; each rank's proposals must then differ, and two splits must
 * never agree on one context where they share a rank.  So a rank reserves
 * its proposal (no other split in progress here proposes it), and after
 * the ranks agree on the largest proposal each claims it: its own
 * proposal, a context past next_context nobody here claimed, or another
 * split's mere proposal (which that split then no longer owns).  If any
 * rank cannot, a second exchange tells them all, and they try again after
 * a short random pause (which breaks the symmetry of two splits that keep
 * colliding), until the deadline.  A claim lasts until the split opens
 * (context_open moves next_context past it) or gives up. */
typedef struct ra_ctx_claim {
    uint32_t context;
    const void *owner;        /* the split's token */
    int agreed;               /* claimed; else only proposed */
    struct ra_ctx_claim *next;
} ra_ctx_claim;

#define VERDICT_MAGIC "RAV1"
#define VERDICT_BYTES 5
enum { VERDICT_TAKEN = 0, VERDICT_CLAIMED = 1, VERDICT_GIVE_UP = 2 };

static ra_ctx_claim *find_claim(ra_comm *t, uint32_t context) {
    for (ra_ctx_claim *k = t->claims; k != NULL; k = k->next)
        if (k->context == context) return k;
    return NULL;
}

int ra_comm_context_pending(ra_comm *t, uint32_t context) {
    const ra_ctx_claim *k = find_claim(t, context);
    return k != NULL && k->agreed;
}

/* The claims of `owner` (NULL: all) go (t->mu held, or t unshared). */
static void drop_claims(ra_comm *t, const void *owner) {
    ra_ctx_claim **link = &t->claims;
    while (*link != NULL) {
        ra_ctx_claim *k = *link;
        if (owner != NULL && k->owner != owner) {
            link = &k->next;
            continue;
        }
        *link = k->next;
        ra_host_free(k, sizeof *k);
    }
}

void ra_comm_claims_free(ra_comm *t) { drop_claims(t, NULL); }

static void release_claims(ra_comm *t, const void *owner) {
    pthread_mutex_lock(&t->mu);
    drop_claims(t, owner);
    pthread_mutex_unlock(&t->mu);
}

/* The first context from next_context on that no split in progress here
 * proposed or claimed, reserved for `owner`. */
static ra_status reserve_context(ra_comm *t, const void *owner,
                                 uint32_t *out) {
    ra_ctx_claim *k = ra_host_calloc(sizeof *k);
    if (k == NULL) return RA_ERR_NOMEM;
    pthread_mutex_lock(&t->mu);
    uint32_t context = atomic_load(&t->next_context);
    while (context < RA_XFER_MAX_CONTEXT && find_claim(t, context) != NULL)
        context++;
    k->context = context;
    k->owner = owner;
    k->next = t->claims;
    t->claims = k;
    pthread_mutex_unlock(&t->mu);
    *out = context;
    return RA_OK;
}

/* Claim the agreed `context` for `owner` here: VERDICT_CLAIMED, or
 * VERDICT_TAKEN (another split here claimed it, or it lies below
 * next_context: taken before), or VERDICT_GIVE_UP (out of memory). */
static int claim_context(ra_comm *t, const void *owner, uint32_t context) {
    ra_ctx_claim *fresh = ra_host_calloc(sizeof *fresh);
    int verdict = VERDICT_TAKEN;
    pthread_mutex_lock(&t->mu);
    ra_ctx_claim *k = find_claim(t, context);
    if (k != NULL && (k->owner == owner || !k->agreed)) {
        k->owner = owner;
        k->agreed = 1;
        verdict = VERDICT_CLAIMED;
    } else if (k == NULL && context >= atomic_load(&t->next_context)) {
        if (fresh != NULL) {
            *fresh = (ra_ctx_claim){context, owner, 1, t->claims};
            t->claims = fresh;
            fresh = NULL;
            verdict = VERDICT_CLAIMED;
        } else {
            verdict = VERDICT_GIVE_UP;
        }
    }
    pthread_mutex_unlock(&t->mu);
    if (fresh != NULL) ra_host_free(fresh, sizeof *fresh);
    return verdict;
}

/* The time left before `deadline` for one exchange (never 0, which would
 * mean the default timeout). */
static double left(double deadline) {
    double t = deadline - ra_now();
    return t > 1e-3 ? t : 1e-3;
}

/* Every rank's `n` bytes of rec, before `deadline`: *all (*total bytes)
 * and *lens (c->size entries), for the caller to free (also on failure). */
static ra_status gather(ra_comm *c, const void *rec, size_t n,
                        double deadline, void **all, size_t *total,
                        size_t **lens) {
    *lens = ra_host_calloc(sizeof(size_t) * (size_t)c->size);
    if (*lens == NULL) return RA_ERR_NOMEM;
    return ra_comm_allgather(c, rec, n, all, total, *lens, left(deadline));
}

/* Every rank's record (color, key, proposed context) into e; *largest:
 * the largest proposal. */
static ra_status exchange_records(ra_comm *c, int color, int key,
                                  uint32_t proposal, double deadline,
                                  split_entry *e, uint32_t *largest) {
    unsigned char rec[RECORD_BYTES];
    memcpy(rec, RECORD_MAGIC, 4);
    put_u32(rec + 4, (uint32_t)(int32_t)color);
    put_u32(rec + 8, (uint32_t)(int32_t)key);
    put_u32(rec + 12, proposal);
    void *all = NULL;
    size_t total = 0, *lens = NULL;
    ra_status st = gather(c, rec, sizeof rec, deadline, &all, &total, &lens);
    if (st == RA_OK) st = read_records(c, all, lens, e);
    *largest = 0;
    for (int i = 0; st == RA_OK && i < c->size; i++)
        if (e[i].context > *largest) *largest = e[i].context;
    if (all != NULL) ra_host_free(all, total);
    ra_host_free(lens, sizeof(size_t) * (size_t)c->size);
    return st;
}

/* Every rank's verdict on the agreed context: the lowest one (GIVE_UP
 * above all), and *who, a rank that gave up. */
static ra_status exchange_verdicts(ra_comm *c, int mine, double deadline,
                                   int *verdict, int *who) {
    unsigned char rec[VERDICT_BYTES];
    memcpy(rec, VERDICT_MAGIC, 4);
    rec[4] = (unsigned char)mine;
    void *all = NULL;
    size_t total = 0, *lens = NULL;
    ra_status st = gather(c, rec, sizeof rec, deadline, &all, &total, &lens);
    *verdict = VERDICT_CLAIMED;
    *who = -1;
    size_t off = 0;
    for (int i = 0; st == RA_OK && i < c->size; off += lens[i], i++) {
        const unsigned char *r = (const unsigned char *)all + off;
        if (lens[i] != VERDICT_BYTES || memcmp(r, VERDICT_MAGIC, 4) != 0 ||
            r[4] > VERDICT_GIVE_UP) {
            st = bad_record(c, i, "bad context verdict");
        } else if (r[4] == VERDICT_GIVE_UP) {
            *verdict = VERDICT_GIVE_UP;
            if (*who < 0) *who = i;
        } else if (r[4] == VERDICT_TAKEN && *verdict != VERDICT_GIVE_UP) {
            *verdict = VERDICT_TAKEN;
        }
    }
    if (all != NULL) ra_host_free(all, total);
    ra_host_free(lens, sizeof(size_t) * (size_t)c->size);
    return st;
}

/* A pause of up to `round` ms (at most 10), not past the deadline. */
static void pause_before_retry(uint64_t *seed, int round, double deadline) {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    double cap = (round < 10 ? round : 10) * 1e-3;
    double t = cap * (double)(*seed % 1024) / 1024.0;
    if (t > deadline - ra_now()) t = deadline - ra_now();
    if (!(t > 0)) return;
    struct timespec ts = {(time_t)t, (long)((t - (double)(time_t)t) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* The context of the new communicators, claimed on this rank when it
 * joins one (color >= 0); every rank's record in e. */
static ra_status agree_context(ra_comm *c, ra_comm *root, int color,
                               int key, double deadline, const void *owner,
                               split_entry *e, uint32_t *out) {
    uint64_t seed = (uint64_t)(uintptr_t)owner ^
                    (uint64_t)(ra_now() * 1e9) ^ ((uint64_t)c->rank << 32);
    if (seed == 0) seed = 1;
    for (int round = 1;; round++) {
        uint32_t proposal, context;
        RA_CHECK(reserve_context(root, owner, &proposal));
        RA_CHECK(exchange_records(c, color, key, proposal, deadline, e,
                                  &context));
        /* (past the last context: refused by the caller on every rank) */
        int mine = VERDICT_CLAIMED;
        if (color >= 0 && context < RA_XFER_MAX_CONTEXT)
            mine = claim_context(root, owner, context);
        if (mine == VERDICT_TAKEN && ra_now() >= deadline)
            mine = VERDICT_GIVE_UP;
        int verdict, who;
        RA_CHECK(exchange_verdicts(c, mine, deadline, &verdict, &who));
        if (verdict == VERDICT_CLAIMED) {
            *out = context;
            return RA_OK;
        }
        if (verdict == VERDICT_GIVE_UP) {
            /* every rank saw the same verdicts: all fail alike */
            char msg[RA_COMM_MSG_LEN];
            ra_snprintf(msg, sizeof msg, "rank %d: split: rank %d found no "
                        "free communicator context (%d tries: splits of "
                        "other communicators on these connections took "
                        "them, or it ran out of time or memory)", c->rank,
                        who, round);
            ra_set_error(RA_ERR_COMM, "%s", msg);
            return ra_comm_fail(c, RA_ERR_COMM, msg);
        }
        release_claims(root, owner);
        pause_before_retry(&seed, round, deadline);
    }
}

/* ---- the split ---------------------------------------------------------- */

ra_status ra_comm_split(ra_comm *c, int color, int key, double timeout,
                        ra_comm **out) {
    *out = NULL;
    RA_CHECK(ra_comm_check_usable(c, "split"));
    if (color < -1) {
        ra_set_error(RA_ERR_VALUE, "rank %d: split: color must be >= 0 (or "
                     "-1: no group), got %d", c->rank, color);
        return RA_ERR_VALUE;
    }
    if (!(timeout > 0)) timeout = c->default_timeout;
    double deadline = ra_now() + timeout;
    ra_comm *root = c->transport != NULL ? c->transport : c;
    int p = c->size, nccl = strcmp(c->vt->name, "nccl") == 0;
    int token;                /* names this split's claims while it runs */
    ra_status st = RA_OK;
    split_entry *e = ra_host_calloc(sizeof(split_entry) * (size_t)p);
    split_entry *sorted = ra_host_calloc(sizeof(split_entry) * (size_t)p);
    int *members = ra_host_calloc(sizeof(int) * (size_t)p);
    if (!e || !sorted || !members) {
        st = RA_ERR_NOMEM;
        goto done;
    }
    /* the agreed context (nccl: only recorded, each split has an NCCL
     * communicator of its own) */
    uint32_t context = 0;
    if (nccl) {
        RA_CHECKGOTO(exchange_records(c, color, key,
                                      atomic_load(&root->next_context),
                                      deadline, e, &context), st, done);
    } else {
        RA_CHECKGOTO(agree_context(c, root, color, key, deadline, &token, e,
                                   &context), st, done);
    }
    if (context >= RA_XFER_MAX_CONTEXT) {
        ra_set_error(RA_ERR_COMM, "rank %d: split: no communicator context "
                     "left (%u splits over this transport)", c->rank,
                     context);
        st = ra_comm_fail(c, RA_ERR_COMM, ra_last_error());
        goto done;
    }
    /* a member's transport moves next_context when its split opens there
     * (make_view); the others' at once */
    if (nccl || color < 0) ra_comm_context_taken(root, context);

    memcpy(sorted, e, sizeof(split_entry) * (size_t)p);
    qsort(sorted, (size_t)p, sizeof *sorted, by_color);
    if (nccl) RA_CHECKGOTO(check_nccl_comm_id(c, sorted), st, done);

    /* my group, ordered by (key, rank) */
    int size = 0, new_rank = -1;
    for (int i = 0; i < p; i++)
        if (color >= 0 && e[i].color == color) sorted[size++] = e[i];
    qsort(sorted, (size_t)size, sizeof *sorted, by_key_then_rank);
    for (int i = 0; i < size; i++) {
        members[i] = sorted[i].rank;
        if (sorted[i].rank == c->rank) new_rank = i;
    }
    if (!nccl) {
        if (color >= 0) {
            st = make_view(c, members, size, new_rank, context, out);
            if (st != RA_OK) ra_comm_context_taken(root, context);
        }
        goto done;
    }
    unsigned char id[RA_NCCL_ID_BYTES];
    RA_CHECKGOTO(share_group_id(c, members, color >= 0 ? size : 0,
                                color >= 0 ? new_rank : -1,
                                deadline - ra_now(), id), st, done);
    if (color < 0) goto done;
    ra_nccl_options o;
    memset(&o, 0, sizeof o);
    o.rank = new_rank;
    o.size = size;
    o.device = c->device_id;
    o.unique_id = size > 1 ? id : NULL;
    o.timeout = deadline - ra_now();
    if (!(o.timeout > 0)) o.timeout = 1e-3;
    st = ra_nccl_comm_create(&o, out);
    if (st == RA_OK) (*out)->default_timeout = c->default_timeout;
done:
    /* opened (its context below next_context) or given up */
    if (!nccl) release_claims(root, &token);
    ra_host_free(e, sizeof(split_entry) * (size_t)p);
    ra_host_free(sorted, sizeof(split_entry) * (size_t)p);
    ra_host_free(members, sizeof(int) * (size_t)p);
    return st;
}
