/*
 * tensor_map.h -- the CUtensorMap of a bulk tensor copy (cp.async.bulk.tensor,
 * cuda/hopper/ptx_sm90.cuh), made on the host by the driver's
 * cuTensorMapEncodeTiled.  ringattn does not link libcuda: the function is
 * taken from the driver through the runtime's cudaGetDriverEntryPoint
 * (ByVersion where the runtime has it), once per translation unit.  On the
 * emulated GPU (RINGATTN_CUDA=emulate) the emulated runtime hands out its
 * own encoder the same way (csrc/emu/tensor_map.cpp).  C and C++.
 *
 *   int ra_tensor_map_tiled(CUtensorMap *map, CUtensorMapDataType dtype,
 *                           unsigned rank, const void *base,
 *                           const uint64_t *dims, const uint64_t *strides,
 *                           const uint32_t *box, const uint32_t *elem_strides,
 *                           CUtensorMapSwizzle swizzle, char *err, size_t errlen);
 *
 * dims[rank] and box[rank] in elements and strides[rank - 1] in bytes (of
 * dimensions 1..rank-1), innermost dimension first; elem_strides[rank] (NULL:
 * all 1) takes every elem_strides[i]-th element of dimension i >= 1; no
 * interleave, out-of-bounds elements read as zero.  Returns 0, or -1 with a
 * sentence in err naming the driver's answer and the arguments.  map must
 * be 64-byte aligned (a CUtensorMap variable is); pass it to a kernel as a
 * `const __grid_constant__ CUtensorMap` parameter or in global memory.
 */
#ifndef RA_HOPPER_TENSOR_MAP_H
#define RA_HOPPER_TENSOR_MAP_H

#include <cuda.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef CUresult (*ra_tensor_map_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t,
                                            void *, const cuuint64_t *, const cuuint64_t *,
                                            const cuuint32_t *, const cuuint32_t *,
                                            CUtensorMapInterleave, CUtensorMapSwizzle,
                                            CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* the driver's cuTensorMapEncodeTiled (NULL, with a reason in err, when the
 * runtime or driver cannot give it) */
static inline ra_tensor_map_encode_fn ra_tensor_map_encoder(char *err, size_t errlen) {
    static ra_tensor_map_encode_fn fn;   /* found once; a race finds the same */
    if (fn != NULL) return fn;
    void *p = NULL;
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                     cudaEnableDefault, &q);
#else
    cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault,
                                            &q);
#endif
    if (e != cudaSuccess || p == NULL || q != cudaDriverEntryPointSuccess) {
        if (err != NULL && errlen)
            snprintf(err, errlen, "the CUDA driver has no cuTensorMapEncodeTiled (runtime: %s, "
                     "lookup status %d); bulk tensor copies need CUDA 12 and a driver for it",
                     cudaGetErrorString(e), (int)q);
        return NULL;
    }
    fn = (ra_tensor_map_encode_fn)p;
    return fn;
}

static inline int ra_tensor_map_tiled(CUtensorMap *map, CUtensorMapDataType dtype,
                                      unsigned rank, const void *base, const uint64_t *dims,
                                      const uint64_t *strides, const uint32_t *box,
                                      const uint32_t *elem_strides, CUtensorMapSwizzle swizzle,
                                      char *err, size_t errlen) {
    ra_tensor_map_encode_fn encode = ra_tensor_map_encoder(err, errlen);
    if (encode == NULL) return -1;
    if (rank < 1 || rank > 5) {
        if (err != NULL && errlen)
            snprintf(err, errlen, "tensor map rank: expected 1..5, got %u", rank);
        return -1;
    }
    cuuint64_t d[5], s[4];
    cuuint32_t b[5], e[5];
    for (unsigned i = 0; i < rank; i++) {
        d[i] = dims[i];
        b[i] = box[i];
        e[i] = elem_strides != NULL ? elem_strides[i] : 1;
        if (i + 1 < rank) s[i] = strides[i];
    }
    const CUresult r = encode(map, dtype, rank, (void *)base, d, rank > 1 ? s : NULL, b, e,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        if (err != NULL && errlen) {
            int n = snprintf(err, errlen, "cuTensorMapEncodeTiled returned %d for rank %u, "
                             "dtype %d, base %p, swizzle %d: dims", (int)r, rank, (int)dtype,
                             base, (int)swizzle);
            for (unsigned i = 0; i < rank && n > 0 && (size_t)n < errlen; i++)
                n += snprintf(err + n, errlen - (size_t)n, " %llu", (unsigned long long)d[i]);
            if (n > 0 && (size_t)n < errlen) n += snprintf(err + n, errlen - (size_t)n, ", box");
            for (unsigned i = 0; i < rank && n > 0 && (size_t)n < errlen; i++)
                n += snprintf(err + n, errlen - (size_t)n, " %u", b[i]);
        }
        return -1;
    }
    return 0;
}

/* The map of a (B, S, H, D) tensor of 16-bit elements (bfloat16 when bf16,
 * else float16; element strides sb, ss, sh; D contiguous) as the Hopper
 * kernels read it: 4-D (D, S, H, B), box 64 columns x `rows` rows of one
 * head and batch row, 128-byte swizzle.  An axis of extent 1 is never stepped along, so any legal
 * stride stands in for the caller's there.  0, or -1 with the reason in
 * err. */
static inline int ra_tensor_map_bshd(CUtensorMap *map, int bf16, const void *x, int64_t batch,
                                     int64_t seq, int64_t heads, int64_t D, int64_t sb,
                                     int64_t ss, int64_t sh, uint32_t rows, char *err,
                                     size_t errlen) {
    const uint64_t dims[4] = {(uint64_t)D, (uint64_t)seq, (uint64_t)heads, (uint64_t)batch};
    const uint64_t strides[3] = {seq > 1 ? (uint64_t)ss * 2 : 16, heads > 1 ? (uint64_t)sh * 2 : 16,
                                 batch > 1 ? (uint64_t)sb * 2 : 16};
    const uint32_t box[4] = {64, rows, 1, 1};
    return ra_tensor_map_tiled(map,
                               bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                    : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                               4, x, dims, strides, box, NULL, CU_TENSOR_MAP_SWIZZLE_128B, err,
                               errlen);
}

#endif /* RA_HOPPER_TENSOR_MAP_H */
