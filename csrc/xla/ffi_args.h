/*
 * ffi_args.h -- what the attention handlers share: the q/k/v checks, the
 * position pieces of a ring block, and the dense strides of XLA's buffers.
 *
 * Positions.  Without a position operand a call is local attention: query
 * row i sits at S_k - S_q + i and key j at j (bottom-right alignment).  A
 * ring block passes a (P, 3) int64 operand instead, rows (length, start,
 * stride): the first `q_pieces` rows cut q's rows into runs of affine
 * positions (start + stride * i), the others cut k's rows the same way
 * (contiguous shards are one run, zigzag shards two, striped one with
 * stride p).  It is an operand, not an attribute, because inside
 * shard_map the rank is only known when the program runs.
 */
#ifndef RA_XLA_FFI_ARGS_H
#define RA_XLA_FFI_ARGS_H

#include "attn/attn_params.h"
#include "xla/ffi_frame.h"

#define RA_XLA_MAX_PIECES 8

typedef struct ra_xla_qkv {
    int64_t B, Sq, Sk, H, Hkv, D;
    ra_dtype dtype, acc;
} ra_xla_qkv;

/* q (B, S_q, H, D); k, v (B, S_k, H_kv, D); one float dtype; H % H_kv == 0. */
ra_status ra_xla_check_qkv(const ra_xla_tensor *q, const ra_xla_tensor *k,
                           const ra_xla_tensor *v, ra_xla_qkv *d);
/* t: (B, S_q, H, D) of dtype `want` or `alt` (pass want twice for one). */
ra_status ra_xla_check_rows(const ra_xla_tensor *t, const ra_xla_qkv *d,
                            int64_t S, int64_t heads, ra_dtype want,
                            ra_dtype alt);
/* t: (B, H, S_q) in the acc dtype. */
ra_status ra_xla_check_bhs(const ra_xla_tensor *t, const ra_xla_qkv *d);
/* Two tensors of one shape (an aliased input and its result). */
ra_status ra_xla_check_alias(const ra_xla_tensor *in, const ra_xla_tensor *out);

/* Common attributes: causal, scale (default 1/sqrt(D)), num_threads, the
 * window and softcap (into mask, whose id pointers each block sets) and
 * whether segment id operands follow (has_ids). */
typedef struct ra_xla_opts {
    int causal;
    double scale;
    int num_threads;
    ra_attn_mask mask;
    int has_ids;
} ra_xla_opts;
ra_status ra_xla_read_opts(const ra_xla_call *c, int64_t D, ra_xla_opts *o);

/* RA_ERR_VALUE if any mask attribute was given (dilated attention). */
ra_status ra_xla_no_masks(const ra_xla_opts *o);
/* The optional operands after the `base` ones, checked: the positions
 * (pos->data NULL when absent; *nq from q_pieces) and, with o->has_ids,
 * the two segment id operands into ids[0..1], int32 (B, S_q) and
 * (B, S_k).  ref is the result that fixes the leading dims; l->folded is
 * cleared when the ids do not fold into the batch. */
ra_status ra_xla_optional_args(const ra_xla_call *c, int base,
                               const ra_xla_opts *o, const ra_xla_qkv *d,
                               const ra_xla_tensor *ref, ra_xla_lead *l,
                               ra_xla_tensor *pos, int *nq,
                               ra_xla_tensor *ids);
/* mask with its id pointers set for a block of q rows from q_off and k
 * rows from k_off (ids: the call's two id operands at this leading index,
 * NULL without ids). */
void ra_xla_block_mask(ra_attn_mask *mask, const ra_xla_opts *o,
                       const int32_t *q_ids, const int32_t *kv_ids,
                       const ra_xla_qkv *d, int64_t q_off, int64_t k_off);

typedef struct ra_xla_piece {
    int64_t off, len;           /* local rows [off, off + len) */
    int64_t start, stride;      /* their positions start + stride * i */
} ra_xla_piece;

typedef struct ra_xla_pieces {
    int nq, nk;
    ra_xla_piece q[RA_XLA_MAX_PIECES], k[RA_XLA_MAX_PIECES];
} ra_xla_pieces;

/* The position operand (argument i), checked once per call: *pos set, and
 * *nq from the q_pieces attribute.  Absent (fewer arguments): pos->data NULL. */
ra_status ra_xla_positions_arg(const ra_xla_call *c, int i,
                               const ra_xla_tensor *ref, ra_xla_tensor *pos,
                               int *nq);
/* The pieces of leading index idx (pos->data NULL: local attention). */
ra_status ra_xla_load_pieces(const ra_xla_call *c, const ra_xla_tensor *pos,
                             int nq, const ra_xla_lead *l, int64_t idx,
                             int64_t Sq, int64_t Sk, ra_xla_pieces *pp);

/* One kernel call: q rows [q_off, q_off + nq) at positions q_start +
 * q_stride * i, against k/v rows [k_off, k_off + nk) at k_start +
 * k_stride * j. */
typedef struct ra_xla_block {
    int64_t q_off, nq, q_start, q_stride;
    int64_t k_off, nk, k_start, k_stride;
} ra_xla_block;

#define RA_XLA_MAX_BLOCKS (RA_XLA_MAX_PIECES * RA_XLA_MAX_PIECES)

/* The kernel calls that merge a call's pieces into a running state: one
 * per (q piece, k piece) pair that has a visible key, trimmed to the query
 * rows that see a key of the piece and the keys some row sees (by causal
 * masking and the window); pairs empty or that nothing can see are left
 * out, costing nothing.  Returns how many blocks it wrote. */
int ra_xla_state_blocks(const ra_xla_pieces *pp, const ra_xla_opts *o,
                        ra_xla_block *blocks);
/* A call over a single pair of pieces without a running state: one block
 * of every row (what ringattn.attention runs). */
int ra_xla_single_block(const ra_xla_pieces *pp, ra_xla_block *block);

#endif /* RA_XLA_FFI_ARGS_H */
