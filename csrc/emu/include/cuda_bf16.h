/*
 * cuda_bf16.h -- bfloat16 on ringattn's emulated GPU: __nv_bfloat16 and
 * __nv_bfloat162 and the conversions the kernels use, bit-exact with the
 * device (round to nearest even; a NaN becomes the canonical 0x7fff).
 */
#ifndef RA_EMU_CUDA_BF16_H
#define RA_EMU_CUDA_BF16_H

#include <stdint.h>
#include <string.h>

#include "cuda_fp16.h"

#ifdef __cplusplus
extern "C" {
#endif
static inline uint16_t ra_emu_f32_to_bf16_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)0x7fffu;
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}
static inline float ra_emu_bf16_bits_to_f32(uint16_t b) {
    const uint32_t x = (uint32_t)b << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}
#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
struct __nv_bfloat16 {
    uint16_t __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(ra_emu_f32_to_bf16_bits(f)) {}
    __nv_bfloat16(double d) : __x(ra_emu_f32_to_bf16_bits((float)d)) {}
    operator float() const { return ra_emu_bf16_bits_to_f32(__x); }
};
struct __attribute__((aligned(4))) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

static inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    __nv_bfloat16 b;
    b.__x = ra_emu_f32_to_bf16_bits(f);
    return b;
}
static inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
static inline float __bfloat162float(__nv_bfloat16 b) { return ra_emu_bf16_bits_to_f32(b.__x); }
static inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    __nv_bfloat162 r;
    r.x = __float2bfloat16_rn(a);
    r.y = __float2bfloat16_rn(b);
    return r;
}
static inline float __low2float(__nv_bfloat162 h) { return __bfloat162float(h.x); }
static inline float __high2float(__nv_bfloat162 h) { return __bfloat162float(h.y); }
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
    __nv_bfloat16 h;
    h.__x = u;
    return h;
}
#endif /* __cplusplus */

#endif /* RA_EMU_CUDA_BF16_H */
