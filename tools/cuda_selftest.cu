/*
 * cuda_selftest.cu -- a standalone check of every CUDA kernel ringattn
 * has, through its extern "C" launchers, against a float64 CPU reference
 * (tools/cuda_selftest_ref.h), independent of the Python layer.  Built and
 * run by tools/gpu_check.sh (stage "selftest"):
 *   nvcc -O2 -std=c++17 -Icsrc -Icuda -DRA_WITH_CUDA tools/cuda_selftest.cu
 *        cuda/*.o csrc/core/status.c -o selftest && ./selftest [quick|full]
 * "full I/N" runs shard I of N (every N-th case of the grid, from case
 * I - 1; the N shards run each case once: the test suite runs the full grid
 * on the emulated GPU in shards); "plan full I/N" only counts them.
 *
 * What runs (each case prints one line "ok ..." or "FAIL ..."):
 *   run_case      forward (out in the input dtype and in the accumulator
 *                 dtype), backward and an accumulate continuation over two
 *                 key chunks (running state from ra_cuda_fill_state, ring
 *                 position offsets) on contiguous tensors; for float16 and
 *                 bfloat16 at D 64/128 also with the generic kernels forced
 *                 and, on a device whose tensor-core family is sm90a (the
 *                 wgmma/TMA kernels: an H100 with a build for sm_90a, the
 *                 emulated GPU), with the mma.sync family forced
 *                 (RINGATTN_CUDA_KERNELS=sm80); the strided, masked and
 *                 huge-score cases run that family's forward too
 *   run_strided   forward and backward on padded strides with affine
 *                 positions (ring steps), empty query rows, keys no query
 *                 sees, float32 grads and accumulate; the backward also
 *                 against the generic kernels and against itself (bits)
 *   run_masked    documents, windows and soft-capping with causal, GQA,
 *                 S_q != S_k, ring positions and accumulate, forward and
 *                 backward (MaskCase; the generic kernels as a control)
 *   run_huge      huge but finite scores (q scaled by 1e9 in float32 and
 *                 bfloat16, 1e18 in float64): finite and correct gradients,
 *                 also from an lse merged over two key chunks
 * Every backward runs both ways: deterministic = 0 (for float16/bfloat16
 * at D 64/128 the fused kernel of the device's family -- on sm90a the
 * wgmma one of hopper/attn_bwd_wg.cu, masks included, else the mma.sync
 * one of attn_bwd_fused.cu -- dq added up by float32 atomics over the key blocks;
 * accumulated straight into a float32 dq, or through its scratch and
 * conversion) and deterministic = 1 (the split kernels, whose bits
 * run_strided checks repeat; on sm90a the wgmma kernel's without its dq
 * product, then the wgmma dq pass).  On a two-family device run_case and
 * run_masked check both backwards ran the sm90a kernel, and their sm80
 * cases run the mma.sync backward too: run_case's in the quick grid and on
 * two shapes of the full grid, run_masked's in both grids
 * (g_bwd_families).
 *   run_broadcast k and v shared by the batch (batch stride 0): the
 *                 mma.sync forward, which the dispatcher keeps for layouts
 *                 a tensor map cannot describe
 *   run_merge     the LSE merge of two key halves
 *   run_copy      the strided cast copy, every pair of dtypes
 * The full grid: float32/float64/float16/bfloat16, D in {8, 59, 64, 96,
 * 128, 256}, causal and not, GQA and MQA, S_q != S_k both ways.  "quick"
 * (for compute-sanitizer) runs every kernel instantiation once on small
 * sizes: the generic kernels at each per-lane width (D 8, 59, 96, 256) and
 * dtype, the tensor-core kernels for both 16-bit dtypes at D 64 and 128
 * with 16-bit and float32 outputs and accumulate, each masked variant the
 * same way (and the long document walks once), merge, fill_state, copy.
 * Exit status: 0 when every case passed.
 */
#include <climits>
#include <cstring>
#include <random>

#include "cuda_selftest_ref.h"

/* the test binary does not link csrc/core/cuda_rt.c (it needs Python):
 * what cuda/ uses of it.  The selftest launches on the legacy stream
 * (stream 0), so that is its "compute stream", and the fused backward's dq
 * scratch comes from cudaMalloc and goes back with cudaFree (which waits
 * for the device, so the scratch outlives the kernels that use it). */
extern "C" ra_status ra_cuda_status(int err, const char *what, const char *file, int line) {
    if (err == 0) return RA_OK;
    ra_set_error(RA_ERR_CUDA, "CUDA error in %s (%s:%d): %s", what, file, line,
                 cudaGetErrorString((cudaError_t)err));
    return RA_ERR_CUDA;
}
extern "C" ra_status ra_cuda_compute_stream(int device, void **stream) {
    (void)device;
    *stream = nullptr;
    return RA_OK;
}
extern "C" ra_status ra_cuda_malloc(int device, size_t nbytes, void **ptr) {
    (void)device;
    return ra_cuda_status((int)cudaMalloc(ptr, nbytes), "cudaMalloc", __FILE__, __LINE__);
}
extern "C" ra_status ra_cuda_free(int device, void *ptr, size_t nbytes) {
    (void)device;
    (void)nbytes;
    return ra_cuda_status((int)cudaFree(ptr), "cudaFree", __FILE__, __LINE__);
}

static std::vector<double> randn(std::mt19937_64 &rng, size_t n, double scale = 1.0) {
    std::normal_distribution<double> nd;
    std::vector<double> x(n);
    for (auto &e : x) e = nd(rng) * scale;
    return x;
}

/* Which kernels a case runs: the dispatcher's choice (the fastest family
 * the device has), the generic ones forced (RINGATTN_CUDA_GENERIC=1), or
 * the mma.sync family forced (RINGATTN_CUDA_KERNELS=sm80) where the device
 * also has the sm90a family (g_two_families).  An SM80 case runs the
 * backward too only while g_bwd_families is set (the quick grid, a subset
 * of the full one, and every masked SM80 case: the sm90a backward runs in
 * every FAST case). */
enum Kern { FAST, GENERIC, SM80 };
static bool g_two_families = false;
static bool g_bwd_families = false;

static const char *kern_label(Kern k) {
    return k == GENERIC ? " generic" : k == SM80 ? " sm80" : "";
}
static void force_kernels(Kern k) {
    if (k == GENERIC) setenv("RINGATTN_CUDA_GENERIC", "1", 1);
    else unsetenv("RINGATTN_CUDA_GENERIC");
    if (k == SM80) setenv("RINGATTN_CUDA_KERNELS", "sm80", 1);
    else unsetenv("RINGATTN_CUDA_KERNELS");
}
static void force_generic(bool on) { force_kernels(on ? GENERIC : FAST); }

/* Forward params for contiguous BSHD q/out, k/v and lse (B, H, S_q). */
static ra_attn_fwd_params fwd_params(ra_dtype t, int B, int Sq, int Sk, int H, int Hk, int D,
                                     bool causal, long qoff) {
    ra_attn_fwd_params f;
    memset(&f, 0, sizeof f);
    f.dtype = f.out_dtype = t;
    f.batch = B; f.seqlen_q = Sq; f.seqlen_k = Sk; f.heads = H; f.heads_kv = Hk; f.head_dim = D;
    f.q_batch_stride = (int64_t)Sq * H * D; f.q_seq_stride = (int64_t)H * D; f.q_head_stride = D;
    f.k_batch_stride = (int64_t)Sk * Hk * D; f.k_seq_stride = (int64_t)Hk * D; f.k_head_stride = D;
    f.v_batch_stride = f.k_batch_stride; f.v_seq_stride = f.k_seq_stride; f.v_head_stride = D;
    f.out_batch_stride = f.q_batch_stride; f.out_seq_stride = f.q_seq_stride; f.out_head_stride = D;
    f.lse_batch_stride = (int64_t)H * Sq; f.lse_head_stride = Sq; f.lse_seq_stride = 1;
    f.scale = 1.0 / std::sqrt((double)D);
    f.causal = causal;
    f.q_pos_offset = qoff; f.q_pos_stride = 1; f.k_pos_offset = 0; f.k_pos_stride = 1;
    return f;
}

