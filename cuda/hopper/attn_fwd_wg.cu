/*
 * attn_fwd_wg.cu -- the Hopper (sm_90a) attention forward for float16 and
 * bfloat16 with head_dim 64 or 128: FlashAttention's algorithm on
 * warpgroup matrix multiplies (wgmma), bulk tensor copies (TMA) and warp
 * specialisation.  Same contract as the mma.sync kernel (attn_fwd_tc.cu):
 * out = softmax(scale * q k^T + mask) v and lse per query row in float32;
 * with p.accumulate the result merges into the float32 running state by
 * the LSE rule; causal, GQA, S_q != S_k, ring position offsets, documents,
 * windows and soft-capping; key tiles no rule leaves visible are skipped.
 *
 * Shapes: q, out (B, S_q, H, D); k, v (B, S_k, H_kv, D); lse (B, H, S_q)
 * float32.  q, k, v are read through tensor maps (4-D: D, S, H, B) made
 * here per call, so their strides must suit a bulk tensor copy (16-byte
 * aligned base and strides: ra_fwd_wg_supported); the dispatcher
 * (attn_fwd.cu) falls back to the mma.sync kernel when they do not, or
 * when the driver cannot make a tensor map.
 *
 * Algorithm: a block of three warpgroups owns 128 query rows of one
 * (b, h).  Warp 0 (the producer, fwd_mainloop.cuh) walks the key tiles of
 * 128 keys the block sees and copies Q once and K, V of each tile into a
 * two-stage ring of shared buffers, completing mbarriers.  Consumer
 * warpgroups 1 and 2 own 64 rows each; per tile j they issue S_{j+1} =
 * Q K_{j+1}^T (wgmma, both operands from shared memory) together with
 * O += P_j V_j (P from registers), then run the softmax of S_{j+1}
 * (fwd_softmax.cuh) while O's product finishes, then rescale O: the
 * softmax of one tile overlaps the products of the previous one inside a
 * warpgroup, and the two warpgroups take turns issuing (ping-pong), so
 * one's softmax also runs under the other's products.  Rows that see no
 * key end as (0, -inf); a NaN score makes its row NaN.  The epilogue
 * (fwd_epilogue.cuh) stores or merges each thread's two rows.
 *
 * Launch: grid B * H * ceil(S_q / 128) (1-D, heaviest causal blocks
 * first), 384 threads, one block per SM (setmaxnreg: 40 registers for the
 * producer warpgroup, 232 for the consumers), dynamic shared memory
 * Smem<D>::kLaunchBytes (161 KB at D 128, 81 KB at D 64).
 */
#include <string.h>

#include "attn_kernels.cuh"
#include "hopper/fwd_epilogue.cuh"
#include "hopper/fwd_mainloop.cuh"
#include "hopper/tensor_map.h"

namespace {

using namespace ra::wg;

/* One consumer warpgroup (c = 0, 1) over the tiles the producer hands it. */
template <typename T, int D, bool M>
__device__ void consume(const FwdArgs &a, const Buffers<D> &buf, const ra::QBlock &blk,
                        int64_t kend, int c) {
    const ra_attn_fwd_params &p = a.p;
    RowMasks rm;
    rm.template init<M>(p, blk, kend, c);
    RowState st;
    st.init();
    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++) o[i] = 0.f;
    float s[kSRegs];
    uint32_t pa[kBlockK / 16][4];
    float al_a = 1.f, al_b = 1.f;

