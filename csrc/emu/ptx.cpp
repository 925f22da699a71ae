/*
 * ptx.cpp -- cp.async, ldmatrix, stmatrix, elect.sync and mma.sync on the
 * emulated GPU (see ptx.h and ptx_sm90.h for the semantics and fragment
 * layouts, taken from the PTX ISA).
 *
 * stmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.shared.b16 is ldmatrix run
 * backwards: lane 8i + j gives the address of row j of matrix i; lane l
 * holds in register i, of matrix i, row l/4 columns 2(l%4) and 2(l%4)+1
 * (of the transposed matrix with .trans), low half first.
 */
#include "emu/ptx.h"
#include "emu/ptx_sm90.h"
#include "emu/simt.h"

#include <cuda_bf16.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

namespace ra_emu {

Thread *kernel_thread(const char *what) {
    Thread *t = current_thread();
    if (t == nullptr) {
        fprintf(stderr, "ringattn emulated GPU: %s called outside a kernel\n", what);
        abort();
    }
    return t;
}

/* Land the copies [0, end) of t's queue. */
static void land(Thread *t, int end) {
    for (int i = 0; i < end; i++) {
        CpAsync &c = t->cp[i];
        if (c.src_size) {
            check_access(t, (uintptr_t)c.src, c.src_size, false);
            memcpy(c.dst, c.src, c.src_size);
        }
        if (c.src_size < c.cp_size) memset(c.dst + c.src_size, 0, c.cp_size - c.src_size);
        shadow_cp_landed(t, c.dst, c.cp_size);
    }
    memmove(t->cp, t->cp + end, sizeof(CpAsync) * (size_t)(t->n_cp - end));
    t->n_cp -= end;
}

void complete_ldmatrix(Block *b, unsigned warp, unsigned mask) {
    (void)mask;
    const unsigned base = warp * RA_EMU_WARP;
    const uint8_t mode = b->threads[base].coll_mode;
    const int num = mode >> 1, trans = mode & 1;
    uint16_t m[4][8][8];
    for (int i = 0; i < num; i++) {
        for (int j = 0; j < 8; j++) {
            Thread *owner = &b->threads[base + 8 * i + j];
            if (owner->coll_mode != mode)
                ra_emu_report(RA_EMU_SYNC, "lanes of one ldmatrix disagree on its shape "
                              "(lane %d)", 8 * i + j);
            const uintptr_t a = (uintptr_t)owner->in[0];
            if (a % 16)
                ra_emu_report(RA_EMU_MISALIGNED, "ldmatrix row address %p of lane %d is not "
                              "16-byte aligned", (void *)a, 8 * i + j);
            check_shared(owner, a, 16, false);
            memcpy(m[i][j], (const void *)a, 16);
        }
    }
    for (unsigned l = 0; l < RA_EMU_WARP; l++) {
        Thread *o = &b->threads[base + l];
        const unsigned r = l / 4, c = 2 * (l % 4);
        for (int i = 0; i < num; i++) {
            uint32_t lo, hi;
            if (!trans) {
                lo = m[i][r][c];
                hi = m[i][r][c + 1];
            } else {
                lo = m[i][c][r];
                hi = m[i][c + 1][r];
            }
            o->out[i] = lo | (hi << 16);
        }
    }
}

void complete_stmatrix(Block *b, unsigned warp, unsigned mask) {
    (void)mask;
    const unsigned base = warp * RA_EMU_WARP;
    const uint8_t mode = b->threads[base].coll_mode;
    const int num = mode >> 1, trans = mode & 1;
    uint16_t m[4][8][8];
    for (unsigned l = 0; l < RA_EMU_WARP; l++) {
        const Thread *o = &b->threads[base + l];
        if (o->coll_mode != mode)
            ra_emu_report(RA_EMU_SYNC, "lanes of one stmatrix disagree on its shape (lane %u)", l);
        const unsigned r = l / 4, c = 2 * (l % 4);
        for (int i = 0; i < num; i++) {
            const uint32_t v = (uint32_t)o->in[1 + i];
            if (!trans) {
                m[i][r][c] = (uint16_t)v;
                m[i][r][c + 1] = (uint16_t)(v >> 16);
            } else {
                m[i][c][r] = (uint16_t)v;
                m[i][c + 1][r] = (uint16_t)(v >> 16);
            }
        }
    }
    for (int i = 0; i < num; i++) {
        for (int j = 0; j < 8; j++) {
            Thread *owner = &b->threads[base + 8 * i + j];
            const uintptr_t a = (uintptr_t)owner->in[0];
            if (a % 16)
                ra_emu_report(RA_EMU_MISALIGNED, "stmatrix row address %p of lane %d is not "
                              "16-byte aligned", (void *)a, 8 * i + j);
            check_shared(owner, a, 16, true);
            memcpy((void *)a, m[i][j], 16);
        }
    }
}

static inline float elem(uint32_t bits16, bool bf16) {
    return bf16 ? ra_emu_bf16_bits_to_f32((uint16_t)bits16)
                : ra_emu_f16_bits_to_f32((uint16_t)bits16);
}

void complete_mma(Block *b, unsigned warp, unsigned mask) {
    (void)mask;
    const unsigned base = warp * RA_EMU_WARP;
    const uint8_t mode = b->threads[base].coll_mode;
    const bool bf16 = mode != 0;
    float A[16][16], B[16][8], C[16][8];
    for (unsigned l = 0; l < RA_EMU_WARP; l++) {
        const Thread *o = &b->threads[base + l];
        if (o->coll_mode != mode)
            ra_emu_report(RA_EMU_SYNC, "lanes of one mma.sync disagree on its types (lane %u)",
                          l);
        const unsigned g = l / 4, t = l % 4;
        uint32_t ar[4], br[2];
        float cr[4];
        for (int i = 0; i < 4; i++) ar[i] = (uint32_t)o->in[i];
        br[0] = (uint32_t)o->in[4];
        br[1] = (uint32_t)o->in[5];
        for (int i = 0; i < 4; i++) {
            const uint32_t u = (uint32_t)o->in[6 + i];
            memcpy(&cr[i], &u, 4);
        }
        for (int h = 0; h < 2; h++) {
            A[g][2 * t + h] = elem(ar[0] >> (16 * h) & 0xffffu, bf16);
            A[g + 8][2 * t + h] = elem(ar[1] >> (16 * h) & 0xffffu, bf16);
            A[g][2 * t + 8 + h] = elem(ar[2] >> (16 * h) & 0xffffu, bf16);
            A[g + 8][2 * t + 8 + h] = elem(ar[3] >> (16 * h) & 0xffffu, bf16);
            B[2 * t + h][g] = elem(br[0] >> (16 * h) & 0xffffu, bf16);
            B[2 * t + 8 + h][g] = elem(br[1] >> (16 * h) & 0xffffu, bf16);
        }
        C[g][2 * t] = cr[0];
        C[g][2 * t + 1] = cr[1];
        C[g + 8][2 * t] = cr[2];
        C[g + 8][2 * t + 1] = cr[3];
    }
    float D[16][8];
    for (int r = 0; r < 16; r++) {
        for (int n = 0; n < 8; n++) {
            /* products of 16-bit inputs are exact in float; the sum is
             * rounded once (the device rounds its partial sums a little
             * differently: within float32 accumulation error of this) */
            double s = 0;
            for (int k = 0; k < 16; k++) s += (double)A[r][k] * (double)B[k][n];
            D[r][n] = (float)((double)C[r][n] + s);
        }
    }
    for (unsigned l = 0; l < RA_EMU_WARP; l++) {
        Thread *o = &b->threads[base + l];
        const unsigned g = l / 4, t = l % 4;
        const float d[4] = {D[g][2 * t], D[g][2 * t + 1], D[g + 8][2 * t], D[g + 8][2 * t + 1]};
        for (int i = 0; i < 4; i++) {
            uint32_t u;
            memcpy(&u, &d[i], 4);
            o->out[i] = u;
        }
    }
}

}  // namespace ra_emu

