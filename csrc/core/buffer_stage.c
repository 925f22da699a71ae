/*
 * buffer_stage.c -- contiguous staging buffers for Buffer copies, and the
 * copy between two views of one memory whose bytes overlap.
 *
 * A copy between overlapping views (`y[1:]` from `y[:-1]`) reads elements
 * that it has already written if it goes element by element or row by row;
 * NumPy's np.copyto answers as if the source went through a temporary, and
 * so does ringattn: the source is copied into a fresh contiguous buffer of
 * its own dtype on its own device first, then that buffer into the
 * destination.
 */
#include "core/buffer.h"

#include <stdint.h>

ra_buffer *ra_buffer_staging(const ra_buffer *like, DLDataType dl,
                             int device_type, int device_id,
                             const char *what) {
    ra_buffer *t = ra_buffer_empty_dl(like->ndim, like->shape, dl,
                                      device_type, device_id, 0);
    if (t == NULL) {
        /* keep what the allocation said (a CUDA error, say) */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *text = value != NULL ? PyObject_Str(value) : NULL;
        const char *msg = text != NULL ? PyUnicode_AsUTF8(text) : NULL;
        if (msg == NULL) PyErr_Clear();
        ra_set_error(RA_ERR_NOMEM,
                     "copy: a %s staging buffer of the %s could not be "
                     "allocated: %s",
                     device_type == RA_DEV_CUDA ? "device" : "host", what,
                     msg != NULL ? msg : "out of memory");
        Py_XDECREF(text);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    }
    return t;
}

/* [lo, hi): the addresses of the bytes a buffer with at least one element
 * touches.  A Buffer's extent fits in the address space (its memory
 * exists), so the sums do not overflow. */
static void byte_extent(const ra_buffer *b, uintptr_t *lo, uintptr_t *hi) {
    const int64_t elsize = (int64_t)ra_buffer_elsize(b);
    int64_t below = 0, above = 0;
    for (int i = 0; i < b->ndim; i++) {
        const int64_t reach = (b->shape[i] - 1) * b->strides[i] * elsize;
        if (reach < 0)
            below += reach;
        else
            above += reach;
    }
    *lo = (uintptr_t)b->data - (uintptr_t)(-below);
    *hi = (uintptr_t)b->data + (uintptr_t)above + (uintptr_t)elsize;
}

int ra_buffer_overlaps(const ra_buffer *a, const ra_buffer *b) {
    if (ra_buffer_numel(a) == 0 || ra_buffer_numel(b) == 0) return 0;
    uintptr_t alo, ahi, blo, bhi;
    byte_extent(a, &alo, &ahi);
    byte_extent(b, &blo, &bhi);
    return alo < bhi && blo < ahi;
}

ra_status ra_buffer_copy_overlapping(ra_buffer *dst, ra_buffer *src) {
    ra_buffer *tmp = ra_buffer_staging(src, src->dl_dtype, src->device_type,
                                       src->device_id, "overlapping copy");
    if (tmp == NULL) return RA_ERR_NOMEM;
    /* neither step overlaps: tmp is fresh memory */
    ra_status st = ra_buffer_copy_into(tmp, src);
    if (st == RA_OK) st = ra_buffer_copy_into(dst, tmp);
    Py_DECREF(tmp);
    return st;
}
