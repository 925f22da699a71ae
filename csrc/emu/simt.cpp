/*
 * simt.cpp -- kernels on the emulated GPU: grids on a pool of worker
 * threads, each block's threads as fibers that really interleave, block
 * barriers and warp collectives, launch-configuration checks of an sm_90
 * device, and the kernel language's entry points (device.h).
 *
 * Fibers.  A worker runs one block at a time as blockDim fibers with their
 * own stacks (guard page below each).  A fiber runs until a sync point
 * (__syncthreads, a warp collective) and switches back to the worker's
 * scheduler, which runs the next ready fiber in schedule order (forward,
 * reverse or random, RINGATTN_EMU_SCHEDULE).  A pass over the block runs
 * every ready fiber once; a pass in which none could run while some have
 * not returned is a deadlock (reported with what each one waits for).
 *
 * Barriers.  __syncthreads completes when every thread that has not
 * returned has arrived (returned threads count as arrived, as on the
 * device).  Warp collectives (shuffles, votes, __syncwarp, ldmatrix, mma)
 * complete when every lane of their mask has joined the same collective
 * with the same mask; the lane that completes it computes every lane's
 * result.  A mask without the calling lane, a lane that returned while
 * others wait for it, lanes of one mask in different collectives, a
 * shuffle reading a lane outside the mask: reported.
 *
 * Reports (ra_emu_report) in kernel code stop the thread that made them:
 * the block stops at once, blocks not started are skipped, and the grid
 * fails (the runtime turns that into the device's sticky error).
 */
#include "emu/sm90.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <condition_variable>
#include <unordered_map>

#include <cuda_runtime.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define RA_EMU_ASAN 1
#endif

/* ---- context switch ------------------------------------------------------- */

extern "C" void ra_emu_ctx_switch(void **save_sp, void *load_sp);
extern "C" void ra_emu_fiber_start(void);

#if defined(__x86_64__)
/* Save the callee-saved registers, MXCSR and the x87 control word on the
 * current stack, store the stack pointer in *save_sp, load load_sp and
 * restore the same from there.  A new fiber's stack is laid out as if it had
 * switched away just before ra_emu_fiber_start, with the Thread in r12 and
 * the function to call in r13. */
__asm__(
    ".text\n"
    ".globl ra_emu_ctx_switch\n"
    ".hidden ra_emu_ctx_switch\n"
    ".type ra_emu_ctx_switch,@function\n"
    "ra_emu_ctx_switch:\n"
    "    pushq %rbp\n"
    "    pushq %rbx\n"
    "    pushq %r12\n"
    "    pushq %r13\n"
    "    pushq %r14\n"
    "    pushq %r15\n"
    "    subq $8, %rsp\n"
    "    stmxcsr (%rsp)\n"
    "    fnstcw 4(%rsp)\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    ldmxcsr (%rsp)\n"
    "    fldcw 4(%rsp)\n"
    "    addq $8, %rsp\n"
    "    popq %r15\n"
    "    popq %r14\n"
    "    popq %r13\n"
    "    popq %r12\n"
    "    popq %rbx\n"
    "    popq %rbp\n"
    "    ret\n"
    ".size ra_emu_ctx_switch,.-ra_emu_ctx_switch\n"
    ".globl ra_emu_fiber_start\n"
    ".hidden ra_emu_fiber_start\n"
    ".type ra_emu_fiber_start,@function\n"
    "ra_emu_fiber_start:\n"
    "    movq %r12, %rdi\n"
    "    callq *%r13\n"
    "    ud2\n"
    ".size ra_emu_fiber_start,.-ra_emu_fiber_start\n");
