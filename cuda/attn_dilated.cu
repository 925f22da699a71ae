/*
 * attn_dilated.cu -- LongNet dilated attention on CUDA (DESIGN 2, "Dilated
 * attention"), forward and backward, composed of the dense kernels.
 *
 *   q, out: (B, S_q, H, D)   k, v: (B, S_k, H_kv, D)   lse, delta: (B, H, S_q)
 *   row i of q at global position q_pos_offset + i, row j of k/v at
 *   k_pos_offset + j (position strides 1).
 *
 * Branch (w, r) pairs query i with key j of query head h iff both lie in
 * one segment [s w, (s+1) w) and both are = o (mod r) inside it, o = h mod
 * r.  For one offset o the heads h = o, o + r, ... share their rows, so
 * they run as one dense call with head stride r:
 *   - w divisible by r: the rows selected in every segment are the global
 *     positions = o (mod r), one arithmetic progression (sequence stride r,
 *     position stride r); the pairs stay inside a segment through document
 *     ids pos / w (none when every selected row lies in one segment);
 *   - r >= w: one row per segment, at s w + o: the progression has stride
 *     w and every row is its own document;
 *   - otherwise the progression restarts in each segment: one call per
 *     segment, no ids.
 * The dense kernels see strided views of the inputs (no copy); positions
 * keep causal masking global.  A kv head map the strided heads cannot
 * express (GQA group and rate not multiples of one another) runs one call
 * per head.
 *
 * Forward: every call merges into a float32 (float64) running state by the
 * LSE rule: the output itself when it has the acc dtype, else a scratch
 * converted at the end.  Rows no branch selects keep out 0, lse -inf.
 * Backward: the sum over the calls of the dense backward with the final lse
 * and delta, into acc-dtype gradients (scratch unless accumulating); each
 * call names its branches and heads (params.branches, branch_head0,
 * branch_head_stride) so that a pair several branches share gets its share
 * of P where the exponent rule snaps (huge scores).
 */
#include "attn_kernels.cuh"
#include "core/copy.h"

namespace {

/* ids[i] = (first + step * i) / w - base: the segment of each selected row */
__global__ void dilated_ids_kernel(int32_t *ids, int64_t n, int64_t first, int64_t step,
                                   int64_t w, int64_t base) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        ids[i] = (int32_t)((first + step * i) / w - base);
}

/* The rows one call selects on one side: positions first + step * i, i <
 * count (step 1 when count <= 1, so no stride is ever multiplied by a huge
 * rate). */
struct Rows {
    int64_t first, step, count;
};

/* rows of [lo, lo + n) at positions = o (mod m), m >= 1, inside [a, e) */
Rows progression(int64_t lo, int64_t n, int64_t o, int64_t m, int64_t a, int64_t e) {
    if (lo > a) a = lo;
    if (lo + n < e) e = lo + n;
    Rows r{0, 1, 0};
    if (a >= e) return r;
    int64_t f = a - (a % m) + o;          /* a >= 0, o < m */
    if (f < a) {
        if (m >= e - f) return r;         /* f + m past the range (m may be huge) */
        f += m;
    }
    if (f >= e) return r;
    r.first = f;
    r.count = (e - 1 - f) / m + 1;
    r.step = r.count > 1 ? m : 1;
    return r;
}

/* One offset's heads: query heads head0 + head_step * j, j < heads, read
 * kv heads kv0 + kv_step * j' with the kernel's own map j' = j / (heads /
 * heads_kv). */
struct HeadSet {
    int64_t head0, head_step, heads, kv0, kv_step, heads_kv;
};

/* the head sets of offset o (o < H) for rate r: one strided set where the
 * kv map allows, else one set per head; returns how many */
