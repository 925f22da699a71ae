/*
 * attn_fwd.cu -- ra_cuda_attn_fwd: checks what every forward kernel relies
 * on, then picks the tensor-core kernel (float16/bfloat16, head_dim 64/128,
 * 16-byte aligned rows; attn_fwd_tc.cu) or the generic SIMT kernel (all
 * dtypes, head_dim 1..256; attn_fwd_simt.cu).  RINGATTN_CUDA_GENERIC=1
 * forces the generic kernel (for tests that compare the two).
 *
 * q, out: (B, S_q, H, D); k, v: (B, S_k, H_kv, D); lse: (B, H, S_q) acc dtype.
 */
#include <stdlib.h>
#include <string.h>

#include "attn_kernels.cuh"

static bool force_generic(void) {
    const char *env = getenv("RINGATTN_CUDA_GENERIC");
    return env != NULL && strcmp(env, "1") == 0;
}

extern "C" ra_status ra_cuda_attn_fwd(const ra_attn_fwd_params *p, void *stream) {
    if (p->dtype != RA_FLOAT32 && p->dtype != RA_FLOAT64 &&
        p->dtype != RA_FLOAT16 && p->dtype != RA_BFLOAT16) {
        ra_set_error(RA_ERR_TYPE, "attention: unsupported dtype %s", ra_dtype_name(p->dtype));
        return RA_ERR_TYPE;
    }
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
    if (p->head_dim < 1 || p->head_dim > RA_MAX_HEAD_DIM) {
        ra_set_error(RA_ERR_VALUE, "attention: head_dim %lld outside [1, %d] on CUDA",
                     (long long)p->head_dim, RA_MAX_HEAD_DIM);
        return RA_ERR_VALUE;
    }
    if (p->heads_kv < 1 || p->heads % p->heads_kv != 0) {
        ra_set_error(RA_ERR_VALUE, "attention: heads %lld not a multiple of kv heads %lld",
                     (long long)p->heads, (long long)p->heads_kv);
        return RA_ERR_VALUE;
    }
    if (p->causal && (p->q_pos_stride < 1 || p->k_pos_stride < 1)) {
        ra_set_error(RA_ERR_VALUE, "attention: position strides must be >= 1");
        return RA_ERR_VALUE;
    }
    if (p->batch == 0 || p->heads == 0 || p->seqlen_q == 0) return RA_OK;
    cudaStream_t s = (cudaStream_t)stream;
    RaDeviceGuard guard;
    RA_CHECK(guard.enter_for(p->q));
    if (!force_generic() && ra_fwd_tc_supported(*p)) return ra_fwd_tc(*p, s);
    return ra_fwd_simt(*p, s);
}
