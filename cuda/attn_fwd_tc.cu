/*
 * attn_fwd_tc.cu -- the tensor-core attention forward for float16 and
 * bfloat16 with head_dim 64 or 128 (FlashAttention-2's algorithm on
 * mma.sync m16n8k16, sm_80 and newer).
 *
 * Computes out = softmax(scale * q k^T + mask) v and lse per query row,
 * float32 accumulation throughout; with p.accumulate the result is merged
 * into the float32 running state (out, lse) by the LSE rule.
 *
 * Shapes: q, out (B, S_q, H, D); k, v (B, S_k, H_kv, D); lse (B, H, S_q)
 * float32.  Rows must be 16-byte aligned (checked by ra_fwd_tc_supported).
 *
 * Algorithm: a block of 8 warps owns 128 query rows (16 per warp) of one
 * (b, h).  K and V tiles of 64 keys stream through shared memory, double
 * buffered with cp.async (tile n + 1 loads while tile n computes; one
 * barrier per tile).  Per tile each warp computes S = Q K^T (16 x 64) with
 * ldmatrix + mma from addresses computed once (fwd_tc/mainloop.cuh), masks
 * it only when the tile is not fully visible to the warp's rows (sequence
 * tail or causal diagonal), exponentiates it against its rows' pivots
 * (online softmax with a lazy rescale, fwd_tc/softmax.cuh), converts P to
 * 16-bit A fragments in registers and accumulates O += P V (V via
 * ldmatrix.trans).  Key tiles entirely in the causal future are never
 * loaded.  Rows that see no key end as out 0, lse -inf; a NaN score makes
 * l (so out and lse) NaN.  The results (fwd_tc/epilogue.cuh) go out through
 * shared memory in 16-byte stores, or merge into the running state.
 * Tile shapes and the model's numbers behind them: fwd_tc/traits.cuh.
 *
 * The masked variant (M, mask.cuh) walks only the key tiles the block's
 * window span and document ids leave, tests the elements of the tiles not
 * known to be fully visible against each row's span and segment id (the
 * tile's ids staged in shared memory with it), and soft-caps the scores:
 * s = c * tanh(scale * q.k / c), in log2 units.
 *
 * Launch: grid B * H * ceil(S_q / 128) (1-D, heaviest causal blocks first),
 * 256 threads, dynamic shared memory 4 * 64 * D * 2 bytes (Q 128 rows,
 * 2 x K, 2 x V of 64), with M 2 * 64 ids and 16 words of document tile bits
 * more.
 */
#include "attn_kernels.cuh"
#include "fwd_tc/epilogue.cuh"
#include "fwd_tc/mainloop.cuh"
#include "fwd_tc/softmax.cuh"
#include "fwd_tc/traits.cuh"