using namespace ra_emu;

extern "C" void ra_emu_cp_async(void *smem_dst, const void *global_src, int cp_size,
                                int src_size) {
    Thread *t = kernel_thread("cp.async");
    if ((cp_size != 4 && cp_size != 8 && cp_size != 16) || src_size < 0 ||
        src_size > cp_size)
        ra_emu_report(RA_EMU_TRAP, "cp.async of cp-size %d, src-size %d", cp_size, src_size);
    if ((uintptr_t)smem_dst % (unsigned)cp_size || (uintptr_t)global_src % (unsigned)cp_size)
        ra_emu_report(RA_EMU_MISALIGNED, "cp.async of %d bytes from %p to %p: not %d-byte "
                      "aligned", cp_size, global_src, smem_dst, cp_size);
    /* bounds (a report stops the thread before the poison below) and the
     * shadow's write check, then the destination is pending */
    shadow_cp_pending(t, (unsigned char *)smem_dst, (size_t)cp_size);
    if (t->n_cp == kMaxCpAsync)
        ra_emu_report(RA_EMU_TRAP, "more than %d cp.async operations in flight in one thread",
                      (int)kMaxCpAsync);
    CpAsync &c = t->cp[t->n_cp++];
    c.dst = (unsigned char *)smem_dst;
    c.src = (const unsigned char *)global_src;
    c.cp_size = (uint8_t)cp_size;
    c.src_size = (uint8_t)src_size;
    memset(smem_dst, 0xff, (size_t)cp_size);  /* poison until the wait */
}