    Stage cur{0, 0};
    ra::sm90::mbar_wait(&buf.full_k[0], 0);
    const TileMeta first = uniform(buf.meta[0]);
    if (first.k0 >= 0) {
        // tile 0: S_0 alone
        ra::sm90::mbar_wait(buf.full_q, 0);
        turn_begin(c, true);
        issue_s<T, D>(s, buf, c, 0);
        turn_end(c, false);
        ra::sm90::wgmma_wait<0>();
        ra::sm90::fence_operand(s);
        mask_tile<M>(s, p, rm, first.k0, first.same != 0, buf.ids);
        st.step(s, rm.mult, &al_a, &al_b);
        release(&buf.empty_k[0]);
        ra::a_from_acc<T, kBlockK>(pa, s);
        for (;;) {
            Stage nxt = cur;
            nxt.advance();
            ra::sm90::mbar_wait(&buf.full_k[nxt.index], nxt.phase);
            const TileMeta mn = uniform(buf.meta[nxt.index]);
            const bool more = mn.k0 >= 0;
            ra::sm90::mbar_wait(&buf.full_v[cur.index], cur.phase);
            if (!more) {
                // the last tile: O += P_j V_j alone
                turn_begin(c, false);
                issue_pv<T, D>(o, pa, buf, cur.index);
                turn_end(c, true);
                ra::sm90::wgmma_wait<0>();
                ra::sm90::fence_operand(o);
                release(&buf.empty_v[cur.index]);
                break;
            }
            // S_{j+1} and O += P_j V_j, issued in this warpgroup's turn (one
            // straight path from issue to wait: ptxas then knows which group
            // wait<1> retires, and keeps both asynchronous)
            turn_begin(c, false);
            issue_s<T, D>(s, buf, c, nxt.index);
            issue_pv<T, D>(o, pa, buf, cur.index);
            turn_end(c, false);
            // the softmax of S_{j+1} while P_j V_j runs
            ra::sm90::wgmma_wait<1>();
            ra::sm90::fence_operand(s);
            mask_tile<M>(s, p, rm, mn.k0, mn.same != 0, buf.ids + nxt.index * kBlockK);
            st.step(s, rm.mult, &al_a, &al_b);
            release(&buf.empty_k[nxt.index]);
            ra::sm90::wgmma_wait<0>();
            ra::sm90::fence_operand(o);
            release(&buf.empty_v[cur.index]);
            rescale<D>(o, al_a, al_b);
            ra::a_from_acc<T, kBlockK>(pa, s);
            cur = nxt;
        }
    }
    store_rows<T, D>(p, blk, rm, st, o);
}

template <typename T, int D, bool M>
__global__ void __launch_bounds__(kThreads, 1) fwd_wg_kernel(const __grid_constant__ FwdArgs a) {
#if defined(RA_CUDA_EMULATED) || defined(RA_SM90_ASM)
    const ra_attn_fwd_params &p = a.p;
    const Buffers<D> buf(ra::dynamic_smem());
    const ra::QBlock blk = ra::q_block<kBlockQ>(p, a.n_qblocks);
    const ra::Range keys = ra::block_keys<kBlockQ, M>(p, blk.q0);
    // warp-uniform in the compiler's eyes (a shuffle), so that the wgmma
    // under it are not treated as divergent (which serialises them)
    const int wg = __shfl_sync(0xffffffffu, (int)(threadIdx.x / kWarpgroupThreads), 0);
    if (threadIdx.x == 0) {
        ra::sm90::mbar_init(buf.full_q, 1);
        for (int s = 0; s < kStages; s++) {
            ra::sm90::mbar_init(&buf.full_k[s], 1);
            ra::sm90::mbar_init(&buf.full_v[s], 1);
            ra::sm90::mbar_init(&buf.empty_k[s], kConsumers * 4);
            ra::sm90::mbar_init(&buf.empty_v[s], kConsumers * 4);
        }
        ra::sm90::mbar_init_fence();
    }
    __syncthreads();
    if (wg == 0) {
        ra::sm90::setmaxnreg_dec<kProducerRegs>();
        if (threadIdx.x < 32) produce<D, M>(a, buf, blk, keys.begin, keys.end);
        return;
    }
    ra::sm90::setmaxnreg_inc<kConsumerRegs>();
    consume<T, D, M>(a, buf, blk, keys.end, wg - 1);
#else
    (void)a;
    __trap();   // built for another architecture: the dispatcher never launches it there
#endif
}

