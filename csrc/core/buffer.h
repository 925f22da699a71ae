/*
 * buffer.h -- ringattn.Buffer: an n-d strided view of host or device memory
 * that ringattn either owns (an ra_block) or borrows from another producer
 * (kept alive through `owner`).  Speaks DLPack both ways.
 *
 * Invariants: `data` points at element [0, ..., 0] (any DLPack byte_offset is
 * already applied); strides are in elements; shape/strides have `ndim`
 * entries; a Buffer never changes shape, dtype or data pointer after
 * creation, so it is safe to read without the GIL.
 */
#ifndef RA_BUFFER_H
#define RA_BUFFER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "core/ra_common.h"
#include "core/dlpack.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RA_MAX_NDIM 8

/* A block of memory ringattn allocated.  Reference counted (atomically, no
 * GIL needed) because views and exported DLPack tensors share it. */
typedef struct ra_block {
    void *ptr;
    size_t nbytes;
    int device_type;   /* ra_device_type */
    int device_id;
    int refcount;      /* atomic */
} ra_block;

ra_block *ra_block_alloc(int device_type, int device_id, size_t nbytes,
                         int zero);        /* NULL + ra_set_error on failure */
void ra_block_incref(ra_block *b);
void ra_block_decref(ra_block *b);       /* frees on the last reference */

typedef struct ra_buffer {
    PyObject_HEAD
    void *data;
    int device_type;            /* ra_device_type / DLDeviceType */
    int device_id;
    DLDataType dl_dtype;        /* exact DLPack type */
    ra_dtype dtype;             /* RA_DTYPE_OTHER if not a float type we compute with */
    int ndim;
    int readonly;
    int64_t shape[RA_MAX_NDIM];
    int64_t strides[RA_MAX_NDIM];
    ra_block *block;            /* owned memory, or NULL */
    PyObject *owner;            /* borrowed memory's keeper, or NULL */
    PyObject *weakreflist;
} ra_buffer;

/* The Buffer type object (set up by module exec; one per process). */
extern PyTypeObject *ra_BufferType;
#define ra_Buffer_Check(op) PyObject_TypeCheck((op), ra_BufferType)

/* New contiguous (row-major) buffer owned by ringattn.  zero: fill with 0. */
ra_buffer *ra_buffer_empty(int ndim, const int64_t *shape, ra_dtype dtype,
                           int device_type, int device_id, int zero);
/* The same for any DLPack element type (integer ids, say): the Buffer's
 * dtype is RA_DTYPE_OTHER unless dl is one of the float types. */
ra_buffer *ra_buffer_empty_dl(int ndim, const int64_t *shape, DLDataType dl,
                              int device_type, int device_id, int zero);
/* An empty Buffer object (no memory, ndim 0) for constructors to fill. */
ra_buffer *ra_buffer_new_raw(void);
/* New view over `base` (shares its memory and keeper). */
ra_buffer *ra_buffer_view(ra_buffer *base, void *data, int ndim,
                          const int64_t *shape, const int64_t *strides);

/* Any array-like -> Buffer without copying: a Buffer itself, a NumPy array
 * (incl. ml_dtypes bfloat16), or any object with __dlpack__.  `name` is the
 * argument name used in error messages.  New reference or NULL with a
 * Python exception set.  stream: consumer stream passed to __dlpack__ for
 * CUDA producers (-1 = none). */
ra_buffer *ra_buffer_from_object(PyObject *obj, const char *name,
                                 intptr_t stream);

/* dst[...] = src[...] converted to dst's dtype: same shape, float dtypes
 * (or one integer dtype on both sides, copied as it is; on or to a CUDA
 * device only between contiguous buffers), dst writable.  Same device: on
 * that device (the GIL released around the host copy).  Host <-> one CUDA
 * device: ra_buffer_copy_across.  Overlapping dst and src give the
 * answer of a copy through a temporary.  RA_OK, or a status with ra_set_error's
 * message.  Holds the GIL (staging buffers are Buffer objects). */
