/*
 * attn_fwd_simt.cu -- the generic attention forward: every dtype (float32,
 * float64, float16, bfloat16), every head_dim 1..256, CUDA cores only.
 *
 * Computes, per query row i of head h (kv head h / (H / H_kv)):
 *   s_j = scale * q_i . k_j      for keys j visible to i
 *         (soft-capped: c * tanh(s_j / c) when p.mask.softcap = c > 0)
 *   out_i = sum_j softmax(s)_j v_j,  lse_i = log sum_j exp(s_j)
 * in the accumulator type A (double for float64 inputs, float otherwise),
 * by the online softmax over tiles of 32 keys (flash attention's recurrence
 * on CUDA cores).  With p.accumulate the result is merged into the running
 * state (out, lse) by the LSE rule.
 *
 * Shapes: q, out (B, S_q, H, D); k, v (B, S_k, H_kv, D); lse (B, H, S_q).
 *
 * Launch: one block of 4 warps per (b, h, 16 query rows); grid
 * B * H * ceil(S_q / 16), 1-D, heaviest causal blocks first.  Each warp owns
 * 4 query rows.  Per tile of 32 keys, K and V are staged in shared memory
 * (as A); lane j scores key j for each of the warp's rows, the warp reduces
 * max and sum with shuffles, and lane l accumulates output dims l, l+32, ...
 * (DPL = ceil(D/32) of them, a template parameter).  The masked variant
 * (M, mask.cuh) walks only the key tiles the block's window span and
 * document ids leave, and tests each (row, key) against them.
 * Shared memory: (16*D + 32*(D|1) + 32*D) * sizeof(A) bytes, dynamic, and
 * with M 8 words of document tile bits.
 */
#include "attn_kernels.cuh"

namespace {

constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 4;
constexpr int kBlockQ = kWarps * kRowsPerWarp;  // 16 query rows per block
constexpr int kTileK = 32;                       // keys per tile = lanes

template <typename T, int DPL, bool M>
__global__ void __launch_bounds__(kWarps * 32)
fwd_simt_kernel(ra_attn_fwd_params p, int64_t n_qblocks) {
    typedef typename ra::Acc<T>::type A;
    unsigned char *smem_raw = ra::dynamic_smem();
    A *sq = reinterpret_cast<A *>(smem_raw);
    const int D = (int)p.head_dim;
    const int ldk = D | 1;  // odd row stride: lanes reading one column hit distinct banks
    A *sk = sq + kBlockQ * D;
    A *sv = sk + kTileK * ldk;
    uint32_t *doc_words = reinterpret_cast<uint32_t *>(sv + kTileK * D);  // M: 2 * kWarps

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const ra::QBlock blk = ra::q_block<kBlockQ>(p, n_qblocks);
    const int64_t b = blk.b, h = blk.h, hk = blk.hk, q0 = blk.q0;

    const ra::In<T> qg(p.q, b * p.q_batch_stride, h * p.q_head_stride, p.dtype);
    const ra::In<T> kg(p.k, b * p.k_batch_stride, hk * p.k_head_stride, p.dtype);
    const ra::In<T> vg(p.v, b * p.v_batch_stride, hk * p.v_head_stride, p.dtype);
    const A scale = (A)p.scale;

    // q tile (16 x D), pre-scaled; rows past S_q are zero and never stored
    for (int idx = threadIdx.x; idx < kBlockQ * D; idx += blockDim.x) {
        const int r = idx / D, d = idx % D;
        const int64_t i = q0 + r;
        sq[idx] = i < p.seqlen_q ? qg[i * p.q_seq_stride + d] * scale : (A)0;
    }

    // keys [kbegin, kend) bound every row's visible keys
    const ra::Range keys = ra::block_keys<kBlockQ, M>(p, q0);
    const int64_t kbegin = keys.begin, kend = keys.end;

    A m[kRowsPerWarp], l[kRowsPerWarp], o[kRowsPerWarp][DPL];
    int64_t qpos[kRowsPerWarp];
    ra::Span seen[kRowsPerWarp];  // M: the key positions each row may see
    int32_t qid[kRowsPerWarp];    // M with documents: each row's segment id
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; r++) {
        m[r] = ra::neg_inf<A>();
        l[r] = 0;
        qpos[r] = p.q_pos_offset + (q0 + warp * kRowsPerWarp + r) * p.q_pos_stride;
        if constexpr (M) seen[r] = ra::keys_seen_by(p, qpos[r]);
#pragma unroll
        for (int t = 0; t < DPL; t++) o[r][t] = 0;
    }

