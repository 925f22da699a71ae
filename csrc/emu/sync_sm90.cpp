/*
 * sync_sm90.cpp -- Hopper synchronisation on the emulated GPU: the
 * release clock and the warps' vectors (sm90.h), named barriers
 * (bar.sync / bar.arrive id, count), mbarriers (init, arrive,
 * arrive.expect_tx, expect_tx, complete_tx by bulk copies, try_wait /
 * test_wait.parity), warpgroup collectives (wgmma.mma_async, setmaxnreg),
 * fence.proxy.async, and what the scheduler asks of them: the text of a
 * deadlock, and the checks when a thread returns or a block ends.
 *
 * mbarrier phases (PTX ISA, "Parallel Synchronization and Communication
 * Instructions: mbarrier").  init(count) starts phase 0 with `count`
 * pending arrivals and a transaction count of 0.  arrive takes one (or
 * `count`) pending arrival; expect_tx(b) adds b to the transaction count,
 * complete_tx(b) (a bulk copy landing) takes b from it; the phase
 * completes when both are 0, and the next one starts with `count` pending
 * arrivals again.  try_wait.parity(p) returns once the phase of parity p
 * has completed: the current phase when its parity is p, else the one
 * before it (so parity 1 on a fresh barrier returns at once).  Here a wait
 * blocks the thread until then; when no thread of the block can run any
 * more, the block is a deadlock whose report names the barrier, the
 * parity waited for and the arrivals and transaction bytes still missing.
 * test_wait answers 0 to the first poll of a phase not yet complete, then
 * waits like try_wait (the emulator cannot tell a spin from a wait).  Bulk
 * copies (ptx_tma.cpp) count their bytes at issue; their data lands when
 * the phase completes.
 *
 * Named barriers: ids 1-15 (0 is __syncthreads'), counts in threads, a
 * multiple of 32; a barrier completes when `count` threads have arrived
 * (bar.sync waits, bar.arrive does not); every thread must give the same
 * count.
 */
#include "emu/sm90.h"
#include "emu/ptx_sm90.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

