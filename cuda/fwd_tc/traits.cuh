/*
 * fwd_tc/traits.cuh -- the shapes of the tensor-core forward (attn_fwd_tc.cu):
 * tiles, warps, pipeline depth, shared-memory layout, and the constants of
 * its softmax.  Every choice carries the performance model's number
 * (docs/results.md "Performance model", design C'; predicted, H100 SXM,
 * bf16 D 128 S 16k causal unless said otherwise).
 */
#ifndef RA_FWD_TC_TRAITS_CUH
#define RA_FWD_TC_TRAITS_CUH

namespace ra {
namespace fwd_tc {

template <int D_>
struct Traits {
    static constexpr int D = D_;                 // head_dim: 64 or 128
    static_assert(D == 64 || D == 128, "the tensor-core forward takes head_dim 64 or 128");

    // 128 query rows per block, 8 warps x 16 rows: every K/V tile is
    // streamed once per 128 rows, not 64 (L2 -> SM traffic halved; model:
    // -20 % against 64-row blocks, design C vs B)
    static constexpr int kWarps = 8;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kWarpRows = 16;
    static constexpr int kBlockQ = kWarps * kWarpRows;
    // 64 keys per K/V tile: S is 16 x 64 per warp (32 float registers per
    // thread); 128 would not fit D 64's budget below
    static constexpr int kBlockK = 64;
    // 2 stages: tile n + 1 loads (cp.async) while tile n computes
    static constexpr int kStages = 2;

    static constexpr int kRowBytes = D * 2;      // one 16-bit row
    static constexpr int kChunks = D / 8;        // 16-byte chunks per row
    static constexpr int kQBytes = kBlockQ * kRowBytes;
    static constexpr int kTileBytes = kBlockK * kRowBytes;        // one K or V tile
    static constexpr int kStageBytes = 2 * kTileBytes;            // K, then V
    static constexpr int kKVBytes = kStages * kStageBytes;
    // masked variant: the key ids of each stage, then DocTiles' words
    static constexpr int kIdsOffset = kQBytes + kKVBytes;
    static constexpr int kWordsOffset = kIdsOffset + kStages * kBlockK * 4;

    // dynamic shared memory: Q 128 x D, 2 stages of K and V 64 x D
    // (96 KB at D 128, 48 KB at D 64), with M the ids and 2 x 8 words
    static constexpr size_t smem_bytes(bool masked) {
        return masked ? (size_t)kWordsOffset + 2 * kWarps * 4 : (size_t)kQBytes + kKVBytes;
    }

    // Registers: at D 64, 2 blocks per SM (16 warps, 4 per scheduler) need
    // <= 128 registers per thread (model: 1.08-1.09x SDPA flash; 0.94-1.01x
    // with 1 block).  The masked variant's extra state (document walk,
    // spans, softcap) does not fit 128 without spilling: 1 block per SM.
    // At D 128 one block per SM whatever the count <= 255 (2 blocks would
    // need <= 128: model 0.96-0.99x against 0.88-1.02x, not reachable with
    // O's 64 registers).
    static constexpr int min_blocks(bool masked) { return D == 64 && !masked ? 2 : 1; }
};

/* The online softmax (softmax.cuh). */
// Lazy rescale: a row keeps its pivot until a tile's max exceeds it by
// more than 2^8 (in log2 units: 8); P then stays <= 2^8, far from float16's
// and float32's ranges.  Skips the 2 x D / 8 multiplies of O on almost
// every tile (model: -2 %, design C' vs C).
constexpr float kRescaleAbove = 8.0f;
// Scale folded into the exponent's FFMA, P = 2^(s * scale_log2 - pivot
// * scale_log2) (model, with ex2.approx: -4 %, design A): exact enough
// while |pivot * scale_log2| < 2^10 (the rounding of the product is then
// below 2^-14 in the exponent, a relative 2^-14.5 in P); a row with a larger
// pivot first subtracts the pivot from its raw scores, as an unfused kernel
// would (huge scores, cold).
constexpr float kFoldBelow = 1024.0f;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

}  // namespace fwd_tc
}  // namespace ra

#endif /* RA_FWD_TC_TRAITS_CUH */
