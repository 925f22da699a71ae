/*
 * bwd_traits.cuh -- the shapes of the Hopper (sm_90a) attention backward
 * (attn_bwd_wg.cu): tile sizes, warp roles, register split, pipeline depth
 * and the shared-memory layout, as plain constants.
 *
 * Warp roles (384 threads, three warpgroups):
 *   warpgroup 0   the producer: its warp 0 loads the block's K and V once
 *                 and, per query tile, Q and dout by bulk tensor copies
 *                 (TMA) and the rows' lse and delta (as RowStats) into a
 *                 ring of kStages shared buffers; its other warps only
 *                 give their registers away
 *   warpgroups 1, 2  the consumers: warpgroup c owns keys 64 c .. 64 c + 63
 *                 of the block's 128 and their dK, dV accumulators
 *                 (64 x D float32 each, in registers)
 */
#ifndef RA_HOPPER_BWD_TRAITS_CUH
#define RA_HOPPER_BWD_TRAITS_CUH

#include "attn_bwd_fused_ds.cuh"   /* RowStats, row_stats_of, DqTarget */
#include "hopper/ptx_sm90.cuh"

namespace ra {
namespace wgb {

/* 128 keys per block, 64 per consumer warpgroup (wgmma's M is 64: S^T =
 * K Q^T puts the keys on the accumulator's rows, so dV += P^T dout and
 * dK += dS^T Q take P^T and dS^T straight from registers as A).  As in
 * the fused mma.sync kernel, 128 keys halve the dq atomics per flop
 * against 64. */
constexpr int kBlockN = 128;
constexpr int kKeysPerWg = 64;
constexpr int kConsumers = kBlockN / kKeysPerWg;

/* 64 query rows per streamed tile: S^T and dP^T are 64 x 64 (32 registers
 * each per thread), beside dK and dV's D / 2 + D / 2 (128 at D 128). */
constexpr int kBlockM = 64;

/* Two stages of Q, dout and the rows' statistics: the producer loads tile
 * i + 1 while tile i computes. */
constexpr int kStages = 2;

constexpr int kWarpgroupThreads = 128;
constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;   /* 384 */

/* setmaxnreg: 24 for the producer warpgroup (32-bit tile walk), 240 for
 * the consumers, whose dK and dV take 128 (128 x 24 + 256 x 240 = 64512 of
 * 65536).  The masked variant: 40 and 232 (the document walk
 * of its producer spilled at 24). */
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;
constexpr int kMaskedProducerRegs = 40;
constexpr int kMaskedConsumerRegs = 232;

/* Named barrier of the consumers' dS^T tiles (both warpgroups, 256
 * threads; 0 is __syncthreads): each consumer's dQ product reads both. */
constexpr int kDsBarrier = 1;

/* 128-byte rows swizzled as a bulk tensor copy with the 128-byte swizzle
 * writes them (16-byte chunk c of row r at chunk c ^ (r % 8)): a 64-column
 * half of a K/V tile (128 rows), of a Q/dout tile (64 rows), and a dS^T
 * tile (64 keys x 64 queries). */
constexpr int kKHalfBytes = kBlockN * 128;
constexpr int kQHalfBytes = kBlockM * 128;
constexpr int kDsBytes = kKeysPerWg * 128;
constexpr int kAtomBytes = 1024;   /* 8 rows x 128 bytes: the swizzle's period (SBO) */

/* Shared memory (byte offsets from a 1024-aligned base):
 *   K, V            kBlockN x D each, D / 64 halves
 *   Q[s], dO[s]     kBlockM x D each, s < kStages
 *   dS[2][c]        consumer c's dS^T (keys x queries, 16-bit), two
 *                   buffers (tile parity) so one barrier per tile orders
 *                   a warp's write of tile i + 2 after every warp's dQ
 *                   product of tile i (dS[p][1] follows dS[p][0]: one
 *                   128-key operand)
 *   stats[s]        kBlockM RowStats (lse log2 e, band, delta scale;
 *                   with documents the row's id)
 *   meta[s]         the masked variant's record of the stage's tile
 *                   (TileMeta: the producer's walk decides it)
 *   barriers        full_kv; full[s] (Q, dout, stats landed); empty[s]
 *                   (every consumer warp is done with stage s) */
template <int D>
struct Smem {
    static_assert(D == 64 || D == 128, "head_dim 64 or 128");
    static constexpr int kHalves = D / 64;
    static constexpr int kKVBytes = kHalves * kKHalfBytes;
    static constexpr int kQBytes = kHalves * kQHalfBytes;
    static constexpr int kK = 0;
    static constexpr int kV = kK + kKVBytes;
    static constexpr int kQ = kV + kKVBytes;
    static constexpr int kDO = kQ + kStages * kQBytes;
    static constexpr int kDS = kDO + kStages * kQBytes;
    static constexpr int kStats = kDS + 2 * kConsumers * kDsBytes;
    static constexpr int kMeta = kStats + kStages * kBlockM * (int)sizeof(bwd_fused::RowStats);
    static constexpr int kBars = kMeta + kStages * 16;
    static constexpr int kNumBars = 1 + 2 * kStages;
    static constexpr int kBytes = kBars + kNumBars * 8;
    static constexpr int kLaunchBytes = kBytes + kAtomBytes;
};

/* The masked variant's record of the tile in a stage: its first query row
 * (-1: the block has no more tiles), the query head within the GQA group,
 * and whether every id of its rows equals the block's one id (documents:
 * then no pair of the tile needs the id test). */
struct TileMeta {
    int32_t m0, head, same, unused;
};

template <int D>
struct Buffers {
    unsigned char *base;   /* the rest is computed from it (few live registers) */

