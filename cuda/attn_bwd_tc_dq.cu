/*
 * attn_bwd_tc_dq.cu -- the tensor-core backward's second pass: dq for
 * float16 and bfloat16 with head_dim 64 or 128 (mma.sync m16n8k16, sm_80
 * and newer).  The first pass (dk, dv) is attn_bwd_tc_dkdv.cu; this one
 * recomputes P rather than sharing it, so neither pass needs atomics or a
 * float32 scratch buffer.
 *
 * With P_ij = exp(scale * q_i . k_j - lse_i) for visible pairs (0 otherwise
 * and for rows whose final lse is -inf), dP_ij = dout_i . v_j and
 * dS_ij = P_ij (dP_ij - delta_i):   dq_i = scale * sum_j dS_ij k_j.
 *
 * Shapes: q, dout, dq (B, S_q, H, D); k, v (B, S_k, H_kv, D); lse, delta
 * (B, H, S_q) float32.  dq is float16/bfloat16 or float32 (float32 when
 * p.accumulate, which adds into it).
 *
 * Algorithm: a block of 4 warps owns 64 query rows of one (b, h), 16 per
 * warp; its Q and dout rows stay in shared memory and each thread keeps the
 * lse and delta of its two rows in registers.  Key tiles of 64 (K and V)
 * stream through shared memory, double buffered with cp.async; tiles wholly
 * in the causal future of the block's last query are never loaded.  Per tile
 * each warp computes
 *   S  = Q K^T        (16 x 64)   K as [n][k]
 *   dP = dout V^T     (16 x 64)   V as [n][k]
 *   P  = exp2(S * scale * log2e - lse2), masked on non-full tiles
 *   dS = P (dP - delta)
 *   dQ += dS K        (16 x D)    dS from registers, K as [k][n]
 * with dQ float32 in registers, written (times scale) once at the end by
 * its one owner thread: deterministic.  The exponent rule and what it
 * guarantees for huge scores: attn_bwd_tc.cuh.
 *
 * The masked variant (M, mask.cuh) walks only the key tiles the block's
 * window span and document ids leave, tests the elements of tiles not known
 * to be fully visible against each row's span and segment id, and with a
 * softcap c recomputes the capped score exactly as the forward did
 * (u = tanh(s * scale / c), score c * u) and multiplies dS by 1 - u^2.
 * With p.branches it also applies the branch rule of dilated attention to
 * the pairs the exponent rule snapped, after the P/dS pass (mask.cuh
 * branch_rule_fix).
 *
 * Launch: grid B * H * ceil(S_q / 64) (1-D, heaviest causal blocks first),
 * 128 threads, dynamic shared memory (2 * 64 + 4 * 64) * D * 2 bytes
 * (Q, dout, 2 x K, 2 x V), with M 2 * 64 ids and 8 words more.
 */
#include "attn_bwd_tc.cuh"

