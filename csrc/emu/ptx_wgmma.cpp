/*
 * ptx_wgmma.cpp -- wgmma.mma_async on the emulated GPU: the warpgroup
 * matrix multiply of the PTX ISA ("Asynchronous Warpgroup Level Matrix
 * Multiply-Accumulate"), m64nNk16 with f16/bf16 inputs and f32
 * accumulators, N a multiple of 8 up to 256.
 *
 * Registers (warp w of the warpgroup, lane l, g = l/4, q = l%4):
 *   A (from registers): the mma.m16n8k16 A fragment of rows 16w..16w+15:
 *     a0 (16w+g, 2q..2q+1), a1 (16w+g+8, 2q..), a2 (16w+g, 2q+8..),
 *     a3 (16w+g+8, 2q+8..), low half the lower column
 *   D: N/2 floats; register i = 4j + h holds row 16w + g + 8(h>>1),
 *     column 8j + 2q + (h&1)
 *
 * Shared-memory matrix descriptor (64 bits): start address >> 4 in bits
 * 0-13, leading-dimension byte offset (LBO) >> 4 in 16-29, stride-dimension
 * byte offset (SBO) >> 4 in 32-45, base offset in 49-51, swizzle in 62-63
 * (0 none, 1 128B, 2 64B, 3 32B).  In 16-byte chunks, with W = 1, 2, 4, 8
 * chunks per swizzle row (none, 32B, 64B, 128B) and T = 8 elements per
 * chunk, element (r, k) of an operand (r = m for A, n for B) lies at
 *   K-major (imm-trans 0), c = k / 8:
 *     none   16 (r%8) + SBO (r/8) + LBO c
 *     swz    16 ((r%8) W + c) + SBO (r/8)
 *   MN-major (imm-trans 1), j = r / 8:
 *     none   SBO j + 16 (k%8) + LBO (k/8)
 *     swz    16 (j%W + (k%8) W) + LBO (j/W) + SBO (k/8)
 * plus 2 (k%8) (K-major) or 2 (r%8) (MN-major) bytes within the chunk;
 * the swizzle then XORs address bits [4, 4 + log2 W) with bits [7, ...)
 * of the shared-window address (CUTLASS's Swizzle<B,4,3>, the pattern a
 * bulk tensor copy writes).  A base offset other than 0 is not modelled
 * (reported).
 *
 * Asynchrony.  The product is computed when the 128 threads have issued
 * it, from the shared memory and registers of that moment; each thread's
 * accumulator registers then read as poison (NaN bytes) and the checker
 * reports any access to them, or any write of its A-fragment registers,
 * until the wgmma.wait_group that retires its group lands the result.
 * wgmmas on the same accumulator chain in issue order without a wait.  The
 * shared operands are an async-proxy read until then: a write to them
 * before the wait that retires it is reported (check.cpp).
 */
#include "emu/ptx_sm90.h"
#include "emu/sm90.h"

#include <cuda_bf16.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