#elif defined(__aarch64__)
__asm__(
    ".text\n"
    ".globl ra_emu_ctx_switch\n"
    ".hidden ra_emu_ctx_switch\n"
    ".type ra_emu_ctx_switch,%function\n"
    "ra_emu_ctx_switch:\n"
    "    sub sp, sp, #176\n"
    "    stp x19, x20, [sp, #0]\n"
    "    stp x21, x22, [sp, #16]\n"
    "    stp x23, x24, [sp, #32]\n"
    "    stp x25, x26, [sp, #48]\n"
    "    stp x27, x28, [sp, #64]\n"
    "    stp x29, x30, [sp, #80]\n"
    "    stp d8, d9, [sp, #96]\n"
    "    stp d10, d11, [sp, #112]\n"
    "    stp d12, d13, [sp, #128]\n"
    "    stp d14, d15, [sp, #144]\n"
    "    mrs x9, fpcr\n"
    "    str x9, [sp, #160]\n"
    "    mov x9, sp\n"
    "    str x9, [x0]\n"
    "    mov sp, x1\n"
    "    ldp x19, x20, [sp, #0]\n"
    "    ldp x21, x22, [sp, #16]\n"
    "    ldp x23, x24, [sp, #32]\n"
    "    ldp x25, x26, [sp, #48]\n"
    "    ldp x27, x28, [sp, #64]\n"
    "    ldp x29, x30, [sp, #80]\n"
    "    ldp d8, d9, [sp, #96]\n"
    "    ldp d10, d11, [sp, #112]\n"
    "    ldp d12, d13, [sp, #128]\n"
    "    ldp d14, d15, [sp, #144]\n"
    "    ldr x9, [sp, #160]\n"
    "    msr fpcr, x9\n"
    "    add sp, sp, #176\n"
    "    ret\n"
    ".size ra_emu_ctx_switch,.-ra_emu_ctx_switch\n"
    ".globl ra_emu_fiber_start\n"
    ".hidden ra_emu_fiber_start\n"
    ".type ra_emu_fiber_start,%function\n"
    "ra_emu_fiber_start:\n"
    "    mov x0, x19\n"
    "    blr x20\n"
    "    brk #0\n"
    ".size ra_emu_fiber_start,.-ra_emu_fiber_start\n");
#else
#error "ringattn's emulated GPU has fibers for x86-64 and aarch64 only"
#endif

