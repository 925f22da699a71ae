/*
 * attn_kernels.cuh -- the internal (C++) launchers behind ra_cuda_attn_fwd
 * and ra_cuda_attn_bwd, one per kernel family, each in its own .cu file so
 * that the files compile in parallel.  The extern "C" dispatchers in
 * attn_fwd.cu / attn_bwd.cu choose among them.
 */
#ifndef RA_ATTN_KERNELS_CUH
#define RA_ATTN_KERNELS_CUH

#include "common.cuh"

/* Generic SIMT kernels: every dtype, head_dim 1..256.  attn_fwd_simt.cu,
 * attn_bwd_simt.cu */
ra_status ra_fwd_simt(const ra_attn_fwd_params &p, cudaStream_t s);
ra_status ra_bwd_simt(const ra_attn_bwd_params &p, cudaStream_t s);

/* Tensor-core forward: float16/bfloat16, head_dim 64 or 128, 16-byte
 * aligned rows.  attn_fwd_tc.cu */
bool ra_fwd_tc_supported(const ra_attn_fwd_params &p);
ra_status ra_fwd_tc(const ra_attn_fwd_params &p, cudaStream_t s);

/* Tensor-core backward, float16/bfloat16, head_dim 64 or 128 (eligibility
 * in attn_bwd.cu): the dk/dv pass (attn_bwd_tc_dkdv.cu) and the dq pass
 * (attn_bwd_tc_dq.cu), each deterministic and run in that order. */
ra_status ra_bwd_tc_dkdv(const ra_attn_bwd_params &p, cudaStream_t s);
ra_status ra_bwd_tc_dq(const ra_attn_bwd_params &p, cudaStream_t s);

/* Number of blocks for `units` work items of `per_block` each, or an error
 * when the grid would not fit a 1-D launch. */
static inline ra_status ra_grid_1d(int64_t units, int64_t per_block,
                                   int64_t *blocks_out) {
    const int64_t blocks = (units + per_block - 1) / per_block;
    if (blocks > 0x7fffffffLL) {
        ra_set_error(RA_ERR_OVERFLOW, "attention grid of %lld blocks is too "
                     "large for one launch", (long long)blocks);
        return RA_ERR_OVERFLOW;
    }
    *blocks_out = blocks;
    return RA_OK;
}

#endif /* RA_ATTN_KERNELS_CUH */
