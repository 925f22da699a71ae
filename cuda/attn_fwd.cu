/*
 * attn_fwd.cu -- ra_cuda_attn_fwd: checks what every forward kernel relies
 * on, then picks a tensor-core kernel (float16/bfloat16, head_dim 64/128,
 * 16-byte aligned rows): the wgmma/TMA one (hopper/attn_fwd_wg.cu) where
 * the device's family is sm90a (attn_family.cu) and tensor maps can
 * describe q, k, v, else the mma.sync one (attn_fwd_tc.cu); or the
 * generic SIMT kernel (all dtypes, head_dim 1..256; attn_fwd_simt.cu).
 * RINGATTN_CUDA_GENERIC=1 forces the generic kernel (for tests that
 * compare them), RINGATTN_CUDA_KERNELS=sm80 the mma.sync family.
 *
 * q, out: (B, S_q, H, D); k, v: (B, S_k, H_kv, D); lse: (B, H, S_q) acc dtype.
 */
#include "attn_kernels.cuh"

extern "C" ra_status ra_cuda_attn_fwd(const ra_attn_fwd_params *p, void *stream) {
    RA_CHECK(ra_check_attn_dtype("attention", p->dtype));
    const ra_dtype acc = ra_acc_dtype(p->dtype);
    if (p->out_dtype != p->dtype && p->out_dtype != acc) {
        ra_set_error(RA_ERR_TYPE, "attention: out dtype %s must be %s or %s",
                     ra_dtype_name(p->out_dtype), ra_dtype_name(p->dtype), ra_dtype_name(acc));
        return RA_ERR_TYPE;
    }
    if (p->accumulate && p->out_dtype != acc) {
        ra_set_error(RA_ERR_TYPE, "attention: a running state (accumulate) must be %s, got %s",
                     ra_dtype_name(acc), ra_dtype_name(p->out_dtype));
        return RA_ERR_TYPE;
    }
    RA_CHECK(ra_check_attn_geometry("attention", *p));
    if (p->batch == 0 || p->heads == 0 || p->seqlen_q == 0) return RA_OK;
    cudaStream_t s = (cudaStream_t)stream;
    RaDeviceGuard guard;
    RA_CHECK(guard.enter_for(p->q));
    if (!ra_force_generic() && ra_fwd_tc_supported(*p)) {
        ra_family family = RA_FAMILY_SM80;
        RA_CHECK(ra_kernel_family(-1, &family));
        if (family == RA_FAMILY_SM90A && ra_fwd_wg_supported(*p)) {
            bool ran = false;
            RA_CHECK(ra_fwd_wg(*p, s, &ran));
            if (ran) {
                ra_count_fwd_kernel(0);
                return RA_OK;
            }
        }
        ra_count_fwd_kernel(1);
        return ra_fwd_tc(*p, s);
    }
    ra_count_fwd_kernel(2);
    return ra_fwd_simt(*p, s);
}