namespace ra_emu {

static inline uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

Sm90Block *hp_block(Block *b) {
    if (b->hp == nullptr) b->hp = new Sm90Block();
    Sm90Block *h = b->hp;
    if (!b->hp_on) {
        b->hp_on = true;
        memset(h->vc, 0, sizeof h->vc);
        memset(h->fence, 0, sizeof h->fence);
        for (unsigned s = 0; s < h->n_mbar; s++) {
            for (TmaStage *st = h->mbar[s].staged; st != nullptr;) {
                TmaStage *next = st->next;
                free(st);
                st = next;
            }
        }
        memset(h->mbar, 0, sizeof h->mbar);
        h->n_mbar = 0;
        memset(h->named, 0, sizeof h->named);
        memset(h->wg, 0, sizeof h->wg);
        memset(h->maxnreg, 0, sizeof h->maxnreg);
        h->ops.assign(1, AsyncOp());
    }
    return h;
}

void hp_block_start(Block *b) {
    b->now = 1;
    b->bar_time = 0;
    b->hp_on = false;
    b->w->reg_watch = 0;
}

Sm90Thread *hp_thread(Thread *t) {
    if (t->hp == nullptr) {
        t->hp = (Sm90Thread *)calloc(1, sizeof(Sm90Thread));
        if (t->hp == nullptr) {
            fprintf(stderr, "ringattn emulated GPU: out of memory for a thread's wgmma state\n");
            abort();
        }
    }
    return t->hp;
}

void hp_thread_start(Thread *t) {
    Sm90Thread *s = t->hp;
    if (s == nullptr) return;
    s->n_acc = s->n_ops = s->n_groups = 0;
    s->seq = s->fences = 0;
    s->watch_lo = s->watch_hi = 0;
    s->n_bulk = s->n_bulk_groups = 0;
}

uint32_t hp_release(Block *b, unsigned warp, uint32_t *carry) {
    Sm90Block *h = b->hp;
    const uint32_t r = b->now++;
    const uint32_t *v = h->vc[warp];
    for (unsigned i = 0; i < kVc; i++) carry[i] = umax(carry[i], v[i]);
    carry[warp] = umax(carry[warp], r);
    return r;
}

void hp_acquire(Block *b, unsigned warp, const uint32_t *carry) {
    uint32_t *v = b->hp->vc[warp];
    for (unsigned i = 0; i < kVc; i++) v[i] = umax(v[i], carry[i]);
}

void hp_syncthreads(Block *b) {
    if (!b->hp_on) return;
    Sm90Block *h = b->hp;
    uint32_t seen[kMaxMbar] = {0};
    for (unsigned w = 0; w < b->nwarps; w++)
        for (unsigned s = 0; s < kMaxMbar; s++) seen[s] = umax(seen[s], h->vc[w][32 + s]);
    for (unsigned w = 0; w < b->nwarps; w++) {
        for (unsigned u = 0; u < b->nwarps; u++) h->vc[w][u] = umax(h->vc[w][u], b->bar_time);
        memcpy(&h->vc[w][32], seen, sizeof seen);
    }
}

/* ---- mbarriers ----------------------------------------------------------------- */

static unsigned phase_index(const MBarrier &m) { return m.phase - m.phase_base; }

/* the phase completes: its staged bulk copies land, its arrivals' releases
 * become what a waiter acquires, waiters wake */
static void mbar_complete(Block *b, int s) {
    MBarrier &m = b->hp->mbar[s];
    TmaStage *st = m.staged;
    m.staged = nullptr;
    while (st != nullptr) {
        TmaStage *next = st->next;
        memcpy(st->dst, st->data, st->n);
        free(st);
        st = next;
    }
    m.phase++;
    for (unsigned i = 0; i < kVc; i++) m.done[i] = umax(m.done[i], m.carry[i]);
    memset(m.carry, 0, sizeof m.carry);
    m.pending = m.expected;
    m.tx = m.tx_expect = m.tx_done = 0;
    for (unsigned i = 0; i < b->nthreads; i++) {
        Thread *o = &b->threads[i];
        if (o->state == T_MBAR && o->wait_arg == (uint32_t)s) o->state = T_READY;
    }
}

static void mbar_maybe_complete(Block *b, int s) {
    MBarrier &m = b->hp->mbar[s];
    if (m.pending == 0 && m.tx == 0) mbar_complete(b, s);
}

static void check_tx(const MBarrier &m, Thread *t) {
    (void)t;
    if (m.tx > 0xfffff || m.tx < -0xfffff)
        ra_emu_report(RA_EMU_TRAP, "mbarrier transaction count %lld is outside the range "
                      "the device keeps (+-(2^20 - 1) bytes per phase)", (long long)m.tx);
}

void hp_mbar_complete_tx(Block *b, int s, int64_t bytes, TmaStage *stage) {
    MBarrier &m = b->hp->mbar[s];
    if (stage != nullptr) {
        stage->next = m.staged;
        m.staged = stage;
    }
    m.tx -= bytes;
    m.tx_done += bytes;
    mbar_maybe_complete(b, s);
}

static int find_slot(Sm90Block *h, const void *bar) {
    for (unsigned s = 0; s < h->n_mbar; s++)
        if (h->mbar[s].addr == (const unsigned char *)bar) return (int)s;
    return -1;
}

static void check_mbar_address(Thread *t, const void *bar, const char *what) {
    if ((uintptr_t)bar % 8)
        ra_emu_report(RA_EMU_MISALIGNED, "%s on an mbarrier at %p: not 8-byte aligned", what,
                      bar);
    if (!in_shared(t, (uintptr_t)bar, 8))
        ra_emu_report(RA_EMU_OOB_SHARED, "%s on an mbarrier at %p, which is not in the "
                      "block's shared memory", what, bar);
}

int hp_mbar_slot(Thread *t, const void *bar, const char *what) {
    Block *b = t->blk;
    Sm90Block *h = hp_block(b);
    check_mbar_address(t, bar, what);
    const int s = find_slot(h, bar);
    char where[96];
    if (s < 0 || !h->mbar[s].live)
        ra_emu_report(RA_EMU_SYNC, "%s on the mbarrier at %s, which no mbarrier.init "
                      "initialised%s", what, shared_where(t, bar, where, sizeof where),
                      s >= 0 ? " (it was invalidated)" : "");
    const MBarrier &m = h->mbar[s];
    if (!shadow_synced(t, m.init_tid, m.init_time, m.init_wwarp))
        ra_emu_report(RA_EMU_RACE_SHARED, "%s on the mbarrier at %s before its mbarrier.init "
                      "by thread %u is visible (no __syncthreads or barrier after the init)",
                      what, shared_where(t, bar, where, sizeof where), m.init_tid);
    return s;
}

/* ---- named barriers ------------------------------------------------------------- */

static void named_complete(Block *b, unsigned id, Thread *caller, bool caller_waits) {
    Sm90Block *h = b->hp;
    NamedBar &nb = h->named[id];
    for (unsigned i = 0; i < b->nthreads; i++) {
        Thread *o = &b->threads[i];
        if (o->state == T_NAMED && o->wait_arg == id) {
            hp_acquire(b, o->warp, nb.carry);
            o->state = T_READY;
        }
    }
    if (caller_waits) hp_acquire(b, caller->warp, nb.carry);
    nb.arrived = 0;
    nb.count = 0;
    memset(nb.carry, 0, sizeof nb.carry);
}

/* ---- warpgroup collectives ---------------------------------------------------------- */

static const char *wg_name(uint8_t kind) {
    return kind == WG_WGMMA ? "wgmma.mma_async" : kind == WG_SETMAXNREG ? "setmaxnreg" : "?";
}

void hp_wg_collective(Thread *t, uint8_t kind, void (*complete)(Block *, unsigned)) {
    Block *b = t->blk;
    Sm90Block *h = hp_block(b);
    const unsigned wg = t->warp / 4;
    if ((wg + 1) * 128 > b->nthreads)
        ra_emu_report(RA_EMU_SYNC, "%s in warpgroup %u, which has %u threads: a warpgroup is "
                      "4 whole warps (128 threads)", wg_name(kind), wg, b->nthreads - wg * 128);
    WgColl &c = h->wg[wg];
    if (c.arrived == 0) {
        c.kind = kind;
    } else if (c.kind != kind) {
        ra_emu_report(RA_EMU_SYNC, "threads of warpgroup %u in different warpgroup "
                      "instructions: thread %u in %s, others in %s", wg, t->tid,
                      wg_name(kind), wg_name(c.kind));
    }
    for (unsigned i = wg * 128; i < wg * 128 + 128; i++) {
        if (b->threads[i].state == T_DONE)
            ra_emu_report(RA_EMU_SYNC, "%s of warpgroup %u waits for thread %u, which has "
                          "returned", wg_name(kind), wg, i);
    }
    t->state = T_WGROUP;
    t->wait_arg = kind;
    if (++c.arrived == 128) {
        c.arrived = 0;
        complete(b, wg);
        for (unsigned i = wg * 128; i < wg * 128 + 128; i++) b->threads[i].state = T_READY;
    }
    fiber_yield(t);
}

static void complete_setmaxnreg(Block *b, unsigned wg) {
    Sm90Block *h = b->hp;
    const Thread *first = &b->threads[wg * 128];
    const unsigned n = (unsigned)first->in[0];
    const int inc = (int)first->in[1];
    for (unsigned i = wg * 128 + 1; i < wg * 128 + 128; i++) {
        const Thread *o = &b->threads[i];
        if ((unsigned)o->in[0] != n || (int)o->in[1] != inc)
            ra_emu_report(RA_EMU_SYNC, "setmaxnreg is not warpgroup-uniform: thread %u asks "
                          "for .%s %u, thread %u for .%s %u", first->tid, inc ? "inc" : "dec",
                          n, o->tid, o->in[1] ? "inc" : "dec", (unsigned)o->in[0]);
    }
    if (n < 24 || n > 256 || n % 8)
        ra_emu_report(RA_EMU_TRAP, "setmaxnreg %u: the count must be a multiple of 8 in "
                      "24..256", n);
    const unsigned cur = h->maxnreg[wg];
    if (cur != 0 && (inc ? n < cur : n > cur))
        ra_emu_report(RA_EMU_TRAP, "setmaxnreg.%s %u in warpgroup %u, whose count is %u: "
                      ".inc may only raise it, .dec only lower it", inc ? "inc" : "dec", n,
                      wg, cur);
    h->maxnreg[wg] = n;
}

/* ---- the scheduler's questions ------------------------------------------------------- */

void hp_describe_wait(const Thread *t, char *buf, size_t n) {
    const Block *b = t->blk;
    const Sm90Block *h = b->hp;
    if (h == nullptr || !b->hp_on) {
        snprintf(buf, n, "in nothing");
        return;
    }
    if (t->state == T_NAMED) {
        const NamedBar &nb = h->named[t->wait_arg];
        snprintf(buf, n, "at named barrier %u (%u of %u threads arrived)", t->wait_arg,
                 nb.arrived, nb.count);
    } else if (t->state == T_MBAR) {
        const MBarrier &m = h->mbar[t->wait_arg];
        char where[96];
        shared_where(t, m.addr, where, sizeof where);
        const int64_t arrived = (int64_t)m.expected - m.pending;
        int k = snprintf(buf, n, "on the mbarrier at %s for the phase of parity %u: phase %u "
                         "has %lld of %u arrivals and %lld of %lld expect_tx bytes",
                         where, t->wait_arg2, phase_index(m), (long long)arrived, m.expected,
                         (long long)m.tx_done, (long long)m.tx_expect);
        if (k > 0 && (size_t)k < n) {
            const char *why = m.tx > 0 && m.pending == 0
                                  ? " (expect_tx bytes that never arrive)"
                              : m.tx < 0 ? " (more bytes arrived than expect_tx announced)"
                              : m.pending > 0 ? " (arrivals missing)" : "";
            snprintf(buf + k, n - (size_t)k, "%s", why);
        }
    } else if (t->state == T_WGROUP) {
        snprintf(buf, n, "in %s (warpgroup %u: %u of 128 threads joined)",
                 wg_name((uint8_t)t->wait_arg), t->warp / 4, h->wg[t->warp / 4].arrived);
    } else {
        snprintf(buf, n, "in nothing");
    }
}

void hp_thread_exit(Thread *t) {
    Block *b = t->blk;
    if (!b->hp_on) return;
    Sm90Block *h = b->hp;
    const unsigned wg = t->warp / 4;
    if (wg < kMaxWarpgroups && h->wg[wg].arrived)
        ra_emu_report(RA_EMU_SYNC, "thread %u returned while its warpgroup %u waits for it in "
                      "%s", t->tid, wg, wg_name(h->wg[wg].kind));
    Sm90Thread *s = t->hp;
    if (s != nullptr && s->n_ops)
        ra_emu_report(RA_EMU_SYNC, "thread %u returned with %u wgmma.mma_async operations in "
                      "flight (no wgmma.wait_group retired them)", t->tid, s->n_ops);
}

void hp_block_end(Block *b) {
    if (!b->hp_on) return;
    Sm90Block *h = b->hp;
    for (unsigned s = 0; s < h->n_mbar; s++) {
        MBarrier &m = h->mbar[s];
        if (m.staged == nullptr) continue;
        size_t bytes = 0;
        for (TmaStage *st = m.staged; st != nullptr; st = st->next) bytes += st->n;
        char where[96];
        shared_where(&b->threads[0], m.addr, where, sizeof where);
        ra_emu_report(RA_EMU_SYNC, "the block finished with %zu bytes of bulk copies in flight "
                      "on the mbarrier at %s: its phase %u never completed (%lld of %lld "
                      "expect_tx bytes, %lld of %u arrivals)", bytes, where, phase_index(m),
                      (long long)m.tx_done, (long long)m.tx_expect,
                      (long long)((int64_t)m.expected - m.pending), m.expected);
        return;
    }
}

}  // namespace ra_emu

