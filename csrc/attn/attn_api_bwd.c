/*
 * attn_api_bwd.c -- the Python boundary of the backward kernels and the LSE
 * merge.  Same flow as attn_api.c: Buffers -> checks -> params -> kernel.
 *
 *   dout, out, q, dq : (B, S_q, H, D)     k, v, dk, dv : (B, S_k, H_kv, D)
 *   lse, delta       : (B, H, S_q) float32 (float64 for float64 inputs)
 */
#include <math.h>
#include <string.h>

#include "attn/attn_api.h"
#include "attn/attn_args.h"
#include "attn/attn_cpu.h"
#include "core/cuda_rt.h"
#include "core/module.h"

/* t: q, k, v, out, dout, lse, delta, dq, dk, dv (the RA_BWD_* order of
 * attn_params.h); unused ones NULL */
static void fill_bwd_params(ra_attn_bwd_params *p, const qkv_dims *d,
                            const tensor_arg *t, double scale, int causal,
                            const int64_t pos[4], const ra_attn_mask *mask,
                            int accumulate, int deterministic,
                            int num_threads) {
    ra_view views[RA_BWD_NVIEWS];
    for (int i = 0; i < RA_BWD_NVIEWS; i++) views[i] = view_of(t[i].buf);
    const ra_attn_call call = call_of(d, scale, causal, pos, mask, accumulate,
                                      num_threads);
    const ra_buffer *dq = t[RA_BWD_DQ].buf;
    ra_attn_bwd_fill(p, &call, views, t[RA_BWD_DOUT].buf->dtype,
                     dq != NULL ? dq->dtype : d->dtype, deterministic);
}

/* Make `a` (a (B,H,S) buffer) use the same strides as `like`, copying when
 * they differ (lse and delta share one stride set in the params). */
static int match_strides(tensor_arg *a, ra_buffer *like) {
    ra_buffer *b = a->buf;
    int same = 1;
    for (int i = 0; i < 3; i++)
        if (b->shape[i] > 1 && b->strides[i] != like->strides[i]) same = 0;
    return same ? 0 : replace_with_copy(a);
}

static ra_status run_preprocess(const ra_attn_bwd_params *p, int device_type,
                                int device_id) {
    ra_status st = RA_OK;
    if (device_type == RA_DEV_CUDA) {
        st = ra_cuda_run(device_id, RA_CUDA_BWD_PRE, p);
    } else {
        Py_BEGIN_ALLOW_THREADS
        st = ra_cpu_attn_bwd_preprocess(p);
        Py_END_ALLOW_THREADS
    }
    return st;
}

