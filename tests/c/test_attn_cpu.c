/*
 * test_attn_cpu.c -- standalone harness for the CPU attention kernels
 * (csrc/attn/attn_cpu_*.c): checks forward, backward (preprocess + main), merge
 * and dilated attention against a naive double-precision reference on
 * random inputs of odd sizes, layouts and dtypes; and times the float32
 * kernels (`bench` mode).
 *
 *   ./test_attn_cpu            correctness grid (exit status 1 on failure)
 *   ./test_attn_cpu quick      a small grid (for sanitizers / valgrind)
 *   ./test_attn_cpu bench [S]  GFLOP/s of forward and backward, B=1 H=8 D=64
 *
 * The reference is written as "attention with a count bias": score (i, j)
 * of head h gets log c(i, j), c = number of branches selecting the pair
 * (dense: 1 where visible, 0 where masked).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn/attn_cpu.h"
#include "attn/attn_cpu_kern.h"

/* ---- random numbers ---------------------------------------------------- */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double urand(void) { /* [-1, 1) */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 4503599627370496.0 - 1.0;
}

/* ---- strided tensors --------------------------------------------------- */
/* A (B, S, H, D) tensor with a chosen layout; `bs, ss, hs` in elements. */
typedef struct tensor {
    void *data;
    size_t bytes;
    ra_dtype dt;
    int64_t B, S, H, D, bs, ss, hs;
} tensor;

/* layout 0: contiguous BSHD; 1: BHSD (head-major); 2: padded seq stride,
 * reversed batch order in memory (non-monotone strides) */
static tensor t_make(ra_dtype dt, int64_t B, int64_t S, int64_t H, int64_t D,
                     int layout) {
    tensor t = {0};
    t.dt = dt; t.B = B; t.S = S; t.H = H; t.D = D;
    int64_t n;
    if (layout == 1) {
        t.ss = D; t.hs = S * D; t.bs = H * S * D; n = B * H * S * D;
    } else if (layout == 2) {
        t.hs = D + 3; t.ss = H * (D + 3) + 5; t.bs = S * t.ss + 7;
        n = B * t.bs;
    } else {
        t.hs = D; t.ss = H * D; t.bs = S * H * D; n = B * S * H * D;
    }
    t.bytes = (size_t)(n > 0 ? n : 1) * ra_dtype_size(dt);
    t.data = calloc(1, t.bytes);
    if (layout == 2 && B > 1) {
        /* batch b at offset (B-1-b)*bs: point data at the last batch */
        t.bs = -t.bs;
    }
    return t;
}
static int64_t t_base(const tensor *t) { return t->bs < 0 ? -(t->B - 1) * t->bs : 0; }
static int64_t t_idx(const tensor *t, int64_t b, int64_t s, int64_t h, int64_t d) {
    return t_base(t) + b * t->bs + s * t->ss + h * t->hs + d;
}
static double t_get(const tensor *t, int64_t b, int64_t s, int64_t h, int64_t d) {
    return ra_cpu_ld(t->data, t_idx(t, b, s, h, d), t->dt);
}
static void t_set(tensor *t, int64_t b, int64_t s, int64_t h, int64_t d, double v) {
    ra_cpu_st(t->data, t_idx(t, b, s, h, d), t->dt, v);
}
static void t_rand(tensor *t, double amp) {
    for (int64_t b = 0; b < t->B; b++)
        for (int64_t s = 0; s < t->S; s++)
            for (int64_t h = 0; h < t->H; h++)
                for (int64_t d = 0; d < t->D; d++) t_set(t, b, s, h, d, amp * urand());
}
static void *t_ptr(const tensor *t) {
    return (char *)t->data + t_base(t) * (int64_t)ra_dtype_size(t->dt);
}
static void t_free(tensor *t) { free(t->data); t->data = NULL; }

/* lse-like (B, H, S) arrays: contiguous, acc dtype, stored as tensor with
 * D = 1 and H/S swapped in the stride sense */
