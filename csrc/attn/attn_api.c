/*
 * attn_api.c -- the Python boundary of the attention kernels.
 *
 * Data flows: Python arguments -> Buffers (zero-copy) -> checks (shapes,
 * dtypes, devices, strides, sizes; all before any work) -> one params struct
 * filled in one place -> CPU kernel (GIL released) or CUDA launcher on the
 * device's compute stream.  Inputs whose last dimension is not contiguous
 * are copied; everything else is used in place.
 *
 *   q, out, dout, dq : (B, S_q, H, D)     k, v, dk, dv : (B, S_k, H_kv, D)
 *   lse, delta       : (B, H, S_q) float32 (float64 for float64 inputs)
 */
#include <math.h>
#include <string.h>

#include "attn/attn_api.h"
#include "attn/attn_args.h"
#include "attn/attn_cpu.h"
#include "core/buffer.h"
#include "core/module.h"
#ifdef RA_WITH_CUDA
#include "attn_cuda.h"
#include "core/cuda_rt.h"
#endif

/* ---- forward ------------------------------------------------------------ */

static PyObject *fwd_common(PyObject *args, PyObject *kwds, int dilated) {
    static char *kwlist_dense[] = {
        "q", "k", "v", "causal", "scale", "out", "lse", "accumulate",
        "q_pos_offset", "q_pos_stride", "k_pos_offset", "k_pos_stride",
        "num_threads", "check_only", "segment_ids", "kv_segment_ids",
        "window", "softcap", NULL};
    static char *kwlist_dil[] = {
        "q", "k", "v", "segment_lengths", "dilation_rates", "causal", "scale",
        "out", "lse", "accumulate", "q_pos_offset", "k_pos_offset",
        "num_threads", "check_only", NULL};
    PyObject *qo, *ko, *vo, *scale_o = Py_None, *out_o = Py_None,
             *lse_o = Py_None, *qoff_o = Py_None, *segs = NULL, *rates = NULL;
    int causal = 0, accumulate = 0, num_threads = 0, check_only = 0;
    PyObject *qstride = NULL, *koff = NULL, *kstride = NULL, *threads_o = NULL;
    ra_dilated_config cfg;
    mask_kwargs mkw = {Py_None, Py_None, Py_None, Py_None};
    ra_attn_mask mask;
    tensor_arg t[7];           /* q, k, v, out, lse, q ids, kv ids */
    memset(t, 0, sizeof t);
    memset(&mask, 0, sizeof mask);
    PyObject *result = NULL;

    if (dilated) {
        if (!PyArg_ParseTupleAndKeywords(
                args, kwds, "OOOOO|$pOOOpOOOp:dilated_fwd", kwlist_dil, &qo,
                &ko, &vo, &segs, &rates, &causal, &scale_o, &out_o, &lse_o,
                &accumulate, &qoff_o, &koff, &threads_o, &check_only))
            return NULL;
        if (ra_parse_dilated(segs, rates, &cfg) < 0) return NULL;
    } else {
        if (!PyArg_ParseTupleAndKeywords(
                args, kwds, "OOO|$pOOOpOOOOOpOOOO:attn_fwd", kwlist_dense,
                &qo, &ko, &vo, &causal, &scale_o, &out_o, &lse_o, &accumulate,
                &qoff_o, &qstride, &koff, &kstride, &threads_o, &check_only,
                &mkw.segment_ids, &mkw.kv_segment_ids, &mkw.window,
                &mkw.softcap))
            return NULL;
    }
    if (load_tensor(&t[0], qo, "q", 4, BSHD) < 0) goto done;
    if (load_tensor(&t[1], ko, "k", 4, BSHD) < 0) goto done;
    if (load_tensor(&t[2], vo, "v", 4, BSHD) < 0) goto done;
    qkv_dims d;
    if (check_qkv(&t[0], &t[1], &t[2], &d) < 0) goto done;
    double scale;
    if (parse_scale(scale_o, d.D, &scale) < 0) goto done;
    int64_t pos[4];
    if ((dilated ? parse_dilated_positions(qoff_o, koff, &d, pos)
                 : parse_positions(qoff_o, qstride, koff, kstride, &d, pos)) < 0)
        goto done;
    if (!dilated && parse_masks(&mkw, &d, &t[5], &mask) < 0) goto done;
    if (parse_num_threads(threads_o, &num_threads) < 0) goto done;
    if (check_only) {          /* q, k, v, scale, positions, masks: no work */
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    ra_dtype acc = ra_acc_dtype(d.dtype);
    int64_t lse_shape[3] = {d.B, d.H, d.Sq};
    if (accumulate && (out_o == Py_None || lse_o == Py_None)) {
        PyErr_SetString(PyExc_ValueError,
                        "accumulate=True needs the running state: pass out= "
                        "and lse=");
        goto done;
    }
    if (out_o != Py_None) {
        if (load_output(&t[3], out_o, "out", 4, BSHD) < 0) goto done;
        if (check_shape4_like(&t[3], &t[0]) < 0) goto done;
        if (check_same_device(&t[0], &t[3]) < 0 || check_writable(&t[3]) < 0)
            goto done;
        if (accumulate) {
            if (check_acc_dtype(&t[3], acc, "the running state is kept in "
                                            "float32/float64") < 0)
                goto done;
        } else if (t[3].buf->dtype != d.dtype && t[3].buf->dtype != acc) {
            PyErr_Format(PyExc_TypeError,
                         "out: expected dtype %s or %s, got %s",
                         ra_dtype_name(d.dtype), ra_dtype_name(acc),
                         ra_dtype_name(t[3].buf->dtype));
            goto done;
        }
    } else {
        t[3].name = "out";
        t[3].buf = alloc_out(4, t[0].buf->shape, d.dtype, &d, 0);
        if (t[3].buf == NULL) goto done;
    }
    if (lse_o != Py_None) {
        t[4].name = "lse";
        t[4].buf = ra_buffer_from_object(lse_o, "lse", -1);
        if (t[4].buf == NULL) goto done;
        if (t[4].buf->ndim != 3) {
            PyErr_Format(PyExc_ValueError,
                         "lse: expected 3 dimensions %s, got %d", BHS,
                         t[4].buf->ndim);
            goto done;
        }
        if (t[4].buf->dtype == RA_DTYPE_OTHER) {
            dtype_error("lse", t[4].buf);
            goto done;
        }
        if (check_shape3(&t[4], d.B, d.H, d.Sq, BHS) < 0) goto done;
        if (check_acc_dtype(&t[4], acc, "lse is float32, float64 for float64 "
                                        "inputs") < 0)
            goto done;
        if (check_same_device(&t[0], &t[4]) < 0 || check_writable(&t[4]) < 0)
            goto done;
    } else {
        t[4].name = "lse";
        t[4].buf = alloc_out(3, lse_shape, acc, &d, 0);
        if (t[4].buf == NULL) goto done;
    }

    ra_attn_fwd_params p;
    const ra_attn_call call = call_of(&d, scale, causal, pos, &mask,
                                      accumulate, num_threads);
    ra_attn_fwd_fill(&p, &call, view_of(t[0].buf), view_of(t[1].buf),
                     view_of(t[2].buf), view_of(t[3].buf), t[3].buf->dtype,
                     view_of(t[4].buf));
    ra_status st = RA_OK;
    if (d.device_type == RA_DEV_CUDA) {
        const ra_dilated_call dc = {&p, &cfg};
        st = dilated ? ra_cuda_run(d.device_id, RA_CUDA_DILATED_FWD, &dc)
                     : ra_cuda_run(d.device_id, RA_CUDA_FWD, &p);
    } else {
        Py_BEGIN_ALLOW_THREADS
        st = dilated ? ra_cpu_dilated_fwd(&p, &cfg) : ra_cpu_attn_fwd(&p);
        Py_END_ALLOW_THREADS
    }
    if (st != RA_OK) {
        ra_raise(st);
        goto done;
    }
    result = PyTuple_Pack(2, (PyObject *)t[3].buf, (PyObject *)t[4].buf);
done:
    release_args(t, 7);
    return result;
}

static PyObject *mod_attn_fwd(PyObject *m, PyObject *args, PyObject *kwds) {
    (void)m;
    return fwd_common(args, kwds, 0);
}

static PyObject *mod_dilated_fwd(PyObject *m, PyObject *args, PyObject *kwds) {
    (void)m;
    return fwd_common(args, kwds, 1);
}

/* init_state(out, lse): out := 0, lse := -inf -- an empty running state
 * ("no key seen yet") for accumulate=True calls.  out (B, S, H, D) and lse
 * (B, H, S), both float32 (or both float64), on the CPU or a CUDA device. */
static PyObject *mod_init_state(PyObject *m, PyObject *args) {
    PyObject *oo, *lo;
    tensor_arg t[2];
    memset(t, 0, sizeof t);
    PyObject *result = NULL;
    (void)m;
    if (!PyArg_ParseTuple(args, "OO:init_state", &oo, &lo)) return NULL;
    if (load_output(&t[0], oo, "out", 4, BSHD) < 0) goto done;
    qkv_dims d;
    dims_of_rows(t[0].buf, t[0].buf->dtype, &d);
    if (d.dtype != RA_FLOAT32 && d.dtype != RA_FLOAT64) {
        PyErr_Format(PyExc_TypeError,
                     "out: expected a float32 or float64 running state, got %s",
                     ra_dtype_name(d.dtype));
        goto done;
    }
    if (check_writable(&t[0]) < 0) goto done;
    if (load_bhs(&t[1], lo, "lse", &d, 1) < 0) goto done;
    ra_state_params sp;
    memset(&sp, 0, sizeof sp);
    ra_buffer *o = t[0].buf, *l = t[1].buf;
    sp.out = o->data;
    sp.lse = l->data;
    sp.acc = d.dtype;
    sp.batch = d.B;
    sp.seqlen = d.Sq;
    sp.heads = d.H;
    sp.head_dim = d.D;
    sp.out_batch_stride = o->strides[0];
    sp.out_seq_stride = o->strides[1];
    sp.out_head_stride = o->strides[2];
    sp.lse_batch_stride = l->strides[0];
    sp.lse_head_stride = l->strides[1];
    sp.lse_seq_stride = l->strides[2];
    ra_status st = RA_OK;
    if (d.device_type == RA_DEV_CUDA) {
        st = ra_cuda_run(d.device_id, RA_CUDA_STATE, &sp);
    } else {
        const size_t es = ra_dtype_size(d.dtype);
        Py_BEGIN_ALLOW_THREADS
        for (int64_t b = 0; b < d.B; b++)
            for (int64_t i = 0; i < d.Sq; i++)
                for (int64_t h = 0; h < d.H; h++) {
                    char *row = (char *)sp.out +
                                (b * sp.out_batch_stride + i * sp.out_seq_stride +
                                 h * sp.out_head_stride) * (int64_t)es;
                    memset(row, 0, (size_t)d.D * es);
                    int64_t li = b * sp.lse_batch_stride +
                                 h * sp.lse_head_stride + i * sp.lse_seq_stride;
                    if (d.dtype == RA_FLOAT64)
                        ((double *)sp.lse)[li] = -INFINITY;
                    else
                        ((float *)sp.lse)[li] = -INFINITY;
                }
        Py_END_ALLOW_THREADS
    }
    if (st != RA_OK) {
        ra_raise(st);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release_args(t, 2);
    return result;
}

static PyObject *mod_simd_level(PyObject *m, PyObject *unused) {
    (void)m;
    (void)unused;
    return PyUnicode_FromString(ra_cpu_simd_level());
}

static PyObject *mod_num_threads(PyObject *m, PyObject *unused) {
    (void)m;
    (void)unused;
    return PyLong_FromLong(ra_cpu_num_threads(0));
}

/* The tensor-core family of the forward on CUDA device `device` ("sm90a"
 * or "sm80", cuda/attn_family.cu), None without a usable GPU; a bad
 * RINGATTN_CUDA_KERNELS raises. */
static PyObject *mod_cuda_kernel_family(PyObject *m, PyObject *arg) {
    (void)m;
    const long device = PyLong_AsLong(arg);
    if (device == -1 && PyErr_Occurred()) return NULL;
#ifdef RA_WITH_CUDA
    if (device >= 0 && ra_cuda_available(NULL) && device < ra_cuda_device_count()) {
        const char *name = NULL;
        const ra_status st = ra_cuda_kernel_family((int)device, &name);
        if (st != RA_OK) return ra_raise(st);
        return PyUnicode_FromString(name);
    }
#endif
    Py_RETURN_NONE;
}

/* Forward calls so far per kernel: {"sm90a", "sm80", "generic"} (tests). */
static PyObject *mod_cuda_fwd_kernel_counts(PyObject *m, PyObject *unused) {
    (void)m;
    (void)unused;
    unsigned long long n[3] = {0, 0, 0};
#ifdef RA_WITH_CUDA
    ra_cuda_fwd_kernel_counts(n);
#endif
    return Py_BuildValue("{s:K,s:K,s:K}", "sm90a", n[0], "sm80", n[1], "generic", n[2]);
}

/* Backward calls so far per kernel: {"sm90a", "sm80", "generic"} (tests). */
static PyObject *mod_cuda_bwd_kernel_counts(PyObject *m, PyObject *unused) {
    (void)m;
    (void)unused;
    unsigned long long n[3] = {0, 0, 0};
#ifdef RA_WITH_CUDA
    ra_cuda_bwd_kernel_counts(n);
#endif
    return Py_BuildValue("{s:K,s:K,s:K}", "sm90a", n[0], "sm80", n[1], "generic", n[2]);
}

static PyMethodDef attn_functions[] = {
    {"attn_fwd", (PyCFunction)(void (*)(void))mod_attn_fwd,
     METH_VARARGS | METH_KEYWORDS,
     "attn_fwd(q, k, v, *, causal=False, scale=None, out=None, lse=None, "
     "accumulate=False, q_pos_offset=None, q_pos_stride=1, k_pos_offset=0, "
     "k_pos_stride=1, num_threads=0, check_only=False, segment_ids=None, "
     "kv_segment_ids=None, window=None, softcap=None) -> (out, lse), or "
     "None after the checks alone with check_only=True.  segment_ids (B, "
     "S_q) / kv_segment_ids (B, S_k) integer document ids (kv ids default "
     "to segment_ids), window=(left, right) ints >= 0 or None, softcap a "
     "float > 0: the masks of DESIGN 2"},
    {"dilated_fwd", (PyCFunction)(void (*)(void))mod_dilated_fwd,
     METH_VARARGS | METH_KEYWORDS,
     "dilated_fwd(q, k, v, segment_lengths, dilation_rates, *, causal=False, "
     "scale=None, out=None, lse=None, accumulate=False, q_pos_offset=None, "
     "k_pos_offset=0, num_threads=0, check_only=False) -> (out, lse)"},
    {"init_state", mod_init_state, METH_VARARGS,
     "init_state(out, lse): out := 0, lse := -inf (an empty running state)"},
    {"cuda_kernel_family", mod_cuda_kernel_family, METH_O,
     "cuda_kernel_family(device) -> 'sm90a' | 'sm80' | None: the tensor-core "
     "forward kernels on that CUDA device (RINGATTN_CUDA_KERNELS=sm80 forces "
     "the mma.sync ones); None without a usable GPU"},
    {"cuda_fwd_kernel_counts", mod_cuda_fwd_kernel_counts, METH_NOARGS,
     "cuda_fwd_kernel_counts() -> {'sm90a', 'sm80', 'generic'}: forward "
     "calls so far that ran each kernel (for tests)"},
    {"cuda_bwd_kernel_counts", mod_cuda_bwd_kernel_counts, METH_NOARGS,
     "cuda_bwd_kernel_counts() -> {'sm90a', 'sm80', 'generic'}: backward "
     "calls so far that ran each kernel (for tests)"},
    {"cpu_simd_level", mod_simd_level, METH_NOARGS,
     "SIMD level the CPU kernels dispatched to"},
    {"cpu_num_threads", mod_num_threads, METH_NOARGS,
     "threads the CPU kernels use by default"},
    {NULL, NULL, 0, NULL},
};

int ra_attn_exec(PyObject *m, ra_module_state *st) {
    (void)st;
    if (PyModule_AddIntConstant(m, "MAX_BRANCHES", RA_MAX_BRANCHES) < 0)
        return -1;
    if (PyModule_AddFunctions(m, attn_functions) < 0) return -1;
    return PyModule_AddFunctions(m, ra_attn_bwd_functions);
}
