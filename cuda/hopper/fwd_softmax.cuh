/*
 * fwd_softmax.cuh -- the Hopper forward's per-tile softmax step on the
 * wgmma accumulator of S (64 rows x 128 keys per consumer warpgroup):
 * the masks of the tile, the online softmax (running row max and sum in
 * float32), P in registers as the 16-bit A operand of O += P V.
 *
 * Register layout (PTX ISA, wgmma m64nNk16 f32 accumulator; the same as
 * mma.sync's C fragments laid side by side): register 4j + h of lane l in
 * warp w of the warpgroup holds row 16w + l/4 + 8 (h >> 1), column
 * 8j + 2 (l % 4) + (h & 1).  A thread thus holds two rows ("a": h < 2,
 * "b": h >= 2) and 32 columns of each; a row's other columns are in the
 * three other lanes of its quad (reductions: two xor-shuffles).
 *
 * Scores stay unscaled until the exponent: p = 2^(s * mult - m)
 * with mult = scale * log2(e), one FFMA and one MUFU.EX2 (ra::ex2_approx)
 * per score (model: -4 % against exp2f and a separate scale, design A);
 * rows of huge scores (|max| mult >= 2^12) round the product first.
 * Soft-capped scores are capped into log2 units first (mult = 1): s ->
 * c log2(e) tanh(s scale / c), as the mma.sync kernel does.  The running
 * max m is in log2 units; a row that has seen no key keeps -inf and
 * pivots on 0, so it ends with l = 0 (out 0, lse -inf); a NaN score does
 * not enter the max (fmaxf) but makes its p, so l, NaN.
 */
#ifndef RA_HOPPER_FWD_SOFTMAX_CUH
#define RA_HOPPER_FWD_SOFTMAX_CUH

#include "hopper/fwd_traits.cuh"
#include "mask.cuh"
#include "mma.cuh"

namespace ra {
namespace wg {

constexpr int kSRegs = kBlockK / 2;   /* S accumulator registers per thread */
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
/* |pivot| (log2 units) from which the exponent is computed as the
 * mma.sync kernel does, round(s * mult) - pivot, not by one FFMA
 * (RowState::step) */
constexpr float kFfmaPivotLimit = 4096.f;

/* What one consumer thread knows of its two rows and of its warpgroup's
 * 64, for masking a tile. */
struct RowMasks {
    int64_t row_a, row_b;        /* query indices (row_b = row_a + 8) */
    int64_t qpos_a, qpos_b;
    int64_t wg_qpos_first;       /* position of the warpgroup's first row */
    int64_t kend;                /* the block's key end (block_keys) */
    /* masks (M): the rows' spans, the warpgroup's bounds (keys at or past
     * wg_lo, up to wg_hi, every row of the warpgroup sees), ids */
    Span seen_a, seen_b;
    int64_t wg_lo, wg_hi;
    bool wg_any;                 /* the warpgroup has a row < S_q */
    int32_t qid_a, qid_b;
    bool docs, capped;
    float cap_in, cap_out;       /* s -> tanh(s cap_in) cap_out (log2 units) */
    float mult;                  /* scale log2(e), or 1 when capped */