typedef struct rowvec {
    void *data;
    ra_dtype dt;
    int64_t B, H, S, bs, hs, ss;
} rowvec;
static rowvec r_make(ra_dtype dt, int64_t B, int64_t H, int64_t S, int odd) {
    rowvec r = {0};
    r.dt = dt; r.B = B; r.H = H; r.S = S;
    if (odd) { r.ss = 2; r.hs = 2 * S + 1; r.bs = H * r.hs + 3; }
    else { r.ss = 1; r.hs = S; r.bs = H * S; }
    r.data = calloc((size_t)(B * (r.bs > 0 ? r.bs : 1) + 4), ra_dtype_size(dt));
    return r;
}
static double r_get(const rowvec *r, int64_t b, int64_t h, int64_t s) {
    return ra_cpu_ld(r->data, b * r->bs + h * r->hs + s * r->ss, r->dt);
}
static void r_set(rowvec *r, int64_t b, int64_t h, int64_t s, double v) {
    ra_cpu_st(r->data, b * r->bs + h * r->hs + s * r->ss, r->dt, v);
}

/* ---- selection counts (dense or dilated) -------------------------------- */
typedef struct problem {
    int64_t B, Sq, Sk, H, Hkv, D;
    int causal;
    int64_t qoff, qst, koff, kst;
    double scale;
    const ra_dilated_config *cfg;  /* NULL: dense */
} problem;

static int pair_count(const problem *pb, int64_t h, int64_t i, int64_t j) {
    int64_t pq = pb->qoff + i * pb->qst, pk = pb->koff + j * pb->kst;
    if (pb->causal && pk > pq) return 0;
    if (pb->cfg == NULL) return 1;
    int c = 0;
    for (int br = 0; br < pb->cfg->n_branches; br++) {
        int64_t w = pb->cfg->segment_lengths[br], r = pb->cfg->dilation_rates[br];
        int64_t o = h % r;
        if (pq / w != pk / w) continue;
        if ((pq % w) % r == o && (pk % w) % r == o) c++;
    }
    return c;
}

/* reference forward of one (b, h, i) row: lse and out row (double) */
static double ref_row(const problem *pb, const tensor *q, const tensor *k,
                      const tensor *v, int64_t b, int64_t h, int64_t i,
                      double *orow, double *srow) {
    int64_t g = h / (pb->H / pb->Hkv);
    double m = -INFINITY;
    for (int64_t j = 0; j < pb->Sk; j++) {
        int c = pair_count(pb, h, i, j);
        if (c == 0) { srow[j] = -INFINITY; continue; }
        double s = 0;
        for (int64_t d = 0; d < pb->D; d++)
            s += t_get(q, b, i, h, d) * t_get(k, b, j, g, d);
        srow[j] = s * pb->scale + log((double)c);
        if (srow[j] > m) m = srow[j];
    }
    for (int64_t d = 0; d < pb->D; d++) orow[d] = 0;
    if (m == -INFINITY) return -INFINITY;
    double l = 0;
    for (int64_t j = 0; j < pb->Sk; j++) {
        if (srow[j] == -INFINITY) continue;
        double p = exp(srow[j] - m);
        l += p;
        for (int64_t d = 0; d < pb->D; d++) orow[d] += p * t_get(v, b, j, g, d);
    }
    for (int64_t d = 0; d < pb->D; d++) orow[d] /= l;
    return m + log(l);
}

/* ---- error bookkeeping ------------------------------------------------- */
typedef struct erracc { double maxerr, maxref; long nan; } erracc;
static void ea_add(erracc *e, double got, double ref) {
    if (isnan(got)) { e->nan++; return; }
    if (isinf(ref) || isinf(got)) {
        if (got != ref) e->nan++;
        return;
    }
    double d = fabs(got - ref);
    if (d > e->maxerr) e->maxerr = d;
    if (fabs(ref) > e->maxref) e->maxref = fabs(ref);
}
static double ea_rel(const erracc *e) { return e->nan ? INFINITY : e->maxerr / (e->maxref > 1e-2 ? e->maxref : 1e-2); }

