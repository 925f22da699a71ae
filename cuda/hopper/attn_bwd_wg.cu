/*
 * attn_bwd_wg.cu -- the Hopper (sm_90a) attention backward for float16 and
 * bfloat16 with head_dim 64 or 128 (deterministic=False): dq, dk and dv in
 * one pass on warpgroup matrix multiplies (wgmma), bulk tensor copies
 * (TMA) and warp specialisation.  Same contract as the fused mma.sync
 * kernel (attn_bwd_fused.cu, whose header has the formulas): P from the
 * forward's lse by the exponent rule of mask.cuh (bwd_exponent, band_of),
 * dS = P (dP - delta) scale; dk, dv summed over the GQA group; causal,
 * S_q != S_k, ring position offsets and strides; with p.accumulate the
 * gradients (float32) are added into, dq in place, else dq goes through a
 * zeroed float32 scratch and the fused kernel's conversion pass (both by
 * bwd_fused::with_dq_target, so dq's last bits vary from run to run, as
 * the fused kernel's do); rows whose lse is -inf contribute nothing; a NaN
 * score makes the gradients it reaches NaN.  Documents, windows and
 * soft-capping in a second instantiation (M), as the fused kernel applies
 * them: the window bounds the block's query range, a key's visible
 * queries are one span (causal and the window), with documents only the
 * query tiles holding an id of the block's keys are loaded and a tile all
 * of the block's one id skips the id test; a softcap caps the score by
 * the forward's tanh and multiplies dS by 1 - tanh^2.  With p.branches (a
 * branch of dilated attention) the masked instantiation also applies the
 * branch rule (mask.cuh) to its P^T and dS^T fragments (branch_rule).
 *
 * deterministic=True (ra_bwd_wg_dkdv): the same kernel without its dq
 * product (DQ false: no dS^T in shared memory, no barrier between the
 * consumers, no atomics), so each dk, dv element has one writer and the
 * same bits on every run; dq then comes from the wgmma dq pass
 * (hopper/attn_bwd_wg_dq.cu), as in the split pair (attn_bwd.cu).
 *
 * Shapes: q, dout, dq (B, S_q, H, D); k, v, dk, dv (B, S_k, H_kv, D); lse,
 * delta (B, H, S_q) float32.  q, dout, k, v are read through tensor maps
 * made per call (ra_bwd_wg_supported: strides a map can describe); the
 * dispatcher falls back to the fused kernel when the driver cannot make
 * them.
 *
 * Algorithm (shapes and roles: bwd_traits.cuh; products: bwd_mainloop.cuh):
 * a block of three warpgroups owns 128 keys of one (b, hk).  Warp 0 loads
 * K, V once and streams the query tiles (64 rows) of every head of the
 * group that can see the block's keys (causal: from the first query that
 * sees key k0) into a two-stage ring.  Consumer warpgroup c owns keys
 * 64 c.. and per tile, 32 queries at a time at D 128 (64 at D 64), issues
 * S^T = K_c Q^T and dP^T = V_c dout^T, turns them into P^T and dS^T in
 * registers (as 16-bit A fragments; unmasked, P^T is formed while dP^T's
 * product still runs), then issues dV += P^T dout and
 * dK += dS^T Q, stages dS^T in shared memory and, once both consumers
 * have, issues (behind dV and dK, without waiting for them) dQ = dS K over
 * the block's 128 keys for its half of D's
 * columns, whose float32 result it adds into the dq target by
 * red.global.add (one add per element and block, as the fused kernel's).
 * At the end dK and dV go out from the accumulators (added into float32
 * with p.accumulate, else stored as float32 or 16-bit).
 *
 * The masked variant's producer walks tile by tile (every head of the
 * group on a tile, then the next tile) and names each stage's tile in a
 * TileMeta; a stage with m0 = -1 ends the block (bwd_mainloop.cuh
 * produce_masked).
 *
 * Launch: grid B * H_kv * ceil(S_k / 128), 384 threads, one block per SM
 * (setmaxnreg 24 / 240; masked 40 / 232: the document walk's state in the
 * producer spilled at 24), Smem<D>::kLaunchBytes of dynamic shared memory
 * (163 KB at D 128, 99 KB at D 64; the DQ-less pass leaves its dS^T
 * buffers unused).  ptxas (CUDA 13.0) reports spills at D 128 (a few loop
 * invariants of the consumers: 40 bytes stored, 48 loaded, 4 local loads
 * per tile) unmasked, none masked, none without DQ, none at D 64
 * (tests/test_sass_report.py KNOWN_SPILLS).
 */
