/*
 * attn_kernels.cuh -- the internal (C++) launchers behind ra_cuda_attn_fwd
 * and ra_cuda_attn_bwd, one per kernel family, each in its own .cu file so
 * that the files compile in parallel.  The extern "C" dispatchers in
 * attn_fwd.cu / attn_bwd.cu choose among them.
 */
#ifndef RA_ATTN_KERNELS_CUH
#define RA_ATTN_KERNELS_CUH

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "mask.cuh"

/* Generic SIMT kernels: every dtype, head_dim 1..256.  attn_fwd_simt.cu,
 * attn_bwd_simt.cu (dk, dv; then dq from attn_bwd_simt_dq.cu) */
ra_status ra_fwd_simt(const ra_attn_fwd_params &p, cudaStream_t s);
ra_status ra_bwd_simt(const ra_attn_bwd_params &p, cudaStream_t s);

/* Tensor-core forward: float16/bfloat16, head_dim 64 or 128, 16-byte
 * aligned rows.  attn_fwd_tc.cu */
bool ra_fwd_tc_supported(const ra_attn_fwd_params &p);
ra_status ra_fwd_tc(const ra_attn_fwd_params &p, cudaStream_t s);

/* Hopper (sm_90a) forward on wgmma and bulk tensor copies: float16 /
 * bfloat16, head_dim 64 or 128, q/k/v strides a tensor map can describe.
 * *ran is false (and nothing was launched) when the driver could not make
 * the tensor maps: the caller then runs the mma.sync kernel.
 * cuda/hopper/attn_fwd_wg.cu */
bool ra_fwd_wg_supported(const ra_attn_fwd_params &p);
ra_status ra_fwd_wg(const ra_attn_fwd_params &p, cudaStream_t s, bool *ran);

/* The tensor-core family for a device (-1: the current one), from the
 * build, its compute capability and RINGATTN_CUDA_KERNELS (an invalid
 * value is an error); the count of forward calls per kernel (0 sm90a, 1
 * sm80, 2 generic).  cuda/attn_family.cu */
enum ra_family { RA_FAMILY_SM80, RA_FAMILY_SM90A };
ra_status ra_kernel_family(int device, ra_family *family);
void ra_count_fwd_kernel(int which);
/* the same count for the backward (0 sm90a, 1 sm80, 2 generic) */
void ra_count_bwd_kernel(int which);

/* Tensor-core backward, float16/bfloat16, head_dim 64 or 128 (eligibility
 * in attn_bwd.cu).  deterministic: the dk/dv pass (attn_bwd_tc_dkdv.cu) and
 * the dq pass (attn_bwd_tc_dq.cu), each deterministic and run in that
 * order.  Otherwise the fused pass (attn_bwd_fused.cu), dq by float32
 * atomics; *ran is false when it cannot run here (the device grants too
 * little shared memory, or a dq scratch would be needed on a stream other
 * than ringattn's compute stream) and the caller takes the split pair. */
ra_status ra_bwd_tc_dkdv(const ra_attn_bwd_params &p, cudaStream_t s);
ra_status ra_bwd_tc_dq(const ra_attn_bwd_params &p, cudaStream_t s);
ra_status ra_bwd_tc_fused(const ra_attn_bwd_params &p, cudaStream_t s, bool *ran);

/* Hopper (sm_90a) backward on wgmma and bulk tensor copies (the fused
 * kernel's contract, deterministic=False): float16/bfloat16, head_dim 64
 * or 128, masks and dilated branches included, q/k/v/dout strides a tensor
 * map can describe (ra_bwd_wg_supported, after attn_bwd.cu's tensor-core
 * checks).  *ran is false (nothing launched) when the driver could not
 * make the tensor maps, the device grants too little shared memory, or a
 * dq scratch would be needed on a stream other than ringattn's compute
 * stream.  ra_bwd_wg_dkdv: the same kernel without its dq product, the
 * deterministic dk/dv pass (each element of dk and dv has one writer);
 * *ran false as above but for the dq scratch, which it does not need.
 * cuda/hopper/attn_bwd_wg.cu */