namespace ra_emu {

uintptr_t g_stacks_lo, g_stacks_span;
uintptr_t g_windows_lo, g_windows_span;
Worker *g_workers[256];
/* the worker of this OS thread, and the thread a scheduler-side report
 * (a deadlock) is about */
static thread_local Worker *g_worker;

static const size_t kRedzone = 4096;       /* around the shared memory window */

static void fiber_main(Thread *t);

/* Lay out a fresh fiber's stack so that switching to it starts fiber_main(t). */
static void fiber_prepare(Thread *t) {
    uintptr_t top = ((uintptr_t)t->stack_lo + t->stack_size) & ~(uintptr_t)15;
#if defined(__x86_64__)
    uint64_t *sp = (uint64_t *)(top - 128);           /* 16-aligned */
    sp[0] = 0x1f80 | ((uint64_t)0x037f << 32);        /* MXCSR, x87 control word */
    sp[1] = 0;                                        /* r15 */
    sp[2] = 0;                                        /* r14 */
    sp[3] = (uint64_t)(uintptr_t)&fiber_main;         /* r13 */
    sp[4] = (uint64_t)(uintptr_t)t;                   /* r12 */
    sp[5] = 0;                                        /* rbx */
    sp[6] = 0;                                        /* rbp */
    sp[7] = (uint64_t)(uintptr_t)&ra_emu_fiber_start; /* return address */
    t->sp = sp;
#else
    uint64_t *sp = (uint64_t *)(top - 256);
    memset(sp, 0, 176);
    sp[0] = (uint64_t)(uintptr_t)t;                   /* x19 */
    sp[1] = (uint64_t)(uintptr_t)&fiber_main;         /* x20 */
    sp[11] = (uint64_t)(uintptr_t)&ra_emu_fiber_start; /* x30 */
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    sp[20] = fpcr;
    t->sp = sp;
#endif
}

/* scheduler -> fiber */
static void resume(Worker *w, Thread *t) {
#ifdef RA_EMU_ASAN
    __sanitizer_start_switch_fiber(&w->sched_fake_stack, t->stack_lo, t->stack_size);
#endif
    ra_emu_ctx_switch(&w->sched_sp, t->sp);
#ifdef RA_EMU_ASAN
    __sanitizer_finish_switch_fiber(w->sched_fake_stack, nullptr, nullptr);
#endif
}

/* fiber -> scheduler; returns when the scheduler resumes this fiber.  A
 * fiber that is done never comes back. */
static void yield_to_scheduler(Thread *t) {
    Worker *w = t->blk->w;
#ifdef RA_EMU_ASAN
    __sanitizer_start_switch_fiber(t->state == T_DONE ? nullptr : &t->asan_fake_stack,
                                   w->sched_stack_bottom, w->sched_stack_size);
#endif
    ra_emu_ctx_switch(&t->sp, w->sched_sp);
#ifdef RA_EMU_ASAN
    __sanitizer_finish_switch_fiber(t->asan_fake_stack, nullptr, nullptr);
#endif
}

void fiber_yield(Thread *t) { yield_to_scheduler(t); }

/* ---- blocks -------------------------------------------------------------------- */

static void release_barrier(Block *b) {
    b->bar_gen++;
    b->bar_time = b->now++;
    hp_syncthreads(b);
    b->bar_arrived = 0;
    b->bar_result = b->bar_count;
    b->bar_count = 0;
    for (unsigned i = 0; i < b->nthreads; i++)
        if (b->threads[i].state == T_BARRIER) b->threads[i].state = T_READY;
}

static const char *coll_name(CollKind k) {
    switch (k) {
    case C_SYNCWARP: return "__syncwarp";
    case C_SHFL: return "a warp shuffle";
    case C_VOTE: return "a warp vote";
    case C_LDMATRIX: return "ldmatrix";
    case C_MMA: return "mma.sync";
    case C_STMATRIX: return "stmatrix";
    case C_ELECT: return "elect.sync";
    default: return "nothing";
    }
}

static void thread_exit(Thread *t) {
    Block *b = t->blk;
    hp_thread_exit(t);
    t->state = T_DONE;
    b->live--;
    Warp &wp = b->warps[t->warp];
    wp.done |= 1u << t->lane;
    for (unsigned l = 0; l < RA_EMU_WARP; l++) {
        if (!(wp.waiting & (1u << l))) continue;
        Thread *o = &b->threads[t->warp * RA_EMU_WARP + l];
        if (o->coll_mask & (1u << t->lane)) {
            ra_emu_report(RA_EMU_SYNC,
                          "lane %u of warp %u returned while lane %u waits for it in %s "
                          "(mask 0x%08x)", t->lane, t->warp, l, coll_name(o->coll),
                          o->coll_mask);
        }
    }
    if (b->live > 0 && b->bar_arrived == b->live) release_barrier(b);
}

static void fiber_main(Thread *t) {
#ifdef RA_EMU_ASAN
    Worker *w = t->blk->w;
    const void *bottom = nullptr;
    size_t size = 0;
    __sanitizer_finish_switch_fiber(nullptr, &bottom, &size);
    if (w->sched_stack_bottom == nullptr) {
        w->sched_stack_bottom = bottom;
        w->sched_stack_size = size;
    }
#endif
    t->blk->g->thunk(t->blk->g->args);
    thread_exit(t);
    yield_to_scheduler(t);
    abort();  /* a finished fiber is never resumed */
}

static void describe_waits(Block *b, char *buf, size_t n) {
    size_t used = 0;
    unsigned shown = 0;
    for (unsigned i = 0; i < b->nthreads && shown < 6; i++) {
        Thread *t = &b->threads[i];
        if (t->state == T_DONE || t->state == T_READY) continue;
        /* one line per run of threads waiting alike */
        unsigned j = i;
        while (j + 1 < b->nthreads && b->threads[j + 1].state == t->state &&
               b->threads[j + 1].coll == t->coll && b->threads[j + 1].wait_arg == t->wait_arg)
            j++;
        const bool hopper = t->state == T_NAMED || t->state == T_MBAR || t->state == T_WGROUP;
        int k = snprintf(buf + used, n - used, "%sthreads %u-%u wait %s", shown ? "; " : "",
                         i, j, t->state == T_BARRIER ? "at __syncthreads" : hopper ? "" : "in ");
        if (k < 0 || (size_t)k >= n - used) return;
        used += (size_t)k;
        if (hopper) {
            hp_describe_wait(t, buf + used, n - used);
            used += strlen(buf + used);
        } else if (t->state == T_WARP) {
            k = snprintf(buf + used, n - used, "%s (mask 0x%08x)", coll_name(t->coll),
                         t->coll_mask);
            if (k < 0 || (size_t)k >= n - used) return;
            used += (size_t)k;
        }
        shown++;
        i = j;
    }
}

static uint64_t xorshift(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

struct Job {
    const ra_emu_grid *g;
    uint64_t nblocks, next, finished;
    unsigned running;
    int failed;               /* first report kind, 0 if none */
    Job *next_job;
    std::condition_variable done_cv;
};

/* Run one block on worker w. */
static void run_block(Worker *w, Job *job, uint64_t index) {
    const ra_emu_grid *g = job->g;
    Block *b = &w->block;
    b->job = job;
    b->g = g;
    b->w = w;
    b->bx = (unsigned)(index % g->grid.x);
    b->by = (unsigned)((index / g->grid.x) % g->grid.y);
    b->bz = (unsigned)(index / ((uint64_t)g->grid.x * g->grid.y));
    b->nthreads = g->block.x * g->block.y * g->block.z;
    b->nwarps = (b->nthreads + RA_EMU_WARP - 1) / RA_EMU_WARP;
    b->threads = w->threads;
    b->smem = w->smem_base;
    b->smem_size = g->smem;
    b->serial = ++w->serial;
    if (b->serial == 0) {  /* wrapped: every cell must look stale again */
        memset(w->cells, 0, sizeof(Cell) * (RA_EMU_SMEM_OPTIN / 2));
        b->serial = ++w->serial;
    }
    b->bar_gen = 1;
    b->bar_arrived = 0;
    b->bar_count = b->bar_result = 0;
    b->live = b->nthreads;
    b->stop = false;
    hp_block_start(b);
    for (unsigned i = 0; i < b->nwarps; i++) b->warps[i].gen = 1, b->warps[i].waiting = 0, b->warps[i].done = 0;
    w->report_thread = nullptr;
    /* shared memory starts as garbage: poison, so that a read of bytes never
     * written shows (and the checker reports it) */
    if (g->smem) memset(b->smem, 0xff, g->smem);
    for (unsigned i = 0; i < b->nthreads; i++) {
        Thread *t = &w->threads[i];
        t->blk = b;
        t->tid = i;
        t->lane = i % RA_EMU_WARP;
        t->warp = i / RA_EMU_WARP;
        t->ix = i % g->block.x;
        t->iy = (i / g->block.x) % g->block.y;
        t->iz = i / (g->block.x * g->block.y);
        t->state = T_READY;
        t->coll = C_NONE;
        t->coll_mask = 0;
        t->n_cp = 0;
        t->n_groups = 0;
        t->wait_arg = t->wait_arg2 = 0;
        t->poll_slot = t->poll_phase = 0;
        hp_thread_start(t);
        t->asan_fake_stack = nullptr;
        fiber_prepare(t);
    }
    const ra_emu_settings *cfg = ra_emu_config();
    unsigned *order = w->order;
    uint64_t rng = cfg->seed * 0x9e3779b97f4a7c15ull + index + 1;
    const unsigned n = b->nthreads;
    for (unsigned i = 0; i < n; i++) order[i] = cfg->schedule == 1 ? n - 1 - i : i;
    for (;;) {
        if (cfg->schedule == 2) {
            for (unsigned i = n - 1; i > 0; i--) {
                unsigned j = (unsigned)(xorshift(&rng) % (i + 1));
                unsigned tmp = order[i];
                order[i] = order[j];
                order[j] = tmp;
            }
        }
        bool ran = false;
        for (unsigned i = 0; i < n; i++) {
            Thread *t = &w->threads[order[i]];
            if (t->state == T_READY) {
                resume(w, t);
                ran = true;
                if (b->stop) return;
            }
        }
        if (b->live == 0) {
            if (b->hp_on) {
                w->report_thread = &w->threads[0];   /* the report's context */
                hp_block_end(b);
                w->report_thread = nullptr;
            }
            return;
        }
        if (!ran) {
            char why[1200] = "";
            describe_waits(b, why, sizeof why);
            /* attributed to the block, not to one thread */
            Thread *first = nullptr;
            for (unsigned i = 0; i < n && first == nullptr; i++)
                if (w->threads[i].state != T_DONE) first = &w->threads[i];
            w->report_thread = first;  /* the report's context */
            b->stop = true;
            ra_emu_report(RA_EMU_SYNC, "deadlock: %s", why);
            w->report_thread = nullptr;
            return;
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&job->failed, __ATOMIC_RELAXED)) return;
    }
}

/* ---- the worker pool ------------------------------------------------------------- */

static std::mutex *g_pool_mu;
static std::condition_variable *g_pool_cv;
static Job *g_jobs;            /* grids with blocks left to start */
static pthread_once_t g_pool_once = PTHREAD_ONCE_INIT;
static std::unordered_map<const void *, int> *g_func_smem;

static void *map_or_die(size_t bytes) {
    void *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        fprintf(stderr, "ringattn emulated GPU: cannot map %zu bytes for a worker: %s\n",
                bytes, strerror(errno));
        abort();
    }
    return p;
}