#include <string.h>

#include "attn_kernels.cuh"
#include "hopper/bwd_mainloop.cuh"
#include "hopper/tensor_map.h"

namespace {

using namespace ra::wgb;
using ra::bwd_fused::DqTarget;
using ra::bwd_fused::RowStats;

constexpr float kLog2e = 1.4426950408889634f;

/* What a consumer thread knows of its two rows (keys a and a + 8), as
 * query indices (32-bit: at D 128 dK and dV hold 128 registers): the
 * queries that see key a, key b are [qbeg, qend) (past S_k: none; without
 * masks qend is S_q, not read).  Rows past S_q need no test: their
 * statistics make P = 0.  With documents the keys' ids. */
struct KeyRows {
    int32_t qbeg_a, qbeg_b;   /* S_q < 2^31 (ra_bwd_wg_supported) */
    int32_t qend_a, qend_b;
    int32_t kid_a, kid_b;
    int32_t key_a;            /* M: key a's index (the branch rule) */
};

__device__ __forceinline__ int32_t first_query(const ra_attn_bwd_params &p, int64_t key) {
    if (key >= p.seqlen_k) return (int32_t)p.seqlen_q;
    return p.causal ? (int32_t)ra::causal_query_begin(key, p.q_pos_offset, p.q_pos_stride,
                                                      p.k_pos_offset, p.k_pos_stride, p.seqlen_q)
                    : 0;
}

/* The masked variant's rows: the queries that see the key under causal
 * and the window (block_queries of a one-key block), and the key's id. */
__device__ __forceinline__ void masked_rows(const ra_attn_bwd_params &p, int64_t b, int64_t key,
                                            int32_t *qbeg, int32_t *qend, int32_t *kid) {
    *qbeg = *qend = *kid = 0;
    if (key >= p.seqlen_k) return;
    const ra::Range qr = ra::block_queries<1, true>(p, key);
    *qbeg = (int32_t)qr.begin;
    *qend = (int32_t)qr.end;
    if (ra::mask_docs(p.mask)) *kid = ra::kv_seg_ids(p.mask, b).at(key);
}

/* the first key of the thread's two rows */
__device__ __forceinline__ int64_t key_a_of(const ra::KBlock &blk, int c) {
    const int warp = (threadIdx.x / 32) % 4, g = (threadIdx.x % 32) / 4;
    return blk.k0 + c * kKeysPerWg + 16 * warp + g;
}

/* What the masked variant's P/dS step needs besides the rows: the
 * softcap's factors (s -> tanh(s cap_in) cap_out, log2 units; cap_in 0:
 * none) and whether the tile's ids need comparing. */
struct TileMask {
    float cap_in, cap_out;
    bool doc_test;
};

/* The first column key a, key b of a thread sees on a tile of NQ queries
 * from m0 (qbeg - m0, clamped to 0..NQ). */
template <int NQ>
__device__ __forceinline__ void first_cols(const KeyRows &kr, int32_t m0, int *lo_a, int *lo_b) {
    const int32_t a = kr.qbeg_a - m0, b = kr.qbeg_b - m0;
    *lo_a = a < 0 ? 0 : a > NQ ? NQ : (int)a;
    *lo_b = b < 0 ? 0 : b > NQ ? NQ : (int)b;
}

/* A thread's walk over its fragment of a tile of NQ queries from m0:
 * f(ia, ib, col, before_a, before_b) for each column col of its two rows
 * (registers ia for key a, ib for key b), and whether col comes before the
 * first query that key sees (first_cols). */
template <int NQ, typename F>
__device__ __forceinline__ void for_frag(const KeyRows &kr, int32_t m0, F f) {
    const int t = threadIdx.x % 4;
    int lo_a, lo_b;
    first_cols<NQ>(kr, m0, &lo_a, &lo_b);
#pragma unroll
    for (int j = 0; j < NQ / 8; j++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int col = 8 * j + 2 * t + e;
            f(4 * j + e, 4 * j + 2 + e, col, col < lo_a, col < lo_b);
        }
    }
}

/* The masked variant's P/dS step, S^T -> P^T and dP^T -> dS^T in place
 * (the fused kernel's P/dS step on the transposed tile: column `col` is
 * query m0 + col, with its row's statistics rows[col]); pairs a mask hides
 * get 0 after the arithmetic, so a NaN score stays NaN only where the pair
 * is visible.  The visible columns of key a are [qbeg_a, qend_a) (and,
 * with tm.doc_test, those of its id); with a softcap the exponent is of
 * the capped score and dS gains 1 - u^2 of the same u = tanh (mask.cuh).
 * The unmasked variant takes two steps (p_step, ds_step). */
