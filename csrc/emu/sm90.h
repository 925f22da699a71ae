/*
 * sm90.h -- the Hopper (sm_90) half of the emulated GPU's execution state,
 * shared by sync_sm90.cpp (the release clock, named barriers, warpgroup
 * collectives), mbarrier.cpp, ptx_wgmma.cpp (wgmma), ptx_tma.cpp (bulk copies
 * and tensor maps), check.cpp (the checker's view of them) and simt.cpp
 * (the scheduler's).  Internal; C++.
 *
 * Ordering model.  The checker orders two accesses of different warps by
 * happens-before at warp granularity.  Each release (a thread arriving at
 * a named barrier, arriving on an mbarrier, a __syncthreads) takes a time
 * from the block's clock (Block::now, which then advances); each warp w
 * keeps a vector vc[w]: vc[w][u] is the latest release time of warp u that
 * w has acquired, vc[w][32 + s] the number of completed phases of mbarrier
 * slot s it has observed.  An access stamped t by warp u is ordered before
 * warp w's accesses once vc[w][u] >= t.  Acquires: leaving a barrier (the
 * union of what its arrivals released), a successful mbarrier wait (the
 * union of what the arrivals of its completed phases released, and the
 * phase count itself).  Lanes of one warp share its vector; __syncwarp
 * orders them as before.
 *
 * Bulk copies (TMA) write shared memory from the async proxy: their bytes
 * are visible to a warp that observed the completion of the mbarrier phase
 * they complete on.  wgmma operands and bulk-store sources are read by the
 * async proxy: a generic write must be followed by a fence.proxy.async of
 * the writer before such a read, and the reading op stays in the block's op
 * table until a wgmma.wait_group (cp.async.bulk.wait_group.read) retires
 * it; a write before that is reported.
 */
#ifndef RA_EMU_SM90_H
#define RA_EMU_SM90_H

#include <stddef.h>
#include <stdint.h>

#include <vector>

#include "emu/simt.h"