using namespace ra_emu;

/* ---- entry points (ptx_sm90.h) ----------------------------------------------------- */

extern "C" void ra_emu_mbar_init(void *bar, unsigned count) {
    Thread *t = kernel_thread("mbarrier.init");
    Block *b = t->blk;
    Sm90Block *h = hp_block(b);
    check_mbar_address(t, bar, "mbarrier.init");
    if (count == 0 || count > 0xfffff)
        ra_emu_report(RA_EMU_TRAP, "mbarrier.init with count %u (1..2^20 - 1)", count);
    int s = find_slot(h, bar);
    if (s < 0) {
        if (h->n_mbar == kMaxMbar)
            ra_emu_report(RA_EMU_TRAP, "more than %u mbarriers in one block", (unsigned)kMaxMbar);
        s = (int)h->n_mbar++;
        h->mbar[s].addr = (unsigned char *)bar;
    }
    MBarrier &m = h->mbar[s];
    char where[96];
    if (m.live && m.staged != nullptr)
        ra_emu_report(RA_EMU_SYNC, "mbarrier.init on the mbarrier at %s while bulk copies are "
                      "in flight on it", shared_where(t, bar, where, sizeof where));
    m.live = true;
    m.expected = count;
    m.pending = count;
    m.tx = m.tx_expect = m.tx_done = 0;
    m.phase_base = m.phase;
    m.init_tid = t->tid;
    m.init_time = b->now;
    m.init_wwarp = b->warps[t->warp].gen;
    memset(m.carry, 0, sizeof m.carry);
}

