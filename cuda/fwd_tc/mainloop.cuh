/*
 * fwd_tc/mainloop.cuh -- what one warp of the tensor-core forward does per
 * key tile with the tensor cores, and how the tiles reach shared memory:
 *   FragAddr    the byte offsets of this lane's ldmatrix rows, computed once
 *   scores      S = Q K^T, 16 rows x 64 keys (fp32 C fragments)
 *   accumulate  O += P V, P from S's registers, V by ldmatrix.trans
 *   TileLoader  copies of a tile of rows into a swizzled shared tile
 * Shared memory (traits.cuh): Q at 0, stage s's K at kQBytes + s kStageBytes
 * and its V kTileBytes after it; every tile is swizzled as mma.cuh's swz
 * (16-byte chunk c of row r at chunk c ^ (r & 7)).
 */
#ifndef RA_FWD_TC_MAINLOOP_CUH
#define RA_FWD_TC_MAINLOOP_CUH

#include "mma.cuh"
#include "fwd_tc/traits.cuh"

namespace ra {
namespace fwd_tc {

/* The ldmatrix row addresses of one lane, as byte offsets from the shared
 * base.  An ldmatrix.x4 takes one row address per lane; with tile rows
 * starting at multiples of 8 the swizzle term (row & 7) is lane & 7 for
 * every fragment, so a k-step kk (16 columns, chunks 2 kk and 2 kk + 1)
 * reads chunk (2 kk + h) ^ (lane & 7) = 2 kk ^ x for a lane constant x =
 * h ^ (lane & 7) (h: the lane's chunk of the pair).  Chunks 8..15 (D 128)
 * are those of 0..7 plus 8.  So four offsets per operand, j = kk & 3, cover
 * every k-step: kk adds 128 bytes per 4 steps, the n-tile or key-step a
 * multiple of 16 rows, both immediates of the ldmatrix (today's kernel
 * recomputed the swizzle each tile: 4.9 integer instructions per
 * ldmatrix; the model's C' assumes <= 1.5: -6 %, design B vs A). */
template <class Tr>
struct FragAddr {
    uint32_t q[4];  // A of Q: rows warp*16 + lane % 16, chunk pair half lane / 16
    uint32_t k[4];  // B of K (stage 0): keys lane % 8 + 8 (lane / 16), half (lane / 8) % 2
    uint32_t v[4];  // B of V (stage 0, .trans): keys lane % 8 + 8 ((lane / 8) % 2), half lane / 16

    __device__ __forceinline__ FragAddr(int warp, int lane) {
        const int r7 = lane & 7, h16 = (lane >> 4) & 1, h8 = (lane >> 3) & 1;
        const uint32_t q_row = (uint32_t)(warp * 16 + (lane & 15)) * Tr::kRowBytes;
        const uint32_t k_row = Tr::kQBytes + (uint32_t)(r7 + 8 * h16) * Tr::kRowBytes;
        const uint32_t v_row = Tr::kQBytes + Tr::kTileBytes + (uint32_t)(r7 + 8 * h8) * Tr::kRowBytes;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            q[j] = q_row + 16u * (uint32_t)((2 * j) ^ (h16 ^ r7));
            k[j] = k_row + 16u * (uint32_t)((2 * j) ^ (h8 ^ r7));
            v[j] = v_row + 16u * (uint32_t)((2 * j) ^ (h16 ^ r7));
        }
    }
};

/* byte offset of k-step kk (16 columns) in a swizzled row: from the lane's
 * pattern kk & 3, the chunks 8..15 128 bytes on */
constexpr uint32_t kstep_bytes(int kk) { return 128u * (uint32_t)(kk >> 2); }

/* S = Q K^T for this warp's 16 rows and the tile's 64 keys (`stage`: the
 * byte offset of the K/V stage from stage 0).  Per warp and tile: D/16 A
 * and 4 D/16 B ldmatrix, 8 D/16 mma (D 128: 8 + 32 ldmatrix, 64 mma). */
template <typename T, class Tr>
__device__ __forceinline__ void scores(float (&s)[Tr::kBlockK / 8][4], const unsigned char *smem,
                                       const FragAddr<Tr> &fa, uint32_t stage) {
#pragma unroll
    for (int i = 0; i < Tr::kBlockK / 8; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < Tr::D / 16; kk++) {
        uint32_t a[4];
        ldmatrix_x4(a, smem + fa.q[kk & 3] + kstep_bytes(kk));
        const unsigned char *kb = smem + (fa.k[kk & 3] + stage) + kstep_bytes(kk);
#pragma unroll
        for (int n2 = 0; n2 < Tr::kBlockK / 16; n2++) {
            uint32_t b[4];
            ldmatrix_x4(b, kb + n2 * 16 * Tr::kRowBytes);
            mma_16816<T>(s[2 * n2], a, b[0], b[1]);
            mma_16816<T>(s[2 * n2 + 1], a, b[2], b[3]);
        }
    }
}

/* O += P V: P (16 x 64, the exponentiated S) as 16-bit A fragments, 16
 * keys per step, V's fragments by ldmatrix.trans (D 128: 32 ldmatrix, 64
 * mma per warp and tile). */
template <typename T, class Tr>
__device__ __forceinline__ void accumulate(float (&o)[Tr::D / 8][4],
                                           const float (&p)[Tr::kBlockK / 8][4],
                                           const unsigned char *smem, const FragAddr<Tr> &fa,
                                           uint32_t stage) {
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockK / 16; kk++) {
        uint32_t a[4];
        a_from_c<T>(a, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
        for (int d2 = 0; d2 < Tr::D / 16; d2++) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, smem + (fa.v[d2 & 3] + stage) + kstep_bytes(d2) +
                                     kk * 16 * Tr::kRowBytes);
            mma_16816<T>(o[2 * d2], a, b[0], b[1]);
            mma_16816<T>(o[2 * d2 + 1], a, b[2], b[3]);
        }
    }
}