template <int NQ>
__device__ __forceinline__ void p_ds(float (&s)[NQ / 2], float (&dp)[NQ / 2],
                                     const RowStats *rows, const KeyRows &kr, int32_t m0,
                                     float sl2, float scale, const TileMask &tm) {
    const int32_t ea = kr.qend_a - m0, eb = kr.qend_b - m0;
    const int hi_a = ea < 0 ? 0 : ea > NQ ? NQ : (int)ea;
    const int hi_b = eb < 0 ? 0 : eb > NQ ? NQ : (int)eb;
    const bool capped = tm.cap_in != 0.f;
    for_frag<NQ>(kr, m0, [&](int ia, int ib, int col, bool before_a, bool before_b) {
        const RowStats rs = rows[col];
        float xa, xb, fa = 1.f, fb = 1.f;
        if (capped) {
            const float ua = ra::tanh_acc(s[ia] * tm.cap_in);
            const float ub = ra::tanh_acc(s[ib] * tm.cap_in);
            xa = fmaf(ua, tm.cap_out, -rs.lse2);
            xb = fmaf(ub, tm.cap_out, -rs.lse2);
            fa = 1.f - ua * ua;
            fb = 1.f - ub * ub;
        } else {
            xa = fmaf(s[ia], sl2, -rs.lse2);
            xb = fmaf(s[ib], sl2, -rs.lse2);
        }
        const float pa = ra::ex2_approx(ra::bwd_exponent(xa, rs.band));
        const float pb = ra::ex2_approx(ra::bwd_exponent(xb, rs.band));
        float da = pa * fmaf(dp[ia], scale, -rs.dls);
        float db = pb * fmaf(dp[ib], scale, -rs.dls);
        da *= fa;
        db *= fb;
        const bool hide_a =
            before_a || col >= hi_a || (tm.doc_test && rs.qid != kr.kid_a);
        const bool hide_b =
            before_b || col >= hi_b || (tm.doc_test && rs.qid != kr.kid_b);
        s[ia] = hide_a ? 0.f : pa;
        s[ib] = hide_b ? 0.f : pb;
        dp[ia] = hide_a ? 0.f : da;
        dp[ib] = hide_b ? 0.f : db;
    });
}

/* The unmasked variant's P/dS step in two halves, so that P^T is formed
 * while dP^T's product still runs (consume_tile waits for S^T alone
 * first), with the values and the zeros of the joint step:
 * S^T -> P^T in place (0 where the key does not see the query). */
template <int NQ>
__device__ __forceinline__ void p_step(float (&s)[NQ / 2], const RowStats *rows,
                                       const KeyRows &kr, int32_t m0, float sl2) {
    for_frag<NQ>(kr, m0, [&](int ia, int ib, int col, bool hide_a, bool hide_b) {
        const RowStats rs = rows[col];
        const float xa = fmaf(s[ia], sl2, -rs.lse2);
        const float xb = fmaf(s[ib], sl2, -rs.lse2);
        const float pa = ra::ex2_approx(ra::bwd_exponent(xa, rs.band));
        const float pb = ra::ex2_approx(ra::bwd_exponent(xb, rs.band));
        s[ia] = hide_a ? 0.f : pa;
        s[ib] = hide_b ? 0.f : pb;
    });
}

/* dP^T -> dS^T in place from P^T (0 where the key does not see the query,
 * also when dP is not finite there). */
template <int NQ>
__device__ __forceinline__ void ds_step(const float (&p)[NQ / 2], float (&dp)[NQ / 2],
                                        const RowStats *rows, const KeyRows &kr, int32_t m0,
                                        float scale) {
    for_frag<NQ>(kr, m0, [&](int ia, int ib, int col, bool hide_a, bool hide_b) {
        const float dls = rows[col].dls;
        const float da = p[ia] * fmaf(dp[ia], scale, -dls);
        const float db = p[ib] * fmaf(dp[ib], scale, -dls);
        dp[ia] = hide_a ? 0.f : da;
        dp[ib] = hide_b ? 0.f : db;
    });
}

