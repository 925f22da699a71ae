/*
 * ffi_args.c -- checks and position pieces shared by the attention
 * handlers (ffi_args.h).  Every check names the operand, the expected and
 * the actual value.
 */
#include "xla/ffi_args.h"

#include <math.h>
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

ra_status ra_xla_read_opts(const ra_xla_call *c, int64_t D, ra_xla_opts *o) {
    int present = 0;
    int64_t causal = 0, nt = 0;
    RA_CHECK(ra_xla_attr_int(c, "causal", &causal, &present));
    o->causal = causal != 0;
    o->scale = 1.0 / sqrt((double)D);
    RA_CHECK(ra_xla_attr_f64(c, "scale", &o->scale, &present));
    if (!isfinite(o->scale)) {
        ra_set_error(RA_ERR_VALUE, "scale: expected a finite number, got %g",
                     o->scale);
        return RA_ERR_VALUE;
    }
    RA_CHECK(ra_xla_attr_int(c, "num_threads", &nt, &present));
    if (nt < 0 || nt > 4096) {
        ra_set_error(RA_ERR_VALUE, "num_threads: expected 0..4096, got %lld",
                     (long long)nt);
        return RA_ERR_VALUE;
    }
    o->num_threads = (int)nt;
    return RA_OK;
}

/* ---- position pieces -------------------------------------------------------- */

ra_status ra_xla_positions_arg(const ra_xla_call *c, int i,
                               const ra_xla_tensor *ref, ra_xla_tensor *pos,
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
    ra_xla_lead check;
    RA_CHECK(ra_xla_lead_plan(&check, ref, pos, 1));
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
        /* bounds keep start + stride * len far from overflow */
        if (len < 0 || len > total - off || stride < 1 || stride > ((int64_t)1 << 40) ||
            start < -((int64_t)1 << 60) || start > ((int64_t)1 << 60)) {
            ra_set_error(RA_ERR_VALUE,
                         "positions: %s piece %d (length %lld, start %lld, "
                         "stride %lld) is out of range for %lld rows",
                         what, i, (long long)len, (long long)start,
                         (long long)stride, (long long)total);
            return RA_ERR_VALUE;
        }
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

int ra_xla_state_blocks(const ra_xla_pieces *pp, int causal,
                        ra_xla_block *blocks) {
    int n = 0;
    for (int a = 0; a < pp->nq; a++) {
        for (int b = 0; b < pp->nk; b++) {
            const ra_xla_piece *qp = &pp->q[a], *kp = &pp->k[b];
            int64_t i0 = 0, kn = kp->len;
            if (qp->len == 0 || kp->len == 0) continue;
            if (causal) {
                const int64_t q_last = qp->start + qp->stride * (qp->len - 1);
                if (kp->start > q_last) continue;       /* all in the future */
                /* keys some row sees: pos_k <= q_last */
                const int64_t seen = (q_last - kp->start) / kp->stride + 1;
                if (seen < kn) kn = seen;
                /* rows that see a key: pos_q >= kp->start */
                if (kp->start > qp->start)
                    i0 = (kp->start - qp->start + qp->stride - 1) / qp->stride;
                if (i0 >= qp->len) continue;
            }
            blocks[n++] = (ra_xla_block){qp->off + i0, qp->len - i0,
                                         qp->start + i0 * qp->stride, qp->stride,
                                         kp->off, kn, kp->start, kp->stride};
        }
    }
    return n;
}