/* Backward params with the same geometry as a forward's. */
static ra_attn_bwd_params bwd_params(const ra_attn_fwd_params &f) {
    ra_attn_bwd_params b;
    memset(&b, 0, sizeof b);
    b.dtype = b.out_dtype = b.grad_dtype = f.dtype;
    b.q = f.q; b.k = f.k; b.v = f.v;  // the backward reads the forward's inputs
    b.batch = f.batch; b.seqlen_q = f.seqlen_q; b.seqlen_k = f.seqlen_k;
    b.heads = f.heads; b.heads_kv = f.heads_kv; b.head_dim = f.head_dim;
    b.q_batch_stride = f.q_batch_stride; b.q_seq_stride = f.q_seq_stride; b.q_head_stride = f.q_head_stride;
    b.k_batch_stride = f.k_batch_stride; b.k_seq_stride = f.k_seq_stride; b.k_head_stride = f.k_head_stride;
    b.v_batch_stride = f.v_batch_stride; b.v_seq_stride = f.v_seq_stride; b.v_head_stride = f.v_head_stride;
    b.out_batch_stride = b.dout_batch_stride = b.dq_batch_stride = f.q_batch_stride;
    b.out_seq_stride = b.dout_seq_stride = b.dq_seq_stride = f.q_seq_stride;
    b.out_head_stride = b.dout_head_stride = b.dq_head_stride = f.q_head_stride;
    b.dk_batch_stride = b.dv_batch_stride = f.k_batch_stride;
    b.dk_seq_stride = b.dv_seq_stride = f.k_seq_stride;
    b.dk_head_stride = b.dv_head_stride = f.k_head_stride;
    b.lse_batch_stride = f.lse_batch_stride; b.lse_head_stride = f.lse_head_stride;
    b.lse_seq_stride = f.lse_seq_stride;
    b.scale = f.scale; b.causal = f.causal;
    b.q_pos_offset = f.q_pos_offset; b.q_pos_stride = f.q_pos_stride;
    b.k_pos_offset = f.k_pos_offset; b.k_pos_stride = f.k_pos_stride;
    b.mask = f.mask;
    b.deterministic = 1;
    return b;
}

/* ---- contiguous forward, backward, accumulate -------------------------- */

/* Positions and masks of a problem (DESIGN.md §2): pos_q(i) = qoff + i qstr,
 * pos_k(j) = koff + j kstr (qoff = LONG_MIN: bottom-right, S_k - S_q). */
struct Layout {
    long qoff = LONG_MIN, koff = 0, qstr = 1, kstr = 1;
    RefMask mask;
};

/* A contiguous problem: q (scaled by q_scale), k, v, dout rounded to t,
 * the float64 reference, device copies (segment ids too), and
 * forward/backward params wired to them and to fresh (poisoned) out, lse,
 * delta and grad buffers. */
