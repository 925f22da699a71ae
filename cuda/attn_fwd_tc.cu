/*
 * attn_fwd_tc.cu -- the tensor-core attention forward for float16 and
 * bfloat16 with head_dim 64 or 128 (flash attention 2's algorithm on
 * mma.sync m16n8k16, sm_80 and newer).
 *
 * Computes out = softmax(scale * q k^T + mask) v and lse per query row,
 * float32 accumulation throughout; with p.accumulate the result is merged
 * into the float32 running state (out, lse) by the LSE rule.
 *
 * Shapes: q, out (B, S_q, H, D); k, v (B, S_k, H_kv, D); lse (B, H, S_q)
 * float32.  Rows must be 16-byte aligned (checked by ra_fwd_tc_supported).
 *
 * Algorithm: a block of 4 warps owns 64 query rows (16 per warp) of one
 * (b, h).  K and V tiles of 64 keys stream through shared memory, double
 * buffered with cp.async (tile n+1 loads while tile n computes).  Per tile
 * each warp computes S = Q K^T (16 x 64) with ldmatrix + mma, scales it into
 * log2 units, masks it only when the tile is not fully visible (sequence
 * tail or causal diagonal), updates its running row max / sum (online
 * softmax, rows reduced across the 4 lanes of a quad), converts P to 16-bit
 * A fragments in registers and accumulates O += P V (V via ldmatrix.trans).
 * Key tiles entirely in the causal future are never loaded.  Rows that see
 * no key keep m = -inf and l = 0 and end as out 0, lse -inf; a NaN score
 * makes l (so out and lse) NaN.
 *
 * The masked variant (M, mask.cuh) walks only the key tiles the block's
 * window span and document ids leave, tests the elements of the tiles not
 * known to be fully visible against each row's span and segment id (the
 * tile's ids staged in shared memory with it), and soft-caps the scores:
 * s = c * tanh(scale * q.k / c), in log2 units.
 *
 * Launch: grid B * H * ceil(S_q / 64) (1-D, heaviest causal blocks first),
 * 128 threads, dynamic shared memory 5 * 64 * D * 2 bytes (Q, 2 x K, 2 x V),
 * with M 2 * 64 ids and 8 words of document tile bits more.
 */
#include "attn_kernels.cuh"
#include "mma.cuh"

