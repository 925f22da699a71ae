/*
 * attn_cpu_simd.h -- SIMD building blocks of the CPU attention kernels,
 * written once with GCC vector extensions and compiled for several targets.
 *
 * Not a normal header: an attn_cpu_isa_*.c file sets, before including it,
 *   RA_REAL      float or double (the arithmetic type)
 *   RA_VBYTES    vector size in bytes (16 SSE2, 32 AVX2, 64 AVX-512)
 *   RA_MR, RA_NV micro-tile: RA_MR rows x RA_NV vectors of accumulators
 * and a `#pragma GCC target` for the instruction set.  Everything here is
 * static, so each translation unit gets its own copy.
 *
 * Provides
 *   rv / ri            vector of reals / of same-width integers
 *   v_exp2(x)          2^x elementwise, exact 0 below the smallest normal,
 *                      NaN for NaN
 *   v_exp2_le0(x)      the same for x <= 0 only (cheaper: no clamping)
 *   v_tanh(x, &sech2)  tanh elementwise, and 1 - tanh^2 without cancellation
 *   ra_gemm(...)       C (+)= A * B for small packed panels, where A is read
 *                      by broadcasting scalars (any row/column strides, so A
 *                      or its transpose) and B is read as row vectors:
 *                      C[m][n] (+)= sum_k A[m*ars + k*aks] * B[k*ldb + n],
 *                      N a multiple of the vector width.
 * The micro-kernel keeps an RA_MR x RA_NV block of C in registers and does
 * one broadcast and RA_NV fused multiply-adds per row and k.
 */
#ifndef RA_REAL
#error "define RA_REAL, RA_VBYTES, RA_MR, RA_NV before including attn_cpu_simd.h"
#endif

typedef RA_REAL real;
#define VW ((int)(RA_VBYTES / sizeof(RA_REAL)))

#if RA_IS_DOUBLE
typedef int64_t ri_el;
typedef uint64_t ru_el;
#else
typedef int32_t ri_el;
typedef uint32_t ru_el;
#endif
typedef real rv __attribute__((vector_size(RA_VBYTES)));
typedef ri_el ri __attribute__((vector_size(RA_VBYTES)));
/* unsigned lanes for exponent-field arithmetic, which wraps by design */
typedef ru_el ru __attribute__((vector_size(RA_VBYTES)));
typedef real rvu __attribute__((vector_size(RA_VBYTES), aligned(sizeof(real))));

#define RA_AI static inline __attribute__((always_inline))

RA_AI rv v_ld(const real *p) { return *(const rvu *)p; }
RA_AI void v_st(real *p, rv x) { *(rvu *)p = x; }
/* x - 0 is x for every x (unlike 0 + x, which turns -0 into +0), so GCC
 * folds this to a plain broadcast */
RA_AI rv v_set1(real x) { return x - (rv){0}; }
RA_AI rv v_max(rv a, rv b) {
    ri m = a > b;
    return (rv)(((ri)a & m) | ((ri)b & ~m));
}
/* horizontal max / sum as a tree of halvings (log2(VW) dependent steps) */
RA_AI real v_hmax(rv a) {
#pragma GCC unroll 8
    for (int w = VW / 2; w >= 1; w /= 2)
#pragma GCC unroll 16
        for (int i = 0; i < w; i++) a[i] = a[i + w] > a[i] ? a[i + w] : a[i];
    return a[0];
}
RA_AI real v_hsum(rv a) {
#pragma GCC unroll 8
    for (int w = VW / 2; w >= 1; w /= 2)
#pragma GCC unroll 16
        for (int i = 0; i < w; i++) a[i] += a[i + w];
    return a[0];
}

/* 2^f for |f| <= 1/2 by a Taylor polynomial, coefficients ln(2)^i / i!
 * (degree 6 for float, 12 for double: error below one unit in the last
 * place); `magic` rounds to an integer when added, and `lo` is the smallest
 * normal exponent. */
#if RA_IS_DOUBLE
static const real ra_exp2_c[] = {
    1.0, 0.6931471805599453, 0.2402265069591007, 0.05550410866482158,
    0.009618129107628477, 0.0013333558146428443, 0.00015403530393381608,
    1.525273380405984e-05, 1.3215486790144307e-06, 1.0178086009239699e-07,
    7.054911620801123e-09, 4.445538271870811e-10, 2.567843599348821e-11};
enum { RA_EXP2_DEG = 12, RA_EXP2_SHIFT = 52 };
static const real ra_exp2_lo = -1021.0, ra_exp2_hi = 1023.0,
                  ra_exp2_magic = 6755399441055744.0;