    template <bool M>
    __device__ void init(const ra_attn_fwd_params &p, const QBlock &blk, int64_t kend_, int c) {
        const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
        const int64_t wg_first = blk.q0 + c * kRowsPerWg;
        row_a = wg_first + warp * 16 + lane / 4;
        row_b = row_a + 8;
        qpos_a = p.q_pos_offset + row_a * p.q_pos_stride;
        qpos_b = p.q_pos_offset + row_b * p.q_pos_stride;
        wg_qpos_first = p.q_pos_offset + wg_first * p.q_pos_stride;
        kend = kend_;
        wg_any = wg_first < p.seqlen_q;
        docs = M && mask_docs(p.mask);
        capped = M && p.mask.softcap > 0;
        cap_in = capped ? (float)(p.scale / p.mask.softcap) : 0.f;
        cap_out = capped ? (float)(p.mask.softcap * (double)kLog2e) : 0.f;
        mult = capped ? 1.f : (float)p.scale * kLog2e;
        seen_a = seen_b = Span{0, 0};
        wg_lo = wg_hi = 0;
        qid_a = qid_b = 0;
        if constexpr (M) {
            seen_a = keys_seen_by(p, qpos_a);
            seen_b = keys_seen_by(p, qpos_b);
            const int64_t wg_end =
                wg_first + kRowsPerWg < p.seqlen_q ? wg_first + kRowsPerWg : p.seqlen_q;
            if (wg_any) {
                wg_lo = keys_seen_by(p, p.q_pos_offset + (wg_end - 1) * p.q_pos_stride).lo;
                wg_hi = keys_seen_by(p, wg_qpos_first).hi;
            }
            if (docs) {
                const SegIds qids = q_seg_ids(p.mask, blk.b);
                qid_a = row_a < p.seqlen_q ? qids.at(row_a) : 0;
                qid_b = row_b < p.seqlen_q ? qids.at(row_b) : 0;
            }
        }
    }
};

/* Cap (M, softcap) and mask the scores of the tile of keys k0 .. k0 + 127
 * in place; `same`: the producer found every id of the tile equal to the
 * block's one id; ids: the tile's kv ids (documents).  Only a tile not
 * known to be fully visible to every row of the warpgroup is tested
 * element by element. */
template <bool M>
__device__ __forceinline__ void mask_tile(float (&s)[kSRegs], const ra_attn_fwd_params &p,
                                          const RowMasks &r, int64_t k0, bool same,
                                          const int32_t *ids) {
    const int t = threadIdx.x % 4;
    if constexpr (M) {
        if (r.capped) {
#pragma unroll
            for (int i = 0; i < kSRegs; i++) s[i] = tanh_acc(s[i] * r.cap_in) * r.cap_out;
        }
        const bool full = r.wg_any && k0 + kBlockK <= r.kend &&
                          p.k_pos_offset + k0 * p.k_pos_stride >= r.wg_lo &&
                          p.k_pos_offset + (k0 + kBlockK - 1) * p.k_pos_stride <= r.wg_hi && same;
        if (full) return;
        const bool doc_test = r.docs && !same;
#pragma unroll
        for (int j = 0; j < kBlockK / 8; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = 8 * j + 2 * t + e;
                const int64_t key = k0 + col;
                const int64_t kpos = p.k_pos_offset + key * p.k_pos_stride;
                const bool in = key < r.kend;
                const int32_t kid = doc_test ? ids[col] : 0;
                if (!in || !in_span(r.seen_a, kpos) || (doc_test && kid != r.qid_a))
                    s[4 * j + e] = -CUDART_INF_F;
                if (!in || !in_span(r.seen_b, kpos) || (doc_test && kid != r.qid_b))
                    s[4 * j + 2 + e] = -CUDART_INF_F;
            }
        }
    } else {
        (void)same;
        (void)ids;
        const bool full = k0 + kBlockK <= p.seqlen_k &&
                          (!p.causal || p.k_pos_offset + (k0 + kBlockK - 1) * p.k_pos_stride <=
                                            r.wg_qpos_first);
        if (full) return;
#pragma unroll
        for (int j = 0; j < kBlockK / 8; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int64_t key = k0 + 8 * j + 2 * t + e;
                const int64_t kpos = p.k_pos_offset + key * p.k_pos_stride;
                const bool in = key < r.kend;
                if (!in || (p.causal && kpos > r.qpos_a)) s[4 * j + e] = -CUDART_INF_F;
                if (!in || (p.causal && kpos > r.qpos_b)) s[4 * j + 2 + e] = -CUDART_INF_F;
            }
        }
    }
}

/* The running state of a thread's two rows: max m of the scaled scores
 * (log2 units: the rounded product s * mult, as the mma.sync kernel keeps
 * it; rounding is monotone, so it is the product of the raw max), sum l of
 * 2^(s mult - m) over this lane's columns (quad-reduced at the end). */
struct RowState {
    float m_a, m_b, l_a, l_b;
    __device__ __forceinline__ void init() {
        m_a = m_b = -CUDART_INF_F;
        l_a = l_b = 0.f;
    }