namespace {

using ra::fwd_tc::Traits;

template <typename T, int D, bool M>
__global__ void __launch_bounds__(Traits<D>::kThreads, Traits<D>::min_blocks(M))
fwd_tc_kernel(ra_attn_fwd_params p, int64_t n_qblocks, bool vec_out) {
    using Tr = Traits<D>;
    namespace ft = ra::fwd_tc;
    constexpr int kBlockQ = Tr::kBlockQ, kBlockK = Tr::kBlockK, kWarps = Tr::kWarps;
    constexpr int kNT = kBlockK / 8;  // n-tiles of S
    constexpr int kDT = D / 8;        // n-tiles of O
    unsigned char *smem = ra::dynamic_smem();
    int32_t *skid = reinterpret_cast<int32_t *>(smem + Tr::kIdsOffset);       // M: 2 x 64 ids
    uint32_t *doc_words = reinterpret_cast<uint32_t *>(smem + Tr::kWordsOffset);  // M: 16

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const ra::QBlock blk = ra::q_block<kBlockQ>(p, n_qblocks);
    const int64_t b = blk.b, h = blk.h, hk = blk.hk, q0 = blk.q0;

    const T *qg = (const T *)p.q + b * p.q_batch_stride + h * p.q_head_stride;
    const T *kg = (const T *)p.k + b * p.k_batch_stride + hk * p.k_head_stride;
    const T *vg = (const T *)p.v + b * p.v_batch_stride + hk * p.v_head_stride;

    const ra::Range keys = ra::block_keys<kBlockQ, M>(p, q0);
    const int64_t kbegin = keys.begin, kend = keys.end;  // kbegin = 0 without M
    // key tile j: keys kbegin + 64 j .. + 63; the first n_whole lie below
    // kend entirely (the loader's fast path)
    const int64_t n_tiles = kend > kbegin ? (kend - kbegin + kBlockK - 1) / kBlockK : 0;
    const int64_t n_whole = kend > kbegin ? (kend - kbegin) / kBlockK : 0;

    // this warp's rows w0 .. w0 + 15 (this thread's: g and g + 8 of them)
    const int64_t w0 = q0 + warp * 16;
    const int64_t w_last = w0 + 15 < p.seqlen_q ? w0 + 15 : p.seqlen_q - 1;
    const int64_t wpos_first = p.q_pos_offset + w0 * p.q_pos_stride;
    const float sl2 = (float)p.scale * ft::kLog2e;

    // Tiles [full_first, full_end) are fully visible to every row of the
    // warp: no element tests there (with M only when the tile's ids are
    // all the block's one id).  Causal: the tiles wholly at or before the
    // warp's first row.  M: the keys every row of the warp sees.
    int64_t full_first = 0, full_end = 0;
    if constexpr (M) {
        const int64_t w_lo = ra::keys_seen_by(p, p.q_pos_offset + w_last * p.q_pos_stride).lo;
        const int64_t w_hi = ra::keys_seen_by(p, wpos_first).hi;
        const int64_t klo = ra::count_below_sat(w_lo, p.k_pos_offset, p.k_pos_stride, p.seqlen_k);
        int64_t khi = ra::count_upto_sat(w_hi, p.k_pos_offset, p.k_pos_stride, p.seqlen_k);
        khi = khi < kend ? khi : kend;
        full_first = klo > kbegin ? (klo - kbegin + kBlockK - 1) / kBlockK : 0;
        full_end = khi > kbegin ? (khi - kbegin) / kBlockK : 0;
    } else {
        int64_t kvis = p.seqlen_k;
        if (p.causal) {
            const int64_t c = ra::count_upto(wpos_first, p.k_pos_offset, p.k_pos_stride, p.seqlen_k);
            kvis = c < kvis ? c : kvis;
        }
        full_end = kvis / kBlockK;
    }

    // masks (M): the rows' segment ids, soft-capping
    int32_t qid_a = 0, qid_b = 0;
    const bool docs = M && ra::mask_docs(p.mask);
    const bool capped = M && p.mask.softcap > 0;
    const float cap_in = capped ? (float)(p.scale / p.mask.softcap) : 0.f;
    const float cap_out = capped ? (float)(p.mask.softcap * (double)ft::kLog2e) : 0.f;
    ra::SegIds kids{};
    ra::DocTiles<kBlockK, kWarps> tiles;
    if constexpr (M) {
        if (docs) {
            const int64_t q_end = q0 + kBlockQ < p.seqlen_q ? q0 + kBlockQ : p.seqlen_q;
            const ra::SegIds qids = ra::q_seg_ids(p.mask, b);
            kids = ra::kv_seg_ids(p.mask, b);
            qid_a = w0 + g < p.seqlen_q ? qids.at(w0 + g) : 0;
            qid_b = w0 + g + 8 < p.seqlen_q ? qids.at(w0 + g + 8) : 0;
            tiles.init_block(qids, q0, q_end, kids, kbegin, kend, doc_words);
        }
    }
    auto next_tile = [&](int64_t j) -> ra::Hit {
        if constexpr (M) {
            if (docs) return tiles.next(j, n_tiles);
        }
        return ra::Hit{j, true};
    };
    const ft::TileLoader<Tr> loader(threadIdx.x);
    // keys of tile j into stage buf (and with documents their ids)
    auto stage = [&](int64_t j, int buf) {
        const uint32_t at = Tr::kQBytes + (uint32_t)buf * Tr::kStageBytes;
        const int64_t k0 = kbegin + j * kBlockK;
        if (j < n_whole) {
            loader.template load<kBlockK>(smem, at, kg, p.k_seq_stride, k0);
            loader.template load<kBlockK>(smem, at + Tr::kTileBytes, vg, p.v_seq_stride, k0);
        } else {
            loader.template load_checked<kBlockK, false>(smem, at, kg, p.k_seq_stride, k0, kend);
            loader.template load_checked<kBlockK, false>(smem, at + Tr::kTileBytes, vg,
                                                         p.v_seq_stride, k0, kend);
        }
        if constexpr (M) {
            // the ids by cp.async too: a plain load here would make every
            // tile wait for global memory (600 cycles in the one-warp schedule)
            if (docs && threadIdx.x < kBlockK) {
                const int64_t key = k0 + threadIdx.x;
                const bool ok = key < kend;
                ra::cp_async<4>(skid + buf * kBlockK + threadIdx.x,
                              ok ? kids.ids + key * kids.stride : kids.ids, ok);
            }
        }
    };

    const ft::FragAddr<Tr> frag(warp, lane);
    float o[kDT][4];
#pragma unroll
    for (int i = 0; i < kDT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    ft::RowState rows;
    rows.init();
    const float mul = capped ? 1.f : sl2;  // raw (or capped) scores -> log2 units

    // Key tiles stream double buffered.  Without M the it-th tile is tile
    // it; with M the it-th tile the masks leave (cur: its number, and
    // whether its ids all equal the block's one id).
    ra::Hit cur = next_tile(0);
    if (cur.tile < n_tiles) {
        loader.template load_checked<kBlockQ, true>(smem, 0, qg, p.q_seq_stride, q0, p.seqlen_q);
        stage(cur.tile, 0);
        ra::cp_async_commit();
    }

    for (int it = 0; cur.tile < n_tiles; it++) {
        const int buf = it & 1;
        ra::cp_async_wait<0>();
        // tile `it` (and Q) visible to every warp, and every warp done with
        // tile it - 1, whose stage the prefetch below refills
        __syncthreads();
        const ra::Hit nxt = next_tile(cur.tile + 1);
        if (nxt.tile < n_tiles) {
            stage(nxt.tile, buf ^ 1);
            ra::cp_async_commit();
        }
        const uint32_t at = (uint32_t)buf * Tr::kStageBytes;

        float s[kNT][4];
        ft::scores<T, Tr>(s, smem, frag, at);

        // soft-cap (into log2 units); mask only tiles not fully visible to
        // every row of the warp
        if (capped) {
#pragma unroll
            for (int i = 0; i < kNT; i++) {
#pragma unroll
                for (int e = 0; e < 4; e++) s[i][e] = ra::tanh_acc(s[i][e] * cap_in) * cap_out;
            }
        }
        if (!(full_first <= cur.tile && cur.tile < full_end && cur.same)) {
            const int64_t k0 = kbegin + cur.tile * kBlockK;
            const int64_t qpos_a = p.q_pos_offset + (w0 + g) * p.q_pos_stride;
            const int64_t qpos_b = qpos_a + 8 * p.q_pos_stride;
            if constexpr (M) {
                const ra::Span seen_a = ra::keys_seen_by(p, qpos_a);
                const ra::Span seen_b = ra::keys_seen_by(p, qpos_b);
                const int32_t *ids = skid + buf * kBlockK;
                const bool doc_test = docs && !cur.same;
#pragma unroll
                for (int i = 0; i < kNT; i++) {
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int col = i * 8 + 2 * t + e;
                        const int64_t key = k0 + col;
                        const int64_t kpos = p.k_pos_offset + key * p.k_pos_stride;
                        const bool in = key < kend;
                        const int32_t kid = doc_test ? ids[col] : 0;
                        if (!in || !ra::in_span(seen_a, kpos) || (doc_test && kid != qid_a))
                            s[i][e] = -CUDART_INF_F;
                        if (!in || !ra::in_span(seen_b, kpos) || (doc_test && kid != qid_b))
                            s[i][2 + e] = -CUDART_INF_F;
                    }
                }
            } else {
#pragma unroll
                for (int i = 0; i < kNT; i++) {
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int64_t key = k0 + i * 8 + 2 * t + e;
                        const int64_t kpos = p.k_pos_offset + key * p.k_pos_stride;
                        const bool in = key < kend;
                        if (!in || (p.causal && kpos > qpos_a)) s[i][e] = -CUDART_INF_F;
                        if (!in || (p.causal && kpos > qpos_b)) s[i][2 + e] = -CUDART_INF_F;
                    }
                }
            }
        }

        rows.step(s, o, mul);                       // s becomes P
        ft::accumulate<T, Tr>(o, s, smem, frag, at);  // O += P V
        cur = nxt;
    }

