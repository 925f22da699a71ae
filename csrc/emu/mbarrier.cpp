/*
 * mbarrier.cpp -- mbarriers on the emulated GPU (PTX ISA, "Parallel
 * Synchronization and Communication Instructions: mbarrier"): init, inval,
 * arrive (count), arrive.expect_tx, expect_tx, complete_tx by bulk copies
 * (ptx_tma.cpp), try_wait / test_wait.parity.
 *
 * Phases.  init(count) starts phase 0 with `count` pending arrivals and a
 * transaction count of 0.  arrive takes one (or `count`) pending arrival;
 * expect_tx(b) adds b to the transaction count, complete_tx(b) (a bulk copy
 * landing) takes b from it; the phase completes when both are 0, and the
 * next one starts with `count` pending arrivals again.  try_wait.parity(p)
 * returns once the phase of parity p has completed: the current phase when
 * its parity is p, else the one before it (so parity 1 on a fresh barrier
 * returns at once).  Here a wait blocks the thread until then; when no
 * thread of the block can run any more, the block is a deadlock whose
 * report names the barrier, the parity waited for and the arrivals and
 * transaction bytes still missing.  test_wait answers 0 to the first poll
 * of a phase not yet complete, then waits like try_wait (the emulator
 * cannot tell a spin from a wait).  Bulk copies count their bytes at issue;
 * their data lands when the phase completes.
 *
 * Ordering: an arrive is a release of the arriving warp into the phase's
 * carry; a completed phase's carries are what a successful wait acquires,
 * with the phase count itself (what makes a bulk copy's bytes visible to
 * that warp, sm90.h).
 */
#include "emu/sm90.h"
#include "emu/ptx_sm90.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

namespace ra_emu {

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
    for (unsigned i = 0; i < kVc; i++) m.done[i] = hp_max(m.done[i], m.carry[i]);
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

void mbar_describe_wait(const Thread *t, char *buf, size_t n) {
    const Sm90Block *h = t->blk->hp;
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
}

void mbar_block_end(Block *b) {
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
            seen = hp_max(seen, m.phase);
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

