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
/* A dtype argument as NumPy takes one -- a name ("float32", "float", "f4",
 * "bfloat16"), a NumPy dtype or scalar type (np.float32, np.dtype("int64"),
 * ml_dtypes.bfloat16), or a Python type (float is float64) -- -> its DLPack
 * type: 1, or 0 with a TypeError naming `arg` and the types ringattn takes
 * (float: floats only). */
int ra_dtype_arg(PyObject *obj, const char *arg, int float_only,
                 DLDataType *out);

#ifdef __cplusplus
}
#endif
#endif