static PyObject *bwd_common(PyObject *args, PyObject *kwds, int dilated) {
    static char *kwlist_dense[] = {
        "dout", "q", "k", "v", "out", "lse", "causal", "scale", "dq", "dk",
        "dv", "delta", "accumulate", "deterministic", "q_pos_offset",
        "q_pos_stride", "k_pos_offset", "k_pos_stride", "num_threads",
        "check_only", "branches", "branch_head", "branch_head_stride", "segment_ids",
        "kv_segment_ids", "window", "softcap", NULL};
    static char *kwlist_dil[] = {
        "dout", "q", "k", "v", "out", "lse", "segment_lengths",
        "dilation_rates", "causal", "scale", "dq", "dk", "dv", "delta",
        "accumulate", "deterministic", "q_pos_offset", "k_pos_offset",
        "num_threads", "check_only", NULL};
    PyObject *douto, *qo, *ko, *vo, *outo, *lseo, *scale_o = Py_None,
             *dqo = Py_None, *dko = Py_None, *dvo = Py_None,
             *deltao = Py_None, *qoff_o = Py_None, *segs = NULL,
             *rates = NULL, *branches_o = Py_None;
    long long branch_head = 0, branch_head_stride = 1;
    int causal = 0, accumulate = 0, deterministic = 0, num_threads = 0,
        check_only = 0;
    PyObject *qstride = NULL, *koff = NULL, *kstride = NULL, *threads_o = NULL;
    ra_dilated_config cfg;
    mask_kwargs mkw = {Py_None, Py_None, Py_None, Py_None};
    ra_attn_mask mask;
    /* q, k, v, out, dout, lse, delta, dq, dk, dv, q ids, kv ids */
    tensor_arg t[12];
    memset(t, 0, sizeof t);
    memset(&mask, 0, sizeof mask);
    PyObject *result = NULL;

    if (dilated) {
        if (!PyArg_ParseTupleAndKeywords(
                args, kwds, "OOOOOOOO|$pOOOOOppOOOp:dilated_bwd", kwlist_dil,
                &douto, &qo, &ko, &vo, &outo, &lseo, &segs, &rates, &causal,
                &scale_o, &dqo, &dko, &dvo, &deltao, &accumulate,
                &deterministic, &qoff_o, &koff, &threads_o, &check_only))
            return NULL;
        if (ra_parse_dilated(segs, rates, &cfg) < 0) return NULL;
    } else {
        if (!PyArg_ParseTupleAndKeywords(
                args, kwds, "OOOOOO|$pOOOOOppOOOOOpOLLOOOO:attn_bwd",
                kwlist_dense, &douto, &qo, &ko, &vo, &outo, &lseo, &causal,
                &scale_o, &dqo, &dko, &dvo, &deltao, &accumulate,
                &deterministic, &qoff_o, &qstride, &koff, &kstride,
                &threads_o, &check_only, &branches_o, &branch_head,
                &branch_head_stride,
                &mkw.segment_ids, &mkw.kv_segment_ids, &mkw.window,
                &mkw.softcap))
            return NULL;
        /* branches=(segment_lengths, dilation_rates): the scores are one
         * branch of dilated attention, query head j being the global head
         * branch_head + branch_head_stride * j */
        if (branch_head_stride < 1) {
            PyErr_Format(PyExc_ValueError,
                         "branch_head_stride: expected >= 1, got %lld",
                         branch_head_stride);
            return NULL;
        }
        if (branches_o != Py_None) {
            if (!PyTuple_Check(branches_o) || PyTuple_GET_SIZE(branches_o) != 2) {
                PyErr_SetString(PyExc_TypeError,
                                "branches: expected (segment_lengths, "
                                "dilation_rates)");
                return NULL;
            }
            if (ra_parse_dilated(PyTuple_GET_ITEM(branches_o, 0),
                                 PyTuple_GET_ITEM(branches_o, 1), &cfg) < 0)
                return NULL;
            if (branch_head < 0) {
                PyErr_Format(PyExc_ValueError,
                             "branch_head: expected >= 0, got %lld",
                             branch_head);
                return NULL;
            }
        }
    }
    if (load_tensor(&t[0], qo, "q", 4, BSHD) < 0) goto done;
    if (load_tensor(&t[1], ko, "k", 4, BSHD) < 0) goto done;
    if (load_tensor(&t[2], vo, "v", 4, BSHD) < 0) goto done;
    qkv_dims d;
    if (check_qkv(&t[0], &t[1], &t[2], &d) < 0) goto done;
    if (load_tensor(&t[4], douto, "dout", 4, BSHD) < 0) goto done;
    if (check_shape4_like(&t[4], &t[0]) < 0 || check_same_device(&t[0], &t[4]) < 0)
        goto done;
    if (t[4].buf->dtype != d.dtype && t[4].buf->dtype != ra_acc_dtype(d.dtype)) {
        PyErr_Format(PyExc_TypeError, "dout: expected dtype %s (the dtype of "
                                      "q), got %s",
                     ra_dtype_name(d.dtype), ra_dtype_name(t[4].buf->dtype));
        goto done;
    }
    if (deltao == Py_None || outo != Py_None) {
        if (outo == Py_None) {
            PyErr_SetString(PyExc_ValueError,
                            "out: the forward output is needed (or pass "
                            "delta=)");
            goto done;
        }
        if (load_tensor(&t[3], outo, "out", 4, BSHD) < 0) goto done;
        if (check_shape4_like(&t[3], &t[0]) < 0 ||
            check_same_device(&t[0], &t[3]) < 0)
            goto done;
        if (t[3].buf->dtype != t[4].buf->dtype) {
            PyErr_Format(PyExc_TypeError,
                         "out: expected dtype %s (the dtype of dout), got %s",
                         ra_dtype_name(t[4].buf->dtype),
                         ra_dtype_name(t[3].buf->dtype));
            goto done;
        }
    }
    if (load_bhs(&t[5], lseo, "lse", &d, 0) < 0) goto done;
    double scale;
    if (parse_scale(scale_o, d.D, &scale) < 0) goto done;
    int64_t pos[4];
    if ((dilated ? parse_dilated_positions(qoff_o, koff, &d, pos)
                 : parse_positions(qoff_o, qstride, koff, kstride, &d, pos)) < 0)
        goto done;
    if (!dilated) {
        if (parse_masks(&mkw, &d, &t[10], &mask) < 0) goto done;
        if (branches_o != Py_None &&
            (mask.has_window || mask.softcap > 0)) {
            PyErr_SetString(PyExc_ValueError,
                            "branches: dilated attention takes no window or "
                            "softcap (segment_ids are fine)");
            goto done;
        }
    }
    if (parse_num_threads(threads_o, &num_threads) < 0) goto done;
    if (check_only) {   /* dout, q, k, v, out, lse, scale, masks: no work */
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    ra_dtype acc = ra_acc_dtype(d.dtype);
    int64_t bhs[3] = {d.B, d.H, d.Sq};
    if (deltao != Py_None) {
        if (load_bhs(&t[6], deltao, "delta", &d, 0) < 0) goto done;
    } else {
        t[6].name = "delta";
        t[6].buf = alloc_out(3, bhs, acc, &d, 0);
        if (t[6].buf == NULL) goto done;
    }
    if (match_strides(&t[5], t[6].buf) < 0) goto done;
    /* gradients: given (then accumulate may add into them) or allocated in
     * the inputs' dtype */
    PyObject *grad_objs[3] = {dqo, dko, dvo};
    const char *grad_names[3] = {"dq", "dk", "dv"};
    for (int i = 0; i < 3; i++) {
        tensor_arg *g = &t[7 + i];
        tensor_arg *like = &t[i];
        if (grad_objs[i] != Py_None) {
            if (load_output(g, grad_objs[i], grad_names[i], 4, BSHD) < 0)
                goto done;
            if (check_shape4_like(g, like) < 0 || check_same_device(like, g) < 0 ||
                check_writable(g) < 0)
                goto done;
            ra_dtype want = accumulate ? acc : g->buf->dtype;
            if (g->buf->dtype != want ||
                (g->buf->dtype != d.dtype && g->buf->dtype != acc)) {
                PyErr_Format(PyExc_TypeError,
                             "%s: expected dtype %s, got %s", grad_names[i],
                             ra_dtype_name(accumulate ? acc : d.dtype),
                             ra_dtype_name(g->buf->dtype));
                goto done;
            }
        } else if (accumulate) {
            PyErr_Format(PyExc_ValueError,
                         "accumulate=True needs %s= to add into",
                         grad_names[i]);
            goto done;
        } else {
            g->name = grad_names[i];
            g->buf = alloc_out(4, like->buf->shape, d.dtype, &d, 0);
            if (g->buf == NULL) goto done;
        }
    }
    if (t[8].buf->dtype != t[7].buf->dtype || t[9].buf->dtype != t[7].buf->dtype) {
        PyErr_SetString(PyExc_TypeError,
                        "dq, dk, dv: expected one dtype for all three");
        goto done;
    }

    ra_attn_bwd_params p;
    fill_bwd_params(&p, &d, t, scale, causal, pos, &mask, accumulate,
                    deterministic, num_threads);
    if (!dilated && branches_o != Py_None) {
        p.branches = &cfg;
        p.branch_head0 = branch_head;
        p.branch_head_stride = branch_head_stride;
    }
    ra_status st = RA_OK;
    if (deltao == Py_None) {
        st = run_preprocess(&p, d.device_type, d.device_id);
        if (st != RA_OK) {
            ra_raise(st);
            goto done;
        }
    }
    if (d.device_type == RA_DEV_CUDA) {
        const ra_dilated_call dc = {&p, &cfg};
        st = dilated ? ra_cuda_run(d.device_id, RA_CUDA_DILATED_BWD, &dc)
                     : ra_cuda_run(d.device_id, RA_CUDA_BWD, &p);
    } else {
        Py_BEGIN_ALLOW_THREADS
        st = dilated ? ra_cpu_dilated_bwd(&p, &cfg) : ra_cpu_attn_bwd(&p);
        Py_END_ALLOW_THREADS
    }
    if (st != RA_OK) {
        ra_raise(st);
        goto done;
    }
    result = PyTuple_Pack(3, (PyObject *)t[7].buf, (PyObject *)t[8].buf,
                          (PyObject *)t[9].buf);
done:
    release_args(t, 12);
    return result;
}

static PyObject *mod_attn_bwd(PyObject *m, PyObject *args, PyObject *kwds) {
    (void)m;
    return bwd_common(args, kwds, 0);
}

static PyObject *mod_dilated_bwd(PyObject *m, PyObject *args, PyObject *kwds) {
    (void)m;
    return bwd_common(args, kwds, 1);
}

/* delta = rowsum(dout * out): (B, H, S_q) acc dtype */
static PyObject *mod_bwd_preprocess(PyObject *m, PyObject *args,
                                    PyObject *kwds) {
    static char *kwlist[] = {"dout", "out", "delta", "num_threads", NULL};
    PyObject *douto, *outo, *deltao = Py_None, *threads_o = NULL;
    int num_threads = 0;
    tensor_arg t[10];
    memset(t, 0, sizeof t);
    PyObject *result = NULL;
    (void)m;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|$OO:attn_bwd_preprocess",
                                     kwlist, &douto, &outo, &deltao,
                                     &threads_o))
        return NULL;
    if (parse_num_threads(threads_o, &num_threads) < 0) return NULL;
    if (load_tensor(&t[4], douto, "dout", 4, BSHD) < 0) goto done;
    if (load_tensor(&t[3], outo, "out", 4, BSHD) < 0) goto done;
    if (check_shape4_like(&t[3], &t[4]) < 0 || check_same_dtype(&t[4], &t[3]) < 0 ||
        check_same_device(&t[4], &t[3]) < 0)
        goto done;
    qkv_dims d;
    dims_of_rows(t[4].buf, ra_acc_dtype(t[4].buf->dtype), &d);
    int64_t bhs[3] = {d.B, d.H, d.Sq};
    if (deltao != Py_None) {
        if (load_bhs(&t[6], deltao, "delta", &d, 1) < 0) goto done;
    } else {
        t[6].name = "delta";
        t[6].buf = alloc_out(3, bhs, ra_acc_dtype(d.dtype), &d, 0);
        if (t[6].buf == NULL) goto done;
    }
    /* the kernel reads only out/dout/delta; q, k, v slots alias dout */
    t[0].buf = t[4].buf; Py_INCREF(t[0].buf);
    t[1].buf = t[4].buf; Py_INCREF(t[1].buf);
    t[2].buf = t[4].buf; Py_INCREF(t[2].buf);
    t[5].buf = t[6].buf; Py_INCREF(t[5].buf);
    ra_attn_bwd_params p;
    int64_t pos[4] = {0, 1, 0, 1};
    d.dtype = t[4].buf->dtype;
    fill_bwd_params(&p, &d, t, 1.0, 0, pos, NULL, 0, 0, num_threads);
    ra_status st = run_preprocess(&p, d.device_type, d.device_id);
    if (st != RA_OK) {
        ra_raise(st);
        goto done;
    }
    result = (PyObject *)t[6].buf;
    Py_INCREF(result);