    // epilogue: finish the row sums, normalise, store or merge
    float lse[2];
    rows.finish(lse, mul);
    const ra::QBlock at = ra::q_block<kBlockQ>(p, n_qblocks, ft::block_index_again());
    const int64_t w_first = at.q0 + (threadIdx.x / 32) * 16;
    const ft::Rows r = ft::rows_of(p, at.b, at.h, w_first + (threadIdx.x % 32) / 4);
    if (p.accumulate) {
        ft::merge_running_state(p, o, r, rows.l, lse);
        return;
    }
    const float inv[2] = {rows.l[0] == 0.f ? 0.f : 1.f / rows.l[0],
                          rows.l[1] == 0.f ? 0.f : 1.f / rows.l[1]};
    if (vec_out)
        ft::store_staged<T, Tr>(p, o, r, inv, smem, threadIdx.x / 32, at.b, at.h, w_first);
    else
        ft::store_direct<T>(p, o, r, inv);
    ft::store_lse(r, lse);
}

struct Launch {
    template <typename T, int D, bool M>
    static ra_status run(const ra_attn_fwd_params &p, cudaStream_t s) {
        using Tr = Traits<D>;
        const size_t smem = Tr::smem_bytes(M);
        RA_CHECK(ra_set_smem(fwd_tc_kernel<T, D, M>, smem));
        const int64_t n_qblocks = (p.seqlen_q + Tr::kBlockQ - 1) / Tr::kBlockQ;
        int64_t blocks = 0;
        RA_CHECK(ra_grid_1d(n_qblocks * p.heads * p.batch, 1, &blocks));
        // 16-bit out in 16-byte stores when its rows allow them
        const bool vec_out = !p.accumulate && p.out_dtype == p.dtype && ra_aligned(p.out, 16) &&
                             p.out_batch_stride % 8 == 0 && p.out_seq_stride % 8 == 0 &&
                             p.out_head_stride % 8 == 0;
        // grid: B * H * ceil(S_q / 128) blocks of 256 threads
        RA_LAUNCH((fwd_tc_kernel<T, D, M>), (unsigned)blocks, Tr::kThreads, smem, s)(
            p, n_qblocks, vec_out);
        RA_CUDA_CHECK_LAUNCH("fwd_tc_kernel");
        return RA_OK;
    }
};

}  // namespace

