/*
 * simt.h -- the emulated GPU's execution state, shared by simt.cpp (fibers,
 * blocks, barriers, warp collectives), ptx.cpp (cp.async, ldmatrix, mma),
 * check.cpp (the memory checker) and the Hopper parts (sm90.h: mbarriers,
 * named barriers, wgmma, TMA).  Internal; C++.
 *
 * A grid's blocks run on a pool of worker threads.  A worker runs one block
 * at a time: blockDim fibers (Thread), each with its own stack, switched
 * cooperatively at sync points.  The worker owns the block's shared memory
 * window and its shadow (one Cell per 2 bytes), which is never cleared: a
 * Cell belongs to the current block only when its serial is the block's.
 */
#ifndef RA_EMU_SIMT_H
#define RA_EMU_SIMT_H

#include <stddef.h>
#include <stdint.h>

#include "emu/emu.h"

namespace ra_emu {

struct Block;
struct Job;
struct Worker;

enum ThreadState : uint8_t {
    T_READY = 0,   /* runnable */
    T_BARRIER,     /* waiting at __syncthreads */
    T_WARP,        /* waiting in a warp collective */
    T_NAMED,       /* waiting at a named barrier (bar.sync id, count) */
    T_MBAR,        /* waiting on an mbarrier phase (try_wait / test_wait) */
    T_WGROUP,      /* waiting in a warpgroup collective (wgmma, setmaxnreg) */
    T_DONE         /* returned, or stopped after a report */
};

enum CollKind : uint8_t {
    C_NONE = 0,
    C_SYNCWARP,
    C_SHFL,
    C_VOTE,
    C_LDMATRIX,
    C_MMA,
    C_STMATRIX,
    C_ELECT
};

/* One asynchronous copy into shared memory (cp.async), pending until the
 * wait of its group. */
struct CpAsync {
    unsigned char *dst;
    const unsigned char *src;
    uint8_t cp_size, src_size;
};

enum { kMaxCpAsync = 256, kMaxCpGroups = 16 };

struct Thread {
    void *sp;                 /* saved stack pointer while switched out */
    unsigned char *stack_lo;  /* the fiber's stack [stack_lo, stack_lo + stack_size) */
    size_t stack_size;
    Block *blk;
    unsigned tid, lane, warp; /* linear index in the block, lane, warp */
    unsigned ix, iy, iz;      /* threadIdx */
    ThreadState state;

    /* the warp collective this lane waits in: kind, mode, mask, arguments,
     * payload in[] and, once complete, the result out[] */
    CollKind coll;
    uint8_t coll_mode;
    unsigned coll_mask;
    int coll_arg, coll_width;
    uint64_t in[12];
    uint64_t out[4];

    /* cp.async: copies in issue order (cp points into the worker's
     * cp_pool, kMaxCpAsync per thread, kept out of the hot fields); group g
     * ends at cp index group_end[g] (committed groups, oldest first);
     * copies past the last group end are not committed yet */
    CpAsync *cp;
    int n_cp;
    int group_end[kMaxCpGroups];
    int n_groups;

    /* Hopper: what the thread waits for in T_NAMED / T_MBAR / T_WGROUP
     * (a named barrier id, an mbarrier slot and parity, a warpgroup
     * collective's kind), and its wgmma / bulk-copy state (sm90.h,
     * allocated on first use) */
    uint32_t wait_arg, wait_arg2;
    uint32_t poll_slot, poll_phase;   /* the last mbarrier phase test_wait polled */
    struct Sm90Thread *hp;