template <typename T, int D, bool M>
ra_status launch(const ra_attn_fwd_params &p, cudaStream_t s, bool *ran) {
    *ran = false;
    FwdArgs a;
    memset(&a, 0, sizeof a);
    a.p = p;
    char err[300];
    // one box shape (64 x 128 rows) for Q, K and V
    static_assert(kBlockK == kBlockQ, "one box shape for Q, K and V");
    const int bf = p.dtype == RA_BFLOAT16;
    const uint32_t rows = (uint32_t)kBlockK;
    if (ra_tensor_map_bshd(&a.q_map, bf, p.q, p.batch, p.seqlen_q, p.heads, D, p.q_batch_stride,
                           p.q_seq_stride, p.q_head_stride, rows, err, sizeof err) != 0 ||
        ra_tensor_map_bshd(&a.k_map, bf, p.k, p.batch, p.seqlen_k, p.heads_kv, D,
                           p.k_batch_stride, p.k_seq_stride, p.k_head_stride, rows, err,
                           sizeof err) != 0 ||
        ra_tensor_map_bshd(&a.v_map, bf, p.v, p.batch, p.seqlen_k, p.heads_kv, D,
                           p.v_batch_stride, p.v_seq_stride, p.v_head_stride, rows, err,
                           sizeof err) != 0)
        return RA_OK;   // no tensor map: the caller runs the mma.sync kernel
    a.n_qblocks = (p.seqlen_q + kBlockQ - 1) / kBlockQ;
    const size_t smem = (size_t)Smem<D>::kLaunchBytes;
    RA_CHECK(ra_set_smem(fwd_wg_kernel<T, D, M>, smem));
    int64_t blocks = 0;
    RA_CHECK(ra_grid_1d(a.n_qblocks * p.heads * p.batch, 1, &blocks));
    // grid: B * H * ceil(S_q / 128) blocks of 384 threads
    RA_LAUNCH((fwd_wg_kernel<T, D, M>), (unsigned)blocks, kThreads, smem, s)(a);
    RA_CUDA_CHECK_LAUNCH("fwd_wg_kernel");
    *ran = true;
    return RA_OK;
}

template <bool M>
ra_status dispatch(const ra_attn_fwd_params &p, cudaStream_t s, bool *ran) {
    if (p.dtype == RA_FLOAT16)
        return p.head_dim == 64 ? launch<ra::half_t, 64, M>(p, s, ran)
                                : launch<ra::half_t, 128, M>(p, s, ran);
    return p.head_dim == 64 ? launch<ra::bf16_t, 64, M>(p, s, ran)
                            : launch<ra::bf16_t, 128, M>(p, s, ran);
}

}  // namespace

bool ra_fwd_wg_supported(const ra_attn_fwd_params &p) {
    if (!ra_fwd_tc_supported(p)) return false;   // dtypes, head dims, 16-byte aligned rows
    // tensor maps: int32 coordinates, dimensions up to 2^32, strides (of the
    // dimensions longer than 1) positive -- a broadcast (stride 0) axis is
    // left to the mma.sync kernel -- and below 2^40 bytes
    const int64_t lim = (int64_t)1 << 31;
    if (p.batch >= lim || p.seqlen_q >= lim || p.seqlen_k >= lim || p.heads >= lim) return false;
    const int64_t ext[9] = {p.batch, p.seqlen_q, p.heads, p.batch, p.seqlen_k, p.heads_kv,
                            p.batch, p.seqlen_k, p.heads_kv};
    const int64_t str[9] = {p.q_batch_stride, p.q_seq_stride, p.q_head_stride,
                            p.k_batch_stride, p.k_seq_stride, p.k_head_stride,
                            p.v_batch_stride, p.v_seq_stride, p.v_head_stride};
    for (int i = 0; i < 9; i++)
        if (ext[i] > 1 && (str[i] <= 0 || str[i] >= ((int64_t)1 << 39))) return false;
    return true;
}

ra_status ra_fwd_wg(const ra_attn_fwd_params &p, cudaStream_t s, bool *ran) {
    return ra::mask_active(p.mask) ? dispatch<true>(p, s, ran) : dispatch<false>(p, s, ran);
}
