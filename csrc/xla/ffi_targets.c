/*
 * ffi_targets.c -- ringattn's XLA FFI targets: the C handlers XLA calls,
 * one per target and platform, and ringattn._C.ffi_targets(), which hands
 * them to Python as PyCapsules for jax.ffi.register_ffi_target
 * (ringattn/jax_ffi.py registers them when ringattn.jax is imported).
 *
 * This folder (csrc/xla/) holds ringattn's side of XLA's FFI C ABI: our
 * own definitions of that ABI (xla_ffi.h), reading call frames, and the
 * handlers.  It may use the kernel params and the CPU kernels and CUDA
 * launchers (attn_params.h, attn_cpu.h, attn_cuda.h), and the Python C
 * API in this file only; it never includes jaxlib's headers, so building
 * ringattn never needs JAX.
 */
#include "xla/ffi_targets.h"

#include "xla/ffi_handlers.h"

/* One plain C handler per (target, platform): answer XLA's metadata query,
 * else set the call up, run the body and turn its status into an error. */
#define RA_XLA_HANDLER(fn, body, target, device, nargs_min, nargs_max, nrets) \
    static ra_ffi_error *fn(ra_ffi_call_frame *frame) {                      \
        if (ra_xla_metadata_query(frame)) return NULL;                       \
        ra_xla_call c;                                                       \
        ra_status st = ra_xla_begin(&c, frame, target, device, nargs_min,    \
                                    nargs_max, nrets);                       \
        if (st == RA_OK) st = body(&c);                                      \
        return ra_xla_finish(&c, st);                                        \
    }

#ifdef RA_WITH_CUDA
#define RA_XLA_TARGET(name, body, nargs_min, nargs_max, nrets)               \
    RA_XLA_HANDLER(name##_cpu, body, "ringattn_" #name, RA_DEV_CPU,          \
                   nargs_min, nargs_max, nrets)                              \
    RA_XLA_HANDLER(name##_cuda, body, "ringattn_" #name, RA_DEV_CUDA,        \
                   nargs_min, nargs_max, nrets)
#define RA_CUDA_HANDLER(name) name##_cuda
#else
#define RA_XLA_TARGET(name, body, nargs_min, nargs_max, nrets)               \
    RA_XLA_HANDLER(name##_cpu, body, "ringattn_" #name, RA_DEV_CPU,          \
                   nargs_min, nargs_max, nrets)
#define RA_CUDA_HANDLER(name) NULL
#endif

/* attention: base operands, then positions and two segment id operands,
 * each optional (ffi_args.h) */
RA_XLA_TARGET(attn_fwd, ra_xla_attn_fwd, 3, 6, 2)
RA_XLA_TARGET(attn_fwd_acc, ra_xla_attn_fwd_acc, 5, 8, 2)
RA_XLA_TARGET(attn_bwd_pre, ra_xla_bwd_preprocess, 2, 2, 1)
RA_XLA_TARGET(attn_bwd, ra_xla_attn_bwd, 6, 9, 3)
RA_XLA_TARGET(attn_bwd_acc, ra_xla_attn_bwd_acc, 9, 12, 3)
RA_XLA_TARGET(merge, ra_xla_merge, 4, 4, 2)
RA_XLA_TARGET(ids_check, ra_xla_ids_check, 2, 2, 1)
RA_XLA_HANDLER(dilated_fwd_cpu, ra_xla_dilated_fwd, "ringattn_dilated_fwd",
               RA_DEV_CPU, 3, 3, 2)
RA_XLA_HANDLER(dilated_bwd_cpu, ra_xla_dilated_bwd, "ringattn_dilated_bwd",
               RA_DEV_CPU, 6, 6, 3)

typedef struct {
    const char *name;
    ra_ffi_handler *cpu, *cuda;  /* cuda NULL: CPU only */
} target;

static const target targets[] = {
    {"ringattn_attn_fwd", attn_fwd_cpu, RA_CUDA_HANDLER(attn_fwd)},
    {"ringattn_attn_fwd_acc", attn_fwd_acc_cpu, RA_CUDA_HANDLER(attn_fwd_acc)},
    {"ringattn_attn_bwd_pre", attn_bwd_pre_cpu, RA_CUDA_HANDLER(attn_bwd_pre)},
    {"ringattn_attn_bwd", attn_bwd_cpu, RA_CUDA_HANDLER(attn_bwd)},
    {"ringattn_attn_bwd_acc", attn_bwd_acc_cpu, RA_CUDA_HANDLER(attn_bwd_acc)},
    {"ringattn_merge", merge_cpu, RA_CUDA_HANDLER(merge)},
    {"ringattn_ids_check", ids_check_cpu, RA_CUDA_HANDLER(ids_check)},
    {"ringattn_dilated_fwd", dilated_fwd_cpu, NULL},
    {"ringattn_dilated_bwd", dilated_bwd_cpu, NULL},
};

static int add_capsule(PyObject *dict, const char *name, ra_ffi_handler *fn) {
    PyObject *cap = PyCapsule_New((void *)fn, NULL, NULL);
    if (cap == NULL) return -1;
    int rc = PyDict_SetItemString(dict, name, cap);
    Py_DECREF(cap);
    return rc;
}

/* {"cpu": {name: capsule}, "CUDA": {...}}; CUDA only in a CUDA build. */
static PyObject *mod_ffi_targets(PyObject *m, PyObject *unused) {
    (void)m;
    (void)unused;
    PyObject *result = PyDict_New(), *cpu = PyDict_New(), *cuda = PyDict_New();
    if (result == NULL || cpu == NULL || cuda == NULL) goto fail;
    for (size_t i = 0; i < sizeof targets / sizeof targets[0]; i++) {
        if (add_capsule(cpu, targets[i].name, targets[i].cpu) < 0) goto fail;
        if (targets[i].cuda != NULL &&
            add_capsule(cuda, targets[i].name, targets[i].cuda) < 0)
            goto fail;
    }
    if (PyDict_SetItemString(result, "cpu", cpu) < 0) goto fail;
    if (PyDict_Size(cuda) > 0 && PyDict_SetItemString(result, "CUDA", cuda) < 0)
        goto fail;
    Py_DECREF(cpu);
    Py_DECREF(cuda);
    return result;
fail:
    Py_XDECREF(result);
    Py_XDECREF(cpu);
    Py_XDECREF(cuda);
    return NULL;
}

static PyMethodDef xla_functions[] = {
    {"ffi_targets", mod_ffi_targets, METH_NOARGS,
     "ffi_targets() -> {platform: {target name: PyCapsule}}: ringattn's XLA "
     "FFI handlers (API version 1), for jax.ffi.register_ffi_target"},
    {NULL, NULL, 0, NULL},
};

int ra_xla_exec(PyObject *m, ra_module_state *st) {
    (void)st;
    return PyModule_AddFunctions(m, xla_functions);
}
