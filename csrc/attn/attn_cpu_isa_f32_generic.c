/*
 * attn_cpu_isa_f32_generic.c -- the CPU attention tile kernels compiled with
 * float arithmetic for the generic SIMD level (16-byte vectors, 6 x 2
 * vector micro-tiles).  The code lives in attn_cpu_simd.h and
 * attn_cpu_tiles.h; attn_cpu_dispatch.c picks this table at run time when
 * the CPU supports it.
 */
#include "attn/attn_cpu_kern.h"

#if 1 /* baseline: SSE2 on x86-64, the default target elsewhere */

#define RA_REAL float
#define RA_IS_DOUBLE 0
#define RA_VBYTES 16
#define RA_MR 6
#define RA_NV 2
#define RA_ISA_NAME "generic"
#define RA_TABLE_NAME ra_cpu_kernels_f32_generic
#include "attn/attn_cpu_simd.h"
#include "attn/attn_cpu_tiles.h"
#endif
