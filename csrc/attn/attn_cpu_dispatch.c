/*
 * attn_cpu_dispatch.c -- run-time choice of the SIMD level for the CPU
 * attention kernels.  Each level's tile kernels are compiled in their own
 * attn_cpu_isa_*.c file under a `#pragma GCC target`; here the CPU is asked
 * once (__builtin_cpu_supports) which of them it can run.  The environment
 * variable RINGATTN_CPU_SIMD=generic|avx2|avx512 lowers the choice (for
 * testing the other paths); it never raises it above what the CPU supports.
 */
#include "attn/attn_cpu.h"
#include "attn/attn_cpu_kern.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

enum { RA_SIMD_UNSET = 0, RA_SIMD_GENERIC, RA_SIMD_AVX2, RA_SIMD_AVX512 };

static _Atomic int ra_simd_level = RA_SIMD_UNSET;

static int ra_detect_level(void) {
    int level = RA_SIMD_GENERIC;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        level = RA_SIMD_AVX2;
    if (level == RA_SIMD_AVX2 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl"))
        level = RA_SIMD_AVX512;
#endif
    const char *env = getenv("RINGATTN_CPU_SIMD");
    if (env != NULL) {
        int cap = level;
        if (strcmp(env, "generic") == 0) cap = RA_SIMD_GENERIC;
        else if (strcmp(env, "avx2") == 0) cap = RA_SIMD_AVX2;
        if (cap < level) level = cap;
    }
    return level;
}

static int ra_level(void) {
    int level = atomic_load(&ra_simd_level);
    if (level == RA_SIMD_UNSET) {
        level = ra_detect_level();
        atomic_store(&ra_simd_level, level);
    }
    return level;
}

const ra_cpu_kernels *ra_cpu_kernels_for(ra_dtype dtype) {
    int dbl = dtype == RA_FLOAT64;
    switch (ra_level()) {
#if defined(__x86_64__) || defined(__i386__)
    case RA_SIMD_AVX512:
        return dbl ? &ra_cpu_kernels_f64_avx512 : &ra_cpu_kernels_f32_avx512;
    case RA_SIMD_AVX2:
        return dbl ? &ra_cpu_kernels_f64_avx2 : &ra_cpu_kernels_f32_avx2;
#endif
    default:
        return dbl ? &ra_cpu_kernels_f64_generic : &ra_cpu_kernels_f32_generic;
    }
}

const char *ra_cpu_simd_level(void) {
    return ra_cpu_kernels_for(RA_FLOAT32)->isa;
}
