/*
 * errors.c -- the one place where a library status becomes a Python
 * exception.  C code below the Python boundary returns an ra_status and
 * leaves a message with ra_set_error(); the boundary calls ra_raise().
 */
#include "core/module.h"

#include <string.h>

PyObject *ra_raise_msg(ra_status st, const char *msg) {
    PyObject *exc;
    ra_module_state *state = ra_state_get();
    switch (st) {
    case RA_OK:
        PyErr_SetString(PyExc_SystemError, "ringattn: error raised with RA_OK");
        return NULL;
    case RA_ERR_NOMEM: exc = PyExc_MemoryError; break;
    case RA_ERR_VALUE: exc = PyExc_ValueError; break;
    case RA_ERR_TYPE: exc = PyExc_TypeError; break;
    case RA_ERR_BUFFER: exc = PyExc_BufferError; break;
    case RA_ERR_OVERFLOW: exc = PyExc_ValueError; break;
    case RA_ERR_SYSTEM: exc = PyExc_OSError; break;
    case RA_ERR_UNSUPPORTED: exc = PyExc_NotImplementedError; break;
    case RA_ERR_NCCL:
    case RA_ERR_COMM:
    case RA_ERR_TIMEOUT:
        exc = (state != NULL && state->CommError != NULL) ? state->CommError
                                                          : PyExc_RuntimeError;
        break;
    case RA_ERR_CUDA:
    case RA_ERR_INTERNAL:
    default: exc = PyExc_RuntimeError; break;
    }
    if (msg == NULL || msg[0] == '\0') msg = "ringattn: unknown error";
    /* a message may carry a peer's bytes (an abort reason): decoded with
     * replacement, never a UnicodeDecodeError instead of the error */
    PyObject *text =
        PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "replace");
    if (text == NULL) return NULL;
    PyErr_SetObject(exc, text);
    Py_DECREF(text);
    return NULL;
}

PyObject *ra_raise(ra_status st) { return ra_raise_msg(st, ra_last_error()); }