    // masks (M): soft-capping, and the key tiles holding the block's documents
    const bool docs = M && ra::mask_docs(p.mask);
    const A cap = M ? (A)p.mask.softcap : (A)0;
    const A inv_cap = cap > 0 ? (A)1 / cap : (A)0;
    const int64_t n_tiles = kend > kbegin ? (kend - kbegin + kTileK - 1) / kTileK : 0;
    ra::SegIds kids{};
    ra::DocTiles<kTileK, kWarps> tiles;
    if constexpr (M) {
        if (docs) {
            const ra::SegIds qids = ra::q_seg_ids(p.mask, b);
            kids = ra::kv_seg_ids(p.mask, b);
            ra::row_ids(qids, q0 + warp * kRowsPerWarp, p.seqlen_q, qid);
            tiles.init_block(qids, q0, q0 + kBlockQ < p.seqlen_q ? q0 + kBlockQ : p.seqlen_q,
                             kids, kbegin, kend, doc_words);
        }
    }
    auto next_tile = [&](int64_t t) -> ra::Hit {
        if constexpr (M) {
            if (docs) return tiles.next(t, n_tiles);
        }
        return ra::Hit{t, true};
    };

    // key tiles [k0, k0 + 32): every one from 0 without M, with M those the
    // masks leave (hit: the tile's index from kbegin, and whether its ids
    // all equal the block's one id)
    ra::Hit hit = next_tile(0);
    auto step = [&](int64_t k0) -> int64_t {
        if constexpr (M) {
            hit = next_tile(hit.tile + 1);
            return kbegin + hit.tile * kTileK;
        }
        return k0 + kTileK;
    };
    for (int64_t k0 = M ? kbegin + hit.tile * kTileK : 0; M ? hit.tile < n_tiles : k0 < kend;
         k0 = step(k0)) {
        const bool same = hit.same;
        __syncthreads();  // q tile written / previous K, V tile consumed
        for (int idx = threadIdx.x; idx < kTileK * D; idx += blockDim.x) {
            const int j = idx / D, d = idx % D;
            const int64_t key = k0 + j;
            const bool ok = key < kend;
            sk[j * ldk + d] = ok ? kg[key * p.k_seq_stride + d] : (A)0;
            sv[j * D + d] = ok ? vg[key * p.v_seq_stride + d] : (A)0;
        }
        __syncthreads();

        const int64_t key = k0 + lane;
        const int64_t kpos = p.k_pos_offset + key * p.k_pos_stride;
        const bool kvalid = key < kend;
        const bool doc_test = docs && !same;
        const int32_t kid = doc_test && kvalid ? kids.at(key) : 0;
        const int jn = (int)(kend - k0 < kTileK ? kend - k0 : kTileK);
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; r++) {
            const A *qr = sq + (warp * kRowsPerWarp + r) * D;
            const A *kr = sk + lane * ldk;
            A s = 0;
            for (int d = 0; d < D; d++) s += qr[d] * kr[d];
            bool vis;
            if constexpr (M) {
                if (cap > 0) s = cap * ra::tanh_acc(s * inv_cap);
                vis = kvalid && ra::in_span(seen[r], kpos) && (!doc_test || kid == qid[r]);
            } else {
                vis = kvalid && (!p.causal || kpos <= qpos[r]);
            }
            s = vis ? s : ra::neg_inf<A>();
            A mnew = fmax(m[r], ra::warp_max(s));
            if (mnew == ra::neg_inf<A>()) {
                // warp-uniform: the row sees nothing yet, unless fmax passed
                // over a NaN score beside -inf (a NaN score makes the row
                // NaN: l, o and m become NaN below)
                if (!__any_sync(0xffffffffu, s != s)) continue;
                mnew = ra::nan_acc<A>();
            }
            const A alpha = ra::exp_acc(m[r] - mnew);  // 0 when m was -inf
            const A pj = vis ? ra::exp_acc(s - mnew) : (A)0;
            l[r] = l[r] * alpha + ra::warp_sum(pj);
            m[r] = mnew;
#pragma unroll
            for (int t = 0; t < DPL; t++) o[r][t] *= alpha;
            for (int j = 0; j < jn; j++) {
                const A pb = __shfl_sync(0xffffffffu, pj, j);
                const A *vr = sv + j * D;
#pragma unroll
                for (int t = 0; t < DPL; t++) {
                    const int d = lane + 32 * t;
                    if (d < D) o[r][t] += pb * vr[d];
                }
            }
        }
    }

    // epilogue: normalise, then store or merge into the running state
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; r++) {
        const int64_t i = q0 + warp * kRowsPerWarp + r;
        if (i >= p.seqlen_q) continue;
        const bool empty = l[r] == (A)0;  // a NaN l (NaN score) is not empty
        const A inv = empty ? (A)0 : (A)1 / l[r];
        const A lse_new = empty ? ra::neg_inf<A>() : m[r] + ra::log_acc(l[r]);
        A *lse = (A *)p.lse + b * p.lse_batch_stride + h * p.lse_head_stride +
                 i * p.lse_seq_stride;
        const int64_t orow = b * p.out_batch_stride + i * p.out_seq_stride +
                             h * p.out_head_stride;
        if (p.accumulate) {
            if (empty) continue;  // merging nothing leaves the state as it is
            A *out = (A *)p.out + orow;
            const A lo = *lse;
            __syncwarp();  // all lanes read the old lse before lane 0 writes
            const A mm = fmax(lo, lse_new);
            const A e1 = ra::exp_acc(lo - mm), e2 = ra::exp_acc(lse_new - mm);
            const A sum = e1 + e2;
            const A w1 = e1 / sum, w2 = e2 / sum * inv;
#pragma unroll
            for (int t = 0; t < DPL; t++) {
                const int d = lane + 32 * t;
                if (d < D) out[d] = (w1 != (A)0 ? w1 * out[d] : (A)0) + w2 * o[r][t];
            }
            if (lane == 0) *lse = mm + ra::log_acc(sum);
        } else {
#pragma unroll
            for (int t = 0; t < DPL; t++) {
                const int d = lane + 32 * t;
                if (d < D) ra::store_dyn(p.out, orow + d, p.out_dtype, (double)(o[r][t] * inv));
            }
            if (lane == 0) *lse = lse_new;
        }
    }
}

