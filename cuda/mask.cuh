/*
 * mask.cuh -- documents, windows and soft-capping (ra_attn_mask) as the
 * CUDA kernels apply them, and the backward's exponent rule.
 *
 * Every attention kernel has two instantiations, chosen by its launcher:
 * M = false (mask_active(p.mask) is false: causal only, the code it had
 * before masks) and M = true, one variant that handles all three features
 * with run-time flags.  The masked kernels
 *  - fold causal and the window into the span of positions a row sees
 *    (keys_seen_by for a query, queries_seeing for a key) and bound their
 *    block loops by it (block_keys / block_queries in attn_kernels.cuh),
 *    so a sliding window costs O(S w), not O(S^2);
 *  - skip the streamed tiles that hold no segment id of the owning block's
 *    id range [lo, hi] (DocTiles: 128 tiles tested at once, one warp word
 *    of 32 each), and drop the per-element document test on a tile whose
 *    ids all equal the block's single id;
 *  - test elements only on tiles not known to be fully visible;
 *  - cap the scaled score s -> c tanh(s / c) with tanhf (tanh for float64):
 *    within 2 ulps, branch-free, and as many MUFU operations (ex2, rcp) as
 *    any exp-based formula; tanh.approx.f32 (one MUFU) was rejected: its
 *    2^-11 relative error is an absolute score error of up to c * 2^-11
 *    (0.025 at c = 50), 2.5 % in P, beyond the float16 tolerance.  Forward
 *    and backward compute the capped score with the same expression from
 *    the same raw score, so they agree bit for bit, and the backward's dS
 *    gains the factor 1 - tanh^2 of that very tanh.
 */
#ifndef RA_CUDA_MASK_CUH
#define RA_CUDA_MASK_CUH

#include <math.h>
#include <string.h>

#include "common.cuh"

