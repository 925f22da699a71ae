/*
 * cuda_fp16.h -- float16 on ringattn's emulated GPU: the __half and
 * __half2 types and the conversions the kernels use, bit-exact with the
 * device (round to nearest even; a NaN becomes the canonical 0x7fff).
 */
#ifndef RA_EMU_CUDA_FP16_H
#define RA_EMU_CUDA_FP16_H

#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif
/* float -> binary16 bits, round to nearest even */
static inline uint16_t ra_emu_f32_to_f16_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)0x7fffu;              /* NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);    /* rounds to inf */
    if (ax < 0x38800000u) {                                      /* subnormal half or 0 */
        if (ax < 0x33000000u) return (uint16_t)sign;             /* < 2^-25: to 0 */
        const int e = (int)(ax >> 23);
        const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        const int shift = 126 - e;                               /* 14 .. 24 */
        uint32_t r = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((ax >> 13) - (112u << 10));
    const uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    return (uint16_t)(sign | r);
}
static inline float ra_emu_f16_bits_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t x;
    if (e == 0x1f) x = sign | 0x7f800000u | (m << 13);
    else if (e != 0) x = sign | ((e + 112u) << 23) | (m << 13);
    else if (m == 0) x = sign;
    else {
        int sh = 0;
        uint32_t mm = m;
        while (!(mm & 0x400u)) { mm <<= 1; sh++; }
        x = sign | ((uint32_t)(113 - sh) << 23) | ((mm & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &x, 4);
    return f;
}
#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
struct __half {
    uint16_t __x;
    __half() = default;
    __half(float f) : __x(ra_emu_f32_to_f16_bits(f)) {}
    __half(double d) : __x(ra_emu_f32_to_f16_bits((float)d)) {}
    operator float() const { return ra_emu_f16_bits_to_f32(__x); }
};
struct __attribute__((aligned(4))) __half2 {
    __half x, y;
};
typedef __half half;
typedef __half2 half2;

static inline __half __float2half_rn(float f) {
    __half h;
    h.__x = ra_emu_f32_to_f16_bits(f);
    return h;
}
static inline __half __float2half(float f) { return __float2half_rn(f); }
static inline float __half2float(__half h) { return ra_emu_f16_bits_to_f32(h.__x); }
static inline __half2 __floats2half2_rn(float a, float b) {
    __half2 r;
    r.x = __float2half_rn(a);
    r.y = __float2half_rn(b);
    return r;
}
static inline __half2 __float2half2_rn(float a) { return __floats2half2_rn(a, a); }
static inline float __low2float(__half2 h) { return __half2float(h.x); }
static inline float __high2float(__half2 h) { return __half2float(h.y); }
static inline unsigned short __half_as_ushort(__half h) { return h.__x; }
static inline __half __ushort_as_half(unsigned short u) {
    __half h;
    h.__x = u;
    return h;
}
#endif /* __cplusplus */

#endif /* RA_EMU_CUDA_FP16_H */