namespace ra_emu {

enum : unsigned {
    kMaxMbar = 32,          /* distinct mbarriers per block */
    kVc = 64,               /* 32 warps, then 32 mbarrier slots */
    kMaxWarpgroups = RA_EMU_MAX_THREADS / 128,
    kNamedBars = 16,
    kMaxWgAcc = 8,          /* pending wgmma accumulators per thread */
    kMaxWgOps = 128,        /* wgmma operations in flight per thread */
    kMaxWgGroups = 16,
    kMaxBulkOps = 64,       /* bulk stores in flight per thread */
    kMaxBulkGroups = 16
};

/* A bulk copy into shared memory waiting for its mbarrier phase: the
 * bytes (already swizzled) land at dst when the phase completes. */
struct TmaStage {
    TmaStage *next;
    unsigned char *dst;
    size_t n;
    unsigned char data[1];   /* n bytes */
};

struct MBarrier {
    unsigned char *addr;     /* the 8-byte object; null: slot unused */
    bool live;               /* initialised and not invalidated */
    uint32_t expected;       /* arrivals per phase */
    int64_t pending;         /* arrivals missing in the current phase */
    int64_t tx;              /* expect_tx bytes not yet complete_tx'd */
    int64_t tx_expect, tx_done;  /* this phase's totals (for reports) */
    uint32_t phase;          /* completed phases, over every init of the slot */
    uint32_t phase_base;     /* `phase` at the last init */
    unsigned init_tid;
    uint32_t init_time, init_wwarp;
    uint32_t carry[kVc];     /* released by this phase's arrivals */
    uint32_t done[kVc];      /* released by the completed phases */
    TmaStage *staged;
};

struct NamedBar {
    unsigned count, arrived;
    uint32_t carry[kVc];
};

/* a warpgroup collective in progress (wgmma.mma_async, setmaxnreg) */
struct WgColl {
    unsigned arrived;
    uint8_t kind;
};
enum : uint8_t { WG_NONE = 0, WG_WGMMA, WG_SETMAXNREG };

/* An asynchronous-proxy read of shared memory (a wgmma, a bulk store):
 * pending until a thread of it retires it; ret[i] is the time a thread of
 * warp first_warp + i first retired it (0: not yet). */
struct AsyncOp {
    uint32_t issue;
    uint16_t thread;         /* a one-thread op's thread (bulk store), else kNone */
    uint8_t first_warp, nwarps;
    bool pending;
    uint32_t ret[4];
    const char *what;
};

struct Sm90Block {
    uint32_t vc[RA_EMU_MAX_THREADS / RA_EMU_WARP][kVc];
    uint32_t fence[RA_EMU_MAX_THREADS / RA_EMU_WARP];  /* last fence.proxy.async */
    MBarrier mbar[kMaxMbar];
    unsigned n_mbar;
    NamedBar named[kNamedBars];
    WgColl wg[kMaxWarpgroups];
    unsigned maxnreg[kMaxWarpgroups];
    std::vector<AsyncOp> ops;     /* index 0 unused */
    /* a wgmma's operands and product (ptx_wgmma.cpp) */
    float scratch_a[64 * 16], scratch_b[256 * 16];
    double scratch_ab[64][256];
};

/* a pending wgmma accumulator: the thread's registers at d (n floats)
 * read as poison until the wait that retires op `last_seq` lands val */
struct WgAcc {
    float *d;
    unsigned n;
    uint32_t last_seq;
    float val[128];
};

/* a register range the checker watches while a wgmma owns it */
struct WgOpRec {
    uint32_t seq, op;
    const uint32_t *a;       /* A fragment registers (4), or null */
};

struct Sm90Thread {
    WgAcc acc[kMaxWgAcc];
    unsigned n_acc;
    WgOpRec ops[kMaxWgOps];
    unsigned n_ops;
    uint32_t seq;                       /* wgmma operations issued */
    uint32_t group_end[kMaxWgGroups];   /* committed groups: seq ends */
    unsigned n_groups;
    uint32_t fences;                    /* wgmma.fence count */
    uintptr_t watch_lo, watch_hi;       /* bounds of the watched registers */
    /* bulk stores (cp.async.bulk ... bulk_group) */
    uint32_t bulk_op[kMaxBulkOps];
    unsigned n_bulk;
    unsigned bulk_group_end[kMaxBulkGroups];
    unsigned n_bulk_groups;
};

static inline uint32_t hp_max(uint32_t a, uint32_t b) { return a > b ? a : b; }

/* ---- sync_sm90.cpp ---------------------------------------------------------- */

/* the Hopper state of b, switched on at its first use in the block */
Sm90Block *hp_block(Block *b);
/* per block and per thread (re)initialisation by run_block */
void hp_block_start(Block *b);
void hp_thread_start(Thread *t);
/* the thread's wgmma / bulk state (allocated on first use) */
Sm90Thread *hp_thread(Thread *t);
/* clock: a release by warp w into carry (union), an acquire of carry */
uint32_t hp_release(Block *b, unsigned warp, uint32_t *carry);
void hp_acquire(Block *b, unsigned warp, const uint32_t *carry);
/* __syncthreads completed (simt.cpp): every warp acquires every release */
void hp_syncthreads(Block *b);
/* the scheduler: a description of what thread t waits for (T_NAMED,
 * T_MBAR, T_WGROUP), and checks when a thread returns or a block ends */
void hp_describe_wait(const Thread *t, char *buf, size_t n);
void hp_thread_exit(Thread *t);
void hp_block_end(Block *b);
/* a warpgroup collective: the calling thread waits until its 128 threads
 * have joined; the last one runs complete(b, warpgroup) */
void hp_wg_collective(Thread *t, uint8_t kind, void (*complete)(Block *, unsigned));

/* ---- mbarrier.cpp -------------------------------------------------------------- */

/* the mbarrier slot of a generic address (reported when none is live) */
int hp_mbar_slot(Thread *t, const void *bar, const char *what);
/* complete_tx of `bytes` on slot s, with `stage` (may be null) landing
 * at the completion of the current phase */
void hp_mbar_complete_tx(Block *b, int s, int64_t bytes, TmaStage *stage);
/* what a thread in T_MBAR waits for; the block-end check (bulk copies
 * still in flight) */
void mbar_describe_wait(const Thread *t, char *buf, size_t n);
void mbar_block_end(Block *b);

/* ---- ptx_wgmma.cpp ------------------------------------------------------------ */

/* retire what the thread's wgmma.wait_group / bulk wait retires */
void hp_retire_op(Thread *t, uint32_t op);

/* ---- check.cpp (the checker's side) ----------------------------------------- */

/* bounds of [a, a + n) in the block's dynamic shared memory (reported
 * with `what` when outside), the shadow of a bulk copy's destination
 * (written by the async proxy, visible after `need` completions of
 * mbarrier slot `slot`), and an async-proxy read of [a, a + n) by op `op`
 * whose warps are op's (each must see the bytes) */
void shared_range(Thread *t, uintptr_t a, size_t n, const char *what);
void shadow_async_write(Thread *t, uintptr_t a, size_t n, unsigned slot, uint32_t need);
void shadow_async_read(Thread *t, uintptr_t a, size_t n, uint32_t op);
/* the stack accesses of a thread whose registers a wgmma owns */
void check_watched_registers(Thread *t, uintptr_t a, size_t n, bool write);
/* whether an access by thread `other` stamped (time, warp-sync generation
 * wgen) is ordered before thread t's accesses now */
bool shadow_synced(const Thread *t, unsigned other, uint32_t time, uint32_t wgen);
/* whether [a, a + n) lies in the block's shared memory (dynamic, or the
 * static __shared__ variables), and a name for where p is, for reports */
bool in_shared(const Thread *t, uintptr_t a, size_t n);
const char *shared_where(const Thread *t, const void *p, char *buf, size_t n);

}  // namespace ra_emu

#endif /* RA_EMU_SM90_H */
