/*
 * attn_cpu_kern.h -- internal interface between the CPU attention drivers
 * (attn_cpu_fwd.c, attn_cpu_bwd.c, attn_cpu_dilated.c) and the tile kernels
 * that are compiled once per (arithmetic type, SIMD level) in the
 * attn_cpu_isa_*.c files.
 *
 * The drivers own threads, scratch memory and the split of the problem into
 * work items; the tile kernels own the arithmetic.  Everything a tile kernel
 * reads has been packed by the driver (through the table's pack functions)
 * into "real" arrays -- float for float32/float16/bfloat16 inputs, double for
 * float64 -- padded so that the SIMD loops need no tails:
 *
 *   transposed key block  (kt, vt): D rows x RA_CPU_BK columns, zero padded
 *   row block             (kr, vr, q, dout): rows x Dp, Dp = D rounded up to
 *                         the vector width, zero padded columns
 *
 * Keys are processed in blocks of RA_CPU_BK; queries in blocks of RA_CPU_BQ
 * (forward) and RA_CPU_BQB (backward).
 */
#ifndef RA_ATTN_CPU_KERN_H
#define RA_ATTN_CPU_KERN_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attn/attn_params.h"
#include "core/half.h"

#define RA_CPU_BK 64   /* keys per block; a multiple of every vector width */
#define RA_CPU_BQ 128  /* query rows per forward work item */
#define RA_CPU_BQB 64  /* query rows per backward inner step */

#define RA_LOG2E 1.4426950408889634
#define RA_LN2 0.6931471805599453

/* One forward tile job: up to RA_CPU_BQ query rows (a strided view of q and
 * out) against all packed keys of one kv head view. */
typedef struct ra_fwd_blk {
    const void *q;          /* first query row; rows q_ss elements apart */
    int64_t q_ss;
    ra_dtype dtype;         /* of q */
    int64_t nq;             /* rows, 1..RA_CPU_BQ */
    int64_t D, Dp;
    const void *kt;         /* packed: nkb blocks of D x BK (real) */
    const void *vr;         /* packed: nkb*BK rows x Dp (real) */
    int64_t nk;             /* number of keys */
    int64_t qpos0, qpos_st, kpos0, kpos_st;
    int causal;
    double scale;
    void *out;              /* first output row; rows out_ss apart */
    int64_t out_ss;
    ra_dtype out_dtype;
    void *lse;              /* acc dtype; entries lse_ss apart */
    int64_t lse_ss;
    ra_dtype lse_dtype;
    int accumulate;         /* out/lse hold a running state to merge into */
} ra_fwd_blk;

/* One backward tile job: one key block (<= RA_CPU_BK keys) of one kv head
 * against all rows of one query head (packed).  Adds the unscaled
 * contributions dS^T Q into dk, P^T dO into dv and dS K into dq. */
typedef struct ra_bwd_blk {
    const void *q;          /* nq x Dp (real), times scale * log2(e) */
    const void *dout;       /* nq x Dp (real) */
    const void *lse2;       /* nq: lse * log2(e) (real), -inf for empty rows */
    const void *delta;      /* nq (real) */
    void *dq;               /* nq x Dp (real), accumulated into */
    int64_t nq, qpos0, qpos_st;
    const void *kt, *vt;    /* D x BK (real) */
    const void *kr;         /* BK x Dp (real) */
    int64_t nk, kpos0, kpos_st;
    void *dk, *dv;          /* BK x Dp (real), accumulated into */
    int64_t D, Dp;
    int causal;
    /* scores of one branch of dilated attention: the branches and the query
     * head, to count the branches that share a (query, key) pair; NULL for
     * plain attention */
    const ra_dilated_config *branches;
    int64_t head;
} ra_bwd_blk;

/* How many branches of `c` select both global positions qp and kp for query
 * head h (the multiplicity c_h(i, j) of DESIGN 2, "Dilated attention"). */
static inline int ra_dilated_pair_count(const ra_dilated_config *c, int64_t h,
                                        int64_t qp, int64_t kp) {
    int n = 0;
    for (int b = 0; b < c->n_branches; b++) {
        const int64_t w = c->segment_lengths[b], r = c->dilation_rates[b];
        const int64_t s = qp / w, o = h % r;
        n += kp / w == s && (qp - s * w) % r == o && (kp - s * w) % r == o;
    }
    return n;
}

