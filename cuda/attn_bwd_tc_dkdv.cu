/*
 * attn_bwd_tc_dkdv.cu -- the tensor-core backward's first pass: dk and dv
 * for float16 and bfloat16 with head_dim 64 or 128 (mma.sync m16n8k16,
 * sm_80 and newer).  The second pass (dq) is attn_bwd_tc_dq.cu.
 *
 * With P_ij = exp(scale * q_i . k_j - lse_i) for visible pairs (0 otherwise
 * and for rows whose final lse is -inf), dP_ij = dout_i . v_j and
 * dS_ij = P_ij (dP_ij - delta_i):
 *   dv_j = sum_i P_ij dout_i,   dk_j = scale * sum_i dS_ij q_i,
 * summed over the H / H_kv query heads that read kv head hk.
 *
 * Shapes: q, dout (B, S_q, H, D); k, v, dk, dv (B, S_k, H_kv, D); lse, delta
 * (B, H, S_q) float32.  dk, dv are float16/bfloat16 or float32 (float32 when
 * p.accumulate, which adds into them).
 *
 * Algorithm: a block of 4 warps owns 64 keys of one (b, hk), 16 per warp;
 * its K and V rows stay in shared memory.  Query tiles of BM rows (64 for
 * D = 64, 32 for masked D = 64, 16 for D = 128, to keep the accumulators
 * in registers) stream
 * through shared memory with their dout rows, double buffered with
 * cp.async, for each query head of the group in turn; a causal block starts
 * at the first query that can see its first key.  Per tile each warp works
 * in the transposed orientation, its keys as the mma rows:
 *   S^T  = K Q^T        (16 x BM)   ldmatrix K rows, Q as [n][k]
 *   P^T  = exp2(S^T * scale * log2e - lse2)  masked on non-full tiles
 *   dV  += P^T dout     (16 x D)    P^T from registers, dout as [k][n]
 *   dP^T = V dout^T     (16 x BM)
 *   dS^T = P^T (dP^T - delta)
 *   dK  += dS^T Q       (16 x D)    dS^T from registers, Q as [k][n]
 * so no fragment ever goes back through shared memory.  dK, dV are float32
 * in registers and written once at the end (dK times scale); every output
 * element has one writer, so the result is deterministic with no atomics.
 * The exponent rule and what it guarantees for huge scores: attn_bwd_tc.cuh.
 *
 * The masked variant (M, mask.cuh) bounds the query tiles by the window
 * span of the block's keys, walks only the tiles holding one of the block's
 * document ids, and computes dP^T before P^T so that one pass over the
 * fragment gives P^T and dS^T with the softcap's factor 1 - tanh^2 (the
 * score recomputed exactly as the forward capped it); elements of tiles not
 * known to be fully visible are tested against each key's span and id.
 * With p.branches it also applies the branch rule of dilated attention to
 * the pairs the exponent rule snapped, after the P/dS pass (mask.cuh
 * branch_rule_fix).
 *
 * Launch: grid B * H_kv * ceil(S_k / 64) (1-D; the earliest keys, which see
 * the most causal queries, first), 128 threads, dynamic shared memory
 * (2 * 64 + 4 * BM) * D * 2 + 6 * BM * 4 bytes, with M 2 * BM ids and 8
 * words more.
 */
#include "attn_bwd_tc.cuh"

