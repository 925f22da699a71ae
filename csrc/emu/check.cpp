/*
 * check.cpp -- the emulated GPU's memory checker.
 *
 * The kernels are compiled with -fsanitize=thread instrumentation, which
 * calls __tsan_read4(p), __tsan_write8(p), ... before every load and store
 * of kernel code.  Those hooks are defined here (the sanitizer's own
 * runtime is never linked), so every access a kernel makes is classified
 * by its address:
 *
 *   the thread's own stack (locals, the kernel's arguments)      allowed
 *   the block's shared memory window                             check_shared
 *   the devices' memory                                          check_global
 *   the library's own image (read-only data)                     reads allowed
 *   anything else: host memory, which a kernel cannot touch      reported
 *
 * check_global: inside a live allocation of the launching device (out of
 * bounds, freed, another device's memory), and for a read, bytes some
 * kernel, copy or memset has written.
 *
 * check_shared: inside the block's dynamic shared memory, and the shadow
 * (simt.h, one Cell per 2 bytes) finds
 *   - races: a write and an access by another thread in the same barrier
 *     interval (no __syncthreads between them; for two lanes of one warp,
 *     no __syncwarp either), in either order;
 *   - reads of bytes no thread of the block has written;
 *   - reads or writes of a cp.async destination before the wait that
 *     lands it.
 * Host code of the kernels' files (launchers) runs with no current thread
 * and is not checked.
 */
#include "emu/sm90.h"

#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <string.h>

namespace ra_emu {

static uintptr_t g_image_lo, g_image_hi;
static int g_check_on = -1;

struct ImageFind {
    uintptr_t addr, lo, hi;
};

static int find_image(struct dl_phdr_info *info, size_t, void *data) {
    ImageFind *f = (ImageFind *)data;
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) &ph = info->dlpi_phdr[i];
        if (ph.p_type != PT_LOAD) continue;
        const uintptr_t s = info->dlpi_addr + ph.p_vaddr, e = s + ph.p_memsz;
        if (s < lo) lo = s;
        if (e > hi) hi = e;
    }
    if (f->addr >= lo && f->addr < hi) {
        f->lo = lo;
        f->hi = hi;
        return 1;
    }
    return 0;
}

struct TlsFind {
    uintptr_t addr;
    void *data;
    size_t size;
};

static int find_tls(struct dl_phdr_info *info, size_t, void *arg) {
    TlsFind *f = (TlsFind *)arg;
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    size_t tls = 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) &ph = info->dlpi_phdr[i];
        if (ph.p_type == PT_TLS) tls = ph.p_memsz;
        if (ph.p_type != PT_LOAD) continue;
        const uintptr_t s = info->dlpi_addr + ph.p_vaddr, e = s + ph.p_memsz;
        if (s < lo) lo = s;
        if (e > hi) hi = e;
    }
    if (f->addr < lo || f->addr >= hi) return 0;
    f->data = info->dlpi_tls_data;
    f->size = tls;
    return 1;
}

void check_find_tls(Worker *w) {
    TlsFind f = {(uintptr_t)&check_find_tls, nullptr, 0};
    dl_iterate_phdr(find_tls, &f);
    w->tls_lo = (uintptr_t)f.data;
    w->tls_size = f.data != nullptr ? f.size : 0;
    if (w->tls_size) w->tls_cells = new Cell[(w->tls_size + 1) / 2]();
}

void check_init_image(void) {
    ImageFind f = {(uintptr_t)&check_init_image, 0, 0};
    dl_iterate_phdr(find_image, &f);
    g_image_lo = f.lo;
    g_image_hi = f.hi;
    g_check_on = ra_emu_config()->check;
}

/* whether an access by `other` stamped (time, wgen) is ordered before
 * thread t now: its own, a __syncthreads since, a __syncwarp since (same
 * warp), or (Hopper sync in use) a release of other's warp that t's warp
 * has acquired */
static inline bool synced(const Thread *t, unsigned other, uint32_t time, uint32_t wgen) {
    if (other == t->tid) return true;
    const Block *b = t->blk;
    if (time <= b->bar_time) return true;
    const unsigned ow = other / RA_EMU_WARP;
    if (ow == t->warp && wgen != b->warps[t->warp].gen) return true;
    return b->hp_on && time <= b->hp->vc[t->warp][ow];
}

