/*
 * merge.cu -- the LSE merge of two partial attention results (DESIGN 3) and
 * the initialiser of a running forward state.
 *
 * merge: out1, out2, out : (B, S, H, D), any float dtype each
 *        lse1, lse2, lse : (B, H, S), float32 or float64 (all three alike)
 *   lse = logaddexp(lse1, lse2)
 *   out = exp(lse1 - lse) * out1 + exp(lse2 - lse) * out2
 * A NaN lse on either side gives a NaN row.
 * A side whose lse is -inf contributes nothing (its out is never read into
 * the sum, so garbage there cannot become NaN); two empty rows give
 * (0, -inf).  out/lse may alias out1/lse1: one warp owns a row, reads both
 * lse values before any lane writes, and every lane reads and writes only
 * its own elements.
 *
 * fill_state: out = 0, lse = -inf ("no keys seen yet").
 *
 * Launch: 256 threads = 8 warps per block, one warp per (b, s, h) row,
 * grid-stride over rows.
 */
#include "common.cuh"

namespace {

template <typename L>
__global__ void merge_kernel(ra_merge_params p) {
    const int lane = threadIdx.x & 31;
    ra::for_each_row_warp(p.batch, p.seqlen, p.heads, [&](int64_t b, int64_t s, int64_t h) {
        const L *lse1 = (const L *)p.lse1;
        const L *lse2 = (const L *)p.lse2;
        const L l1 = lse1[b * p.lse1_batch_stride + h * p.lse1_head_stride +
                          s * p.lse1_seq_stride];
        const L l2 = lse2[b * p.lse2_batch_stride + h * p.lse2_head_stride +
                          s * p.lse2_seq_stride];
        __syncwarp();  // every lane has read lse1 before lane 0 overwrites it
        // a NaN side is taken as the max: NaN weights and lse (a NaN part
        // makes the row NaN); only two empty sides give the empty row
        const L m = l1 > l2 || l1 != l1 ? l1 : l2;
        L w1 = 0, w2 = 0, l = ra::neg_inf<L>();
        if (!(l1 == ra::neg_inf<L>() && l2 == ra::neg_inf<L>())) {
            const L e1 = ra::exp_acc(l1 - m), e2 = ra::exp_acc(l2 - m);
            const L sum = e1 + e2;
            l = m + ra::log_acc(sum);
            w1 = e1 / sum;
            w2 = e2 / sum;
        }
        const int64_t o1 = b * p.out1_batch_stride + s * p.out1_seq_stride +
                           h * p.out1_head_stride;
        const int64_t o2 = b * p.out2_batch_stride + s * p.out2_seq_stride +
                           h * p.out2_head_stride;
        const int64_t oo = b * p.out_batch_stride + s * p.out_seq_stride +
                           h * p.out_head_stride;
        for (int64_t d = lane; d < p.head_dim; d += 32) {
            double x = 0.0;
            if (w1 != 0) x += (double)w1 * ra::load_dyn(p.out1, o1 + d, p.out1_dtype);
            if (w2 != 0) x += (double)w2 * ra::load_dyn(p.out2, o2 + d, p.out2_dtype);
            ra::store_dyn(p.out, oo + d, p.out_dtype, x);
        }
        if (lane == 0)
            ((L *)p.lse)[b * p.lse_batch_stride + h * p.lse_head_stride +
                         s * p.lse_seq_stride] = l;
    });
}

template <typename L>
__global__ void fill_state_kernel(L *out, L *lse, int64_t batch,
                                  int64_t seqlen, int64_t heads,
                                  int64_t head_dim, int64_t obs, int64_t oss,
                                  int64_t ohs, int64_t lbs, int64_t lhs,
                                  int64_t lss) {
    const int lane = threadIdx.x & 31;
    ra::for_each_row_warp(batch, seqlen, heads, [&](int64_t b, int64_t s, int64_t h) {
        for (int64_t d = lane; d < head_dim; d += 32)
            out[b * obs + s * oss + h * ohs + d] = 0;
        if (lane == 0) lse[b * lbs + h * lhs + s * lss] = ra::neg_inf<L>();
    });
}

unsigned row_blocks(int64_t rows) {
    int64_t blocks = (rows + 7) / 8;
    if (blocks > 65536) blocks = 65536;  // grid-stride covers the rest
    return (unsigned)(blocks < 1 ? 1 : blocks);
}

}  // namespace

extern "C" ra_status ra_cuda_merge(const ra_merge_params *p, void *stream) {
    const int64_t rows = p->batch * p->seqlen * p->heads;
    if (rows == 0) return RA_OK;
    cudaStream_t s = (cudaStream_t)stream;
    RaDeviceGuard guard;
    RA_CHECK(guard.enter_for(p->out));
    // one warp per (b, s, h) row of D elements
    if (p->lse_dtype == RA_FLOAT64) {
        RA_LAUNCH((merge_kernel<double>), row_blocks(rows), 256, 0, s)(*p);
        RA_CUDA_CHECK_LAUNCH("merge_kernel<double>");
    } else {
        RA_LAUNCH((merge_kernel<float>), row_blocks(rows), 256, 0, s)(*p);
        RA_CUDA_CHECK_LAUNCH("merge_kernel<float>");
    }
    return RA_OK;
}

extern "C" ra_status ra_cuda_fill_state(
    void *out, void *lse, ra_dtype acc_dtype, int64_t batch, int64_t seqlen,
    int64_t heads, int64_t head_dim, int64_t out_batch_stride,
    int64_t out_seq_stride, int64_t out_head_stride, int64_t lse_batch_stride,
    int64_t lse_head_stride, int64_t lse_seq_stride, void *stream) {
    const int64_t rows = batch * seqlen * heads;
    if (rows == 0) return RA_OK;
    cudaStream_t s = (cudaStream_t)stream;
    RaDeviceGuard guard;
    RA_CHECK(guard.enter_for(out));
    // out: (B, S, H, D) acc dtype; lse: (B, H, S) acc dtype
    if (acc_dtype == RA_FLOAT64) {
        RA_LAUNCH((fill_state_kernel<double>), row_blocks(rows), 256, 0, s)(
            (double *)out, (double *)lse, batch, seqlen, heads, head_dim,
            out_batch_stride, out_seq_stride, out_head_stride,
            lse_batch_stride, lse_head_stride, lse_seq_stride);
        RA_CUDA_CHECK_LAUNCH("fill_state_kernel<double>");
    } else if (acc_dtype == RA_FLOAT32) {
        RA_LAUNCH((fill_state_kernel<float>), row_blocks(rows), 256, 0, s)(
            (float *)out, (float *)lse, batch, seqlen, heads, head_dim,
            out_batch_stride, out_seq_stride, out_head_stride,
            lse_batch_stride, lse_head_stride, lse_seq_stride);
        RA_CUDA_CHECK_LAUNCH("fill_state_kernel<float>");
    } else {
        ra_set_error(RA_ERR_TYPE, "running state must be float32 or float64, "
                     "got %s", ra_dtype_name(acc_dtype));
        return RA_ERR_TYPE;
    }
    return RA_OK;
}