/* The 16-bit half e (0: low) of a packed pair, and the pair with it set. */
template <typename T>
__device__ __forceinline__ float half_of(uint32_t v, int e) {
    const uint16_t b = (uint16_t)(e ? v >> 16 : v & 0xffffu);
    T x;
    memcpy(&x, &b, 2);
    return ra::to_acc(x);
}
template <typename T>
__device__ __forceinline__ uint32_t with_half(uint32_t v, int e, float f) {
    const T x = ra::from_accf<T>(f);
    uint16_t b;
    memcpy(&b, &x, 2);
    return e ? (v & 0xffffu) | ((uint32_t)b << 16) : (v & 0xffff0000u) | b;
}

/* The branch rule of dilated attention (mask.cuh branch_rule_fix) on the
 * tile's P^T and dS^T fragments, as the fused kernel applies it to its
 * 16-bit tiles: an element whose P is exactly 1 (a pair the exponent rule
 * snapped: an unsnapped exponent in a band row is below -2^-6, a hidden
 * pair holds 0) that c of the branches select takes P and dS times 1/c.
 * Element k = 8 kk + 2 r + e is half e of register r of k-step kk: key a
 * (r even) or a + 8, query m0 + 16 kk + 8 (r / 2) + 2 t + e; h the call's
 * query head.  After the slices, where S^T and dP^T are dead (inside the
 * step it made the D 128 loop spill more). */
template <typename T>
__device__ __forceinline__ void branch_rule(const BwdArgs &a, uint32_t (&pa)[kBlockM / 16][4],
                                            uint32_t (&dsa)[kBlockM / 16][4], const KeyRows &kr,
                                            int32_t m0, int64_t h) {
    const ra_attn_bwd_params &p = a.p;
    const int t = threadIdx.x % 4;
    ra::branch_rule_fix<kBlockM / 2>(
        a.br, [&](int k) { return half_of<T>(pa[k / 8][(k / 2) % 4], k % 2) == 1.f; },
        [&](int k, int64_t *hq, int64_t *qp, int64_t *kp) {
            const int kk = k / 8, r = (k / 2) % 4;
            *hq = a.br.head0 + a.br.head_stride * h;
            *qp = p.q_pos_offset +
                  ((int64_t)m0 + 16 * kk + 8 * (r / 2) + 2 * t + (k & 1)) * p.q_pos_stride;
            *kp = p.k_pos_offset + ((int64_t)kr.key_a + 8 * (r % 2)) * p.k_pos_stride;
        },
        [&](int k, float f) {
#pragma unroll
            for (int i = 0; i < kBlockM / 2; i++) {
                if (i == k) {
                    uint32_t &pv = pa[i / 8][(i / 2) % 4], &dv = dsa[i / 8][(i / 2) % 4];
                    pv = with_half<T>(pv, i % 2, half_of<T>(pv, i % 2) * f);
                    dv = with_half<T>(dv, i % 2, half_of<T>(dv, i % 2) * f);
                }
            }
        });
}

/* dS^T (64 keys x 64 queries) into the warpgroup's tile: row r = key, 128
 * bytes of queries, 16-byte chunk j of row r at chunk j ^ (r % 8) (r % 8
 * is the lane's g: the rows 16 w + 8 h + g). */
__device__ __forceinline__ void store_ds(unsigned char *ds, const uint32_t (&dsa)[kBlockM / 16][4]) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = 16 * warp + 8 * h + g;
#pragma unroll
        for (int j = 0; j < kBlockM / 8; j++) {
            // n-tile j is k-step j / 2, registers 2 (j % 2) + h
            const uint32_t v = dsa[j / 2][2 * (j % 2) + h];
            *reinterpret_cast<uint32_t *>(ds + r * 128 + ((j ^ g) << 4) + 4 * t) = v;
        }
    }
}

/* dq (64 queries x columns (D / 2) c..) added into the target's rows of (b, h). */
template <int D>
__device__ __forceinline__ void add_dq(const DqTarget &tgt, int64_t b, int64_t h, int64_t m0,
                                       int64_t s_q, int c, const float (&dq)[D / 4]) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float *bh = tgt.p + b * tgt.batch_stride + h * tgt.head_stride;
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int64_t row = m0 + 16 * warp + 8 * hh + g;
        if (row < s_q) {
            float *dst = bh + row * tgt.seq_stride + (D / 2) * c + 2 * t;
#pragma unroll
            for (int j = 0; j < D / 16; j++)
                ra::red_add_f32x2(dst + 8 * j, dq[4 * j + 2 * hh], dq[4 * j + 2 * hh + 1]);
        }
    }
}

/* dK or dV (the accumulator of keys kr.key_a, kr.key_b) into its gradient
 * (b, keys, hk): added into float32 (accumulate), stored as float32 or T. */