/* Copies of ROWS rows of D 16-bit elements, global rows row0 .. row0 +
 * ROWS - 1 of a (seq, D) matrix `g` with row stride `ld` (elements), into
 * the swizzled shared tile at byte offset `tile`.  The block's threads
 * split the 16-byte chunks: this thread's column chunk and swizzled row
 * offset are fixed (kThreads is a multiple of 8 rows' chunks), its rows
 * step by kThreads / kChunks.
 *   load            cp.async, every row < limit (the key tiles but a
 *                   sequence's last): one address per tile, a step per chunk
 *   load_checked    rows >= limit zero: by cp.async zero-fill (ASYNC: the
 *                   Q tile), or by plain loads and stores (the last key
 *                   tile: once per block at most, so synchronous) */
template <class Tr>
struct TileLoader {
    static constexpr int kRowStep = Tr::kThreads / Tr::kChunks;
    static_assert(kRowStep % 8 == 0, "a thread's rows must keep their swizzle");
    int row;        // first row of this thread
    int col;        // its column (elements)
    uint32_t dst;   // byte offset of its first chunk in a tile

    __device__ __forceinline__ TileLoader(int tid) {
        row = tid / Tr::kChunks;
        const int c = tid % Tr::kChunks;
        col = 8 * c;
        dst = (uint32_t)row * Tr::kRowBytes + 16u * (uint32_t)(c ^ (row & 7));
    }

    template <int ROWS, typename T>
    __device__ __forceinline__ void load(unsigned char *smem, uint32_t tile, const T *g,
                                         int64_t ld, int64_t row0) const {
        static_assert(ROWS % kRowStep == 0, "tile must split evenly over threads");
        unsigned char *to = smem + tile + dst;
        const T *src = g + (row0 + row) * ld + col;
        const int64_t step = kRowStep * ld;
#pragma unroll
        for (int it = 0; it < ROWS / kRowStep; it++)
            cp_async<16>(to + it * kRowStep * Tr::kRowBytes, src + it * step, true);
    }

    template <int ROWS, bool ASYNC, typename T>
    __device__ __forceinline__ void load_checked(unsigned char *smem, uint32_t tile, const T *g,
                                                 int64_t ld, int64_t row0, int64_t limit) const {
        unsigned char *to = smem + tile + dst;
#pragma unroll
        for (int it = 0; it < ROWS / kRowStep; it++) {
            const int64_t r = row0 + row + it * kRowStep;
            const bool ok = r < limit;
            unsigned char *d = to + it * kRowStep * Tr::kRowBytes;
            if constexpr (ASYNC) {
                cp_async<16>(d, ok ? g + r * ld + col : g, ok);
            } else {
                uint4 x = make_uint4(0u, 0u, 0u, 0u);
                if (ok) x = *reinterpret_cast<const uint4 *>(g + r * ld + col);
                *reinterpret_cast<uint4 *>(d) = x;
            }
        }
    }
};

}  // namespace fwd_tc
}  // namespace ra

#endif /* RA_FWD_TC_MAINLOOP_CUH */
