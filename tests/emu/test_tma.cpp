/*
 * test_tma.cpp -- the emulated GPU's bulk copies and mbarriers, through
 * the kernels' wrappers (cuda/hopper/ptx_sm90.cuh) and the host helper
 * that makes tensor maps (cuda/hopper/tensor_map.h: cuTensorMapEncodeTiled
 * reached through cudaGetDriverEntryPoint, as the real build reaches the
 * driver's), against a direct strided copy computed here:
 *
 *   cp.async.bulk.tensor loads of 1-D to 5-D boxes: in bounds, partly and
 *     wholly out of bounds (zeros), element strides, no swizzle and the
 *     32B/64B/128B swizzles (the 16-byte chunk of shared address A moved to
 *     chunk ((A >> 4) ^ (A >> 7)) & (span/16 - 1)), several boxes through
 *     one mbarrier (phases 0, 1, 2, ... alternate the parity waited for)
 *   bulk tensor stores (out-of-bounds elements left alone), the plain
 *     cp.async.bulk load, expect_tx announced before or after the copy
 *   mbarrier phases between two warps over many rounds (arrive / wait,
 *     checked race-free), parity 1 on a fresh barrier returning at once
 *   the encoder refusing what the driver refuses
 *
 * and broken uses each of which must be flagged (tests/test_emu_hopper.py):
 * a wait on a phase that never completes, a bulk copy destination read
 * before its phase completes (with the checker off: poison), read by a
 * warp that did not wait for the completed phase, expect_tx bytes that
 * never arrive, an mbarrier never initialised, a bulk store's source
 * written before its wait_group.read, a store of generic writes with no
 * fence.proxy.async.
 *
 * Usage: test_tma [case]; no case runs every working case.
 */
#include "hopper/ptx_sm90.cuh"
#include "hopper/tensor_map.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

#include "emu/emu.h"
#include "kernel_test.h"

using namespace ra::sm90;

enum { kDst = 1024, kSmem = 1024 + 65536 };

/* ---- tensors and maps ----------------------------------------------------------------- */

struct Tensor {
    int rank;
    uint64_t dims[5], strides[4];   /* strides in bytes, dims 1.. */
    size_t bytes;
    uint16_t *dev;
    std::vector<uint16_t> host;
};

static uint16_t value_at(size_t elem) { return (uint16_t)(1 + elem % 65000); }

/* a 16-bit tensor whose rows are padded to a multiple of 16 bytes (+16) */
static Tensor make_tensor(int rank, const uint64_t *dims) {
    Tensor t;
    t.rank = rank;
    uint64_t s = (dims[0] * 2 + 15) / 16 * 16 + 16;
    for (int i = 0; i < rank; i++) t.dims[i] = dims[i];
    for (int i = 1; i < rank; i++) {
        t.strides[i - 1] = s;
        s *= dims[i];
    }
    t.bytes = rank > 1 ? (size_t)s : (size_t)dims[0] * 2;
    t.host.assign(t.bytes / 2, 0);
    for (size_t i = 0; i < t.host.size(); i++) t.host[i] = value_at(i);
    CK(cudaMalloc((void **)&t.dev, t.bytes));
    CK(cudaMemcpy(t.dev, t.host.data(), t.bytes, cudaMemcpyHostToDevice));
    return t;
}

static CUtensorMapSwizzle swizzle_of(int span) {
    return span == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : span == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
           : span == 32 ? CU_TENSOR_MAP_SWIZZLE_32B : CU_TENSOR_MAP_SWIZZLE_NONE;
}

static CUtensorMap make_map(const Tensor &t, const uint32_t *box, const uint32_t *estride,
                            int swizzle /* span bytes or 0 */) {
    char err[300] = "";
    CUtensorMap m;
    if (ra_tensor_map_tiled(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (unsigned)t.rank, t.dev,
                            t.dims, t.strides, box, estride, swizzle_of(swizzle), err,
                            sizeof err) != 0) {
        fprintf(stderr, "a valid tensor map refused: %s\n", err);
        exit(1);
    }
    return m;
}

/* what a box at coords lands as in shared memory at kDst: a direct
 * strided copy, then the swizzle of each element's shared address */
