/*
 * attn_bwd_fused.cuh -- the fused tensor-core backward's traits: tile
 * shapes, warp roles and the shared-memory layout, in one place
 * (attn_bwd_fused.cu is the kernel; attn_bwd_fused_ds.cuh its P/dS step,
 * attn_bwd_fused_epi.cuh its epilogue).
 *
 * A block of 8 warps owns kBlockN = 128 keys of one (b, kv head) -- their
 * K and V rows in shared memory, their dK and dV accumulators (128 x D
 * float32 each) in the registers of all 8 warps -- and streams query tiles
 * of kBlockM = 64 rows (Q and dout double buffered with cp.async, the
 * rows' statistics loaded a tile ahead) for each query head of the GQA
 * group.  Per tile:
 *   1. S = Q K^T and dP = dout V^T (64 x 128): warps 2 (rows) x 4 (keys),
 *      32 x 32 each (at D 128 16 rows at a time, attn_bwd_fused.cu);
 *   2. P, dS (the P/dS step) from the fragments, written to shared memory
 *      as 16-bit [query][key] tiles;
 *   3. dV += P^T dout and dK += dS^T Q (128 x D, k over the 64 queries):
 *      warps 4 (keys) x 2 (D halves), 32 x D/2 each, P^T and dS^T loaded
 *      transposed;
 *   4. dQ_part = dS K (64 x D, k over the 128 keys): warps 2 (rows) x 4 (D
 *      quarters), 32 x D/4 each, added into a float32 dq by
 *      red.global.add.
 * Each product is 64 x 128 x D multiply-adds over the block: 64 mma
 * m16n8k16 per warp at D 128 (32 at D 64), 320 (160) per tile for the five.
 *
 * Why this shape (docs/results.md "Designs", tools/perf_model.py bwd J):
 *   - fused: 5 products per tile pair where the split kernels (dkdv_tc +
 *     dq_tc) recompute S and dP for 7; model -27 % (design G vs today);
 *   - 128 keys per block: every block adds its dQ part into L2 by atomics,
 *     so the atomic bytes per flop halve against 64 keys; model -36 % (J
 *     vs H), tensor-bound instead of L2-bound;
 *   - P and dS through shared memory, every product tiled over all 8
 *     warps: dK/dV stay spread over 256 threads (128 registers at D 128)
 *     where 16 keys per warp with P in registers would need 256;
 *   - 64 query rows per tile: S and dP are 32 + 32 registers per thread
 *     while dK, dV hold 128 (D 128): estimated 248 in all; compiled, 244 at
 *     D 128 with S and dP taken 16 rows at a time, 243 at D 64 with the
 *     warp's K fragments of S kept in registers across the loop
 *     (docs/results.md "The backward as built").
 *
 * Shared memory (bytes; every 16-bit tile swizzled, mma.cuh swz):
 *   K, V        2 x 128 x D x 2        (64 KB at D 128)
 *   Q, dout     2 stages x 2 x 64 x D x 2  (64 KB)
 *   P, dS       2 x 64 x 128 x 2       (32 KB)
 *   stats       2 stages x 64 x 16     (RowStats: lse * log2 e, band,
 *                                       delta * scale, with M the row's id)
 *   with M:     128 key ids, 2 x 8 document words
 *   BlockState  128
 * = 166,016 bytes at D 128 (166,592 with M), 100,480 at D 64 (101,056):
 * inside the 227 KB an H100 grants a block and the 163 KB of an A100; a
 * device that grants less runs the split kernels.  After the loop the
 * first (128 x (D + 8) x 4) x 2 bytes hold dK and dV as float32 for the
 * epilogue's row-contiguous 16-byte stores.
 */
#ifndef RA_ATTN_BWD_FUSED_CUH
#define RA_ATTN_BWD_FUSED_CUH

#include "attn_bwd_tc.cuh"
#include "smem_frag.cuh"