extern "C" void ra_emu_mbar_inval(void *bar) {
    Thread *t = kernel_thread("mbarrier.inval");
    const int s = hp_mbar_slot(t, bar, "mbarrier.inval");
    MBarrier &m = t->blk->hp->mbar[s];
    char where[96];
    if (m.staged != nullptr)
        ra_emu_report(RA_EMU_SYNC, "mbarrier.inval on the mbarrier at %s while bulk copies "
                      "are in flight on it", shared_where(t, bar, where, sizeof where));
    m.live = false;
}

extern "C" uint64_t ra_emu_mbar_arrive(void *bar, unsigned count, unsigned tx) {
    Thread *t = kernel_thread("mbarrier.arrive");
    const int s = hp_mbar_slot(t, bar, tx ? "mbarrier.arrive.expect_tx" : "mbarrier.arrive");
    Block *b = t->blk;
    MBarrier &m = b->hp->mbar[s];
    const uint64_t token = phase_index(m);
    if (count == 0 || count > 0xfffff)
        ra_emu_report(RA_EMU_TRAP, "mbarrier.arrive with count %u (1..2^20 - 1)", count);
    m.tx += tx;
    m.tx_expect += tx;
    check_tx(m, t);
    hp_release(b, t->warp, m.carry);
    if ((int64_t)count > m.pending) {
        char where[96];
        ra_emu_report(RA_EMU_SYNC, "mbarrier.arrive of %u on the mbarrier at %s, whose phase "
                      "%u has only %lld arrivals pending (init count %u)", count,
                      shared_where(t, bar, where, sizeof where), phase_index(m),
                      (long long)m.pending, m.expected);
    }
    m.pending -= count;
    mbar_maybe_complete(b, s);
    return token;
}

