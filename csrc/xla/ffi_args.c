/*
 * ffi_args.c -- checks and position pieces shared by the attention
 * handlers (ffi_args.h).  Every check names the operand, the expected and
 * the actual value.
 */
#include "xla/ffi_args.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "xla/ffi_device.h"

static const char *BSHD = "(batch, seq, heads, head_dim)";

ra_status ra_xla_check_qkv(const ra_xla_tensor *q, const ra_xla_tensor *k,
                           const ra_xla_tensor *v, ra_xla_qkv *d) {
    if (q->dtype == RA_DTYPE_OTHER) {
        ra_set_error(RA_ERR_TYPE, "q: expected float32, float64, float16 or "
                                  "bfloat16, got XLA type %d",
                     q->ffi_dtype);
        return RA_ERR_TYPE;
    }
    RA_CHECK(ra_xla_check_dtype(k, q->dtype, "the dtype of q"));
    RA_CHECK(ra_xla_check_dtype(v, q->dtype, "the dtype of q"));
    d->B = ra_xla_dim(q, 0);
    d->Sq = ra_xla_dim(q, 1);
    d->H = ra_xla_dim(q, 2);
    d->D = ra_xla_dim(q, 3);
    d->Sk = ra_xla_dim(k, 1);
    d->Hkv = ra_xla_dim(k, 2);
    d->dtype = q->dtype;
    d->acc = ra_acc_dtype(q->dtype);
    const int64_t kdims[4] = {d->B, d->Sk, d->Hkv, d->D};
    RA_CHECK(ra_xla_check_dims(k, kdims, BSHD));
    RA_CHECK(ra_xla_check_dims(v, kdims, BSHD));
    if (d->Hkv < 1 || d->H % d->Hkv != 0) {
        ra_set_error(RA_ERR_VALUE,
                     "k: expected a number of kv heads that divides q's %lld "
                     "heads, got %lld",
                     (long long)d->H, (long long)d->Hkv);
        return RA_ERR_VALUE;
    }
    if (d->D < 1 || d->D > RA_MAX_HEAD_DIM) {
        ra_set_error(RA_ERR_VALUE, "q: expected head_dim in 1..%d, got %lld",
                     RA_MAX_HEAD_DIM, (long long)d->D);
        return RA_ERR_VALUE;
    }
    return RA_OK;
}

ra_status ra_xla_check_rows(const ra_xla_tensor *t, const ra_xla_qkv *d,
                            int64_t S, int64_t heads, ra_dtype want,
                            ra_dtype alt) {
    const int64_t dims[4] = {d->B, S, heads, d->D};
    RA_CHECK(ra_xla_check_dims(t, dims, BSHD));
    if (t->dtype != want && t->dtype != alt) {
        ra_set_error(RA_ERR_TYPE, "%s: expected dtype %s%s%s, got %s", t->name,
                     ra_dtype_name(want), want == alt ? "" : " or ",
                     want == alt ? "" : ra_dtype_name(alt),
                     t->dtype == RA_DTYPE_OTHER ? "a non-float type"
                                                : ra_dtype_name(t->dtype));
        return RA_ERR_TYPE;
    }
    return RA_OK;
}

ra_status ra_xla_check_bhs(const ra_xla_tensor *t, const ra_xla_qkv *d) {
    const int64_t dims[3] = {d->B, d->H, d->Sq};
    RA_CHECK(ra_xla_check_dims(t, dims, "(batch, heads, seq_q)"));
    return ra_xla_check_dtype(t, d->acc, "float32, float64 for float64 inputs");
}

ra_status ra_xla_check_alias(const ra_xla_tensor *in, const ra_xla_tensor *out) {
    int same = in->lead == out->lead && in->core == out->core &&
               in->dtype == out->dtype;
    for (int i = 0; same && i < in->lead + in->core; i++)
        same = in->dims[i] == out->dims[i];
    if (!same) {
        ra_set_error(RA_ERR_VALUE,
                     "%s: expected the shape and dtype of the result it "
                     "updates in place (%s)",
                     in->name, out->name);
        return RA_ERR_VALUE;
    }
    return RA_OK;
}

/* A window side beyond this reaches every position a call can index, so
 * it counts as unbounded (and keeps position +- side inside int64). */
#define WINDOW_UNBOUNDED_FROM ((int64_t)1 << 61)

