/*
 * attn_cpu_isa_f32_avx512.c -- the CPU attention tile kernels compiled with
 * float arithmetic for the avx512 SIMD level (64-byte vectors, 6 x 4
 * vector micro-tiles).  The code lives in attn_cpu_simd.h and
 * attn_cpu_tiles.h; attn_cpu_dispatch.c picks this table at run time when
 * the CPU supports it.
 */
#include "attn/attn_cpu_kern.h"

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")
#define RA_REAL float
#define RA_IS_DOUBLE 0
#define RA_VBYTES 64
#define RA_MR 6
#define RA_NV 4
#define RA_ISA_NAME "avx512"
#define RA_TABLE_NAME ra_cpu_kernels_f32_avx512
#include "attn/attn_cpu_simd.h"
#include "attn/attn_cpu_tiles.h"
#endif