    void *asan_fake_stack;    /* AddressSanitizer's fiber bookkeeping */
};

/* Shared memory shadow: one per 2 bytes of the shared window.  wtid: the
 * thread that last wrote (kNone: never; kPending bit: a cp.async of that
 * thread is pending; kTma bit: written by a bulk copy (TMA) completing on
 * mbarrier slot wtid & 31, visible to a warp that observed `wtime`
 * completions of it); rtid: the thread that last read (kNone, kMany).
 * Times are the block's release clock (Block::now) at the access, with
 * the warp's __syncwarp generation; kMany: rmask has the warps that read
 * since the write, rmin the earliest read's time.  aop: the latest
 * asynchronous-proxy read (a wgmma operand, a bulk store's source), an
 * index of the block's Sm90 op table (0: none). */
struct Cell {
    uint32_t serial;
    uint16_t wtid, rtid;
    uint32_t wtime, wwarp, rtime, rwarp;
    uint32_t rmin, rmask;
    uint32_t aop;
};
enum : uint16_t { kNone = 0xffff, kMany = 0xfffe, kPending = 0x8000, kTma = 0x4000 };

struct Warp {
    uint32_t gen;             /* __syncwarp generation (memory sync of the warp) */
    unsigned waiting;         /* lanes waiting in a collective */
    unsigned done;            /* lanes that have returned */
};

struct Block {
    Job *job;
    const ra_emu_grid *g;
    Worker *w;
    unsigned bx, by, bz;
    unsigned nthreads, nwarps;
    Thread *threads;
    unsigned char *smem;      /* the dynamic shared memory of this block */
    size_t smem_size;
    uint32_t serial;
    uint32_t bar_gen;         /* __syncthreads generation */
    /* the release clock: advanced by every release (a barrier, an
     * mbarrier arrive, a fence.proxy.async); an access is stamped with it.
     * bar_time: the clock at the last __syncthreads (an access stamped at
     * or before it is ordered before everything after it) */
    uint32_t now, bar_time;
    struct Sm90Block *hp;     /* Hopper state (sm90.h); hp_on once used */
    bool hp_on;
    unsigned bar_arrived, live;
    int bar_count, bar_result;
    Warp warps[RA_EMU_MAX_THREADS / RA_EMU_WARP];
    bool stop;                /* a report stopped this block */
};

/* The worker a block runs on: its scheduler context, fibers, the block's
 * shared memory at smem_base (in the worker's window, see kWindowStride)
 * and its shadow. */
struct Worker {
    Thread *report_thread;    /* the thread a scheduler-side report is about */
    unsigned order[RA_EMU_MAX_THREADS];  /* the schedule of the current pass */
    void *sched_sp;
    void *sched_fake_stack;
    const void *sched_stack_bottom;
    size_t sched_stack_size;
    Thread *threads;
    CpAsync *cp_pool;         /* kMaxCpAsync per thread */
    unsigned char *smem_base;
    Cell *cells;              /* RA_EMU_SMEM_OPTIN / 2 of them, for smem_base.. */
    /* static __shared__ variables are thread_local (device.h): this
     * worker's TLS block of the library is the block's static shared
     * memory, with its own shadow */
    uintptr_t tls_lo;
    size_t tls_size;
    Cell *tls_cells;
    uint32_t serial;
    /* threads of the current block whose registers a pending wgmma owns
     * (the checker then looks at their stack accesses, sm90.h) */
    unsigned reg_watch;
    Block block;
};

/* Every worker's fiber stacks lie in one reserved range: worker w's in
 * [g_stacks_lo + w * kWorkerSpan, ...), its thread i's at i * kStackStride
 * in it (the lowest page a guard).  So the fiber that runs kernel code is
 * found from the stack pointer alone, with no thread-local storage (which
 * a library opened by dlopen cannot use cheaply). */
enum : uintptr_t {
    kStackShift = 17,
    kStackStride = (uintptr_t)1 << kStackShift,          /* 128 KiB */
    kWorkerShift = kStackShift + 10,
    kWorkerSpan = (uintptr_t)1 << kWorkerShift,          /* 1024 stacks */
    kWindowStride = (uintptr_t)256 << 10                 /* shared window per worker */
};
static_assert(kWorkerSpan == kStackStride * RA_EMU_MAX_THREADS, "stack layout");
extern uintptr_t g_stacks_lo, g_stacks_span;
/* every worker's shared memory window in one reservation too: worker w's
 * at g_windows_lo + w * kWindowStride */
extern uintptr_t g_windows_lo, g_windows_span;
extern Worker *g_workers[256];

/* The thread running kernel code on this OS thread (NULL off a kernel). */
static inline Thread *current_thread(void);
/* the thread running kernel code, for an entry point named `what`; a call
 * outside a kernel aborts the process (ptx.cpp) */
Thread *kernel_thread(const char *what);
/* Switch from a fiber back to its worker's scheduler (simt.cpp); returns
 * when the scheduler runs it again. */
void fiber_yield(Thread *t);

/* Wait in a warp collective (the payload is in the calling thread's in[],
 * the result lands in its out[]); returns when every lane of `mask` has joined and the
 * collective is computed.  A lane outside `mask`, an exited lane, lanes in
 * different collectives: reported. */
void collective(CollKind kind, uint8_t mode, unsigned mask, int arg, int width);

/* The checker (check.cpp): an access of n bytes at a by thread t; returns
 * only if it is allowed (a report stops the thread). */
void check_access(Thread *t, uintptr_t a, size_t n, bool write);
void check_shared(Thread *t, uintptr_t a, size_t n, bool write);
/* the worker's static shared memory: the library's TLS block of this OS
 * thread (check.cpp) */
void check_find_tls(Worker *w);
/* cp.async bookkeeping of the shared shadow: a destination becomes
 * pending (checked as a write first, its bounds even with the checker off)
 * and lands at its wait */
void shadow_cp_pending(Thread *t, unsigned char *dst, size_t n);
void shadow_cp_landed(Thread *t, unsigned char *dst, size_t n);
/* the address range of the library's own image (read-only data) */
void check_init_image(void);

/* the thread whose stack holds offset `off` of the stacks' reservation */
static inline Thread *thread_at(uintptr_t off) {
    Worker *w = g_workers[off >> kWorkerShift];
    return &w->threads[(off & (kWorkerSpan - 1)) >> kStackShift];
}

static inline Thread *current_thread(void) {
    const uintptr_t off = (uintptr_t)__builtin_frame_address(0) - g_stacks_lo;
    if (off >= g_stacks_span) return nullptr;
    return thread_at(off);
}

}  // namespace ra_emu

#endif