namespace ra {

__host__ __device__ __forceinline__ bool mask_docs(const ra_attn_mask &m) {
    return m.q_segment_ids != nullptr;
}
__host__ __device__ __forceinline__ bool mask_window(const ra_attn_mask &m) {
    return m.has_window && (m.window_left >= 0 || m.window_right >= 0);
}
/* whether a call needs the masked instantiation */
__host__ __device__ __forceinline__ bool mask_active(const ra_attn_mask &m) {
    return mask_docs(m) || mask_window(m) || m.softcap > 0;
}

/* ---- positions ------------------------------------------------------------ */

/* a + b and a - b for b >= 0, saturated (an unbounded side is INT64_MAX) */
__host__ __device__ __forceinline__ int64_t pos_add(int64_t a, int64_t b) {
    return a > INT64_MAX - b ? INT64_MAX : a + b;
}
__host__ __device__ __forceinline__ int64_t pos_sub(int64_t a, int64_t b) {
    return a < INT64_MIN + b ? INT64_MIN : a - b;
}

/* count_upto / count_below (common.cuh) for any int64 pos, such as a
 * saturated window bound: pos is first clamped to the sequence's last
 * position (plus one). */
__host__ __device__ __forceinline__ int64_t count_upto_sat(int64_t pos, int64_t off,
                                                           int64_t stride, int64_t n) {
    if (n <= 0) return 0;
    const int64_t last = off + (n - 1) * stride;
    return count_upto(pos < last ? pos : last, off, stride, n);
}
__host__ __device__ __forceinline__ int64_t count_below_sat(int64_t pos, int64_t off,
                                                            int64_t stride, int64_t n) {
    if (n <= 0) return 0;
    const int64_t last = off + (n - 1) * stride;
    return count_below(pos <= last ? pos : last + 1, off, stride, n);
}

/* A closed span of positions [lo, hi] (empty when lo > hi). */
struct Span { int64_t lo, hi; };

/* The key positions a query at qpos may see under causal and the window. */
template <typename P>
__host__ __device__ __forceinline__ Span keys_seen_by(const P &p, int64_t qpos) {
    Span s{INT64_MIN, p.causal ? qpos : INT64_MAX};
    if (p.mask.has_window) {
        if (p.mask.window_left >= 0) s.lo = pos_sub(qpos, p.mask.window_left);
        if (p.mask.window_right >= 0) s.hi = min(s.hi, pos_add(qpos, p.mask.window_right));
    }
    return s;
}
/* The query positions that may see a key at kpos (the same rule read the
 * other way: qpos - left <= kpos <= qpos + right, kpos <= qpos if causal). */
template <typename P>
__host__ __device__ __forceinline__ Span queries_seeing(const P &p, int64_t kpos) {
    Span s{p.causal ? kpos : INT64_MIN, INT64_MAX};
    if (p.mask.has_window) {
        if (p.mask.window_right >= 0) s.lo = max(s.lo, pos_sub(kpos, p.mask.window_right));
        if (p.mask.window_left >= 0) s.hi = pos_add(kpos, p.mask.window_left);
    }
    return s;
}
__host__ __device__ __forceinline__ bool in_span(const Span &s, int64_t pos) {
    return s.lo <= pos && pos <= s.hi;
}

/* ---- soft-capping ---------------------------------------------------------- */

__device__ __forceinline__ float tanh_acc(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_acc(double x) { return tanh(x); }

/* ---- the backward's exponent ----------------------------------------------- */

/* x = s - lse is <= 0 in exact arithmetic, so x > 0 is rounding: it reads
 * as 0 (P <= 1; huge scores would otherwise overflow).  For huge |lse| the
 * rounding of lse itself (stored, merged over ring steps) is many units:
 * there an x within 16 ulps of |lse| below 0 reads as 0 too, so a row's
 * dominant key gets P = 1, not exp(-ulps), which would lose it.  The band
 * starts where an ulp of lse reaches 2^-10 (as csrc/attn/attn_cpu_tiles.h
 * does on the CPU; there in log2 units, where the same widths apply). */
template <typename A> struct BandOf;
template <> struct BandOf<float> {
    static constexpr float kFrom = 0x1p13f, kWidth = 0x1p-19f;
};
template <> struct BandOf<double> {
    static constexpr double kFrom = 0x1p42, kWidth = 0x1p-48;
};
/* The band below 0 for a row whose lse (either unit) is `lse`: 0 for
 * ordinary and non-finite lse. */
template <typename A>
__device__ __forceinline__ A band_of(A lse) {
    const A a = fabs(lse);
    return a >= BandOf<A>::kFrom && a < (A)CUDART_INF ? -BandOf<A>::kWidth * a : (A)0;
}
/* the exponent to use: min(x, 0), and 0 inside the band; NaN stays NaN (a
 * NaN score or lse makes P NaN: fmin would turn it into 0, P = 1).  One
 * compare does both: band <= 0, so an x > 0 is also x >= band; NaN fails
 * the compare (two ALU instructions per score instead of three). */
template <typename A>
__device__ __forceinline__ A bwd_exponent(A x, A band) {
    return x >= band ? (A)0 : x;
}

/* ---- the branch rule of dilated attention ---------------------------------- */

/* What the backward kernels need of p.branches (a host pointer, never read
 * on the device), copied into a by-value kernel argument: the branches'
 * segment lengths and dilation rates (n = 0: plain attention, the rule is
 * off) and the global query head of the kernel's head j, head0 +
 * head_stride * j.  Only the masked variants (M) read it: the launchers
 * pick them whenever branches is set (masked_variant). */
struct Branches {
    int n;
    int64_t head0, head_stride;
    int64_t w[RA_MAX_BRANCHES], r[RA_MAX_BRANCHES];
    /* -log2(c) and -ln(c) of c = 0 .. RA_MAX_BRANCHES branches sharing a
     * pair (0 for c <= 1), from the host's libm: no log code in the
     * kernels, and bits the CPU's -(real)log2((double)c) has */
    double neg_log2[RA_MAX_BRANCHES + 1], neg_ln[RA_MAX_BRANCHES + 1];
};
inline Branches branches_of(const ra_attn_bwd_params &p) {
    Branches br;
    memset(&br, 0, sizeof br);
    if (p.branches != nullptr) {
        br.n = p.branches->n_branches;
        br.head0 = p.branch_head0;
        br.head_stride = p.branch_head_stride;
        for (int i = 0; i < br.n && i < RA_MAX_BRANCHES; i++) {
            br.w[i] = p.branches->segment_lengths[i];
            br.r[i] = p.branches->dilation_rates[i];
        }
        for (int c = 2; c <= RA_MAX_BRANCHES; c++) {
            br.neg_log2[c] = -log2((double)c);
            br.neg_ln[c] = -log((double)c);
        }
    }
    return br;
}
/* whether a call runs the masked instantiation: a mask, or (backward) the
 * branch rule */
inline bool masked_variant(const ra_attn_fwd_params &p) { return mask_active(p.mask); }
inline bool masked_variant(const ra_attn_bwd_params &p) {
    return mask_active(p.mask) || p.branches != nullptr;
}

/* a / b truncated toward zero (C's int64 /) for b >= 1, without the
 * out-of-line 64-bit division routine nvcc calls (a call in a kernel
 * makes ptxas save live registers around it: the tensor-core kernels
 * spilled): 32-bit division when both fit, else shift and subtract. */
__device__ __forceinline__ int64_t div_pos(int64_t a, int64_t b) {
    const uint64_t n = a < 0 ? 0 - (uint64_t)a : (uint64_t)a, d = (uint64_t)b;
    uint64_t q;
    if ((n >> 32) == 0 && (d >> 32) == 0) {
        q = (uint32_t)n / (uint32_t)d;
    } else {
        uint64_t r = 0;
        q = 0;
#pragma unroll 1
        for (int i = 63; i >= 0; i--) {
            r = (r << 1) | ((n >> i) & 1u);
            if (r >= d) {
                r -= d;
                q |= (uint64_t)1 << i;
            }
        }
    }
    return a < 0 ? -(int64_t)q : (int64_t)q;
}
__device__ __forceinline__ int64_t mod_pos(int64_t a, int64_t b) { return a - div_pos(a, b) * b; }

/* How many branches select both global positions qp and kp for global
 * query head h (csrc/attn/attn_cpu_kern.h ra_dilated_pair_count, the same
 * int64 arithmetic). */
__device__ __forceinline__ int pair_count(const Branches &br, int64_t h, int64_t qp, int64_t kp) {
    int c = 0;
#pragma unroll 1
    for (int i = 0; i < br.n; i++) {
        const int64_t w = br.w[i], r = br.r[i];
        const int64_t s = div_pos(qp, w);
        if (div_pos(kp, w) != s) continue;
        const int64_t o = mod_pos(h, r);
        c += mod_pos(qp - s * w, r) == o && mod_pos(kp - s * w, r) == o;
    }
    return c;
}
/* The pair counts of one position with N others, 5 bits each (count r at
 * bit 5 r; c <= RA_MAX_BRANCHES < 32): `fixed` is a query position and the
 * others keys (QUERY), or the other way round; the others are first +
 * r step, r < N.  A rolled loop, for the generic kernels: one copy of the
 * count code, few registers, ahead of their unrolled loops. */
template <int N, bool QUERY>
__device__ __forceinline__ uint32_t pair_counts(const Branches &br, int64_t h, int64_t fixed,
                                                int64_t first, int64_t step) {
    static_assert(5 * N <= 32, "5 bits per count");
    uint32_t counts = 0;
#pragma unroll 1
    for (int r = 0; r < N; r++) {
        const int64_t other = first + r * step;
        const int c = QUERY ? pair_count(br, h, fixed, other) : pair_count(br, h, other, fixed);
        counts |= (uint32_t)c << (5 * r);
    }
    return counts;
}

/* The exponent of a pair the exponent rule snaps (x >= band) when the
 * scores are one branch of dilated attention: -log c of the c branches
 * that share the pair (in log2 units when LOG2), so that P sums to 1 over
 * them (csrc/attn/attn_cpu_tiles.h bwd_row); 0, the plain rule, for c <= 1.
 * Inlined: a call (__noinline__) would make the tensor-core kernels save
 * their live fragments around it (dq_tc at D 128 spilled 106 bytes). */
template <bool LOG2, typename A>
__device__ __forceinline__ A shared_exponent(const Branches &br, int64_t h, int64_t qp, int64_t kp) {
    const int c = pair_count(br, h, qp, kp);
    return (A)(LOG2 ? br.neg_log2[c] : br.neg_ln[c]);
}
/* The branch rule after the fact, for the tensor-core kernels (one inlined
 * copy of it per kernel, behind a warp-uniform branch taken only with
 * branches set: no work and no registers for the other calls).  A thread's
 * fragment of N <= 32 elements: snapped(k) (k a constant) tells whether the
 * exponent rule snapped element k, whose P was then exp2(0) = 1; pos(k, &h,
 * &qp, &kp) gives its global query head and positions, scale(k, f)
 * multiplies its P and dS by f = 2^-log2(c) (k varies: an unrolled select),
 * which is P and dS as if x had been -log2(c) (P was 1, dS = P (...)). */
template <int N, typename Snapped, typename Pos, typename Scale>
__device__ __forceinline__ void branch_rule_fix(const Branches &br, Snapped &&snapped, Pos &&pos,
                                                Scale &&scale) {
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < N; k++) m |= (uint32_t)snapped(k) << k;
    while (m != 0) {
        const int k = __ffs(m) - 1;
        m &= m - 1;
        int64_t h, qp, kp;
        pos(k, &h, &qp, &kp);
        const float e = shared_exponent<true, float>(br, h, qp, kp);
        if (e != 0.f) scale(k, exp2f(e));
    }
}

/* ---- documents ------------------------------------------------------------- */

/* The segment ids of one batch row: id of row i = ids[i * stride]. */
struct SegIds {
    const int32_t *ids;
    int64_t stride;
    __device__ __forceinline__ int32_t at(int64_t i) const { return ids[i * stride]; }
};
__device__ __forceinline__ SegIds q_seg_ids(const ra_attn_mask &m, int64_t b) {
    return SegIds{m.q_segment_ids + b * m.q_seg_batch_stride, m.q_seg_seq_stride};
}
__device__ __forceinline__ SegIds kv_seg_ids(const ra_attn_mask &m, int64_t b) {
    return SegIds{m.kv_segment_ids + b * m.kv_seg_batch_stride, m.kv_seg_seq_stride};
}

/* min and max id of rows [r0, r1) (INT32_MAX, INT32_MIN when empty), the
 * same in every lane of every warp that asks */
__device__ __forceinline__ void id_range(SegIds ids, int64_t r0, int64_t r1, int32_t *lo,
                                         int32_t *hi) {
    int32_t a = INT32_MAX, z = INT32_MIN;
    for (int64_t r = r0 + threadIdx.x % 32; r < r1; r += 32) {
        const int32_t x = ids.at(r);
        a = min(a, x);
        z = max(z, x);
    }
    for (int o = 16; o > 0; o >>= 1) {
        a = min(a, __shfl_xor_sync(0xffffffffu, a, o));
        z = max(z, __shfl_xor_sync(0xffffffffu, z, o));
    }
    *lo = a;
    *hi = z;
}

/* The ids of a warp's RPW rows from `first` (0 past n) of one batch row. */
template <int RPW>
__device__ __forceinline__ void row_ids(SegIds ids, int64_t first, int64_t n, int32_t (&id)[RPW]) {
#pragma unroll
    for (int r = 0; r < RPW; r++) id[r] = first + r < n ? ids.at(first + r) : 0;
}

/* A warp's word of 32 tiles of R rows (tile t = rows [base + t R, base +
 * t R + R), clipped to n), tiles t0 .. t0 + 31 (those before t_end): bit k
 * of *meet when tile t0 + k holds an id in [lo, hi], of *same when every id
 * in it also equals lo == hi.  Warp-uniform; one load per lane and 32 rows
 * (coalesced). */
template <int R, int U>
__device__ __forceinline__ void tile_words(const SegIds &ids, int64_t base, int64_t n,
                                           int32_t lo, int32_t hi, int64_t t0, int64_t t_end,
                                           uint32_t *meet, uint32_t *same) {
    const int lane = threadIdx.x % 32;
    uint32_t m = 0, s = 0;
#pragma unroll U
    for (int k = 0; k < 32; k++) {
        const int64_t t = t0 + k;
        bool any = false, all = true;
        if (t < t_end) {
#pragma unroll
            for (int rr = 0; rr < R; rr += 32) {
                const int64_t row = base + t * R + rr + lane;
                if (row < n && (R >= 32 || lane < R)) {  // a tile under 32 rows
                    const int32_t x = ids.at(row);
                    any |= lo <= x && x <= hi;
                    all &= x == lo;
                }
            }
        }
        any = __any_sync(0xffffffffu, any);
        all = __all_sync(0xffffffffu, all);
        m |= (uint32_t)any << k;
        s |= (uint32_t)(any && all && lo == hi) << k;
    }
    *meet = m;
    *same = s;
}

/* A streamed tile the block visits: its index and whether every id in it
 * equals the block's single id (then no element needs the document test). */
struct Hit {
    int64_t tile;
    bool same;
};

/* The tiles of R rows (tile t = rows [base + t R, base + t R + R), clipped
 * to n) that hold a segment id in [lo, hi], the owning block's id range:
 * the only tiles the block can see anything of.  next(t, t_end) is the
 * first such tile at or after t (t_end when none).  Block-uniform: every
 * thread of the block (W warps) calls next() with the same arguments; it
 * synchronises the block when it tests a new chunk of 32 W tiles (each warp
 * one word of 32, coalesced loads) into `words` (2 W uint32 of shared
 * memory: W words "some id in [lo, hi]", W words "every id == lo == hi"). */
template <int R, int W>
struct DocTiles {
    SegIds ids;
    int64_t base, n;
    int32_t lo, hi;
    uint32_t *words;
    int64_t chunk0;  // first tile of the tested chunk; -1: none yet