template <typename T, int D>
__device__ __forceinline__ void store_grad(const ra_attn_bwd_params &p, void *grad, int64_t bs,
                                           int64_t ss, int64_t hs, int64_t b, int64_t hk,
                                           int64_t key_a, const float (&x)[D / 2]) {
    const int t = threadIdx.x % 4;
    const bool acc = p.accumulate != 0, f32 = p.grad_dtype == RA_FLOAT32;
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int64_t key = key_a + 8 * hh;
        if (key >= p.seqlen_k) continue;
        const int64_t base = b * bs + key * ss + hk * hs + 2 * t;
#pragma unroll
        for (int j = 0; j < D / 8; j++) {
            const float x0 = x[4 * j + 2 * hh], x1 = x[4 * j + 2 * hh + 1];
            if (acc || f32) {
                float2 *d = reinterpret_cast<float2 *>((float *)grad + base + 8 * j);
                float2 v = make_float2(x0, x1);
                if (acc) {
                    const float2 o = *d;
                    v.x += o.x;
                    v.y += o.y;
                }
                *d = v;
            } else {
                *reinterpret_cast<uint32_t *>((T *)grad + base + 8 * j) = ra::pack2<T>(x0, x1);
            }
        }
    }
}

/* One tile of consumer warpgroup c: stage st's Q, dout and statistics
 * (rows m0.., query head h), the tile's parity (dS buffer) tt & 1.
 * Without DQ (the deterministic dk/dv pass) only dV and dK: no dS^T in
 * shared memory, no barrier between the consumers. */
template <typename T, int D, bool M, bool DQ>
__device__ __forceinline__ void consume_tile(const BwdArgs &a, const Buffers<D> &buf,
                                             const Stage &st, int32_t tt, int32_t m0, int64_t h,
                                             int64_t b, const KeyRows &kr, const TileMask &tm,
                                             int c, float (&dk)[D / 2], float (&dv)[D / 2]) {
    const ra_attn_bwd_params &p = a.p;
    constexpr int kSlice = D == 128 ? 32 : kBlockM;
    const float scale = (float)p.scale, sl2 = scale * kLog2e;
    const int s = st.index;
    const RowStats *rows = buf.stats(s);
    uint32_t pa[kBlockM / 16][4], dsa[kBlockM / 16][4];
    // S^T, dP^T and their P/dS step NQ queries at a time: at D 128 the
    // whole 64 beside dK and dV spilled (kSlice)
#pragma unroll
    for (int sl = 0; sl < kBlockM / kSlice; sl++) {
        float sx[kSlice / 2], dpx[kSlice / 2];
        issue_xyt<T, D, kSlice>(sx, buf.k(), buf.q(s) + sl * kSlice * 128, c);
        issue_xyt<T, D, kSlice>(dpx, buf.v(), buf.dout(s) + sl * kSlice * 128, c);
        if constexpr (M) {
            ra::sm90::wgmma_wait<0>();
            ra::sm90::fence_operand(sx);
            ra::sm90::fence_operand(dpx);
            p_ds<kSlice>(sx, dpx, rows + sl * kSlice, kr, m0 + sl * kSlice, sl2, scale, tm);
        } else {
            // P^T while dP^T's product still runs, then dS^T
            ra::sm90::wgmma_wait<1>();
            ra::sm90::fence_operand(sx);
            p_step<kSlice>(sx, rows + sl * kSlice, kr, m0 + sl * kSlice, sl2);
            ra::sm90::wgmma_wait<0>();
            ra::sm90::fence_operand(dpx);
            ds_step<kSlice>(sx, dpx, rows + sl * kSlice, kr, m0 + sl * kSlice, scale);
        }
        ra::a_from_acc<T, kSlice>(pa + sl * (kSlice / 16), sx);
        ra::a_from_acc<T, kSlice>(dsa + sl * (kSlice / 16), dpx);
    }
    if constexpr (M) {
        if (a.br.n != 0)   // uniform: one branch of dilated attention
            branch_rule<T>(a, pa, dsa, kr, m0, h);
    }
    if constexpr (DQ) {
        store_ds(buf.ds((int)(tt & 1), c), dsa);
        ra::sm90::fence_proxy_async();   // the generic writes of dS^T before wgmma reads them
    }
    issue_dkdv<T, D>(dv, dk, pa, dsa, buf.dout(s), buf.q(s));
    float dq[D / 4];
    if constexpr (DQ) {
        // dS^T of every warp of both consumers, then dQ's product queued
        // right behind dV's and dK's (all three accumulators live: no
        // spill since P^T forms while dP^T's product runs)
        ra::sm90::named_bar_sync(kDsBarrier, kConsumers * kWarpgroupThreads);
        issue_dq<T, D>(dq, buf.ds((int)(tt & 1), 0), buf.k(), c);
    }
    // retired before the stage is released
    ra::sm90::wgmma_wait<0>();
    ra::sm90::fence_operand(dv);
    ra::sm90::fence_operand(dk);
    ra::sm90::fence_operand(pa);
    ra::sm90::fence_operand(dsa);
    if constexpr (DQ) {
        ra::sm90::fence_operand(dq);
        add_dq<D>(a.dq, b, h, m0, p.seqlen_q, c, dq);
    }
    release(buf.empty(s));
}

