/*
 * fwd_traits.cuh -- the shapes of the Hopper (sm_90a) attention forward:
 * tile sizes, warp roles, register split, pipeline depth and the shared
 * memory layout, as plain constants (the "how big is a tile" of the
 * wgmma/TMA family; the mainloop, softmax and epilogue read them here).
 *
 * Warp roles (384 threads, three warpgroups):
 *   warpgroup 0   the producer: its warp 0 walks the key tiles the block
 *                 sees and loads Q once and K, V per tile by bulk tensor
 *                 copies (TMA) into a ring of kStages shared buffers; its
 *                 other three warps only give their registers away
 *   warpgroups 1, 2  the consumers: each owns 64 of the block's 128 query
 *                 rows; S = Q K^T and O += P V by wgmma, online softmax in
 *                 registers
 *
 * Every number below is a performance choice; its reason is beside it
 * (predicted by ringattn/bench/model.py and tools/perf_model.py, design
 * "W" of docs/results.md).
 */
#ifndef RA_HOPPER_FWD_TRAITS_CUH
#define RA_HOPPER_FWD_TRAITS_CUH

#include "hopper/ptx_sm90.cuh"

namespace ra {
namespace wg {

/* 128 query rows per block, 64 per consumer warpgroup (wgmma's M): K and
 * V tiles are read from shared memory once for 128 rows, half the L2 and
 * shared-memory traffic per flop of 64-row blocks (model: design C vs B,
 * -20 %). */
constexpr int kBlockQ = 128;
constexpr int kRowsPerWg = 64;
constexpr int kConsumers = kBlockQ / kRowsPerWg;

/* 128 keys per tile: S is one m64n128 wgmma chain per k-step (16 issue
 * slots per 64 x 128 x 16 product instead of 8 x 2 mma.sync), and the
 * producer's per-tile cost (barriers, copies) is spread over twice the
 * work of 64-key tiles.  S takes 64 registers per thread, O D/2, P (as
 * 16-bit A fragments) 32: 160 at D 128 within the consumers' 232. */
constexpr int kBlockK = 128;

/* Two stages of K and V: with one block per SM (the register split below
 * gives the SM's whole register file to one block) the producer loads
 * tile j + 1 while tile j computes; a tile's copy (32 KB at D 128, about
 * 11 ns of L2 bandwidth per SM at 4.5 TB/s / 132) is far shorter than its
 * products (2 x 64 x 128 x 128 x 2 flop per warpgroup, about 1000 cycles),
 * so a third stage buys nothing but 64 KB of shared memory. */
constexpr int kStages = 2;

constexpr int kWarpgroupThreads = 128;
constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;   /* 384 */

/* setmaxnreg: the producer keeps 40 registers (its tile walk uses 64-bit
 * positions), the consumers take 232: 128 x 40 + 256 x 232 = 64512 of the
 * SM's 65536.  The kernel is compiled for 384 threads and one block per SM
 * (168 registers each before the split). */
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;

/* Named barriers of the ping-pong schedule (ids 1.. ; 0 is __syncthreads):
 * consumer warpgroup c issues its products only while it holds turn c. */
constexpr int kTurnBarrier0 = 1;

/* Bytes of one 64-column half of a 128-row tile in shared memory: 128
 * rows of 128 bytes, as a bulk tensor copy with the 128-byte swizzle
 * writes them (the 16-byte chunk c of row r at chunk c ^ (r % 8)); wgmma
 * reads them through descriptors of the same swizzle. */
constexpr int kHalfBytes = 128 * 128;
constexpr int kAtomBytes = 1024;   /* 8 rows x 128 bytes: the swizzle's period (SBO) */

/* The shared memory of one block (byte offsets from a 1024-aligned base):
 *   Q               kBlockQ x D, D / 64 halves of kHalfBytes
 *   K[s], V[s]      kBlockK x D each, s < kStages
 *   ids[s]          the tile's kv segment ids (documents)
 *   meta[s]         the tile the producer put in stage s: first key (-1:
 *                   no more tiles) and whether all its ids equal the
 *                   block's one id
 *   barriers        full_q; full_k[s], full_v[s] (the producer's copies
 *                   landed); empty_k[s], empty_v[s] (every consumer warp is
 *                   done with the buffer) */
template <int D>
struct Smem {
    static_assert(D == 64 || D == 128, "head_dim 64 or 128");
    static constexpr int kHalves = D / 64;
    static constexpr int kTileBytes = kHalves * kHalfBytes;
    static constexpr int kQ = 0;
    static constexpr int kK = kQ + kTileBytes;
    static constexpr int kV = kK + kStages * kTileBytes;
    static constexpr int kIds = kV + kStages * kTileBytes;
    static constexpr int kMeta = kIds + kStages * kBlockK * 4;
    static constexpr int kBars = kMeta + kStages * 8;
    static constexpr int kNumBars = 1 + 4 * kStages;
    static constexpr int kBytes = kBars + kNumBars * 8;
    /* what the launch asks for: the layout and room to align its base */
    static constexpr int kLaunchBytes = kBytes + kAtomBytes;
};

/* The producer's record of one stage. */
struct TileMeta {
    int32_t k0;     /* first key of the tile; -1: the block has no more tiles */
    int32_t same;   /* documents: every id of the tile equals the block's one id */
};

/* The shared-memory pointers of one block. */
template <int D>
struct Buffers {
    unsigned char *base;
    uint64_t *full_q, *full_k, *full_v, *empty_k, *empty_v;
    int32_t *ids;
    TileMeta *meta;

    __device__ __forceinline__ explicit Buffers(unsigned char *raw) {
        // the swizzled tiles start on 1024-byte boundaries of the shared window
        const uint32_t a = sm90::smem_u32(raw);
        base = raw + ((kAtomBytes - (a % kAtomBytes)) % kAtomBytes);
        uint64_t *bars = reinterpret_cast<uint64_t *>(base + Smem<D>::kBars);
        full_q = bars;
        full_k = bars + 1;
        full_v = full_k + kStages;
        empty_k = full_v + kStages;
        empty_v = empty_k + kStages;
        ids = reinterpret_cast<int32_t *>(base + Smem<D>::kIds);
        meta = reinterpret_cast<TileMeta *>(base + Smem<D>::kMeta);
    }
    __device__ __forceinline__ unsigned char *q() const { return base + Smem<D>::kQ; }
    __device__ __forceinline__ unsigned char *k(int s) const {
        return base + Smem<D>::kK + s * Smem<D>::kTileBytes;
    }
    __device__ __forceinline__ unsigned char *v(int s) const {
        return base + Smem<D>::kV + s * Smem<D>::kTileBytes;
    }
};

/* A position in the ring of stages: the i-th tile uses stage i % kStages
 * in round i / kStages, whose barrier phases have parity round & 1. */
struct Stage {
    int index;
    uint32_t phase;
    __device__ __forceinline__ void advance() {
        if (++index == kStages) {
            index = 0;
            phase ^= 1u;
        }
    }
};

}  // namespace wg
}  // namespace ra

#endif /* RA_HOPPER_FWD_TRAITS_CUH */
