/*
 * attn_bwd_simt.cu -- the generic attention backward: every dtype, every
 * head_dim 1..256, CUDA cores only, deterministic (no atomics).  This file
 * holds the dk/dv kernel and ra_bwd_simt; the dq kernel is
 * attn_bwd_simt_dq.cu (shared shape: attn_bwd_simt.cuh).
 *
 * With P_ij = exp(scale * q_i . k_j - lse_i) for visible pairs (0 otherwise,
 * and 0 for rows whose final lse is -inf), dP_ij = dout_i . v_j and
 * dS_ij = P_ij * (dP_ij - delta_i), delta_i = rowsum(dout_i * out_i):
 *   dv_j = sum_i P_ij dout_i
 *   dk_j = scale * sum_i dS_ij q_i     (summed over the query heads of kv head)
 *   dq_i = scale * sum_j dS_ij k_j
 * Two kernels, each owning its outputs so no two blocks write one element:
 *   dkdv: one block per (b, kv head, 16 keys); loops over the H / H_kv query
 *         heads and the visible query tiles of 32; lane i handles query i of
 *         the tile, each warp owns 4 keys and accumulates their dk, dv rows
 *         in registers (lane l holds dims l, l+32, ...).
 *   dq:   one block per (b, h, 16 queries); loops over the visible key tiles
 *         of 32; lane j handles key j, each warp owns 4 query rows.
 * Accumulation is in A (double for float64, float otherwise); results are
 * stored in grad_dtype, or added to the float32/float64 buffers when
 * p.accumulate.
 *
 * Scores are recomputed exactly as the forward (attn_fwd_simt.cu) computed
 * them: q pre-multiplied by scale in A, then one fused multiply-add per
 * dimension in order d = 0 .. D-1 (and soft-capped by the same tanh).  So
 * s_ij - lse_i is at most 0 up to the rounding of lse itself, also for huge
 * scores (q scaled by 1e9), and the exponent rule of mask.cuh (bwd_exponent:
 * clamped to <= 0, and 0 within 16 ulps of a huge |lse|) makes P exact
 * there: never above 1, never overflowing, 1 for a row's dominant key.
 *
 * The masked variant (M, mask.cuh): causal and the window bound each
 * block's tile loop (the query range of a key block, the key range of a
 * query block), tiles holding none of the block's document ids are
 * skipped, pairs are tested against both, and with a softcap c the scores
 * are c * tanh(s / c) and dS gains the factor 1 - tanh^2.  With p.branches
 * (one branch of dilated attention) a snapped pair that c branches share
 * reads as exp(-ln c) = 1/c (the branch rule of mask.cuh, with the pair
 * counts of a tile's pairs computed ahead of its score loop).
 *
 * Shapes: q, out, dout, dq (B, S_q, H, D); k, v, dk, dv (B, S_k, H_kv, D);
 * lse, delta (B, H, S_q) in A.
 */
#include "attn_bwd_simt.cuh"

namespace {

using namespace ra::bwd_simt;

template <typename T, int DPL, bool M>
__global__ void __launch_bounds__(kWarps * 32)
dkdv_simt_kernel(ra_attn_bwd_params p, int64_t n_kblocks, const __grid_constant__ ra::Branches br) {
    typedef typename ra::Acc<T>::type A;
    unsigned char *smem_raw = ra::dynamic_smem();
    const int D = (int)p.head_dim;
    const int ldq = D | 1;
    A *sk = reinterpret_cast<A *>(smem_raw);  // 16 x D, owned keys
    A *sv = sk + kBlockRows * D;                // 16 x D
    A *sq = sv + kBlockRows * D;                // 32 x ldq, streamed queries
    A *sdo = sq + kTile * ldq;                  // 32 x ldq
    A *slse = sdo + kTile * ldq;                // 32
    A *sdelta = slse + kTile;                   // 32
    uint32_t *doc_words = reinterpret_cast<uint32_t *>(sdelta + kTile);  // M: 2 * kWarps

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const ra::KBlock blk = ra::k_block<kBlockRows>(p, n_kblocks);
    const int64_t b = blk.b, hk = blk.hk, group = blk.group, k0 = blk.k0;
    const A scale = (A)p.scale;

    const ra::In<T> kg(p.k, b * p.k_batch_stride, hk * p.k_head_stride, p.dtype);
    const ra::In<T> vg(p.v, b * p.v_batch_stride, hk * p.v_head_stride, p.dtype);
    for (int idx = threadIdx.x; idx < kBlockRows * D; idx += blockDim.x) {
        const int r = idx / D, d = idx % D;
        const int64_t j = k0 + r;
        const bool ok = j < p.seqlen_k;
        sk[idx] = ok ? kg[j * p.k_seq_stride + d] : (A)0;
        sv[idx] = ok ? vg[j * p.v_seq_stride + d] : (A)0;
    }

    A dk[kRowsPerWarp][DPL], dv[kRowsPerWarp][DPL];
    int64_t kpos[kRowsPerWarp];
    ra::Span seers[kRowsPerWarp];  // M: the query positions that may see each key
    int32_t kid[kRowsPerWarp];     // M with documents: each key's segment id
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; r++) {
        kpos[r] = p.k_pos_offset + (k0 + warp * kRowsPerWarp + r) * p.k_pos_stride;
        if constexpr (M) seers[r] = ra::queries_seeing(p, kpos[r]);
#pragma unroll
        for (int t = 0; t < DPL; t++) dk[r][t] = dv[r][t] = 0;
    }