namespace {

using namespace ra::bwd_tc;

constexpr int kBlockM = kWarps * 16;  // query rows per block, 16 per warp
constexpr int kBlockN = 64;           // keys per streamed tile

template <int D, bool M>
constexpr size_t dq_smem_bytes() {
    return (size_t)(2 * kBlockM + 4 * kBlockN) * D * 2 +
           (M ? 2 * kBlockN * sizeof(int32_t) + 2 * kWarps * sizeof(uint32_t) : 0);
}

template <typename T, int D, bool M>
__global__ void __launch_bounds__(kThreads)
dq_tc_kernel(ra_attn_bwd_params p, int64_t n_qblocks, const __grid_constant__ ra::Branches br) {
    constexpr int kNT = kBlockN / 8;  // n-tiles of S, dP (keys)
    constexpr int kDT = D / 8;        // n-tiles of dQ
    unsigned char *smem_raw = ra::dynamic_smem();
    T *sq = reinterpret_cast<T *>(smem_raw);  // kBlockM x D, owned queries
    T *sdo = sq + kBlockM * D;                // kBlockM x D
    T *sk = sdo + kBlockM * D;                // 2 x kBlockN x D, streamed keys
    T *sv = sk + 2 * kBlockN * D;             // 2 x kBlockN x D
    int32_t *skid = reinterpret_cast<int32_t *>(sv + 2 * kBlockN * D);  // M: 2 x kBlockN ids
    uint32_t *doc_words = reinterpret_cast<uint32_t *>(skid + 2 * kBlockN);  // M: 8

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const ra::QBlock blk = ra::q_block<kBlockM>(p, n_qblocks);
    const int64_t b = blk.b, h = blk.h, hk = blk.hk, q0 = blk.q0;

    const T *qg = (const T *)p.q + b * p.q_batch_stride + h * p.q_head_stride;
    const T *dog = (const T *)p.dout + b * p.dout_batch_stride + h * p.dout_head_stride;
    const T *kg = (const T *)p.k + b * p.k_batch_stride + hk * p.k_head_stride;
    const T *vg = (const T *)p.v + b * p.v_batch_stride + hk * p.v_head_stride;

    // keys outside [kbegin, kend) are invisible to every query of the block
    const ra::Range keys = ra::block_keys<kBlockM, M>(p, q0);
    const int64_t kbegin = keys.begin, kend = keys.end;  // kbegin = 0 without M
    const int n_tiles = (int)((kend + kBlockN - 1) / kBlockN);

    // this thread's two rows (g and g + 8 of the warp's 16) and, with M,
    // the masks' bounds
    const DqRows r = dq_rows<M>(p, b, h, q0, kBlockM, q0 + warp * 16 + g);
    const int64_t row_a = r.row_a, row_b = row_a + 8;
    const bool docs = M && ra::mask_docs(p.mask);
    const int64_t m_tiles = kend > kbegin ? (kend - kbegin + kBlockN - 1) / kBlockN : 0;
    ra::SegIds kids{};
    ra::DocTiles<kBlockN, kWarps> tiles;
    if constexpr (M) {
        if (docs) {
            const int64_t q_end = q0 + kBlockM < p.seqlen_q ? q0 + kBlockM : p.seqlen_q;
            kids = ra::kv_seg_ids(p.mask, b);
            tiles.init_block(ra::q_seg_ids(p.mask, b), q0, q_end, kids, kbegin, kend, doc_words);
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
        ra::cp_async_tile<T, D, kBlockN, kThreads>(sk + buf * kBlockN * D, kg, p.k_seq_stride,
                                                   k0, kend);
        ra::cp_async_tile<T, D, kBlockN, kThreads>(sv + buf * kBlockN * D, vg, p.v_seq_stride,
                                                   k0, kend);
        if constexpr (M) {
            if (docs && threadIdx.x < kBlockN) {
                const int64_t key = k0 + threadIdx.x;
                skid[buf * kBlockN + threadIdx.x] = key < kend ? kids.at(key) : 0;
            }
        }
    };

    float dq[kDT][4];
#pragma unroll
    for (int i = 0; i < kDT; i++) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;

    // Key tiles stream double buffered: tile it + 1 loads while tile it
    // computes.  Without M tile it is keys [64 it, 64 it + 64); with M it is
    // the it-th tile the masks leave (cur: its index from kbegin, and whether
    // its ids all equal the block's one id).
    ra::Hit cur = next_tile(0);
    if (M ? cur.tile < m_tiles : n_tiles > 0) {
        // group 0: the owned Q, dout rows and the first key tile
        ra::cp_async_tile<T, D, kBlockM, kThreads>(sq, qg, p.q_seq_stride, q0, p.seqlen_q);
        ra::cp_async_tile<T, D, kBlockM, kThreads>(sdo, dog, p.dout_seq_stride, q0, p.seqlen_q);
        stage(M ? kbegin + cur.tile * kBlockN : 0, 0);
        ra::cp_async_commit();
    }

    for (int it = 0; M ? cur.tile < m_tiles : it < n_tiles; it++) {
        const int buf = it & 1;
        ra::Hit nxt{};
        if constexpr (M) nxt = next_tile(cur.tile + 1);
        if (M ? nxt.tile < m_tiles : it + 1 < n_tiles) {
            // buffer buf ^ 1 was released by the __syncthreads ending it - 1
            stage(M ? kbegin + nxt.tile * kBlockN : (int64_t)(it + 1) * kBlockN, buf ^ 1);
            ra::cp_async_commit();
            ra::cp_async_wait<1>();
        } else {
            ra::cp_async_wait<0>();
        }
        __syncthreads();  // tile `it` (and Q, dout) visible to every warp

        const T *kt = sk + buf * kBlockN * D;
        const T *vt = sv + buf * kBlockN * D;
        const int64_t k0 = M ? kbegin + cur.tile * kBlockN : (int64_t)it * kBlockN;
        const bool same = cur.same;

        // S = Q K^T and dP = dout V^T: the warp's 16 rows x 64 keys
        float s[kNT][4], dp[kNT][4];
#pragma unroll
        for (int i = 0; i < kNT; i++) {
#pragma unroll
            for (int e = 0; e < 4; e++) s[i][e] = dp[i][e] = 0.f;
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t aq[4], ao[4];
            ra::frag_a<D>(aq, sq, warp * 16, kk * 16);
            ra::frag_a<D>(ao, sdo, warp * 16, kk * 16);
#pragma unroll
            for (int n2 = 0; n2 < kNT / 2; n2++) {
                uint32_t bk[4], bv[4];
                ra::frag_b_nk<D>(bk, kt, n2 * 16, kk * 16);
                ra::mma_16816<T>(s[2 * n2], aq, bk[0], bk[1]);
                ra::mma_16816<T>(s[2 * n2 + 1], aq, bk[2], bk[3]);
                ra::frag_b_nk<D>(bv, vt, n2 * 16, kk * 16);
                ra::mma_16816<T>(dp[2 * n2], ao, bv[0], bv[1]);
                ra::mma_16816<T>(dp[2 * n2 + 1], ao, bv[2], bv[3]);
            }
        }

        // P and dS = P (dP - delta); element (i, e) of the fragment is row
        // g (e < 2) or g + 8, key k0 + 8i + 2t + (e & 1)
        dq_p_ds<M, kNT>(
            p, r, br, [&](int i, int e) { return s[i][e]; },
            [&](int i, int e) -> float & { return dp[i][e]; }, k0, kend, same,
            skid + buf * kBlockN, h);

        // dQ += dS K: k runs over the tile's 64 keys
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; kk++) {
            uint32_t a[4];
            ra::a_from_c<T>(a, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
            for (int d2 = 0; d2 < kDT / 2; d2++) {
                uint32_t bk[4];
                ra::frag_b_kn<D>(bk, kt, kk * 16, d2 * 16);
                ra::mma_16816<T>(dq[2 * d2], a, bk[0], bk[1]);
                ra::mma_16816<T>(dq[2 * d2 + 1], a, bk[2], bk[3]);
            }
        }
        __syncthreads();  // every warp done with buffer buf before it is refilled
        if constexpr (M) cur = nxt;
    }

    // epilogue: rows g, g + 8 of the warp's queries, columns 8i + 2t, + 1
    const float scale = (float)p.scale;
    const bool f32 = p.grad_dtype == RA_FLOAT32;
    const bool acc = p.accumulate != 0;
    const int64_t dq_a = b * p.dq_batch_stride + row_a * p.dq_seq_stride + h * p.dq_head_stride;
    const int64_t dq_b = dq_a + 8 * p.dq_seq_stride;
#pragma unroll
    for (int i = 0; i < kDT; i++) {
        const int d = i * 8 + 2 * t;
        if (row_a < p.seqlen_q)
            store_grad2<T>(p.dq, dq_a + d, acc, f32, dq[i][0] * scale, dq[i][1] * scale);
        if (row_b < p.seqlen_q)
            store_grad2<T>(p.dq, dq_b + d, acc, f32, dq[i][2] * scale, dq[i][3] * scale);
    }
}

struct Launch {
    template <typename T, int D, bool M>
    static ra_status run(const ra_attn_bwd_params &p, cudaStream_t s) {
        const size_t smem = dq_smem_bytes<D, M>();
        RA_CHECK(ra_set_smem(dq_tc_kernel<T, D, M>, smem));
        const int64_t n_qblocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
        int64_t blocks = 0;
        RA_CHECK(ra_grid_1d(n_qblocks * p.heads * p.batch, 1, &blocks));
        // grid: B * H * ceil(S_q / 64) blocks of 128 threads;
        // q, dout, dq (B, S_q, H, D), k, v (B, S_k, H_kv, D)
        RA_LAUNCH((dq_tc_kernel<T, D, M>), (unsigned)blocks, kThreads, smem, s)(p, n_qblocks,
                                                                          ra::branches_of(p));
        RA_CUDA_CHECK_LAUNCH("dq_tc_kernel");
        return RA_OK;
    }
};

}  // namespace

ra_status ra_bwd_tc_dq(const ra_attn_bwd_params &p, cudaStream_t s) {
    if (p.seqlen_q <= 0) return RA_OK;
    return ra_tc_dispatch<Launch>(p, s);
}