static Worker *worker_new(unsigned index) {
    Worker *w = new Worker();
    memset((void *)w, 0, sizeof *w);
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    w->threads = (Thread *)map_or_die(sizeof(Thread) * RA_EMU_MAX_THREADS);
    w->cp_pool = (CpAsync *)map_or_die(sizeof(CpAsync) * kMaxCpAsync * RA_EMU_MAX_THREADS);
    unsigned char *stacks = (unsigned char *)(g_stacks_lo + index * kWorkerSpan);
    for (unsigned i = 0; i < RA_EMU_MAX_THREADS; i++) {
        unsigned char *guard = stacks + i * kStackStride;
        /* the lowest page stays inaccessible: an overflow faults */
        if (mprotect(guard + page, kStackStride - page, PROT_READ | PROT_WRITE) != 0) {
            fprintf(stderr, "ringattn emulated GPU: cannot map fiber stacks: %s\n",
                    strerror(errno));
            abort();
        }
        w->threads[i].stack_lo = guard + page;
        w->threads[i].stack_size = kStackStride - page;
        w->threads[i].cp = w->cp_pool + (size_t)i * kMaxCpAsync;
    }
    w->smem_base = (unsigned char *)(g_windows_lo + index * kWindowStride) + kRedzone;
    w->cells = (Cell *)map_or_die(sizeof(Cell) * (RA_EMU_SMEM_OPTIN / 2));
    return w;
}