bool ra_fwd_tc_supported(const ra_attn_fwd_params &p) {
    if (p.dtype != RA_FLOAT16 && p.dtype != RA_BFLOAT16) return false;
    if (p.head_dim != 64 && p.head_dim != 128) return false;
    if (p.seqlen_k <= 0) return false;
    if (p.out_dtype != p.dtype && p.out_dtype != RA_FLOAT32) return false;
    if (p.accumulate && p.out_dtype != RA_FLOAT32) return false;
    // cp.async moves 16-byte chunks: every q/k/v row must start 16-aligned
    if (!ra_aligned(p.q, 16) || !ra_aligned(p.k, 16) || !ra_aligned(p.v, 16)) return false;
    const int64_t s8[] = {p.q_batch_stride, p.q_seq_stride, p.q_head_stride,
                          p.k_batch_stride, p.k_seq_stride, p.k_head_stride,
                          p.v_batch_stride, p.v_seq_stride, p.v_head_stride};
    for (int64_t x : s8)
        if (x % 8 != 0) return false;
    // outputs are stored at least two elements at a time
    const unsigned ob = p.out_dtype == RA_FLOAT32 ? 8 : 4;
    if (!ra_aligned(p.out, ob)) return false;
    if (p.out_batch_stride % 2 || p.out_seq_stride % 2 || p.out_head_stride % 2) return false;
    return true;
}

ra_status ra_fwd_tc(const ra_attn_fwd_params &p, cudaStream_t s) {
    return ra_tc_dispatch<Launch>(p, s);
}
