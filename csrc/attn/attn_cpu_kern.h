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

/* The visibility rules as a tile kernel reads them (DESIGN 2: causal and
 * the masks of ra_attn_mask; the drivers fill it with ra_cpu_tile_mask):
 *   a query at position qp sees the keys at positions [qp - lo_off,
 *   qp + hi_off] on the sides that are bounded (causal bounds the right side
 *   at 0), and with documents only the keys whose id equals its own;
 *   softcap2 > 0 caps the scores: S -> softcap2 * tanh(S / softcap2) in the
 *   kernels' base-2 units (softcap2 = softcap * log2 e).
 * Ids are contiguous int32 runs prepared by the driver; "sorted" means
 * non-decreasing along the whole sequence (packed documents), which lets a
 * kernel find a document's rows by binary search. */
typedef struct ra_tile_mask {
    int has_lo, has_hi;
    int64_t lo_off, hi_off;
    const int32_t *q_ids;   /* the tile's query rows, or NULL: no documents */
    const int32_t *kv_ids;  /* the tile's keys */
    /* forward: the smallest and largest id of each key block (of BK keys,
     * counted from the tile's first key) */
    const int32_t *kv_block_min, *kv_block_max;
    int q_sorted, kv_sorted;
    double softcap2;
} ra_tile_mask;

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
    ra_tile_mask m;         /* causal and masks */
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
    ra_tile_mask m;         /* causal and masks; kv_ids: the block's keys */
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

/* The position bounds and the softcap of a tile mask from causal and the
 * params' mask; ids stay NULL (the drivers point them per tile). */
void ra_cpu_tile_mask(int causal, const ra_attn_mask *mask, ra_tile_mask *m);

/* Document ids of a kernel call as the tiles read them: contiguous int32
 * copies of the q and kv ids, "sorted" per batch row, and the smallest and
 * largest kv id of every block of RA_CPU_BK keys.  One allocation. */
typedef struct ra_cpu_ids {
    int32_t *q, *kv;             /* (B, S_q), (B, S_k) */
    int32_t *kv_min, *kv_max;    /* (B, nkb) */
    int32_t *q_sorted, *kv_sorted;  /* (B) */
    int64_t nkb;
    size_t bytes;
} ra_cpu_ids;

/* Fill *ids from the mask (ids->q == NULL without documents). */
ra_status ra_cpu_ids_prepare(const ra_attn_mask *mask, int64_t B, int64_t Sq,
                             int64_t Sk, ra_cpu_ids *ids);
void ra_cpu_ids_free(ra_cpu_ids *ids);

/* Point the tile mask at batch row b's ids: the query rows from i0, the
 * keys from j0 (forward: j0 = 0 with the block ranges; backward: the key
 * block). */
void ra_cpu_tile_ids(const ra_cpu_ids *ids, int64_t b, int64_t Sq, int64_t Sk,
                     int64_t i0, int64_t j0, ra_tile_mask *m);

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
    case RA_FLOAT16: ((uint16_t *)base)[idx] = ra_cpu_d2h(v); break;
    case RA_BFLOAT16: ((uint16_t *)base)[idx] = ra_cpu_d2b(v); break;
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

/* ---- positions: saturating int64 arithmetic, so that any offsets and
 * window sides give the right answer rather than wrap ---------------- */
static inline int64_t ra_sat_add(int64_t a, int64_t b) {
    int64_t r;
    if (__builtin_add_overflow(a, b, &r)) return b > 0 ? INT64_MAX : INT64_MIN;
    return r;
}

static inline int64_t ra_sat_sub(int64_t a, int64_t b) {
    int64_t r;
    if (__builtin_sub_overflow(a, b, &r)) return b < 0 ? INT64_MAX : INT64_MIN;
    return r;
}

/* Of the n positions p0, p0 + st, p0 + 2 st, ... (st >= 1): how many are
 * <= P, and the index of the first that is >= P (n if none). */
static inline int64_t ra_count_le(int64_t P, int64_t p0, int64_t st,
                                  int64_t n) {
    if (P < p0) return 0;
    const int64_t c = ra_sat_sub(P, p0) / st;
    return c >= n ? n : c + 1;
}

static inline int64_t ra_first_ge(int64_t P, int64_t p0, int64_t st,
                                  int64_t n) {
    if (P <= p0) return 0;
    const int64_t c = (ra_sat_sub(P, p0) - 1) / st + 1;
    return c < n ? c : n;
}

/* The keys (first at position kp0, stride kst, n of them) that a query at
 * position qp may see under the bounds of m: [*lo, *hi), narrowed. */
static inline void ra_row_limits(const ra_tile_mask *m, int64_t qp,
                                 int64_t kp0, int64_t kst, int64_t n,
                                 int64_t *lo, int64_t *hi) {
    if (m->has_lo) {
        const int64_t a = ra_first_ge(ra_sat_sub(qp, m->lo_off), kp0, kst, n);
        if (a > *lo) *lo = a;
    }
    if (m->has_hi) {
        const int64_t b = ra_count_le(ra_sat_add(qp, m->hi_off), kp0, kst, n);
        if (b < *hi) *hi = b;
    }
}

/* The rows (first at position qp0, stride qst, n of them) that may see a
 * key at positions [kfirst, klast]: [*r0, *r1). */
static inline void ra_rows_seeing(const ra_tile_mask *m, int64_t kfirst,
                                  int64_t klast, int64_t qp0, int64_t qst,
                                  int64_t n, int64_t *r0, int64_t *r1) {
    *r0 = m->has_hi ? ra_first_ge(ra_sat_sub(kfirst, m->hi_off), qp0, qst, n)
                    : 0;
    *r1 = m->has_lo ? ra_count_le(ra_sat_add(klast, m->lo_off), qp0, qst, n)
                    : n;
}

/* ---- document ids ------------------------------------------------------ */
/* smallest and largest of ids[0..n) (n >= 1); O(1) when sorted */
static inline void ra_ids_range(const int32_t *ids, int64_t n, int sorted,
                                int32_t *lo, int32_t *hi) {
    if (sorted) {
        *lo = ids[0];
        *hi = ids[n - 1];
        return;
    }
    int32_t a = ids[0], b = ids[0];
    for (int64_t i = 1; i < n; i++) {
        a = ids[i] < a ? ids[i] : a;
        b = ids[i] > b ? ids[i] : b;
    }
    *lo = a;
    *hi = b;
}

/* In sorted ids[lo..hi): the first index whose id is >= x (upper = 0) or
 * > x (upper = 1); hi if none. */
static inline int64_t ra_ids_search(const int32_t *ids, int64_t lo, int64_t hi,
                                    int32_t x, int upper) {
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (ids[mid] < x || (upper && ids[mid] == x)) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Narrow [*lo, *hi) of sorted ids to the indices whose id is in [a, b]. */
static inline void ra_ids_narrow(const int32_t *ids, int32_t a, int32_t b,
                                 int64_t *lo, int64_t *hi) {
    if (*lo >= *hi) return;
    *lo = ra_ids_search(ids, *lo, *hi, a, 0);
    *hi = ra_ids_search(ids, *lo, *hi, b, 1);
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
