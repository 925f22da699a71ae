/*
 * attn_bwd.cu -- the backward's entry points.
 *
 * ra_cuda_attn_bwd_preprocess: delta_i = sum_d dout_i[d] * out_i[d] in the
 *   acc dtype, (B, H, S_q) with lse's strides.  One warp per (b, s, h) row,
 *   256 threads per block, grid-stride.
 * ra_cuda_attn_bwd: checks what the kernels rely on and runs the
 *   tensor-core kernels (float16/bfloat16, head_dim 64 or 128, 16-byte
 *   aligned rows) or the generic kernels of attn_bwd_simt.cu and
 *   attn_bwd_simt_dq.cu (every dtype, head_dim 1..256).
 *   Tensor cores with p->deterministic = 0: where the device's family is
 *   sm90a (attn_family.cu; RINGATTN_CUDA_KERNELS=sm80 forces mma.sync)
 *   and ra_bwd_wg_supported (strides a tensor map can describe; masks and
 *   dilated branches included), the wgmma/TMA pass of hopper/attn_bwd_wg.cu
 *   (dq by float32 atomics); else, or when it cannot run, the fused pass of
 *   attn_bwd_fused.cu (dq added up by float32 atomics, so its last bits
 *   vary from run to run), unless the device lacks the shared memory or a
 *   dq scratch would be needed on a stream other than ringattn's compute
 *   stream; then, and with p->deterministic = 1, attn_bwd_tc_dkdv.cu then
 *   attn_bwd_tc_dq.cu, except that with p->deterministic = 1 on the sm90a
 *   family (ra_bwd_wg_supported) both passes run on wgmma: the dk/dv pass
 *   is the Hopper kernel's without its dq product (ra_bwd_wg_dkdv), the
 *   dq pass hopper/attn_bwd_wg_dq.cu (ra_bwd_wg_dq; attn_bwd_tc_dq.cu
 *   where it cannot run).
 *   The split pairs (tensor-core and generic) write every output element
 *   from exactly one thread: the same bits on every run.
 *   RINGATTN_CUDA_GENERIC=1 forces the generic kernels (for tests that
 *   compare the two).  p->branches (the scores are one branch of
 *   dilated attention; ra_check_branches) runs every family's masked
 *   variant, which applies the branch rule of mask.cuh: a pair the
 *   exponent rule snaps that c branches share gets P = 1/c.
 *
 * q, out, dout, dq: (B, S_q, H, D); k, v, dk, dv: (B, S_k, H_kv, D).
 */
#include "attn_kernels.cuh"

