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
#include "emu/simt.h"

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

static inline bool synced(const Thread *t, unsigned other, uint32_t bar, uint32_t wgen) {
    if (other == t->tid) return true;
    const Block *b = t->blk;
    if (bar != b->bar_gen) return true;
    return other / RA_EMU_WARP == t->warp && wgen != b->warps[t->warp].gen;
}

static void race(const Thread *t, size_t off, bool write, const char *what, unsigned other) {
    ra_emu_report(RA_EMU_RACE_SHARED,
                  "race on __shared__ byte %zu: thread %u %s it, thread %u %s it earlier, "
                  "with no %s between", off, t->tid, write ? "writes" : "reads", other, what,
                  other / RA_EMU_WARP == t->warp ? "__syncwarp or __syncthreads"
                                                  : "__syncthreads");
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

/* the race / uninitialised / cp.async checks of shared bytes [a, a + n)
 * whose shadow is cells[] from lo */
static void shadow_access(Thread *t, Cell *cells, uintptr_t lo, uintptr_t a, size_t n,
                          bool write) {
    Block *b = t->blk;
    const size_t first = (a - lo) / 2, last = (a + n - 1 - lo) / 2;
    const uint32_t bar = b->bar_gen, wgen = b->warps[t->warp].gen, serial = b->serial;
    const uint16_t tid = (uint16_t)t->tid;
    for (size_t u = first; u <= last; u++) {
        Cell &c = cells[u];
        if (c.serial != serial) {
            c.serial = serial;
            c.wtid = kNone;
            c.rtid = kNone;
        }
        if (!write) {
            /* the common case first: this thread (or many) already read it
             * in this interval, and the last write is ordered before */
            if (c.rbar == bar && (c.rtid == kMany || (c.rtid == tid && c.rwarp == wgen)) &&
                !(c.wtid & kPending) && (c.wtid == tid || synced(t, c.wtid, c.wbar, c.wwarp)))
                continue;
        }
        if (c.wtid != kNone && (c.wtid & kPending))
            ra_emu_report(RA_EMU_CP_ASYNC_PENDING,
                          "__shared__ %s at byte %zu, a cp.async destination of thread %u, "
                          "before the cp.async.wait_group that lands it",
                          write ? "write" : "read", u * 2, (unsigned)(c.wtid & ~kPending));
        if (write) {
            if (c.wtid != kNone && !synced(t, c.wtid, c.wbar, c.wwarp))
                race(t, u * 2, true, "wrote", c.wtid);
            if (c.rtid == kMany ? c.rbar == bar
                                : c.rtid != kNone && !synced(t, c.rtid, c.rbar, c.rwarp))
                race(t, u * 2, true, "read", c.rtid == kMany ? t->tid ^ 1u : c.rtid);
            c.wtid = tid;
            c.wbar = bar;
            c.wwarp = wgen;
            c.rtid = kNone;
        } else {
            if (c.wtid == kNone)
                ra_emu_report(RA_EMU_UNINIT_SHARED,
                              "__shared__ read of byte %zu, which no thread of the block has "
                              "written", u * 2);
            if (!synced(t, c.wtid, c.wbar, c.wwarp)) race(t, u * 2, false, "wrote", c.wtid);
            if (c.rtid == kNone || c.rtid == tid ||
                (c.rtid != kMany && synced(t, c.rtid, c.rbar, c.rwarp)) ||
                (c.rtid == kMany && c.rbar != bar)) {
                c.rtid = tid;
            } else {
                c.rtid = kMany;
            }
            c.rbar = bar;
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
    const uint32_t bar = b->bar_gen, wgen = b->warps[t->warp].gen;
    for (size_t u = ((uintptr_t)dst - lo) / 2; u <= ((uintptr_t)dst + n - 1 - lo) / 2; u++) {
        Cell &c = b->w->cells[u];
        c.serial = b->serial;
        c.wtid = (uint16_t)t->tid;
        c.wbar = bar;
        c.wwarp = wgen;
        c.rtid = kNone;
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

/* Classify an access by a kernel thread; `soff` is the thread's stack
 * pointer as an offset into the stacks' reservation. */
static inline void access(uintptr_t soff, uintptr_t a, size_t n, bool write) {
    const uintptr_t aoff = a - g_stacks_lo;
    if (aoff < g_stacks_span && (aoff >> kStackShift) == (soff >> kStackShift))
        return;  /* the thread's own stack: locals, the kernel's arguments */
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
