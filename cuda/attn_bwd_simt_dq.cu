/*
 * attn_bwd_simt_dq.cu -- the generic backward's dq pass (every dtype, head_dim
 * 1..256, CUDA cores): one block per (b, h, 16 queries) loops over the
 * visible key tiles of 32; lane j handles key j, each warp owns 4 query
 * rows and accumulates their dq rows in registers.  The method, the shapes,
 * the masked variant and the score recomputation are described in
 * attn_bwd_simt.cu.
 */
#include "attn_bwd_simt.cuh"

namespace {

using namespace ra::bwd_simt;

template <typename T, int DPL, bool M>
__global__ void __launch_bounds__(kWarps * 32)
dq_simt_kernel(ra_attn_bwd_params p, int64_t n_qblocks, const __grid_constant__ ra::Branches br) {
    typedef typename ra::Acc<T>::type A;
    unsigned char *smem_raw = ra::dynamic_smem();
    const int D = (int)p.head_dim;
    const int ldk = D | 1;
    A *sq = reinterpret_cast<A *>(smem_raw);  // 16 x D, owned queries
    A *sdo = sq + kBlockRows * D;               // 16 x D
    A *sk = sdo + kBlockRows * D;               // 32 x ldk, streamed keys
    A *sv = sk + kTile * ldk;                   // 32 x ldk
    uint32_t *doc_words = reinterpret_cast<uint32_t *>(sv + kTile * ldk);  // M: 2 * kWarps

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const ra::QBlock blk = ra::q_block<kBlockRows>(p, n_qblocks);
    const int64_t b = blk.b, h = blk.h, hk = blk.hk, q0 = blk.q0;
    const A scale = (A)p.scale;

    const ra::In<T> qg(p.q, b * p.q_batch_stride, h * p.q_head_stride, p.dtype);
    const ra::In<T> dog(p.dout, b * p.dout_batch_stride, h * p.dout_head_stride, p.dtype);
    const ra::In<T> kg(p.k, b * p.k_batch_stride, hk * p.k_head_stride, p.dtype);
    const ra::In<T> vg(p.v, b * p.v_batch_stride, hk * p.v_head_stride, p.dtype);
    for (int idx = threadIdx.x; idx < kBlockRows * D; idx += blockDim.x) {
        const int r = idx / D, d = idx % D;
        const int64_t i = q0 + r;
        const bool ok = i < p.seqlen_q;
        sq[idx] = ok ? qg[i * p.q_seq_stride + d] * scale : (A)0;  // as the forward
        sdo[idx] = ok ? dog[i * p.dout_seq_stride + d] : (A)0;
    }

    A dq[kRowsPerWarp][DPL], lse[kRowsPerWarp], delta[kRowsPerWarp], band[kRowsPerWarp];
    int64_t qpos[kRowsPerWarp];
    ra::Span seen[kRowsPerWarp];  // M: the key positions each row may see
    int32_t qid[kRowsPerWarp];    // M with documents: each row's segment id
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; r++) {
        const int64_t i = q0 + warp * kRowsPerWarp + r;
        qpos[r] = p.q_pos_offset + i * p.q_pos_stride;
        const int64_t li = b * p.lse_batch_stride + h * p.lse_head_stride + i * p.lse_seq_stride;
        const bool ok = i < p.seqlen_q;
        lse[r] = ok ? ((const A *)p.lse)[li] : ra::neg_inf<A>();
        delta[r] = ok ? ((const A *)p.delta)[li] : (A)0;
        band[r] = ra::band_of(lse[r]);
        if constexpr (M) seen[r] = ra::keys_seen_by(p, qpos[r]);
#pragma unroll
        for (int t = 0; t < DPL; t++) dq[r][t] = 0;
    }

    // keys [kbegin, kend) bound every row's visible keys
    const ra::Range keys = ra::block_keys<kBlockRows, M>(p, q0);
    const int64_t kbegin = keys.begin, kend = keys.end;

    // masks (M): soft-capping, and the key tiles holding the block's documents
    const bool docs = M && ra::mask_docs(p.mask);
    const A cap = M ? (A)p.mask.softcap : (A)0;
    const A inv_cap = cap > 0 ? (A)1 / cap : (A)0;
    const int64_t n_tiles = kend > kbegin ? (kend - kbegin + kTile - 1) / kTile : 0;
    ra::SegIds kids{};
    ra::DocTiles<kTile, kWarps> tiles;
    if constexpr (M) {
        if (docs) {
            const ra::SegIds qids = ra::q_seg_ids(p.mask, b);
            kids = ra::kv_seg_ids(p.mask, b);
            ra::row_ids(qids, q0 + warp * kRowsPerWarp, p.seqlen_q, qid);
            tiles.init_block(qids, q0, q0 + kBlockRows < p.seqlen_q ? q0 + kBlockRows : p.seqlen_q,
                             kids, kbegin, kend, doc_words);
        }
    }
    auto next_tile = [&](int64_t t) -> ra::Hit {
        if constexpr (M) {
            if (docs) return tiles.next(t, n_tiles);
        }
        return ra::Hit{t, true};
    };

