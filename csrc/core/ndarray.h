/*
 * ndarray.h -- the NumPy side of Buffer: wrap an ndarray without copying
 * (ml_dtypes bfloat16 included, which NumPy cannot export through DLPack)
 * and view a Buffer as an ndarray.  The only file using the NumPy C API.
 */
#ifndef RA_NDARRAY_H
#define RA_NDARRAY_H

#include "core/buffer.h"

#ifdef __cplusplus
extern "C" {
#endif

int ra_ndarray_init(void);                 /* import NumPy's C API */
int ra_is_ndarray(PyObject *obj);
/* ndarray -> Buffer (zero copy; keeps the array alive). */
ra_buffer *ra_buffer_from_ndarray(PyObject *arr, const char *name);
/* Buffer -> ndarray viewing the same memory (base = the Buffer). */
PyObject *ra_buffer_to_ndarray(ra_buffer *buf);

#ifdef __cplusplus
}
#endif
#endif