extern "C" void ra_emu_cp_async_commit(void) {
    Thread *t = kernel_thread("cp.async.commit_group");
    if (t->n_groups == kMaxCpGroups) {
        ra_emu_report(RA_EMU_TRAP, "more than %d cp.async groups in flight in one thread",
                      (int)kMaxCpGroups);
    }
    t->group_end[t->n_groups++] = t->n_cp;
}

extern "C" void ra_emu_cp_async_wait(int n) {
    Thread *t = kernel_thread("cp.async.wait_group");
    if (n < 0) n = 0;
    while (t->n_groups > n) {
        const int end = t->group_end[0];
        land(t, end);
        for (int g = 1; g < t->n_groups; g++) t->group_end[g - 1] = t->group_end[g] - end;
        t->n_groups--;
    }
}

extern "C" void ra_emu_ldmatrix(uint32_t *regs, const void *smem_row, int num, int trans) {
    Thread *t = kernel_thread("ldmatrix");
    if (num != 1 && num != 2 && num != 4)
        ra_emu_report(RA_EMU_TRAP, "ldmatrix of %d matrices", num);
    t->in[0] = (uint64_t)(uintptr_t)smem_row;
    collective(C_LDMATRIX, (uint8_t)((num << 1) | (trans ? 1 : 0)), 0xffffffffu, 0, 32);
    for (int i = 0; i < num; i++) regs[i] = (uint32_t)t->out[i];
}

extern "C" void ra_emu_mma_m16n8k16(float *c, const uint32_t *a, uint32_t b0, uint32_t b1,
                                    int bf16) {
    Thread *t = kernel_thread("mma.sync");
    for (int i = 0; i < 4; i++) t->in[i] = a[i];
    t->in[4] = b0;
    t->in[5] = b1;
    for (int i = 0; i < 4; i++) {
        uint32_t u;
        memcpy(&u, &c[i], 4);
        t->in[6 + i] = u;
    }
    collective(C_MMA, (uint8_t)(bf16 ? 1 : 0), 0xffffffffu, 0, 32);
    for (int i = 0; i < 4; i++) {
        const uint32_t u = (uint32_t)t->out[i];
        memcpy(&c[i], &u, 4);
    }
}

extern "C" void ra_emu_stmatrix(void *row, const uint32_t *regs, int num, int trans) {
    Thread *t = kernel_thread("stmatrix");
    if (num != 1 && num != 2 && num != 4)
        ra_emu_report(RA_EMU_TRAP, "stmatrix of %d matrices", num);
    t->in[0] = (uint64_t)(uintptr_t)row;
    for (int i = 0; i < num; i++) t->in[1 + i] = regs[i];
    collective(C_STMATRIX, (uint8_t)((num << 1) | (trans ? 1 : 0)), 0xffffffffu, 0, 32);
}

extern "C" unsigned ra_emu_elect(unsigned mask, int *leader) {
    Thread *t = kernel_thread("elect.sync");
    collective(C_ELECT, 0, mask, 0, 32);
    const unsigned lane = (unsigned)t->out[0];
    *leader = lane == t->lane;
    return lane;
}