namespace {

using namespace ra::bwd_tc;

constexpr int kBlockN = kWarps * 16;  // keys per block, 16 per warp

/* query rows per streamed tile, so that dK, dV and the tile's fragments
 * stay in registers: 64 for D = 64, 32 for the masked D = 64 (whose P^T and
 * dP^T fragments are live together), 16 for D = 128 (with 32, dK and dV
 * alone hold 128 registers and the kernel spilled: 255 registers, 32 bytes
 * of spill stores; with 16, 252 and none, at 48 ldmatrix per 64 mma
 * instead of 80 per 128) */
template <int D, bool M> struct Tile { static constexpr int BM = D == 64 ? (M ? 32 : 64) : 16; };

template <int D, bool M>
constexpr size_t dkdv_smem_bytes() {
    return (size_t)(2 * kBlockN + 4 * Tile<D, M>::BM) * D * 2 +
           (size_t)6 * Tile<D, M>::BM * sizeof(float) +
           (M ? 2 * Tile<D, M>::BM * sizeof(int32_t) + 2 * kWarps * sizeof(uint32_t) : 0);
}

template <typename T, int D, bool M>
__global__ void __launch_bounds__(kThreads)
dkdv_tc_kernel(ra_attn_bwd_params p, int64_t n_kblocks, const __grid_constant__ ra::Branches br) {
    constexpr int BM = Tile<D, M>::BM;
    constexpr int kMT = BM / 8;  // n-tiles of S^T, dP^T (queries)
    constexpr int kDT = D / 8;   // n-tiles of dK, dV
    unsigned char *smem_raw = ra::dynamic_smem();
    T *sk = reinterpret_cast<T *>(smem_raw);  // kBlockN x D, owned keys
    T *sv = sk + kBlockN * D;                 // kBlockN x D
    T *sq = sv + kBlockN * D;                 // 2 x BM x D, streamed queries
    T *sdo = sq + 2 * BM * D;                 // 2 x BM x D
    float *slse = reinterpret_cast<float *>(sdo + 2 * BM * D);  // 2 x BM, log2 units
    float *sdelta = slse + 2 * BM;                              // 2 x BM
    float *sband = sdelta + 2 * BM;                             // 2 x BM
    int32_t *sqid = reinterpret_cast<int32_t *>(sband + 2 * BM);     // M: 2 x BM ids
    uint32_t *doc_words = reinterpret_cast<uint32_t *>(sqid + 2 * BM);  // M: 8

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const ra::KBlock blk = ra::k_block<kBlockN>(p, n_kblocks);
    const int64_t b = blk.b, hk = blk.hk, group = blk.group, k0 = blk.k0;

    const T *kg = (const T *)p.k + b * p.k_batch_stride + hk * p.k_head_stride;
    const T *vg = (const T *)p.v + b * p.v_batch_stride + hk * p.v_head_stride;

    // queries outside [i_begin, i_end) see none of this block's keys
    const ra::Range queries = ra::block_queries<kBlockN, M>(p, k0);
    const int64_t i_begin = queries.begin, i_end = queries.end;  // i_end = S_q without M
    const int64_t n_mtiles = M ? (i_end > i_begin ? (i_end - i_begin + BM - 1) / BM : 0)
                               : (p.seqlen_q - i_begin + BM - 1) / BM;
    const int64_t n_iters = group * n_mtiles;  // (query head, query tile) pairs

    // this thread's two keys: rows g and g + 8 of the warp's 16
    const int64_t key_a = k0 + warp * 16 + g, key_b = key_a + 8;
    const int64_t kpos_a = p.k_pos_offset + key_a * p.k_pos_stride;
    const int64_t kpos_b = p.k_pos_offset + key_b * p.k_pos_stride;
    // a tile needs no mask when all 64 keys exist and its first query sees the last key
    const bool keys_full = k0 + kBlockN <= p.seqlen_k;
    const int64_t kpos_block_last = p.k_pos_offset + (k0 + kBlockN - 1) * p.k_pos_stride;
    const float sl2 = (float)p.scale * kLog2e;

    // masks (M): the keys' query spans and ids, the block's bounds, soft-capping
    ra::Span seers_a{}, seers_b{};
    int64_t blk_lo = 0, blk_hi = 0;  // queries at or past blk_lo, up to blk_hi, see every key
    int32_t kid_a = 0, kid_b = 0;
    const bool docs = M && ra::mask_docs(p.mask);
    const bool capped = M && p.mask.softcap > 0;
    const float cap_in = capped ? (float)(p.scale / p.mask.softcap) : 0.f;
    const float cap_out = capped ? (float)(p.mask.softcap * (double)kLog2e) : 0.f;
    ra::SegIds qids{};
    ra::DocTiles<BM, kWarps> tiles;
    if constexpr (M) {
        seers_a = ra::queries_seeing(p, kpos_a);
        seers_b = ra::queries_seeing(p, kpos_b);
        blk_lo = ra::queries_seeing(p, kpos_block_last).lo;
        blk_hi = ra::queries_seeing(p, p.k_pos_offset + k0 * p.k_pos_stride).hi;
        if (docs) {
            const ra::SegIds kids = ra::kv_seg_ids(p.mask, b);
            qids = ra::q_seg_ids(p.mask, b);
            kid_a = key_a < p.seqlen_k ? kids.at(key_a) : 0;
            kid_b = key_b < p.seqlen_k ? kids.at(key_b) : 0;
            tiles.init_block(kids, k0, k0 + kBlockN < p.seqlen_k ? k0 + kBlockN : p.seqlen_k,
                             qids, i_begin, i_end, doc_words);
        }
    }
    // the first visible (query head, query tile) pair at or after `it`; the
    // tiles' ids do not depend on the head
    auto next_iter = [&](int64_t it) -> ra::Hit {
        if constexpr (M) {
            if (docs) {
                while (it < n_iters) {
                    const int64_t hg = it / n_mtiles, mt = it % n_mtiles;
                    const ra::Hit hit = tiles.next(mt, n_mtiles);
                    if (hit.tile < n_mtiles) return ra::Hit{hg * n_mtiles + hit.tile, hit.same};
                    if (mt == 0) break;  // no tile of any head
                    it = (hg + 1) * n_mtiles;
                }
                return ra::Hit{n_iters, false};
            }
        }
        return ra::Hit{it, true};
    };

    // Stage iteration `it` -- query head hk * group + it / n_mtiles, query
    // rows m0 .. m0 + BM - 1 -- into buffer `buf`: Q and dout by cp.async,
    // lse, delta, band (and with documents the ids) by plain stores
    // (visible after the next __syncthreads).
    auto stage = [&](int64_t it, int buf) {
        const int64_t h = hk * group + it / n_mtiles;
        const int64_t m0 = i_begin + (it % n_mtiles) * BM;
        const T *qg = (const T *)p.q + b * p.q_batch_stride + h * p.q_head_stride;
        const T *dog = (const T *)p.dout + b * p.dout_batch_stride + h * p.dout_head_stride;
        ra::cp_async_tile<T, D, BM, kThreads>(sq + buf * BM * D, qg, p.q_seq_stride, m0, p.seqlen_q);
        ra::cp_async_tile<T, D, BM, kThreads>(sdo + buf * BM * D, dog, p.dout_seq_stride, m0,
                                              p.seqlen_q);
        if (threadIdx.x < BM) {
            row_stats(p, b * p.lse_batch_stride + h * p.lse_head_stride, m0 + threadIdx.x,
                      slse + buf * BM + threadIdx.x, sdelta + buf * BM + threadIdx.x,
                      sband + buf * BM + threadIdx.x);
            if constexpr (M) {
                if (docs) {
                    const int64_t row = m0 + threadIdx.x;
                    sqid[buf * BM + threadIdx.x] = row < i_end ? qids.at(row) : 0;
                }
            }
        }
    };

    float dk[kDT][4], dv[kDT][4];
#pragma unroll
    for (int i = 0; i < kDT; i++) {
#pragma unroll
        for (int e = 0; e < 4; e++) dk[i][e] = dv[i][e] = 0.f;
    }

    // (query head, query tile) iterations stream double buffered: the next
    // one loads while this one computes.  Without M every one of the n_iters
    // in turn; with M those the masks leave (cur: the iteration, and whether
    // its tile's ids all equal the block's one id).
    ra::Hit cur = next_iter(0);
    if (M ? cur.tile < n_iters : n_iters > 0) {
        // group 0: the owned K, V rows and the first query tile
        ra::cp_async_tile<T, D, kBlockN, kThreads>(sk, kg, p.k_seq_stride, k0, p.seqlen_k);
        ra::cp_async_tile<T, D, kBlockN, kThreads>(sv, vg, p.v_seq_stride, k0, p.seqlen_k);
        stage(M ? cur.tile : 0, 0);
        ra::cp_async_commit();
    }

    for (int64_t n = 0; M ? cur.tile < n_iters : n < n_iters; n++) {
        const int buf = (int)(n & 1);
        const int64_t it = M ? cur.tile : n;
        ra::Hit nxt{};
        if constexpr (M) nxt = next_iter(cur.tile + 1);
        if (M ? nxt.tile < n_iters : it + 1 < n_iters) {
            // buffer buf ^ 1 was released by the __syncthreads ending the last iteration
            stage(M ? nxt.tile : it + 1, buf ^ 1);
            ra::cp_async_commit();
            ra::cp_async_wait<1>();
        } else {
            ra::cp_async_wait<0>();
        }
        __syncthreads();  // tile `it` (and K, V) visible to every warp

        const bool same = cur.same;
        const T *qt = sq + buf * BM * D;
        const T *dot = sdo + buf * BM * D;
        const float *lt = slse + buf * BM;
        const float *dt = sdelta + buf * BM;
        const float *bt = sband + buf * BM;
        const int64_t m0 = i_begin + (it % n_mtiles) * BM;

        // S^T = K Q^T: the warp's 16 keys x BM queries
        float s[kMT][4];
#pragma unroll
        for (int i = 0; i < kMT; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t a[4];
            ra::frag_a<D>(a, sk, warp * 16, kk * 16);
#pragma unroll
            for (int n2 = 0; n2 < kMT / 2; n2++) {
                uint32_t bq[4];
                ra::frag_b_nk<D>(bq, qt, n2 * 16, kk * 16);
                ra::mma_16816<T>(s[2 * n2], a, bq[0], bq[1]);
                ra::mma_16816<T>(s[2 * n2 + 1], a, bq[2], bq[3]);
            }
        }

        // dV += P^T dout: k runs over the tile's BM queries
        auto add_dv = [&]() {
#pragma unroll
            for (int kk = 0; kk < BM / 16; kk++) {
                uint32_t a[4];
                ra::a_from_c<T>(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
                for (int d2 = 0; d2 < kDT / 2; d2++) {
                    uint32_t bo[4];
                    ra::frag_b_kn<D>(bo, dot, kk * 16, d2 * 16);
                    ra::mma_16816<T>(dv[2 * d2], a, bo[0], bo[1]);
                    ra::mma_16816<T>(dv[2 * d2 + 1], a, bo[2], bo[3]);
                }
            }
        };
        // dP^T = V dout^T: 16 keys x BM queries
        float dp[kMT][4];
        auto compute_dp = [&]() {
#pragma unroll
            for (int i = 0; i < kMT; i++) dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                uint32_t a[4];
                ra::frag_a<D>(a, sv, warp * 16, kk * 16);
#pragma unroll
                for (int n2 = 0; n2 < kMT / 2; n2++) {
                    uint32_t bo[4];
                    ra::frag_b_nk<D>(bo, dot, n2 * 16, kk * 16);
                    ra::mma_16816<T>(dp[2 * n2], a, bo[0], bo[1]);
                    ra::mma_16816<T>(dp[2 * n2 + 1], a, bo[2], bo[3]);
                }
            }
        };

        if constexpr (M) {
            compute_dp();
            // P^T and dS^T = P^T (dP^T - delta) (1 - tanh^2 with a softcap);
            // element (i, e) of the fragment is key row g (e < 2) or g + 8,
            // query m0 + 8i + 2t + (e & 1)
            const bool full = keys_full && p.q_pos_offset + m0 * p.q_pos_stride >= blk_lo &&
                p.q_pos_offset + (m0 + BM - 1) * p.q_pos_stride <= blk_hi && same;
            const int32_t *ids = sqid + buf * BM;
            const bool doc_test = docs && !same;
#pragma unroll
            for (int i = 0; i < kMT; i++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int col = i * 8 + 2 * t + e;
                    const float l2 = lt[col], band = bt[col], dl = dt[col];
                    float xa, xb, ca = 1.f, cb = 1.f;
                    if (capped) {
                        const float ua = ra::tanh_acc(s[i][e] * cap_in);
                        const float ub = ra::tanh_acc(s[i][2 + e] * cap_in);
                        xa = ua * cap_out;
                        xb = ub * cap_out;
                        ca = 1.f - ua * ua;
                        cb = 1.f - ub * ub;
                    } else {
                        xa = s[i][e] * sl2;
                        xb = s[i][2 + e] * sl2;
                    }
                    float pa = exp2f(ra::bwd_exponent(xa - l2, band));
                    float pb = exp2f(ra::bwd_exponent(xb - l2, band));
                    if (!full) {
                        const int64_t qpos = p.q_pos_offset + (m0 + col) * p.q_pos_stride;
                        const int32_t qid = doc_test ? ids[col] : 0;
                        if (key_a >= p.seqlen_k || !ra::in_span(seers_a, qpos) ||
                            (doc_test && qid != kid_a))
                            pa = 0.f;
                        if (key_b >= p.seqlen_k || !ra::in_span(seers_b, qpos) ||
                            (doc_test && qid != kid_b))
                            pb = 0.f;
                    }
                    s[i][e] = pa;
                    s[i][2 + e] = pb;
                    dp[i][e] = pa * (dp[i][e] - dl) * ca;
                    dp[i][2 + e] = pb * (dp[i][2 + e] - dl) * cb;
                }
            }
            if (br.n != 0) {
                // the branch rule: element k = 4i + e is query m0 + 8i + 2t +
                // (e & 1) of the tile's head, key a (e < 2) or b; a visible
                // snapped pair has P = 1 exactly (an unsnapped x < band gives
                // P < 1 in a band row), a hidden one P = 0
                const int64_t h_it = hk * group + it / n_mtiles;
                ra::branch_rule_fix<kMT * 4>(
                    br, [&](int k) { return s[k / 4][k % 4] == 1.f; },
                    [&](int k, int64_t *hq, int64_t *qp, int64_t *kp) {
                        *hq = br.head0 + br.head_stride * h_it;
                        *qp = p.q_pos_offset + (m0 + (k / 4) * 8 + 2 * t + (k & 1)) * p.q_pos_stride;
                        *kp = (k % 4) < 2 ? kpos_a : kpos_b;
                    },
                    [&](int k, float f) {
#pragma unroll
                        for (int kk = 0; kk < kMT * 4; kk++) {
                            if (kk == k) {
                                s[kk / 4][kk % 4] *= f;
                                dp[kk / 4][kk % 4] *= f;
                            }
                        }
                    });
            }
            add_dv();
        } else {
            // P^T = exp2(S^T * scale * log2e - lse2[query]); element (i, e) of
            // the fragment is key row g (e < 2) or g + 8, query m0 + 8i + 2t + (e & 1)
            const bool full = keys_full &&
                (!p.causal || kpos_block_last <= p.q_pos_offset + m0 * p.q_pos_stride);
#pragma unroll
            for (int i = 0; i < kMT; i++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int col = i * 8 + 2 * t + e;
                    const float l2 = lt[col], band = bt[col];
                    float pa = exp2f(ra::bwd_exponent(s[i][e] * sl2 - l2, band));
                    float pb = exp2f(ra::bwd_exponent(s[i][2 + e] * sl2 - l2, band));
                    if (!full) {
                        const int64_t qpos = p.q_pos_offset + (m0 + col) * p.q_pos_stride;
                        if (key_a >= p.seqlen_k || (p.causal && kpos_a > qpos)) pa = 0.f;
                        if (key_b >= p.seqlen_k || (p.causal && kpos_b > qpos)) pb = 0.f;
                    }
                    s[i][e] = pa;
                    s[i][2 + e] = pb;
                }
            }
            add_dv();
            compute_dp();
            // dS^T = P^T (dP^T - delta[query])
#pragma unroll
            for (int i = 0; i < kMT; i++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float dl = dt[i * 8 + 2 * t + e];
                    dp[i][e] = s[i][e] * (dp[i][e] - dl);
                    dp[i][2 + e] = s[i][2 + e] * (dp[i][2 + e] - dl);
                }
            }
        }

        // dK += dS^T Q: k runs over the tile's BM queries
