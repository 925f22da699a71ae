/*
 * ptx_tma.cpp -- bulk copies on the emulated GPU (the tensor memory
 * accelerator): cp.async.bulk.tensor loads (global -> shared, completing
 * on an mbarrier) and stores (shared -> global, bulk groups) of 1-5-D
 * boxes through a tensor map, and the plain cp.async.bulk load.
 *
 * A box (tensor map: tma.h, from cuTensorMapEncodeTiled) of boxDim[i]
 * elements per dimension, every elementStrides[i]-th element for i >= 1
 * (ceil(boxDim[i] / elementStrides[i]) of them), starting at the signed
 * coordinates given, lies in shared memory densely, dimension 0 fastest.
 * Elements outside the tensor (a coordinate < 0 or >= globalDim) read as 0
 * (NaN with CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA) and a store
 * leaves them out.  With a swizzle of 32, 64 or 128 bytes the 16-byte
 * chunk of each shared address is XORed with the address bits above the
 * swizzle row (bits [4, 4+b) ^= bits [7, 7+b), b = 1, 2, 3), the pattern
 * wgmma's descriptors read.  The transaction bytes are the whole box, out
 * of bounds included.
 *
 * A load's bytes count against the mbarrier's transaction count when it is
 * issued; the data lands when the mbarrier phase completes.  Until then the
 * destination reads as poison (0xff bytes), and the checker reports a read
 * by a warp that has not seen that phase complete.  A store reads its
 * shared source when issued (a generic write to it needs a
 * fence.proxy.async first) and writes global memory then; the source must
 * not be written before the cp.async.bulk.wait_group.read that retires it.
 * Not modelled: clusters and multicast (a shared::cluster address is the
 * block's own), im2col and interleaved maps, L2 cache hints, reductions.
 */
#include "emu/ptx_sm90.h"
#include "emu/sm90.h"
#include "emu/tma.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

