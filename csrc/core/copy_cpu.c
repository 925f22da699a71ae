/*
 * copy_cpu.c -- strided n-d copy with float dtype conversion on the host
 * (or of elements of one other type, unchanged),
 * and the scalar float16/bfloat16 converters (round to nearest even, NaN and
 * infinities preserved).
 *
 * The last dimension is the inner loop; every other index is decoded from a
 * flat row number so rows spread over OpenMP threads.
 */
#include "core/copy.h"
#include "core/half.h"

#include <math.h>
#include <string.h>

float ra_half_to_float(uint16_t h) { return ra_cpu_h2f(h); }
uint16_t ra_float_to_half(float f) { return ra_cpu_f2h(f); }
float ra_bf16_to_float(uint16_t h) { return ra_cpu_b2f(h); }
uint16_t ra_float_to_bf16(float f) { return ra_cpu_f2b(f); }

static inline double load_elem(const char *p, ra_dtype t) {
    switch (t) {
    case RA_FLOAT32: { float v; memcpy(&v, p, 4); return v; }
    case RA_FLOAT64: { double v; memcpy(&v, p, 8); return v; }
    case RA_FLOAT16: { uint16_t v; memcpy(&v, p, 2); return ra_half_to_float(v); }
    case RA_BFLOAT16: { uint16_t v; memcpy(&v, p, 2); return ra_bf16_to_float(v); }
    default: return 0.0;
    }
}

static inline void store_elem(char *p, ra_dtype t, double x) {
    switch (t) {
    case RA_FLOAT32: { float v = (float)x; memcpy(p, &v, 4); break; }
    case RA_FLOAT64: memcpy(p, &x, 8); break;
    case RA_FLOAT16: { uint16_t v = ra_cpu_d2h(x); memcpy(p, &v, 2); break; }
    case RA_BFLOAT16: { uint16_t v = ra_cpu_d2b(x); memcpy(p, &v, 2); break; }
    default: break;
    }
}

/* dst += src along one row (float dtypes): float32 arithmetic unless a
 * side is float64. */
static void add_row(char *dst, int64_t ds, ra_dtype dt, const char *src,
                    int64_t ss, ra_dtype st, int64_t n) {
    size_t dsz = ra_dtype_size(dt), ssz = ra_dtype_size(st);
    if (dt == RA_FLOAT32 && st == RA_FLOAT32) {
        for (int64_t i = 0; i < n; i++)
            ((float *)dst)[i * ds] += ((const float *)src)[i * ss];
        return;
    }
    const int wide = dt == RA_FLOAT64 || st == RA_FLOAT64;
    for (int64_t i = 0; i < n; i++) {
        char *d = dst + i * ds * (int64_t)dsz;
        double v = load_elem(d, dt) + load_elem(src + i * ss * (int64_t)ssz, st);
        store_elem(d, dt, wide ? v : (double)(float)v);
    }
}

/* One row along the last dimension; elsize: the bytes of an element of
 * dtype RA_DTYPE_OTHER (then dt == st). */
static void copy_row(char *dst, int64_t ds, ra_dtype dt, const char *src,
                     int64_t ss, ra_dtype st, int64_t n, size_t elsize) {
    size_t dsz = ra_dtype_size(dt), ssz = ra_dtype_size(st);
    if (dt == RA_DTYPE_OTHER) dsz = ssz = elsize;
    if (dt == st && ds == 1 && ss == 1) {
        memcpy(dst, src, (size_t)n * dsz);
        return;
    }
    if (dt == RA_DTYPE_OTHER) {
        for (int64_t i = 0; i < n; i++)
            memcpy(dst + i * ds * (int64_t)dsz, src + i * ss * (int64_t)ssz,
                   dsz);
        return;
    }
    if (dt == RA_FLOAT32 && st == RA_FLOAT32) {
        for (int64_t i = 0; i < n; i++)
            ((float *)dst)[i * ds] = ((const float *)src)[i * ss];
        return;
    }
    if (st == RA_FLOAT64 && dt == RA_FLOAT64) {
        for (int64_t i = 0; i < n; i++)
            ((double *)dst)[i * ds] = ((const double *)src)[i * ss];
        return;
    }
    if (st != RA_FLOAT64 && dt != RA_FLOAT64) {
        /* float32 arithmetic is exact for every conversion among 32/16 bit */
        for (int64_t i = 0; i < n; i++) {
            float v = (float)load_elem(src + i * ss * (int64_t)ssz, st);
            store_elem(dst + i * ds * (int64_t)dsz, dt, v);
        }
        return;
    }
    for (int64_t i = 0; i < n; i++)
        store_elem(dst + i * ds * (int64_t)dsz, dt,
                   load_elem(src + i * ss * (int64_t)ssz, st));
}

ra_status ra_cpu_copy(const ra_copy_params *p) {
    if (p->ndim < 0 || p->ndim > RA_COPY_MAX_NDIM) {
        ra_set_error(RA_ERR_INTERNAL, "copy: bad ndim %d", p->ndim);
        return RA_ERR_INTERNAL;
    }
    const int raw = p->src_dtype == RA_DTYPE_OTHER &&
                    p->dst_dtype == RA_DTYPE_OTHER && p->other_elsize > 0;
    if ((!raw || p->accumulate) &&
        (ra_dtype_size(p->src_dtype) == 0 || ra_dtype_size(p->dst_dtype) == 0)) {
        ra_set_error(RA_ERR_TYPE, "copy: expected float dtypes");
        return RA_ERR_TYPE;
    }
    if (p->ndim == 0) {
        if (p->accumulate)
            add_row((char *)p->dst, 1, p->dst_dtype, (const char *)p->src, 1,
                    p->src_dtype, 1);
        else
            copy_row((char *)p->dst, 1, p->dst_dtype, (const char *)p->src, 1,
                     p->src_dtype, 1, p->other_elsize);
        return RA_OK;
    }
    int64_t rows = 1;
    for (int i = 0; i < p->ndim - 1; i++) rows *= p->shape[i];
    int64_t n = p->shape[p->ndim - 1];
    if (rows == 0 || n == 0) return RA_OK;
    const int last = p->ndim - 1;
    const size_t ssz = raw ? p->other_elsize : ra_dtype_size(p->src_dtype);
    const size_t dsz = raw ? p->other_elsize : ra_dtype_size(p->dst_dtype);
    int nthreads = ra_cpu_threads_for(p->num_threads, 4.0 * (double)(rows * n));
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        int64_t rem = r, soff = 0, doff = 0;
        for (int i = last - 1; i >= 0; i--) {
            int64_t idx = rem % p->shape[i];
            rem /= p->shape[i];
            soff += idx * p->src_strides[i];
            doff += idx * p->dst_strides[i];
        }
        char *drow = (char *)p->dst + doff * (int64_t)dsz;
        const char *srow = (const char *)p->src + soff * (int64_t)ssz;
        if (p->accumulate)
            add_row(drow, p->dst_strides[last], p->dst_dtype, srow,
                    p->src_strides[last], p->src_dtype, n);
        else
            copy_row(drow, p->dst_strides[last], p->dst_dtype, srow,
                     p->src_strides[last], p->src_dtype, n, p->other_elsize);
    }
    return RA_OK;
}
