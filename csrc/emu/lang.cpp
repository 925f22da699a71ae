/*
 * lang.cpp -- the kernel language's entry points on the emulated GPU
 * (device.h): thread and block indices, the dynamic shared memory, warp
 * shuffles and votes (warp collectives of simt.cpp), fences, __trap and
 * atomics (checked like any access, then done with the host's atomics).
 * Not instrumented: kernel code calls these.
 */
#include "emu/simt.h"

#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

using namespace ra_emu;

extern "C" uint3 ra_emu_thread_idx(void) {
    const Thread *t = current_thread();
    if (t == nullptr) return uint3{0, 0, 0};
    return uint3{t->ix, t->iy, t->iz};
}
extern "C" uint3 ra_emu_block_idx(void) {
    const Thread *t = current_thread();
    if (t == nullptr) return uint3{0, 0, 0};
    return uint3{t->blk->bx, t->blk->by, t->blk->bz};
}
extern "C" dim3 ra_emu_block_dim(void) {
    const Thread *t = current_thread();
    if (t == nullptr) return dim3(1, 1, 1);
    return dim3(t->blk->g->block.x, t->blk->g->block.y, t->blk->g->block.z);
}
extern "C" dim3 ra_emu_grid_dim(void) {
    const Thread *t = current_thread();
    if (t == nullptr) return dim3(1, 1, 1);
    return dim3(t->blk->g->grid.x, t->blk->g->grid.y, t->blk->g->grid.z);
}
extern "C" unsigned char *ra_emu_dynamic_smem(void) {
    const Thread *t = current_thread();
    return t == nullptr ? nullptr : t->blk->smem;
}
extern "C" unsigned ra_emu_cvta_shared(const void *p) {
    const Thread *t = current_thread();
    if (t == nullptr) return 0;
    return (unsigned)((const unsigned char *)p - t->blk->smem);
}

extern "C" unsigned ra_emu_activemask(void) {
    const Thread *t = current_thread();
    const Block *b = t->blk;
    unsigned m = 0;
    for (unsigned l = 0; l < RA_EMU_WARP; l++) {
        const unsigned i = t->warp * RA_EMU_WARP + l;
        if (i < b->nthreads && b->threads[i].state != T_DONE) m |= 1u << l;
    }
    return m;
}

extern "C" uint64_t ra_emu_shfl(unsigned mask, uint64_t value, int mode, int lane_arg,
                                int width) {
    current_thread()->in[0] = value;
    collective(C_SHFL, (uint8_t)mode, mask, lane_arg, width);
    return current_thread()->out[0];
}

extern "C" unsigned ra_emu_vote(unsigned mask, int pred, int mode) {
    current_thread()->in[0] = pred != 0;
    collective(C_VOTE, (uint8_t)mode, mask, 0, 32);
    return (unsigned)current_thread()->out[0];
}

extern "C" void ra_emu_threadfence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

extern "C" void ra_emu_trap(void) {
    ra_emu_report(RA_EMU_TRAP, "__trap() called");
    abort();  /* not reached in a kernel: the report stops the thread */
}

extern "C" uint64_t ra_emu_atomic(void *p, int kind, int op, uint64_t value, uint64_t compare) {
    Thread *t = current_thread();
    const size_t n = kind == 2 || kind == 4 ? 8 : 4;
    if (t != nullptr) check_access(t, (uintptr_t)p, n, true);
    if ((uintptr_t)p % n) {
        ra_emu_report(RA_EMU_MISALIGNED, "atomic on %p, not %zu-byte aligned", p, n);
    }
    if (n == 4) {
        uint32_t *q = (uint32_t *)p;
        uint32_t old = __atomic_load_n(q, __ATOMIC_RELAXED), want;
        do {
            switch (op) {
            case 0:
                if (kind == 3) {
                    float f, v;
                    memcpy(&f, &old, 4);
                    memcpy(&v, &value, 4);
                    f += v;
                    memcpy(&want, &f, 4);
                } else {
                    want = old + (uint32_t)value;
                }
                break;
            case 1:
                want = kind == 0 ? (uint32_t)((int32_t)old > (int32_t)value ? old : (uint32_t)value)
                                 : (old > (uint32_t)value ? old : (uint32_t)value);
                break;
            case 2:
                want = kind == 0 ? (uint32_t)((int32_t)old < (int32_t)value ? old : (uint32_t)value)
                                 : (old < (uint32_t)value ? old : (uint32_t)value);
                break;
            case 3: want = (uint32_t)value; break;
            default: want = old == (uint32_t)compare ? (uint32_t)value : old; break;
            }
        } while (!__atomic_compare_exchange_n(q, &old, want, true, __ATOMIC_RELAXED,
                                              __ATOMIC_RELAXED));
        return old;
    }
    uint64_t *q = (uint64_t *)p;
    uint64_t old = __atomic_load_n(q, __ATOMIC_RELAXED), want;
    do {
        switch (op) {
        case 0:
            if (kind == 4) {
                double f, v;
                memcpy(&f, &old, 8);
                memcpy(&v, &value, 8);
                f += v;
                memcpy(&want, &f, 8);
            } else {
                want = old + value;
            }
            break;
        case 3: want = value; break;
        case 4: want = old == compare ? value : old; break;
        default: want = op == 1 ? (old > value ? old : value) : (old < value ? old : value); break;
        }
    } while (!__atomic_compare_exchange_n(q, &old, want, true, __ATOMIC_RELAXED,
                                          __ATOMIC_RELAXED));
    return old;
}