static void *worker_main(void *arg) {
    Worker *w = (Worker *)arg;
    g_worker = w;      /* also makes this thread's TLS block of the library */
    check_find_tls(w);
    std::unique_lock<std::mutex> lk(*g_pool_mu);
    for (;;) {
        Job *job = g_jobs;
        while (job != nullptr && job->next >= job->nblocks) job = job->next_job;
        if (job == nullptr) {
            g_pool_cv->wait(lk);
            continue;
        }
        const uint64_t index = job->next++;
        job->running++;
        lk.unlock();
        run_block(w, job, index);
        lk.lock();
        job->running--;
        job->finished++;
        if (__atomic_load_n(&job->failed, __ATOMIC_RELAXED)) job->next = job->nblocks;
        if (job->next >= job->nblocks && job->running == 0) job->done_cv.notify_all();
    }
    return nullptr;
}

static void pool_start(void) {
    g_pool_mu = new std::mutex();
    g_pool_cv = new std::condition_variable();
    g_func_smem = new std::unordered_map<const void *, int>();
    check_init_image();
    const int n = ra_emu_config()->workers;
    /* every worker's fiber stacks in one reservation (simt.h) */
    g_stacks_span = (uintptr_t)n * kWorkerSpan;
    void *stacks = mmap(nullptr, g_stacks_span, PROT_NONE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (stacks == MAP_FAILED) {
        fprintf(stderr, "ringattn emulated GPU: cannot reserve fiber stacks: %s\n",
                strerror(errno));
        abort();
    }
    g_stacks_lo = (uintptr_t)stacks;
    g_windows_span = (uintptr_t)n * kWindowStride;
    static_assert(kRedzone + RA_EMU_SMEM_OPTIN + kRedzone <= kWindowStride, "window");
    g_windows_lo = (uintptr_t)map_or_die(g_windows_span);
    for (int i = 0; i < n; i++) g_workers[i] = worker_new((unsigned)i);
    for (int i = 0; i < n; i++) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 1 << 20);
        pthread_t th;
        if (pthread_create(&th, &attr, worker_main, g_workers[i]) != 0) {
            fprintf(stderr, "ringattn emulated GPU: cannot start block worker %d\n", i);
            abort();
        }
        pthread_attr_destroy(&attr);
    }
}