bool shadow_synced(const Thread *t, unsigned other, uint32_t time, uint32_t wgen) {
    return synced(t, other, time, wgen);
}

/* every warp that read the cell since its write (kMany) is ordered before
 * t: after reads by several warps the earliest read is what is checked */
static inline bool many_synced(const Thread *t, const Cell &c) {
    const Block *b = t->blk;
    if (c.rtime <= b->bar_time) return true;
    if (!b->hp_on) return false;
    const uint32_t *vc = b->hp->vc[t->warp];
    for (uint32_t m = c.rmask; m; m &= m - 1)
        if (vc[__builtin_ctz(m)] < c.rmin) return false;
    return true;
}

static const char *between(const Thread *t, unsigned other) {
    const bool warp = other / RA_EMU_WARP == t->warp;
    if (t->blk->hp_on)
        return warp ? "__syncwarp or barrier" : "barrier (__syncthreads, named barrier, mbarrier)";
    return warp ? "__syncwarp or __syncthreads" : "__syncthreads";
}

static void race(const Thread *t, size_t off, bool write, const char *what, unsigned other) {
    ra_emu_report(RA_EMU_RACE_SHARED,
                  "race on __shared__ byte %zu: thread %u %s it, thread %u %s it earlier, "
                  "with no %s between", off, t->tid, write ? "writes" : "reads", other, what,
                  between(t, other));
}

static void shared_bounds(const Thread *t, uintptr_t a, size_t n, bool write) {
    const Block *b = t->blk;
    const uintptr_t lo = (uintptr_t)b->smem;
    if (a < lo || a + n > lo + b->smem_size) {
        const long long off = (long long)(a - lo);
        ra_emu_report(RA_EMU_OOB_SHARED,
                      "__shared__ %s of %zu bytes at offset %lld: the block has %zu bytes of "
                      "dynamic shared memory", write ? "write" : "read", n, off, b->smem_size);
    }
}

static void tma_unseen(const Thread *t, size_t off, bool write, const Cell &c) {
    const Block *b = t->blk;
    const MBarrier &m = b->hp->mbar[c.wtid & 31];
    char where[96];
    shared_where(t, m.addr, where, sizeof where);
    ra_emu_report(RA_EMU_CP_ASYNC_PENDING,
                  "__shared__ %s at byte %zu, a bulk copy (cp.async.bulk) destination, before "
                  "thread %u has seen its mbarrier phase complete (mbarrier at %s, phase %u; "
                  "%s)", write ? "write" : "read", off, t->tid, where,
                  c.wtime - 1 - m.phase_base,
                  m.phase >= c.wtime ? "completed, but this warp did not wait for it"
                                     : "not completed yet");
}

static void pending_async_read(const Thread *t, size_t off, const Cell &c, const char *who) {
    const AsyncOp &op = t->blk->hp->ops[c.aop];
    char by[48];
    if (op.thread == kNone) snprintf(by, sizeof by, "warpgroup %u", op.first_warp / 4u);
    else snprintf(by, sizeof by, "thread %u", (unsigned)op.thread);
    ra_emu_report(RA_EMU_CP_ASYNC_PENDING,
                  "__shared__ %s at byte %zu, which a pending %s of %s reads: written before "
                  "the %s that retires it", who, off, op.what, by,
                  op.thread == kNone ? "wgmma.wait_group" : "cp.async.bulk.wait_group.read");
}

/* whether thread t still has async op `op` in flight (issued, not retired
 * by its own wgmma.wait_group / cp.async.bulk.wait_group.read) */
static bool op_in_flight(const Thread *t, uint32_t op) {
    const Sm90Thread *s = t->hp;
    if (s == nullptr) return false;
    for (unsigned i = 0; i < s->n_ops; i++)
        if (s->ops[i].op == op) return true;
    for (unsigned i = 0; i < s->n_bulk; i++)
        if (s->bulk_op[i] == op) return true;
    return false;
}