done:
    release_args(t, 10);
    return result;
}

/* ---- merge --------------------------------------------------------------- */

static PyObject *mod_merge(PyObject *m, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"out1", "lse1", "out2", "lse2", "out", "lse",
                             "num_threads", NULL};
    PyObject *o1, *l1, *o2, *l2, *oo = Py_None, *lo = Py_None, *threads_o = NULL;
    int num_threads = 0;
    tensor_arg t[6];
    memset(t, 0, sizeof t);
    PyObject *result = NULL;
    (void)m;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|$OOO:merge", kwlist, &o1,
                                     &l1, &o2, &l2, &oo, &lo, &threads_o))
        return NULL;
    if (parse_num_threads(threads_o, &num_threads) < 0) return NULL;
    if (load_tensor(&t[0], o1, "out1", 4, BSHD) < 0) goto done;
    if (load_tensor(&t[2], o2, "out2", 4, BSHD) < 0) goto done;
    if (check_shape4_like(&t[2], &t[0]) < 0 || check_same_device(&t[0], &t[2]) < 0)
        goto done;
    qkv_dims d;
    dims_of_rows(t[0].buf, RA_FLOAT32, &d);
    /* the state is float64 for float64 outputs or when both lse are
     * float64, else float32; a lse of any other dtype is blamed itself */
    {
        ra_buffer *probe1 = ra_buffer_from_object(l1, "lse1", -1);
        if (probe1 == NULL) goto done;
        ra_buffer *probe2 = ra_buffer_from_object(l2, "lse2", -1);
        if (probe2 == NULL) {
            Py_DECREF(probe1);
            goto done;
        }
        int f64 = t[0].buf->dtype == RA_FLOAT64 ||
                  (probe1->dtype == RA_FLOAT64 && probe2->dtype == RA_FLOAT64);
        d.dtype = f64 ? RA_FLOAT64 : RA_FLOAT32;
        Py_DECREF(probe1);
        Py_DECREF(probe2);
    }
    if (load_bhs(&t[1], l1, "lse1", &d, 0) < 0) goto done;
    if (load_bhs(&t[3], l2, "lse2", &d, 0) < 0) goto done;
    ra_dtype out_dtype = t[0].buf->dtype;
    if (t[2].buf->dtype == RA_FLOAT64 || t[2].buf->dtype == RA_FLOAT32)
        if (ra_dtype_size(t[2].buf->dtype) > ra_dtype_size(out_dtype))
            out_dtype = t[2].buf->dtype;
    if (oo != Py_None) {
        if (load_output(&t[4], oo, "out", 4, BSHD) < 0) goto done;
        if (check_shape4_like(&t[4], &t[0]) < 0 ||
            check_same_device(&t[0], &t[4]) < 0 || check_writable(&t[4]) < 0)
            goto done;
    } else {
        t[4].name = "out";
        t[4].buf = alloc_out(4, t[0].buf->shape, out_dtype, &d, 0);
        if (t[4].buf == NULL) goto done;
    }
    if (lo != Py_None) {
        if (load_bhs(&t[5], lo, "lse", &d, 1) < 0) goto done;
    } else {
        int64_t bhs[3] = {d.B, d.H, d.Sq};
        t[5].name = "lse";
        t[5].buf = alloc_out(3, bhs, ra_acc_dtype(d.dtype), &d, 0);
        if (t[5].buf == NULL) goto done;
    }
    ra_merge_params p;
    memset(&p, 0, sizeof p);
    p.out1 = t[0].buf->data;
    p.lse1 = t[1].buf->data;
    p.out2 = t[2].buf->data;
    p.lse2 = t[3].buf->data;
    p.out = t[4].buf->data;
    p.lse = t[5].buf->data;
    p.out1_dtype = t[0].buf->dtype;
    p.out2_dtype = t[2].buf->dtype;
    p.out_dtype = t[4].buf->dtype;
    p.lse_dtype = t[1].buf->dtype;
    p.batch = d.B;
    p.seqlen = d.Sq;
    p.heads = d.H;
    p.head_dim = d.D;