static double tol_for(ra_dtype dt, int grad) {
    switch (dt) {
    case RA_FLOAT64: return 1e-10;
    case RA_FLOAT32: return grad ? 2e-4 : 3e-5;
    case RA_FLOAT16: return grad ? 4e-3 : 2e-3;
    default: return grad ? 3e-2 : 1.6e-2;
    }
}

static int n_fail = 0, n_cases = 0;

/* ---- one forward + backward case ---------------------------------------- */
static void run_case(ra_dtype dt, problem pb, int layout, int accumulate,
                     int out_acc, int nthreads) {
    const ra_dtype acc = ra_acc_dtype(dt);
    const ra_dtype od = (accumulate || out_acc) ? acc : dt;
    const int64_t B = pb.B, Sq = pb.Sq, Sk = pb.Sk, H = pb.H, Hkv = pb.Hkv, D = pb.D;
    tensor q = t_make(dt, B, Sq, H, D, layout), k = t_make(dt, B, Sk, Hkv, D, (layout + 1) % 3);
    tensor v = t_make(dt, B, Sk, Hkv, D, layout), out = t_make(od, B, Sq, H, D, layout);
    tensor dout = t_make(od, B, Sq, H, D, (layout + 2) % 3);
    rowvec lse = r_make(acc, B, H, Sq, layout == 2), delta = r_make(acc, B, H, Sq, layout == 2);
    t_rand(&q, 2.0); t_rand(&k, 2.0); t_rand(&v, 1.0); t_rand(&dout, 1.0);
    double *refo = malloc(sizeof(double) * (size_t)(B * Sq * H * D + 1));
    double *refl = malloc(sizeof(double) * (size_t)(B * Sq * H + 1));
    double *srow = malloc(sizeof(double) * (size_t)(Sk + 1));
    double *orow = malloc(sizeof(double) * (size_t)(D + 1));

    /* initial running state for accumulate mode: some rows empty */
    if (accumulate) {
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < Sq; i++) {
                    int empty = (i % 3) == 1;
                    r_set(&lse, b, h, i, empty ? -INFINITY : 3.0 * urand());
                    for (int64_t d = 0; d < D; d++)
                        t_set(&out, b, i, h, d, empty ? 0.0 : urand());
                }
    }
    /* reference (merged with the old state if accumulating) */
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < Sq; i++) {
                double l = ref_row(&pb, &q, &k, &v, b, h, i, orow, srow);
                double *ro = refo + ((b * Sq + i) * H + h) * D;
                if (accumulate) {
                    double l0 = r_get(&lse, b, h, i), m = l0 > l ? l0 : l;
                    if (m == -INFINITY) {
                        for (int64_t d = 0; d < D; d++) ro[d] = 0;
                        l = -INFINITY;
                    } else {
                        double e0 = exp(l0 - m), e1 = exp(l - m);
                        for (int64_t d = 0; d < D; d++)
                            ro[d] = (e0 * t_get(&out, b, i, h, d) + e1 * orow[d]) / (e0 + e1);
                        l = m + log(e0 + e1);
                    }
                } else {
                    for (int64_t d = 0; d < D; d++) ro[d] = orow[d];
                }
                refl[(b * H + h) * Sq + i] = l;
            }

    ra_attn_fwd_params fp = {0};
    fp.q = t_ptr(&q); fp.k = t_ptr(&k); fp.v = t_ptr(&v); fp.out = t_ptr(&out);
    fp.lse = lse.data; fp.dtype = dt; fp.out_dtype = od;
    fp.batch = B; fp.seqlen_q = Sq; fp.seqlen_k = Sk; fp.heads = H; fp.heads_kv = Hkv;
    fp.head_dim = D;
    fp.q_batch_stride = q.bs; fp.q_seq_stride = q.ss; fp.q_head_stride = q.hs;
    fp.k_batch_stride = k.bs; fp.k_seq_stride = k.ss; fp.k_head_stride = k.hs;
    fp.v_batch_stride = v.bs; fp.v_seq_stride = v.ss; fp.v_head_stride = v.hs;
    fp.out_batch_stride = out.bs; fp.out_seq_stride = out.ss; fp.out_head_stride = out.hs;
    fp.lse_batch_stride = lse.bs; fp.lse_head_stride = lse.hs; fp.lse_seq_stride = lse.ss;
    fp.scale = pb.scale; fp.causal = pb.causal;
    fp.q_pos_offset = pb.qoff; fp.q_pos_stride = pb.qst;
    fp.k_pos_offset = pb.koff; fp.k_pos_stride = pb.kst;
    fp.accumulate = accumulate; fp.num_threads = nthreads;
    ra_status st = pb.cfg ? ra_cpu_dilated_fwd(&fp, pb.cfg) : ra_cpu_attn_fwd(&fp);
    erracc eo = {0}, el = {0};
    if (st != RA_OK) { printf("  fwd status %d: %s\n", st, ra_last_error()); eo.nan = 1; }
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < Sq; i++) {
                ea_add(&el, r_get(&lse, b, h, i), refl[(b * H + h) * Sq + i]);
                for (int64_t d = 0; d < D; d++)
                    ea_add(&eo, t_get(&out, b, i, h, d), refo[((b * Sq + i) * H + h) * D + d]);
            }
    double tol = tol_for(dt, 0);
    if (od != dt) tol = tol_for(acc, 0);
    int ok = ea_rel(&eo) <= tol && ea_rel(&el) <= tol_for(acc, 0) * 4;

    /* ---- backward (non-accumulating forward state only) ---- */
    erracc eq = {0}, ek = {0}, ev = {0}, ed = {0};
    if (!accumulate) {
        int gacc = (layout == 1);   /* accumulate into acc-dtype grads */
        ra_dtype gd = (gacc || out_acc) ? acc : dt;
        tensor dq = t_make(gd, B, Sq, H, D, (layout + 1) % 3), dk = t_make(gd, B, Sk, Hkv, D, layout);
        tensor dv = t_make(gd, B, Sk, Hkv, D, (layout + 2) % 3);
        if (gacc) { t_rand(&dq, 1.0); t_rand(&dk, 1.0); t_rand(&dv, 1.0); }
        double *rq = calloc((size_t)(B * Sq * H * D + 1), sizeof(double));
        double *rk = calloc((size_t)(B * Sk * Hkv * D + 1), sizeof(double));
        double *rv = calloc((size_t)(B * Sk * Hkv * D + 1), sizeof(double));
        for (int64_t b = 0; b < B; b++)
            for (int64_t s = 0; s < Sq; s++)
                for (int64_t h = 0; h < H; h++)
                    for (int64_t d = 0; d < D; d++)
                        if (gacc) rq[((b * Sq + s) * H + h) * D + d] = t_get(&dq, b, s, h, d);
        for (int64_t b = 0; b < B; b++)
            for (int64_t s = 0; s < Sk; s++)
                for (int64_t h = 0; h < Hkv; h++)
                    for (int64_t d = 0; d < D; d++)
                        if (gacc) {
                            rk[((b * Sk + s) * Hkv + h) * D + d] = t_get(&dk, b, s, h, d);
                            rv[((b * Sk + s) * Hkv + h) * D + d] = t_get(&dv, b, s, h, d);
                        }
        /* reference grads from the reference lse and the stored out */
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++) {
                int64_t g = h / (H / Hkv);
                for (int64_t i = 0; i < Sq; i++) {
                    double L = refl[(b * H + h) * Sq + i];
                    double dl = 0;
                    for (int64_t d = 0; d < D; d++) dl += t_get(&dout, b, i, h, d) * t_get(&out, b, i, h, d);
                    ref_row(&pb, &q, &k, &v, b, h, i, orow, srow);
                    if (L == -INFINITY) continue;
                    for (int64_t j = 0; j < Sk; j++) {
                        if (srow[j] == -INFINITY) continue;
                        double P = exp(srow[j] - L), dP = 0;
                        for (int64_t d = 0; d < D; d++) dP += t_get(&dout, b, i, h, d) * t_get(&v, b, j, g, d);
                        double dS = P * (dP - dl);
                        for (int64_t d = 0; d < D; d++) {
                            rv[((b * Sk + j) * Hkv + g) * D + d] += P * t_get(&dout, b, i, h, d);
                            rk[((b * Sk + j) * Hkv + g) * D + d] += pb.scale * dS * t_get(&q, b, i, h, d);
                            rq[((b * Sq + i) * H + h) * D + d] += pb.scale * dS * t_get(&k, b, j, g, d);
                        }
                    }
                }
            }
        ra_attn_bwd_params bp = {0};
        bp.q = fp.q; bp.k = fp.k; bp.v = fp.v; bp.out = fp.out; bp.dout = t_ptr(&dout);
        bp.lse = lse.data; bp.delta = delta.data;
        bp.dq = t_ptr(&dq); bp.dk = t_ptr(&dk); bp.dv = t_ptr(&dv);
        bp.dtype = dt; bp.out_dtype = od; bp.grad_dtype = gd;
        bp.batch = B; bp.seqlen_q = Sq; bp.seqlen_k = Sk; bp.heads = H; bp.heads_kv = Hkv; bp.head_dim = D;
        bp.q_batch_stride = q.bs; bp.q_seq_stride = q.ss; bp.q_head_stride = q.hs;
        bp.k_batch_stride = k.bs; bp.k_seq_stride = k.ss; bp.k_head_stride = k.hs;
        bp.v_batch_stride = v.bs; bp.v_seq_stride = v.ss; bp.v_head_stride = v.hs;
        bp.out_batch_stride = out.bs; bp.out_seq_stride = out.ss; bp.out_head_stride = out.hs;
        bp.dout_batch_stride = dout.bs; bp.dout_seq_stride = dout.ss; bp.dout_head_stride = dout.hs;
        bp.dq_batch_stride = dq.bs; bp.dq_seq_stride = dq.ss; bp.dq_head_stride = dq.hs;
        bp.dk_batch_stride = dk.bs; bp.dk_seq_stride = dk.ss; bp.dk_head_stride = dk.hs;
        bp.dv_batch_stride = dv.bs; bp.dv_seq_stride = dv.ss; bp.dv_head_stride = dv.hs;
        bp.lse_batch_stride = lse.bs; bp.lse_head_stride = lse.hs; bp.lse_seq_stride = lse.ss;
        bp.scale = pb.scale; bp.causal = pb.causal;
        bp.q_pos_offset = pb.qoff; bp.q_pos_stride = pb.qst;
        bp.k_pos_offset = pb.koff; bp.k_pos_stride = pb.kst;
        bp.accumulate = gacc; bp.deterministic = 1; bp.num_threads = nthreads;
        st = ra_cpu_attn_bwd_preprocess(&bp);
        if (st == RA_OK) st = pb.cfg ? ra_cpu_dilated_bwd(&bp, pb.cfg) : ra_cpu_attn_bwd(&bp);
        if (st != RA_OK) { printf("  bwd status %d: %s\n", st, ra_last_error()); eq.nan = 1; }
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < Sq; i++)
                for (int64_t h = 0; h < H; h++) {
                    double dl = 0;
                    for (int64_t d = 0; d < D; d++) {
                        dl += t_get(&dout, b, i, h, d) * t_get(&out, b, i, h, d);
                        ea_add(&eq, t_get(&dq, b, i, h, d), rq[((b * Sq + i) * H + h) * D + d]);
                    }
                    ea_add(&ed, r_get(&delta, b, h, i), dl);
                }
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < Sk; j++)
                for (int64_t h = 0; h < Hkv; h++)
                    for (int64_t d = 0; d < D; d++) {
                        ea_add(&ek, t_get(&dk, b, j, h, d), rk[((b * Sk + j) * Hkv + h) * D + d]);
                        ea_add(&ev, t_get(&dv, b, j, h, d), rv[((b * Sk + j) * Hkv + h) * D + d]);
                    }
        double gt = tol_for(gd == dt ? dt : acc, 1);
        if (gd != dt) gt = tol_for(dt == RA_FLOAT64 ? dt : RA_FLOAT32, 1) * (dt == RA_FLOAT32 || dt == RA_FLOAT64 ? 1 : 10);
        ok = ok && ea_rel(&eq) <= gt && ea_rel(&ek) <= gt && ea_rel(&ev) <= gt &&
             ea_rel(&ed) <= tol_for(acc, 0) * 4;
        free(rq); free(rk); free(rv);
        t_free(&dq); t_free(&dk); t_free(&dv);
    }
    n_cases++;
    if (!ok) n_fail++;
    if (!ok || getenv("VERBOSE"))
        printf("%s %-8s B%lld Sq%lld Sk%lld H%lld/%lld D%lld c%d pos(%lld,%lld;%lld,%lld) L%d acc%d oacc%d%s"
               " | out %.2e lse %.2e dq %.2e dk %.2e dv %.2e delta %.2e\n",
               ok ? "ok  " : "FAIL", ra_dtype_name(dt), (long long)B, (long long)Sq,
               (long long)Sk, (long long)H, (long long)Hkv, (long long)D, pb.causal,
               (long long)pb.qoff, (long long)pb.qst, (long long)pb.koff, (long long)pb.kst,
               layout, accumulate, out_acc, pb.cfg ? " dilated" : "", ea_rel(&eo),
               ea_rel(&el), ea_rel(&eq), ea_rel(&ek), ea_rel(&ev), ea_rel(&ed));
    free(refo); free(refl); free(srow); free(orow);
    t_free(&q); t_free(&k); t_free(&v); t_free(&out); t_free(&dout);
    free(lse.data); free(delta.data);
}