namespace ra_emu {

/* the payload of one thread's wgmma.mma_async (Thread::in) */
enum : uint64_t {
    F_BF16 = 1u << 16, F_SCALE_D = 1u << 17, F_NEG_A = 1u << 18, F_NEG_B = 1u << 19,
    F_TRANS_A = 1u << 20, F_TRANS_B = 1u << 21, F_RS = 1u << 22
};

struct Desc {
    uint32_t start, lbo, sbo, base, mode, w;
};

static Desc decode(uint64_t d) {
    Desc r;
    r.start = (uint32_t)(d & 0x3fff) << 4;
    r.lbo = (uint32_t)((d >> 16) & 0x3fff) << 4;
    r.sbo = (uint32_t)((d >> 32) & 0x3fff) << 4;
    r.base = (uint32_t)((d >> 49) & 7);
    r.mode = (uint32_t)(d >> 62);
    r.w = r.mode == 1 ? 8 : r.mode == 2 ? 4 : r.mode == 3 ? 2 : 1;
    return r;
}

/* shared-window byte address of element (r, k) of a 16-bit operand */
static uint32_t elem_addr(const Desc &d, bool mn_major, unsigned r, unsigned k) {
    uint32_t off;
    if (!mn_major) {
        const unsigned c = k / 8;
        off = d.mode == 0 ? 16 * (r % 8) + d.sbo * (r / 8) + d.lbo * c
                          : 16 * ((r % 8) * d.w + c) + d.sbo * (r / 8);
        off += 2 * (k % 8);
    } else {
        const unsigned j = r / 8;
        off = d.mode == 0 ? d.sbo * j + 16 * (k % 8) + d.lbo * (k / 8)
                          : 16 * (j % d.w + (k % 8) * d.w) + d.lbo * (j / d.w) + d.sbo * (k / 8);
        off += 2 * (r % 8);
    }
    uint32_t a = d.start + off;
    if (d.mode != 0) a ^= ((a >> 7) & (d.w - 1)) << 4;
    return a;
}

static const char *mode_name(uint32_t mode) {
    return mode == 1 ? "128B" : mode == 2 ? "64B" : mode == 3 ? "32B" : "none";
}

/* rows x 16 elements of an operand from shared memory (checked against
 * the block's dynamic shared memory, as an async-proxy read of op) */
static void load_operand(Block *b, Thread *t, uint64_t desc, bool mn_major, unsigned rows,
                         bool bf16, float *out /* [rows][16] */, const char *which,
                         uint32_t op) {
    const Desc d = decode(desc);
    if (d.base != 0)
        ra_emu_report(RA_EMU_TRAP, "wgmma.mma_async %s descriptor with matrix base offset %u: "
                      "the emulated GPU models base offset 0 only (tiles on the swizzle "
                      "pattern's boundary)", which, d.base);
    uint32_t lo = UINT32_MAX, hi = 0;
    for (unsigned r = 0; r < rows; r++) {
        for (unsigned k = 0; k < 16; k++) {
            const uint32_t a = elem_addr(d, mn_major, r, k);
            lo = a < lo ? a : lo;
            hi = a + 2 > hi ? a + 2 : hi;
        }
    }
    if (hi > b->smem_size)
        ra_emu_report(RA_EMU_OOB_SHARED, "wgmma.mma_async %s descriptor (start byte %u, LBO %u, "
                      "SBO %u, swizzle %s, %s-major) addresses __shared__ bytes [%u, %u), "
                      "outside the block's %zu bytes of dynamic shared memory", which, d.start,
                      d.lbo, d.sbo, mode_name(d.mode), mn_major ? "MN" : "K", lo, hi,
                      b->smem_size);
    for (unsigned r = 0; r < rows; r++) {
        for (unsigned k = 0; k < 16; k++) {
            const uint32_t a = elem_addr(d, mn_major, r, k);
            uint16_t v;
            memcpy(&v, b->smem + a, 2);
            out[r * 16 + k] = bf16 ? ra_emu_bf16_bits_to_f32(v) : ra_emu_f16_bits_to_f32(v);
            shadow_async_read(t, (uintptr_t)b->smem + a, 2, op);
        }
    }
}

static void set_watch(Block *b, Sm90Thread *s) {
    const bool was = s->watch_hi != 0;
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (unsigned i = 0; i < s->n_acc; i++) {
        const uintptr_t a = (uintptr_t)s->acc[i].d, e = a + s->acc[i].n * sizeof(float);
        lo = a < lo ? a : lo;
        hi = e > hi ? e : hi;
    }
    for (unsigned i = 0; i < s->n_ops; i++) {
        if (s->ops[i].a == nullptr) continue;
        const uintptr_t a = (uintptr_t)s->ops[i].a, e = a + 16;
        lo = a < lo ? a : lo;
        hi = e > hi ? e : hi;
    }
    if (hi == 0) lo = 0;
    s->watch_lo = lo;
    s->watch_hi = hi;
    if (!was && hi != 0) b->w->reg_watch++;
    if (was && hi == 0) b->w->reg_watch--;
}

static void complete_wgmma(Block *b, unsigned wg) {
    Sm90Block *h = b->hp;
    Thread *th = &b->threads[wg * 128];
    const uint64_t flags = th[0].in[1];
    const bool rs = flags & F_RS, bf16 = flags & F_BF16;
    const unsigned n = (unsigned)(flags & 0xffff);
    for (unsigned i = 1; i < 128; i++) {
        const Thread *o = &th[i];
        if (o->in[1] != flags || o->in[3] != th[0].in[3] || (!rs && o->in[2] != th[0].in[2]))
            ra_emu_report(RA_EMU_SYNC, "wgmma.mma_async of warpgroup %u: thread %u and thread "
                          "%u give different shapes, types, flags or descriptors", wg,
                          th[0].tid, o->tid);
    }
    h->ops.push_back(AsyncOp());
    const uint32_t op = (uint32_t)(h->ops.size() - 1);
    AsyncOp &rec = h->ops[op];
    rec.issue = b->now;
    rec.thread = kNone;
    rec.first_warp = (uint8_t)(wg * 4);
    rec.nwarps = 4;
    rec.pending = true;
    rec.what = "wgmma.mma_async";

    float *A = h->scratch_a, *B = h->scratch_b;
    double (*AB)[256] = h->scratch_ab;
    Thread *t = current_thread();
    load_operand(b, t, th[0].in[3], flags & F_TRANS_B, n, bf16, B, "B", op);
    if (rs) {
        for (unsigned i = 0; i < 128; i++) {
            const Thread *o = &th[i];
            const unsigned w = i / 32, l = i % 32, g = l / 4, q = l % 4;
            for (unsigned r = 0; r < 4; r++) {
                const uint32_t v = (uint32_t)o->in[5 + r];
                const unsigned row = 16 * w + g + 8 * (r & 1), col = 2 * q + 8 * (r >> 1);
                for (unsigned hh = 0; hh < 2; hh++) {
                    const uint16_t bits = (uint16_t)(v >> (16 * hh));
                    A[row * 16 + col + hh] =
                        bf16 ? ra_emu_bf16_bits_to_f32(bits) : ra_emu_f16_bits_to_f32(bits);
                }
            }
        }
    } else {
        load_operand(b, t, th[0].in[2], flags & F_TRANS_A, 64, bf16, A, "A", op);
    }
    const double sa = flags & F_NEG_A ? -1.0 : 1.0, sb = flags & F_NEG_B ? -1.0 : 1.0;
    for (unsigned m = 0; m < 64; m++) {
        for (unsigned c = 0; c < n; c++) {
            /* products of 16-bit inputs are exact in double, as is their sum */
            double s = 0;
            for (unsigned k = 0; k < 16; k++) s += (double)A[m * 16 + k] * (double)B[c * 16 + k];
            AB[m][c] = sa * sb * s;
        }
    }
    for (unsigned i = 0; i < 128; i++) {
        Thread *o = &th[i];
        Sm90Thread *s = hp_thread(o);
        if (s->fences == 0)
            ra_emu_report(RA_EMU_SYNC, "wgmma.mma_async by thread %u with no wgmma.fence "
                          "before it (one must precede the first wgmma and follow any write "
                          "of the registers it uses)", o->tid);
        float *d = (float *)(uintptr_t)o->in[0];
        const unsigned nr = n / 2;
        WgAcc *acc = nullptr;
        for (unsigned k = 0; k < s->n_acc; k++) {
            WgAcc &x = s->acc[k];
            if (x.d == d && x.n == nr) {
                acc = &x;
            } else if ((uintptr_t)x.d < (uintptr_t)(d + nr) && (uintptr_t)d < (uintptr_t)(x.d + x.n)) {
                ra_emu_report(RA_EMU_SYNC, "wgmma.mma_async of thread %u uses accumulator "
                              "registers that overlap those of a pending wgmma of another shape",
                              o->tid);
            }
        }
        float c[128];
        if (acc != nullptr) {
            memcpy(c, acc->val, nr * sizeof(float));
        } else {
            if (s->n_acc == kMaxWgAcc)
                ra_emu_report(RA_EMU_TRAP, "more than %u wgmma accumulators pending in one "
                              "thread", (unsigned)kMaxWgAcc);
            memcpy(c, d, nr * sizeof(float));
            acc = &s->acc[s->n_acc++];
            acc->d = d;
            acc->n = nr;
        }
        const unsigned w = i / 32, l = i % 32, g = l / 4, q = l % 4;
        for (unsigned r = 0; r < nr; r++) {
            const unsigned j = r / 4, hh = r % 4;
            const unsigned row = 16 * w + g + 8 * (hh >> 1), col = 8 * j + 2 * q + (hh & 1);
            acc->val[r] = flags & F_SCALE_D ? (float)((double)c[r] + AB[row][col])
                                            : (float)AB[row][col];
        }
        acc->last_seq = s->seq;
        memset(d, 0xff, nr * sizeof(float));   /* poison until the wait */
        if (s->n_ops == kMaxWgOps)
            ra_emu_report(RA_EMU_TRAP, "more than %u wgmma.mma_async in flight in one thread",
                          (unsigned)kMaxWgOps);
        WgOpRec &r = s->ops[s->n_ops++];
        r.seq = s->seq++;
        r.op = op;
        r.a = rs ? (const uint32_t *)(uintptr_t)o->in[4] : nullptr;
        set_watch(b, s);
    }
}

void hp_retire_op(Thread *t, uint32_t op_index) {
    Block *b = t->blk;
    AsyncOp &op = b->hp->ops[op_index];
    op.pending = false;
    const unsigned i = t->warp - op.first_warp;
    if (i < op.nwarps && op.ret[i] == 0) op.ret[i] = b->now;
}

}  // namespace ra_emu