extern "C" void ra_emu_mbar_expect_tx(void *bar, unsigned tx) {
    Thread *t = kernel_thread("mbarrier.expect_tx");
    const int s = hp_mbar_slot(t, bar, "mbarrier.expect_tx");
    MBarrier &m = t->blk->hp->mbar[s];
    m.tx += tx;
    m.tx_expect += tx;
    check_tx(m, t);
    mbar_maybe_complete(t->blk, s);
}

extern "C" int ra_emu_mbar_wait(void *bar, unsigned parity, int test) {
    Thread *t = kernel_thread("mbarrier.try_wait");
    const char *what = test ? "mbarrier.test_wait.parity" : "mbarrier.try_wait.parity";
    const int s = hp_mbar_slot(t, bar, what);
    Block *b = t->blk;
    if (parity > 1) ra_emu_report(RA_EMU_TRAP, "%s with parity %u (0 or 1)", what, parity);
    for (bool first = true;; first = false) {
        MBarrier &m = b->hp->mbar[s];
        if ((phase_index(m) & 1u) != parity) {
            hp_acquire(b, t->warp, m.done);
            uint32_t &seen = b->hp->vc[t->warp][32 + s];
            seen = umax(seen, m.phase);
            return 1;
        }
        /* test_wait: the first poll of a phase answers "not yet" at once,
         * as the device does; a thread that polls it again waits (the
         * emulator cannot tell a spin from a wait, and a wait that can
         * never end is then a deadlock it reports) */
        if (test && first && !(t->poll_slot == (uint32_t)s + 1 && t->poll_phase == m.phase)) {
            t->poll_slot = (uint32_t)s + 1;
            t->poll_phase = m.phase;
            return 0;
        }
        t->state = T_MBAR;
        t->wait_arg = (uint32_t)s;
        t->wait_arg2 = parity;
        fiber_yield(t);
        if (!b->hp->mbar[s].live) {
            char where[96];
            ra_emu_report(RA_EMU_SYNC, "%s on the mbarrier at %s, invalidated while the "
                          "thread waited", what, shared_where(t, bar, where, sizeof where));
        }
    }
}