    /* One tile: the new row max, s -> p = 2^(s mult - max) in place, l
     * rescaled and grown; *alpha_a, *alpha_b: the factors O must be
     * rescaled by (2^(m_old - m_new)). */
    __device__ __forceinline__ void step(float (&s)[kSRegs], float mult, float *alpha_a,
                                         float *alpha_b) {
        float tx_a = -CUDART_INF_F, tx_b = -CUDART_INF_F;
#pragma unroll
        for (int j = 0; j < kBlockK / 8; j++) {
            tx_a = fmaxf(tx_a, fmaxf(s[4 * j], s[4 * j + 1]));
            tx_b = fmaxf(tx_b, fmaxf(s[4 * j + 2], s[4 * j + 3]));
        }
        tx_a = fmaxf(tx_a, __shfl_xor_sync(0xffffffffu, tx_a, 1));
        tx_a = fmaxf(tx_a, __shfl_xor_sync(0xffffffffu, tx_a, 2));
        tx_b = fmaxf(tx_b, __shfl_xor_sync(0xffffffffu, tx_b, 1));
        tx_b = fmaxf(tx_b, __shfl_xor_sync(0xffffffffu, tx_b, 2));
        // (__fmul_rn: never contracted into an FFMA with the subtractions)
        const float mx_a = fmaxf(m_a, __fmul_rn(tx_a, mult));
        const float mx_b = fmaxf(m_b, __fmul_rn(tx_b, mult));
        // the pivot; a row with no visible key so far uses 0
        const float piv_a = mx_a == -CUDART_INF_F ? 0.f : mx_a;
        const float piv_b = mx_b == -CUDART_INF_F ? 0.f : mx_b;
        *alpha_a = ex2_approx(m_a - piv_a);
        *alpha_b = ex2_approx(m_b - piv_b);
        m_a = mx_a;
        m_b = mx_b;
        // The FFMA leaves the row max itself the exponent s mult - piv, the
        // rounding of piv: up to half its ulp, 2^-13 while |piv| < 2^12 (P
        // off by less than its own 16-bit rounding).  Huge scores (q * 1e9)
        // are first scaled and shifted in place as the mma.sync kernel does
        // it (the product rounded, so the max gets exactly 2^0), the FFMA
        // then being x * 1 - 0: a warp-uniform branch, rarely taken, off the
        // common path (tests/test_cuda.py "1e9").
        float fm = mult, fa = piv_a, fb = piv_b;
        const bool huge = fabsf(piv_a) >= kFfmaPivotLimit || fabsf(piv_b) >= kFfmaPivotLimit;
        if (__any_sync(0xffffffffu, huge)) {
#pragma unroll
            for (int j = 0; j < kBlockK / 8; j++) {
                s[4 * j] = __fmul_rn(s[4 * j], mult) - piv_a;
                s[4 * j + 1] = __fmul_rn(s[4 * j + 1], mult) - piv_a;
                s[4 * j + 2] = __fmul_rn(s[4 * j + 2], mult) - piv_b;
                s[4 * j + 3] = __fmul_rn(s[4 * j + 3], mult) - piv_b;
            }
            fm = 1.f;
            fa = fb = 0.f;
        }
#pragma unroll
        for (int j = 0; j < kBlockK / 8; j++) {
            s[4 * j] = ex2_approx(fmaf(s[4 * j], fm, -fa));
            s[4 * j + 1] = ex2_approx(fmaf(s[4 * j + 1], fm, -fa));
            s[4 * j + 2] = ex2_approx(fmaf(s[4 * j + 2], fm, -fb));
            s[4 * j + 3] = ex2_approx(fmaf(s[4 * j + 3], fm, -fb));
        }
        float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
        for (int j = 0; j < kBlockK / 8; j++) {
            sum_a += s[4 * j] + s[4 * j + 1];
            sum_b += s[4 * j + 2] + s[4 * j + 3];
        }
        l_a = l_a * *alpha_a + sum_a;
        l_b = l_b * *alpha_b + sum_b;
    }

    /* finish the sums across the quad */
    __device__ __forceinline__ void reduce() {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
        l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    }
};

/* O *= alpha per row (after the products that used the old max retired) */
template <int D>
__device__ __forceinline__ void rescale(float (&o)[D / 2], float alpha_a, float alpha_b) {
#pragma unroll
    for (int j = 0; j < D / 8; j++) {
        o[4 * j] *= alpha_a;
        o[4 * j + 1] *= alpha_a;
        o[4 * j + 2] *= alpha_b;
        o[4 * j + 3] *= alpha_b;
    }
}

}  // namespace wg
}  // namespace ra

#endif /* RA_HOPPER_FWD_SOFTMAX_CUH */