/* One consumer warpgroup (c = 0, 1) over the block's walk: without masks
 * the walk computed here as the producer computes it; with them (M) the
 * tiles the producer's stages name (TileMeta), until the one that ends. */
template <typename T, int D, bool M, bool DQ>
__device__ void consume(const BwdArgs &a, const Buffers<D> &buf, const Walk &w,
                        const ra::KBlock &blk, int c) {
    const ra_attn_bwd_params &p = a.p;
    const int64_t key_a = key_a_of(blk, c);
    KeyRows kr{};
    TileMask tm{0.f, 0.f, false};
    if constexpr (M) {
        masked_rows(p, blk.b, key_a, &kr.qbeg_a, &kr.qend_a, &kr.kid_a);
        masked_rows(p, blk.b, key_a + 8, &kr.qbeg_b, &kr.qend_b, &kr.kid_b);
        kr.key_a = (int32_t)key_a;
        if (p.mask.softcap > 0) {
            tm.cap_in = (float)(p.scale / p.mask.softcap);
            tm.cap_out = (float)(p.mask.softcap * (double)kLog2e);
        }
    } else {
        kr.qbeg_a = first_query(p, key_a);
        kr.qbeg_b = first_query(p, key_a + 8);
    }

    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++) dk[i] = dv[i] = 0.f;

    Stage st{0, 0};
    if constexpr (M) {
        const bool docs = ra::mask_docs(p.mask);
        for (int32_t tt = 0;; tt++) {
            ra::sm90::mbar_wait(buf.full(st.index), st.phase);
            // warp-uniform in the compiler's eyes (lane 0's): the wgmma under
            // the branches stay asynchronous (fwd_mainloop.cuh)
            const TileMeta m = *buf.meta(st.index);
            const int32_t m0 = __shfl_sync(0xffffffffu, m.m0, 0);
            if (m0 < 0) break;
            const int32_t hh = __shfl_sync(0xffffffffu, m.head, 0);
            tm.doc_test = docs && __shfl_sync(0xffffffffu, m.same, 0) == 0;
            if (tt == 0) ra::sm90::mbar_wait(buf.full_kv(), 0);
            consume_tile<T, D, M, DQ>(a, buf, st, tt, m0, blk.hk * blk.group + hh, blk.b, kr,
                                      tm, c, dk, dv);
            st.advance();
        }
    } else {
        // warp-uniform in the compiler's eyes (the wgmma under the loop stay
        // asynchronous: fwd_mainloop.cuh)
        const int32_t n_tiles = __shfl_sync(0xffffffffu, w.n_tiles, 0);
        if (n_tiles > 0) ra::sm90::mbar_wait(buf.full_kv(), 0);
        for (int32_t tt = 0; tt < n_tiles; tt++) {
            ra::sm90::mbar_wait(buf.full(st.index), st.phase);
            consume_tile<T, D, M, DQ>(a, buf, st, tt, w.m0(tt),
                                      blk.hk * blk.group + w.head(tt), blk.b, kr, tm, c, dk,
                                      dv);
            st.advance();
        }
    }
    store_grad<T, D>(p, p.dk, p.dk_batch_stride, p.dk_seq_stride, p.dk_head_stride, blk.b, blk.hk,
                     key_a, dk);
    store_grad<T, D>(p, p.dv, p.dv_batch_stride, p.dv_seq_stride, p.dv_head_stride, blk.b, blk.hk,
                     key_a, dv);
}