static ra_status read_mask(const ra_xla_call *c, ra_xla_opts *o) {
    int has_left = 0, has_right = 0, present = 0;
    int64_t left = -1, right = -1, ids = 0;
    memset(&o->mask, 0, sizeof o->mask);
    RA_CHECK(ra_xla_attr_int(c, "window_left", &left, &has_left));
    RA_CHECK(ra_xla_attr_int(c, "window_right", &right, &has_right));
    if (has_left != has_right || left < -1 || right < -1) {
        ra_set_error(RA_ERR_VALUE,
                     "window: expected attributes window_left and "
                     "window_right together, each >= 0 or -1 (unbounded), "
                     "got %lld, %lld",
                     has_left ? (long long)left : -2LL,
                     has_right ? (long long)right : -2LL);
        return RA_ERR_VALUE;
    }
    if (has_left) {
        o->mask.has_window = 1;
        o->mask.window_left = left >= WINDOW_UNBOUNDED_FROM ? -1 : left;
        o->mask.window_right = right >= WINDOW_UNBOUNDED_FROM ? -1 : right;
    }
    RA_CHECK(ra_xla_attr_f64(c, "softcap", &o->mask.softcap, &present));
    if (present && !(o->mask.softcap > 0 && RA_SOFTCAP_OK(o->mask.softcap))) {
        ra_set_error(RA_ERR_VALUE, "softcap: expected a number in [%g, %g], "
                                   "got %g",
                     RA_SOFTCAP_MIN, RA_SOFTCAP_MAX, o->mask.softcap);
        return RA_ERR_VALUE;
    }
    RA_CHECK(ra_xla_attr_int(c, "segment_ids", &ids, &present));
    o->has_ids = ids != 0;
    return RA_OK;
}

ra_status ra_xla_attr_threads(const ra_xla_call *c, int *num_threads) {
    int64_t n = 0;
    int present = 0;
    *num_threads = 0;
    RA_CHECK(ra_xla_attr_int(c, "num_threads", &n, &present));
    RA_CHECK(ra_check_num_threads(n));
    *num_threads = (int)n;
    return RA_OK;
}

ra_status ra_xla_read_opts(const ra_xla_call *c, int64_t D, ra_xla_opts *o) {
    int present = 0;
    int64_t causal = 0;
    RA_CHECK(ra_xla_attr_int(c, "causal", &causal, &present));
    o->causal = causal != 0;
    o->scale = 1.0 / sqrt((double)D);
    RA_CHECK(ra_xla_attr_f64(c, "scale", &o->scale, &present));
    if (!isfinite(o->scale)) {
        ra_set_error(RA_ERR_VALUE, "scale: expected a finite number, got %g",
                     o->scale);
        return RA_ERR_VALUE;
    }
    RA_CHECK(ra_xla_attr_threads(c, &o->num_threads));
    return read_mask(c, o);
}

/* ---- mask operands ---------------------------------------------------------- */

ra_status ra_xla_no_masks(const ra_xla_opts *o) {
    if (o->mask.has_window || o->mask.softcap > 0 || o->has_ids) {
        ra_set_error(RA_ERR_VALUE, "dilated attention takes no segment ids, "
                                   "window or softcap");
        return RA_ERR_VALUE;
    }
    return RA_OK;
}

static ra_status extra_args(const ra_xla_call *c, int base,
                            const ra_xla_opts *o, int *has_pos, int *ids_at) {
    const int64_t extra = c->frame->args.size - base - (o->has_ids ? 2 : 0);
    if (extra != 0 && extra != 1) {
        ra_set_error(RA_ERR_VALUE,
                     "expected %d operands, then positions if any, then %s, "
                     "got %lld operands",
                     base, o->has_ids ? "two segment id operands" : "nothing",
                     (long long)c->frame->args.size);
        return RA_ERR_VALUE;
    }
    *has_pos = (int)extra;
    *ids_at = base + (int)extra;
    return RA_OK;
}

static ra_status ids_args(const ra_xla_call *c, int i, const ra_xla_qkv *d,
                          ra_xla_tensor *ids) {
    static const char *names[2] = {"segment_ids", "kv_segment_ids"};
    for (int j = 0; j < 2; j++) {
        RA_CHECK(ra_xla_arg(c, i + j, names[j], 2, &ids[j]));
        if (ids[j].ffi_dtype != RA_FFI_S32) {
            ra_set_error(RA_ERR_TYPE, "%s: expected int32 ids, got XLA type %d",
                         names[j], ids[j].ffi_dtype);
            return RA_ERR_TYPE;
        }
        const int64_t dims[2] = {d->B, j == 0 ? d->Sq : d->Sk};
        RA_CHECK(ra_xla_check_dims(&ids[j], dims,
                                   j == 0 ? "(batch, seq_q)" : "(batch, seq_k)"));
    }
    return RA_OK;
}