namespace ra_emu {

static EmuTensorMap read_map(const void *p, int rank, const char *what) {
    EmuTensorMap m;
    if ((uintptr_t)p % 64)
        ra_emu_report(RA_EMU_MISALIGNED, "%s with a tensor map at %p: not 64-byte aligned",
                      what, p);
    memcpy(&m, p, sizeof m);
    if (m.magic != kTensorMapMagic)
        ra_emu_report(RA_EMU_TRAP, "%s with a tensor map at %p that cuTensorMapEncodeTiled did "
                      "not make", what, p);
    if ((int)m.rank != rank)
        ra_emu_report(RA_EMU_TRAP, "%s.%dd with a tensor map of rank %u", what, rank, m.rank);
    return m;
}

/* the box: elements per dimension (count), bytes of a dense row, total */
struct Box {
    unsigned count[5];
    size_t row, bytes, rows;
};

static Box box_of(const EmuTensorMap &m) {
    Box x;
    x.rows = 1;
    for (unsigned i = 0; i < 5; i++) {
        x.count[i] = i < m.rank ? (m.box[i] + m.estride[i] - 1) / m.estride[i] : 1;
        if (i > 0) x.rows *= x.count[i];
    }
    x.row = (size_t)x.count[0] * m.esize;
    x.bytes = x.row * x.rows;
    return x;
}

/* offset in the shared image of byte `o` of the dense box, for a box at
 * shared-window address `base` */
static size_t swizzled(const EmuTensorMap &m, uint32_t base, size_t o) {
    if (m.swizzle == 0) return o;
    const uint32_t a = base + (uint32_t)o;
    const uint32_t mask = (1u << m.swizzle) - 1;   /* 1, 3, 7 */
    return (size_t)((a ^ (((a >> 7) & mask) << 4)) - base);
}

/* for each row of the box: its global address (0 when an outer coordinate
 * is out of bounds) and the in-bounds range [lo, hi) of its elements */
template <typename F>
static void for_rows(const EmuTensorMap &m, const Box &x, const int32_t *c, F f) {
    unsigned j[5] = {0, 0, 0, 0, 0};
    int64_t x0 = c[0];
    const int64_t lo = x0 < 0 ? -x0 : 0;
    int64_t hi = (int64_t)m.dims[0] - x0;
    if (hi > (int64_t)x.count[0]) hi = x.count[0];
    for (size_t r = 0; r < x.rows; r++) {
        bool in = true;
        uint64_t addr = m.gaddr;
        for (unsigned i = 1; i < m.rank; i++) {
            const int64_t g = (int64_t)c[i] + (int64_t)j[i] * m.estride[i];
            if (g < 0 || g >= (int64_t)m.dims[i]) in = false;
            else addr += (uint64_t)g * m.strides[i - 1];
        }
        const bool any = in && lo < hi;
        f(r, any ? addr + (uint64_t)((x0 + lo) * m.esize) : 0, any ? (size_t)lo : 0,
          any ? (size_t)hi : 0);
        for (unsigned i = 1; i < 5; i++) {
            if (++j[i] < x.count[i]) break;
            j[i] = 0;
        }
    }
}

static void check_dst(Thread *t, const void *p, size_t bytes, unsigned align, const char *what) {
    if ((uintptr_t)p % align)
        ra_emu_report(RA_EMU_MISALIGNED, "%s: shared address %p is not %u-byte aligned", what,
                      p, align);
    shared_range(t, (uintptr_t)p, bytes, what);
}

/* stage `bytes` for dst, count them on the mbarrier and poison dst */
static void land_later(Thread *t, unsigned char *dst, TmaStage *st, int slot) {
    Block *b = t->blk;
    shadow_async_write(t, (uintptr_t)dst, st->n, (unsigned)slot, b->hp->mbar[slot].phase + 1);
    memset(dst, 0xff, st->n);
    hp_mbar_complete_tx(b, slot, (int64_t)st->n, st);
}

static TmaStage *new_stage(unsigned char *dst, size_t n) {
    TmaStage *st = (TmaStage *)malloc(sizeof(TmaStage) + n);
    if (st == nullptr) {
        fprintf(stderr, "ringattn emulated GPU: out of memory for a bulk copy\n");
        abort();
    }
    st->next = nullptr;
    st->dst = dst;
    st->n = n;
    return st;
}

static void fill_value(const EmuTensorMap &m, unsigned char *p) {
    if (!m.oob_nan) {
        memset(p, 0, m.esize);
        return;
    }
    memset(p, 0xff, m.esize);
    p[m.esize - 1] = 0x7f;   /* a quiet NaN of the element's width */
}

static void bulk_store_op(Thread *t, const void *src, size_t bytes);

}  // namespace ra_emu

using namespace ra_emu;

extern "C" void ra_emu_tma_load(void *dst, const void *tensor_map, const int32_t *coords,
                                int rank, void *bar) {
    Thread *t = kernel_thread("cp.async.bulk.tensor");
    const char *what = "cp.async.bulk.tensor (load)";
    Block *b = t->blk;
    hp_block(b);
    const EmuTensorMap m = read_map(tensor_map, rank, what);
    const Box x = box_of(m);
    check_dst(t, dst, x.bytes, 128, what);
    const int slot = hp_mbar_slot(t, bar, what);
    unsigned char *d = (unsigned char *)dst;
    const uint32_t base = (uint32_t)(d - b->smem);
    TmaStage *st = new_stage(d, x.bytes);
    unsigned char fill[8];
    fill_value(m, fill);
    for_rows(m, x, coords, [&](size_t r, uint64_t addr, size_t lo, size_t hi) {
        if (hi > lo) check_access(t, (uintptr_t)addr, (hi - lo) * m.esize, false);
        for (size_t e = 0; e < x.count[0]; e++) {
            const size_t o = r * x.row + e * m.esize;
            unsigned char *out = st->data + swizzled(m, base, o);
            if (e >= lo && e < hi) memcpy(out, (const void *)(uintptr_t)(addr + (e - lo) * m.esize),
                                          m.esize);
            else memcpy(out, fill, m.esize);
        }
    });
    land_later(t, d, st, slot);
}