extern "C" void ra_emu_named_barrier(unsigned id, unsigned count, int arrive_only) {
    Thread *t = kernel_thread("bar.sync");
    Block *b = t->blk;
    Sm90Block *h = hp_block(b);
    const char *what = arrive_only ? "bar.arrive" : "bar.sync";
    if (id == 0 || id >= kNamedBars)
        ra_emu_report(RA_EMU_SYNC, "%s %u: named barriers are 1..15 here (0 is the one "
                      "__syncthreads uses)", what, id);
    if (count == 0 || count % RA_EMU_WARP || count > b->nthreads)
        ra_emu_report(RA_EMU_SYNC, "%s %u, %u: the count must be a multiple of 32 threads, "
                      "at most the block's %u", what, id, count, b->nthreads);
    NamedBar &nb = h->named[id];
    if (nb.arrived == 0) {
        nb.count = count;
    } else if (nb.count != count) {
        ra_emu_report(RA_EMU_SYNC, "%s %u: thread %u arrives with count %u, earlier threads "
                      "with %u", what, id, t->tid, count, nb.count);
    }
    hp_release(b, t->warp, nb.carry);
    if (++nb.arrived == nb.count) {
        named_complete(b, id, t, !arrive_only);
        return;
    }
    if (arrive_only) return;
    t->state = T_NAMED;
    t->wait_arg = id;
    fiber_yield(t);
}

extern "C" void ra_emu_setmaxnreg(unsigned n, int inc) {
    Thread *t = kernel_thread("setmaxnreg");
    t->in[0] = n;
    t->in[1] = inc ? 1 : 0;
    hp_wg_collective(t, WG_SETMAXNREG, complete_setmaxnreg);
}

extern "C" unsigned ra_emu_warpgroup_maxnreg(void) {
    Thread *t = kernel_thread("setmaxnreg");
    Block *b = t->blk;
    return b->hp_on ? b->hp->maxnreg[t->warp / 4] : 0;
}

extern "C" void ra_emu_fence_proxy_async(void) {
    Thread *t = kernel_thread("fence.proxy.async");
    Block *b = t->blk;
    Sm90Block *h = hp_block(b);
    h->fence[t->warp] = b->now++;
}