int head_sets(int64_t H, int64_t Hkv, int64_t o, int64_t r, HeadSet *out, int max_out,
              int64_t *next_head) {
    const int64_t group = H / Hkv;
    const int64_t nh = r >= H ? 1 : (H - o + r - 1) / r;
    const int64_t step = nh > 1 ? r : 1;
    if (*next_head == 0) {
        if (group == 1) {
            out[0] = HeadSet{o, step, nh, o, step, nh};
            *next_head = -1;
            return 1;
        }
        if (nh == 1 || step % group == 0) {
            out[0] = HeadSet{o, step, nh, o / group, step / group > 0 ? step / group : 1, nh};
            *next_head = -1;
            return 1;
        }
        if (group % step == 0) {          /* nh = H / r; j / (group / r) is the kv head */
            out[0] = HeadSet{o, step, nh, 0, 1, Hkv};
            *next_head = -1;
            return 1;
        }
    }
    /* one call per head, max_out at a time */
    int n = 0;
    for (int64_t j = *next_head; j < nh && n < max_out; j++, n++) {
        const int64_t h = o + r * j;
        out[n] = HeadSet{h, 1, 1, h / group, 1, 1};
        *next_head = j + 1;
    }
    if (*next_head >= nh) *next_head = -1;
    return n;
}

/* One dense call: rows of each side, the head set, and the document ids
 * (n_ids == 0: none). */
struct Call {
    Rows q, k;
    HeadSet hs;
    int64_t w, base;       /* ids = pos / w - base */
    bool ids;
};

const char *elem(const void *p, int64_t off, ra_dtype t) {
    return (const char *)p + off * (int64_t)ra_dtype_size(t);
}
char *elem_w(void *p, int64_t off, ra_dtype t) {
    return (char *)p + off * (int64_t)ra_dtype_size(t);
}

/* Enumerate the calls of every branch for local rows q [qlo, qlo + Sq), k
 * [klo, klo + Sk); fn(const Call &) returns a status. */
template <typename F>
ra_status for_each_call(const ra_dilated_config &cfg, int64_t qlo, int64_t Sq, int64_t klo,
                        int64_t Sk, int64_t H, int64_t Hkv, F fn) {
    if (Sq <= 0 || Sk <= 0 || qlo < 0 || klo < 0) return RA_OK;
    for (int b = 0; b < cfg.n_branches; b++) {
        const int64_t w = cfg.segment_lengths[b], r = cfg.dilation_rates[b];
        const int64_t n_off = r < w ? (r < H ? r : H) : (w < H ? w : H);
        /* segments holding rows of both sides */
        const int64_t s_lo = (qlo > klo ? qlo : klo) / w;
        const int64_t q_last = qlo + Sq - 1, k_last = klo + Sk - 1;
        const int64_t s_hi = (q_last < k_last ? q_last : k_last) / w;
        if (s_lo > s_hi) continue;
        const bool one_progression = r >= w || w % r == 0;
        for (int64_t o = 0; o < n_off; o++) {
            /* offsets past the segment select nothing; heads h = o mod r */
            int64_t next = 0;
            while (next >= 0) {
                HeadSet sets[16];
                const int ns = head_sets(H, Hkv, o, r, sets, 16, &next);
                for (int si = 0; si < ns; si++) {
                    if (one_progression) {
                        const int64_t m = r >= w ? w : r;
                        const int64_t a = s_lo * w;
                        /* (s_hi + 1) * w may pass int64 only where no row is */
                        const int64_t e = s_hi >= INT64_MAX / w - 1 ? INT64_MAX : (s_hi + 1) * w;
                        Call c;
                        c.q = progression(qlo, Sq, o, m, a, e);
                        c.k = progression(klo, Sk, o, m, a, e);
                        if (c.q.count == 0 || c.k.count == 0) continue;
                        c.hs = sets[si];
                        c.w = w;
                        const int64_t sq0 = c.q.first / w, sk0 = c.k.first / w;
                        const int64_t sq1 = (c.q.first + c.q.step * (c.q.count - 1)) / w;
                        const int64_t sk1 = (c.k.first + c.k.step * (c.k.count - 1)) / w;
                        c.base = sq0 < sk0 ? sq0 : sk0;
                        c.ids = !(sq0 == sq1 && sk0 == sk1 && sq0 == sk0);
                        if (sq1 < sk0 || sk1 < sq0) continue;   /* no shared segment */
                        RA_CHECK(fn(c));
                    } else {
                        for (int64_t s = s_lo; s <= s_hi; s++) {
                            Call c;
                            const int64_t a = s * w, e = a > INT64_MAX - w ? INT64_MAX : a + w;
                            /* positions a + o + r i: = (a + o) mod r */
                            c.q = progression(qlo, Sq, (a + o) % r, r, a, e);
                            c.k = progression(klo, Sk, (a + o) % r, r, a, e);
                            if (c.q.count == 0 || c.k.count == 0) continue;
                            c.hs = sets[si];
                            c.w = w;
                            c.base = 0;
                            c.ids = false;
                            RA_CHECK(fn(c));
                        }
                    }
                }
            }
        }
    }
    return RA_OK;
}