struct Problem {
    ra_dtype t, acc;
    int B, Sq, Sk, H, Hk, D;
    size_t nq, nk, nl;
    std::vector<double> q, k, v, g, ro, rl, rdq, rdk, rdv;
    Dev dq_, dk_, dv_, dg, dout, dl, ddelta, gq, gk, gv, qids, kids;
    ra_attn_fwd_params f;
    ra_attn_bwd_params b;
    Problem(ra_dtype t_, int B_, int Sq_, int Sk_, int H_, int Hk_, int D_, bool causal,
            std::mt19937_64 &rng, double q_scale = 1.0, const Layout &lay = Layout())
        : t(t_), acc(ra_acc_dtype(t_)), B(B_), Sq(Sq_), Sk(Sk_), H(H_), Hk(Hk_), D(D_),
          nq((size_t)B_ * Sq_ * H_ * D_), nk((size_t)B_ * Sk_ * Hk_ * D_), nl((size_t)B_ * H_ * Sq_),
          // round inputs to the dtype so the reference sees what the kernel sees
          q(rounded(randn(rng, nq, q_scale), t_)), k(rounded(randn(rng, nk), t_)),
          v(rounded(randn(rng, nk), t_)), g(rounded(randn(rng, nq), t_)),
          dq_(nq * esize(t_)), dk_(nk * esize(t_)), dv_(nk * esize(t_)), dg(nq * esize(t_)),
          dout(nq * esize(t_)), dl(nl * esize(acc)), ddelta(nl * esize(acc)),
          gq(nq * esize(t_)), gk(nk * esize(t_)), gv(nk * esize(t_)),
          qids(lay.mask.qids.size() * sizeof(int)), kids(lay.mask.kids.size() * sizeof(int)) {
        const long qoff = lay.qoff == LONG_MIN ? Sk - Sq : lay.qoff;  // bottom-right alignment
        reference(B, Sq, Sk, H, Hk, D, causal, qoff, lay.koff, q, k, v, g, ro, rl, rdq, rdk, rdv,
                  lay.qstr, lay.kstr, &lay.mask);
        up(dq_, encode(q, t)); up(dk_, encode(k, t)); up(dv_, encode(v, t)); up(dg, encode(g, t));
        // q, out (B, S_q, H, D); k, v (B, S_k, H_kv, D); lse (B, H, S_q)
        f = fwd_params(t, B, Sq, Sk, H, Hk, D, causal, qoff);
        f.q = dq_.p; f.k = dk_.p; f.v = dv_.p; f.out = dout.p; f.lse = dl.p;
        f.k_pos_offset = lay.koff; f.q_pos_stride = lay.qstr; f.k_pos_stride = lay.kstr;
        const RefMask &m = lay.mask;
        if (!m.qids.empty()) {
            // segment ids (B, S_q) and (B, S_k) int32, contiguous
            CK(cudaMemcpy(qids.p, m.qids.data(), qids.n, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(kids.p, m.kids.data(), kids.n, cudaMemcpyHostToDevice));
            f.mask.q_segment_ids = (const int32_t *)qids.p;
            f.mask.kv_segment_ids = (const int32_t *)kids.p;
            f.mask.q_seg_batch_stride = Sq; f.mask.q_seg_seq_stride = 1;
            f.mask.kv_seg_batch_stride = Sk; f.mask.kv_seg_seq_stride = 1;
        }
        f.mask.has_window = m.window;
        f.mask.window_left = m.left; f.mask.window_right = m.right;
        f.mask.softcap = m.softcap;
        b = bwd_params(f);
        b.out = dout.p; b.dout = dg.p; b.lse = dl.p; b.delta = ddelta.p;
        b.dq = gq.p; b.dk = gk.p; b.dv = gv.p;
    }
    void forward() { RK(ra_cuda_attn_fwd(&f, 0)); }
    /* fused (deterministic 0: the fused tensor-core kernel where it
     * applies) or deterministic (the split kernels) */
    void backward(bool deterministic) {
        b.deterministic = deterministic;
        RK(ra_cuda_attn_bwd_preprocess(&b, 0));
        RK(ra_cuda_attn_bwd(&b, 0));
    }
};

/* Run the problem's backward and check that kernel family `want` ran it
 * (ra_cuda_bwd_kernel_counts: 0 sm90a, 1 sm80, 2 generic); false, with
 * what ran, otherwise. */
static bool backward_ran(Problem &pr, bool det, int want) {
    unsigned long long before[3], after[3];
    ra_cuda_bwd_kernel_counts(before);
    pr.backward(det);
    CK(cudaDeviceSynchronize());
    ra_cuda_bwd_kernel_counts(after);
    if (after[want] == before[want] + 1) return true;
    printf("    the backward ran %llu sm90a, %llu sm80, %llu generic kernels, expected "
           "kernel %d\n", after[0] - before[0], after[1] - before[1], after[2] - before[2],
           want);
    return false;
}

static bool run_case(ra_dtype t, int B, int Sq, int Sk, int H, int Hk, int D, bool causal,
                     Kern kern) {
    const bool bwd = kern != SM80 || g_bwd_families;
    std::mt19937_64 rng(B * 131 + Sq * 7 + Sk * 3 + D + causal + 1000 * (int)t);
    Problem pr(t, B, Sq, Sk, H, Hk, D, causal, rng);
    const size_t nq = pr.nq, nl = pr.nl;
    const ra_dtype acc = pr.acc;
    const ra_attn_fwd_params &f = pr.f;
    const double tol = fwd_tol(t);
    force_kernels(kern);
    pr.forward();
    // the same into an accumulator-dtype output
    Dev dout_acc(nq * esize(acc)), dl2(nl * esize(acc));
    ra_attn_fwd_params fa = f;
    fa.out = dout_acc.p; fa.out_dtype = acc; fa.lse = dl2.p;
    RK(ra_cuda_attn_fwd(&fa, 0));
    CK(cudaDeviceSynchronize());
    bool ok = cmp("out", down(pr.dout, nq, t), pr.ro, tol) &&
              cmp("lse", down(pr.dl, nl, acc), pr.rl, tol) &&
              cmp("out(acc dtype)", down(dout_acc, nq, acc), pr.ro, tol) &&
              cmp("lse(acc dtype)", down(dl2, nl, acc), pr.rl, tol);

    // the reference backward uses exact out; bf16/fp16 out rounding moves
    // delta a little.  Both backward paths (the generic kernels have one;
    // an sm80 case of a device with two families runs the forward only).
    const double btol = tol * 2;
    const bool tc = (t == RA_FLOAT16 || t == RA_BFLOAT16) && (D == 64 || D == 128);
    for (int det = kern == GENERIC ? 1 : 0; bwd && det < 2 && ok; det++) {
        // the backward of a two-family device: the wgmma one (deterministic:
        // its dk/dv pass, then its dq pass)
        const int want = kern == GENERIC || !tc ? 2 : kern == FAST && g_two_families ? 0 : 1;
        if (!backward_ran(pr, det != 0, want)) {
            ok = false;
            break;
        }
        ok = cmp(det ? "dq" : "dq(fused)", down(pr.gq, nq, t), pr.rdq, btol) &&
             cmp(det ? "dk" : "dk(fused)", down(pr.gk, pr.nk, t), pr.rdk, btol) &&
             cmp(det ? "dv" : "dv(fused)", down(pr.gv, pr.nk, t), pr.rdv, btol);
    }

    // accumulate: two key chunks into a running state (acc dtype), the
    // second with its positions continued (a ring step)
    if (Sk >= 2) {
        Dev so(nq * esize(acc)), sl(nl * esize(acc));
        RK(ra_cuda_fill_state(so.p, sl.p, acc, B, Sq, H, D, f.out_batch_stride, f.out_seq_stride, D,
                              f.lse_batch_stride, Sq, 1, 0));
        const int split = Sk / 3 + 1;
        ra_attn_fwd_params a = f;
        a.out = so.p; a.lse = sl.p; a.out_dtype = acc; a.accumulate = 1;
        a.seqlen_k = split;
        RK(ra_cuda_attn_fwd(&a, 0));
        a.k = (const unsigned char *)pr.dk_.p + (size_t)split * f.k_seq_stride * esize(t);
        a.v = (const unsigned char *)pr.dv_.p + (size_t)split * f.k_seq_stride * esize(t);
        a.seqlen_k = Sk - split; a.k_pos_offset = split;
        RK(ra_cuda_attn_fwd(&a, 0));
        CK(cudaDeviceSynchronize());
        ok = ok && cmp("acc out", down(so, nq, acc), pr.ro, tol) &&
             cmp("acc lse", down(sl, nl, acc), pr.rl, tol);
    }
    force_kernels(FAST);
    printf("%-4s %-8s B=%d Sq=%d Sk=%d H=%d Hkv=%d D=%d causal=%d%s\n", ok ? "ok" : "FAIL",
           ra_dtype_name(t), B, Sq, Sk, H, Hk, D, (int)causal, kern_label(kern));
    return ok;
}

/* ---- padded strides and affine positions -------------------------------- */

struct StridedCase {
    int B, Sq, Sk, H, Hk, D;
    bool causal;
    long qoff, qstr, koff, kstr;  // affine positions
    int pad;                      // extra elements per sequence row of every BSHD tensor
    bool grad_f32, accumulate;
};

/* (B, S, Hh, D) logical values <-> a buffer with seq stride Hh * D + pad;
 * `fill` goes into the pad positions */
static std::vector<double> to_strided(const std::vector<double> &x, int B, int S, int Hh, int D,
                                      int pad, double fill) {
    const size_t row = (size_t)Hh * D + pad;
    std::vector<double> y((size_t)B * S * row, fill);
    for (size_t bs = 0; bs < (size_t)B * S; bs++)
        for (size_t e = 0; e < (size_t)Hh * D; e++) y[bs * row + e] = x[bs * Hh * D + e];
    return y;
}
/* the pad elements of a buffer laid out as to_strided's */
static std::vector<double> from_pad(const std::vector<double> &y, int B, int S, int Hh, int D,
                                    int pad) {
    const size_t row = (size_t)Hh * D + pad;
    std::vector<double> x;
    for (size_t bs = 0; bs < (size_t)B * S; bs++)
        for (size_t e = (size_t)Hh * D; e < row; e++) x.push_back(y[bs * row + e]);
    return x;
}
static std::vector<double> from_strided(const std::vector<double> &y, int B, int S, int Hh, int D,
                                        int pad) {
    const size_t row = (size_t)Hh * D + pad;
    std::vector<double> x((size_t)B * S * Hh * D);
    for (size_t bs = 0; bs < (size_t)B * S; bs++)
        for (size_t e = 0; e < (size_t)Hh * D; e++) x[bs * Hh * D + e] = y[bs * row + e];
    return x;
}

/* The forward on the strided layout vs the reference, then the backward
 * alone (out and lse are the reference's, so the forward plays no part)
 * against the reference, the generic kernels and a second run of itself. */
static bool run_strided(ra_dtype t, const StridedCase &c) {
    const int B = c.B, Sq = c.Sq, Sk = c.Sk, H = c.H, Hk = c.Hk, D = c.D;
    std::mt19937_64 rng(B * 977 + Sq * 31 + Sk * 17 + H * 5 + D + c.causal + 7 * c.pad);
    const size_t nq = (size_t)B * Sq * H * D, nk = (size_t)B * Sk * Hk * D, nl = (size_t)B * H * Sq;
    auto q = rounded(randn(rng, nq), t), k = rounded(randn(rng, nk), t);
    auto v = rounded(randn(rng, nk), t), g = rounded(randn(rng, nq), t);
    std::vector<double> ro, rl, rdq, rdk, rdv;
    reference(B, Sq, Sk, H, Hk, D, c.causal, c.qoff, c.koff, q, k, v, g, ro, rl, rdq, rdk, rdv,
              c.qstr, c.kstr);
    const ra_dtype acc = ra_acc_dtype(t);
    const ra_dtype gt = c.grad_f32 || c.accumulate ? acc : t;
    const double tol = bwd_tol(t);

    // strided device copies; the pad of inputs holds a value that must not leak in
    const int64_t qrow = (int64_t)H * D + c.pad, krow = (int64_t)Hk * D + c.pad;
    const size_t nqs = (size_t)B * Sq * qrow, nks = (size_t)B * Sk * krow;
    Dev dq_(nqs * esize(t)), dk_(nks * esize(t)), dv_(nks * esize(t)), dg(nqs * esize(t));
    Dev dout(nqs * esize(t)), fout(nqs * esize(t));
    Dev dl(nl * esize(acc)), fl(nl * esize(acc)), ddelta(nl * esize(acc));
    up(dq_, encode(to_strided(q, B, Sq, H, D, c.pad, 3.0), t));
    up(dk_, encode(to_strided(k, B, Sk, Hk, D, c.pad, 3.0), t));
    up(dv_, encode(to_strided(v, B, Sk, Hk, D, c.pad, 3.0), t));
    up(dg, encode(to_strided(g, B, Sq, H, D, c.pad, 3.0), t));
    up(dout, encode(to_strided(ro, B, Sq, H, D, c.pad, 3.0), t));
    up(dl, encode(rl, acc));

    // accumulate: grads start from random values (pad included) that must be added to / kept
    const auto q_init = randn(rng, nqs), k_init = randn(rng, nks), v_init = randn(rng, nks);

    ra_attn_bwd_params bp;
    memset(&bp, 0, sizeof bp);
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

    // forward on the same layout and positions
    ra_attn_fwd_params f;
    memset(&f, 0, sizeof f);
    f.q = dq_.p; f.k = dk_.p; f.v = dv_.p; f.out = fout.p; f.lse = fl.p;
    f.dtype = f.out_dtype = t;
    f.batch = B; f.seqlen_q = Sq; f.seqlen_k = Sk; f.heads = H; f.heads_kv = Hk; f.head_dim = D;
    f.q_batch_stride = bp.q_batch_stride; f.q_seq_stride = qrow; f.q_head_stride = D;
    f.k_batch_stride = bp.k_batch_stride; f.k_seq_stride = krow; f.k_head_stride = D;
    f.v_batch_stride = bp.v_batch_stride; f.v_seq_stride = krow; f.v_head_stride = D;
    f.out_batch_stride = bp.q_batch_stride; f.out_seq_stride = qrow; f.out_head_stride = D;
    f.lse_batch_stride = bp.lse_batch_stride; f.lse_head_stride = Sq; f.lse_seq_stride = 1;
    f.scale = bp.scale; f.causal = c.causal;
    f.q_pos_offset = c.qoff; f.q_pos_stride = c.qstr; f.k_pos_offset = c.koff; f.k_pos_stride = c.kstr;
    RK(ra_cuda_attn_fwd(&f, 0));
    CK(cudaDeviceSynchronize());
    bool ok = cmp("out", from_strided(down(fout, nqs, t), B, Sq, H, D, c.pad), ro, fwd_tol(t)) &&
              cmp("lse", down(fl, nl, acc), rl, fwd_tol(t));
    if (ok && g_two_families && (D == 64 || D == 128) && esize(t) == 2) {
        // the mma.sync family's forward on the same layout
        force_kernels(SM80);
        RK(ra_cuda_attn_fwd(&f, 0));
        CK(cudaDeviceSynchronize());
        force_kernels(FAST);
        ok = cmp("out (sm80)", from_strided(down(fout, nqs, t), B, Sq, H, D, c.pad), ro,
                 fwd_tol(t)) &&
             cmp("lse (sm80)", down(fl, nl, acc), rl, fwd_tol(t));
    }

    // one backward into fresh grads (NaN-filled unless accumulating); returns the raw buffers
    struct Grads { std::vector<double> dq, dk, dv; };
    auto run = [&](bool generic, bool deterministic) {
        Dev gq(nqs * esize(gt)), gk(nks * esize(gt)), gv(nks * esize(gt));
        if (c.accumulate) {
            up(gq, encode(q_init, gt)); up(gk, encode(k_init, gt)); up(gv, encode(v_init, gt));
        }
        ra_attn_bwd_params r = bp;
        r.dq = gq.p; r.dk = gk.p; r.dv = gv.p;
        r.deterministic = deterministic;
        force_generic(generic);
        RK(ra_cuda_attn_bwd_preprocess(&r, 0));
        RK(ra_cuda_attn_bwd(&r, 0));
        CK(cudaDeviceSynchronize());
        force_generic(false);
        return Grads{down(gq, nqs, gt), down(gk, nks, gt), down(gv, nks, gt)};
    };
    // the fused kernel (deterministic = 0), the split pair twice (its bits
    // must repeat), the generic kernels
    const Grads fused = run(false, false), fast = run(false, true), again = run(false, true);
    const Grads generic = run(true, true);

    for (const Grads *gr : {&fused, &fast}) {
        const char *which = gr == &fused ? "(fused)" : "";
        char nq_[32], nk_[32], nv_[32];
        snprintf(nq_, sizeof nq_, "dq%s", which);
        snprintf(nk_, sizeof nk_, "dk%s", which);
        snprintf(nv_, sizeof nv_, "dv%s", which);
        if (c.accumulate) {
            // whole buffers: init + grad on the logical elements, init untouched in the pad
            auto want = [&](const std::vector<double> &init, const std::vector<double> &ref, int S,
                            int Hh) {
                auto w = to_strided(ref, B, S, Hh, D, c.pad, 0.0);
                for (size_t i = 0; i < w.size(); i++) w[i] += init[i];
                return w;
            };
            ok = ok && cmp(nq_, gr->dq, want(q_init, rdq, Sq, H), tol) &&
                 cmp(nk_, gr->dk, want(k_init, rdk, Sk, Hk), tol) &&
                 cmp(nv_, gr->dv, want(v_init, rdv, Sk, Hk), tol);
        } else {
            ok = ok && cmp(nq_, from_strided(gr->dq, B, Sq, H, D, c.pad), rdq, tol) &&
                 cmp(nk_, from_strided(gr->dk, B, Sk, Hk, D, c.pad), rdk, tol) &&
                 cmp(nv_, from_strided(gr->dv, B, Sk, Hk, D, c.pad), rdv, tol);
        }
    }
    // logical elements only: the pad of non-accumulated grads stays NaN
    ok = ok &&
         cmp("dq vs generic", from_strided(fast.dq, B, Sq, H, D, c.pad),
             from_strided(generic.dq, B, Sq, H, D, c.pad), tol) &&
         cmp("dk vs generic", from_strided(fast.dk, B, Sk, Hk, D, c.pad),
             from_strided(generic.dk, B, Sk, Hk, D, c.pad), tol) &&
         cmp("dv vs generic", from_strided(fast.dv, B, Sk, Hk, D, c.pad),
             from_strided(generic.dv, B, Sk, Hk, D, c.pad), tol);
    auto same_bits = [](const std::vector<double> &a, const std::vector<double> &b) {
        for (size_t i = 0; i < a.size(); i++)  // NaN pads compare by bits too
            if (memcmp(&a[i], &b[i], sizeof(double)) != 0) return false;
        return true;
    };
    if (ok && !(same_bits(fast.dq, again.dq) && same_bits(fast.dk, again.dk) &&
                same_bits(fast.dv, again.dv))) {
        printf("    two deterministic runs differ in their bits\n");
        ok = false;
    }
    // the fused kernel writes only the logical elements too: the pad of
    // non-accumulated grads stays NaN, of accumulated ones init
    auto same_pad = [&](const std::vector<double> &a, const std::vector<double> &b, int S, int Hh) {
        return same_bits(from_pad(a, B, S, Hh, D, c.pad), from_pad(b, B, S, Hh, D, c.pad));
    };
    if (ok && !(same_pad(fused.dq, fast.dq, Sq, H) && same_pad(fused.dk, fast.dk, Sk, Hk) &&
                same_pad(fused.dv, fast.dv, Sk, Hk))) {
        printf("    the fused kernel wrote into the pad\n");
        ok = false;
    }
    printf("%-4s strided %-8s B=%d Sq=%d Sk=%d H=%d Hkv=%d D=%d causal=%d pos=(%ld+%ld i, %ld+%ld j) "
           "pad=%d grad=%s acc=%d\n", ok ? "ok" : "FAIL", ra_dtype_name(t), B, Sq, Sk, H, Hk, D,
           (int)c.causal, c.qoff, c.qstr, c.koff, c.kstr, c.pad, ra_dtype_name(gt), (int)c.accumulate);
    return ok;
}

/* ---- masks: documents, windows, soft-capping ---------------------------- */

struct MaskCase {
    int B, Sq, Sk, H, Hk;
    bool causal;
    long qoff, koff, str;  // positions (qoff LONG_MIN: bottom-right), both strides `str`
    int docs;              // 0 none; runs of 1..40 (1), 1..300 (3); random ids in [0, 3) (2)
    bool window;
    long left, right;      // < 0: unbounded side
    double softcap, q_scale;
    bool accumulate;       // also as two key chunks of a running state / added grads
};

/* Segment ids of the documents `kind` laid over positions pmin .. pmin + n - 1
 * of each of B batch rows: runs (sorted, lengths from 1) or random ids. */
static std::vector<int> doc_layout(int kind, int B, long n, std::mt19937_64 &rng) {
    std::vector<int> ids((size_t)B * n);
    const int longest = kind == 3 ? 300 : 40;
    for (int b = 0; b < B; b++) {
        int id = 0;
        long left = 0;
        for (long p = 0; p < n; p++) {
            if (kind == 2) {
                ids[(size_t)b * n + p] = (int)(rng() % 3);
                continue;
            }
            if (left == 0) {
                left = 1 + (long)(rng() % longest);
                id++;
            }
            ids[(size_t)b * n + p] = id;
            left--;
        }
    }
    return ids;
}

/* The forward (out in t and, with accumulate, as a running state over two
 * key chunks) and the backward (grads in t and, with accumulate, added
 * into float grads over the same two chunks) under the masks of `c`,
 * against the float64 reference. */
static bool run_masked(ra_dtype t, int D, const MaskCase &c, Kern kern) {
    const bool bwd = kern != SM80 || g_bwd_families;
    const int B = c.B, Sq = c.Sq, Sk = c.Sk, H = c.H, Hk = c.Hk;
    std::mt19937_64 rng(Sq * 7 + Sk * 3 + D + 100 * c.docs + 10 * c.left + c.right + (int)t);
    Layout lay;
    lay.qoff = c.qoff == LONG_MIN ? (long)(Sk - Sq) * c.str : c.qoff;
    lay.koff = c.koff; lay.qstr = lay.kstr = c.str;
    RefMask &m = lay.mask;
    if (c.docs) {
        // one layout over every position q and k use, so kv ids differ from q ids
        const long pmin = std::min(lay.qoff, lay.koff);
        const long pmax = std::max(lay.qoff + (Sq - 1) * c.str, lay.koff + (Sk - 1) * c.str);
        const long n = pmax - pmin + 1;
        const auto ids = doc_layout(c.docs, B, n, rng);
        m.qids.resize((size_t)B * Sq);
        m.kids.resize((size_t)B * Sk);
        for (int b = 0; b < B; b++) {
            for (int i = 0; i < Sq; i++)
                m.qids[(size_t)b * Sq + i] = ids[(size_t)b * n + lay.qoff + i * c.str - pmin];
            for (int j = 0; j < Sk; j++)
                m.kids[(size_t)b * Sk + j] = ids[(size_t)b * n + lay.koff + j * c.str - pmin];
        }
    }
    m.window = c.window; m.left = c.left; m.right = c.right; m.softcap = c.softcap;
    Problem pr(t, B, Sq, Sk, H, Hk, D, c.causal, rng, c.q_scale, lay);
    const ra_dtype acc = pr.acc;
    const size_t nq = pr.nq, nk = pr.nk, nl = pr.nl;
    const double tol = fwd_tol(t), btol = bwd_tol(t);
    force_kernels(kern);
    pr.forward();
    CK(cudaDeviceSynchronize());
    bool ok = cmp("out", down(pr.dout, nq, t), pr.ro, tol) &&
              cmp("lse", down(pr.dl, nl, acc), pr.rl, tol);
    // the fused backward, then the deterministic one (the generic kernels: one)
    const bool tc = (t == RA_FLOAT16 || t == RA_BFLOAT16) && (D == 64 || D == 128);
    for (int det = kern == GENERIC ? 1 : 0; bwd && det < 2 && ok; det++) {
        // the backward of a two-family device, masked or not: the wgmma one
        // (deterministic: its dk/dv pass, then its dq pass)
        const int want = kern == GENERIC || !tc ? 2 : kern == FAST && g_two_families ? 0 : 1;
        if (!backward_ran(pr, det != 0, want)) {
            ok = false;
            break;
        }
        ok = cmp(det ? "dq" : "dq(fused)", down(pr.gq, nq, t), pr.rdq, btol) &&
             cmp(det ? "dk" : "dk(fused)", down(pr.gk, nk, t), pr.rdk, btol) &&
             cmp(det ? "dv" : "dv(fused)", down(pr.gv, nk, t), pr.rdv, btol);
    }

    for (int det = kern == GENERIC || !bwd ? 1 : 0; det < 2 && ok && c.accumulate && Sk >= 2;
         det++) {
        // two key chunks, the second at its offsets (k, v, kv ids, positions,
        // dk, dv): a running forward state, and grads added into zeros
        const int split = Sk / 3 + 1;
        const size_t kb = (size_t)split * pr.f.k_seq_stride * esize(t);
        Dev so(nq * esize(acc)), sl(nl * esize(acc));
        Dev aq(nq * esize(acc)), ak(nk * esize(acc)), av(nk * esize(acc));
        CK(cudaMemset(aq.p, 0, aq.n)); CK(cudaMemset(ak.p, 0, ak.n)); CK(cudaMemset(av.p, 0, av.n));
        RK(ra_cuda_fill_state(so.p, sl.p, acc, B, Sq, H, D, pr.f.out_batch_stride,
                              pr.f.out_seq_stride, D, pr.f.lse_batch_stride, Sq, 1, 0));
        ra_attn_fwd_params a = pr.f;
        a.out = so.p; a.lse = sl.p; a.out_dtype = acc; a.accumulate = 1;
        ra_attn_bwd_params g = pr.b;
        g.dq = aq.p; g.dk = ak.p; g.dv = av.p; g.grad_dtype = acc; g.accumulate = 1;
        g.deterministic = det;
        for (int part = 0; part < 2; part++) {
            const size_t off = part ? kb : 0, aoff = part ? kb / esize(t) * esize(acc) : 0;
            a.k = g.k = (const unsigned char *)pr.dk_.p + off;
            a.v = g.v = (const unsigned char *)pr.dv_.p + off;
            g.dk = (unsigned char *)ak.p + aoff;
            g.dv = (unsigned char *)av.p + aoff;
            a.seqlen_k = g.seqlen_k = part ? Sk - split : split;
            a.k_pos_offset = g.k_pos_offset = lay.koff + (part ? split * lay.kstr : 0);
            if (c.docs)
                a.mask.kv_segment_ids = g.mask.kv_segment_ids =
                    (const int32_t *)pr.kids.p + (part ? split : 0);
            RK(ra_cuda_attn_fwd(&a, 0));
            if (bwd) RK(ra_cuda_attn_bwd(&g, 0));  // delta from the first backward
        }
        CK(cudaDeviceSynchronize());
        ok = ok && cmp("acc out", down(so, nq, acc), pr.ro, tol) &&
             cmp("acc lse", down(sl, nl, acc), pr.rl, tol);
        if (bwd)
            ok = ok && cmp(det ? "acc dq" : "acc dq(fused)", down(aq, nq, acc), pr.rdq, btol) &&
                 cmp(det ? "acc dk" : "acc dk(fused)", down(ak, nk, acc), pr.rdk, btol) &&
                 cmp(det ? "acc dv" : "acc dv(fused)", down(av, nk, acc), pr.rdv, btol);
    }
    force_kernels(FAST);
    printf("%-4s masked %-8s B=%d Sq=%d Sk=%d H=%d Hkv=%d D=%d causal=%d pos=(%ld, %ld)*%ld "
           "docs=%d window=%s(%ld,%ld) softcap=%g q*%g acc=%d%s\n", ok ? "ok" : "FAIL",
           ra_dtype_name(t), B, Sq, Sk, H, Hk, D, (int)c.causal, lay.qoff, lay.koff, c.str, c.docs,
           c.window ? "" : "none", c.left, c.right, c.softcap, c.q_scale, (int)c.accumulate,
           kern_label(kern));
    return ok;
}

/* ---- k and v shared by the batch (stride 0) ----------------------------- */

/* k, v of one batch row read by every batch row of q (batch stride 0): the
 * Hopper kernels' tensor maps take no broadcast axis, so the dispatcher
 * runs the mma.sync kernel (the forward-kernel counters show which ran),
 * whose result must be the reference's with k, v repeated. */
static bool run_broadcast(ra_dtype t, int D, bool causal) {
    const int B = 2, Sq = 70, Sk = 90, H = 2, Hk = 1;
    std::mt19937_64 rng(D * 3 + causal + (int)t);
    const size_t nq = (size_t)B * Sq * H * D, nk1 = (size_t)Sk * Hk * D, nl = (size_t)B * H * Sq;
    const auto q = rounded(randn(rng, nq), t), k1 = rounded(randn(rng, nk1), t);
    const auto v1 = rounded(randn(rng, nk1), t), g = rounded(randn(rng, nq), t);
    std::vector<double> k(k1), v(v1), ro, rl, rdq, rdk, rdv;
    k.insert(k.end(), k1.begin(), k1.end());
    v.insert(v.end(), v1.begin(), v1.end());
    reference(B, Sq, Sk, H, Hk, D, causal, Sk - Sq, 0, q, k, v, g, ro, rl, rdq, rdk, rdv);
    const ra_dtype acc = ra_acc_dtype(t);
    Dev dq_(nq * esize(t)), dk_(nk1 * esize(t)), dv_(nk1 * esize(t)), dout(nq * esize(t));
    Dev dl(nl * esize(acc));
    up(dq_, encode(q, t)); up(dk_, encode(k1, t)); up(dv_, encode(v1, t));
    ra_attn_fwd_params f = fwd_params(t, B, Sq, Sk, H, Hk, D, causal, Sk - Sq);
    f.q = dq_.p; f.k = dk_.p; f.v = dv_.p; f.out = dout.p; f.lse = dl.p;
    f.k_batch_stride = f.v_batch_stride = 0;   // every batch row reads k, v of row 0
    unsigned long long before[3], after[3];
    ra_cuda_fwd_kernel_counts(before);
    RK(ra_cuda_attn_fwd(&f, 0));
    CK(cudaDeviceSynchronize());
    ra_cuda_fwd_kernel_counts(after);
    bool ok = cmp("out", down(dout, nq, t), ro, fwd_tol(t)) &&
              cmp("lse", down(dl, nl, acc), rl, fwd_tol(t));
    if (ok && (after[0] != before[0] || after[1] != before[1] + 1)) {
        printf("    the forward ran %llu sm90a, %llu sm80 kernels, expected the sm80 one\n",
               after[0] - before[0], after[1] - before[1]);
        ok = false;
    }
    printf("%-4s broadcast kv %-8s B=%d Sq=%d Sk=%d D=%d causal=%d\n", ok ? "ok" : "FAIL",
           ra_dtype_name(t), B, Sq, Sk, D, (int)causal);
    return ok;
}

/* ---- huge but finite scores -------------------------------------------- */

/* q scaled by `factor`: the softmax is one-hot, P recomputed in the
 * backward from lse must stay <= 1 and be exact (1 for a row's dominant
 * key) although lse and the recomputed score round differently by many
 * units.  out, lse, dv and dq are checked against the reference; dk =
 * scale * sum dS q carries q's magnitude, so its error is measured against
 * max |q|.  The backward runs twice: with the lse of one forward call, and
 * with the lse of a running state merged over two key chunks (a ring's,
 * rounded once more). */
static bool run_huge(ra_dtype t, int D, bool causal, double factor) {
    std::mt19937_64 rng(D * 7 + causal + (int)t);
    Problem pr(t, 1, 70, 90, 2, 1, D, causal, rng, factor);
    bool ok = true;
    if (g_two_families && (D == 64 || D == 128) && esize(t) == 2) {
        // the mma.sync family's forward first (the backward below reads the
        // default family's out and lse)
        force_kernels(SM80);
        pr.forward();
        CK(cudaDeviceSynchronize());
        force_kernels(FAST);
        ok = cmp("out (sm80)", down(pr.dout, pr.nq, t), pr.ro, fwd_tol(t)) &&
             cmp("lse (sm80)", down(pr.dl, pr.nl, pr.acc), pr.rl, fwd_tol(t));
    }
    pr.forward();
    CK(cudaDeviceSynchronize());
    double qmax = 0;
    for (double x : pr.q) qmax = std::max(qmax, std::fabs(x));
    const double tol = bwd_tol(t);
    ok = ok && cmp("out", down(pr.dout, pr.nq, t), pr.ro, fwd_tol(t)) &&
         cmp("lse", down(pr.dl, pr.nl, pr.acc), pr.rl, fwd_tol(t));
    for (int run = 0; run < 4 && ok; run++) {
        const bool merged = run >= 2, det = run % 2;  // fused, then the split pair
        if (run == 2) {
            // lse of keys [0, 40) and [40, 90) merged into a running state
            Dev so(pr.nq * esize(pr.acc));
            RK(ra_cuda_fill_state(so.p, pr.dl.p, pr.acc, 1, pr.Sq, pr.H, D, pr.f.out_batch_stride,
                                  pr.f.out_seq_stride, D, pr.f.lse_batch_stride, pr.Sq, 1, 0));
            ra_attn_fwd_params a = pr.f;
            a.out = so.p; a.out_dtype = pr.acc; a.accumulate = 1; a.seqlen_k = 40;
            RK(ra_cuda_attn_fwd(&a, 0));
            a.k = (const unsigned char *)pr.dk_.p + (size_t)40 * a.k_seq_stride * esize(t);
            a.v = (const unsigned char *)pr.dv_.p + (size_t)40 * a.v_seq_stride * esize(t);
            a.seqlen_k = 50; a.k_pos_offset = 40;
            RK(ra_cuda_attn_fwd(&a, 0));
        }
        pr.backward(det);
        CK(cudaDeviceSynchronize());
        const auto gdq = down(pr.gq, pr.nq, t), gdk = down(pr.gk, pr.nk, t);
        const auto gdv = down(pr.gv, pr.nk, t);
        ok = all_finite("dq", gdq) && all_finite("dk", gdk) && all_finite("dv", gdv) &&
             cmp("dv", gdv, pr.rdv, tol) && cmp("dq", gdq, pr.rdq, tol) &&
             cmp("dk", gdk, pr.rdk, tol, qmax);
        if (!ok)
            printf("    (%s, with the lse %s)\n", det ? "deterministic" : "fused",
                   merged ? "merged over two chunks" : "of one call");
    }
    printf("%-4s huge %-8s q*%g D=%d causal=%d\n", ok ? "ok" : "FAIL", ra_dtype_name(t), factor, D,
           (int)causal);
    return ok;
}

/* ---- merge and copy ------------------------------------------------------ */

/* The LSE merge of attention over keys [0, split) (out in t) and [split,
 * S_k) (out in the acc dtype), into t: equals attention over all keys. */
static bool run_merge(ra_dtype t, int D) {
    const int B = 2, Sq = 33, Sk = 90, H = 2, split = 40;
    std::mt19937_64 rng(D + 11 * (int)t);
    Problem pr(t, B, Sq, Sk, H, H, D, false, rng);
    const size_t nq = pr.nq, nl = pr.nl;
    const ra_dtype acc = pr.acc;
    Dev o1(nq * esize(t)), o2(nq * esize(acc)), o(nq * esize(t));
    Dev l1(nl * esize(acc)), l2(nl * esize(acc)), l(nl * esize(acc));
    ra_attn_fwd_params f = pr.f;
    f.seqlen_k = split; f.out = o1.p; f.lse = l1.p;
    RK(ra_cuda_attn_fwd(&f, 0));
    f.k = (const unsigned char *)pr.dk_.p + (size_t)split * f.k_seq_stride * esize(t);
    f.v = (const unsigned char *)pr.dv_.p + (size_t)split * f.k_seq_stride * esize(t);
    f.seqlen_k = Sk - split; f.out = o2.p; f.out_dtype = acc; f.lse = l2.p;
    RK(ra_cuda_attn_fwd(&f, 0));
    ra_merge_params m;
    memset(&m, 0, sizeof m);
    m.out1 = o1.p; m.lse1 = l1.p; m.out2 = o2.p; m.lse2 = l2.p; m.out = o.p; m.lse = l.p;
    m.out1_dtype = t; m.out2_dtype = acc; m.out_dtype = t; m.lse_dtype = acc;
    m.batch = B; m.seqlen = Sq; m.heads = H; m.head_dim = D;
    // outs (B, S, H, D) contiguous; lses (B, H, S)
    m.out1_batch_stride = m.out2_batch_stride = m.out_batch_stride = (int64_t)Sq * H * D;
    m.out1_seq_stride = m.out2_seq_stride = m.out_seq_stride = (int64_t)H * D;
    m.out1_head_stride = m.out2_head_stride = m.out_head_stride = D;
    m.lse1_batch_stride = m.lse2_batch_stride = m.lse_batch_stride = (int64_t)H * Sq;
    m.lse1_head_stride = m.lse2_head_stride = m.lse_head_stride = Sq;
    m.lse1_seq_stride = m.lse2_seq_stride = m.lse_seq_stride = 1;
    RK(ra_cuda_merge(&m, 0));
    CK(cudaDeviceSynchronize());
    const bool ok = cmp("merged out", down(o, nq, t), pr.ro, fwd_tol(t)) &&
                    cmp("merged lse", down(l, nl, acc), pr.rl, fwd_tol(t));
    printf("%-4s merge %-8s D=%d\n", ok ? "ok" : "FAIL", ra_dtype_name(t), D);
    return ok;
}

/* dst (4, 5, 6) contiguous = cast(src viewed transposed (2, 0, 1)); the
 * result equals the host conversion of the same values exactly. */
static bool run_copy(ra_dtype s, ra_dtype d) {
    const int n0 = 4, n1 = 5, n2 = 6, n = n0 * n1 * n2;
    std::mt19937_64 rng(17 * (int)s + (int)d);
    const auto x = rounded(randn(rng, n), s);     // stored as (n1, n2, n0)
    Dev src(n * esize(s)), dst(n * esize(d));
    up(src, encode(x, s));
    ra_copy_params p;
    memset(&p, 0, sizeof p);
    p.ndim = 3; p.shape[0] = n0; p.shape[1] = n1; p.shape[2] = n2;
    p.src = src.p; p.src_dtype = s;
    p.src_strides[0] = 1; p.src_strides[1] = (int64_t)n2 * n0; p.src_strides[2] = n0;
    p.dst = dst.p; p.dst_dtype = d;
    p.dst_strides[0] = (int64_t)n1 * n2; p.dst_strides[1] = n2; p.dst_strides[2] = 1;
    RK(ra_cuda_copy(&p, 0));
    CK(cudaDeviceSynchronize());
    std::vector<double> want(n);
    for (int a = 0; a < n0; a++)
        for (int b = 0; b < n1; b++)
            for (int c = 0; c < n2; c++) want[(a * n1 + b) * n2 + c] = x[(b * n2 + c) * n0 + a];
    const bool ok = cmp("copy", down(dst, n, d), rounded(want, d), 0.0);
    printf("%-4s copy %s -> %s\n", ok ? "ok" : "FAIL", ra_dtype_name(s), ra_dtype_name(d));
    return ok;
}

/* ---- the grids ------------------------------------------------------------ */

/* Which cases of the grid this run takes: every case has an index in grid
 * order; shard i of n (1-based) runs the cases with index % n == i - 1, so
 * the n shards together run every case exactly once.  A dry run ("plan")
 * walks the same grid and runs nothing, to count the cases. */
struct Grid {
    int shard = 0, shards = 1;  // 0-based shard of `shards`
    bool dry = false;
    int index = 0, ran = 0, fails = 0;
    template <class Case> void run(Case &&one_case) {
        if (index++ % shards != shard) return;
        ran++;
        if (!dry && !one_case()) fails++;
    }
};

/* "I/N" with 1 <= I <= N <= 1000 */
static bool parse_shard(const char *s, Grid &g) {
    int i = 0, n = 0, used = 0;
    if (sscanf(s, "%d/%d%n", &i, &n, &used) != 2 || s[used] != '\0' || n < 1 || n > 1000 ||
        i < 1 || i > n)
        return false;
    g.shard = i - 1;
    g.shards = n;
    return true;
}

int main(int argc, char **argv) {
    // selftest [plan] [quick|full] [I/N]
    int a = 1;
    Grid grid;
    if (a < argc && strcmp(argv[a], "plan") == 0) grid.dry = true, a++;
    const char *which = a < argc ? argv[a++] : "full";
    const bool quick = strcmp(which, "quick") == 0;
    const bool sharded = a < argc;
    if ((!quick && strcmp(which, "full") != 0) || (sharded && !parse_shard(argv[a++], grid)) ||
        a < argc) {
        fprintf(stderr, "usage: %s [plan] [quick|full] [I/N]  (shard I of N, 1 <= I <= N)\n",
                argv[0]);
        return 2;
    }
    int dev_count = 0;
    if (!grid.dry && (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0)) {
        printf("selftest: no CUDA device\n");
        return 2;
    }
    // the tensor-core kernels run in every family the device has
    const char *family = "sm80";
    RK(ra_cuda_kernel_family(0, &family));
    g_two_families = strcmp(family, "sm90a") == 0;
    printf("selftest: tensor-core kernel families %s\n", g_two_families ? "sm90a, sm80" : "sm80");
    const ra_dtype dts[] = {RA_BFLOAT16, RA_FLOAT16, RA_FLOAT32, RA_FLOAT64};
    const int dims[] = {8, 59, 64, 96, 128, 256};
    //                         B   Sq   Sk  H  Hkv
    const int shapes[][5] = {{1, 1, 1, 1, 1}, {2, 7, 7, 2, 2}, {1, 113, 113, 4, 2},
                             {2, 65, 200, 3, 1}, {1, 200, 65, 2, 2}, {1, 130, 257, 2, 1}};
    const int quick_shape[5] = {2, 17, 40, 2, 1};  // GQA, S_q != S_k, 2 query blocks
    for (ra_dtype t : dts)
        for (int D : dims) {
            const bool tc = (t == RA_FLOAT16 || t == RA_BFLOAT16) && (D == 64 || D == 128);
            if (quick) {
                const int *s = quick_shape;
                g_bwd_families = true;
                grid.run([&] { return run_case(t, s[0], s[1], s[2], s[3], s[4], D, true,
                                               FAST); });
                if (tc && g_two_families)
                    grid.run([&] { return run_case(t, s[0], s[1], s[2], s[3], s[4], D, true,
                                                   SM80); });
                continue;
            }
            for (const auto &s : shapes)
                for (int c = 0; c < 2; c++) {
                    grid.run([&] { return run_case(t, s[0], s[1], s[2], s[3], s[4], D, c,
                                                   FAST); });
                    if (tc)
                        grid.run([&] { return run_case(t, s[0], s[1], s[2], s[3], s[4], D, c,
                                                       GENERIC); });
                    // the mma.sync backward on two shapes (S_q != S_k both ways)
                    g_bwd_families = &s == &shapes[3] || &s == &shapes[5];
                    if (tc && g_two_families)
                        grid.run([&] { return run_case(t, s[0], s[1], s[2], s[3], s[4], D, c,
                                                       SM80); });
                    g_bwd_families = false;
                }
        }
    g_bwd_families = false;
    // odd sizes, GQA, S_q != S_k, empty query rows (causal with S_q > S_k),
    // keys no query sees, affine positions, padded strides, float32 grads
    // and accumulate
    const StridedCase strided_cases[] = {
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
    for (ra_dtype t : dts)
        for (int D : {64, 128, 59, 96})
            for (size_t ci = 0; ci < sizeof strided_cases / sizeof strided_cases[0]; ci++) {
                const bool sixteen = t == RA_FLOAT16 || t == RA_BFLOAT16;
                // the tensor-core kernels on every case; the generic ones as a control
                // quick: float32 grads and accumulate on each tensor-core
                // instantiation (16-bit grads ran in run_case)
                if (quick && (!(ci == 4 || ci == 7) || !sixteen || D == 59 || D == 96)) continue;
                if (!sixteen && D != 59) continue;
                if (sixteen && (D == 59 || D == 96) && ci % 4 != 0) continue;
                StridedCase c = strided_cases[ci];
                c.D = D;
                grid.run([&] { return run_strided(t, c); });
            }
    // masks: documents (runs from length 1, random unsorted ids, long
    // runs whose tiles lie in one document), windows ((0,0), (1,0),
    // asymmetric, wider than n, one-sided), softcap with large scores, with
    // causal, GQA/MQA, S_q != S_k, ring positions (offsets, strides, keys
    // wholly in the future) and accumulate; long sequences walk the document
    // tiles over several chunks
    const long BR = LONG_MIN;  // bottom-right positions
    const MaskCase mask_cases[] = {
        // B  Sq    Sk  H Hk causal qoff koff str docs win  left right cap  q*  acc
        {2, 150,  150, 4, 2, true,  BR,    0, 1, 1, false,   -1,  -1,  0,  1, false},
        {2,  97,  150, 4, 1, false, BR,    0, 1, 2, false,   -1,  -1,  0,  1, false},
        {1, 150,   97, 2, 2, true,  BR,    0, 1, 2, false,   -1,  -1,  0,  1, false},
        {1, 130,  130, 2, 1, true,  BR,    0, 1, 0, true,     0,   0,  0,  1, false},
        {2, 130,  130, 4, 2, true,  BR,    0, 1, 0, true,     1,   0,  0,  1, false},
        {1,  97,  200, 2, 1, false, BR,    0, 1, 0, true,     5,  17,  0,  1, false},
        {1, 150,  150, 2, 2, true,  BR,    0, 1, 0, true,  1000, 1000, 0,  1, false},
        {1, 150,  150, 2, 1, false, BR,    0, 1, 0, true,    -1,   3,  0,  1, false},
        {1, 150,  150, 2, 1, false, BR,    0, 1, 0, true,     7,  -1,  0,  1, false},
        {1, 130,  130, 2, 1, true,  BR,    0, 1, 0, false,   -1,  -1,  5,  8, false},
        {2,  97,  150, 4, 2, false, BR,    0, 1, 0, false,   -1,  -1, 30,  3, false},
        {2, 150,  150, 4, 2, true,  BR,    0, 1, 1, true,    20,   0, 10,  4, false},
        {1, 100,  160, 2, 1, true,  300, 100, 1, 3, true,   250,   0,  0,  1, false},
        {1,  90,   70, 2, 1, true,    0, 200, 1, 1, true,    50,  50,  7,  1, false},
        {1,  80,   90, 2, 1, true,    1,   2, 3, 1, true,    10,   0,  0,  1, false},
        {1, 200,  260, 4, 2, true,  BR,    0, 1, 3, true,    40,   0, 20,  2, true},
        {2,  97,  150, 2, 1, false, BR,    0, 1, 2, true,     3,   9,  0,  1, true},
        {1,  70, 9000, 2, 1, true,  BR,    0, 1, 3, false,   -1,  -1,  0,  1, false},
        {1, 9000,  70, 2, 1, false, BR,    0, 1, 3, false,   -1,  -1,  0,  1, false},
    };
    const int n_mask_cases = sizeof mask_cases / sizeof mask_cases[0];
    // quick: each masked instantiation once (documents, window, softcap, causal,
    // GQA, S_q != S_k), and the long document walks
    const MaskCase quick_mask = {1, 40, 70, 2, 1, true, BR, 0, 1, 1, true, 9, 2, 6, 3, false};
    for (ra_dtype t : dts) {
        const bool sixteen = t == RA_FLOAT16 || t == RA_BFLOAT16;
        for (int D : dims) {
            const bool tc = sixteen && (D == 64 || D == 128);
            if (quick) {
                // the generic kernels by lane width (D 8 and 59 share one), the
                // tensor-core ones
                if (tc || D == 8 || D == 59 || D == 96 || D == 256)
                    grid.run([&] { return run_masked(t, D, quick_mask, FAST); });
                g_bwd_families = true;   // the masked mma.sync backward too
                if (tc && g_two_families)
                    grid.run([&] { return run_masked(t, D, quick_mask, SM80); });
                g_bwd_families = false;
                if (t == RA_BFLOAT16 && (D == 59 || D == 64))  // the long walks
                    for (int ci = n_mask_cases - 2; ci < n_mask_cases; ci++)
                        grid.run([&] { return run_masked(t, D, mask_cases[ci], FAST); });
                continue;
            }
            // the tensor-core kernels (and the generic ones as a control on every
            // third case); float32 at two lane widths, float64 at one; every
            // dtype at the other lane widths (D 8 below 32 lanes, 96, 256) on a
            // third of the cases each
            const bool every = tc || (D == 59 && !sixteen) || (t == RA_FLOAT32 && D == 128);
            const bool third = !tc && (D == 8 || D == 96 || D == 256);
            if (!every && !third) continue;
            for (int ci = 0; ci < n_mask_cases; ci++) {
                if (!every && ci % 3 != D % 3) continue;
                grid.run([&] { return run_masked(t, D, mask_cases[ci], FAST); });
                if (tc && ci % 3 == 0)
                    grid.run([&] { return run_masked(t, D, mask_cases[ci], GENERIC); });
                g_bwd_families = true;   // the masked mma.sync backward too
                if (tc && g_two_families && ci % 3 == 1)
                    grid.run([&] { return run_masked(t, D, mask_cases[ci], SM80); });
                g_bwd_families = false;
            }
        }
    }
    // huge scores: right gradients on the generic kernels and the
    // tensor-core ones (the exponent rule of cuda/mask.cuh)
    for (int c = 0; c < 2; c++) {
        if (quick && c == 0) continue;
        grid.run([&] { return run_huge(RA_FLOAT32, 59, c, 1e9); });
        grid.run([&] { return run_huge(RA_FLOAT64, 59, c, 1e18); });
        grid.run([&] { return run_huge(RA_FLOAT16, 64, c, 300.0); });
        grid.run([&] { return run_huge(RA_BFLOAT16, 64, c, 1e4); });
        grid.run([&] { return run_huge(RA_BFLOAT16, 64, c, 1e9); });
        if (!quick) {
            grid.run([&] { return run_huge(RA_FLOAT32, 128, c, 1e9); });
            grid.run([&] { return run_huge(RA_BFLOAT16, 96, c, 1e9); });
            grid.run([&] { return run_huge(RA_FLOAT16, 128, c, 300.0); });
            grid.run([&] { return run_huge(RA_BFLOAT16, 128, c, 1e9); });
        }
    }
    // a broadcast k, v (batch stride 0): the mma.sync kernel's, on every device
    for (ra_dtype t : {RA_BFLOAT16, RA_FLOAT16})
        for (int D : {64, 128}) {
            if (quick && (t == RA_FLOAT16 || D == 64)) continue;
            grid.run([&] { return run_broadcast(t, D, D == 128); });
        }
    for (ra_dtype t : dts)
        for (int D : {59, 64}) {
            if (quick && D == 64 && (t == RA_FLOAT32 || t == RA_FLOAT64)) continue;
            grid.run([&] { return run_merge(t, D); });
        }
    for (ra_dtype s : dts)
        for (ra_dtype d : dts) grid.run([&] { return run_copy(s, d); });
    if (grid.dry)
        printf("selftest plan %s %d/%d: %d of %d cases\n", which, grid.shard + 1, grid.shards,
               grid.ran, grid.index);
    else if (sharded)  // the grid's cases are numbered from 0
        printf("selftest %s %d/%d: %d of %d cases failed (grid cases %d, %d, %d, ... of %d)\n",
               which, grid.shard + 1, grid.shards, grid.fails, grid.ran, grid.shard,
               grid.shard + grid.shards, grid.shard + 2 * grid.shards, grid.index);
    else
        printf("selftest %s: %d of %d cases failed\n", which, grid.fails, grid.ran);
    return grid.fails ? 1 : 0;
}
