/*
 * tensor_map.cpp -- the host side of the emulated GPU's bulk tensor
 * copies: cuTensorMapEncodeTiled (include/cuda.h), which checks its
 * arguments as the CUDA driver documents them and writes the emulator's
 * tensor map (tma.h) into the 128-byte CUtensorMap, and the runtime's
 * cudaGetDriverEntryPoint / cudaGetDriverEntryPointByVersion, the way a
 * program reaches it (a real build takes the driver's function the same
 * way, without linking libcuda: cuda/hopper/tensor_map.h).
 *
 * Not modelled (the encoder returns CUDA_ERROR_INVALID_VALUE, as it does
 * for arguments the driver refuses): interleaved layouts, and a swizzled
 * box whose inner dimension is narrower than the swizzle span (32, 64 or
 * 128 bytes), whose shared-memory placement the emulator does not know.
 */
#include "emu/tma.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <string.h>

using namespace ra_emu;

static unsigned element_size(CUtensorMapDataType t) {
    switch (t) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8: return 1;
    case CU_TENSOR_MAP_DATA_TYPE_UINT16:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16: return 2;
    case CU_TENSOR_MAP_DATA_TYPE_UINT32:
    case CU_TENSOR_MAP_DATA_TYPE_INT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ:
    case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ: return 4;
    case CU_TENSOR_MAP_DATA_TYPE_UINT64:
    case CU_TENSOR_MAP_DATA_TYPE_INT64:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT64: return 8;
    default: return 0;
    }
}

static bool is_float(CUtensorMapDataType t) {
    return t >= CU_TENSOR_MAP_DATA_TYPE_FLOAT16;   /* FLOAT16 .. TFLOAT32_FTZ */
}

extern "C" CUresult cuTensorMapEncodeTiled(CUtensorMap *tensorMap,
                                           CUtensorMapDataType tensorDataType,
                                           cuuint32_t tensorRank, void *globalAddress,
                                           const cuuint64_t *globalDim,
                                           const cuuint64_t *globalStrides,
                                           const cuuint32_t *boxDim,
                                           const cuuint32_t *elementStrides,
                                           CUtensorMapInterleave interleave,
                                           CUtensorMapSwizzle swizzle,
                                           CUtensorMapL2promotion l2Promotion,
                                           CUtensorMapFloatOOBfill oobFill) {
    const unsigned esize = element_size(tensorDataType);
    if (tensorMap == nullptr || (uintptr_t)tensorMap % 64 || esize == 0 || tensorRank < 1 ||
        tensorRank > 5 || globalAddress == nullptr || (uintptr_t)globalAddress % 16 ||
        globalDim == nullptr || boxDim == nullptr || elementStrides == nullptr ||
        (tensorRank > 1 && globalStrides == nullptr))
        return CUDA_ERROR_INVALID_VALUE;
    if (interleave != CU_TENSOR_MAP_INTERLEAVE_NONE)
        return CUDA_ERROR_INVALID_VALUE;   /* not modelled */
    if ((unsigned)swizzle > CU_TENSOR_MAP_SWIZZLE_128B || (unsigned)l2Promotion > 3 ||
        (unsigned)oobFill > 1 || (oobFill && !is_float(tensorDataType)))
        return CUDA_ERROR_INVALID_VALUE;
    EmuTensorMap m;
    memset(&m, 0, sizeof m);
    m.magic = kTensorMapMagic;
    m.rank = (uint8_t)tensorRank;
    m.dtype = (uint8_t)tensorDataType;
    m.esize = (uint8_t)esize;
    m.swizzle = (uint8_t)swizzle;
    m.oob_nan = (uint8_t)oobFill;
    m.l2 = (uint8_t)l2Promotion;
    m.gaddr = (uint64_t)(uintptr_t)globalAddress;
    for (unsigned i = 0; i < tensorRank; i++) {
        if (globalDim[i] == 0 || globalDim[i] > ((uint64_t)1 << 32) || boxDim[i] == 0 ||
            boxDim[i] > 256 || elementStrides[i] == 0 || elementStrides[i] > 8)
            return CUDA_ERROR_INVALID_VALUE;
        m.dims[i] = globalDim[i];
        m.box[i] = (uint16_t)boxDim[i];
        m.estride[i] = (uint8_t)(i == 0 ? 1 : elementStrides[i]);
        if (i > 0) {
            const uint64_t s = globalStrides[i - 1];
            if (s % 16 || s >= ((uint64_t)1 << 40)) return CUDA_ERROR_INVALID_VALUE;
            m.strides[i - 1] = s;
        }
    }
    const unsigned inner = boxDim[0] * esize;
    if (inner % 16) return CUDA_ERROR_INVALID_VALUE;
    if (swizzle != CU_TENSOR_MAP_SWIZZLE_NONE) {
        const unsigned span = 16u << (unsigned)swizzle;   /* 32, 64, 128 */
        if (inner > span) return CUDA_ERROR_INVALID_VALUE;
        if (inner != span) return CUDA_ERROR_INVALID_VALUE;   /* not modelled */
    }
    memset(tensorMap, 0, sizeof *tensorMap);
    memcpy(tensorMap, &m, sizeof m);
    return CUDA_SUCCESS;
}

extern "C" cudaError_t cudaGetDriverEntryPointByVersion(
        const char *symbol, void **funcPtr, unsigned int cudaVersion, unsigned long long flags,
        enum cudaDriverEntryPointQueryResult *driverStatus) {
    if (symbol == nullptr || funcPtr == nullptr || flags > 2 || cudaVersion > 13000)
        return cudaErrorInvalidValue;
    *funcPtr = nullptr;
    enum cudaDriverEntryPointQueryResult st = cudaDriverEntryPointSymbolNotFound;
    if (strcmp(symbol, "cuTensorMapEncodeTiled") == 0) {
        if (cudaVersion >= 12000) {
            *funcPtr = (void *)&cuTensorMapEncodeTiled;
            st = cudaDriverEntryPointSuccess;
        } else {
            st = cudaDriverEntryPointVersionNotSufficent;
        }
    }
    if (driverStatus != nullptr) *driverStatus = st;
    return cudaSuccess;
}

extern "C" cudaError_t cudaGetDriverEntryPoint(const char *symbol, void **funcPtr,
                                               unsigned long long flags,
                                               enum cudaDriverEntryPointQueryResult *driverStatus) {
    return cudaGetDriverEntryPointByVersion(symbol, funcPtr, 13000, flags, driverStatus);
}