/* A write by t of bytes an async-proxy op (c.aop) reads: 0 when ordered
 * after the op: t took part in it and has retired it, or a warp of the op
 * retired it and t's warp acquired a later release of that warp (a lane of
 * the op's own warp, for a one-thread op, once any lane retired it);
 * 1 while t's own part or the whole op is still in flight; 2 otherwise. */
static int async_read_state(const Thread *t, const Cell &c) {
    const Block *b = t->blk;
    const AsyncOp &op = b->hp->ops[c.aop];
    const bool member = op.thread == kNone
                            ? t->warp >= op.first_warp && t->warp < op.first_warp + op.nwarps
                            : t->tid == op.thread;
    if (member) return op_in_flight(t, c.aop) ? 1 : 0;
    if (op.pending) return 1;
    for (unsigned i = 0; i < op.nwarps; i++) {
        const uint32_t r = op.ret[i];
        if (r == 0) continue;
        const unsigned w = op.first_warp + i;
        if (w == t->warp || r <= b->bar_time || r <= b->hp->vc[t->warp][w]) return 0;
    }
    return 2;
}

static void async_read_check(const Thread *t, size_t off, const Cell &c, const char *who) {
    const int st = async_read_state(t, c);
    if (st == 1) pending_async_read(t, off, c, who);
    if (st == 2) race(t, off, true, "read (asynchronously)", t->blk->hp->ops[c.aop].first_warp * 32);
}

/* the race / uninitialised / cp.async / bulk-copy checks of shared bytes
 * [a, a + n) whose shadow is cells[] from lo */
static void shadow_access(Thread *t, Cell *cells, uintptr_t lo, uintptr_t a, size_t n,
                          bool write) {
    Block *b = t->blk;
    const size_t first = (a - lo) / 2, last = (a + n - 1 - lo) / 2;
    const uint32_t now = b->now, wgen = b->warps[t->warp].gen, serial = b->serial;
    const uint32_t wbit = 1u << t->warp;
    const uint16_t tid = (uint16_t)t->tid;
    for (size_t u = first; u <= last; u++) {
        Cell &c = cells[u];
        if (c.serial != serial) {
            c.serial = serial;
            c.wtid = kNone;
            c.rtid = kNone;
            c.aop = 0;
        }
        if (!write) {
            /* the common case first: this thread (or this warp among many)
             * already read it at this time, and the last write is ordered
             * before */
            if (c.rtime == now &&
                (c.rtid == kMany ? (c.rmask & wbit) != 0 : c.rtid == tid && c.rwarp == wgen) &&
                !(c.wtid & (kPending | kTma)) &&
                (c.wtid == tid || synced(t, c.wtid, c.wtime, c.wwarp)))
                continue;
        }
        if (c.wtid != kNone && (c.wtid & kPending))
            ra_emu_report(RA_EMU_CP_ASYNC_PENDING,
                          "__shared__ %s at byte %zu, a cp.async destination of thread %u, "
                          "before the cp.async.wait_group that lands it",
                          write ? "write" : "read", u * 2, (unsigned)(c.wtid & ~kPending));
        const bool tma = c.wtid != kNone && (c.wtid & kTma);
        if (tma && b->hp->vc[t->warp][32 + (c.wtid & 31)] < c.wtime)
            tma_unseen(t, u * 2, write, c);
        if (write) {
            if (c.aop) async_read_check(t, u * 2, c, "write");
            if (c.wtid != kNone && !tma && !synced(t, c.wtid, c.wtime, c.wwarp))
                race(t, u * 2, true, "wrote", c.wtid);
            if (c.rtid == kMany ? !many_synced(t, c)
                                : c.rtid != kNone && !synced(t, c.rtid, c.rtime, c.rwarp))
                race(t, u * 2, true, "read", c.rtid == kMany ? t->tid ^ 1u : c.rtid);
            c.wtid = tid;
            c.wtime = now;
            c.wwarp = wgen;
            c.rtid = kNone;
            c.aop = 0;
        } else {
            if (c.wtid == kNone)
                ra_emu_report(RA_EMU_UNINIT_SHARED,
                              "__shared__ read of byte %zu, which no thread of the block has "
                              "written", u * 2);
            if (!tma && !synced(t, c.wtid, c.wtime, c.wwarp)) race(t, u * 2, false, "wrote", c.wtid);
            if (c.rtid == kNone || c.rtid == tid ||
                (c.rtid != kMany && synced(t, c.rtid, c.rtime, c.rwarp)) ||
                (c.rtid == kMany && many_synced(t, c))) {
                if (c.rtid != tid) {
                    c.rmin = now;
                    c.rmask = 0;
                }
                c.rtid = tid;
            } else {
                if (c.rtid != kMany) c.rmask = 1u << (c.rtid / RA_EMU_WARP);
                c.rtid = kMany;
            }
            c.rmask |= wbit;
            c.rtime = now;
            c.rwarp = wgen;
        }
    }
}