/* ---- merge ------------------------------------------------------------- */
static void run_merge(ra_dtype dt1, ra_dtype dt2, ra_dtype dto, ra_dtype ld,
                      int inplace) {
    const int64_t B = 2, S = 9, H = 3, D = 5;
    tensor o1 = t_make(dt1, B, S, H, D, 0), o2 = t_make(dt2, B, S, H, D, 2);
    tensor oo = t_make(dto, B, S, H, D, 1);
    rowvec l1 = r_make(ld, B, H, S, 0), l2 = r_make(ld, B, H, S, 1), lo = r_make(ld, B, H, S, 0);
    t_rand(&o1, 1); t_rand(&o2, 1);
    double *ref = malloc(sizeof(double) * (size_t)(B * S * H * D)), *refl = malloc(sizeof(double) * (size_t)(B * S * H));
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t s = 0; s < S; s++) {
                double a = (s % 4 == 1) ? -INFINITY : 2 * urand(), c = (s % 3 == 1) ? -INFINITY : 2 * urand();
                r_set(&l1, b, h, s, a); r_set(&l2, b, h, s, c);
                a = r_get(&l1, b, h, s); c = r_get(&l2, b, h, s);
                double m = a > c ? a : c, L = -INFINITY;
                if (m > -INFINITY) L = m + log(exp(a - m) + exp(c - m));
                refl[(b * H + h) * S + s] = L;
                for (int64_t d = 0; d < D; d++)
                    ref[((b * S + s) * H + h) * D + d] = m == -INFINITY ? 0 :
                        exp(a - L) * t_get(&o1, b, s, h, d) + exp(c - L) * t_get(&o2, b, s, h, d);
            }
    ra_merge_params mp = {0};
    tensor *dst = inplace ? &o1 : &oo;
    rowvec *dl = inplace ? &l1 : &lo;
    mp.out1 = t_ptr(&o1); mp.lse1 = l1.data; mp.out2 = t_ptr(&o2); mp.lse2 = l2.data;
    mp.out = t_ptr(dst); mp.lse = dl->data;
    mp.out1_dtype = dt1; mp.out2_dtype = dt2; mp.out_dtype = dst->dt; mp.lse_dtype = ld;
    mp.batch = B; mp.seqlen = S; mp.heads = H; mp.head_dim = D;
    mp.out1_batch_stride = o1.bs; mp.out1_seq_stride = o1.ss; mp.out1_head_stride = o1.hs;
    mp.out2_batch_stride = o2.bs; mp.out2_seq_stride = o2.ss; mp.out2_head_stride = o2.hs;
    mp.out_batch_stride = dst->bs; mp.out_seq_stride = dst->ss; mp.out_head_stride = dst->hs;
    mp.lse1_batch_stride = l1.bs; mp.lse1_head_stride = l1.hs; mp.lse1_seq_stride = l1.ss;
    mp.lse2_batch_stride = l2.bs; mp.lse2_head_stride = l2.hs; mp.lse2_seq_stride = l2.ss;
    mp.lse_batch_stride = dl->bs; mp.lse_head_stride = dl->hs; mp.lse_seq_stride = dl->ss;
    erracc eo = {0}, el = {0};
    if (ra_cpu_merge(&mp) != RA_OK) eo.nan = 1;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t s = 0; s < S; s++) {
                ea_add(&el, r_get(dl, b, h, s), refl[(b * H + h) * S + s]);
                for (int64_t d = 0; d < D; d++)
                    ea_add(&eo, t_get(dst, b, s, h, d), ref[((b * S + s) * H + h) * D + d]);
            }
    int ok = ea_rel(&eo) <= tol_for(dst->dt, 0) && ea_rel(&el) <= tol_for(ld, 0);
    n_cases++;
    if (!ok) n_fail++;
    if (!ok || getenv("VERBOSE"))
        printf("%s merge %s+%s->%s lse %s inplace %d | out %.2e lse %.2e\n", ok ? "ok  " : "FAIL",
               ra_dtype_name(dt1), ra_dtype_name(dt2), ra_dtype_name(dst->dt), ra_dtype_name(ld),
               inplace, ea_rel(&eo), ea_rel(&el));
    free(ref); free(refl); t_free(&o1); t_free(&o2); t_free(&oo);
    free(l1.data); free(l2.data); free(lo.data);
}