/* The block's roles (DQ: the dq product too, else the dk/dv pass alone). */
template <typename T, int D, bool M, bool DQ>
__device__ __forceinline__ void bwd_wg_block(const BwdArgs &a) {
#if defined(RA_CUDA_EMULATED) || defined(RA_SM90_ASM)
    const Buffers<D> buf(ra::dynamic_smem());
    // the block and its walk, computed by each role after its setmaxnreg
    // (values live across it were spilled)
    auto walk_of = [&](const ra::KBlock &blk) {
        const ra::Range qr = ra::block_queries<kBlockN, M>(a.p, blk.k0);
        Walk w;
        w.i_begin = (int32_t)qr.begin;
        w.n_m = (int32_t)(qr.end > qr.begin ? (qr.end - qr.begin + kBlockM - 1) / kBlockM : 0);
        w.n_tiles = w.n_m * (int32_t)blk.group;
        return w;
    };
    const int wg = __shfl_sync(0xffffffffu, (int)(threadIdx.x / kWarpgroupThreads), 0);
    init_barriers(buf.bars());
    if (wg == 0) {
        ra::sm90::setmaxnreg_dec<M ? kMaskedProducerRegs : kProducerRegs>();
        if (threadIdx.x < 32) {
            const ra::KBlock blk = ra::k_block<kBlockN>(a.p, a.n_kblocks);
            if constexpr (M)
                produce_masked<D>(a, buf, walk_of(blk), blk.b, blk.hk, blk.group, blk.k0);
            else
                produce<D>(a, buf, walk_of(blk), blk.b, blk.hk, blk.hk * blk.group, blk.k0);
        }
        return;
    }
    ra::sm90::setmaxnreg_inc<M ? kMaskedConsumerRegs : kConsumerRegs>();
    const ra::KBlock blk = ra::k_block<kBlockN>(a.p, a.n_kblocks);
    consume<T, D, M, DQ>(a, buf, walk_of(blk), blk, wg - 1);
#else
    (void)a;
    __trap();   // built for another architecture: the dispatcher never launches it there
#endif
}

/* dq, dk and dv (deterministic=False) */
template <typename T, int D, bool M>
__global__ void __launch_bounds__(kThreads, 1) bwd_wg_kernel(const __grid_constant__ BwdArgs a) {
    bwd_wg_block<T, D, M, true>(a);
}

/* dk and dv only (the deterministic pass) */
template <typename T, int D, bool M>
__global__ void __launch_bounds__(kThreads, 1) dkdv_wg_kernel(const __grid_constant__ BwdArgs a) {
    bwd_wg_block<T, D, M, false>(a);
}

template <typename T, int D, bool M, bool DQ>
ra_status launch(const ra_attn_bwd_params &p, cudaStream_t s, const DqTarget &tgt, void *ctx) {
    BwdArgs &a = *static_cast<BwdArgs *>(ctx);
    a.dq = tgt;
    const size_t smem = (size_t)Smem<D>::kLaunchBytes;
    int64_t blocks = 0;
    RA_CHECK(ra_grid_1d(a.n_kblocks * p.heads_kv * p.batch, 1, &blocks));
    // grid: B * H_kv * ceil(S_k / 128) blocks of 384 threads
    if constexpr (DQ) {
        RA_CHECK(ra_set_smem(bwd_wg_kernel<T, D, M>, smem));
        if (blocks == 0) return RA_OK;
        RA_LAUNCH((bwd_wg_kernel<T, D, M>), (unsigned)blocks, kThreads, smem, s)(a);
        RA_CUDA_CHECK_LAUNCH("bwd_wg_kernel");
    } else {
        RA_CHECK(ra_set_smem(dkdv_wg_kernel<T, D, M>, smem));
        if (blocks == 0) return RA_OK;
        RA_LAUNCH((dkdv_wg_kernel<T, D, M>), (unsigned)blocks, kThreads, smem, s)(a);
        RA_CUDA_CHECK_LAUNCH("dkdv_wg_kernel");
    }
    return RA_OK;
}

/* the launcher of (dtype, D, M, DQ) */
template <bool M, bool DQ>
ra::bwd_fused::DqRun pick(ra_dtype t, int64_t D) {
    if (t == RA_FLOAT16)
        return D == 64 ? launch<ra::half_t, 64, M, DQ> : launch<ra::half_t, 128, M, DQ>;
    return D == 64 ? launch<ra::bf16_t, 64, M, DQ> : launch<ra::bf16_t, 128, M, DQ>;
}

ra::bwd_fused::DqRun pick(const ra_attn_bwd_params &p, bool dq) {
    const bool m = ra::masked_variant(p);
    const ra_dtype t = p.dtype;
    const int64_t D = p.head_dim;
    if (dq) return m ? pick<true, true>(t, D) : pick<false, true>(t, D);
    return m ? pick<true, false>(t, D) : pick<false, false>(t, D);
}

}  // namespace