#pragma unroll
        for (int kk = 0; kk < BM / 16; kk++) {
            uint32_t a[4];
            ra::a_from_c<T>(a, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
            for (int d2 = 0; d2 < kDT / 2; d2++) {
                uint32_t bq[4];
                ra::frag_b_kn<D>(bq, qt, kk * 16, d2 * 16);
                ra::mma_16816<T>(dk[2 * d2], a, bq[0], bq[1]);
                ra::mma_16816<T>(dk[2 * d2 + 1], a, bq[2], bq[3]);
            }
        }
        __syncthreads();  // every warp done with buffer buf before it is refilled
        if constexpr (M) cur = nxt;
    }

    // epilogue: rows g, g + 8 of the warp's keys, columns 8i + 2t, + 1
    const float scale = (float)p.scale;
    const bool f32 = p.grad_dtype == RA_FLOAT32;
    const bool acc = p.accumulate != 0;
    const int64_t dk_a = b * p.dk_batch_stride + key_a * p.dk_seq_stride + hk * p.dk_head_stride;
    const int64_t dv_a = b * p.dv_batch_stride + key_a * p.dv_seq_stride + hk * p.dv_head_stride;
    const int64_t dk_b = dk_a + 8 * p.dk_seq_stride, dv_b = dv_a + 8 * p.dv_seq_stride;