void check_shared(Thread *t, uintptr_t a, size_t n, bool write) {
    shared_bounds(t, a, n, write);
    if (g_check_on != 1) return;
    shadow_access(t, t->blk->w->cells, (uintptr_t)t->blk->smem, a, n, write);
}

void shadow_cp_pending(Thread *t, unsigned char *dst, size_t n) {
    check_shared(t, (uintptr_t)dst, n, true);   /* bounds always; a write */
    if (g_check_on != 1) return;
    Block *b = t->blk;
    const uintptr_t lo = (uintptr_t)b->smem;
    for (size_t u = ((uintptr_t)dst - lo) / 2; u <= ((uintptr_t)dst + n - 1 - lo) / 2; u++)
        b->w->cells[u].wtid = (uint16_t)(t->tid | kPending);
}

void shadow_cp_landed(Thread *t, unsigned char *dst, size_t n) {
    if (g_check_on != 1) return;
    Block *b = t->blk;
    const uintptr_t lo = (uintptr_t)b->smem;
    const uint32_t now = b->now, wgen = b->warps[t->warp].gen;
    for (size_t u = ((uintptr_t)dst - lo) / 2; u <= ((uintptr_t)dst + n - 1 - lo) / 2; u++) {
        Cell &c = b->w->cells[u];
        c.serial = b->serial;
        c.wtid = (uint16_t)t->tid;
        c.wtime = now;
        c.wwarp = wgen;
        c.rtid = kNone;
        c.aop = 0;
    }
}

static void check_global(Thread *t, uintptr_t a, size_t n, bool write) {
    const int dev = (int)((a - ra_emu_arena_lo) / ra_emu_arena_per_device);
    const int own = t->blk->g->device;
    if (dev != own)
        ra_emu_report(RA_EMU_PEER_GLOBAL,
                      "__global__ %s of %zu bytes at %p: memory of device %d, the kernel runs "
                      "on device %d (no peer access)", write ? "write" : "read", n, (void *)a,
                      dev, own);
    uintptr_t bad = 0;
    const int k = ra_emu_mem_check((const void *)a, n, write, !write, &bad);
    if (k != 0) {
        void *base = nullptr;
        size_t size = 0;
        char where[160] = "";
        if (ra_emu_mem_find((const void *)a, &base, &size) == 0)
            snprintf(where, sizeof where, " (offset %lld of a %zu-byte allocation at %p)",
                     (long long)(a - (uintptr_t)base), size, base);
        const char *what = k == RA_EMU_FREED_GLOBAL ? "freed memory"
                           : k == RA_EMU_UNINIT_GLOBAL ? "memory never written"
                                                       : "outside every allocation";
        ra_emu_report((ra_emu_report_kind)k, "__global__ %s of %zu bytes at %p%s: %s (first "
                      "bad byte %p)", write ? "write" : "read", n, (void *)a, where, what,
                      (void *)bad);
    }
    if (write) ra_emu_mem_mark_init((const void *)a, n);
}

/* ---- Hopper: shared memory seen by the async proxy ------------------------------ */

bool in_shared(const Thread *t, uintptr_t a, size_t n) {
    const Block *b = t->blk;
    const uintptr_t lo = (uintptr_t)b->smem;
    if (a >= lo && a + n <= lo + b->smem_size && a + n >= a) return true;
    const Worker *w = b->w;
    return w->tls_size && a >= w->tls_lo && a + n <= w->tls_lo + w->tls_size;
}