bool ra_bwd_wg_supported(const ra_attn_bwd_params &p) {
    // the caller has checked the mma.sync kernels' needs (dtypes, head dims,
    // 16-byte aligned rows)
    // tensor maps: int32 coordinates, strides of the axes longer than 1
    // positive and below 2^40 bytes (a broadcast axis is left to mma.sync)
    const int64_t lim = (int64_t)1 << 31;
    // (a block's key indices, past S_k by up to 127, too)
    if (p.batch >= lim || p.seqlen_q >= lim || p.seqlen_k >= lim - kBlockN || p.heads >= lim)
        return false;
    // a block's walk (query tiles of the group's heads) counts in int32
    if ((p.heads / p.heads_kv) * (p.seqlen_q / 64 + 1) >= lim) return false;
    const int64_t ext[12] = {p.batch, p.seqlen_q, p.heads, p.batch, p.seqlen_q, p.heads,
                             p.batch, p.seqlen_k, p.heads_kv, p.batch, p.seqlen_k, p.heads_kv};
    const int64_t str[12] = {p.q_batch_stride,    p.q_seq_stride,    p.q_head_stride,
                             p.dout_batch_stride, p.dout_seq_stride, p.dout_head_stride,
                             p.k_batch_stride,    p.k_seq_stride,    p.k_head_stride,
                             p.v_batch_stride,    p.v_seq_stride,    p.v_head_stride};
    for (int i = 0; i < 12; i++)
        if (ext[i] > 1 && (str[i] <= 0 || str[i] >= ((int64_t)1 << 39))) return false;
    return true;
}

namespace {

/* The kernel's argument for p (its tensor maps made); false (nothing to
 * launch: the caller runs the mma.sync kernels) when the device grants too
 * little shared memory or the driver cannot make the maps. */
ra_status prepare(const ra_attn_bwd_params &p, BwdArgs *a, bool *ok) {
    *ok = false;
    const int64_t D = p.head_dim;
    const size_t need = D == 64 ? (size_t)Smem<64>::kLaunchBytes : (size_t)Smem<128>::kLaunchBytes;
    size_t optin = 0;
    RA_CHECK(ra_smem_optin(&optin));
    if (optin < need) return RA_OK;
    memset(a, 0, sizeof *a);
    a->p = p;
    a->n_kblocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
    a->br = ra::branches_of(p);
    char err[300];
    const int bf = p.dtype == RA_BFLOAT16;
    *ok = ra_tensor_map_bshd(&a->q_map, bf, p.q, p.batch, p.seqlen_q, p.heads, D,
                             p.q_batch_stride, p.q_seq_stride, p.q_head_stride, kBlockM, err,
                             sizeof err) == 0 &&
          ra_tensor_map_bshd(&a->do_map, bf, p.dout, p.batch, p.seqlen_q, p.heads, D,
                             p.dout_batch_stride, p.dout_seq_stride, p.dout_head_stride, kBlockM,
                             err, sizeof err) == 0 &&
          ra_tensor_map_bshd(&a->k_map, bf, p.k, p.batch, p.seqlen_k, p.heads_kv, D,
                             p.k_batch_stride, p.k_seq_stride, p.k_head_stride, kBlockN, err,
                             sizeof err) == 0 &&
          ra_tensor_map_bshd(&a->v_map, bf, p.v, p.batch, p.seqlen_k, p.heads_kv, D,
                             p.v_batch_stride, p.v_seq_stride, p.v_head_stride, kBlockN, err,
                             sizeof err) == 0;
    return RA_OK;
}

}  // namespace

ra_status ra_bwd_wg(const ra_attn_bwd_params &p, cudaStream_t s, bool *ran) {
    *ran = false;
    BwdArgs a;
    bool ok = false;
    RA_CHECK(prepare(p, &a, &ok));
    if (!ok) return RA_OK;
    return ra::bwd_fused::with_dq_target(p, s, pick(p, true), &a, ran);
}

ra_status ra_bwd_wg_dkdv(const ra_attn_bwd_params &p, cudaStream_t s, bool *ran) {
    *ran = false;
    BwdArgs a;
    bool ok = false;
    RA_CHECK(prepare(p, &a, &ok));
    if (!ok) return RA_OK;
    RA_CHECK(pick(p, false)(p, s, ra::bwd_fused::DqTarget{}, &a));
    *ran = true;
    return RA_OK;
}
