/*
 * module.h -- the ringattn._C extension module as core/ sees it: the
 * per-module state, the one mapping of a status to a Python exception, and
 * the hooks by which core/ adds its types and functions.  csrc/module.c
 * creates the module and calls every folder's hook (attn/attn_api.h and
 * comm/comm_py.h declare theirs).
 *
 * The module uses multi-phase init; types are heap types made from
 * PyType_Spec with PyType_FromModuleAndSpec.  A process holds one instance
 * (importing it in a second interpreter is refused), so C code that has no
 * module at hand reaches the types and exceptions through ra_state_get().
 */
#ifndef RA_MODULE_H
#define RA_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "core/ra_common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ra_module_state {
    PyTypeObject *BufferType;
    PyTypeObject *CommType;
    PyTypeObject *RequestType;
    PyObject *CommError;        /* ringattn.CommError(RuntimeError) */
} ra_module_state;

/* The state of the one live module instance (NULL before exec), set by
 * the module's exec and cleared when it fails or the module is freed
 * (module_state.c, with the state's GC support). */
ra_module_state *ra_state_get(void);
void ra_state_set(ra_module_state *st);
int ra_state_traverse(ra_module_state *st, visitproc visit, void *arg);
void ra_state_clear(ra_module_state *st);

/* Turn (status, ra_last_error()) into a Python exception; returns NULL so
 * callers can `return ra_raise(st);`.  The one place that maps library
 * status codes to exceptions (errors.c). */
PyObject *ra_raise(ra_status st);
/* Same, with an explicit message. */
PyObject *ra_raise_msg(ra_status st, const char *msg);

/* core/'s hooks: Buffer and its functions (buffer.c), the CUDA queries
 * (cuda_rt.c; cuda_rt.h itself stays free of Python for nvcc). */
int ra_buffer_exec(PyObject *m, ra_module_state *st);
int ra_cuda_exec(PyObject *m, ra_module_state *st);
int ra_cuda_emu_exec(PyObject *m);       /* cuda_emu.c, called by ra_cuda_exec */
int ra_cuda_lifetime_exec(PyObject *m);  /* cuda_lifetime.c, likewise */

#ifdef __cplusplus
}
#endif
#endif /* RA_MODULE_H */