#else
static const real ra_exp2_c[] = {1.0f, 0.6931471805599453f, 0.2402265069591007f,
                                 0.05550410866482158f, 0.009618129107628477f,
                                 0.0013333558146428443f, 0.00015403530393381608f};
enum { RA_EXP2_DEG = 6, RA_EXP2_SHIFT = 23 };
static const real ra_exp2_lo = -125.0f, ra_exp2_hi = 127.0f,
                  ra_exp2_magic = 12582912.0f;
#endif

RA_AI rv v_exp2_poly(rv f) {
    rv p = v_set1(ra_exp2_c[RA_EXP2_DEG]);
    for (int i = RA_EXP2_DEG - 1; i >= 0; i--) p = p * f + v_set1(ra_exp2_c[i]);
    return p;
}

/* NaN lanes of x passed through to r: the integer work on the exponent
 * field would turn a NaN into some number (or the clamps of v_exp2 into
 * 2^lo), and a NaN score must reach the result (DESIGN 2) */
RA_AI rv v_keep_nan(rv x, ru r) {
    const ri nan = x != x;
    return (rv)((r & ~(ru)nan) | ((ru)x & (ru)nan));
}

/* 2^x: x = n + f with n = round(x), |f| <= 1/2; 2^f by the polynomial, 2^n
 * by adding n to the exponent field.  Inputs below the smallest normal
 * exponent (including -inf) give exactly 0; NaN gives NaN. */
RA_AI rv v_exp2(rv x) {
    const rv x0 = x;
    ri dead = x < v_set1(ra_exp2_lo);
    x = v_max(x, v_set1(ra_exp2_lo));
    x = -v_max(-x, v_set1(-ra_exp2_hi));
    rv t = x + v_set1(ra_exp2_magic);   /* rounds x to an integer */
    rv n = t - v_set1(ra_exp2_magic);
    rv p = v_exp2_poly(x - n);
    ru ni = (ru)t - (ru)v_set1(ra_exp2_magic);  /* the integer n */
    ru r = (ru)p + (ni << RA_EXP2_SHIFT);
    return v_keep_nan(x0, r & ~(ru)dead);
}

/* 2^x for x <= 0 (the softmax case: scores minus their running max), with
 * the same polynomial as v_exp2 but no clamping: the exponent n is read
 * straight from the rounded sum t = x + magic (the bits of magic vanish
 * when shifted into the exponent field), and every lane below the smallest
 * normal exponent, -inf included, is forced to exactly 0.  NaN (a NaN
 * score, or +inf minus a running max of +inf) gives NaN. */
RA_AI rv v_exp2_le0(rv x) {
    ri dead = x < v_set1(ra_exp2_lo);
    rv t = x + v_set1(ra_exp2_magic);
    rv p = v_exp2_poly(x - (t - v_set1(ra_exp2_magic)));
    ru r = (ru)p + ((ru)t << RA_EXP2_SHIFT);
    return v_keep_nan(x, r & ~(ru)dead);
}

/* tanh(x) and sech(x)^2 = 1 - tanh(x)^2 (soft-capping, DESIGN 2).
 * |x| < 0.625: tanh(x) = x p(x^2), p a least-squares fit on Chebyshev nodes
 * (degree 5 for float, 10 for double: within 2 units in the last place),
 * and 1 - t^2 has no cancellation (t < 0.56).  Larger |x|: with
 * e = exp(-2|x|), tanh = (1 - e) / (1 + e) and sech^2 = 4e / (1 + e)^2, both
 * without cancellation; e is exactly 0 far out (and for infinities), so
 * huge scores give tanh = +-1 and sech^2 = 0, never NaN. */
#if RA_IS_DOUBLE
static const real ra_tanh_c[] = {
    1.0, -0.3333333333331601, 0.13333333331579156, -0.05396825327090624,
    0.021869474239513666, -0.008863063360248998, 0.0035908245446815167,
    -0.0014494227381988203, 0.0005693871487461794, -0.00019638362742645704,
    4.2546983309147244e-05};
enum { RA_TANH_DEG = 10 };
#else
static const real ra_tanh_c[] = {
    0.9999999959352007f, -0.3333325873952267f, 0.13331091308302623f,
    -0.05371849242583629f, 0.020583500085106957f, -0.005652358310425322f};
enum { RA_TANH_DEG = 5 };
#endif

