/*
 * ptx_sm90.h -- the Hopper (sm_90a) PTX of cuda/hopper/ptx_sm90.cuh on
 * ringattn's emulated GPU (sync_sm90.cpp, mbarrier.cpp, ptx_wgmma.cpp,
 * ptx_tma.cpp, ptx.cpp).  The wrappers call these when built with RA_CUDA_EMULATED
 * instead of their asm statements; nothing else does.  Pointers are
 * generic addresses (the wrappers' cvta to the shared window happens here).
 *
 *   wgmma.mma_async.sync.aligned.m64n<n>k16.f32.{f16,bf16}.{f16,bf16}
 *       d: the thread's n/2 accumulator registers; A from a_regs (four
 *       .b32, the mma.m16n8k16 A layout, warp w of the warpgroup holding
 *       rows 16w..16w+15) or, a_regs NULL, from the shared-memory matrix
 *       descriptor a_desc; B from b_desc.  scale_d 0: D = A B, else
 *       D = A B + D; scale_a, scale_b: 1 or -1; trans_a, trans_b: the
 *       imm-trans operands (1: M-/N-major in shared memory)
 *   wgmma.fence / commit_group / wait_group n
 *   mbarrier.init / inval / arrive{.expect_tx} / expect_tx /
 *       {try,test}_wait.parity (returns 1 once the phase of that parity
 *       has completed)
 *   cp.async.bulk.tensor.<rank>d.shared::cluster.global.mbarrier::
 *       complete_tx::bytes (tensor map, int32 coordinates, mbarrier);
 *   cp.async.bulk.tensor.<rank>d.global.shared::cta.bulk_group;
 *   cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes;
 *   cp.async.bulk.commit_group / wait_group{.read} n
 *   fence.proxy.async.shared::cta; bar.sync / bar.arrive id, count;
 *   setmaxnreg.{inc,dec}.sync.aligned.u32; elect.sync;
 *   stmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.shared.b16
 */
#ifndef RA_EMU_PTX_SM90_H
#define RA_EMU_PTX_SM90_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

void ra_emu_wgmma(float *d, int n, const uint32_t *a_regs, uint64_t a_desc, uint64_t b_desc,
                  int bf16, int scale_d, int scale_a, int scale_b, int trans_a, int trans_b);
void ra_emu_wgmma_fence(void);
void ra_emu_wgmma_commit(void);
void ra_emu_wgmma_wait(int n);

void ra_emu_mbar_init(void *bar, unsigned count);
void ra_emu_mbar_inval(void *bar);
uint64_t ra_emu_mbar_arrive(void *bar, unsigned count, unsigned tx);
void ra_emu_mbar_expect_tx(void *bar, unsigned tx);
/* test: test_wait (the first poll of an incomplete phase returns 0) */
int ra_emu_mbar_wait(void *bar, unsigned parity, int test);

void ra_emu_tma_load(void *dst, const void *tensor_map, const int32_t *coords, int rank,
                     void *bar);
void ra_emu_tma_store(const void *tensor_map, const int32_t *coords, int rank,
                      const void *src);
void ra_emu_bulk_load(void *dst, const void *src, unsigned bytes, void *bar);
void ra_emu_bulk_commit(void);
void ra_emu_bulk_wait(int n, int read);

void ra_emu_fence_proxy_async(void);
void ra_emu_named_barrier(unsigned id, unsigned count, int arrive_only);
void ra_emu_setmaxnreg(unsigned n, int inc);
/* the count the last setmaxnreg of the calling thread's warpgroup set (0: none) */
unsigned ra_emu_warpgroup_maxnreg(void);
/* the elected lane (the lowest of mask); *leader: whether it is the caller */
unsigned ra_emu_elect(unsigned mask, int *leader);
void ra_emu_stmatrix(void *row, const uint32_t *regs, int num, int trans);

#ifdef __cplusplus
}
#endif
#endif /* RA_EMU_PTX_SM90_H */