static std::vector<uint16_t> expected_box(const Tensor &t, const uint32_t *box,
                                          const uint32_t *estride, int swizzle,
                                          const int *coords, size_t *bytes) {
    unsigned cnt[5] = {1, 1, 1, 1, 1};
    for (int i = 0; i < t.rank; i++) cnt[i] = i == 0 ? box[0] : (box[i] + estride[i] - 1) / estride[i];
    const size_t n = (size_t)cnt[0] * cnt[1] * cnt[2] * cnt[3] * cnt[4];
    *bytes = n * 2;
    std::vector<uint16_t> img(n, 0xdead);
    size_t dense = 0;
    for (unsigned j4 = 0; j4 < cnt[4]; j4++)
        for (unsigned j3 = 0; j3 < cnt[3]; j3++)
            for (unsigned j2 = 0; j2 < cnt[2]; j2++)
                for (unsigned j1 = 0; j1 < cnt[1]; j1++)
                    for (unsigned j0 = 0; j0 < cnt[0]; j0++, dense++) {
                        const unsigned j[5] = {j0, j1, j2, j3, j4};
                        bool in = true;
                        size_t byte = 0;
                        for (int i = 0; i < t.rank; i++) {
                            const long g = coords[i] + (long)j[i] * (i ? estride[i] : 1);
                            if (g < 0 || g >= (long)t.dims[i]) in = false;
                            byte += (size_t)g * (i ? t.strides[i - 1] : 2);
                        }
                        uint32_t a = kDst + (uint32_t)dense * 2;
                        if (swizzle) {
                            const uint32_t chunks = (uint32_t)swizzle / 16 - 1;
                            a = (a & ~(chunks << 4)) | ((((a >> 4) ^ (a >> 7)) & chunks) << 4);
                        }
                        img[(a - kDst) / 2] = in ? t.host[byte / 2] : 0;
                    }
    return img;
}

/* ---- loads ----------------------------------------------------------------------------- */

__global__ void k_load(const __grid_constant__ CUtensorMap map, int rank, const int *coords,
                       int nbox, unsigned bytes, uint16_t *out, int expect_after) {
    unsigned char *s = ra::dynamic_smem();
    uint64_t *bar = (uint64_t *)s;
    uint16_t *dst = (uint16_t *)(s + kDst);
    const int t = threadIdx.x;
    if (t == 0) {
        tma_prefetch_map(&map);
        mbar_init(bar, 1);
        mbar_init_fence();
    }
    __syncthreads();
    for (int b = 0; b < nbox; b++) {
        if (t == 0) {
            const int *c = coords + 5 * b;
            if (!expect_after) mbar_arrive_expect_tx(bar, bytes);
            switch (rank) {
            case 1: tma_load_1d(dst, &map, bar, c[0]); break;
            case 2: tma_load_2d(dst, &map, bar, c[0], c[1]); break;
            case 3: tma_load_3d(dst, &map, bar, c[0], c[1], c[2]); break;
            case 4: tma_load_4d(dst, &map, bar, c[0], c[1], c[2], c[3]); break;
            default: tma_load_5d(dst, &map, bar, c[0], c[1], c[2], c[3], c[4]); break;
            }
            if (expect_after) mbar_arrive_expect_tx(bar, bytes);
        }
        mbar_wait(bar, (uint32_t)(b & 1));
        for (unsigned i = t; i < bytes / 2; i += blockDim.x) out[b * (bytes / 2) + i] = dst[i];
        __syncthreads();   /* every read before the next box overwrites dst */
    }
}

struct LoadCase {
    const char *name;
    int rank;
    uint64_t dims[5];
    uint32_t box[5], estride[5];
    int swizzle;
    int coords[4][5];
    int nbox;
};

