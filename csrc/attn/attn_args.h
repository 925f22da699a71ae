/*
 * attn_args.h -- argument checks shared by the attention entry points
 * (attn_api.c: forward, dilated; attn_api_bwd.c: backward, merge).  Each
 * check raises a Python exception naming the argument with the expected and
 * the actual value, and returns -1.
 */
#ifndef RA_ATTN_ARGS_H
#define RA_ATTN_ARGS_H

#include "attn/attn_params.h"
#include "core/buffer.h"

typedef struct {
    const char *name;
    ra_buffer *buf; /* owned reference */
} tensor_arg;

/* q/k/v checks shared by forward and backward; fills the sizes. */
typedef struct {
    int64_t B, Sq, Sk, H, Hkv, D;
    ra_dtype dtype;
    int device_type, device_id;
} qkv_dims;

extern const char *BSHD; /* "(batch, seq, heads, head_dim)" */
extern const char *BHS;  /* "(batch, heads, seq_q)" */

void release_args(tensor_arg *a, int n);
int dtype_error(const char *name, ra_buffer *b);   /* not a float dtype */
/* TypeError "name: expected <expected>, got <b's dtype>"; -1 */
int dtype_error_expecting(const char *name, ra_buffer *b,
                          const char *expected);
int load_tensor(tensor_arg *a, PyObject *obj, const char *name, int ndim,
                const char *dims_doc);  /* copies a strided last dim */
int load_output(tensor_arg *a, PyObject *obj, const char *name, int ndim,
                const char *dims_doc);  /* refuses a strided last dim */
/* swap a->buf for a compact (row-major) copy of itself; -1 on error */
int replace_with_copy(tensor_arg *a);
int check_same_dtype(tensor_arg *ref, tensor_arg *a);
int check_same_device(tensor_arg *ref, tensor_arg *a);
int check_dim(tensor_arg *a, int dim, const char *what, int64_t want,
              const char *source);
int check_writable(tensor_arg *a);
int check_shape3(tensor_arg *a, int64_t d0, int64_t d1, int64_t d2,
                 const char *doc);
int check_shape4_like(tensor_arg *a, tensor_arg *ref);
int check_acc_dtype(tensor_arg *a, ra_dtype want, const char *why);
/* dims of a (B, S, H, D) row tensor such as out or dout, for checks of
 * the (B, H, S) tensors that go with it: S_k = 0, H_kv = H, dtype as given */
void dims_of_rows(const ra_buffer *rows, ra_dtype dtype, qkv_dims *d);
int check_qkv(tensor_arg *q, tensor_arg *k, tensor_arg *v, qkv_dims *d);
int parse_scale(PyObject *obj, int64_t D, double *scale);
/* num_threads keyword: None (or absent) and 0 are the default, else
 * ra_check_num_threads' range; -1 with TypeError / ValueError. */
int parse_num_threads(PyObject *obj, int *num_threads);
/* b as the params see it (NULL: an unused tensor) */
ra_view view_of(const ra_buffer *b);
/* what the kernel call takes besides its tensors (attn_params.h) */
ra_attn_call call_of(const qkv_dims *d, double scale, int causal,
                     const int64_t pos[4], const ra_attn_mask *mask,
                     int accumulate, int num_threads);
/* q_pos_offset, q_pos_stride, k_pos_offset, k_pos_stride (NULL or None:
 * the defaults, q's bottom-right aligned) -> out, bounded by
 * ra_check_positions; -1 with ValueError / TypeError naming the keyword. */
int parse_positions(PyObject *qoff, PyObject *qstride, PyObject *koff,
                    PyObject *kstride, const qkv_dims *d, int64_t out[4]);
/* positions of a dilated call (stride 1; q offset 0 by default; S_q must
 * equal S_k unless offsets are given) -- and dilated attention runs on the
 * CPU only: a CUDA input is refused here, before any work.  -1 on error. */
int parse_dilated_positions(PyObject *qoff, PyObject *koff, const qkv_dims *d,
                            int64_t out[4]);
ra_buffer *alloc_out(int ndim, const int64_t *shape, ra_dtype t,
                     const qkv_dims *d, int zero);
/* 3-d (B, H, S_q) acc-dtype tensor such as lse or delta */
int load_bhs(tensor_arg *a, PyObject *obj, const char *name, const qkv_dims *d,
             int writable);

/* The mask keywords of attn_fwd / attn_bwd as Python passed them (NULL or
 * None when absent); attn_mask_args.c. */
typedef struct {
    PyObject *segment_ids, *kv_segment_ids, *window, *softcap;
} mask_kwargs;
/* Check them against q/k/v's dims and fill *m (zeroed first: no mask).
 * ids[0], ids[1] receive the int32 q and kv ids (owned; the caller releases
 * them after the kernel ran).  -1 with the named exception on bad input. */
int parse_masks(const mask_kwargs *kw, const qkv_dims *d, tensor_arg ids[2],
                ra_attn_mask *m);
/* 1 if any rule of *m is on */
int mask_is_set(const ra_attn_mask *m);

/* segment_lengths / dilation_rates -> config (ValueError on bad values) */
int ra_parse_dilated(PyObject *segs, PyObject *rates, ra_dilated_config *cfg);

/* The CUDA launchers the entry points dispatch to. */
typedef enum {
    RA_CUDA_FWD,      /* ra_attn_fwd_params */
    RA_CUDA_BWD_PRE,  /* ra_attn_bwd_params */
    RA_CUDA_BWD,      /* ra_attn_bwd_params */
    RA_CUDA_MERGE,    /* ra_merge_params */
    RA_CUDA_STATE,    /* ra_state_params */
    RA_CUDA_DILATED_FWD, /* ra_dilated_call of ra_attn_fwd_params */
    RA_CUDA_DILATED_BWD  /* ra_dilated_call of ra_attn_bwd_params */
} ra_cuda_op;

/* a dilated attention call: the params and the branches */
typedef struct ra_dilated_call {
    const void *params;
    const ra_dilated_config *cfg;
} ra_dilated_call;

/* (out, lse) := (0, -inf) over (B, S, H, D) / (B, H, S) */
typedef struct ra_state_params {
    void *out, *lse;
    ra_dtype acc;
    int64_t batch, seqlen, heads, head_dim;
    int64_t out_batch_stride, out_seq_stride, out_head_stride;
    int64_t lse_batch_stride, lse_head_stride, lse_seq_stride;
} ra_state_params;

/* Run one launcher on `device`'s compute stream with the GIL released, the
 * device made current around it.  Without CUDA: RA_ERR_UNSUPPORTED. */
ra_status ra_cuda_run(int device, ra_cuda_op op, const void *params);

#endif
