/*
 * attn_bwd_simt.cuh -- what the two generic backward kernels share
 * (attn_bwd_simt.cu: dk, dv; attn_bwd_simt_dq.cu: dq; one file each so that
 * they compile in parallel): the block shape and the dq pass's launcher.
 */
#ifndef RA_ATTN_BWD_SIMT_CUH
#define RA_ATTN_BWD_SIMT_CUH

#include "attn_kernels.cuh"

namespace ra {
namespace bwd_simt {

constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 4;
constexpr int kBlockRows = kWarps * kRowsPerWarp;  // 16 owned rows per block
constexpr int kTile = 32;                           // streamed rows per tile

}  // namespace bwd_simt
}  // namespace ra

/* The dq pass (attn_bwd_simt_dq.cu), run after the dk/dv pass. */
ra_status ra_bwd_simt_dq(const ra_attn_bwd_params &p, cudaStream_t s);

#endif /* RA_ATTN_BWD_SIMT_CUH */