    // key tiles [j0, j0 + 32): every one from 0 without M, with M those the
    // masks leave (hit: the tile's index from kbegin, and whether its ids
    // all equal the block's one id)
    ra::Hit hit = next_tile(0);
    auto step = [&](int64_t j0) -> int64_t {
        if constexpr (M) {
            hit = next_tile(hit.tile + 1);
            return kbegin + hit.tile * kTile;
        }
        return j0 + kTile;
    };
    for (int64_t j0 = M ? kbegin + hit.tile * kTile : 0; M ? hit.tile < n_tiles : j0 < kend;
         j0 = step(j0)) {
        const bool same = hit.same;
        __syncthreads();  // owned Q, dO written / previous tile consumed
        for (int idx = threadIdx.x; idx < kTile * D; idx += blockDim.x) {
            const int r = idx / D, d = idx % D;
            const int64_t j = j0 + r;
            const bool ok = j < kend;
            sk[r * ldk + d] = ok ? kg[j * p.k_seq_stride + d] : (A)0;
            sv[r * ldk + d] = ok ? vg[j * p.v_seq_stride + d] : (A)0;
        }
        __syncthreads();

        const int64_t key = j0 + lane;
        const int64_t kpos = p.k_pos_offset + key * p.k_pos_stride;
        const bool kvalid = key < kend;
        const bool doc_test = docs && !same;
        const int32_t kid = doc_test && kvalid ? kids.at(key) : 0;
        // M with branches: the pair counts of the warp's rows with the lane's
        // key (mask.cuh pair_counts)
        uint32_t counts = 0;
        if constexpr (M) {
            if (br.n != 0)
                counts = ra::pair_counts<kRowsPerWarp, false>(
                    br, br.head0 + br.head_stride * h, kpos,
                    p.q_pos_offset + (q0 + warp * kRowsPerWarp) * p.q_pos_stride,
                    p.q_pos_stride);
        }
        const int jn = (int)(kend - j0 < kTile ? kend - j0 : kTile);
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; r++) {
            if (lse[r] == ra::neg_inf<A>()) continue;  // warp-uniform: empty row, dq = 0
            const A *qr = sq + (warp * kRowsPerWarp + r) * D;
            const A *dor = sdo + (warp * kRowsPerWarp + r) * D;
            const A *kj = sk + lane * ldk;
            const A *vj = sv + lane * ldk;
            A s = 0, dp = 0;
            for (int d = 0; d < D; d++) {
                s += qr[d] * kj[d];
                dp += dor[d] * vj[d];
            }
            A dcap = 1;  // d capped / d s
            bool vis;
            if constexpr (M) {
                if (cap > 0) {
                    const A u = ra::tanh_acc(s * inv_cap);
                    s = cap * u;
                    dcap = 1 - u * u;
                }
                vis = kvalid && ra::in_span(seen[r], kpos) && (!doc_test || kid == qid[r]);
            } else {
                vis = kvalid && (!p.causal || kpos <= qpos[r]);
            }
            auto exponent = [&]() -> A {
                A x = ra::bwd_exponent(s - lse[r], band[r]);
                if constexpr (M) {  // the branch rule: a snapped pair reads as -ln(c)
                    if (counts != 0 && s - lse[r] >= band[r])
                        x = (A)br.neg_ln[(counts >> (5 * r)) & 31u];
                }
                return x;
            };
            const A pr = vis ? ra::exp_acc(exponent()) : (A)0;
            A ds = pr * (dp - delta[r]);
            if constexpr (M) ds *= dcap;
            for (int j = 0; j < jn; j++) {
                const A dsb = __shfl_sync(0xffffffffu, ds, j);
                const A *krow = sk + j * ldk;
#pragma unroll
                for (int t = 0; t < DPL; t++) {
                    const int d = lane + 32 * t;
                    if (d < D) dq[r][t] += dsb * krow[d];
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < kRowsPerWarp; r++) {
        const int64_t i = q0 + warp * kRowsPerWarp + r;
        if (i >= p.seqlen_q) continue;
        const int64_t oq = b * p.dq_batch_stride + i * p.dq_seq_stride + h * p.dq_head_stride;
#pragma unroll
        for (int t = 0; t < DPL; t++) {
            const int d = lane + 32 * t;
            if (d >= D) continue;
            const A g = dq[r][t] * scale;
            if (p.accumulate) ((A *)p.dq)[oq + d] += g;
            else ra::store_dyn(p.dq, oq + d, p.grad_dtype, (double)g);
        }
    }
}

struct Launch {
    template <typename T, int DPL, bool M>
    static ra_status run(const ra_attn_bwd_params &p, cudaStream_t s) {
        typedef typename ra::Acc<T>::type A;
        const int D = (int)p.head_dim;
        const int ld = D | 1;
        // dq: grid B * H * ceil(S_q / 16), 128 threads
        if (p.seqlen_q > 0) {
            const size_t smem = (size_t)(2 * kBlockRows * D + 2 * kTile * ld) * sizeof(A) +
                                (M ? 2 * kWarps * sizeof(uint32_t) : 0);
            RA_CHECK(ra_set_smem(dq_simt_kernel<T, DPL, M>, smem));
            const int64_t n_qblocks = (p.seqlen_q + kBlockRows - 1) / kBlockRows;
            int64_t blocks = 0;
            RA_CHECK(ra_grid_1d(n_qblocks * p.heads * p.batch, 1, &blocks));
            RA_LAUNCH((dq_simt_kernel<T, DPL, M>), (unsigned)blocks, kWarps * 32, smem, s)(p, n_qblocks,
                                                                           ra::branches_of(p));
            RA_CUDA_CHECK_LAUNCH("dq_simt_kernel");
        }
        return RA_OK;
    }
};

}  // namespace

ra_status ra_bwd_simt_dq(const ra_attn_bwd_params &p, cudaStream_t s) {
    return ra_simt_dispatch<Launch>(p, s, "attention backward");
}