const char *shared_where(const Thread *t, const void *p, char *buf, size_t n) {
    const Block *b = t->blk;
    const uintptr_t a = (uintptr_t)p, lo = (uintptr_t)b->smem;
    if (a >= lo && a < lo + b->smem_size)
        snprintf(buf, n, "__shared__ byte %zu", (size_t)(a - lo));
    else if (b->w->tls_size && a >= b->w->tls_lo && a < b->w->tls_lo + b->w->tls_size)
        snprintf(buf, n, "static __shared__ byte %zu", (size_t)(a - b->w->tls_lo));
    else
        snprintf(buf, n, "%p (not shared memory)", p);
    return buf;
}

void shared_range(Thread *t, uintptr_t a, size_t n, const char *what) {
    const Block *b = t->blk;
    const uintptr_t lo = (uintptr_t)b->smem;
    if (a < lo || a + n > lo + b->smem_size || a + n < a)
        ra_emu_report(RA_EMU_OOB_SHARED,
                      "%s: shared bytes [%lld, %lld) lie outside the block's %zu bytes of "
                      "dynamic shared memory", what, (long long)(a - lo),
                      (long long)(a + n - lo), b->smem_size);
}

/* the shadow cells of dynamic shared bytes [a, a + n) (bounds checked by
 * the caller), refreshed for this block */
static Cell *cells_of(const Thread *t, uintptr_t a, size_t *first, size_t *last, size_t n) {
    const Block *b = t->blk;
    const uintptr_t lo = (uintptr_t)b->smem;
    *first = (a - lo) / 2;
    *last = (a + n - 1 - lo) / 2;
    Cell *cells = b->w->cells;
    for (size_t u = *first; u <= *last; u++) {
        Cell &c = cells[u];
        if (c.serial != b->serial) {
            c.serial = b->serial;
            c.wtid = kNone;
            c.rtid = kNone;
            c.aop = 0;
        }
    }
    return cells;
}

void shadow_async_write(Thread *t, uintptr_t a, size_t n, unsigned slot, uint32_t need) {
    if (g_check_on != 1 || n == 0) return;
    Block *b = t->blk;
    size_t first, last;
    Cell *cells = cells_of(t, a, &first, &last, n);
    for (size_t u = first; u <= last; u++) {
        Cell &c = cells[u];
        if (c.wtid != kNone && (c.wtid & kPending))
            ra_emu_report(RA_EMU_CP_ASYNC_PENDING,
                          "bulk copy into __shared__ byte %zu, a cp.async destination of "
                          "thread %u, before the cp.async.wait_group that lands it", u * 2,
                          (unsigned)(c.wtid & ~kPending));
        if (c.aop) async_read_check(t, u * 2, c, "bulk copy");
        if (c.wtid != kNone && (c.wtid & kTma)) {
            if (b->hp->vc[t->warp][32 + (c.wtid & 31)] < c.wtime) tma_unseen(t, u * 2, true, c);
        } else if (c.wtid != kNone && !synced(t, c.wtid, c.wtime, c.wwarp)) {
            race(t, u * 2, true, "wrote", c.wtid);
        }
        if (c.rtid == kMany ? !many_synced(t, c)
                            : c.rtid != kNone && !synced(t, c.rtid, c.rtime, c.rwarp))
            race(t, u * 2, true, "read", c.rtid == kMany ? t->tid ^ 1u : c.rtid);
        c.wtid = (uint16_t)(kTma | slot);
        c.wtime = need;
        c.rtid = kNone;
        c.aop = 0;
    }
}