using namespace ra_emu;

extern "C" void ra_emu_wgmma_fence(void) {
    Thread *t = kernel_thread("wgmma.fence");
    hp_block(t->blk);
    hp_thread(t)->fences++;
}

extern "C" void ra_emu_wgmma(float *d, int n, const uint32_t *a_regs, uint64_t a_desc,
                             uint64_t b_desc, int bf16, int scale_d, int scale_a, int scale_b,
                             int trans_a, int trans_b) {
    Thread *t = kernel_thread("wgmma.mma_async");
    if (n < 8 || n > 256 || n % 8)
        ra_emu_report(RA_EMU_TRAP, "wgmma.mma_async.m64n%dk16: N must be a multiple of 8 in "
                      "8..256", n);
    if ((scale_a != 1 && scale_a != -1) || (scale_b != 1 && scale_b != -1))
        ra_emu_report(RA_EMU_TRAP, "wgmma.mma_async with imm-scale-a %d, imm-scale-b %d (1 or "
                      "-1)", scale_a, scale_b);
    if (a_regs != nullptr && trans_a)
        ra_emu_report(RA_EMU_TRAP, "wgmma.mma_async with A in registers has no imm-trans-a");
    hp_block(t->blk);
    uint64_t flags = (uint64_t)n;
    if (bf16) flags |= F_BF16;
    if (scale_d) flags |= F_SCALE_D;
    if (scale_a < 0) flags |= F_NEG_A;
    if (scale_b < 0) flags |= F_NEG_B;
    if (trans_a) flags |= F_TRANS_A;
    if (trans_b) flags |= F_TRANS_B;
    if (a_regs != nullptr) flags |= F_RS;
    t->in[0] = (uint64_t)(uintptr_t)d;
    t->in[1] = flags;
    t->in[2] = a_regs != nullptr ? 0 : a_desc;
    t->in[3] = b_desc;
    t->in[4] = (uint64_t)(uintptr_t)a_regs;
    for (int i = 0; i < 4; i++) t->in[5 + i] = a_regs != nullptr ? a_regs[i] : 0;
    hp_wg_collective(t, WG_WGMMA, complete_wgmma);
}