bool ra_bwd_wg_supported(const ra_attn_bwd_params &p);
ra_status ra_bwd_wg(const ra_attn_bwd_params &p, cudaStream_t s, bool *ran);
ra_status ra_bwd_wg_dkdv(const ra_attn_bwd_params &p, cudaStream_t s, bool *ran);

/* The deterministic dq pass on the same machinery (after ra_bwd_wg_dkdv):
 * attn_bwd_tc_dq.cu's contract; *ran false (nothing launched) when the
 * driver could not make the tensor maps or the device grants too little
 * shared memory.  cuda/hopper/attn_bwd_wg_dq.cu */
ra_status ra_bwd_wg_dq(const ra_attn_bwd_params &p, cudaStream_t s, bool *ran);

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

/* RINGATTN_CUDA_GENERIC=1 forces the generic kernels (for tests that
 * compare them with the tensor-core ones). */
static inline bool ra_force_generic(void) {
    const char *env = getenv("RINGATTN_CUDA_GENERIC");
    return env != NULL && strcmp(env, "1") == 0;
}

/* Whether ptr is a multiple of `bytes` (the tensor-core eligibility tests). */
static inline bool ra_aligned(const void *ptr, unsigned bytes) {
    return ((uintptr_t)ptr % bytes) == 0;
}

/* The checks every attention entry point makes, with `what` ("attention",
 * "attention backward") opening the message: a float dtype first, and the
 * head geometry, the position strides (causal, window) and the masks'
 * consistency after the entry point's own dtype checks. */
static inline ra_status ra_check_attn_dtype(const char *what, ra_dtype dtype) {
    if (dtype != RA_FLOAT32 && dtype != RA_FLOAT64 && dtype != RA_FLOAT16 &&
        dtype != RA_BFLOAT16) {
        ra_set_error(RA_ERR_TYPE, "%s: unsupported dtype %s", what, ra_dtype_name(dtype));
        return RA_ERR_TYPE;
    }
    return RA_OK;
}
template <typename P>
static inline ra_status ra_check_attn_geometry(const char *what, const P &p) {
    if (p.head_dim < 1 || p.head_dim > RA_MAX_HEAD_DIM) {
        ra_set_error(RA_ERR_VALUE, "%s: head_dim %lld outside [1, %d] on CUDA", what,
                     (long long)p.head_dim, RA_MAX_HEAD_DIM);
        return RA_ERR_VALUE;
    }
    if (p.heads_kv < 1 || p.heads % p.heads_kv != 0) {
        ra_set_error(RA_ERR_VALUE, "%s: heads %lld not a multiple of kv heads %lld", what,
                     (long long)p.heads, (long long)p.heads_kv);
        return RA_ERR_VALUE;
    }
    if ((p.causal || ra::mask_window(p.mask)) && (p.q_pos_stride < 1 || p.k_pos_stride < 1)) {
        ra_set_error(RA_ERR_VALUE, "%s: position strides must be >= 1", what);
        return RA_ERR_VALUE;
    }
    if ((p.mask.q_segment_ids == nullptr) != (p.mask.kv_segment_ids == nullptr)) {
        ra_set_error(RA_ERR_VALUE, "%s: q and kv segment ids must be given together", what);
        return RA_ERR_VALUE;
    }
    if (!RA_SOFTCAP_OK(p.mask.softcap)) {
        ra_set_error(RA_ERR_VALUE, "%s: softcap must be in [%g, %g] (0: none), got %g",
                     what, RA_SOFTCAP_MIN, RA_SOFTCAP_MAX, p.mask.softcap);
        return RA_ERR_VALUE;
    }
    return RA_OK;
}