ra_status ra_xla_optional_args(const ra_xla_call *c, int base,
                               const ra_xla_opts *o, const ra_xla_qkv *d,
                               ra_xla_lead *l, ra_xla_tensor *pos, int *nq,
                               ra_xla_tensor *ids) {
    int has_pos = 0, ids_at = 0;
    RA_CHECK(extra_args(c, base, o, &has_pos, &ids_at));
    if (o->has_ids) {
        RA_CHECK(ids_args(c, ids_at, d, ids));
        for (int j = 0; j < 2; j++) {
            int full = 0;
            RA_CHECK(ra_xla_lead_check(l, &ids[j], &full));
            l->folded = l->folded && full;
        }
    }
    memset(pos, 0, sizeof *pos);
    *nq = 1;
    if (has_pos) RA_CHECK(ra_xla_positions_arg(c, base, l, pos, nq));
    return RA_OK;
}

void ra_xla_block_mask(ra_attn_mask *mask, const ra_xla_opts *o,
                       const int32_t *q_ids, const int32_t *kv_ids,
                       const ra_xla_qkv *d, int64_t q_off, int64_t k_off) {
    *mask = o->mask;
    if (q_ids == NULL) return;
    /* dense (B, S) of the whole operands, this block's rows onward */
    mask->q_segment_ids = q_ids + q_off;
    mask->q_seg_batch_stride = d->Sq;
    mask->q_seg_seq_stride = 1;
    mask->kv_segment_ids = kv_ids + k_off;
    mask->kv_seg_batch_stride = d->Sk;
    mask->kv_seg_seq_stride = 1;
}

/* ---- position pieces -------------------------------------------------------- */

ra_status ra_xla_positions_arg(const ra_xla_call *c, int i,
                               const ra_xla_lead *l, ra_xla_tensor *pos,
                               int *nq) {
    memset(pos, 0, sizeof *pos);
    *nq = 1;
    if (i >= c->frame->args.size) return RA_OK;
    RA_CHECK(ra_xla_arg(c, i, "positions", 2, pos));
    if ((pos->ffi_dtype != RA_FFI_S64 && pos->ffi_dtype != RA_FFI_S32) ||
        ra_xla_dim(pos, 1) != 3) {
        ra_set_error(RA_ERR_TYPE,
                     "positions: expected an int64 (or int32) table of "
                     "(length, start, stride) rows");
        return RA_ERR_TYPE;
    }
    int64_t n = 0;
    int present = 0;
    RA_CHECK(ra_xla_attr_int(c, "q_pieces", &n, &present));
    const int64_t rows = ra_xla_dim(pos, 0);
    if (!present || n < 1 || n > RA_XLA_MAX_PIECES || rows - n < 1 ||
        rows - n > RA_XLA_MAX_PIECES) {
        ra_set_error(RA_ERR_VALUE,
                     "positions: expected 1..%d rows for q (attribute "
                     "q_pieces) and 1..%d for k, got %lld rows, q_pieces=%lld",
                     RA_XLA_MAX_PIECES, RA_XLA_MAX_PIECES, (long long)rows,
                     (long long)n);
        return RA_ERR_VALUE;
    }
    RA_CHECK(ra_xla_lead_check(l, pos, NULL));
    if (c->device_type == RA_DEV_CUDA && !ra_xla_lead_shared(pos)) {
        ra_set_error(RA_ERR_UNSUPPORTED,
                     "positions: batched (vmapped) positions are supported "
                     "on the CPU only");
        return RA_ERR_UNSUPPORTED;
    }
    *nq = (int)n;
    return RA_OK;
}

static ra_status cut(const int64_t *rows, int n, int64_t total,
                     const char *what, ra_xla_piece *out) {
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        const int64_t len = rows[3 * i], start = rows[3 * i + 1],
                      stride = rows[3 * i + 2];
        if (len < 0 || len > total - off) {
            ra_set_error(RA_ERR_VALUE,
                         "positions: %s piece %d has length %lld, expected "
                         "0..%lld (the %s rows it has left)",
                         what, i, (long long)len, (long long)(total - off),
                         what);
            return RA_ERR_VALUE;
        }
        /* positions inside +-2^60, as every kernel call's */
        char start_name[48], stride_name[48];
        snprintf(start_name, sizeof start_name, "positions[%s piece %d].start",
                 what, i);
        snprintf(stride_name, sizeof stride_name,
                 "positions[%s piece %d].stride", what, i);
        RA_CHECK(ra_check_positions(start_name, start, stride_name, stride,
                                    len));
        out[i].off = off;
        out[i].len = len;
        out[i].start = start;
        out[i].stride = stride;
        off += len;
    }
    if (off != total) {
        ra_set_error(RA_ERR_VALUE,
                     "positions: the %s pieces cover %lld rows, expected %lld",
                     what, (long long)off, (long long)total);
        return RA_ERR_VALUE;
    }
    return RA_OK;
}

