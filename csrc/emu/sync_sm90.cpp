/*
 * sync_sm90.cpp -- Hopper synchronisation on the emulated GPU: the
 * release clock and the warps' happens-before vectors (sm90.h), named
 * barriers (bar.sync / bar.arrive id, count), warpgroup collectives
 * (wgmma.mma_async, setmaxnreg), fence.proxy.async, and what the scheduler
 * asks of the Hopper state: the text of a deadlock, and the checks when a
 * thread returns or a block ends.  mbarriers are in mbarrier.cpp.
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
    for (unsigned i = 0; i < kVc; i++) carry[i] = hp_max(carry[i], v[i]);
    carry[warp] = hp_max(carry[warp], r);
    return r;
}

void hp_acquire(Block *b, unsigned warp, const uint32_t *carry) {
    uint32_t *v = b->hp->vc[warp];
    for (unsigned i = 0; i < kVc; i++) v[i] = hp_max(v[i], carry[i]);
}

void hp_syncthreads(Block *b) {
    if (!b->hp_on) return;
    Sm90Block *h = b->hp;
    uint32_t seen[kMaxMbar] = {0};
    for (unsigned w = 0; w < b->nwarps; w++)
        for (unsigned s = 0; s < kMaxMbar; s++) seen[s] = hp_max(seen[s], h->vc[w][32 + s]);
    for (unsigned w = 0; w < b->nwarps; w++) {
        for (unsigned u = 0; u < b->nwarps; u++) h->vc[w][u] = hp_max(h->vc[w][u], b->bar_time);
        memcpy(&h->vc[w][32], seen, sizeof seen);
    }
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
        mbar_describe_wait(t, buf, n);
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
    if (b->hp_on) mbar_block_end(b);
}

}  // namespace ra_emu

using namespace ra_emu;

/* ---- entry points (ptx_sm90.h) ----------------------------------------------------- */

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