RA_AI rv v_tanh(rv x, rv *sech2) {
    const ri sign = (ri)x & (ri)v_set1(-(real)0);
    const rv ax = (rv)((ri)x & ~sign);
    const ri small = ax < v_set1((real)0.625);
    const rv u = x * x;
    rv p = v_set1(ra_tanh_c[RA_TANH_DEG]);
    for (int i = RA_TANH_DEG - 1; i >= 0; i--) p = p * u + v_set1(ra_tanh_c[i]);
    const rv t_small = x * p;
    const rv e = v_exp2(ax * v_set1((real)(-2.0 * RA_LOG2E)));
    const rv one = v_set1(1), ope = one + e;
    const rv t_big = (rv)((ri)((one - e) / ope) | sign);
    const rv s_small = one - t_small * t_small;
    const rv s_big = v_set1(4) * e / (ope * ope);
    *sech2 = (rv)(((ri)s_small & small) | ((ri)s_big & ~small));
    return (rv)(((ri)t_small & small) | ((ri)t_big & ~small));
}

/* ---- micro-kernel and panel product ----------------------------------- */
RA_AI void ra_mk(int mr, int nv, int64_t K, const real *A, int64_t ars,
                 int64_t aks, const real *B, int64_t ldb, real *C, int64_t ldc,
                 int acc) {
    rv c[RA_MR][RA_NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++)
            c[r][v] = acc ? v_ld(C + r * ldc + v * VW) : v_set1(0);
    for (int64_t k = 0; k < K; k++) {
        rv b[RA_NV];
        for (int v = 0; v < nv; v++) b[v] = v_ld(B + k * ldb + v * VW);
        const real *a = A + k * aks;
        for (int r = 0; r < mr; r++) {
            rv av = v_set1(a[r * ars]);
            for (int v = 0; v < nv; v++) c[r][v] += av * b[v];
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) v_st(C + r * ldc + v * VW, c[r][v]);
}

#define RA_MK_DEF(mr)                                                         \
    static __attribute__((noinline)) void ra_mk_##mr##_w(                    \
        int64_t K, const real *A, int64_t ars, int64_t aks, const real *B,   \
        int64_t ldb, real *C, int64_t ldc, int acc) {                        \
        ra_mk(mr, RA_NV, K, A, ars, aks, B, ldb, C, ldc, acc);               \
    }                                                                         \
    static __attribute__((noinline)) void ra_mk_##mr##_1(                    \
        int64_t K, const real *A, int64_t ars, int64_t aks, const real *B,   \
        int64_t ldb, real *C, int64_t ldc, int acc) {                        \
        ra_mk(mr, 1, K, A, ars, aks, B, ldb, C, ldc, acc);                   \
    }
#if RA_MR != 6
#error "ra_gemm's row tails are written for RA_MR == 6"
#endif
RA_MK_DEF(1)
RA_MK_DEF(2)
RA_MK_DEF(3)
RA_MK_DEF(4)
RA_MK_DEF(5)
RA_MK_DEF(6)

typedef void (*ra_mk_fn)(int64_t, const real *, int64_t, int64_t, const real *,
                         int64_t, real *, int64_t, int);
static const ra_mk_fn ra_mk_wide[RA_MR + 1] = {
    0, ra_mk_1_w, ra_mk_2_w, ra_mk_3_w, ra_mk_4_w, ra_mk_5_w, ra_mk_6_w};
static const ra_mk_fn ra_mk_one[RA_MR + 1] = {
    0, ra_mk_1_1, ra_mk_2_1, ra_mk_3_1, ra_mk_4_1, ra_mk_5_1, ra_mk_6_1};

/* C (M x N, ldc) (+)= A (M x K, strides ars/aks) * B (K x N, ldb).
 * N must be a multiple of VW; M, K anything >= 0. */
static void ra_gemm(int64_t M, int64_t N, int64_t K, const real *A,
                    int64_t ars, int64_t aks, const real *B, int64_t ldb,
                    real *C, int64_t ldc, int acc) {
    int64_t n0 = 0;
    const int64_t nw = (int64_t)RA_NV * VW;
    for (; n0 + nw <= N; n0 += nw) {
        int64_t m0 = 0;
        for (; m0 + RA_MR <= M; m0 += RA_MR)
            ra_mk_6_w(K, A + m0 * ars, ars, aks, B + n0, ldb,
                      C + m0 * ldc + n0, ldc, acc);
        if (m0 < M)
            ra_mk_wide[M - m0](K, A + m0 * ars, ars, aks, B + n0, ldb,
                               C + m0 * ldc + n0, ldc, acc);
    }
    for (; n0 < N; n0 += VW) {
        int64_t m0 = 0;
        for (; m0 + RA_MR <= M; m0 += RA_MR)
            ra_mk_6_1(K, A + m0 * ars, ars, aks, B + n0, ldb,
                      C + m0 * ldc + n0, ldc, acc);
        if (m0 < M)
            ra_mk_one[M - m0](K, A + m0 * ars, ars, aks, B + n0, ldb,
                              C + m0 * ldc + n0, ldc, acc);
    }
}