#pragma unroll
    for (int i = 0; i < kDT; i++) {
        const int d = i * 8 + 2 * t;
        if (key_a < p.seqlen_k) {
            store_grad2<T>(p.dk, dk_a + d, acc, f32, dk[i][0] * scale, dk[i][1] * scale);
            store_grad2<T>(p.dv, dv_a + d, acc, f32, dv[i][0], dv[i][1]);
        }
        if (key_b < p.seqlen_k) {
            store_grad2<T>(p.dk, dk_b + d, acc, f32, dk[i][2] * scale, dk[i][3] * scale);
            store_grad2<T>(p.dv, dv_b + d, acc, f32, dv[i][2], dv[i][3]);
        }
    }
}

struct Launch {
    template <typename T, int D, bool M>
    static ra_status run(const ra_attn_bwd_params &p, cudaStream_t s) {
        const size_t smem = dkdv_smem_bytes<D, M>();
        RA_CHECK(ra_set_smem(dkdv_tc_kernel<T, D, M>, smem));
        const int64_t n_kblocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
        int64_t blocks = 0;
        RA_CHECK(ra_grid_1d(n_kblocks * p.heads_kv * p.batch, 1, &blocks));
        // grid: B * H_kv * ceil(S_k / 64) blocks of 128 threads;
        // k, v, dk, dv (B, S_k, H_kv, D), q, dout (B, S_q, H, D)
        RA_LAUNCH((dkdv_tc_kernel<T, D, M>), (unsigned)blocks, kThreads, smem, s)(p, n_kblocks,
                                                                            ra::branches_of(p));
        RA_CUDA_CHECK_LAUNCH("dkdv_tc_kernel");
        return RA_OK;
    }
};

}  // namespace

ra_status ra_bwd_tc_dkdv(const ra_attn_bwd_params &p, cudaStream_t s) {
    if (p.seqlen_k <= 0) return RA_OK;
    return ra_tc_dispatch<Launch>(p, s);
}