/* ---- collectives ------------------------------------------------------------------ */

/* ptx.cpp computes ldmatrix, mma and stmatrix */
void complete_ldmatrix(Block *b, unsigned warp, unsigned mask);
void complete_mma(Block *b, unsigned warp, unsigned mask);
void complete_stmatrix(Block *b, unsigned warp, unsigned mask);

static int shfl_source(unsigned lane, int mode, int arg, int width) {
    const int seg = (int)lane & ~(width - 1);
    switch (mode) {
    case 0: return seg + (arg & (width - 1));
    case 1: {
        const int s = (int)lane ^ arg;
        return s >= seg + width ? (int)lane : s;
    }
    case 2: {
        const int s = (int)lane - arg;
        return s < seg ? (int)lane : s;
    }
    default: {
        const int s = (int)lane + arg;
        return s >= seg + width ? (int)lane : s;
    }
    }
}

void collective(CollKind kind, uint8_t mode, unsigned mask, int arg, int width) {
    Thread *t = current_thread();
    Block *b = t->blk;
    const unsigned bit = 1u << t->lane;
    const unsigned lanes_in_warp =
        t->warp == b->nwarps - 1 && b->nthreads % RA_EMU_WARP
            ? (1u << (b->nthreads % RA_EMU_WARP)) - 1u : 0xffffffffu;
    if (!(mask & bit))
        ra_emu_report(RA_EMU_SYNC, "%s with mask 0x%08x, which leaves out the calling lane %u",
                      coll_name(kind), mask, t->lane);
    if (mask & ~lanes_in_warp)
        ra_emu_report(RA_EMU_SYNC, "%s with mask 0x%08x names lanes the warp does not have",
                      coll_name(kind), mask);
    t->coll = kind;
    t->coll_mode = mode;
    t->coll_mask = mask;
    t->coll_arg = arg;
    t->coll_width = width;
    t->state = T_WARP;
    Warp &wp = b->warps[t->warp];
    wp.waiting |= bit;
    const unsigned base = t->warp * RA_EMU_WARP;
    /* a lane of the mask that has returned can never join */
    if (mask & wp.done)
        ra_emu_report(RA_EMU_SYNC, "%s (mask 0x%08x) waits for lane %d, which has returned",
                      coll_name(kind), mask, __builtin_ctz(mask & wp.done));
    if ((wp.waiting & mask) == mask) {
        for (unsigned m = mask; m; m &= m - 1) {
            const unsigned l = (unsigned)__builtin_ctz(m);
            Thread *o = &b->threads[base + l];
            if (o->coll != kind || o->coll_mask != mask) {
                ra_emu_report(RA_EMU_SYNC, "lanes of one warp in different collectives: "
                              "lane %u in %s (mask 0x%08x), lane %u in %s (mask 0x%08x)",
                              t->lane, coll_name(kind), mask, l, coll_name(o->coll),
                              o->coll_mask);
            }
        }
        switch (kind) {
        case C_SYNCWARP:
            wp.gen++;
            break;
        case C_SHFL:
            for (unsigned m = mask; m; m &= m - 1) {
                const unsigned l = (unsigned)__builtin_ctz(m);
                Thread *o = &b->threads[base + l];
                const int w = o->coll_width;
                if (w < 1 || w > 32 || (w & (w - 1))) {
                    ra_emu_report(RA_EMU_SYNC, "shuffle width %d is not a power of 2 in 1..32",
                                  w);
                }
                const int src = shfl_source(l, o->coll_mode, o->coll_arg, w);
                if (!((mask >> src) & 1u)) {
                    ra_emu_report(RA_EMU_SYNC, "lane %u shuffles from lane %d, which is not in "
                                  "the mask 0x%08x", l, src, mask);
                }
                o->out[0] = b->threads[base + src].in[0];
            }
            break;
        case C_VOTE: {
            unsigned ballot = 0;
            for (unsigned l = 0; l < RA_EMU_WARP; l++)
                if ((mask >> l) & 1u && b->threads[base + l].in[0]) ballot |= 1u << l;
            for (unsigned l = 0; l < RA_EMU_WARP; l++) {
                if (!((mask >> l) & 1u)) continue;
                Thread *o = &b->threads[base + l];
                o->out[0] = mode == 0 ? ballot != 0 : mode == 1 ? ballot == mask : ballot;
            }
            break;
        }
        case C_LDMATRIX:
            complete_ldmatrix(b, t->warp, mask);
            break;
        case C_MMA:
            complete_mma(b, t->warp, mask);
            break;
        case C_STMATRIX:
            complete_stmatrix(b, t->warp, mask);
            break;
        case C_ELECT: {
            /* the lowest lane of the mask leads */
            const unsigned leader = (unsigned)__builtin_ctz(mask);
            for (unsigned m = mask; m; m &= m - 1)
                b->threads[base + __builtin_ctz(m)].out[0] = leader;
            break;
        }
        default:
            break;
        }
        wp.waiting &= ~mask;
        for (unsigned m = mask; m; m &= m - 1)
            b->threads[base + __builtin_ctz(m)].state = T_READY;
    }
    yield_to_scheduler(t);
    t->coll = C_NONE;
}

}  // namespace ra_emu