    __device__ __forceinline__ void init(SegIds ids_, int64_t base_, int64_t n_, int32_t lo_,
                                         int32_t hi_, uint32_t *words_) {
        ids = ids_;
        base = base_;
        n = n_;
        lo = lo_;
        hi = hi_;
        words = words_;
        chunk0 = -1;
    }

    /* init for a block that owns rows [r0, r_end) of `own` and streams
     * rows [base_, n_) of `other`: lo, hi the owned rows' id range */
    __device__ __forceinline__ void init_block(SegIds own, int64_t r0, int64_t r_end,
                                               SegIds other, int64_t base_, int64_t n_,
                                               uint32_t *words_) {
        int32_t lo_, hi_;
        id_range(own, r0, r_end, &lo_, &hi_);
        init(other, base_, n_, lo_, hi_, words_);
    }

    __device__ void test_chunk(int64_t t0, int64_t t_end) {
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        __syncthreads();  // every thread is done reading the previous words
        uint32_t meet, same;
        tile_words<R, 4>(ids, base, n, lo, hi, t0 + 32 * warp, t_end, &meet, &same);
        if (lane == 0) {
            words[warp] = meet;
            words[W + warp] = same;
        }
        __syncthreads();
        chunk0 = t0;
    }

    __device__ Hit next(int64_t t, int64_t t_end) {
        while (t < t_end) {
            if (chunk0 < 0 || t < chunk0 || t >= chunk0 + 32 * W) test_chunk(t, t_end);
            const int64_t off = t - chunk0;
            int w = (int)(off >> 5);
            uint32_t m = words[w] & (0xffffffffu << (off & 31));
            for (;;) {
                if (m) {
                    const int bit = __ffs(m) - 1;
                    const int64_t tile = chunk0 + 32 * w + bit;
                    if (tile >= t_end) return Hit{t_end, false};
                    return Hit{tile, ((words[W + w] >> bit) & 1u) != 0};
                }
                if (++w == W) break;
                m = words[w];
            }
            t = chunk0 + 32 * W;
        }
        return Hit{t_end, false};
    }
};

/* ---- the document tile walk of one warp ----------------------------------- */

/* DocTiles for a single warp (the Hopper kernels' producer warp): the tiles of R rows
 * (tile t = rows [base + t R, base + t R + R), clipped to n) holding an id
 * in [lo, hi], tested 32 at a time into two warp-uniform words in
 * registers, with no block barrier (the consumers do not take part). */
template <int R>
struct WarpDocTiles {
    SegIds ids;
    int64_t base, n;
    int32_t lo, hi;
    int64_t chunk0;      /* first tile of the tested chunk; -1: none yet */
    uint32_t meet, same;