/* Document ids of one call's rows, from ringattn's caching pool (released
 * behind the stream by the caller) */
struct IdScratch {
    int device = -1;
    void *ptr = nullptr;
    size_t bytes = 0;
    ~IdScratch() {
        if (ptr != nullptr) ra_cuda_free(device, ptr, bytes);
    }
};

ra_status make_ids(const Call &c, cudaStream_t s, IdScratch *ids, ra_attn_mask *m) {
    if (!c.ids) return RA_OK;
    int dev = 0;
    RA_CUDA_CHECK(cudaGetDevice(&dev));
    const int64_t n = c.q.count + c.k.count;
    ids->device = dev;
    ids->bytes = (size_t)n * sizeof(int32_t);
    RA_CHECK(ra_cuda_malloc(dev, ids->bytes, &ids->ptr));
    int32_t *qi = (int32_t *)ids->ptr, *ki = qi + c.q.count;
    int64_t blocks = (n + 255) / 256;
    if (blocks > 4096) blocks = 4096;
    RA_LAUNCH(dilated_ids_kernel, (unsigned)blocks, 256, 0, s)(
        qi, c.q.count, c.q.first, c.q.step, c.w, c.base);
    RA_CUDA_CHECK_LAUNCH("dilated_ids_kernel");
    RA_LAUNCH(dilated_ids_kernel, (unsigned)blocks, 256, 0, s)(
        ki, c.k.count, c.k.first, c.k.step, c.w, c.base);
    RA_CUDA_CHECK_LAUNCH("dilated_ids_kernel");
    m->q_segment_ids = qi;
    m->kv_segment_ids = ki;
    m->q_seg_batch_stride = 0;
    m->q_seg_seq_stride = 1;
    m->kv_seg_batch_stride = 0;
    m->kv_seg_seq_stride = 1;
    return RA_OK;
}

/* a pool scratch of (B, S, H, D) in `dt`, contiguous, zeroed; freed (behind
 * the stream) when it goes out of scope */
struct Scratch4 {
    int device = -1;
    void *ptr = nullptr;
    size_t bytes = 0;
    int64_t bs = 0, ss = 0, hs = 0;
    ra_status make(int64_t B, int64_t S, int64_t H, int64_t D, ra_dtype dt, cudaStream_t s) {
        RA_CUDA_CHECK(cudaGetDevice(&device));
        bytes = (size_t)(B * S * H * D) * ra_dtype_size(dt);
        bs = S * H * D;
        ss = H * D;
        hs = D;
        if (bytes == 0) return RA_OK;
        RA_CHECK(ra_cuda_malloc(device, bytes, &ptr));
        RA_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, s));
        return RA_OK;
    }
    ~Scratch4() {
        if (ptr != nullptr) ra_cuda_free(device, ptr, bytes);
    }
};

/* dst (B, S, H, D; dst strides, dst dtype) := src scratch (contiguous) */
ra_status store4(const Scratch4 &src, ra_dtype src_dt, void *dst, ra_dtype dst_dt, int64_t B,
                 int64_t S, int64_t H, int64_t D, int64_t bs, int64_t ss, int64_t hs,
                 cudaStream_t s) {
    if (src.ptr == nullptr) return RA_OK;
    ra_copy_params c;
    memset(&c, 0, sizeof c);
    c.ndim = 4;
    const int64_t shape[4] = {B, S, H, D};
    const int64_t sst[4] = {src.bs, src.ss, src.hs, 1}, dstt[4] = {bs, ss, hs, 1};
    for (int i = 0; i < 4; i++) {
        c.shape[i] = shape[i];
        c.src_strides[i] = sst[i];
        c.dst_strides[i] = dstt[i];
    }
    c.src = src.ptr;
    c.src_dtype = src_dt;
    c.dst = dst;
    c.dst_dtype = dst_dt;
    return ra_cuda_copy(&c, s);
}