namespace ra {
namespace bwd_fused {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockN = 128;  // keys per block
constexpr int kBlockM = 64;   // query rows per streamed tile

/* where a float32 dq gradient lives: the caller's dq when it accumulates
 * into it, else a zeroed scratch (B, S_q, H, D) that a conversion pass
 * turns into dq */
struct DqTarget {
    float *p;
    int64_t batch_stride, seq_stride, head_stride;
};

/* Runs `run` with the float32 dq target of the call: dq itself when it
 * accumulates, else a zeroed scratch from ringattn's caching pool, turned
 * into dq by a conversion pass after `run` (only on ringattn's compute
 * stream: elsewhere *ran stays false and nothing runs).  Shared by the
 * fused kernel and the Hopper one (hopper/attn_bwd_wg.cu); attn_bwd_fused.cu */
typedef ra_status (*DqRun)(const ra_attn_bwd_params &p, cudaStream_t s, const DqTarget &tgt,
                           void *ctx);
ra_status with_dq_target(const ra_attn_bwd_params &p, cudaStream_t s, DqRun run, void *ctx,
                         bool *ran);

/* What a block knows of itself that its loop reads once per tile: kept in
 * shared memory (written by thread 0 before the loop, read after the loop's
 * barriers) rather than in registers, where ptxas holds such loop
 * invariants for the whole loop and, beside dK and dV, spilled them.
 * Offsets are in elements. */
struct BlockState {
    int64_t k0;                // first key of the block
    int64_t i_begin, i_end;    // the query rows that can see a key of the block
    int64_t full_lo, full_hi;  // the rows [full_lo, full_hi) see every key of it
    int64_t q_off, dout_off;   // q, dout of (b, first query head of the group)
    int64_t lse_off, dq_off;   // lse/delta (b, that head); the dq target's
    const int32_t *qids;       // M with documents: the batch row's query ids
    int group;                 // query heads per kv head
};

/* One query row's statistics as the P/dS step reads them, 16 bytes: one
 * 128-bit shared load per row where three 32-bit ones were (the 8 rows a
 * warp's load touches are 8 distinct 16-byte words: one wavefront). */
struct __align__(16) RowStats {
    float lse2;   // lse log2 e, or +inf for a row that contributes nothing
    float band;   // the exponent rule's band
    float dls;    // delta times the softmax scale (0 for such a row)
    int32_t qid;  // M with documents: the row's document id
};
static_assert(sizeof(RowStats) == 16, "one 128-bit load");

template <int D, bool M>
struct Layout {
    static constexpr int kKV = kBlockN * D * 2;        // one of K, V
    static constexpr int kQT = kBlockM * D * 2;        // one Q or dout tile
    static constexpr int kPT = kBlockM * kBlockN * 2;  // P or dS
    static constexpr int kK = 0;
    static constexpr int kV = kK + kKV;
    static constexpr int kQ = kV + kKV;       // 2 stages
    static constexpr int kDO = kQ + 2 * kQT;  // 2 stages
    static constexpr int kP = kDO + 2 * kQT;
    static constexpr int kDS = kP + kPT;
    static constexpr int kStats = kDS + kPT;                    // RowStats[2][64]
    static constexpr int kKid = kStats + 2 * kBlockM * 16;      // M: int32[128]
    static constexpr int kWords = kKid + kBlockN * 4;           // M: uint32[2 * kWarps]
    static constexpr int kState = M ? kWords + 2 * kWarps * 4 : kKid;  // BlockState
    static constexpr int kBytes = kState + 128;
    // the epilogue's float32 dK and dV, rows padded by 8 floats (32 bytes:
    // the 8 rows one fragment store touches fall into distinct bank groups
    // two by two, the least a 256-byte warp store can take)
    static constexpr int kEpiStride = D + 8;  // floats per row
    static constexpr int kEpiDK = 0;
    static constexpr int kEpiDV = kBlockN * kEpiStride * 4;
    static_assert(kEpiDV + kBlockN * kEpiStride * 4 <= kBytes, "epilogue fits");
};

}  // namespace bwd_fused
}  // namespace ra

#endif /* RA_ATTN_BWD_FUSED_CUH */