ra_status ra_xla_load_pieces(const ra_xla_call *c, const ra_xla_tensor *pos,
                             int nq, const ra_xla_lead *l, int64_t idx,
                             int64_t Sq, int64_t Sk, ra_xla_pieces *pp) {
    memset(pp, 0, sizeof *pp);
    if (pos->data == NULL) {
        pp->nq = pp->nk = 1;
        pp->q[0] = (ra_xla_piece){0, Sq, Sk - Sq, 1};
        pp->k[0] = (ra_xla_piece){0, Sk, 0, 1};
        return RA_OK;
    }
    int64_t rows[3 * 2 * RA_XLA_MAX_PIECES];
    const int64_t n = ra_xla_dim(pos, 0);
    const int wide = pos->ffi_dtype == RA_FFI_S64;
    const int64_t off = l == NULL ? 0 : ra_xla_lead_offset(l, pos, idx);
    RA_CHECK(ra_xla_read_ints(c, (const char *)pos->data + off * (wide ? 8 : 4),
                              wide, rows, 3 * n));
    pp->nq = nq;
    pp->nk = (int)n - nq;
    RA_CHECK(cut(rows, pp->nq, Sq, "q", pp->q));
    return cut(rows + 3 * nq, pp->nk, Sk, "k", pp->k);
}

int ra_xla_single_block(const ra_xla_pieces *pp, ra_xla_block *block) {
    if (pp->nq != 1 || pp->nk != 1) return 0;
    const ra_xla_piece *qp = &pp->q[0], *kp = &pp->k[0];
    *block = (ra_xla_block){qp->off, qp->len, qp->start, qp->stride,
                            kp->off, kp->len, kp->start, kp->stride};
    return 1;
}

static int64_t floor_div(int64_t a, int64_t b) {   /* b > 0 */
    const int64_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

static int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Rows [*i0, *i1) of q piece qp that see any key of kp, and keys [*j0, *j1)
 * that some row sees, when every visible distance pos_k - pos_q lies in
 * [lo, hi] and both pieces have one stride (the difference j - i then
 * runs over a range).  0 when none does. */
static int meet(const ra_xla_piece *qp, const ra_xla_piece *kp, int64_t lo,
                int64_t hi, int64_t *i0, int64_t *i1, int64_t *j0,
                int64_t *j1) {
    const int64_t s = qp->stride, c = kp->start - qp->start;
    const int64_t m_lo = max64(1 - qp->len, ceil_div(lo - c, s));
    const int64_t m_hi = min64(kp->len - 1, floor_div(hi - c, s));
    if (lo > hi || m_lo > m_hi) return 0;
    *i0 = max64(0, -m_hi);
    *i1 = min64(qp->len - 1, kp->len - 1 - m_lo) + 1;
    *j0 = max64(0, m_lo);
    *j1 = min64(kp->len - 1, qp->len - 1 + m_hi) + 1;
    return 1;
}

int ra_xla_state_blocks(const ra_xla_pieces *pp, const ra_xla_opts *o,
                        ra_xla_block *blocks) {
    /* visible distances pos_k - pos_q: [lo, hi] (positions stay within
     * +-2^60 (ra_check_positions), so +-2^62 is unbounded) */
    const int64_t big = (int64_t)1 << 62;
    int64_t lo = -big, hi = big;
    if (o->causal) hi = 0;
    if (o->mask.has_window) {
        if (o->mask.window_left >= 0) lo = -o->mask.window_left;
        if (o->mask.window_right >= 0) hi = min64(hi, o->mask.window_right);
    }
    const int bounded = o->causal || o->mask.has_window;
    int n = 0;
    for (int a = 0; a < pp->nq; a++) {
        for (int b = 0; b < pp->nk; b++) {
            const ra_xla_piece *qp = &pp->q[a], *kp = &pp->k[b];
            int64_t i0 = 0, i1 = qp->len, j0 = 0, j1 = kp->len;
            if (qp->len == 0 || kp->len == 0) continue;
            if (bounded && qp->stride == kp->stride) {
                if (!meet(qp, kp, lo, hi, &i0, &i1, &j0, &j1)) continue;
            } else if (o->causal) {
                const int64_t q_last = qp->start + qp->stride * (qp->len - 1);
                if (kp->start > q_last) continue;       /* all in the future */
                /* keys some row sees: pos_k <= q_last */
                j1 = min64(kp->len, (q_last - kp->start) / kp->stride + 1);
                /* rows that see a key: pos_q >= kp->start */
                if (kp->start > qp->start)
                    i0 = (kp->start - qp->start + qp->stride - 1) / qp->stride;
                if (i0 >= qp->len) continue;
            }
            blocks[n++] = (ra_xla_block){qp->off + i0, i1 - i0,
                                         qp->start + i0 * qp->stride, qp->stride,
                                         kp->off + j0, j1 - j0,
                                         kp->start + j0 * kp->stride,
                                         kp->stride};
        }
    }
    return n;
}
