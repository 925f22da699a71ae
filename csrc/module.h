/*
 * module.h -- the ringattn._C extension module: its per-module state and the
 * hooks each concept file (buffer, attn_api, comm, ...) provides to it.
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
#include "ra_common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ra_module_state {
    PyTypeObject *BufferType;
    PyTypeObject *CommType;
    PyTypeObject *RequestType;
    PyObject *CommError;        /* ringattn.CommError(RuntimeError) */
} ra_module_state;

/* The state of the one live module instance (NULL before exec). */
ra_module_state *ra_state_get(void);

/* Turn (status, ra_last_error()) into a Python exception; returns NULL so
 * callers can `return ra_raise(st);`.  The one place that maps library
 * status codes to exceptions (csrc/errors.c). */
PyObject *ra_raise(ra_status st);
/* Same, with an explicit message. */
PyObject *ra_raise_msg(ra_status st, const char *msg);

/* Hooks: each concept file adds its types/functions to the module. */
int ra_buffer_exec(PyObject *m, ra_module_state *st);   /* buffer.c   */
int ra_attn_exec(PyObject *m, ra_module_state *st);     /* attn_api.c */
int ra_comm_exec(PyObject *m, ra_module_state *st);     /* comm.c     */
int ra_cuda_exec(PyObject *m, ra_module_state *st);     /* cuda_rt.c  */

#ifdef __cplusplus
}
#endif
#endif /* RA_MODULE_H */
