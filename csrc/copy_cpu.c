/*
 * copy_cpu.c -- strided n-d copy with float dtype conversion on the host,
 * and the scalar float16/bfloat16 converters (round to nearest even, NaN and
 * infinities preserved).
 *
 * The last dimension is the inner loop; every other index is decoded from a
 * flat row number so rows spread over OpenMP threads.
 */
#include "copy.h"

#include <math.h>
#include <string.h>

float ra_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while ((man & 0x400u) == 0);
            man &= 0x3ffu;
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | (man << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

uint16_t ra_float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) /* inf or nan */
        return (uint16_t)(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0));
    if (absx >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (absx < 0x38800000u) { /* below the smallest normal half: subnormal */
        if (absx < 0x33000000u) return (uint16_t)sign; /* < half of min sub */
        uint32_t e = absx >> 23;
        uint32_t m = (absx & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e; /* 14..24 */
        uint32_t r = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = absx - 0x38000000u; /* rebias exponent 127 -> 15 */
    uint32_t rem = r & 0x1fffu;
    r >>= 13;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    return (uint16_t)(sign | r);
}

float ra_bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

uint16_t ra_float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) /* nan: keep it quiet */
        return (uint16_t)((x >> 16) | 0x40u);
    uint32_t lsb = (x >> 16) & 1u;
    x += 0x7fffu + lsb;
    return (uint16_t)(x >> 16);
}

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
    case RA_FLOAT16: { uint16_t v = ra_float_to_half((float)x); memcpy(p, &v, 2); break; }
    case RA_BFLOAT16: { uint16_t v = ra_float_to_bf16((float)x); memcpy(p, &v, 2); break; }
    default: break;
    }
}

/* One row along the last dimension. */
static void copy_row(char *dst, int64_t ds, ra_dtype dt, const char *src,
                     int64_t ss, ra_dtype st, int64_t n) {
    size_t dsz = ra_dtype_size(dt), ssz = ra_dtype_size(st);
    if (dt == st && ds == 1 && ss == 1) {
        memcpy(dst, src, (size_t)n * dsz);
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
    if (ra_dtype_size(p->src_dtype) == 0 || ra_dtype_size(p->dst_dtype) == 0) {
        ra_set_error(RA_ERR_TYPE, "copy: expected float dtypes");
        return RA_ERR_TYPE;
    }
    if (p->ndim == 0) {
        copy_row((char *)p->dst, 1, p->dst_dtype, (const char *)p->src, 1,
                 p->src_dtype, 1);
        return RA_OK;
    }
    int64_t rows = 1;
    for (int i = 0; i < p->ndim - 1; i++) rows *= p->shape[i];
    int64_t n = p->shape[p->ndim - 1];
    if (rows == 0 || n == 0) return RA_OK;
    const int last = p->ndim - 1;
    const size_t ssz = ra_dtype_size(p->src_dtype);
    const size_t dsz = ra_dtype_size(p->dst_dtype);
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
        copy_row((char *)p->dst + doff * (int64_t)dsz, p->dst_strides[last],
                 p->dst_dtype, (const char *)p->src + soff * (int64_t)ssz,
                 p->src_strides[last], p->src_dtype, n);
    }
    return RA_OK;
}
