/*
 * half.h -- float16 and bfloat16 <-> float32 scalar conversions (round to
 * nearest even; infinities kept; NaN stays a quiet NaN), shared by the CPU
 * kernels' packing and the strided copy.
 */
#ifndef RA_HALF_H
#define RA_HALF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float ra_cpu_h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {                                  /* subnormal half */
        int e = 113;
        while (!(man & 0x400u)) { man <<= 1; e--; }
        bits = sign | ((uint32_t)e << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t ra_cpu_f2h(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u)                    /* inf or nan */
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* overflow */
    if (ax < 0x38800000u) {                   /* half subnormal or zero */
        if (ax < 0x33000000u) return (uint16_t)sign;
        uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e;             /* 14..24 */
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ax - 0x38000000u;            /* rebias exponent 127 -> 15 */
    uint32_t rem = r & 0x1fffu;
    r >>= 13;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    return (uint16_t)(sign | r);
}

static inline float ra_cpu_b2f(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t ra_cpu_f2b(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* double -> float rounded to odd: truncated toward zero, with the lowest
 * bit set when anything was cut off.  Rounding that float to nearest even
 * at 16 or fewer bits then gives the correctly rounded result of the
 * double (rounding through a nearest-even float would round twice: a
 * double just above a half-way point lands on it and goes to even). */
static inline float ra_cpu_d2f_odd(double x) {
    float t = (float)x;
    if (!((double)t != x) || x != x) return t;       /* exact, or NaN */
    if (fabs((double)t) > fabs(x)) t = nextafterf(t, 0.0f);  /* toward zero */
    uint32_t bits;
    memcpy(&bits, &t, 4);
    if ((bits & 0x7f800000u) != 0x7f800000u) bits |= 1u;
    memcpy(&t, &bits, 4);
    return t;
}

/* double -> float16 / bfloat16, rounded once, to nearest even */
static inline uint16_t ra_cpu_d2h(double x) { return ra_cpu_f2h(ra_cpu_d2f_odd(x)); }
static inline uint16_t ra_cpu_d2b(double x) { return ra_cpu_f2b(ra_cpu_d2f_odd(x)); }

#endif /* RA_HALF_H */