namespace {

template <typename T>
__global__ void delta_kernel(ra_attn_bwd_params p) {
    typedef typename ra::Acc<T>::type A;
    const int lane = threadIdx.x & 31;
    ra::for_each_row_warp(p.batch, p.seqlen_q, p.heads, [&](int64_t b, int64_t s, int64_t h) {
        const T *o = (const T *)p.out + b * p.out_batch_stride + s * p.out_seq_stride +
                     h * p.out_head_stride;
        const T *g = (const T *)p.dout + b * p.dout_batch_stride + s * p.dout_seq_stride +
                     h * p.dout_head_stride;
        A acc = 0;
        for (int64_t d = lane; d < p.head_dim; d += 32)
            acc += ra::to_acc(o[d]) * ra::to_acc(g[d]);
        acc = ra::warp_sum(acc);
        if (lane == 0)
            ((A *)p.delta)[b * p.lse_batch_stride + h * p.lse_head_stride +
                           s * p.lse_seq_stride] = acc;
    });
}

template <typename T>
ra_status launch_delta(const ra_attn_bwd_params &p, cudaStream_t s) {
    const int64_t rows = p.batch * p.seqlen_q * p.heads;
    int64_t blocks = (rows + 7) / 8;
    if (blocks > 65536) blocks = 65536;
    // one warp per (b, s, h) row; 8 rows per 256-thread block
    RA_LAUNCH((delta_kernel<T>), (unsigned)blocks, 256, 0, s)(p);
    RA_CUDA_CHECK_LAUNCH("delta_kernel");
    return RA_OK;
}

ra_status check_bwd(const ra_attn_bwd_params *p) {
    RA_CHECK(ra_check_attn_dtype("attention backward", p->dtype));
    if (p->out_dtype != p->dtype) {
        ra_set_error(RA_ERR_TYPE, "attention backward on CUDA: out/dout dtype %s must equal "
                     "q's dtype %s", ra_dtype_name(p->out_dtype), ra_dtype_name(p->dtype));
        return RA_ERR_TYPE;
    }
    const ra_dtype acc = ra_acc_dtype(p->dtype);
    if (p->grad_dtype != p->dtype && p->grad_dtype != acc) {
        ra_set_error(RA_ERR_TYPE, "attention backward: grad dtype %s must be %s or %s",
                     ra_dtype_name(p->grad_dtype), ra_dtype_name(p->dtype), ra_dtype_name(acc));
        return RA_ERR_TYPE;
    }
    if (p->accumulate && p->grad_dtype != acc) {
        ra_set_error(RA_ERR_TYPE, "attention backward: accumulated grads must be %s, got %s",
                     ra_dtype_name(acc), ra_dtype_name(p->grad_dtype));
        return RA_ERR_TYPE;
    }
    RA_CHECK(ra_check_branches(p));
    return ra_check_attn_geometry("attention backward", *p);
}

/* What the tensor-core kernels rely on (check_bwd has passed): 16-bit
 * inputs, head_dim 64/128, q/k/v/dout rows that cp.async can move in
 * 16-byte chunks, and grads stored two elements at a time. */
bool tc_supported(const ra_attn_bwd_params &p) {
    if (p.dtype != RA_FLOAT16 && p.dtype != RA_BFLOAT16) return false;
    if (p.head_dim != 64 && p.head_dim != 128) return false;
    if (p.grad_dtype != p.dtype && p.grad_dtype != RA_FLOAT32) return false;
    if (!ra_aligned(p.q, 16) || !ra_aligned(p.k, 16) || !ra_aligned(p.v, 16) ||
        !ra_aligned(p.dout, 16))
        return false;
    const int64_t s8[] = {p.q_batch_stride,    p.q_seq_stride,    p.q_head_stride,
                          p.k_batch_stride,    p.k_seq_stride,    p.k_head_stride,
                          p.v_batch_stride,    p.v_seq_stride,    p.v_head_stride,
                          p.dout_batch_stride, p.dout_seq_stride, p.dout_head_stride};
    for (int64_t x : s8)
        if (x % 8 != 0) return false;
    const unsigned gb = p.grad_dtype == RA_FLOAT32 ? 8 : 4;
    if (!ra_aligned(p.dq, gb) || !ra_aligned(p.dk, gb) || !ra_aligned(p.dv, gb)) return false;
    const int64_t s2[] = {p.dq_batch_stride, p.dq_seq_stride, p.dq_head_stride,
                          p.dk_batch_stride, p.dk_seq_stride, p.dk_head_stride,
                          p.dv_batch_stride, p.dv_seq_stride, p.dv_head_stride};
    for (int64_t x : s2)
        if (x % 2 != 0) return false;
    return true;
}

}  // namespace

extern "C" ra_status ra_cuda_attn_bwd_preprocess(const ra_attn_bwd_params *p, void *stream) {
    RA_CHECK(check_bwd(p));
    if (p->batch == 0 || p->heads == 0 || p->seqlen_q == 0) return RA_OK;
    cudaStream_t s = (cudaStream_t)stream;
    RaDeviceGuard guard;
    RA_CHECK(guard.enter_for(p->q));
    switch (p->dtype) {
    case RA_FLOAT32: return launch_delta<float>(*p, s);
    case RA_FLOAT64: return launch_delta<double>(*p, s);
    case RA_FLOAT16: return launch_delta<ra::half_t>(*p, s);
    default: return launch_delta<ra::bf16_t>(*p, s);
    }
}

extern "C" ra_status ra_cuda_attn_bwd(const ra_attn_bwd_params *p, void *stream) {
    RA_CHECK(check_bwd(p));
    if (p->batch == 0 || p->heads == 0) return RA_OK;
    RaDeviceGuard guard;
    RA_CHECK(guard.enter_for(p->q));
    cudaStream_t s = (cudaStream_t)stream;
    if (!ra_force_generic() && tc_supported(*p)) {
        bool ran = false;
        ra_family family = RA_FAMILY_SM80;
        RA_CHECK(ra_kernel_family(-1, &family));
        const bool wg = family == RA_FAMILY_SM90A && ra_bwd_wg_supported(*p);
        if (!p->deterministic) {
            if (wg) {
                RA_CHECK(ra_bwd_wg(*p, s, &ran));
                if (ran) {
                    ra_count_bwd_kernel(0);
                    return RA_OK;
                }
            }
            RA_CHECK(ra_bwd_tc_fused(*p, s, &ran));
            if (ran) {
                ra_count_bwd_kernel(1);
                return RA_OK;
            }
        } else if (wg) {
            RA_CHECK(ra_bwd_wg_dkdv(*p, s, &ran));
            if (ran) {
                ra_count_bwd_kernel(0);
                RA_CHECK(ra_bwd_wg_dq(*p, s, &ran));
                return ran ? RA_OK : ra_bwd_tc_dq(*p, s);
            }
        }
        ra_count_bwd_kernel(1);
        RA_CHECK(ra_bwd_tc_dkdv(*p, s));
        return ra_bwd_tc_dq(*p, s);
    }
    ra_count_bwd_kernel(2);
    return ra_bwd_simt(*p, s);
}