/* The generic kernels' instantiation for params p (fwd or bwd): element
 * type T from p.dtype, DPL, the head dims each lane holds, 1, 2, 4 or 8
 * for head_dim up to 32, 64, 128, 256, and M, the masked variant when
 * p.mask (or a backward's branch rule) asks for it; calls
 * L::run<T, DPL, M>(p, s).  The masked variant
 * has fewer instantiations to compile: float32, float16 and bfloat16 share
 * T = Dyn<float> (the dtype read at run time as the rows are staged) and
 * head_dim <= 32 takes DPL 2.  `what` opens the message of an unsupported
 * dtype. */
template <typename L, typename T, bool M, typename P>
static inline ra_status ra_simt_dispatch_dpl(const P &p, cudaStream_t s) {
    if constexpr (!M) {
        if (p.head_dim <= 32) return L::template run<T, 1, M>(p, s);
    }
    if (p.head_dim <= 64) return L::template run<T, 2, M>(p, s);
    if (p.head_dim <= 128) return L::template run<T, 4, M>(p, s);
    return L::template run<T, 8, M>(p, s);
}
template <typename L, bool M, typename P>
static inline ra_status ra_simt_dispatch_m(const P &p, cudaStream_t s, const char *what) {
    switch (p.dtype) {
    case RA_FLOAT64: return ra_simt_dispatch_dpl<L, double, M>(p, s);
    case RA_FLOAT32:
    case RA_FLOAT16:
    case RA_BFLOAT16:
        if constexpr (M) {
            return ra_simt_dispatch_dpl<L, ra::Dyn<float>, M>(p, s);
        } else {
            if (p.dtype == RA_FLOAT32) return ra_simt_dispatch_dpl<L, float, M>(p, s);
            if (p.dtype == RA_FLOAT16) return ra_simt_dispatch_dpl<L, ra::half_t, M>(p, s);
            return ra_simt_dispatch_dpl<L, ra::bf16_t, M>(p, s);
        }
    default:
        ra_set_error(RA_ERR_TYPE, "%s: unsupported dtype %s", what, ra_dtype_name(p.dtype));
        return RA_ERR_TYPE;
    }
}
template <typename L, typename P>
static inline ra_status ra_simt_dispatch(const P &p, cudaStream_t s, const char *what) {
    return ra::masked_variant(p) ? ra_simt_dispatch_m<L, true>(p, s, what)
                                   : ra_simt_dispatch_m<L, false>(p, s, what);
}

/* The tensor-core kernels' instantiation (eligibility already checked:
 * float16 or bfloat16, head_dim 64 or 128; M as above): calls
 * L::run<T, D, M>(p, s). */
template <typename L, bool M, typename P>
static inline ra_status ra_tc_dispatch_m(const P &p, cudaStream_t s) {
    if (p.dtype == RA_FLOAT16)
        return p.head_dim == 64 ? L::template run<ra::half_t, 64, M>(p, s)
                                : L::template run<ra::half_t, 128, M>(p, s);
    return p.head_dim == 64 ? L::template run<ra::bf16_t, 64, M>(p, s)
                            : L::template run<ra::bf16_t, 128, M>(p, s);
}
template <typename L, typename P>
static inline ra_status ra_tc_dispatch(const P &p, cudaStream_t s) {
    return ra::masked_variant(p) ? ra_tc_dispatch_m<L, true>(p, s)
                                   : ra_tc_dispatch_m<L, false>(p, s);
}