void shadow_async_read(Thread *t, uintptr_t a, size_t n, uint32_t op_index) {
    if (g_check_on != 1 || n == 0) return;
    Block *b = t->blk;
    Sm90Block *h = b->hp;
    const AsyncOp &op = h->ops[op_index];
    size_t first, last;
    Cell *cells = cells_of(t, a, &first, &last, n);
    for (size_t u = first; u <= last; u++) {
        Cell &c = cells[u];
        if (c.wtid == kNone)
            ra_emu_report(RA_EMU_UNINIT_SHARED,
                          "%s reads __shared__ byte %zu, which no thread or copy of the block "
                          "has written", op.what, u * 2);
        if (c.wtid & kPending)
            ra_emu_report(RA_EMU_CP_ASYNC_PENDING,
                          "%s reads __shared__ byte %zu, a cp.async destination of thread %u, "
                          "before the cp.async.wait_group that lands it", op.what, u * 2,
                          (unsigned)(c.wtid & ~kPending));
        for (unsigned i = 0; i < op.nwarps; i++) {
            const unsigned w = op.first_warp + i;
            const Thread *lane0 = &b->threads[w * RA_EMU_WARP];
            if (c.wtid & kTma) {
                if (h->vc[w][32 + (c.wtid & 31)] < c.wtime) tma_unseen(lane0, u * 2, false, c);
            } else if (!synced(lane0, c.wtid, c.wtime, c.wwarp)) {
                ra_emu_report(RA_EMU_RACE_SHARED,
                              "race on __shared__ byte %zu: %s of warp %u reads it, thread %u "
                              "wrote it earlier, with no barrier between", u * 2, op.what, w,
                              (unsigned)c.wtid);
            }
        }
        if (!(c.wtid & kTma) && c.wtime > h->fence[c.wtid / RA_EMU_WARP])
            ra_emu_report(RA_EMU_RACE_SHARED,
                          "%s reads __shared__ byte %zu, which thread %u wrote with generic "
                          "stores and no fence.proxy.async after them (the async proxy may "
                          "not see the write)", op.what, u * 2, (unsigned)c.wtid);
        c.aop = op_index;
    }
}

void check_watched_registers(Thread *t, uintptr_t a, size_t n, bool write) {
    const Sm90Thread *s = t->hp;
    if (s == nullptr || a + n <= s->watch_lo || a >= s->watch_hi) return;
    for (unsigned i = 0; i < s->n_acc; i++) {
        const WgAcc &acc = s->acc[i];
        const uintptr_t lo = (uintptr_t)acc.d, hi = lo + acc.n * sizeof(float);
        if (a < hi && a + n > lo)
            ra_emu_report(RA_EMU_SYNC,
                          "%s of wgmma accumulator register %zu (of %u) before the "
                          "wgmma.wait_group that retires the wgmma.mma_async writing it",
                          write ? "write" : "read", (size_t)((a > lo ? a - lo : 0) / 4), acc.n);
    }
    if (!write) return;
    for (unsigned i = 0; i < s->n_ops; i++) {
        const uintptr_t lo = (uintptr_t)s->ops[i].a, hi = lo + 16;
        if (s->ops[i].a != nullptr && a < hi && a + n > lo)
            ra_emu_report(RA_EMU_SYNC,
                          "write of a wgmma A-fragment register before the wgmma.wait_group "
                          "that retires the wgmma.mma_async reading it");
    }
}

/* Classify an access by a kernel thread; `soff` is the thread's stack
 * pointer as an offset into the stacks' reservation. */
static inline void access(uintptr_t soff, uintptr_t a, size_t n, bool write) {
    const uintptr_t aoff = a - g_stacks_lo;
    if (aoff < g_stacks_span && (aoff >> kStackShift) == (soff >> kStackShift)) {
        /* the thread's own stack: locals, the kernel's arguments; the
         * registers a pending wgmma owns are checked */
        if (__builtin_expect(g_workers[soff >> kWorkerShift]->reg_watch != 0, 0))
            check_watched_registers(thread_at(soff), a, n, write);
        return;
    }
    Thread *t = thread_at(soff);
    if (a - g_windows_lo < g_windows_span) {
        check_shared(t, a, n, write);
        return;
    }
    const Worker *w = t->blk->w;
    if (a - w->tls_lo < w->tls_size) {   /* static __shared__ (device.h) */
        if (a + n - w->tls_lo > w->tls_size)
            ra_emu_report(RA_EMU_OOB_SHARED, "static __shared__ %s of %zu bytes past the "
                          "block's static shared memory", write ? "write" : "read", n);
        shadow_access(t, w->tls_cells, w->tls_lo, a, n, write);
        return;
    }
    if (a - ra_emu_arena_lo < ra_emu_arena_hi - ra_emu_arena_lo) {
        check_global(t, a, n, write);
        return;
    }
    if (!write && a - g_image_lo < g_image_hi - g_image_lo) return;
    ra_emu_report(RA_EMU_HOST_MEMORY,
                  "%s of %zu bytes at %p: host memory (a kernel can touch only device "
                  "memory, its block's shared memory and its own locals)",
                  write ? "write" : "read", n, (void *)a);
}

