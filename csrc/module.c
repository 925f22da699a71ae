/*
 * module.c -- ringattn._C: multi-phase module initialisation.  The one file
 * that sees every folder: core/ (Buffer, the CUDA runtime), attn/ and comm/
 * each add their types and functions through a hook declared in their own
 * header; the module's state and its GC support live in core/.
 */
#include "attn/attn_api.h"
#include "comm/comm_py.h"
#include "core/dlpack.h"
#include "core/module.h"
#include "core/ndarray.h"
#include "xla/ffi_targets.h"

static int ra_module_exec(PyObject *m) {
    ra_module_state *st = (ra_module_state *)PyModule_GetState(m);
    if (ra_state_get() != NULL) {
        PyErr_SetString(PyExc_ImportError,
                        "ringattn._C can be loaded only once per process");
        return -1;
    }
    if (ra_ndarray_init() < 0) return -1;

    st->CommError = PyErr_NewExceptionWithDoc(
        "ringattn.CommError",
        "A communication failure: a dead, stuck or mismatched peer, a "
        "deadline passed, or a transport/NCCL error.  The message names the "
        "rank, the peer, the operation and the ring step.",
        PyExc_RuntimeError, NULL);
    if (st->CommError == NULL) return -1;
    if (PyModule_AddObjectRef(m, "CommError", st->CommError) < 0) return -1;
    ra_state_set(st);

    if (ra_buffer_exec(m, st) < 0) goto fail;
    if (ra_attn_exec(m, st) < 0) goto fail;
    if (ra_comm_exec(m, st) < 0) goto fail;
    if (ra_cuda_exec(m, st) < 0) goto fail;
    if (ra_xla_exec(m, st) < 0) goto fail;
    if (PyModule_AddIntConstant(m, "DLPACK_MAJOR", RA_DLPACK_MAJOR) < 0)
        goto fail;
    return 0;
fail:
    ra_state_set(NULL);
    return -1;
}

static int ra_module_traverse(PyObject *m, visitproc visit, void *arg) {
    return ra_state_traverse((ra_module_state *)PyModule_GetState(m), visit,
                             arg);
}

static int ra_module_clear(PyObject *m) {
    ra_state_clear((ra_module_state *)PyModule_GetState(m));
    return 0;
}

static void ra_module_free(void *m) {
    ra_module_clear((PyObject *)m);
    if (ra_state_get() == PyModule_GetState((PyObject *)m)) ra_state_set(NULL);
}

static PyModuleDef_Slot ra_module_slots[] = {
    {Py_mod_exec, ra_module_exec},
    {0, NULL},
};

static struct PyModuleDef ra_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ringattn._C",
    .m_doc = "ringattn C core: buffers with DLPack, attention kernels, "
             "communicators.",
    .m_size = sizeof(ra_module_state),
    .m_slots = ra_module_slots,
    .m_traverse = ra_module_traverse,
    .m_clear = ra_module_clear,
    .m_free = ra_module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&ra_module_def); }