extern "C" void ra_emu_bulk_load(void *dst, const void *src, unsigned bytes, void *bar) {
    Thread *t = kernel_thread("cp.async.bulk");
    const char *what = "cp.async.bulk (load)";
    hp_block(t->blk);
    if (bytes == 0 || bytes % 16 || (uintptr_t)src % 16)
        ra_emu_report(RA_EMU_MISALIGNED, "%s of %u bytes from %p: the size and the global "
                      "address must be multiples of 16", what, bytes, src);
    check_dst(t, dst, bytes, 16, what);
    const int slot = hp_mbar_slot(t, bar, what);
    check_access(t, (uintptr_t)src, bytes, false);
    TmaStage *st = new_stage((unsigned char *)dst, bytes);
    memcpy(st->data, src, bytes);
    land_later(t, (unsigned char *)dst, st, slot);
}

namespace ra_emu {
static void bulk_store_op(Thread *t, const void *src, size_t bytes) {
    Block *b = t->blk;
    Sm90Block *h = b->hp;
    Sm90Thread *s = hp_thread(t);
    h->ops.push_back(AsyncOp());
    const uint32_t op = (uint32_t)(h->ops.size() - 1);
    AsyncOp &rec = h->ops[op];
    rec.issue = b->now;
    rec.thread = (uint16_t)t->tid;
    rec.first_warp = (uint8_t)t->warp;
    rec.nwarps = 1;
    rec.pending = true;
    rec.what = "cp.async.bulk.tensor store";
    shadow_async_read(t, (uintptr_t)src, bytes, op);
    if (s->n_bulk == kMaxBulkOps)
        ra_emu_report(RA_EMU_TRAP, "more than %u bulk stores in flight in one thread",
                      (unsigned)kMaxBulkOps);
    s->bulk_op[s->n_bulk++] = op;
}
}  // namespace ra_emu

extern "C" void ra_emu_tma_store(const void *tensor_map, const int32_t *coords, int rank,
                                 const void *src) {
    Thread *t = kernel_thread("cp.async.bulk.tensor");
    const char *what = "cp.async.bulk.tensor (store)";
    Block *b = t->blk;
    hp_block(b);
    const EmuTensorMap m = read_map(tensor_map, rank, what);
    const Box x = box_of(m);
    check_dst(t, src, x.bytes, 128, what);
    const unsigned char *s = (const unsigned char *)src;
    const uint32_t base = (uint32_t)(s - b->smem);
    bulk_store_op(t, src, x.bytes);
    for_rows(m, x, coords, [&](size_t r, uint64_t addr, size_t lo, size_t hi) {
        if (hi <= lo) return;
        check_access(t, (uintptr_t)addr, (hi - lo) * m.esize, true);
        for (size_t e = lo; e < hi; e++) {
            const size_t o = r * x.row + e * m.esize;
            memcpy((void *)(uintptr_t)(addr + (e - lo) * m.esize), s + swizzled(m, base, o),
                   m.esize);
        }
    });
}

extern "C" void ra_emu_bulk_commit(void) {
    Thread *t = kernel_thread("cp.async.bulk.commit_group");
    Sm90Thread *s = hp_thread(t);
    if (s->n_bulk_groups == kMaxBulkGroups)
        ra_emu_report(RA_EMU_TRAP, "more than %u bulk groups pending in one thread",
                      (unsigned)kMaxBulkGroups);
    s->bulk_group_end[s->n_bulk_groups++] = s->n_bulk;
}

extern "C" void ra_emu_bulk_wait(int n, int read) {
    (void)read;   /* the global writes were done at issue */
    Thread *t = kernel_thread("cp.async.bulk.wait_group");
    Sm90Thread *s = hp_thread(t);
    if (n < 0 || n > 7) ra_emu_report(RA_EMU_TRAP, "cp.async.bulk.wait_group %d (0..7)", n);
    if (s->n_bulk_groups <= (unsigned)n) return;
    const unsigned end = s->bulk_group_end[s->n_bulk_groups - (unsigned)n - 1];
    for (unsigned i = 0; i < end; i++) hp_retire_op(t, s->bulk_op[i]);
    memmove(s->bulk_op, s->bulk_op + end, (s->n_bulk - end) * sizeof(uint32_t));
    s->n_bulk -= end;
    const unsigned keep = (unsigned)n;
    for (unsigned g = 0; g < keep; g++)
        s->bulk_group_end[g] = s->bulk_group_end[s->n_bulk_groups - keep + g] - end;
    s->n_bulk_groups = keep;
}