namespace {

constexpr int kWarps = 4;
constexpr int kBlockQ = 64;
constexpr int kBlockK = 64;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename T, int D, bool M>
__global__ void __launch_bounds__(kThreads)
fwd_tc_kernel(ra_attn_fwd_params p, int64_t n_qblocks) {
    unsigned char *smem_raw = ra::dynamic_smem();
    T *sq = reinterpret_cast<T *>(smem_raw);      // 64 x D
    T *sk = sq + kBlockQ * D;                      // 2 x 64 x D
    T *sv = sk + 2 * kBlockK * D;                  // 2 x 64 x D
    int32_t *skid = reinterpret_cast<int32_t *>(sv + 2 * kBlockK * D);  // M: 2 x 64 ids
    uint32_t *doc_words = reinterpret_cast<uint32_t *>(skid + 2 * kBlockK);  // M: 8
    constexpr int kDT = D / 8;                     // n-tiles of O
    constexpr int kNT = kBlockK / 8;               // n-tiles of S

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const ra::QBlock blk = ra::q_block<kBlockQ>(p, n_qblocks);
    const int64_t b = blk.b, h = blk.h, hk = blk.hk, q0 = blk.q0;

    const T *qg = (const T *)p.q + b * p.q_batch_stride + h * p.q_head_stride;
    const T *kg = (const T *)p.k + b * p.k_batch_stride + hk * p.k_head_stride;
    const T *vg = (const T *)p.v + b * p.v_batch_stride + hk * p.v_head_stride;

    const ra::Range keys = ra::block_keys<kBlockQ, M>(p, q0);
    const int64_t kbegin = keys.begin, kend = keys.end;  // kbegin = 0 without M
    const int n_tiles = (int)((kend + kBlockK - 1) / kBlockK);
    const int64_t qpos_first = p.q_pos_offset + q0 * p.q_pos_stride;

    // this thread's two rows (g and g + 8 of the warp's 16)
    const int64_t row_a = q0 + warp * 16 + g, row_b = row_a + 8;
    const int64_t qpos_a = p.q_pos_offset + row_a * p.q_pos_stride;
    const int64_t qpos_b = p.q_pos_offset + row_b * p.q_pos_stride;
    const float sl2 = (float)p.scale * kLog2e;

    // masks (M): the rows' key spans and ids, the block's bounds, soft-capping
    ra::Span seen_a{}, seen_b{};
    int64_t blk_lo = 0, blk_hi = 0;  // keys at or past blk_lo, up to blk_hi, every row sees
    int32_t qid_a = 0, qid_b = 0;
    const bool docs = M && ra::mask_docs(p.mask);
    const bool capped = M && p.mask.softcap > 0;
    const float cap_in = capped ? (float)(p.scale / p.mask.softcap) : 0.f;
    const float cap_out = capped ? (float)(p.mask.softcap * (double)kLog2e) : 0.f;
    const int64_t m_tiles = kend > kbegin ? (kend - kbegin + kBlockK - 1) / kBlockK : 0;
    ra::SegIds kids{};
    ra::DocTiles<kBlockK, kWarps> tiles;
    if constexpr (M) {
        seen_a = ra::keys_seen_by(p, qpos_a);
        seen_b = ra::keys_seen_by(p, qpos_b);
        const int64_t q_end = q0 + kBlockQ < p.seqlen_q ? q0 + kBlockQ : p.seqlen_q;
        blk_lo = ra::keys_seen_by(p, p.q_pos_offset + (q_end - 1) * p.q_pos_stride).lo;
        blk_hi = ra::keys_seen_by(p, qpos_first).hi;
        if (docs) {
            const ra::SegIds qids = ra::q_seg_ids(p.mask, b);
            kids = ra::kv_seg_ids(p.mask, b);
            qid_a = row_a < p.seqlen_q ? qids.at(row_a) : 0;
            qid_b = row_b < p.seqlen_q ? qids.at(row_b) : 0;
            tiles.init_block(qids, q0, q_end, kids, kbegin, kend, doc_words);
        }
    }
    auto next_tile = [&](int64_t it) -> ra::Hit {
        if constexpr (M) {
            if (docs) return tiles.next(it, m_tiles);
        }
        return ra::Hit{it, true};
    };
    // cp.async keys [k0, k0 + 64) into buffer buf (and with documents their ids)
    auto stage = [&](int64_t k0, int buf) {
        ra::cp_async_tile<T, D, kBlockK, kThreads>(sk + buf * kBlockK * D, kg, p.k_seq_stride,
                                                   k0, kend);
        ra::cp_async_tile<T, D, kBlockK, kThreads>(sv + buf * kBlockK * D, vg, p.v_seq_stride,
                                                   k0, kend);
        if constexpr (M) {
            if (docs && threadIdx.x < kBlockK) {
                const int64_t key = k0 + threadIdx.x;
                skid[buf * kBlockK + threadIdx.x] = key < kend ? kids.at(key) : 0;
            }
        }
    };

    float o[kDT][4];
#pragma unroll
    for (int i = 0; i < kDT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_a = -CUDART_INF_F, m_b = -CUDART_INF_F, l_a = 0.f, l_b = 0.f;

    // Key tiles stream double buffered: tile it + 1 loads while tile it
    // computes.  Without M tile it is keys [64 it, 64 it + 64); with M it is
    // the it-th tile the masks leave (cur: its index from kbegin, and whether
    // its ids all equal the block's one id).
    ra::Hit cur = next_tile(0);
    if (M ? cur.tile < m_tiles : n_tiles > 0) {
        ra::cp_async_tile<T, D, kBlockQ, kThreads>(sq, qg, p.q_seq_stride, q0, p.seqlen_q);
        stage(M ? kbegin + cur.tile * kBlockK : 0, 0);
        ra::cp_async_commit();
    }

    for (int it = 0; M ? cur.tile < m_tiles : it < n_tiles; it++) {
        const int buf = it & 1;
        ra::Hit nxt{};
        if constexpr (M) nxt = next_tile(cur.tile + 1);
        if (M ? nxt.tile < m_tiles : it + 1 < n_tiles) {
            // buffer buf ^ 1 was released by the __syncthreads ending it - 1
            stage(M ? kbegin + nxt.tile * kBlockK : (int64_t)(it + 1) * kBlockK, buf ^ 1);
            ra::cp_async_commit();
            ra::cp_async_wait<1>();
        } else {
            ra::cp_async_wait<0>();
        }
        __syncthreads();  // tile `it` (and Q) visible to every warp

        const T *kt = sk + buf * kBlockK * D;
        const T *vt = sv + buf * kBlockK * D;
        const int64_t k0 = M ? kbegin + cur.tile * kBlockK : (int64_t)it * kBlockK;
        const bool same = cur.same;

        // S = Q K^T for this warp's 16 rows x 64 keys
        float s[kNT][4];
#pragma unroll
        for (int i = 0; i < kNT; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t a[4];
            ra::frag_a<D>(a, sq, warp * 16, kk * 16);
#pragma unroll
            for (int n2 = 0; n2 < kNT / 2; n2++) {
                uint32_t bk[4];
                ra::frag_b_nk<D>(bk, kt, n2 * 16, kk * 16);
                ra::mma_16816<T>(s[2 * n2], a, bk[0], bk[1]);
                ra::mma_16816<T>(s[2 * n2 + 1], a, bk[2], bk[3]);
            }
        }

        // scale (or soft-cap) into log2 units; mask only tiles that are not
        // fully visible
        if constexpr (M) {
            const bool full = k0 + kBlockK <= kend &&
                p.k_pos_offset + k0 * p.k_pos_stride >= blk_lo &&
                p.k_pos_offset + (k0 + kBlockK - 1) * p.k_pos_stride <= blk_hi && same;
#pragma unroll
            for (int i = 0; i < kNT; i++) {
#pragma unroll
                for (int e = 0; e < 4; e++)
                    s[i][e] = capped ? ra::tanh_acc(s[i][e] * cap_in) * cap_out : s[i][e] * sl2;
            }
            if (!full) {
                const int32_t *ids = skid + buf * kBlockK;
                const bool doc_test = docs && !same;
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
            }
        } else {
            const bool full = k0 + kBlockK <= p.seqlen_k &&
                (!p.causal || p.k_pos_offset + (k0 + kBlockK - 1) * p.k_pos_stride <= qpos_first);
#pragma unroll
            for (int i = 0; i < kNT; i++) {
#pragma unroll
                for (int e = 0; e < 4; e++) s[i][e] *= sl2;
            }
            if (!full) {
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

        // online softmax: row max over the quad, rescale, exponentiate
        float mx_a = m_a, mx_b = m_b;
#pragma unroll
        for (int i = 0; i < kNT; i++) {
            mx_a = fmaxf(mx_a, fmaxf(s[i][0], s[i][1]));
            mx_b = fmaxf(mx_b, fmaxf(s[i][2], s[i][3]));
        }
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
        // a row with no visible key so far keeps -inf; use 0 as its pivot
        const float piv_a = mx_a == -CUDART_INF_F ? 0.f : mx_a;
        const float piv_b = mx_b == -CUDART_INF_F ? 0.f : mx_b;
        const float alpha_a = exp2f(m_a - piv_a), alpha_b = exp2f(m_b - piv_b);
        m_a = mx_a;
        m_b = mx_b;
        float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
        for (int i = 0; i < kNT; i++) {
            s[i][0] = exp2f(s[i][0] - piv_a);
            s[i][1] = exp2f(s[i][1] - piv_a);
            s[i][2] = exp2f(s[i][2] - piv_b);
            s[i][3] = exp2f(s[i][3] - piv_b);
            sum_a += s[i][0] + s[i][1];
            sum_b += s[i][2] + s[i][3];
        }
        l_a = l_a * alpha_a + sum_a;  // per-lane partial; quad-reduced at the end
        l_b = l_b * alpha_b + sum_b;
#pragma unroll
        for (int i = 0; i < kDT; i++) {
            o[i][0] *= alpha_a;
            o[i][1] *= alpha_a;
            o[i][2] *= alpha_b;
            o[i][3] *= alpha_b;
        }

        // O += P V: P's C fragments become A fragments (16 keys per k-step)
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; kk++) {
            uint32_t a[4];
            ra::a_from_c<T>(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
            for (int d2 = 0; d2 < kDT / 2; d2++) {
                uint32_t bv[4];
                ra::frag_b_kn<D>(bv, vt, kk * 16, d2 * 16);
                ra::mma_16816<T>(o[2 * d2], a, bv[0], bv[1]);
                ra::mma_16816<T>(o[2 * d2 + 1], a, bv[2], bv[3]);
            }
        }
        __syncthreads();  // every warp done with buffer buf before it is refilled
        if constexpr (M) cur = nxt;
    }

    // epilogue: finish the row sums, normalise, store or merge
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    const bool ok_a = row_a < p.seqlen_q, ok_b = row_b < p.seqlen_q;
    // a NaN l (a NaN score: exp2f(NaN) went into the sum) is not empty
    const bool empty_a = l_a == 0.f, empty_b = l_b == 0.f;
    const float inv_a = empty_a ? 0.f : 1.f / l_a, inv_b = empty_b ? 0.f : 1.f / l_b;
    const float lse_a = empty_a ? -CUDART_INF_F : (m_a + log2f(l_a)) * kLn2;
    const float lse_b = empty_b ? -CUDART_INF_F : (m_b + log2f(l_b)) * kLn2;
    float *lse_base = (float *)p.lse + b * p.lse_batch_stride + h * p.lse_head_stride;
    const int64_t orow_a = b * p.out_batch_stride + row_a * p.out_seq_stride + h * p.out_head_stride;
    const int64_t orow_b = orow_a + 8 * p.out_seq_stride;

    if (p.accumulate) {
        // out is the float32 running state; weights of old state and new part
        const float lo_a = ok_a ? lse_base[row_a * p.lse_seq_stride] : -CUDART_INF_F;
        const float lo_b = ok_b ? lse_base[row_b * p.lse_seq_stride] : -CUDART_INF_F;
        __syncwarp();  // the quad has read the old lse before lane t == 0 writes
        float w1_a = 1.f, w2_a = 0.f, w1_b = 1.f, w2_b = 0.f, ln_a = lo_a, ln_b = lo_b;
        if (!empty_a) {
            const float mm = fmaxf(lo_a, lse_a);
            const float e1 = __expf(lo_a - mm), e2 = __expf(lse_a - mm), sum = e1 + e2;
            w1_a = e1 / sum; w2_a = e2 / sum * inv_a; ln_a = mm + logf(sum);
        }
        if (!empty_b) {
            const float mm = fmaxf(lo_b, lse_b);
            const float e1 = __expf(lo_b - mm), e2 = __expf(lse_b - mm), sum = e1 + e2;
            w1_b = e1 / sum; w2_b = e2 / sum * inv_b; ln_b = mm + logf(sum);
        }
        float *out = (float *)p.out;
#pragma unroll
        for (int i = 0; i < kDT; i++) {
            const int d = i * 8 + 2 * t;
            if (ok_a && !empty_a) {
                float2 *dst = reinterpret_cast<float2 *>(out + orow_a + d);
                const float2 old = w1_a != 0.f ? *dst : make_float2(0.f, 0.f);
                *dst = make_float2(w1_a * old.x + w2_a * o[i][0], w1_a * old.y + w2_a * o[i][1]);
            }
            if (ok_b && !empty_b) {
                float2 *dst = reinterpret_cast<float2 *>(out + orow_b + d);
                const float2 old = w1_b != 0.f ? *dst : make_float2(0.f, 0.f);
                *dst = make_float2(w1_b * old.x + w2_b * o[i][2], w1_b * old.y + w2_b * o[i][3]);
            }
        }
        if (t == 0) {
            if (ok_a && !empty_a) lse_base[row_a * p.lse_seq_stride] = ln_a;
            if (ok_b && !empty_b) lse_base[row_b * p.lse_seq_stride] = ln_b;
        }
    } else {
        const bool out_f32 = p.out_dtype == RA_FLOAT32;
#pragma unroll
        for (int i = 0; i < kDT; i++) {
            const int d = i * 8 + 2 * t;
            if (out_f32) {
                float *out = (float *)p.out;
                if (ok_a) *reinterpret_cast<float2 *>(out + orow_a + d) = make_float2(o[i][0] * inv_a, o[i][1] * inv_a);
                if (ok_b) *reinterpret_cast<float2 *>(out + orow_b + d) = make_float2(o[i][2] * inv_b, o[i][3] * inv_b);
            } else {
                T *out = (T *)p.out;
                if (ok_a) *reinterpret_cast<uint32_t *>(out + orow_a + d) = ra::pack2<T>(o[i][0] * inv_a, o[i][1] * inv_a);
                if (ok_b) *reinterpret_cast<uint32_t *>(out + orow_b + d) = ra::pack2<T>(o[i][2] * inv_b, o[i][3] * inv_b);
            }
        }
        if (t == 0) {
            if (ok_a) lse_base[row_a * p.lse_seq_stride] = lse_a;
            if (ok_b) lse_base[row_b * p.lse_seq_stride] = lse_b;
        }
    }
}

struct Launch {
    template <typename T, int D, bool M>
    static ra_status run(const ra_attn_fwd_params &p, cudaStream_t s) {
        const size_t smem = (size_t)(kBlockQ + 4 * kBlockK) * D * sizeof(T) +
                            (M ? 2 * kBlockK * sizeof(int32_t) + 2 * kWarps * sizeof(uint32_t)
                               : 0);
        RA_CHECK(ra_set_smem(fwd_tc_kernel<T, D, M>, smem));
        const int64_t n_qblocks = (p.seqlen_q + kBlockQ - 1) / kBlockQ;
        int64_t blocks = 0;
        RA_CHECK(ra_grid_1d(n_qblocks * p.heads * p.batch, 1, &blocks));
        // grid: B * H * ceil(S_q / 64) blocks of 128 threads
        RA_LAUNCH((fwd_tc_kernel<T, D, M>), (unsigned)blocks, kThreads, smem, s)(p, n_qblocks);
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
    // outputs are stored two elements at a time
    const unsigned ob = p.out_dtype == RA_FLOAT32 ? 8 : 4;
    if (!ra_aligned(p.out, ob)) return false;
    if (p.out_batch_stride % 2 || p.out_seq_stride % 2 || p.out_head_stride % 2) return false;
    return true;
}

ra_status ra_fwd_tc(const ra_attn_fwd_params &p, cudaStream_t s) {
    return ra_tc_dispatch<Launch>(p, s);
}
