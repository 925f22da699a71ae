/*
 * tma.h -- the emulated GPU's tensor map: what the emulated
 * cuTensorMapEncodeTiled (tensor_map.cpp) writes into the 128 bytes of a
 * CUtensorMap and cp.async.bulk.tensor (ptx_tma.cpp) reads back.  On a
 * real GPU the object is opaque to programs; here it is this struct.
 * Internal; C++.
 */
#ifndef RA_EMU_TMA_H
#define RA_EMU_TMA_H

#include <stdint.h>

namespace ra_emu {

enum : uint32_t { kTensorMapMagic = 0x4d544152u };   /* "RATM" */

struct EmuTensorMap {
    uint32_t magic;
    uint8_t rank, dtype, esize, swizzle;   /* swizzle: CUtensorMapSwizzle (0..3) */
    uint8_t oob_nan, l2, pad[2];
    uint64_t gaddr;
    uint64_t dims[5];
    uint64_t strides[4];   /* bytes between steps of dimensions 1..rank-1 */
    uint16_t box[5];
    uint8_t estride[5];    /* estride[0] is 1: TMA has no stride in dimension 0 */
};
static_assert(sizeof(EmuTensorMap) <= 128, "a CUtensorMap has 128 bytes");

}  // namespace ra_emu

#endif /* RA_EMU_TMA_H */