extern "C" void ra_emu_wgmma_commit(void) {
    Thread *t = kernel_thread("wgmma.commit_group");
    Sm90Thread *s = hp_thread(t);
    if (s->n_groups == kMaxWgGroups)
        ra_emu_report(RA_EMU_TRAP, "more than %u wgmma groups pending in one thread",
                      (unsigned)kMaxWgGroups);
    s->group_end[s->n_groups++] = s->seq;
}

extern "C" void ra_emu_wgmma_wait(int n) {
    Thread *t = kernel_thread("wgmma.wait_group");
    Sm90Thread *s = hp_thread(t);
    if (n < 0 || n > 7) ra_emu_report(RA_EMU_TRAP, "wgmma.wait_group %d (0..7)", n);
    if (s->n_groups <= (unsigned)n) return;
    /* retire every group but the newest n */
    const uint32_t end = s->group_end[s->n_groups - (unsigned)n - 1];
    unsigned keep = 0;
    for (unsigned i = 0; i < s->n_acc; i++) {
        WgAcc &a = s->acc[i];
        if (a.last_seq < end) {
            memcpy(a.d, a.val, a.n * sizeof(float));
        } else {
            if (keep != i) s->acc[keep] = a;
            keep++;
        }
    }
    s->n_acc = keep;
    keep = 0;
    for (unsigned i = 0; i < s->n_ops; i++) {
        if (s->ops[i].seq < end) {
            hp_retire_op(t, s->ops[i].op);
        } else {
            s->ops[keep++] = s->ops[i];
        }
    }
    s->n_ops = keep;
    memmove(s->group_end, s->group_end + (s->n_groups - (unsigned)n),
            (size_t)n * sizeof(uint32_t));
    s->n_groups = (unsigned)n;
    set_watch(t->blk, s);
}