    __device__ __forceinline__ void init(SegIds own, int64_t r0, int64_t r_end, SegIds other,
                                         int64_t base_, int64_t n_) {
        id_range(own, r0, r_end, &lo, &hi);
        ids = other;
        base = base_;
        n = n_;
        chunk0 = -1;
        meet = same = 0;
    }

    __device__ void test_chunk(int64_t t0, int64_t t_end) {
        tile_words<R, 1>(ids, base, n, lo, hi, t0, t_end, &meet, &same);
        chunk0 = t0;
    }

    /* the first tile at or after t holding an id of the block (t_end: none) */
    __device__ Hit next(int64_t t, int64_t t_end) {
        while (t < t_end) {
            if (chunk0 < 0 || t < chunk0 || t >= chunk0 + 32) test_chunk(t, t_end);
            const uint32_t m = meet & (0xffffffffu << (int)(t - chunk0));
            if (m) {
                const int bit = __ffs(m) - 1;
                const int64_t tile = chunk0 + bit;
                if (tile >= t_end) return Hit{t_end, false};
                return Hit{tile, ((same >> bit) & 1u) != 0};
            }
            t = chunk0 + 32;
        }
        return Hit{t_end, false};
    }
};

}  // namespace ra

#endif /* RA_CUDA_MASK_CUH */
