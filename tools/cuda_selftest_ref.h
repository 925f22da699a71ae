/*
 * cuda_selftest_ref.h -- what tools/cuda_selftest.cu compares with: host
 * encodings of the four float dtypes, device buffers, the float64 CPU
 * reference of attention forward and backward, and the error check.
 *
 * The reference works on contiguous BSHD arrays with affine positions
 * (pos_q(i) = qoff + i * qstr, pos_k(j) = koff + j * kstr) for the causal
 * rule and the window, and optionally documents and soft-capping
 * (RefMask), exactly as DESIGN.md §2 states them: a row that sees no key
 * has out 0 and lse -inf.
 */
#ifndef RA_CUDA_SELFTEST_REF_H
#define RA_CUDA_SELFTEST_REF_H

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common.cuh"
#include "core/copy.h"     /* ra_copy_params, ra_cuda_copy */

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); exit(2); } } while (0)
#define RK(x) do { ra_status s_ = (x); if (s_ != RA_OK) { \
    printf("ra %s at %d: %s\n", #x, __LINE__, ra_last_error()); exit(3); } } while (0)

static inline size_t esize(ra_dtype t) { return ra_dtype_size(t); }

static std::vector<unsigned char> encode(const std::vector<double> &x, ra_dtype t) {
    std::vector<unsigned char> b(x.size() * esize(t));
    for (size_t i = 0; i < x.size(); i++) {
        if (t == RA_FLOAT64) ((double *)b.data())[i] = x[i];
        else if (t == RA_FLOAT32) ((float *)b.data())[i] = (float)x[i];
        else if (t == RA_FLOAT16) ((__half *)b.data())[i] = __float2half_rn((float)x[i]);
        else ((__nv_bfloat16 *)b.data())[i] = __float2bfloat16_rn((float)x[i]);
    }
    return b;
}
static std::vector<double> decode(const unsigned char *b, size_t n, ra_dtype t) {
    std::vector<double> x(n);
    for (size_t i = 0; i < n; i++) {
        if (t == RA_FLOAT64) x[i] = ((const double *)b)[i];
        else if (t == RA_FLOAT32) x[i] = ((const float *)b)[i];
        else if (t == RA_FLOAT16) x[i] = __half2float(((const __half *)b)[i]);
        else x[i] = __bfloat162float(((const __nv_bfloat16 *)b)[i]);
    }
    return x;
}
/* x rounded to dtype t and back: what a kernel reading t sees */
static std::vector<double> rounded(const std::vector<double> &x, ra_dtype t) {
    return decode(encode(x, t).data(), x.size(), t);
}

/* A device allocation, poisoned with 0xff bytes (NaN for every float
 * dtype) so that an element no kernel wrote shows up in the comparison. */
struct Dev {
    void *p = nullptr;
    size_t n = 0;
    explicit Dev(size_t bytes) : n(bytes) {
        CK(cudaMalloc(&p, bytes ? bytes : 1));
        CK(cudaMemset(p, 0xff, bytes ? bytes : 1));
    }
    ~Dev() { cudaFree(p); }
    Dev(const Dev &) = delete;
    Dev &operator=(const Dev &) = delete;
};
static void up(Dev &d, const std::vector<unsigned char> &b) {
    CK(cudaMemcpy(d.p, b.data(), b.size(), cudaMemcpyHostToDevice));
}
static std::vector<double> down(const Dev &d, size_t n, ra_dtype t) {
    std::vector<unsigned char> b(n * esize(t));
    CK(cudaMemcpy(b.data(), d.p, b.size(), cudaMemcpyDeviceToHost));
    return decode(b.data(), n, t);
}

/* The masks of DESIGN.md §2 for the reference: documents (q ids (B, S_q),
 * kv ids (B, S_k), contiguous; empty = none), a window (a side < 0 is
 * unbounded) and a softcap (0 = none). */
struct RefMask {
    std::vector<int> qids, kids;
    bool window = false;
    long left = -1, right = -1;
    double softcap = 0;
};

/* float64 reference on contiguous BSHD with affine positions */
static void reference(int B, int Sq, int Sk, int H, int Hk, int D, bool causal, long qoff, long koff,
                      const std::vector<double> &q, const std::vector<double> &k,
                      const std::vector<double> &v, const std::vector<double> &dout,
                      std::vector<double> &out, std::vector<double> &lse, std::vector<double> &dq,
                      std::vector<double> &dk, std::vector<double> &dv, long qstr = 1,
                      long kstr = 1, const RefMask *mask = nullptr) {
    const double sc = 1.0 / std::sqrt((double)D);
    const RefMask none;
    const RefMask &mk = mask ? *mask : none;
    out.assign((size_t)B * Sq * H * D, 0);
    lse.assign((size_t)B * H * Sq, -INFINITY);
    dq.assign(out.size(), 0);
    dk.assign((size_t)B * Sk * Hk * D, 0);
    dv.assign(dk.size(), 0);
    std::vector<double> s(Sk), pr(Sk), dcap(Sk, 1.0);
    for (int b = 0; b < B; b++) for (int h = 0; h < H; h++) for (int i = 0; i < Sq; i++) {
        const int hk = h / (H / Hk);
        const double *qi = &q[(((size_t)b * Sq + i) * H + h) * D];
        const long qp = qoff + i * qstr;
        double m = -INFINITY;
        for (int j = 0; j < Sk; j++) {
            const double *kj = &k[(((size_t)b * Sk + j) * Hk + hk) * D];
            const long kp = koff + j * kstr;
            bool vis = !causal || kp <= qp;
            if (mk.window) vis = vis && (mk.left < 0 || qp - kp <= mk.left) &&
                                 (mk.right < 0 || kp - qp <= mk.right);
            if (!mk.qids.empty())
                vis = vis && mk.qids[(size_t)b * Sq + i] == mk.kids[(size_t)b * Sk + j];
            double d = 0;
            for (int x = 0; x < D; x++) d += qi[x] * kj[x];
            d *= sc;
            if (mk.softcap > 0) {
                const double t = std::tanh(d / mk.softcap);
                d = mk.softcap * t;
                dcap[j] = 1 - t * t;
            }
            s[j] = vis ? d : -INFINITY;
            m = std::max(m, s[j]);
        }
        if (m == -INFINITY) continue;
        double l = 0;
        for (int j = 0; j < Sk; j++) l += (pr[j] = std::exp(s[j] - m));
        lse[((size_t)b * H + h) * Sq + i] = m + std::log(l);
        double *oi = &out[(((size_t)b * Sq + i) * H + h) * D];
        const double *gi = &dout[(((size_t)b * Sq + i) * H + h) * D];
        for (int j = 0; j < Sk; j++) {
            pr[j] /= l;
            const double *vj = &v[(((size_t)b * Sk + j) * Hk + hk) * D];
            for (int x = 0; x < D; x++) oi[x] += pr[j] * vj[x];
        }
        double delta = 0;
        for (int x = 0; x < D; x++) delta += gi[x] * oi[x];
        for (int j = 0; j < Sk; j++) {
            const double *kj = &k[(((size_t)b * Sk + j) * Hk + hk) * D];
            const double *vj = &v[(((size_t)b * Sk + j) * Hk + hk) * D];
            double dp = 0;
            for (int x = 0; x < D; x++) dp += gi[x] * vj[x];
            const double ds = pr[j] * (dp - delta) * dcap[j];
            double *dkj = &dk[(((size_t)b * Sk + j) * Hk + hk) * D];
            double *dvj = &dv[(((size_t)b * Sk + j) * Hk + hk) * D];
            double *dqi = &dq[(((size_t)b * Sq + i) * H + h) * D];
            for (int x = 0; x < D; x++) {
                dvj[x] += pr[j] * gi[x];
                dkj[x] += sc * ds * qi[x];
                dqi[x] += sc * ds * kj[x];
            }
        }
    }
}

/* max |got - ref| <= tol * max(1, max |ref|, floor_mag); infinities must
 * match exactly, NaN never passes (also in `got` where ref is finite). */
static bool cmp(const char *what, const std::vector<double> &got, const std::vector<double> &ref,
                double tol, double floor_mag = 1.0) {
    if (got.size() != ref.size()) {
        printf("    %s: %zu elements, want %zu\n", what, got.size(), ref.size());
        return false;
    }
    double err = 0, mag = std::max(1.0, floor_mag);
    for (size_t i = 0; i < ref.size(); i++) {
        if (std::isnan(got[i])) {
            printf("    %s[%zu] is NaN\n", what, i);
            return false;
        }
        if (std::isinf(ref[i]) || std::isinf(got[i])) {
            if (got[i] != ref[i]) {
                printf("    %s[%zu] = %g, want %g\n", what, i, got[i], ref[i]);
                return false;
            }
            continue;
        }
        err = std::max(err, std::fabs(got[i] - ref[i]));
        mag = std::max(mag, std::fabs(ref[i]));
    }
    if (err > tol * mag) {
        printf("    %s: max error %.3g > %.3g\n", what, err, tol * mag);
        return false;
    }
    return true;
}

/* every element finite (no NaN, no inf) */
static bool all_finite(const char *what, const std::vector<double> &x) {
    for (size_t i = 0; i < x.size(); i++)
        if (!std::isfinite(x[i])) {
            printf("    %s[%zu] = %g is not finite\n", what, i, x[i]);
            return false;
        }
    return true;
}

/* tolerances of forward results and of gradients, per input dtype */
static double fwd_tol(ra_dtype t) {
    return t == RA_BFLOAT16 ? 2e-2 : t == RA_FLOAT16 ? 5e-3 : t == RA_FLOAT32 ? 1e-4 : 1e-9;
}
static double bwd_tol(ra_dtype t) {
    return t == RA_BFLOAT16 ? 4e-2 : t == RA_FLOAT16 ? 1e-2 : t == RA_FLOAT32 ? 2e-4 : 2e-9;
}

#endif /* RA_CUDA_SELFTEST_REF_H */