/* The scratch (document ids, state, gradients) comes from ringattn's
 * caching pool, which hands a freed block out again only to work queued
 * after it on ringattn's compute stream: the composition runs there only. */
ra_status check_stream(cudaStream_t s, const char *what) {
    int dev = 0;
    void *compute = nullptr;
    RA_CUDA_CHECK(cudaGetDevice(&dev));
    RA_CHECK(ra_cuda_compute_stream(dev, &compute));
    if ((cudaStream_t)compute != s) {
        ra_set_error(RA_ERR_UNSUPPORTED, "%s on CUDA runs on ringattn's compute stream only",
                     what);
        return RA_ERR_UNSUPPORTED;
    }
    return RA_OK;
}

}  // namespace

extern "C" ra_status ra_cuda_dilated_fwd(const ra_attn_fwd_params *p,
                                         const ra_dilated_config *cfg, void *stream) {
    RA_CHECK(ra_check_dilated(cfg, p->q_pos_stride, p->k_pos_stride, &p->mask));
    RA_CHECK(ra_check_attn_dtype("dilated attention", p->dtype));
    const ra_dtype acc = ra_acc_dtype(p->dtype);
    if (p->out_dtype != p->dtype && p->out_dtype != acc) {
        ra_set_error(RA_ERR_TYPE, "dilated attention: out dtype %s must be %s or %s",
                     ra_dtype_name(p->out_dtype), ra_dtype_name(p->dtype), ra_dtype_name(acc));
        return RA_ERR_TYPE;
    }
    if (p->accumulate && p->out_dtype != acc) {
        ra_set_error(RA_ERR_TYPE, "dilated attention: a running state must be %s, got %s",
                     ra_dtype_name(acc), ra_dtype_name(p->out_dtype));
        return RA_ERR_TYPE;
    }
    RA_CHECK(ra_check_attn_geometry("dilated attention", *p));
    if (p->batch == 0 || p->heads == 0 || p->seqlen_q == 0) return RA_OK;
    cudaStream_t s = (cudaStream_t)stream;
    RaDeviceGuard guard;
    RA_CHECK(guard.enter_for(p->q));
    RA_CHECK(check_stream(s, "dilated attention"));
    const int64_t B = p->batch, Sq = p->seqlen_q, H = p->heads, D = p->head_dim;

    /* the running state: out itself, or an acc scratch */
    Scratch4 state;
    void *so = p->out;
    int64_t obs = p->out_batch_stride, oss = p->out_seq_stride, ohs = p->out_head_stride;
    if (p->out_dtype != acc) {
        RA_CHECK(state.make(B, Sq, H, D, acc, s));
        so = state.ptr;
        obs = state.bs;
        oss = state.ss;
        ohs = state.hs;
    }
    if (!p->accumulate)
        RA_CHECK(ra_cuda_fill_state(so, p->lse, acc, B, Sq, H, D, obs, oss, ohs,
                                    p->lse_batch_stride, p->lse_head_stride,
                                    p->lse_seq_stride, stream));

    RA_CHECK(for_each_call(*cfg, p->q_pos_offset, Sq, p->k_pos_offset, p->seqlen_k, H,
                           p->heads_kv, [&](const Call &c) -> ra_status {
        ra_attn_fwd_params d = *p;
        const int64_t qi = c.q.first - p->q_pos_offset, kj = c.k.first - p->k_pos_offset;
        const HeadSet &hs = c.hs;
        d.q = elem(p->q, qi * p->q_seq_stride + hs.head0 * p->q_head_stride, p->dtype);
        d.k = elem(p->k, kj * p->k_seq_stride + hs.kv0 * p->k_head_stride, p->dtype);
        d.v = elem(p->v, kj * p->v_seq_stride + hs.kv0 * p->v_head_stride, p->dtype);
        d.out = elem_w(so, qi * oss + hs.head0 * ohs, acc);
        d.lse = elem_w(p->lse, qi * p->lse_seq_stride + hs.head0 * p->lse_head_stride, acc);
        d.out_dtype = acc;
        d.seqlen_q = c.q.count;
        d.seqlen_k = c.k.count;
        d.heads = hs.heads;
        d.heads_kv = hs.heads_kv;
        d.q_seq_stride = p->q_seq_stride * c.q.step;
        d.q_head_stride = p->q_head_stride * hs.head_step;
        d.k_seq_stride = p->k_seq_stride * c.k.step;
        d.k_head_stride = p->k_head_stride * hs.kv_step;
        d.v_seq_stride = p->v_seq_stride * c.k.step;
        d.v_head_stride = p->v_head_stride * hs.kv_step;
        d.out_batch_stride = obs;
        d.out_seq_stride = oss * c.q.step;
        d.out_head_stride = ohs * hs.head_step;
        d.lse_seq_stride = p->lse_seq_stride * c.q.step;
        d.lse_head_stride = p->lse_head_stride * hs.head_step;
        d.q_pos_offset = c.q.first;
        d.q_pos_stride = c.q.step;
        d.k_pos_offset = c.k.first;
        d.k_pos_stride = c.k.step;
        d.accumulate = 1;
        IdScratch ids;
        RA_CHECK(make_ids(c, s, &ids, &d.mask));
        return ra_cuda_attn_fwd(&d, stream);
    }));
    if (p->out_dtype != acc)
        RA_CHECK(store4(state, acc, p->out, p->out_dtype, B, Sq, H, D, p->out_batch_stride,
                        p->out_seq_stride, p->out_head_stride, s));
    return RA_OK;
}