struct Launch {
    template <typename T, int DPL, bool M>
    static ra_status run(const ra_attn_fwd_params &p, cudaStream_t s) {
        typedef typename ra::Acc<T>::type A;
        const int D = (int)p.head_dim;
        const size_t smem = (size_t)(kBlockQ * D + kTileK * (D | 1) + kTileK * D) * sizeof(A) +
                            (M ? 2 * kWarps * sizeof(uint32_t) : 0);
        RA_CHECK(ra_set_smem(fwd_simt_kernel<T, DPL, M>, smem));
        const int64_t n_qblocks = (p.seqlen_q + kBlockQ - 1) / kBlockQ;
        int64_t blocks = 0;
        RA_CHECK(ra_grid_1d(n_qblocks * p.heads * p.batch, 1, &blocks));
        // grid: (B * H * ceil(S_q / 16)) blocks of 128 threads
        RA_LAUNCH((fwd_simt_kernel<T, DPL, M>), (unsigned)blocks, kWarps * 32, smem, s)(p, n_qblocks);
        RA_CUDA_CHECK_LAUNCH("fwd_simt_kernel");
        return RA_OK;
    }
};

}  // namespace

ra_status ra_fwd_simt(const ra_attn_fwd_params &p, cudaStream_t s) {
    return ra_simt_dispatch<Launch>(p, s, "attention");
}