    __device__ __forceinline__ explicit Buffers(unsigned char *raw) {
        const uint32_t a = sm90::smem_u32(raw);
        base = raw + ((kAtomBytes - (a % kAtomBytes)) % kAtomBytes);
    }
    __device__ __forceinline__ uint64_t *bars() const {
        return reinterpret_cast<uint64_t *>(base + Smem<D>::kBars);
    }
    __device__ __forceinline__ uint64_t *full_kv() const { return bars(); }
    __device__ __forceinline__ uint64_t *full(int s) const { return bars() + 1 + s; }
    __device__ __forceinline__ uint64_t *empty(int s) const { return bars() + 1 + kStages + s; }
    __device__ __forceinline__ bwd_fused::RowStats *stats(int s) const {
        return reinterpret_cast<bwd_fused::RowStats *>(base + Smem<D>::kStats) + s * kBlockM;
    }
    __device__ __forceinline__ TileMeta *meta(int s) const {
        return reinterpret_cast<TileMeta *>(base + Smem<D>::kMeta) + s;
    }
    __device__ __forceinline__ unsigned char *k() const { return base + Smem<D>::kK; }
    __device__ __forceinline__ unsigned char *v() const { return base + Smem<D>::kV; }
    __device__ __forceinline__ unsigned char *q(int s) const {
        return base + Smem<D>::kQ + s * Smem<D>::kQBytes;
    }
    __device__ __forceinline__ unsigned char *dout(int s) const {
        return base + Smem<D>::kDO + s * Smem<D>::kQBytes;
    }
    __device__ __forceinline__ unsigned char *ds(int parity, int c) const {
        return base + Smem<D>::kDS + (parity * kConsumers + c) * kDsBytes;
    }
};

/* Thread 0's initialisation of a block's barriers laid out as bars[0] (the
 * block's one-time copies), full[s] = bars[1 + s] (one arrive with the
 * stage's bytes), empty[s] = bars[1 + kStages + s] (one arrival per
 * consumer warp), then a block barrier: the backward's layout (Buffers
 * bars()) and the deterministic dq pass's (attn_bwd_wg_dq.cu). */
__device__ __forceinline__ void init_barriers(uint64_t *bars) {
    if (threadIdx.x == 0) {
        sm90::mbar_init(bars, 1);
        for (int s = 0; s < kStages; s++) {
            sm90::mbar_init(bars + 1 + s, 1);
            sm90::mbar_init(bars + 1 + kStages + s, kConsumers * 4);
        }
        sm90::mbar_init_fence();
    }
    __syncthreads();
}

/* A position in the ring of stages (as the forward's). */
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

/* The kernel's argument: the backward's params, the tensor maps of q,
 * dout (box 64 x 64 rows) and k, v (box 64 x 128 rows), each (B, S, H, D)
 * as a 4-D map (D, S, H, B), 128-byte swizzle; the float32 dq target; the
 * branch rule's branches (mask.cuh; n = 0 without p.branches). */
struct BwdArgs {
    CUtensorMap q_map, do_map, k_map, v_map;
    ra_attn_bwd_params p;
    bwd_fused::DqTarget dq;
    int64_t n_kblocks;
    Branches br;
};

/* The block's walk: query tiles [i_begin, i_end) in steps of kBlockM for
 * each of the group's query heads; tile t is head t / n_m, rows from
 * i_begin + (t % n_m) kBlockM. */
struct Walk {
    int32_t i_begin, n_m, n_tiles;   /* int32: ra_bwd_wg_supported */
    __device__ __forceinline__ int32_t head(int32_t t) const { return t / n_m; }
    __device__ __forceinline__ int32_t m0(int32_t t) const {
        return i_begin + (t % n_m) * kBlockM;
    }
};

}  // namespace wgb
}  // namespace ra

#endif /* RA_HOPPER_BWD_TRAITS_CUH */