extern "C" ra_status ra_cuda_dilated_bwd(const ra_attn_bwd_params *p,
                                         const ra_dilated_config *cfg, void *stream) {
    RA_CHECK(ra_check_dilated(cfg, p->q_pos_stride, p->k_pos_stride, &p->mask));
    RA_CHECK(ra_check_attn_dtype("dilated attention backward", p->dtype));
    const ra_dtype acc = ra_acc_dtype(p->dtype);
    if (p->accumulate && p->grad_dtype != acc) {
        ra_set_error(RA_ERR_TYPE, "dilated attention backward: accumulated grads must be %s, got %s",
                     ra_dtype_name(acc), ra_dtype_name(p->grad_dtype));
        return RA_ERR_TYPE;
    }
    if (p->grad_dtype != p->dtype && p->grad_dtype != acc) {
        ra_set_error(RA_ERR_TYPE, "dilated attention backward: grad dtype %s must be %s or %s",
                     ra_dtype_name(p->grad_dtype), ra_dtype_name(p->dtype), ra_dtype_name(acc));
        return RA_ERR_TYPE;
    }
    RA_CHECK(ra_check_attn_geometry("dilated attention backward", *p));
    if (p->batch == 0 || p->heads == 0) return RA_OK;
    cudaStream_t s = (cudaStream_t)stream;
    RaDeviceGuard guard;
    RA_CHECK(guard.enter_for(p->q));
    RA_CHECK(check_stream(s, "dilated attention backward"));
    const int64_t B = p->batch, Sq = p->seqlen_q, Sk = p->seqlen_k, H = p->heads,
                  Hkv = p->heads_kv, D = p->head_dim;

    /* gradient targets: the gradients themselves when accumulating, else
     * zeroed acc scratch stored into them at the end */
    Scratch4 gq, gk, gv;
    void *tq = p->dq, *tk = p->dk, *tv = p->dv;
    int64_t q_st[3] = {p->dq_batch_stride, p->dq_seq_stride, p->dq_head_stride};
    int64_t k_st[3] = {p->dk_batch_stride, p->dk_seq_stride, p->dk_head_stride};
    int64_t v_st[3] = {p->dv_batch_stride, p->dv_seq_stride, p->dv_head_stride};
    if (!p->accumulate) {
        RA_CHECK(gq.make(B, Sq, H, D, acc, s));
        RA_CHECK(gk.make(B, Sk, Hkv, D, acc, s));
        RA_CHECK(gv.make(B, Sk, Hkv, D, acc, s));
        tq = gq.ptr;
        tk = gk.ptr;
        tv = gv.ptr;
        q_st[0] = gq.bs; q_st[1] = gq.ss; q_st[2] = gq.hs;
        k_st[0] = gk.bs; k_st[1] = gk.ss; k_st[2] = gk.hs;
        v_st[0] = gv.bs; v_st[1] = gv.ss; v_st[2] = gv.hs;
    }

    RA_CHECK(for_each_call(*cfg, p->q_pos_offset, Sq, p->k_pos_offset, Sk, H, Hkv,
                           [&](const Call &c) -> ra_status {
        ra_attn_bwd_params d = *p;
        const int64_t qi = c.q.first - p->q_pos_offset, kj = c.k.first - p->k_pos_offset;
        const HeadSet &hs = c.hs;
        const int64_t qh = hs.head0, kh = hs.kv0;
        d.q = elem(p->q, qi * p->q_seq_stride + qh * p->q_head_stride, p->dtype);
        d.out = elem(p->out, qi * p->out_seq_stride + qh * p->out_head_stride, p->out_dtype);
        d.dout = elem(p->dout, qi * p->dout_seq_stride + qh * p->dout_head_stride, p->out_dtype);
        d.k = elem(p->k, kj * p->k_seq_stride + kh * p->k_head_stride, p->dtype);
        d.v = elem(p->v, kj * p->v_seq_stride + kh * p->v_head_stride, p->dtype);
        const int64_t lo = qi * p->lse_seq_stride + qh * p->lse_head_stride;
        d.lse = elem(p->lse, lo, acc);
        d.delta = elem_w(p->delta, lo, acc);
        d.dq = elem_w(tq, qi * q_st[1] + qh * q_st[2], acc);
        d.dk = elem_w(tk, kj * k_st[1] + kh * k_st[2], acc);
        d.dv = elem_w(tv, kj * v_st[1] + kh * v_st[2], acc);
        d.grad_dtype = acc;
        d.seqlen_q = c.q.count;
        d.seqlen_k = c.k.count;
        d.heads = hs.heads;
        d.heads_kv = hs.heads_kv;
        const int64_t qs = c.q.step, ks = c.k.step, hq = hs.head_step, hk = hs.kv_step;
        d.q_seq_stride = p->q_seq_stride * qs;
        d.q_head_stride = p->q_head_stride * hq;
        d.out_seq_stride = p->out_seq_stride * qs;
        d.out_head_stride = p->out_head_stride * hq;
        d.dout_seq_stride = p->dout_seq_stride * qs;
        d.dout_head_stride = p->dout_head_stride * hq;
        d.k_seq_stride = p->k_seq_stride * ks;
        d.k_head_stride = p->k_head_stride * hk;
        d.v_seq_stride = p->v_seq_stride * ks;
        d.v_head_stride = p->v_head_stride * hk;
        d.dq_batch_stride = q_st[0];
        d.dq_seq_stride = q_st[1] * qs;
        d.dq_head_stride = q_st[2] * hq;
        d.dk_batch_stride = k_st[0];
        d.dk_seq_stride = k_st[1] * ks;
        d.dk_head_stride = k_st[2] * hk;
        d.dv_batch_stride = v_st[0];
        d.dv_seq_stride = v_st[1] * ks;
        d.dv_head_stride = v_st[2] * hk;
        d.lse_seq_stride = p->lse_seq_stride * qs;
        d.lse_head_stride = p->lse_head_stride * hq;
        d.q_pos_offset = c.q.first;
        d.q_pos_stride = qs;
        d.k_pos_offset = c.k.first;
        d.k_pos_stride = ks;
        d.accumulate = 1;
        d.branches = cfg;
        d.branch_head0 = qh;
        d.branch_head_stride = hq;
        IdScratch ids;
        RA_CHECK(make_ids(c, s, &ids, &d.mask));
        return ra_cuda_attn_bwd(&d, stream);
    }));
    if (!p->accumulate) {
        RA_CHECK(store4(gq, acc, p->dq, p->grad_dtype, B, Sq, H, D, p->dq_batch_stride,
                        p->dq_seq_stride, p->dq_head_stride, s));
        RA_CHECK(store4(gk, acc, p->dk, p->grad_dtype, B, Sk, Hkv, D, p->dk_batch_stride,
                        p->dk_seq_stride, p->dk_head_stride, s));
        RA_CHECK(store4(gv, acc, p->dv, p->grad_dtype, B, Sk, Hkv, D, p->dv_batch_stride,
                        p->dv_seq_stride, p->dv_head_stride, s));
    }
    return RA_OK;
}
