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
 * D = 64, 32 for D = 128, to keep the accumulators in registers) stream
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
 *
 * Launch: grid B * H_kv * ceil(S_k / 64) (1-D; the earliest keys, which see
 * the most causal queries, first), 128 threads, dynamic shared memory
 * (2 * 64 + 4 * BM) * D * 2 + 4 * BM * 4 bytes.
 */
#include "attn_bwd_tc.cuh"

namespace {

using namespace ra::bwd_tc;

constexpr int kBlockN = kWarps * 16;  // keys per block, 16 per warp

template <int D> struct Tile { static constexpr int BM = D == 64 ? 64 : 32; };

template <int D>
constexpr size_t dkdv_smem_bytes() {
    return (size_t)(2 * kBlockN + 4 * Tile<D>::BM) * D * 2 + (size_t)4 * Tile<D>::BM * sizeof(float);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
dkdv_tc_kernel(ra_attn_bwd_params p, int64_t n_kblocks) {
    constexpr int BM = Tile<D>::BM;
    constexpr int kMT = BM / 8;  // n-tiles of S^T, dP^T (queries)
    constexpr int kDT = D / 8;   // n-tiles of dK, dV
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *sk = reinterpret_cast<T *>(smem_raw);  // kBlockN x D, owned keys
    T *sv = sk + kBlockN * D;                 // kBlockN x D
    T *sq = sv + kBlockN * D;                 // 2 x BM x D, streamed queries
    T *sdo = sq + 2 * BM * D;                 // 2 x BM x D
    float *slse = reinterpret_cast<float *>(sdo + 2 * BM * D);  // 2 x BM, log2 units
    float *sdelta = slse + 2 * BM;                              // 2 x BM

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const ra::KBlock blk = ra::k_block<kBlockN>(p, n_kblocks);
    const int64_t b = blk.b, hk = blk.hk, group = blk.group, k0 = blk.k0;

    const T *kg = (const T *)p.k + b * p.k_batch_stride + hk * p.k_head_stride;
    const T *vg = (const T *)p.v + b * p.v_batch_stride + hk * p.v_head_stride;

    // queries before i_begin see none of this block's keys
    const int64_t i_begin = ra::block_query_begin(p, k0);
    const int64_t n_mtiles = (p.seqlen_q - i_begin + BM - 1) / BM;
    const int64_t n_iters = group * n_mtiles;  // (query head, query tile) pairs

    // this thread's two keys: rows g and g + 8 of the warp's 16
    const int64_t key_a = k0 + warp * 16 + g, key_b = key_a + 8;
    const int64_t kpos_a = p.k_pos_offset + key_a * p.k_pos_stride;
    const int64_t kpos_b = p.k_pos_offset + key_b * p.k_pos_stride;
    // a tile needs no mask when all 64 keys exist and its first query sees the last key
    const bool keys_full = k0 + kBlockN <= p.seqlen_k;
    const int64_t kpos_block_last = p.k_pos_offset + (k0 + kBlockN - 1) * p.k_pos_stride;
    const float sl2 = (float)p.scale * kLog2e;

    // Stage iteration `it` -- query head hk * group + it / n_mtiles, query
    // rows m0 .. m0 + BM - 1 -- into buffer `buf`: Q and dout by cp.async,
    // lse and delta by plain stores (visible after the next __syncthreads).
    auto stage = [&](int64_t it, int buf) {
        const int64_t h = hk * group + it / n_mtiles;
        const int64_t m0 = i_begin + (it % n_mtiles) * BM;
        const T *qg = (const T *)p.q + b * p.q_batch_stride + h * p.q_head_stride;
        const T *dog = (const T *)p.dout + b * p.dout_batch_stride + h * p.dout_head_stride;
        ra::cp_async_tile<T, D, BM, kThreads>(sq + buf * BM * D, qg, p.q_seq_stride, m0, p.seqlen_q);
        ra::cp_async_tile<T, D, BM, kThreads>(sdo + buf * BM * D, dog, p.dout_seq_stride, m0,
                                              p.seqlen_q);
        if (threadIdx.x < BM)
            row_stats(p, b * p.lse_batch_stride + h * p.lse_head_stride, m0 + threadIdx.x,
                      slse + buf * BM + threadIdx.x, sdelta + buf * BM + threadIdx.x);
    };

    float dk[kDT][4], dv[kDT][4];
#pragma unroll
    for (int i = 0; i < kDT; i++) {
#pragma unroll
        for (int e = 0; e < 4; e++) dk[i][e] = dv[i][e] = 0.f;
    }

    if (n_iters > 0) {
        // group 0: the owned K, V rows and the first query tile
        ra::cp_async_tile<T, D, kBlockN, kThreads>(sk, kg, p.k_seq_stride, k0, p.seqlen_k);
        ra::cp_async_tile<T, D, kBlockN, kThreads>(sv, vg, p.v_seq_stride, k0, p.seqlen_k);
        stage(0, 0);
        ra::cp_async_commit();
    }

    for (int64_t it = 0; it < n_iters; it++) {
        const int buf = (int)(it & 1);
        if (it + 1 < n_iters) {
            // buffer buf ^ 1 was released by the __syncthreads ending it - 1
            stage(it + 1, buf ^ 1);
            ra::cp_async_commit();
            ra::cp_async_wait<1>();
        } else {
            ra::cp_async_wait<0>();
        }
        __syncthreads();  // tile `it` (and K, V) visible to every warp

        const T *qt = sq + buf * BM * D;
        const T *dot = sdo + buf * BM * D;
        const float *lt = slse + buf * BM;
        const float *dt = sdelta + buf * BM;
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

        // P^T = exp2(S^T * scale * log2e - lse2[query]); element (i, e) of
        // the fragment is key row g (e < 2) or g + 8, query m0 + 8i + 2t + (e & 1)
        const bool full = keys_full &&
            (!p.causal || kpos_block_last <= p.q_pos_offset + m0 * p.q_pos_stride);
#pragma unroll
        for (int i = 0; i < kMT; i++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = i * 8 + 2 * t + e;
                const float l2 = lt[col];
                float pa = exp2f(fminf(s[i][e] * sl2 - l2, 0.f));
                float pb = exp2f(fminf(s[i][2 + e] * sl2 - l2, 0.f));
                if (!full) {
                    const int64_t qpos = p.q_pos_offset + (m0 + col) * p.q_pos_stride;
                    if (key_a >= p.seqlen_k || (p.causal && kpos_a > qpos)) pa = 0.f;
                    if (key_b >= p.seqlen_k || (p.causal && kpos_b > qpos)) pb = 0.f;
                }
                s[i][e] = pa;
                s[i][2 + e] = pb;
            }
        }

        // dV += P^T dout: k runs over the tile's BM queries
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

        // dP^T = V dout^T: 16 keys x BM queries
        float dp[kMT][4];
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
    template <typename T, int D>
    static ra_status run(const ra_attn_bwd_params &p, cudaStream_t s) {
        const size_t smem = dkdv_smem_bytes<D>();
        RA_CHECK(ra_set_smem(dkdv_tc_kernel<T, D>, smem));
        const int64_t n_kblocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
        int64_t blocks = 0;
        RA_CHECK(ra_grid_1d(n_kblocks * p.heads_kv * p.batch, 1, &blocks));
        // grid: B * H_kv * ceil(S_k / 64) blocks of 128 threads;
        // k, v, dk, dv (B, S_k, H_kv, D), q, dout (B, S_q, H, D)
        dkdv_tc_kernel<T, D><<<(unsigned)blocks, kThreads, smem, s>>>(p, n_kblocks);
        RA_CUDA_CHECK_LAUNCH("dkdv_tc_kernel");
        return RA_OK;
    }
};

}  // namespace

ra_status ra_bwd_tc_dkdv(const ra_attn_bwd_params &p, cudaStream_t s) {
    if (p.seqlen_k <= 0) return RA_OK;
    return ra_tc_dispatch<Launch>(p, s);
}