ra_status ra_buffer_copy_into(ra_buffer *dst, ra_buffer *src);
/* The same with accumulate: dst += src (float dtypes, one device). */
ra_status ra_buffer_copy_mode(ra_buffer *dst, ra_buffer *src, int accumulate);
/* The host <-> CUDA part of ra_buffer_copy_into (buffer_xfer.c): one
 * synchronised cudaMemcpy of contiguous bytes on the compute stream, with
 * same-device copies into or out of contiguous staging buffers where a
 * side is strided or the dtypes differ; a strided CUDA destination is
 * written by a copy on the compute stream, then synchronised: the copy is
 * finished on return in both directions.  raw: the elements are
 * one non-float dtype on both sides.  Any other pair of devices (two CUDA
 * devices) is a ValueError. */
ra_status ra_buffer_copy_across(ra_buffer *dst, ra_buffer *src, int raw);
/* A contiguous buffer shaped like `like`, of element type `dl`, on the
 * given device; NULL with ra_set_error's message naming `what` copy needed
 * it (never a Python error).  buffer_stage.c */
ra_buffer *ra_buffer_staging(const ra_buffer *like, DLDataType dl,
                             int device_type, int device_id,
                             const char *what);
/* 1 when a and b (in one memory) touch a common byte.  buffer_stage.c */
int ra_buffer_overlaps(const ra_buffer *a, const ra_buffer *b);
/* ra_buffer_copy_into for overlapping dst and src: as if through a
 * temporary (np.copyto's answer), by way of a staging copy of src. */
ra_status ra_buffer_copy_overlapping(ra_buffer *dst, ra_buffer *src);
/* 1 for host memory: a CPU buffer (any device index) or CUDA pinned host
 * memory (buffer_xfer.c). */
int ra_buffer_on_host(const ra_buffer *b);
/* RA_OK when a raw (non-float) copy between dst and src can move the
 * elements as one contiguous run; else RA_ERR_UNSUPPORTED naming `kind`
 * of copy ("CUDA", "host<->device"), which has no strided path. */
ra_status ra_buffer_raw_contiguous(const ra_buffer *dst, const ra_buffer *src,
                                   const char *kind);
/* The name of a DLPack device type as Buffer.device gives it: "cpu",
 * "cuda", "cuda_host", "cuda_managed", else "other". */
const char *ra_device_name(int device_type);

/* DLPack, both ways (dlpack.c): Buffer.__dlpack__(*, stream=None,
 * max_version=None, dl_device=None, copy=None), Buffer.__dlpack_device__(),
 * and the import of any object with __dlpack__ (as ra_buffer_from_object). */
PyObject *ra_buffer_dlpack(PyObject *self, PyObject *args, PyObject *kwds);
PyObject *ra_buffer_dlpack_device(PyObject *self, PyObject *unused);
ra_buffer *ra_buffer_from_dlpack(PyObject *obj, const char *name,
                                 intptr_t stream);

/* The module functions around Buffer: empty, zeros, from_dlpack,
 * memory_stats, reset_peak_memory_stats (buffer_api.c). */
extern PyMethodDef ra_buffer_functions[];

int64_t ra_buffer_numel(const ra_buffer *b);
ra_dtype ra_dtype_from_dl(DLDataType t);
int ra_dtype_from_name(const char *name, ra_dtype *out);  /* 1 if known */
/* the float names above and int8..int64, uint8..uint64; 1 if known */
int ra_dl_dtype_from_name(const char *name, DLDataType *out);
void ra_dl_dtype_name(DLDataType t, char *buf, size_t n);
int ra_buffer_is_contiguous(const ra_buffer *b);
size_t ra_buffer_elsize(const ra_buffer *b);

#ifdef __cplusplus
}
#endif
#endif /* RA_BUFFER_H */