    // queries [i_begin, i_end) bound the queries that see any owned key
    const ra::Range queries = ra::block_queries<kBlockRows, M>(p, k0);
    const int64_t i_begin = queries.begin, i_end = queries.end;

    // masks (M): soft-capping, and the query tiles holding the block's documents
    const bool docs = M && ra::mask_docs(p.mask);
    const A cap = M ? (A)p.mask.softcap : (A)0;
    const A inv_cap = cap > 0 ? (A)1 / cap : (A)0;
    const int64_t n_tiles = i_end > i_begin ? (i_end - i_begin + kTile - 1) / kTile : 0;
    ra::SegIds qids{};
    ra::DocTiles<kTile, kWarps> tiles;
    if constexpr (M) {
        if (docs) {
            const ra::SegIds kids = ra::kv_seg_ids(p.mask, b);
            qids = ra::q_seg_ids(p.mask, b);
            ra::row_ids(kids, k0 + warp * kRowsPerWarp, p.seqlen_k, kid);
            tiles.init_block(kids, k0, k0 + kBlockRows < p.seqlen_k ? k0 + kBlockRows : p.seqlen_k,
                             qids, i_begin, i_end, doc_words);
        }
    }
    auto next_tile = [&](int64_t t) -> ra::Hit {
        if constexpr (M) {
            if (docs) return tiles.next(t, n_tiles);
        }
        return ra::Hit{t, true};
    };