using namespace ra_emu;

/* ---- reports ---------------------------------------------------------------------- */

/* the thread a report is about: the running fiber, or the one the
 * scheduler names for a deadlock */
static Thread *report_thread(void) {
    Thread *t = current_thread();
    if (t == nullptr && g_worker != nullptr) t = g_worker->report_thread;
    return t;
}

extern "C" int ra_emu_report_context(char *buf, size_t n) {
    Thread *t = report_thread();
    if (t == nullptr) return 0;
    const Block *b = t->blk;
    return snprintf(buf, n, "[kernel %s launched at %s, block (%u,%u,%u), thread (%u,%u,%u)]",
                    b->g->name, b->g->site, b->bx, b->by, b->bz, t->ix, t->iy, t->iz);
}

extern "C" void ra_emu_report_fail_current(ra_emu_report_kind kind, const char *text) {
    (void)text;
    Thread *t = report_thread();
    if (t == nullptr) return;
    Block *b = t->blk;
    int zero = 0;
    __atomic_compare_exchange_n(&b->job->failed, &zero, (int)kind, false, __ATOMIC_RELEASE,
                                __ATOMIC_RELAXED);
    b->stop = true;
    /* on the fiber's own stack: stop this thread (back to the scheduler,
     * never to return); off it (a deadlock found by the scheduler) return */
    if (current_thread() != t) return;
    t->state = T_DONE;
    yield_to_scheduler(t);
    abort();
}