typedef struct ra_cpu_kernels {
    const char *isa;
    int real_size;          /* sizeof(float) or sizeof(double) */
    int vw;                 /* reals per vector */
    size_t (*fwd_scratch)(int64_t Dp);   /* bytes per thread */
    size_t (*bwd_scratch)(int64_t Dp);
    /* n <= BK rows of src (ss elements apart) -> D x BK transposed, padded */
    void (*pack_t)(const void *src, int64_t ss, ra_dtype dt, int64_t n,
                   int64_t D, void *dst);
    /* n rows of src -> n x Dp, each value times mul, columns D..Dp zero */
    void (*pack_r)(const void *src, int64_t ss, ra_dtype dt, int64_t n,
                   int64_t D, int64_t Dp, double mul, void *dst);
    /* n x Dp (real) rows times mul -> dst rows (dst_ss apart, dtype dt),
     * added to what is there when add */
    void (*store_rows)(const void *src, int64_t n, int64_t D, int64_t Dp,
                       double mul, void *dst, int64_t dst_ss, ra_dtype dt,
                       int add);
    void (*fwd_block)(const ra_fwd_blk *fb, void *scratch);
    void (*bwd_kblock)(const ra_bwd_blk *bb, void *scratch);
} ra_cpu_kernels;

extern const ra_cpu_kernels ra_cpu_kernels_f32_avx512, ra_cpu_kernels_f32_avx2,
    ra_cpu_kernels_f32_generic, ra_cpu_kernels_f64_avx512,
    ra_cpu_kernels_f64_avx2, ra_cpu_kernels_f64_generic;

/* The table for arithmetic of `dtype` at the best SIMD level of this CPU. */
const ra_cpu_kernels *ra_cpu_kernels_for(ra_dtype dtype);

/* 1 if any rule of the mask is on (documents, window, softcap). */
int ra_cpu_mask_is_set(const ra_attn_mask *m);

/* Argument checks shared by the dense and dilated drivers (RA_OK or an
 * error with a message). */
ra_status ra_cpu_check_fwd(const ra_attn_fwd_params *p);
ra_status ra_cpu_check_bwd(const ra_attn_bwd_params *p);

/* Zero the D elements of every (b, s, h) row of a (B, S, Hx, D) array of
 * dtype dt with element strides bs, ss, hs, on nt threads. */
void ra_cpu_zero_rows(void *a, ra_dtype dt, int64_t B, int64_t S, int64_t Hx,
                      int64_t D, int64_t bs, int64_t ss, int64_t hs, int nt);

/* ---- scalar element access (packing, small helpers) -------------------- */
/* float16/bfloat16 <-> float32 scalars: half.h */
static inline double ra_cpu_ld(const void *base, int64_t idx, ra_dtype dt) {
    switch (dt) {
    case RA_FLOAT32: return ((const float *)base)[idx];
    case RA_FLOAT64: return ((const double *)base)[idx];
    case RA_FLOAT16: return ra_cpu_h2f(((const uint16_t *)base)[idx]);
    case RA_BFLOAT16: return ra_cpu_b2f(((const uint16_t *)base)[idx]);
    default: return 0.0;
    }
}

static inline void ra_cpu_st(void *base, int64_t idx, ra_dtype dt, double v) {
    switch (dt) {
    case RA_FLOAT32: ((float *)base)[idx] = (float)v; break;
    case RA_FLOAT64: ((double *)base)[idx] = v; break;
    case RA_FLOAT16: ((uint16_t *)base)[idx] = ra_cpu_f2h((float)v); break;
    case RA_BFLOAT16: ((uint16_t *)base)[idx] = ra_cpu_f2b((float)v); break;
    default: break;
    }
}

static inline const void *ra_cpu_at(const void *base, int64_t idx,
                                     ra_dtype dt) {
    return (const char *)base + idx * (int64_t)ra_dtype_size(dt);
}

static inline void *ra_cpu_atw(void *base, int64_t idx, ra_dtype dt) {
    return (char *)base + idx * (int64_t)ra_dtype_size(dt);
}

/* ceil(a / b) for a >= 0, b > 0 */
static inline int64_t ra_cpu_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* size_t product of up to four non-negative factors; 0 on overflow */
static inline size_t ra_cpu_bytes(int64_t a, int64_t b, int64_t c, int64_t d) {
    int64_t r;
    if (!ra_mul_ok(a, b, &r) || !ra_mul_ok(r, c, &r) || !ra_mul_ok(r, d, &r))
        return 0;
    return (size_t)r;
}

#endif /* RA_ATTN_CPU_KERN_H */