static bool load_case(const LoadCase &lc, int expect_after) {
    Tensor t = make_tensor(lc.rank, lc.dims);
    const CUtensorMap map = make_map(t, lc.box, lc.estride, lc.swizzle);
    size_t bytes = 0;
    std::vector<std::vector<uint16_t>> want;
    for (int b = 0; b < lc.nbox; b++)
        want.push_back(expected_box(t, lc.box, lc.estride, lc.swizzle, lc.coords[b], &bytes));
    int *dc;
    uint16_t *dout;
    CK(cudaMalloc((void **)&dc, sizeof lc.coords));
    CK(cudaMalloc((void **)&dout, bytes * lc.nbox));
    CK(cudaMemcpy(dc, lc.coords, sizeof lc.coords, cudaMemcpyHostToDevice));
    CK(cudaFuncSetAttribute(k_load, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    CK(RA_LAUNCH(k_load, 1, 96, kSmem, 0)(map, lc.rank, dc, lc.nbox, (unsigned)bytes, dout,
                                          expect_after));
    CK(cudaDeviceSynchronize());
    std::vector<uint16_t> got(bytes / 2 * lc.nbox);
    CK(cudaMemcpy(got.data(), dout, bytes * lc.nbox, cudaMemcpyDeviceToHost));
    bool ok = true;
    for (int b = 0; b < lc.nbox && ok; b++)
        for (size_t i = 0; i < bytes / 2 && ok; i++)
            if (got[b * (bytes / 2) + i] != want[b][i]) {
                fprintf(stderr, "%s box %d element %zu: %u, want %u\n", lc.name, b, i,
                        got[b * (bytes / 2) + i], want[b][i]);
                ok = false;
            }
    CK(cudaFree(dc));
    CK(cudaFree(dout));
    CK(cudaFree(t.dev));
    return ok;
}

static const LoadCase kLoads[] = {
    {"1d", 1, {1000}, {256}, {1}, 0, {{0}, {900}, {-100}, {2000}}, 4},
    {"2d sw128", 2, {100, 37}, {64, 16}, {1, 1}, 128,
     {{0, 0}, {50, 30}, {-8, -3}, {200, 0}}, 4},
    {"2d sw64", 2, {100, 37}, {32, 8}, {1, 1}, 64, {{3, 5}, {90, -2}}, 2},
    {"2d sw32", 2, {100, 37}, {16, 8}, {1, 1}, 32, {{16, 36}, {-9, 0}}, 2},
    {"2d none", 2, {100, 37}, {40, 5}, {1, 1}, 0, {{1, 1}, {70, 35}, {0, 0}}, 3},
    {"3d sw64 estride", 3, {32, 5, 7}, {32, 4, 3}, {1, 2, 1}, 64, {{0, 1, 2}, {0, -1, 5}}, 2},
    {"4d sw32 estride", 4, {16, 3, 4, 5}, {16, 2, 3, 2}, {1, 1, 2, 1}, 32,
     {{0, 0, 0, 0}, {-4, 2, 1, 4}, {8, 1, -1, 3}}, 3},
    {"5d", 5, {8, 2, 3, 2, 2}, {8, 2, 2, 2, 2}, {1, 1, 1, 1, 1}, 0,
     {{0, 0, 0, 0, 0}, {0, 1, 2, 1, 1}}, 2},
};

/* ---- stores, the plain bulk copy ---------------------------------------------------------- */

__global__ void k_store(const __grid_constant__ CUtensorMap map, int c0, int c1, int bug) {
    unsigned char *s = ra::dynamic_smem();
    uint16_t *src = (uint16_t *)(s + kDst);
    const int t = threadIdx.x;
    /* the box (64 x 16 elements, 128B swizzle): element (r, c) = 7 r + c + 3 */
    for (int i = t; i < 64 * 16; i += blockDim.x) {
        const int r = i / 64, c = i % 64;
        uint32_t a = kDst + (uint32_t)(r * 128 + c * 2);
        a ^= ((a >> 7) & 7) << 4;
        src[(a - kDst) / 2] = (uint16_t)(7 * r + c + 3);
    }
    if (bug != 2) fence_proxy_async();   /* 2: no proxy fence */
    __syncthreads();
    if (t == 0) {
        tma_store_2d(&map, src, c0, c1);
        tma_store_commit();
        if (bug == 1) src[5] = 1;         /* 1: the source written before the wait */
        tma_store_wait_read<0>();
        tma_store_wait<0>();
    }
}

static bool store_case() {
    const uint64_t dims[2] = {100, 37};
    Tensor t = make_tensor(2, dims);
    std::vector<uint16_t> init(t.bytes / 2, 0xeeee);
    CK(cudaMemcpy(t.dev, init.data(), t.bytes, cudaMemcpyHostToDevice));
    const uint32_t box[2] = {64, 16}, one[2] = {1, 1};
    const CUtensorMap map = make_map(t, box, one, 128);
    CK(cudaFuncSetAttribute(k_store, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    CK(RA_LAUNCH(k_store, 1, 64, kSmem, 0)(map, 50, 30, 0));
    CK(cudaDeviceSynchronize());
    std::vector<uint16_t> got(t.bytes / 2);
    CK(cudaMemcpy(got.data(), t.dev, t.bytes, cudaMemcpyDeviceToHost));
    CK(cudaFree(t.dev));
    for (size_t i = 0; i < got.size(); i++) {
        const size_t row = i * 2 / t.strides[0], col = i * 2 % t.strides[0] / 2;
        const bool in = col < 100 && row < 37 && col >= 50 && col < 50 + 64 && row >= 30 &&
                        row < 30 + 16;
        const uint16_t want = in ? (uint16_t)(7 * (row - 30) + (col - 50) + 3) : 0xeeee;
        if (got[i] != want) {
            fprintf(stderr, "store (%zu, %zu): %u, want %u\n", row, col, got[i], want);
            return false;
        }
    }
    return true;
}

__global__ void k_bulk(const uint16_t *src, uint16_t *out, unsigned bytes) {
    unsigned char *s = ra::dynamic_smem();
    uint64_t *bar = (uint64_t *)s;
    uint16_t *dst = (uint16_t *)(s + kDst);
    if (threadIdx.x == 0) {
        mbar_init(bar, 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        bulk_load(dst, src, bytes, bar);       /* the bytes first, */
        mbar_arrive_expect_tx(bar, bytes);     /* then the announcement */
    }
    mbar_wait(bar, 0);
    for (unsigned i = threadIdx.x; i < bytes / 2; i += blockDim.x) out[i] = dst[i];
}

static bool bulk_case() {
    const unsigned bytes = 4096 + 48;
    std::vector<uint16_t> h(bytes / 2);
    for (size_t i = 0; i < h.size(); i++) h[i] = value_at(i * 3);
    uint16_t *src, *out;
    CK(cudaMalloc((void **)&src, bytes));
    CK(cudaMalloc((void **)&out, bytes));
    CK(cudaMemcpy(src, h.data(), bytes, cudaMemcpyHostToDevice));
    CK(cudaFuncSetAttribute(k_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    CK(RA_LAUNCH(k_bulk, 1, 64, kSmem, 0)(src, out, bytes));
    CK(cudaDeviceSynchronize());
    std::vector<uint16_t> got(h.size());
    CK(cudaMemcpy(got.data(), out, bytes, cudaMemcpyDeviceToHost));
    CK(cudaFree(src));
    CK(cudaFree(out));
    return got == h;
}

/* ---- mbarrier phases between warps ------------------------------------------------------- */

/* warp 0 hands round i's value to warp 1 through shared memory behind
 * barrier `full` (32 arrivals), warp 1 answers behind `empty`; 9 rounds, so
 * each barrier goes through phases 0..8 and the parity alternates */
__global__ void k_pingpong(unsigned *out) {
    unsigned char *s = ra::dynamic_smem();
    uint64_t *full = (uint64_t *)s, *empty = full + 1;
    unsigned *x = (unsigned *)(s + 64), *y = x + 32;
    const unsigned t = threadIdx.x, lane = t % 32;
    if (t == 0) {
        mbar_init(full, 32);
        mbar_init(empty, 32);
        mbar_init_fence();
    }
    __syncthreads();
    /* a fresh barrier: the phase before phase 0 counts as complete */
    const bool fresh = mbar_test_wait(empty, 1);
    unsigned sum = 0;
    for (unsigned i = 0; i < 9; i++) {
        if (t < 32) {
            x[lane] = i * 100 + lane;
            mbar_arrive(full);
            mbar_wait(empty, i & 1);
            sum += y[lane];
        } else {
            mbar_wait(full, i & 1);
            y[lane] = x[lane] * 2;
            mbar_arrive(empty);
        }
    }
    out[t] = sum + (fresh ? 1000000u : 0u);
}

static bool pingpong_case() {
    unsigned *d;
    CK(cudaMalloc((void **)&d, 64 * 4));
    CK(RA_LAUNCH(k_pingpong, 1, 64, 512, 0)(d));
    CK(cudaDeviceSynchronize());
    unsigned h[64];
    CK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
    CK(cudaFree(d));
    for (unsigned t = 0; t < 64; t++) {
        unsigned want = 1000000u;
        for (unsigned i = 0; i < 9 && t < 32; i++) want += 2 * (i * 100 + t);
        if (h[t] != want) {
            fprintf(stderr, "pingpong thread %u: %u, want %u\n", t, h[t], want);
            return false;
        }
    }
    return true;
}

static bool encode_refusals() {
    const uint64_t dims[2] = {100, 37};
    Tensor t = make_tensor(2, dims);
    char err[300];
    CUtensorMap m;
    ra_tensor_map_encode_fn enc = ra_tensor_map_encoder(err, sizeof err);
    const uint32_t one[2] = {1, 1}, box_big[2] = {257, 1}, box_wide[2] = {128, 4};
    const uint64_t odd_stride[1] = {200};
    bool ok = true;
    /* box over 256, a stride not a multiple of 16, a box wider than its swizzle */
    ok &= enc(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, t.dev, t.dims, t.strides, box_big, one,
              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
              CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) ==
          CUDA_ERROR_INVALID_VALUE;
    ok &= enc(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, t.dev, t.dims, odd_stride, box_wide,
              one, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
              CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) ==
          CUDA_ERROR_INVALID_VALUE;
    ok &= ra_tensor_map_tiled(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, t.dev, t.dims,
                              t.strides, box_wide, nullptr, CU_TENSOR_MAP_SWIZZLE_128B, err,
                              sizeof err) == -1 &&
          strstr(err, "cuTensorMapEncodeTiled returned 1") != nullptr &&
          strstr(err, "box 128 4") != nullptr;
    ok &= ra_tensor_map_tiled(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, t.dev, t.dims,
                              t.strides, box_wide, nullptr, CU_TENSOR_MAP_SWIZZLE_NONE, err,
                              sizeof err) == 0;
    void *p = &m;
    enum cudaDriverEntryPointQueryResult q;
    ok &= cudaGetDriverEntryPointByVersion("cuNoSuchFunction", &p, 12000, cudaEnableDefault,
                                           &q) == cudaSuccess &&
          p == nullptr && q == cudaDriverEntryPointSymbolNotFound;
    CK(cudaFree(t.dev));
    return ok;
}

/* ---- broken uses --------------------------------------------------------------------------- */

__global__ void k_bugs(const __grid_constant__ CUtensorMap map, uint16_t *out, int bug) {
    unsigned char *s = ra::dynamic_smem();
    uint64_t *bar = (uint64_t *)s, *bar2 = bar + 1, *never = bar + 2;
    uint16_t *dst = (uint16_t *)(s + kDst);
    const unsigned bytes = 64 * 16 * 2, t = threadIdx.x;
    if (t == 0) {
        mbar_init(bar, 1);
        mbar_init(bar2, 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (bug == 1) {                        /* wait on a phase nothing completes */
        if (t == 0) {
            mbar_arrive_expect_tx(bar, bytes);
            tma_load_2d(dst, &map, bar, 0, 0);
        }
        mbar_wait(bar, 0);
        mbar_wait(bar, 1);
    } else if (bug == 2) {                 /* read before the phase completes */
        if (t == 0) {
            mbar_arrive_expect_tx(bar, 2 * bytes);   /* two boxes */
            tma_load_2d(dst, &map, bar, 0, 0);
            mbar_arrive(bar2);
        }
        if (t >= 32) {
            mbar_wait(bar2, 0);
            out[t] = dst[t];                   /* the first box has not landed */
        }
        __syncthreads();
        if (t == 0) tma_load_2d(dst + 64 * 16, &map, bar, 0, 16);
        mbar_wait(bar, 0);
    } else if (bug == 3) {                 /* expect_tx bytes that never arrive */
        if (t == 0) {
            mbar_arrive_expect_tx(bar, bytes + 1024);
            tma_load_2d(dst, &map, bar, 0, 0);
        }
        mbar_wait(bar, 0);
    } else if (bug == 4) {                 /* an mbarrier nobody initialised */
        if (t == 0) mbar_arrive(never);
    } else if (bug == 5) {                 /* a warp reads what only warp 0 waited for */
        if (t == 0) {
            mbar_arrive_expect_tx(bar, bytes);
            tma_load_2d(dst, &map, bar, 0, 0);
            mbar_arrive(bar2);               /* before its own wait: carries nothing */
            mbar_wait(bar, 0);
        }
        if (t >= 32) {
            mbar_wait(bar2, 0);
            out[t] = dst[t];
        }
    }
}

static int run_broken(const char *name) {
    const std::string c = name;
    const uint64_t dims[2] = {100, 37};
    Tensor t = make_tensor(2, dims);
    const uint32_t box[2] = {64, 16}, one[2] = {1, 1};
    const CUtensorMap map = make_map(t, box, one, 128);
    uint16_t *out;
    CK(cudaMalloc((void **)&out, 64 * 2));
    CK(cudaMemset(out, 0, 64 * 2));
    CK(cudaFuncSetAttribute(k_bugs, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    CK(cudaFuncSetAttribute(k_store, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    const struct { const char *name; int bug; } bugs[] = {
        {"wrong_phase", 1}, {"tma_early_read", 2}, {"expect_tx_never", 3},
        {"mbar_uninit", 4}, {"tma_unwaited_warp", 5}};
    cudaError_t e = cudaErrorUnknown;
    bool launched = false;
    for (const auto &b : bugs)
        if (c == b.name) {
            e = RA_LAUNCH(k_bugs, 1, 64, kSmem, 0)(map, out, b.bug);
            launched = true;
        }
    if (c == "tma_early_read_unchecked") {
        CK(RA_LAUNCH(k_bugs, 1, 64, kSmem, 0)(map, out, 2));
        CK(cudaDeviceSynchronize());
        uint16_t h[64];
        CK(cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost));
        if (h[40] == 0xffff) {
            printf("flagged: the destination read before its mbarrier phase completed is "
                   "poison (0x%04x)\n", h[40]);
            return 0;
        }
        fprintf(stderr, "case %s: the early read gave 0x%04x\n", name, h[40]);
        return 1;
    }
    if (c == "store_source_overwrite" || c == "store_no_proxy_fence") {
        e = RA_LAUNCH(k_store, 1, 64, kSmem, 0)(map, 0, 0, c == "store_source_overwrite" ? 1 : 2);
        launched = true;
    }
    if (!launched) {
        fprintf(stderr, "unknown case %s\n", name);
        return 2;
    }
    return expect_flagged(name, e, "");
}

int main(int argc, char **argv) {
    if (argc > 1) return run_broken(argv[1]);
    int bad = 0;
    for (const LoadCase &lc : kLoads)
        for (int after = 0; after < 2; after++)
            if (!load_case(lc, after)) {
                fprintf(stderr, "FAIL load %s%s\n", lc.name, after ? " (expect_tx after)" : "");
                bad++;
            }
    if (!store_case()) { fprintf(stderr, "FAIL store\n"); bad++; }
    if (!bulk_case()) { fprintf(stderr, "FAIL cp.async.bulk\n"); bad++; }
    if (!pingpong_case()) { fprintf(stderr, "FAIL mbarrier ping-pong\n"); bad++; }
    if (!encode_refusals()) { fprintf(stderr, "FAIL cuTensorMapEncodeTiled refusals\n"); bad++; }
    if (ra_emu_reports_count() != 0) {
        fprintf(stderr, "FAIL reports:\n%s\n", ra_emu_reports_text());
        bad++;
    }
    if (bad == 0) printf("ok\n");
    return bad ? 1 : 0;
}
