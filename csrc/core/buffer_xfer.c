/*
 * buffer_xfer.c -- Buffer copies between the host and a CUDA device.
 *
 * One cudaMemcpy moves contiguous bytes of one dtype; everything else
 * (strides, dtype conversion) is done by the same-device copies on either
 * side, through a contiguous staging buffer where needed:
 *
 *   src --(same-device copy, if src is strided or of another dtype)--> a
 *   a   --(cudaMemcpy on the compute stream, synchronised)-------------> b
 *   b   --(same-device copy, if dst is strided)------------------------> dst
 *
 * The copy is ordered after work on ringattn's compute stream (and, through
 * DLPack import, after the producer's stream) and finished on return.
 * Host memory is any CPU buffer (whatever its device index: JAX numbers its
 * host devices) or CUDA pinned host memory.
 */
#include "core/buffer.h"
#include "core/cuda_rt.h"

#include <string.h>

int ra_buffer_on_host(const ra_buffer *b) {
    return b->device_type == RA_DEV_CPU || b->device_type == RA_DEV_CUDA_HOST;
}

ra_status ra_buffer_copy_across(ra_buffer *dst, ra_buffer *src, int raw) {
    const int to_device = dst->device_type == RA_DEV_CUDA;
    if (!(to_device ? ra_buffer_on_host(src)
                    : (src->device_type == RA_DEV_CUDA &&
                       ra_buffer_on_host(dst)))) {
        ra_set_error(RA_ERR_VALUE,
                     "copy: source and destination live on different devices "
                     "(%s:%d and %s:%d); ringattn copies within one device "
                     "and between the host and one CUDA device",
                     ra_device_name(src->device_type), src->device_id,
                     ra_device_name(dst->device_type), dst->device_id);
        return RA_ERR_VALUE;
    }
    if (!ra_cuda_built()) {
        ra_set_error(RA_ERR_UNSUPPORTED,
                     "copy: a CUDA buffer, but ringattn was built without "
                     "CUDA");
        return RA_ERR_UNSUPPORTED;
    }
    const int device = to_device ? dst->device_id : src->device_id;
    /* non-float elements have no strided CUDA copy to stage through */
    if (raw) RA_CHECK(ra_buffer_raw_contiguous(dst, src, "host<->device"));
    const size_t nbytes =
        (size_t)ra_buffer_numel(dst) * ra_buffer_elsize(dst);
    if (nbytes == 0) return RA_OK;

    ra_status st = RA_OK;
    ra_buffer *a = src, *b = dst;
    const int src_ready = ra_buffer_is_contiguous(src) &&
                          (raw || src->dtype == dst->dtype);
    if (!src_ready) {
        a = ra_buffer_staging(src, dst->dl_dtype, src->device_type,
                              src->device_id, "host<->device copy");
        if (a == NULL) return RA_ERR_NOMEM;
        st = ra_buffer_copy_into(a, src);
        if (st != RA_OK) goto done;
    }
    if (!ra_buffer_is_contiguous(dst)) {
        b = ra_buffer_staging(dst, dst->dl_dtype, dst->device_type,
                              dst->device_id, "host<->device copy");
        if (b == NULL) {
            st = RA_ERR_NOMEM;
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    st = ra_cuda_memcpy(device, b->data, to_device, a->data, !to_device,
                        nbytes, 1);
    Py_END_ALLOW_THREADS
    if (st == RA_OK && b != dst) {
        st = ra_buffer_copy_into(dst, b);
        /* finished on return in every direction: dst may belong to a
         * framework whose stream knows nothing of ringattn's */
        if (st == RA_OK && to_device) {
            Py_BEGIN_ALLOW_THREADS
            st = ra_cuda_synchronize(device);
            Py_END_ALLOW_THREADS
        }
    }
done:
    if (a != src) Py_DECREF(a);
    if (b != dst) Py_XDECREF(b);
    return st;
}