#define RA_S4(f, b)                                                            \
    p.f##_batch_stride = (b)->strides[0];                                      \
    p.f##_seq_stride = (b)->strides[1];                                        \
    p.f##_head_stride = (b)->strides[2];
#define RA_S3(f, b)                                                            \
    p.f##_batch_stride = (b)->strides[0];                                      \
    p.f##_head_stride = (b)->strides[1];                                       \
    p.f##_seq_stride = (b)->strides[2];
    RA_S4(out1, t[0].buf)
    RA_S4(out2, t[2].buf)
    RA_S4(out, t[4].buf)
    RA_S3(lse1, t[1].buf)
    RA_S3(lse2, t[3].buf)
    RA_S3(lse, t[5].buf)
#undef RA_S4
#undef RA_S3
    p.num_threads = num_threads;
    ra_status st;
    if (d.device_type == RA_DEV_CUDA) {
        st = ra_cuda_run(d.device_id, RA_CUDA_MERGE, &p);
    } else {
        Py_BEGIN_ALLOW_THREADS
        st = ra_cpu_merge(&p);
        Py_END_ALLOW_THREADS
    }
    if (st != RA_OK) {
        ra_raise(st);
        goto done;
    }
    result = PyTuple_Pack(2, (PyObject *)t[4].buf, (PyObject *)t[5].buf);