void check_access(Thread *t, uintptr_t a, size_t n, bool write) {
    access((uintptr_t)t->stack_lo - g_stacks_lo, a, n, write);
}

}  // namespace ra_emu

using namespace ra_emu;

/* ---- the instrumentation's hooks ------------------------------------------------------ */

#define RA_EMU_HOOK(name, n, write)                                                     \
    extern "C" __attribute__((visibility("hidden"))) void name(void *p) {               \
        if (g_check_on != 1) return;                                                    \
        const uintptr_t soff = (uintptr_t)__builtin_frame_address(0) - g_stacks_lo;     \
        if (soff < g_stacks_span) access(soff, (uintptr_t)p, n, write);                 \
    }
RA_EMU_HOOK(__tsan_read1, 1, false)
RA_EMU_HOOK(__tsan_read2, 2, false)
RA_EMU_HOOK(__tsan_read4, 4, false)
RA_EMU_HOOK(__tsan_read8, 8, false)
RA_EMU_HOOK(__tsan_read16, 16, false)
RA_EMU_HOOK(__tsan_write1, 1, true)
RA_EMU_HOOK(__tsan_write2, 2, true)
RA_EMU_HOOK(__tsan_write4, 4, true)
RA_EMU_HOOK(__tsan_write8, 8, true)
RA_EMU_HOOK(__tsan_write16, 16, true)
RA_EMU_HOOK(__tsan_unaligned_read2, 2, false)
RA_EMU_HOOK(__tsan_unaligned_read4, 4, false)
RA_EMU_HOOK(__tsan_unaligned_read8, 8, false)
RA_EMU_HOOK(__tsan_unaligned_read16, 16, false)
RA_EMU_HOOK(__tsan_unaligned_write2, 2, true)
RA_EMU_HOOK(__tsan_unaligned_write4, 4, true)
RA_EMU_HOOK(__tsan_unaligned_write8, 8, true)
RA_EMU_HOOK(__tsan_unaligned_write16, 16, true)
RA_EMU_HOOK(__tsan_volatile_read1, 1, false)
RA_EMU_HOOK(__tsan_volatile_read2, 2, false)
RA_EMU_HOOK(__tsan_volatile_read4, 4, false)
RA_EMU_HOOK(__tsan_volatile_read8, 8, false)
RA_EMU_HOOK(__tsan_volatile_read16, 16, false)
RA_EMU_HOOK(__tsan_volatile_write1, 1, true)
RA_EMU_HOOK(__tsan_volatile_write2, 2, true)
RA_EMU_HOOK(__tsan_volatile_write4, 4, true)
RA_EMU_HOOK(__tsan_volatile_write8, 8, true)
RA_EMU_HOOK(__tsan_volatile_write16, 16, true)
#undef RA_EMU_HOOK

extern "C" __attribute__((visibility("hidden"))) void __tsan_read_range(void *p, size_t n) {
    Thread *t = current_thread();
    if (t != nullptr && g_check_on == 1 && n) check_access(t, (uintptr_t)p, n, false);
}
extern "C" __attribute__((visibility("hidden"))) void __tsan_write_range(void *p, size_t n) {
    Thread *t = current_thread();
    if (t != nullptr && g_check_on == 1 && n) check_access(t, (uintptr_t)p, n, true);
}
extern "C" __attribute__((visibility("hidden"))) void __tsan_init(void) {}
extern "C" __attribute__((visibility("hidden"))) void __tsan_func_entry(void *) {}
extern "C" __attribute__((visibility("hidden"))) void __tsan_func_exit(void) {}
extern "C" __attribute__((visibility("hidden"))) void __tsan_vptr_update(void **, void *) {}
extern "C" __attribute__((visibility("hidden"))) void __tsan_vptr_read(void **) {}