static problem mkprob(int64_t B, int64_t Sq, int64_t Sk, int64_t H, int64_t Hkv,
                      int64_t D, int causal) {
    problem pb = {B, Sq, Sk, H, Hkv, D, causal, Sk - Sq, 1, 0, 1, 1.0 / sqrt((double)D), NULL};
    return pb;
}

#include "bench_attn_cpu.h"

int main(int argc, char **argv) {
    const int quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    if (argc > 1 && strcmp(argv[1], "bench") == 0) return bench_main(argc, argv);
    printf("SIMD level: %s\n", ra_cpu_simd_level());
    const ra_dtype dts[4] = {RA_FLOAT32, RA_FLOAT64, RA_FLOAT16, RA_BFLOAT16};

    /* merge */
    for (int a = 0; a < 4; a++)
        for (int inpl = 0; inpl < 2; inpl++)
            run_merge(dts[a], dts[(a + 1) % 4], dts[(a + 2) % 4], a == 1 ? RA_FLOAT64 : RA_FLOAT32, inpl);

    /* dense grid */
    const int64_t Ss[] = {1, 7, 113, 1023};
    const int64_t Ds[] = {1, 8, 59, 64, 128, 256};
    int ci = 0;
    for (int di = 0; di < 4; di++) {
        ra_dtype dt = dts[di];
        for (int si = 0; si < 4; si++)
            for (int dd = 0; dd < 6; dd++)
                for (int causal = 0; causal < 2; causal++) {
                    ci++;
                    int64_t S = Ss[si], D = Ds[dd];
                    if (quick && (S > 113 || D > 64)) continue;
                    if (S == 1023 && D >= 128 && (ci % 3)) continue;   /* keep the grid fast */
                    int64_t Sk = (ci % 3 == 0) ? S : (ci % 3 == 1 ? S + 37 : (S > 20 ? S / 2 : S + 3));
                    int64_t ratio = (ci % 3) == 0 ? 1 : ((ci % 3) == 1 ? 2 : 4);
                    problem pb = mkprob(S > 200 ? 1 : 2, S, Sk, 4, 4 / ratio, D, causal);
                    run_case(dt, pb, ci % 3, 0, (ci % 5) == 0, 1 + (ci % 2));
                }
    }
    /* positions: offsets, striped-like strides, empty rows, accumulate */
    for (int di = 0; di < 4; di++) {
        ra_dtype dt = dts[di];
        problem pb = mkprob(2, 97, 131, 4, 2, 59, 1);
        pb.qoff = 5; pb.qst = 3; pb.koff = 20; pb.kst = 3;    /* first rows see nothing */
        run_case(dt, pb, 2, 0, 0, 2);
        pb.qoff = 1; pb.qst = 3; pb.koff = 0; pb.kst = 3;
        run_case(dt, pb, 1, 0, 0, 2);
        pb.qoff = 0; pb.qst = 1; pb.koff = 500; pb.kst = 2;   /* all rows empty */
        run_case(dt, pb, 0, 0, 0, 2);
        pb = mkprob(2, 70, 150, 4, 1, 64, 1);
        pb.qoff = 40; pb.koff = 0;
        run_case(dt, pb, 0, 1, 0, 2);                          /* accumulate */
        pb.causal = 0;
        run_case(dt, pb, 2, 1, 0, 1);
        pb = mkprob(1, 33, 0, 2, 1, 16, 0);                    /* no keys */
        run_case(dt, pb, 0, 0, 0, 1);
        run_case(dt, pb, 0, 1, 0, 1);
        pb = mkprob(1, 50, 300, 6, 3, 64, 1);
        pb.qoff = 1000; pb.koff = 990; pb.kst = 1;
        run_case(dt, pb, 1, 1, 0, 2);
    }
    /* dilated */
    {
        ra_dilated_config cfgs[4] = {
            {2, {8, 32}, {1, 2}},
            {3, {5, 16, 1000}, {1, 3, 4}},
            {2, {4, 64}, {6, 1}},           /* rate > segment length */
            {1, {7}, {2}}};
        const int64_t ns[] = {1, 7, 50, 130};
        for (int di = 0; di < 4; di++)
            for (int c = 0; c < 4; c++)
                for (int ni = 0; ni < 4; ni++)
                    for (int causal = 0; causal < 2; causal++) {
                        if (quick && ni == 3) continue;
                        problem pb = mkprob(2, ns[ni], ns[ni], 4, (c % 2) ? 2 : 4, c == 2 ? 24 : 16, causal);
                        pb.qoff = pb.koff = 0;
                        pb.cfg = &cfgs[c];
                        run_case(dts[di], pb, (c + ni) % 3, (ni + c) % 3 == 1, 0, 2);
                        if (ni == 2 && causal) {   /* ring-like: shifted q shard */
                            pb.Sq = 30; pb.qoff = 40; pb.Sk = 50; pb.koff = 0;
                            run_case(dts[di], pb, 0, 0, 0, 2);
                        }
                    }
    }
    printf("%d cases, %d failed\n", n_cases, n_fail);
    return n_fail != 0;
}