    for (int64_t g = 0; g < group; g++) {
        const int64_t h = hk * group + g;
        const ra::In<T> qg(p.q, b * p.q_batch_stride, h * p.q_head_stride, p.dtype);
        const ra::In<T> dog(p.dout, b * p.dout_batch_stride, h * p.dout_head_stride, p.dtype);
        const A *lseg = (const A *)p.lse + b * p.lse_batch_stride + h * p.lse_head_stride;
        const A *deltag = (const A *)p.delta + b * p.lse_batch_stride + h * p.lse_head_stride;
        // query tiles [i0, i0 + 32): every one from i_begin without M, with M
        // those the masks leave (hit: the tile's index from i_begin, and
        // whether its ids all equal the block's one id)
        ra::Hit hit = next_tile(0);
        auto step = [&](int64_t i0) -> int64_t {
            if constexpr (M) {
                hit = next_tile(hit.tile + 1);
                return i_begin + hit.tile * kTile;
            }
            return i0 + kTile;
        };
        for (int64_t i0 = M ? i_begin + hit.tile * kTile : i_begin;
             M ? hit.tile < n_tiles : i0 < p.seqlen_q; i0 = step(i0)) {
            const bool same = hit.same;
            __syncthreads();  // owned K, V written / previous tile consumed
            for (int idx = threadIdx.x; idx < kTile * D; idx += blockDim.x) {
                const int r = idx / D, d = idx % D;
                const int64_t i = i0 + r;
                const bool ok = i < p.seqlen_q;
                // pre-scaled as in the forward, so s matches its bits
                sq[r * ldq + d] = ok ? qg[i * p.q_seq_stride + d] * scale : (A)0;
                sdo[r * ldq + d] = ok ? dog[i * p.dout_seq_stride + d] : (A)0;
            }
            if (threadIdx.x < kTile) {
                const int64_t i = i0 + threadIdx.x;
                const bool ok = i < p.seqlen_q;
                slse[threadIdx.x] = ok ? lseg[i * p.lse_seq_stride] : ra::neg_inf<A>();
                sdelta[threadIdx.x] = ok ? deltag[i * p.lse_seq_stride] : (A)0;
            }
            __syncthreads();

            const int64_t qpos = p.q_pos_offset + (i0 + lane) * p.q_pos_stride;
            const A lse_i = slse[lane], delta_i = sdelta[lane];
            const A band_i = ra::band_of(lse_i);
            const bool doc_test = docs && !same;
            const int32_t qid = doc_test && i0 + lane < i_end ? qids.at(i0 + lane) : 0;
            // M with branches: the pair counts of the lane's query with the
            // warp's keys (mask.cuh pair_counts)
            uint32_t counts = 0;
            if constexpr (M) {
                if (br.n != 0)
                    counts = ra::pair_counts<kRowsPerWarp, true>(
                        br, br.head0 + br.head_stride * h, qpos,
                        p.k_pos_offset + (k0 + warp * kRowsPerWarp) * p.k_pos_stride,
                        p.k_pos_stride);
            }
            const int in = (int)(p.seqlen_q - i0 < kTile ? p.seqlen_q - i0 : kTile);
#pragma unroll
            for (int r = 0; r < kRowsPerWarp; r++) {
                const A *kr = sk + (warp * kRowsPerWarp + r) * D;
                const A *vr = sv + (warp * kRowsPerWarp + r) * D;
                const A *qi = sq + lane * ldq;
                const A *doi = sdo + lane * ldq;
                A s = 0, dp = 0;
                for (int d = 0; d < D; d++) {
                    s += qi[d] * kr[d];
                    dp += doi[d] * vr[d];
                }
                // lse_i = -inf covers rows past S_q and rows that saw no key
                A dcap = 1;  // d capped / d s
                bool vis;
                if constexpr (M) {
                    if (cap > 0) {
                        const A u = ra::tanh_acc(s * inv_cap);
                        s = cap * u;
                        dcap = 1 - u * u;
                    }
                    vis = lse_i != ra::neg_inf<A>() && ra::in_span(seers[r], qpos) &&
                          (!doc_test || kid[r] == qid);
                } else {
                    vis = lse_i != ra::neg_inf<A>() && (!p.causal || kpos[r] <= qpos);
                }
                auto exponent = [&]() -> A {
                    A x = ra::bwd_exponent(s - lse_i, band_i);
                    if constexpr (M) {  // the branch rule: a snapped pair reads as -ln(c)
                        if (counts != 0 && s - lse_i >= band_i)
                            x = (A)br.neg_ln[(counts >> (5 * r)) & 31u];
                    }
                    return x;
                };
                const A pr = vis ? ra::exp_acc(exponent()) : (A)0;
                A ds = pr * (dp - delta_i);
                if constexpr (M) ds *= dcap;
                for (int i = 0; i < in; i++) {
                    const A pb = __shfl_sync(0xffffffffu, pr, i);
                    const A dsb = __shfl_sync(0xffffffffu, ds, i);
                    const A *qrow = sq + i * ldq;
                    const A *dorow = sdo + i * ldq;
#pragma unroll
                    for (int t = 0; t < DPL; t++) {
                        const int d = lane + 32 * t;
                        if (d < D) {
                            dv[r][t] += pb * dorow[d];
                            dk[r][t] += dsb * qrow[d];
                        }
                    }
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < kRowsPerWarp; r++) {
        const int64_t j = k0 + warp * kRowsPerWarp + r;
        if (j >= p.seqlen_k) continue;
        const int64_t ok_ = b * p.dk_batch_stride + j * p.dk_seq_stride + hk * p.dk_head_stride;
        const int64_t ov = b * p.dv_batch_stride + j * p.dv_seq_stride + hk * p.dv_head_stride;
#pragma unroll
        for (int t = 0; t < DPL; t++) {
            const int d = lane + 32 * t;
            if (d >= D) continue;
            const A gk = dk[r][t], gv = dv[r][t];  // q was pre-scaled: dk has its scale
            if (p.accumulate) {
                ((A *)p.dk)[ok_ + d] += gk;
                ((A *)p.dv)[ov + d] += gv;
            } else {
                ra::store_dyn(p.dk, ok_ + d, p.grad_dtype, (double)gk);
                ra::store_dyn(p.dv, ov + d, p.grad_dtype, (double)gv);
            }
        }
    }
}

struct Launch {
    template <typename T, int DPL, bool M>
    static ra_status run(const ra_attn_bwd_params &p, cudaStream_t s) {
        typedef typename ra::Acc<T>::type A;
        const int D = (int)p.head_dim;
        const int ld = D | 1;
        // dk, dv: grid B * H_kv * ceil(S_k / 16), 128 threads
        if (p.seqlen_k > 0) {
            const size_t smem =
                (size_t)(2 * kBlockRows * D + 2 * kTile * ld + 2 * kTile) * sizeof(A) +
                (M ? 2 * kWarps * sizeof(uint32_t) : 0);
            RA_CHECK(ra_set_smem(dkdv_simt_kernel<T, DPL, M>, smem));
            const int64_t n_kblocks = (p.seqlen_k + kBlockRows - 1) / kBlockRows;
            int64_t blocks = 0;
            RA_CHECK(ra_grid_1d(n_kblocks * p.heads_kv * p.batch, 1, &blocks));
            RA_LAUNCH((dkdv_simt_kernel<T, DPL, M>), (unsigned)blocks, kWarps * 32, smem, s)(p, n_kblocks,
                                                                             ra::branches_of(p));
            RA_CUDA_CHECK_LAUNCH("dkdv_simt_kernel");
        }
        return RA_OK;
    }
};

}  // namespace

ra_status ra_bwd_simt(const ra_attn_bwd_params &p, cudaStream_t s) {
    RA_CHECK(ra_simt_dispatch<Launch>(p, s, "attention backward"));
    return ra_bwd_simt_dq(p, s);
}
