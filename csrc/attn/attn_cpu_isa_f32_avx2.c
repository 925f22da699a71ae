/*
 * attn_cpu_isa_f32_avx2.c -- the CPU attention tile kernels compiled with
 * float arithmetic for the avx2 SIMD level (32-byte vectors, 6 x 2
 * vector micro-tiles).  The code lives in attn_cpu_simd.h and
 * attn_cpu_tiles.h; attn_cpu_dispatch.c picks this table at run time when
 * the CPU supports it.
 */
#include "attn/attn_cpu_kern.h"

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2,fma,f16c")
#define RA_REAL float
#define RA_IS_DOUBLE 0
#define RA_VBYTES 32
#define RA_MR 6
#define RA_NV 2
#define RA_ISA_NAME "avx2"
#define RA_TABLE_NAME ra_cpu_kernels_f32_avx2
#include "attn/attn_cpu_simd.h"
#include "attn/attn_cpu_tiles.h"
#endif