done:
    release_args(t, 6);
    return result;
}

PyMethodDef ra_attn_bwd_functions[] = {
    {"attn_bwd", (PyCFunction)(void (*)(void))mod_attn_bwd,
     METH_VARARGS | METH_KEYWORDS,
     "attn_bwd(dout, q, k, v, out, lse, *, causal=False, scale=None, dq=None, "
     "dk=None, dv=None, delta=None, accumulate=False, deterministic=False, "
     "q_pos_offset=None, q_pos_stride=1, k_pos_offset=0, k_pos_stride=1, "
     "num_threads=0, check_only=False, branches=None, branch_head=0, "
     "branch_head_stride=1, segment_ids=None, kv_segment_ids=None, "
     "window=None, softcap=None) -> "
     "(dq, dk, dv), or None after the checks alone with check_only=True; "
     "the masks as attn_fwd takes them; "
     "branches=(segment_lengths, dilation_rates): the scores are one branch "
     "of dilated attention whose query head j is the global head "
     "branch_head + branch_head_stride * j (segment_ids may be given with "
     "it, window and softcap not)"},
    {"dilated_bwd", (PyCFunction)(void (*)(void))mod_dilated_bwd,
     METH_VARARGS | METH_KEYWORDS,
     "dilated_bwd(dout, q, k, v, out, lse, segment_lengths, dilation_rates, "
     "*, causal=False, scale=None, dq=None, dk=None, dv=None, delta=None, "
     "accumulate=False, deterministic=False, q_pos_offset=None, "
     "k_pos_offset=0, num_threads=0, check_only=False) -> (dq, dk, dv)"},
    {"attn_bwd_preprocess", (PyCFunction)(void (*)(void))mod_bwd_preprocess,
     METH_VARARGS | METH_KEYWORDS,
     "attn_bwd_preprocess(dout, out, *, delta=None) -> delta (B, H, S_q)"},
    {"merge", (PyCFunction)(void (*)(void))mod_merge,
     METH_VARARGS | METH_KEYWORDS,
     "merge(out1, lse1, out2, lse2, *, out=None, lse=None) -> (out, lse)"},
    {NULL, NULL, 0, NULL},
};
