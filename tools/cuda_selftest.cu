/*
 * cuda_selftest.cu -- a standalone check of the CUDA launchers against a
 * float64 CPU reference, independent of the Python layer.  Built and run by
 * tools/gpu_check.sh:
 *   nvcc -O2 -std=c++17 -Icsrc -Icuda -DRA_WITH_CUDA tools/cuda_selftest.cu
 *        cuda/*.o csrc/core/status.c -o selftest && ./selftest
 * For each dtype, head_dim, shape and causal flag: forward (out, lse),
 * backward (dq, dk, dv) and an accumulate continuation over two key chunks
 * (running state from ra_cuda_fill_state, positions continued by offsets).
 * Then the backward alone (run_bwd_case) on a grid of awkward cases, against
 * the reference, the generic kernels and a second run of itself.
 * Prints one line per case and exits non-zero on any failure.
 */
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "common.cuh"

/* the test binary does not link csrc/core/cuda_rt.c (it needs Python) */
extern "C" ra_status ra_cuda_status(int err, const char *what, const char *file, int line) {
    if (err == 0) return RA_OK;
    ra_set_error(RA_ERR_CUDA, "CUDA error in %s (%s:%d): %s", what, file, line,
                 cudaGetErrorString((cudaError_t)err));
    return RA_ERR_CUDA;
}

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); exit(2); } } while (0)
#define RK(x) do { ra_status s_ = (x); if (s_ != RA_OK) { \
    printf("ra %s at %d: %s\n", #x, __LINE__, ra_last_error()); exit(3); } } while (0)

static size_t esize(ra_dtype t) { return ra_dtype_size(t); }

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

struct Dev {
    void *p = nullptr; size_t n = 0;
    Dev(size_t bytes) : n(bytes) { CK(cudaMalloc(&p, bytes ? bytes : 1)); }
    ~Dev() { cudaFree(p); }
};
static void up(Dev &d, const std::vector<unsigned char> &b) { CK(cudaMemcpy(d.p, b.data(), b.size(), cudaMemcpyHostToDevice)); }
static std::vector<double> down(const Dev &d, size_t n, ra_dtype t) {
    std::vector<unsigned char> b(n * esize(t));
    CK(cudaMemcpy(b.data(), d.p, b.size(), cudaMemcpyDeviceToHost));
    return decode(b.data(), n, t);
}

/* float64 reference on contiguous BSHD with affine causal positions */
static void reference(int B, int Sq, int Sk, int H, int Hk, int D, bool causal, long qoff, long koff,
                      const std::vector<double> &q, const std::vector<double> &k, const std::vector<double> &v,
                      const std::vector<double> &dout, std::vector<double> &out, std::vector<double> &lse,
                      std::vector<double> &dq, std::vector<double> &dk, std::vector<double> &dv,
                      long qstr = 1, long kstr = 1) {
    const double sc = 1.0 / std::sqrt((double)D);
    out.assign((size_t)B * Sq * H * D, 0); lse.assign((size_t)B * H * Sq, -INFINITY);
    dq.assign(out.size(), 0); dk.assign((size_t)B * Sk * Hk * D, 0); dv.assign(dk.size(), 0);
    std::vector<double> s(Sk), pr(Sk);
    for (int b = 0; b < B; b++) for (int h = 0; h < H; h++) for (int i = 0; i < Sq; i++) {
        const int hk = h / (H / Hk);
        const double *qi = &q[(((size_t)b * Sq + i) * H + h) * D];
        double m = -INFINITY;
        for (int j = 0; j < Sk; j++) {
            const double *kj = &k[(((size_t)b * Sk + j) * Hk + hk) * D];
            double d = 0; for (int x = 0; x < D; x++) d += qi[x] * kj[x];
            s[j] = (!causal || koff + j * kstr <= qoff + i * qstr) ? d * sc : -INFINITY;
            m = std::max(m, s[j]);
        }
        if (m == -INFINITY) continue;
        double l = 0; for (int j = 0; j < Sk; j++) l += (pr[j] = std::exp(s[j] - m));
        lse[((size_t)b * H + h) * Sq + i] = m + std::log(l);
        double *oi = &out[(((size_t)b * Sq + i) * H + h) * D];
        const double *gi = &dout[(((size_t)b * Sq + i) * H + h) * D];
        for (int j = 0; j < Sk; j++) {
            pr[j] /= l;
            const double *vj = &v[(((size_t)b * Sk + j) * Hk + hk) * D];
            for (int x = 0; x < D; x++) oi[x] += pr[j] * vj[x];
        }
        double delta = 0; for (int x = 0; x < D; x++) delta += gi[x] * oi[x];
        for (int j = 0; j < Sk; j++) {
            const double *kj = &k[(((size_t)b * Sk + j) * Hk + hk) * D];
            const double *vj = &v[(((size_t)b * Sk + j) * Hk + hk) * D];
            double dp = 0; for (int x = 0; x < D; x++) dp += gi[x] * vj[x];
            const double ds = pr[j] * (dp - delta);
            double *dkj = &dk[(((size_t)b * Sk + j) * Hk + hk) * D];
            double *dvj = &dv[(((size_t)b * Sk + j) * Hk + hk) * D];
            double *dqi = &dq[(((size_t)b * Sq + i) * H + h) * D];
            for (int x = 0; x < D; x++) {
                dvj[x] += pr[j] * gi[x]; dkj[x] += sc * ds * qi[x]; dqi[x] += sc * ds * kj[x];
            }
        }
    }
}

static bool cmp(const char *what, const std::vector<double> &got, const std::vector<double> &ref, double tol) {
    double err = 0, mag = 1;
    for (size_t i = 0; i < ref.size(); i++) {
        if (std::isinf(ref[i]) || std::isinf(got[i])) {
            if (got[i] != ref[i]) { printf("    %s[%zu] = %g, want %g\n", what, i, got[i], ref[i]); return false; }
            continue;
        }
        if (std::isnan(got[i])) { printf("    %s[%zu] is NaN\n", what, i); return false; }
        err = std::max(err, std::fabs(got[i] - ref[i])); mag = std::max(mag, std::fabs(ref[i]));
    }
    if (err > tol * mag) { printf("    %s: max error %.3g > %.3g\n", what, err, tol * mag); return false; }
    return true;
}

static bool run_case(ra_dtype t, int B, int Sq, int Sk, int H, int Hk, int D, bool causal) {
    std::mt19937_64 rng(B * 131 + Sq * 7 + Sk * 3 + D + causal);
    std::normal_distribution<double> nd;
    auto rnd = [&](size_t n) { std::vector<double> x(n); for (auto &e : x) e = nd(rng); return x; };
    const size_t nq = (size_t)B * Sq * H * D, nk = (size_t)B * Sk * Hk * D, nl = (size_t)B * H * Sq;
    // round inputs to the dtype so the reference sees what the kernel sees
    auto q = decode(encode(rnd(nq), t).data(), nq, t), k = decode(encode(rnd(nk), t).data(), nk, t);
    auto v = decode(encode(rnd(nk), t).data(), nk, t), g = decode(encode(rnd(nq), t).data(), nq, t);
    const long qoff = Sk - Sq;  // bottom-right alignment
    std::vector<double> ro, rl, rdq, rdk, rdv;
    reference(B, Sq, Sk, H, Hk, D, causal, qoff, 0, q, k, v, g, ro, rl, rdq, rdk, rdv);
    const ra_dtype acc = ra_acc_dtype(t);
    const double tol = t == RA_BFLOAT16 ? 2e-2 : t == RA_FLOAT16 ? 5e-3 : t == RA_FLOAT32 ? 1e-4 : 1e-9;

    Dev dq_(nq * esize(t)), dk_(nk * esize(t)), dv_(nk * esize(t)), dg(nq * esize(t)), dout(nq * esize(t));
    Dev dl(nl * esize(acc)), ddelta(nl * esize(acc));
    Dev gq(nq * esize(t)), gk(nk * esize(t)), gv(nk * esize(t));
    up(dq_, encode(q, t)); up(dk_, encode(k, t)); up(dv_, encode(v, t)); up(dg, encode(g, t));

    ra_attn_fwd_params f; memset(&f, 0, sizeof f);
    f.q = dq_.p; f.k = dk_.p; f.v = dv_.p; f.out = dout.p; f.lse = dl.p; f.dtype = t; f.out_dtype = t;
    f.batch = B; f.seqlen_q = Sq; f.seqlen_k = Sk; f.heads = H; f.heads_kv = Hk; f.head_dim = D;
    // contiguous BSHD strides; lse (B, H, S)
    f.q_batch_stride = (int64_t)Sq * H * D; f.q_seq_stride = H * D; f.q_head_stride = D;
    f.k_batch_stride = (int64_t)Sk * Hk * D; f.k_seq_stride = Hk * D; f.k_head_stride = D;
    f.v_batch_stride = f.k_batch_stride; f.v_seq_stride = f.k_seq_stride; f.v_head_stride = D;
    f.out_batch_stride = f.q_batch_stride; f.out_seq_stride = f.q_seq_stride; f.out_head_stride = D;
    f.lse_batch_stride = (int64_t)H * Sq; f.lse_head_stride = Sq; f.lse_seq_stride = 1;
    f.scale = 1.0 / std::sqrt((double)D); f.causal = causal;
    f.q_pos_offset = qoff; f.q_pos_stride = 1; f.k_pos_offset = 0; f.k_pos_stride = 1;
    RK(ra_cuda_attn_fwd(&f, 0));
    CK(cudaDeviceSynchronize());
    bool ok = cmp("out", down(dout, nq, t), ro, tol) && cmp("lse", down(dl, nl, acc), rl, tol);

    // backward
    ra_attn_bwd_params bp; memset(&bp, 0, sizeof bp);
    bp.q = dq_.p; bp.k = dk_.p; bp.v = dv_.p; bp.out = dout.p; bp.dout = dg.p; bp.lse = dl.p;
    bp.delta = ddelta.p; bp.dq = gq.p; bp.dk = gk.p; bp.dv = gv.p;
    bp.dtype = bp.out_dtype = bp.grad_dtype = t;
    bp.batch = B; bp.seqlen_q = Sq; bp.seqlen_k = Sk; bp.heads = H; bp.heads_kv = Hk; bp.head_dim = D;
    bp.q_batch_stride = f.q_batch_stride; bp.q_seq_stride = f.q_seq_stride; bp.q_head_stride = D;
    bp.k_batch_stride = f.k_batch_stride; bp.k_seq_stride = f.k_seq_stride; bp.k_head_stride = D;
    bp.v_batch_stride = f.k_batch_stride; bp.v_seq_stride = f.k_seq_stride; bp.v_head_stride = D;
    bp.out_batch_stride = bp.dout_batch_stride = bp.dq_batch_stride = f.q_batch_stride;
    bp.out_seq_stride = bp.dout_seq_stride = bp.dq_seq_stride = f.q_seq_stride;
    bp.out_head_stride = bp.dout_head_stride = bp.dq_head_stride = D;
    bp.dk_batch_stride = bp.dv_batch_stride = f.k_batch_stride;
    bp.dk_seq_stride = bp.dv_seq_stride = f.k_seq_stride; bp.dk_head_stride = bp.dv_head_stride = D;
    bp.lse_batch_stride = f.lse_batch_stride; bp.lse_head_stride = Sq; bp.lse_seq_stride = 1;
    bp.scale = f.scale; bp.causal = causal; bp.q_pos_offset = qoff; bp.q_pos_stride = 1;
    bp.k_pos_offset = 0; bp.k_pos_stride = 1; bp.deterministic = 1;
    RK(ra_cuda_attn_bwd_preprocess(&bp, 0));
    RK(ra_cuda_attn_bwd(&bp, 0));
    CK(cudaDeviceSynchronize());
    // the reference backward uses exact out; bf16/fp16 out rounding moves delta a little
    const double btol = tol * 2;
    ok = ok && cmp("dq", down(gq, nq, t), rdq, btol) && cmp("dk", down(gk, nk, t), rdk, btol) &&
         cmp("dv", down(gv, nk, t), rdv, btol);

    // accumulate: two key chunks into a running state (acc dtype)
    if (Sk >= 2) {
        Dev so(nq * esize(acc)), sl(nl * esize(acc));
        RK(ra_cuda_fill_state(so.p, sl.p, acc, B, Sq, H, D, f.out_batch_stride, f.out_seq_stride, D,
                              f.lse_batch_stride, Sq, 1, 0));
        const int split = Sk / 3 + 1;
        ra_attn_fwd_params a = f;
        a.out = so.p; a.lse = sl.p; a.out_dtype = acc; a.accumulate = 1;
        a.seqlen_k = split;
        RK(ra_cuda_attn_fwd(&a, 0));
        a.k = (const unsigned char *)dk_.p + (size_t)split * f.k_seq_stride * esize(t);
        a.v = (const unsigned char *)dv_.p + (size_t)split * f.k_seq_stride * esize(t);
        a.seqlen_k = Sk - split; a.k_pos_offset = split;
        RK(ra_cuda_attn_fwd(&a, 0));
        CK(cudaDeviceSynchronize());
        ok = ok && cmp("acc out", down(so, nq, acc), ro, tol) && cmp("acc lse", down(sl, nl, acc), rl, tol);
    }
    printf("%-4s %-8s B=%d Sq=%d Sk=%d H=%d Hkv=%d D=%d causal=%d\n", ok ? "ok" : "FAIL",
           ra_dtype_name(t), B, Sq, Sk, H, Hk, D, (int)causal);
    return ok;
}

/* ---- backward alone, through ra_cuda_attn_bwd: the tensor-core path for
 * float16/bfloat16 with D 64/128 (the generic path otherwise), checked
 * against the float64 reference, against the generic path
 * (RINGATTN_CUDA_GENERIC=1) and against itself (same bits twice).
 * out and lse are the reference's, so the forward plays no part. */
struct BwdCase {
    int B, Sq, Sk, H, Hk, D;
    bool causal;
    long qoff, qstr, koff, kstr;  // affine positions
    int pad;                      // extra elements per sequence row of every BSHD tensor
    bool grad_f32, accumulate;
};

/* (B, S, Hh, D) logical values <-> a buffer with seq stride Hh * D + pad;
 * `fill` goes into the pad positions */
static std::vector<double> to_strided(const std::vector<double> &x, int B, int S, int Hh, int D, int pad,
                                      double fill) {
    const size_t row = (size_t)Hh * D + pad;
    std::vector<double> y((size_t)B * S * row, fill);
    for (size_t bs = 0; bs < (size_t)B * S; bs++)
        for (size_t e = 0; e < (size_t)Hh * D; e++) y[bs * row + e] = x[bs * Hh * D + e];
    return y;
}
static std::vector<double> from_strided(const std::vector<double> &y, int B, int S, int Hh, int D, int pad) {
    const size_t row = (size_t)Hh * D + pad;
    std::vector<double> x((size_t)B * S * Hh * D);
    for (size_t bs = 0; bs < (size_t)B * S; bs++)
        for (size_t e = 0; e < (size_t)Hh * D; e++) x[bs * Hh * D + e] = y[bs * row + e];
    return x;
}

static bool run_bwd_case(ra_dtype t, const BwdCase &c) {
    const int B = c.B, Sq = c.Sq, Sk = c.Sk, H = c.H, Hk = c.Hk, D = c.D;
    std::mt19937_64 rng(B * 977 + Sq * 31 + Sk * 17 + H * 5 + D + c.causal + 7 * c.pad);
    std::normal_distribution<double> nd;
    auto rnd = [&](size_t n) { std::vector<double> x(n); for (auto &e : x) e = nd(rng); return x; };
    const size_t nq = (size_t)B * Sq * H * D, nk = (size_t)B * Sk * Hk * D, nl = (size_t)B * H * Sq;
    auto q = decode(encode(rnd(nq), t).data(), nq, t), k = decode(encode(rnd(nk), t).data(), nk, t);
    auto v = decode(encode(rnd(nk), t).data(), nk, t), g = decode(encode(rnd(nq), t).data(), nq, t);
    std::vector<double> ro, rl, rdq, rdk, rdv;
    reference(B, Sq, Sk, H, Hk, D, c.causal, c.qoff, c.koff, q, k, v, g, ro, rl, rdq, rdk, rdv, c.qstr, c.kstr);
    const ra_dtype acc = ra_acc_dtype(t);
    const ra_dtype gt = c.grad_f32 || c.accumulate ? acc : t;
    const double tol = t == RA_BFLOAT16 ? 4e-2 : t == RA_FLOAT16 ? 1e-2 : t == RA_FLOAT32 ? 2e-4 : 2e-9;

    // strided device copies; the pad of inputs holds a value that must not leak in
    const int64_t qrow = (int64_t)H * D + c.pad, krow = (int64_t)Hk * D + c.pad;
    const size_t nqs = (size_t)B * Sq * qrow, nks = (size_t)B * Sk * krow;
    Dev dq_(nqs * esize(t)), dk_(nks * esize(t)), dv_(nks * esize(t)), dg(nqs * esize(t)), dout(nqs * esize(t));
    Dev dl(nl * esize(acc)), ddelta(nl * esize(acc));
    up(dq_, encode(to_strided(q, B, Sq, H, D, c.pad, 3.0), t));
    up(dk_, encode(to_strided(k, B, Sk, Hk, D, c.pad, 3.0), t));
    up(dv_, encode(to_strided(v, B, Sk, Hk, D, c.pad, 3.0), t));
    up(dg, encode(to_strided(g, B, Sq, H, D, c.pad, 3.0), t));
    up(dout, encode(to_strided(ro, B, Sq, H, D, c.pad, 3.0), t));
    up(dl, encode(rl, acc));

    // accumulate: grads start from random values (pad included) that must be added to / kept
    const auto q_init = rnd(nqs), k_init = rnd(nks), v_init = rnd(nks);

    ra_attn_bwd_params bp; memset(&bp, 0, sizeof bp);
    bp.q = dq_.p; bp.k = dk_.p; bp.v = dv_.p; bp.out = dout.p; bp.dout = dg.p; bp.lse = dl.p;
    bp.delta = ddelta.p;
    bp.dtype = bp.out_dtype = t; bp.grad_dtype = gt;
    bp.batch = B; bp.seqlen_q = Sq; bp.seqlen_k = Sk; bp.heads = H; bp.heads_kv = Hk; bp.head_dim = D;
    // BSHD with padded sequence rows; lse, delta (B, H, S_q) contiguous
    bp.q_batch_stride = bp.out_batch_stride = bp.dout_batch_stride = bp.dq_batch_stride = (int64_t)Sq * qrow;
    bp.q_seq_stride = bp.out_seq_stride = bp.dout_seq_stride = bp.dq_seq_stride = qrow;
    bp.q_head_stride = bp.out_head_stride = bp.dout_head_stride = bp.dq_head_stride = D;
    bp.k_batch_stride = bp.v_batch_stride = bp.dk_batch_stride = bp.dv_batch_stride = (int64_t)Sk * krow;
    bp.k_seq_stride = bp.v_seq_stride = bp.dk_seq_stride = bp.dv_seq_stride = krow;
    bp.k_head_stride = bp.v_head_stride = bp.dk_head_stride = bp.dv_head_stride = D;
    bp.lse_batch_stride = (int64_t)H * Sq; bp.lse_head_stride = Sq; bp.lse_seq_stride = 1;
    bp.scale = 1.0 / std::sqrt((double)D); bp.causal = c.causal;
    bp.q_pos_offset = c.qoff; bp.q_pos_stride = c.qstr; bp.k_pos_offset = c.koff; bp.k_pos_stride = c.kstr;
    bp.accumulate = c.accumulate; bp.deterministic = 1;

    // one backward into fresh grads (NaN-filled unless accumulating); returns the raw buffers
    struct Grads { std::vector<double> dq, dk, dv; };
    auto run = [&](bool generic) {
        Dev gq(nqs * esize(gt)), gk(nks * esize(gt)), gv(nks * esize(gt));
        if (c.accumulate) {
            up(gq, encode(q_init, gt)); up(gk, encode(k_init, gt)); up(gv, encode(v_init, gt));
        } else {
            CK(cudaMemset(gq.p, 0xff, gq.n)); CK(cudaMemset(gk.p, 0xff, gk.n)); CK(cudaMemset(gv.p, 0xff, gv.n));
        }
        ra_attn_bwd_params r = bp;
        r.dq = gq.p; r.dk = gk.p; r.dv = gv.p;
        if (generic) setenv("RINGATTN_CUDA_GENERIC", "1", 1); else unsetenv("RINGATTN_CUDA_GENERIC");
        RK(ra_cuda_attn_bwd_preprocess(&r, 0));
        RK(ra_cuda_attn_bwd(&r, 0));
        CK(cudaDeviceSynchronize());
        unsetenv("RINGATTN_CUDA_GENERIC");
        return Grads{down(gq, nqs, gt), down(gk, nks, gt), down(gv, nks, gt)};
    };
    const Grads fast = run(false), again = run(false), generic = run(true);

    bool ok = true;
    if (c.accumulate) {
        // whole buffers: init + grad on the logical elements, init untouched in the pad
        auto want = [&](const std::vector<double> &init, const std::vector<double> &ref, int S, int Hh) {
            auto w = to_strided(ref, B, S, Hh, D, c.pad, 0.0);
            for (size_t i = 0; i < w.size(); i++) w[i] += init[i];
            return w;
        };
        ok = cmp("dq(acc)", fast.dq, want(q_init, rdq, Sq, H), tol) &&
             cmp("dk(acc)", fast.dk, want(k_init, rdk, Sk, Hk), tol) &&
             cmp("dv(acc)", fast.dv, want(v_init, rdv, Sk, Hk), tol);
    } else {
        ok = cmp("dq", from_strided(fast.dq, B, Sq, H, D, c.pad), rdq, tol) &&
             cmp("dk", from_strided(fast.dk, B, Sk, Hk, D, c.pad), rdk, tol) &&
             cmp("dv", from_strided(fast.dv, B, Sk, Hk, D, c.pad), rdv, tol);
    }
    // logical elements only: the pad of non-accumulated grads stays NaN
    ok = ok &&
         cmp("dq vs generic", from_strided(fast.dq, B, Sq, H, D, c.pad),
             from_strided(generic.dq, B, Sq, H, D, c.pad), tol) &&
         cmp("dk vs generic", from_strided(fast.dk, B, Sk, Hk, D, c.pad),
             from_strided(generic.dk, B, Sk, Hk, D, c.pad), tol) &&
         cmp("dv vs generic", from_strided(fast.dv, B, Sk, Hk, D, c.pad),
             from_strided(generic.dv, B, Sk, Hk, D, c.pad), tol);
    if (ok && (memcmp(fast.dq.data(), again.dq.data(), fast.dq.size() * sizeof(double)) != 0 ||
               memcmp(fast.dk.data(), again.dk.data(), fast.dk.size() * sizeof(double)) != 0 ||
               memcmp(fast.dv.data(), again.dv.data(), fast.dv.size() * sizeof(double)) != 0)) {
        printf("    two runs differ in their bits\n");
        ok = false;
    }
    printf("%-4s bwd %-8s B=%d Sq=%d Sk=%d H=%d Hkv=%d D=%d causal=%d pos=(%ld+%ld i, %ld+%ld j) pad=%d "
           "grad=%s acc=%d\n", ok ? "ok" : "FAIL", ra_dtype_name(t), B, Sq, Sk, H, Hk, D, (int)c.causal,
           c.qoff, c.qstr, c.koff, c.kstr, c.pad, ra_dtype_name(gt), (int)c.accumulate);
    return ok;
}

int main(int argc, char **argv) {
    // "quick": a small grid for compute-sanitizer runs
    const bool quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    const ra_dtype dts[] = {RA_BFLOAT16, RA_FLOAT16, RA_FLOAT32, RA_FLOAT64};
    const int dims[] = {8, 59, 64, 128, 256};
    const int shapes[][5] = {{1, 1, 1, 1, 1}, {2, 7, 7, 2, 2}, {1, 113, 113, 4, 2},
                             {2, 65, 200, 3, 1}, {1, 200, 65, 2, 2}, {1, 130, 257, 2, 1}};
    int fails = 0, n = 0;
    for (ra_dtype t : dts)
        for (int D : dims)
            for (int si = 0; si < 6; si++)
                for (int c = 0; c < 2; c++) {
                    const int *s = shapes[si];
                    if (quick && (si % 2 == 0 || D == 8 || D == 256)) continue;
                    fails += !run_case(t, s[0], s[1], s[2], s[3], s[4], D, c);
                    n++;
                }
    // backward alone: odd sizes, GQA, S_q != S_k, empty query rows (causal with
    // S_q > S_k), keys no query sees, affine positions, padded strides, float32
    // grads and accumulate
    const BwdCase bwd_cases[] = {
        //  B   Sq   Sk  H Hk  D  causal qoff qstr koff kstr pad f32  acc
        {2,   7,   7, 2, 2, 0, true,   0, 1, 0, 1, 0, false, false},
        {1, 113, 113, 4, 2, 0, true,   0, 1, 0, 1, 0, false, false},
        {1, 113, 113, 4, 2, 0, false,  0, 1, 0, 1, 0, false, false},
        {2,  65, 200, 3, 1, 0, true, 135, 1, 0, 1, 0, false, false},
        {1, 200,  65, 2, 2, 0, true,-135, 1, 0, 1, 0, true,  false},
        {1, 130, 257, 2, 1, 0, true,   0, 1, 0, 1, 8, false, false},
        {1,  97, 150, 4, 1, 0, true,  40, 1, 0, 1, 8, true,  true},
        {1,  97, 150, 4, 1, 0, false,  0, 1, 0, 1, 0, true,  true},
        {1,  90,  70, 2, 1, 0, true,   5, 2, 0, 3, 0, false, false},
        {1, 300, 260, 2, 2, 0, false,  0, 1, 0, 1, 0, false, false},
        {1,  64, 128, 8, 1, 0, true,  64, 1, 0, 1, 0, false, false},
        {1, 128,  64, 2, 1, 0, true, -64, 1, 0, 1, 0, false, true},
    };
    const ra_dtype bwd_dts[] = {RA_BFLOAT16, RA_FLOAT16, RA_FLOAT32};
    for (ra_dtype t : bwd_dts)
        for (int D : {64, 128, 59})
            for (size_t ci = 0; ci < sizeof bwd_cases / sizeof bwd_cases[0]; ci++) {
                if (quick && (ci % 3 != 1 || t == RA_FLOAT32 || D == 59)) continue;
                if (D == 59 && t != RA_FLOAT32) continue;  // the generic path, once, as a control
                BwdCase c = bwd_cases[ci];
                c.D = D;
                fails += !run_bwd_case(t, c);
                n++;
            }
    printf("%d of %d cases failed\n", fails, n);
    return fails ? 1 : 0;
}