/* ---- launches ----------------------------------------------------------------------- */

extern "C" int ra_emu_grid_validate(const ra_emu_grid *g, size_t smem_limit,
                                    const char **why) {
    const uint64_t threads = (uint64_t)g->block.x * g->block.y * g->block.z;
    if (g->grid.x == 0 || g->grid.y == 0 || g->grid.z == 0 || g->block.x == 0 ||
        g->block.y == 0 || g->block.z == 0) {
        *why = "a grid or block dimension is 0";
        return cudaErrorInvalidConfiguration;
    }
    if (g->grid.x > 0x7fffffffu || g->grid.y > 65535 || g->grid.z > 65535) {
        *why = "grid dimensions past (2^31 - 1, 65535, 65535)";
        return cudaErrorInvalidConfiguration;
    }
    if (g->block.x > 1024 || g->block.y > 1024 || g->block.z > 64 ||
        threads > RA_EMU_MAX_THREADS) {
        *why = "more than 1024 threads per block, or block dimensions past (1024, 1024, 64)";
        return cudaErrorInvalidConfiguration;
    }
    if (g->smem > smem_limit) {
        *why = g->smem > RA_EMU_SMEM_OPTIN
                   ? "more dynamic shared memory than the device has per block (227 KiB)"
                   : "more than 48 KiB of dynamic shared memory without "
                     "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)";
        return cudaErrorInvalidValue;
    }
    *why = nullptr;
    return 0;
}

extern "C" int ra_emu_grid_run(const ra_emu_grid *g) {
    pthread_once(&g_pool_once, pool_start);
    Job job;
    job.g = g;
    job.nblocks = (uint64_t)g->grid.x * g->grid.y * g->grid.z;
    job.next = 0;
    job.finished = 0;
    job.running = 0;
    job.failed = 0;
    std::unique_lock<std::mutex> lk(*g_pool_mu);
    job.next_job = g_jobs;
    g_jobs = &job;
    g_pool_cv->notify_all();
    while (!(job.next >= job.nblocks && job.running == 0)) job.done_cv.wait(lk);
    for (Job **p = &g_jobs; *p != nullptr; p = &(*p)->next_job) {
        if (*p == &job) {
            *p = job.next_job;
            break;
        }
    }
    return job.failed;
}

extern "C" int ra_emu_func_set_smem(const void *func, int bytes) {
    pthread_once(&g_pool_once, pool_start);
    if (bytes < 0 || bytes > RA_EMU_SMEM_OPTIN) return cudaErrorInvalidValue;
    std::lock_guard<std::mutex> lk(*g_pool_mu);
    (*g_func_smem)[func] = bytes;
    return 0;
}

extern "C" size_t ra_emu_func_smem_limit(const void *func) {
    pthread_once(&g_pool_once, pool_start);
    std::lock_guard<std::mutex> lk(*g_pool_mu);
    auto it = g_func_smem->find(func);
    const int set = it == g_func_smem->end() ? 0 : it->second;
    return set > RA_EMU_SMEM_DEFAULT ? (size_t)set : (size_t)RA_EMU_SMEM_DEFAULT;
}

/* ---- barriers (device.h) ---------------------------------------------------------------- */

extern "C" int ra_emu_syncthreads_count(int pred) {
    Thread *t = current_thread();
    Block *b = t->blk;
    b->bar_count += pred != 0;
    t->state = T_BARRIER;
    b->bar_arrived++;
    if (b->bar_arrived == b->live) release_barrier(b);
    yield_to_scheduler(t);
    return b->bar_result;
}
extern "C" void ra_emu_syncthreads(void) { (void)ra_emu_syncthreads_count(0); }

extern "C" void ra_emu_syncwarp(unsigned mask) { collective(C_SYNCWARP, 0, mask, 0, 32); }