namespace ra {

/* Where a kernel block sits, for the 1-D grids of the attention kernels
 * (p: forward or backward params).
 *   q_block: a block owning ROWS query rows of one (b, h), blockIdx.x (or
 *            the block index given) =
 *            (b * H + h) * n_qblocks + (n_qblocks - 1 - qb), so the last
 *            query rows (the heaviest causal blocks) start first; hk is the
 *            kv head h reads, q0 = qb * ROWS the first owned row.
 *   k_block: a block owning ROWS keys of one (b, hk), blockIdx.x =
 *            (b * H_kv + hk) * n_kblocks + kb; group = H / H_kv query heads
 *            read hk, k0 = kb * ROWS the first owned key. */
struct QBlock { int64_t b, h, hk, q0; };
struct KBlock { int64_t b, hk, group, k0; };

template <int ROWS, typename P>
__device__ __forceinline__ QBlock q_block(const P &p, int64_t n_qblocks, int64_t block) {
    const int64_t qb = n_qblocks - 1 - block % n_qblocks;
    const int64_t bh = block / n_qblocks;
    QBlock r;
    r.h = bh % p.heads;
    r.b = bh / p.heads;
    r.hk = r.h / (p.heads / p.heads_kv);
    r.q0 = qb * ROWS;
    return r;
}
template <int ROWS, typename P>
__device__ __forceinline__ QBlock q_block(const P &p, int64_t n_qblocks) {
    return q_block<ROWS>(p, n_qblocks, (int64_t)blockIdx.x);
}
template <int ROWS, typename P>
__device__ __forceinline__ KBlock k_block(const P &p, int64_t n_kblocks) {
    const int64_t kb = (int64_t)blockIdx.x % n_kblocks;
    const int64_t bh = (int64_t)blockIdx.x / n_kblocks;
    KBlock r;
    r.hk = bh % p.heads_kv;
    r.b = bh / p.heads_kv;
    r.group = p.heads / p.heads_kv;
    r.k0 = kb * ROWS;
    return r;
}

/* A half-open index range [begin, end) (empty when end <= begin). */
struct Range { int64_t begin, end; };

/* Keys [begin, end) some query of rows [q0, q0 + ROWS) can see: all S_k
 * keys, or those the causal rule (and with M the window) leaves to the
 * rows' positions -- the span of the first row's lowest key to the last
 * existing row's highest. */
template <int ROWS, bool M, typename P>
__host__ __device__ __forceinline__ Range block_keys(const P &p, int64_t q0) {
    const int64_t q_last = (q0 + ROWS < p.seqlen_q ? q0 + ROWS : p.seqlen_q) - 1;
    if (!M)
        return Range{0, p.causal ? causal_key_end(q_last, p.q_pos_offset, p.q_pos_stride,
                                                  p.k_pos_offset, p.k_pos_stride, p.seqlen_k)
                                 : p.seqlen_k};
    const int64_t qpos_first = p.q_pos_offset + q0 * p.q_pos_stride;
    const int64_t qpos_last = p.q_pos_offset + q_last * p.q_pos_stride;
    return Range{count_below_sat(keys_seen_by(p, qpos_first).lo, p.k_pos_offset,
                                 p.k_pos_stride, p.seqlen_k),
                 count_upto_sat(keys_seen_by(p, qpos_last).hi, p.k_pos_offset, p.k_pos_stride,
                                p.seqlen_k)};
}
/* Queries [begin, end) that can see some key of [k0, k0 + ROWS): from the
 * first that can see key k0 (0 without the causal rule) to S_q, or with M
 * to the last the window leaves to the last existing key. */
template <int ROWS, bool M, typename P>
__host__ __device__ __forceinline__ Range block_queries(const P &p, int64_t k0) {
    if (!M)
        return Range{p.causal ? causal_query_begin(k0, p.q_pos_offset, p.q_pos_stride,
                                                   p.k_pos_offset, p.k_pos_stride, p.seqlen_q)
                              : 0,
                     p.seqlen_q};
    const int64_t kpos_first = p.k_pos_offset + k0 * p.k_pos_stride;
    const int64_t k_last = (k0 + ROWS < p.seqlen_k ? k0 + ROWS : p.seqlen_k) - 1;
    const int64_t kpos_last = p.k_pos_offset + k_last * p.k_pos_stride;
    return Range{count_below_sat(queries_seeing(p, kpos_first).lo, p.q_pos_offset,
                                 p.q_pos_stride, p.seqlen_q),
                 count_upto_sat(queries_seeing(p, kpos_last).hi, p.q_pos_offset,
                                p.q_pos_stride, p.seqlen_q)};
}

}  // namespace ra

#endif /* RA_ATTN_KERNELS_CUH */
