/*
 * ptx.h -- the inline-PTX operations of cuda/mma.cuh on ringattn's
 * emulated GPU (ptx.cpp).  mma.cuh's wrappers call these when built with
 * RA_CUDA_EMULATED instead of their asm statements; nothing else does.
 *
 *   cp.async.cg.shared.global [dst], [src], cp_size, src_size
 *       the copy is recorded and the destination poisoned; the data lands
 *       at the cp.async.wait_group that retires its group, not before
 *   cp.async.commit_group / cp.async.wait_group n
 *   ldmatrix.sync.aligned.m8n8.{x1,x2,x4}[.trans].shared.b16
 *       a warp collective: lane 8i + j gives the address of row j of
 *       matrix i; lane l receives, of matrix i, row l/4 columns 2(l%4) and
 *       2(l%4)+1 (of the transposed matrix with .trans), low half first
 *   mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32
 *       a warp collective over the PTX ISA's fragment layouts (g = lane/4,
 *       t = lane%4): A a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..),
 *       a3 (g+8, 2t+8..); B b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g);
 *       C/D c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1)
 */
#ifndef RA_EMU_PTX_H
#define RA_EMU_PTX_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

void ra_emu_cp_async(void *smem_dst, const void *global_src, int cp_size, int src_size);
void ra_emu_cp_async_commit(void);
void ra_emu_cp_async_wait(int n);
void ra_emu_ldmatrix(uint32_t *regs, const void *smem_row, int num, int trans);
void ra_emu_mma_m16n8k16(float *c, const uint32_t *a, uint32_t b0, uint32_t b1, int bf16);

#ifdef __cplusplus
}
#endif
#endif /* RA_EMU_PTX_H */
