/*
 * ptx_conformance.cu -- every PTX instruction ringattn's emulated GPU models
 * (csrc/emu), run on fixed pseudo-random inputs, with one digest (FNV-1a,
 * 64 bits) of each instruction's outputs and one over all of them.  The
 * inputs make every result exact on any hardware (small integers and
 * dyadic fractions, so float32 sums do not depend on the order of
 * summation; conversions of finite values only; no timing-dependent
 * answers), so the digests of a real GPU and of the emulator must agree bit
 * for bit.  tools/ptx_conformance.expected holds them.
 *
 *   mma.cuh family (sm_80+): cp.async (with zero fill), ldmatrix .x1 .x2
 *     .x4 (.trans), mma.sync.m16n8k16 f16/bf16, cvt.rn to f16 and bf16x2,
 *     shfl.sync (idx, xor, up, down, widths), vote.sync
 *   Hopper (sm_90a, cuda/hopper/ptx_sm90.cuh): wgmma.mma_async m64nNk16
 *     (shared operands filled with random values, read through descriptors
 *     of every swizzle and major-ness, A from registers or shared memory,
 *     several k-steps, scale-d 0/1), mbarrier phases (arrive, expect_tx,
 *     test_wait / try_wait parity answers), cp.async.bulk.tensor 1-5-D
 *     loads (out-of-bounds boxes, element strides, swizzles) and stores,
 *     cp.async.bulk, stmatrix, elect.sync, named barriers, setmaxnreg,
 *     fence.proxy.async
 *
 * Build: the GPU kit (tools/gpu_check.sh ptx) compiles it with
 *   nvcc -O2 -std=c++17 -arch=sm_90a -DRA_WITH_CUDA -Icsrc -Icuda
 * (the mma.sync half also runs on sm_90); the emulated build compiles it
 * against csrc/emu (tests/test_ptx_conformance.py).
 * Run: ptx_conformance [--expected FILE]: prints "name digest" lines and
 * "overall <digest>"; with FILE, compares and exits 1 on any difference.
 */
#include "mma.cuh"
#include "hopper/ptx_sm90.cuh"
#include "hopper/tensor_map.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <utility>
#include <vector>

#define CK(x)                                                                          \
    do {                                                                               \
        cudaError_t e_ = (x);                                                          \
        if (e_ != cudaSuccess) {                                                       \
            fprintf(stderr, "ptx_conformance: %s:%d: %s -> %s\n", __FILE__, __LINE__, #x, \
                    cudaGetErrorString(e_));                                           \
            exit(2);                                                                   \
        }                                                                              \
    } while (0)

/* a launch, then its configuration error (RA_LAUNCH is <<<...>>> on nvcc) */
#define GO(launch)                 \
    do {                           \
        launch;                    \
        CK(cudaGetLastError());    \
    } while (0)

using namespace ra::sm90;

/* ---- inputs, digests ------------------------------------------------------------------ */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd() {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 16);
}
static int small(int lo, int hi) { return lo + (int)(rnd() % (uint32_t)(hi - lo + 1)); }

/* a small integer as f16 or bf16 bits (exact) */
static uint16_t bits16(int v, bool bf16) {
    if (v == 0) return 0;
    const int sign = v < 0, a = sign ? -v : v;
    int e = 0;
    while ((a >> e) > 1) e++;
    const int frac = a - (1 << e);   /* < 2^e, e <= 3 */
    if (bf16) return (uint16_t)((sign << 15) | ((e + 127) << 7) | (frac << (7 - e)));
    return (uint16_t)((sign << 15) | ((e + 15) << 10) | (frac << (10 - e)));
}
static uint32_t pair16(bool bf16) {
    return (uint32_t)bits16(small(-4, 4), bf16) | (uint32_t)bits16(small(-4, 4), bf16) << 16;
}

static std::vector<std::pair<std::string, uint64_t>> g_digests;

static void digest(const std::string &name, const void *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ ((const unsigned char *)p)[i]) * 0x100000001b3ull;
    g_digests.emplace_back(name, h);
}

template <typename T> struct Dev {
    T *p = nullptr;
    size_t n;
    explicit Dev(size_t n_) : n(n_) { CK(cudaMalloc((void **)&p, n * sizeof(T))); }
    Dev(const std::vector<T> &h) : n(h.size()) {
        CK(cudaMalloc((void **)&p, n * sizeof(T)));
        CK(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    }
    ~Dev() { cudaFree(p); }
    std::vector<T> get() const {
        std::vector<T> h(n);
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
        return h;
    }
};
template <typename T> static void digest(const std::string &name, const Dev<T> &d) {
    const std::vector<T> h = d.get();
    digest(name, h.data(), h.size() * sizeof(T));
}

/* ---- the mma.sync family ------------------------------------------------------------------ */

__global__ void k_cp_async(const uint4 *src, uint4 *out) {
    uint4 *s = (uint4 *)ra::dynamic_smem();
    const int t = threadIdx.x;
    for (int i = 0; i < 4; i++) ra::cp_async16(s + 4 * t + i, src + 4 * t + i, (t + i) % 3 != 0);
    ra::cp_async_commit();
    ra::cp_async_wait<0>();
    for (int i = 0; i < 4; i++) out[4 * t + i] = s[4 * t + i];
}

__device__ __forceinline__ void ldsm(int num, int trans, uint32_t (&r)[4], const void *row) {
#ifdef RA_CUDA_EMULATED
    ra_emu_ldmatrix(r, row, num, trans);
#else
    const unsigned a = (unsigned)__cvta_generic_to_shared(row);
    if (num == 1 && !trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(a));
    else if (num == 1)
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(a));
    else if (num == 2 && !trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1]) : "r"(a));
    else if (num == 2)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1]) : "r"(a));
    else if (!trans)
        ra::ldmatrix_x4(r, row);
    else
        ra::ldmatrix_x4_trans(r, row);
#endif
}

__global__ void k_ldmatrix(const uint16_t *tile, uint32_t *out, int num, int trans) {
    uint16_t *s = (uint16_t *)ra::dynamic_smem();
    const int l = threadIdx.x;
    for (int i = l; i < 32 * 8; i += 32) s[i] = tile[i];
    __syncwarp();
    uint32_t r[4] = {0, 0, 0, 0};
    ldsm(num, trans, r, s + (8 * (l / 8) + (l * 5 + 3) % 8) * 8);
    for (int i = 0; i < 4; i++) out[4 * l + i] = r[i];
}

template <typename T>
__global__ void k_mma(const uint32_t *a, const uint32_t *b, const float *c, float *d) {
    const int l = threadIdx.x, o = blockIdx.x * 32 + l;
    uint32_t ar[4] = {a[4 * o], a[4 * o + 1], a[4 * o + 2], a[4 * o + 3]};
    float cr[4] = {c[4 * o], c[4 * o + 1], c[4 * o + 2], c[4 * o + 3]};
    ra::mma_16816<T>(cr, ar, b[2 * o], b[2 * o + 1]);
    ra::mma_16816<T>(cr, ar, b[2 * o + 1], b[2 * o]);   /* and accumulate again */
    for (int i = 0; i < 4; i++) d[4 * o + i] = cr[i];
}

__global__ void k_cvt(const float *x, uint32_t *out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const __half h = __float2half_rn(x[i]);
    out[2 * i] = (uint32_t)*(const uint16_t *)&h;
    out[2 * i + 1] = ra::pack2<ra::bf16_t>(x[i], -x[i]);
}

__global__ void k_shfl_vote(const uint32_t *x, uint32_t *out) {
    const unsigned l = threadIdx.x % 32, full = 0xffffffffu;
    const uint32_t v = x[threadIdx.x];
    uint32_t *o = out + 10 * threadIdx.x;
    o[0] = __shfl_sync(full, v, (int)((l * 7 + 3) % 32));
    o[1] = __shfl_xor_sync(full, v, 5);
    o[2] = __shfl_up_sync(full, v, 3);
    o[3] = __shfl_down_sync(full, v, 2);
    o[4] = __shfl_sync(full, v, 3, 8);
    o[5] = __shfl_xor_sync(full, v, 9, 16);
    o[6] = __shfl_down_sync(full, v, 5, 16);
    o[7] = (uint32_t)__any_sync(full, (v & 7) == 0);
    o[8] = (uint32_t)__all_sync(full, (v & 7) != 5);
    o[9] = __ballot_sync(full, v & 1);
}

static void sm80_family() {
    {
        std::vector<uint32_t> h(32 * 4 * 4);
        for (auto &v : h) v = rnd();
        Dev<uint32_t> src(h), out(h.size());
        GO(RA_LAUNCH(k_cp_async, 1, 32, 32 * 4 * 16, 0)((const uint4 *)src.p, (uint4 *)out.p));
        digest("cp.async.cg.shared.global 16 (zero fill)", out);
    }
    std::vector<uint16_t> tile(32 * 8);
    for (auto &v : tile) v = (uint16_t)rnd();
    Dev<uint16_t> dtile(tile);
    for (int num = 1; num <= 4; num *= 2)
        for (int trans = 0; trans < 2; trans++) {
            Dev<uint32_t> out(32 * 4);
            GO(RA_LAUNCH(k_ldmatrix, 1, 32, 32 * 8 * 2, 0)(dtile.p, out.p, num, trans));
            digest("ldmatrix.sync.aligned.m8n8.x" + std::to_string(num) + (trans ? ".trans" : ""),
                   out);
        }
    for (int bf = 0; bf < 2; bf++) {
        const int blocks = 8;
        std::vector<uint32_t> a(blocks * 32 * 4), b(blocks * 32 * 2);
        std::vector<float> c(blocks * 32 * 4);
        for (auto &v : a) v = pair16(bf);
        for (auto &v : b) v = pair16(bf);
        for (auto &v : c) v = (float)small(-64, 64) * 0.125f;
        Dev<uint32_t> da(a), db(b);
        Dev<float> dc(c), dd(c.size());
        if (bf) GO(RA_LAUNCH((k_mma<ra::bf16_t>), blocks, 32, 0, 0)(da.p, db.p, dc.p, dd.p));
        else GO(RA_LAUNCH((k_mma<ra::half_t>), blocks, 32, 0, 0)(da.p, db.p, dc.p, dd.p));
        digest(std::string("mma.sync.aligned.m16n8k16.row.col.f32.") + (bf ? "bf16" : "f16"), dd);
    }
    {
        const int n = 4096;
        std::vector<float> x(n);
        for (int i = 0; i < n; i++) {
            uint32_t u = rnd() ^ (rnd() << 16);
            if (((u >> 23) & 0xff) == 0xff) u &= ~(1u << 30);   /* finite: no NaN, no inf */
            if (i % 4 == 1) u = (u & 0x807fffffu) | ((uint32_t)small(100, 150) << 23);
            memcpy(&x[i], &u, 4);
        }
        Dev<float> dx(x);
        Dev<uint32_t> out(2 * n);
        GO(RA_LAUNCH(k_cvt, n / 128, 128, 0, 0)(dx.p, out.p, n));
        digest("cvt.rn.f16.f32, cvt.rn.bf16x2.f32", out);
    }
    {
        std::vector<uint32_t> x(64);
        for (auto &v : x) v = rnd();
        Dev<uint32_t> dx(x), out(64 * 10);
        GO(RA_LAUNCH(k_shfl_vote, 1, 64, 0, 0)(dx.p, out.p));
        digest("shfl.sync (idx, bfly, up, down), vote.sync (any, all, ballot)", out);
    }
}

/* ---- wgmma ----------------------------------------------------------------------------------- */

enum { kImg = 65536 };

struct WgCfg {
    uint32_t a_off, b_off, lbo_a, sbo_a, lbo_b, sbo_b, step_a, step_b;
    Swizzle sw_a, sw_b;
    int ksteps, accumulate;
};

template <int N, typename T, int TA, int TB, bool RS>
__global__ void __launch_bounds__(128, 1)
k_wgmma(const uint4 *img, const uint32_t *afrag, const float *c, float *d, WgCfg g) {
    unsigned char *s = ra::dynamic_smem();
    const int t = threadIdx.x;
    for (int i = t; i < kImg / 16; i += 128) ((uint4 *)s)[i] = img[i];
    fence_proxy_async();
    __syncthreads();
    float acc[N / 2];
    for (int i = 0; i < N / 2; i++) acc[i] = c[t * (N / 2) + i];
    uint32_t a[4][4];
    for (int k = 0; k < 4; k++)
        for (int j = 0; j < 4; j++) a[k][j] = afrag[(k * 128 + t) * 4 + j];
    wgmma_fence();
    for (int k = 0; k < g.ksteps; k++) {
        const uint64_t db = make_desc(s + g.b_off + k * g.step_b, g.lbo_b, g.sbo_b, g.sw_b);
        const bool accumulate = g.accumulate || k > 0;
        if (RS) {
            wgmma_rs<N, T, TB>(acc, a[k], db, accumulate);
        } else {
            const uint64_t da = make_desc(s + g.a_off + k * g.step_a, g.lbo_a, g.sbo_a, g.sw_a);
            wgmma_ss<N, T, TA, TB>(acc, da, db, accumulate);
        }
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_operand(acc);
    for (int i = 0; i < N / 2; i++) d[t * (N / 2) + i] = acc[i];
}

template <int N, typename T, int TA, int TB, bool RS>
static void wgmma_run(const char *layout, const WgCfg &g) {
    const bool bf = std::is_same<T, ra::bf16_t>::value;
    /* every 16-bit slot of shared memory a random small integer: whatever the
     * descriptors select, the product is exact */
    std::vector<uint16_t> img(kImg / 2);
    for (auto &v : img) v = bits16(small(-3, 3), bf);
    std::vector<uint32_t> afrag(4 * 128 * 4);
    for (auto &v : afrag) v = pair16(bf);
    std::vector<float> c(128 * (N / 2));
    for (auto &v : c) v = (float)small(-32, 32) * 0.25f;
    Dev<uint16_t> dimg(img);
    Dev<uint32_t> dafrag(afrag);
    Dev<float> dc(c), dd(c.size());
    CK(cudaFuncSetAttribute((k_wgmma<N, T, TA, TB, RS>),
                            cudaFuncAttributeMaxDynamicSharedMemorySize, kImg));
    GO(RA_LAUNCH((k_wgmma<N, T, TA, TB, RS>), 1, 128, kImg, 0)((const uint4 *)dimg.p, dafrag.p,
                                                               dc.p, dd.p, g));
    char name[160];
    snprintf(name, sizeof name, "wgmma.mma_async.m64n%dk16.f32.%s %s %s", N, bf ? "bf16" : "f16",
             RS ? "RS" : "SS", layout);
    digest(name, dd);
}

static void wgmma_family() {
    /* K-major 128B rows: 8-row atoms 1024 bytes apart, k-steps 32 bytes on */
    const WgCfg k128 = {0, 32768, 16, 1024, 16, 1024, 32, 32, SWIZZLE_128B, SWIZZLE_128B, 4, 1};
    wgmma_run<64, ra::half_t, 0, 0, false>("A K 128B, B K 128B", k128);
    wgmma_run<64, ra::bf16_t, 0, 0, false>("A K 128B, B K 128B", k128);
    wgmma_run<256, ra::bf16_t, 0, 0, true>("B K 128B", k128);
    wgmma_run<8, ra::bf16_t, 0, 0, false>("A K 128B, B K 128B", k128);
    WgCfg k128_new = k128;
    k128_new.accumulate = 0;
    wgmma_run<200, ra::half_t, 0, 0, false>("A K 128B, B K 128B, scale-d 0", k128_new);
    /* M/N-major: rows of k; 64B: 32 elements per row, next 8 k 512 bytes on,
     * next 32 m/n one LBO on */
    const WgCfg mn64 = {0, 32768, 2048, 512, 8192, 512, 1024, 1024, SWIZZLE_64B, SWIZZLE_64B, 2, 1};
    wgmma_run<64, ra::bf16_t, 1, 1, false>("A MN 64B, B MN 64B", mn64);
    wgmma_run<128, ra::half_t, 0, 1, true>("B MN 64B", mn64);
    /* 32B: K-major rows of 16 elements (one k-step per atom row) */
    const WgCfg k32 = {0, 32768, 16, 256, 16, 256, 2048, 4096, SWIZZLE_32B, SWIZZLE_32B, 2, 1};
    wgmma_run<64, ra::half_t, 0, 0, false>("A K 32B, B K 32B", k32);
    const WgCfg mn32 = {0, 32768, 1024, 256, 2048, 256, 512, 512, SWIZZLE_32B, SWIZZLE_32B, 2, 1};
    wgmma_run<24, ra::bf16_t, 1, 0, false>("A MN 32B, B K 32B", mn32);
    /* no swizzle: core matrices of 8 x 16 bytes, LBO along k, SBO along m/n */
    const WgCfg none = {0, 32768, 128, 256, 128, 256, 256, 256, SWIZZLE_NONE, SWIZZLE_NONE, 2, 1};
    wgmma_run<64, ra::bf16_t, 0, 0, false>("A K none, B K none", none);
    const WgCfg none_mn = {0, 32768, 1024, 128, 4096, 128, 2048, 8192, SWIZZLE_NONE,
                           SWIZZLE_NONE, 2, 1};
    wgmma_run<32, ra::half_t, 1, 1, false>("A MN none, B MN none", none_mn);
    wgmma_run<136, ra::bf16_t, 0, 1, true>("B MN none", none_mn);
    /* a B operand with 128B swizzle read N-major: 64 n per row */
    const WgCfg mn128 = {0, 32768, 16, 1024, 8192, 1024, 32, 2048, SWIZZLE_128B, SWIZZLE_128B,
                         2, 1};
    wgmma_run<128, ra::bf16_t, 0, 1, false>("A K 128B, B MN 128B", mn128);
}

/* The layouts of the Hopper backward's dQ = dS K (hopper/bwd_mainloop.cuh
 * issue_dq): A read M-major with the 128B swizzle (64 m per row), and at
 * D 64 a B whose start is 64 bytes into its swizzled rows.  Run after the
 * other families, so that their inputs (one random stream) and digests
 * stay as they were. */
static void wgmma_bwd_family() {
    const WgCfg mn128a = {0, 32768, 8192, 1024, 8192, 1024, 2048, 2048, SWIZZLE_128B,
                          SWIZZLE_128B, 2, 1};
    wgmma_run<64, ra::bf16_t, 1, 1, false>("A MN 128B, B MN 128B", mn128a);
    const WgCfg mn128c = {0, 32768 + 64, 8192, 1024, 8192, 1024, 2048, 2048, SWIZZLE_128B,
                          SWIZZLE_128B, 2, 1};
    wgmma_run<32, ra::half_t, 1, 1, false>("A MN 128B, B MN 128B +64 bytes", mn128c);
}

/* ---- mbarriers, named barriers, setmaxnreg, elect, stmatrix ---------------------------- */

/* an mbarrier wait with a deadline: a phase the device never completes (a
 * transaction count it reckons differently) sets *timeout instead of
 * hanging the GPU; the host then names the instruction */
__device__ __forceinline__ void wait_or_give_up(uint64_t *bar, uint32_t parity,
                                                unsigned *timeout) {
    for (int i = 0; i < (1 << 20); i++)
        if (mbar_try_wait(bar, parity)) return;
    atomicExch(timeout, 1u);
}

static unsigned *g_timeout;

/* the digest of out, or a TIMEOUT line when a kernel gave up waiting */
template <typename T> static void digest_waited(const std::string &name, const Dev<T> &out) {
    unsigned flag = 0;
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(&flag, g_timeout, 4, cudaMemcpyDeviceToHost));
    if (flag) {
        g_digests.emplace_back(name + " TIMEOUT (an mbarrier phase never completed)", 0);
        CK(cudaMemset(g_timeout, 0, 4));
        return;
    }
    digest(name, out);
}

__global__ void k_mbarrier(const uint4 *src, uint32_t *out, unsigned *timeout) {
    unsigned char *s = ra::dynamic_smem();
    uint64_t *bar = (uint64_t *)s;
    const unsigned t = threadIdx.x;
    uint32_t *o = out + 8 * t;
    if (t == 0) {
        mbar_init(bar, 2);
        mbar_init_fence();
    }
    __syncthreads();
    o[0] = mbar_test_wait(bar, 1);   /* the phase before phase 0: complete */
    o[1] = mbar_test_wait(bar, 0);   /* phase 0: no arrivals yet */
    __syncthreads();
    if (t == 0 || t == 64) mbar_arrive(bar);
    __syncthreads();
    o[2] = mbar_test_wait(bar, 0);   /* phase 0 complete */
    o[3] = mbar_try_wait(bar, 0);
    o[4] = mbar_test_wait(bar, 1);   /* phase 1: nothing yet */
    __syncthreads();
    if (t == 5) mbar_expect_tx(bar, 64);
    __syncthreads();
    if (t == 0 || t == 64) mbar_arrive(bar);
    if (t == 32) bulk_load(s + 128, src, 64, bar);
    wait_or_give_up(bar, 1, timeout);
    o[5] = mbar_test_wait(bar, 1);
    o[6] = ((const uint32_t *)(s + 128))[t % 16];
    o[7] = 0;
}

__global__ void __launch_bounds__(384, 1) k_sync(uint32_t *out) {
    unsigned *s = (unsigned *)ra::dynamic_smem();
    const unsigned t = threadIdx.x, lane = t % 32, warp = t / 32;
    uint32_t *o = out + 6 * t;
    /* FlashAttention-3's split: a producer warpgroup gives registers to two
     * consumer warpgroups */
    if (t < 128) setmaxnreg_dec<40>();
    else setmaxnreg_inc<232>();
    uint32_t leader = 99;
    o[0] = elect_one(&leader);
    o[1] = leader;
    const uint32_t mask = 0x8421f0f0u >> (warp % 4) | (1u << (warp + 3));
    uint32_t part = 77, me = 7;
    if ((mask >> lane) & 1) me = elect_sync(mask, &part);
    o[2] = part;
    o[3] = me;
    /* warpgroup 0 hands values to 1 and 2 behind named barrier 1, they
     * answer behind barrier 2 */
    if (t < 128) {
        s[t] = t * 3 + 1;
        named_bar_arrive(1, 384);
        named_bar_sync(2, 384);
        o[4] = s[128 + t] + s[256 + t];
    } else {
        named_bar_sync(1, 384);
        s[t] = s[t % 128] * (t / 128) + 1000;
        named_bar_arrive(2, 384);
        o[4] = 0;
    }
    o[5] = 0;
}

__global__ void k_stmatrix(uint16_t *out, int num, int trans) {
    uint16_t *s = (uint16_t *)ra::dynamic_smem();
    const int l = threadIdx.x;
    uint32_t r[4];
    for (int i = 0; i < 4; i++) r[i] = (uint32_t)(l * 8 + i * 2 + 1) | (uint32_t)(l * 8 + i * 2 + 2) << 16;
    for (int i = l; i < 32 * 8; i += 32) s[i] = 0;
    __syncwarp();
    void *row = s + (8 * (l / 8) + (l * 3 + 1) % 8) * 8;
    if (num == 1) stmatrix_x1(row, (const uint32_t(&)[1])r);
    else if (num == 2) stmatrix_x2(row, (const uint32_t(&)[2])r);
    else if (trans) stmatrix_x4_trans(row, r);
    else stmatrix_x4(row, r);
    __syncwarp();
    for (int i = l; i < 32 * 8; i += 32) out[i] = s[i];
}

static void sync_family() {
    {
        std::vector<uint32_t> h(16);
        for (auto &v : h) v = rnd();
        Dev<uint32_t> src(h), out(128 * 8);
        GO(RA_LAUNCH(k_mbarrier, 1, 128, 256, 0)((const uint4 *)src.p, out.p, g_timeout));
        digest_waited("mbarrier init/arrive/expect_tx/test_wait/try_wait.parity, cp.async.bulk",
                      out);
    }
    {
        Dev<uint32_t> out(384 * 6);
        GO(RA_LAUNCH(k_sync, 1, 384, 384 * 4, 0)(out.p));
        const std::vector<uint32_t> h = out.get();
        std::vector<uint32_t> elect, bars;
        for (int t = 0; t < 384; t++) {
            for (int i = 0; i < 4; i++) elect.push_back(h[6 * t + i]);
            bars.push_back(h[6 * t + 4]);
        }
        digest("elect.sync (full and partial masks)", elect.data(), elect.size() * 4);
        digest("bar.sync / bar.arrive (named), setmaxnreg.inc/dec", bars.data(), bars.size() * 4);
    }
    for (int v = 0; v < 4; v++) {
        const int num = v == 3 ? 4 : 1 << v, trans = v == 3;
        Dev<uint16_t> out(32 * 8);
        GO(RA_LAUNCH(k_stmatrix, 1, 32, 32 * 8 * 2, 0)(out.p, num, trans));
        digest("stmatrix.sync.aligned.m8n8.x" + std::to_string(num) + (trans ? ".trans" : ""),
               out);
    }
}

/* ---- bulk tensor copies -------------------------------------------------------------------- */

enum { kDst = 1024, kTmaSmem = 1024 + 32768 };

__global__ void k_tma(const __grid_constant__ CUtensorMap map, int rank, const int *coords,
                      int nbox, unsigned bytes, uint16_t *out, unsigned *timeout) {
    unsigned char *s = ra::dynamic_smem();
    uint64_t *bar = (uint64_t *)s;
    uint16_t *dst = (uint16_t *)(s + kDst);
    const int t = threadIdx.x;
    if (t == 0) {
        mbar_init(bar, 1);
        mbar_init_fence();
    }
    __syncthreads();
    for (int b = 0; b < nbox; b++) {
        if (t == 0) {
            const int *c = coords + 5 * b;
            mbar_arrive_expect_tx(bar, bytes);
            if (rank == 1) tma_load_1d(dst, &map, bar, c[0]);
            else if (rank == 2) tma_load_2d(dst, &map, bar, c[0], c[1]);
            else if (rank == 3) tma_load_3d(dst, &map, bar, c[0], c[1], c[2]);
            else if (rank == 4) tma_load_4d(dst, &map, bar, c[0], c[1], c[2], c[3]);
            else tma_load_5d(dst, &map, bar, c[0], c[1], c[2], c[3], c[4]);
        }
        wait_or_give_up(bar, (uint32_t)(b & 1), timeout);
        for (unsigned i = t; i < bytes / 2; i += blockDim.x) out[b * (bytes / 2) + i] = dst[i];
        __syncthreads();
    }
}

__global__ void k_tma_store(const __grid_constant__ CUtensorMap map, const uint16_t *img,
                            int c0, int c1) {
    uint16_t *src = (uint16_t *)(ra::dynamic_smem() + kDst);
    for (int i = threadIdx.x; i < 64 * 16; i += blockDim.x) src[i] = img[i];
    fence_proxy_async();
    __syncthreads();
    if (threadIdx.x == 0) {
        tma_store_2d(&map, src, c0, c1);
        tma_store_commit();
        tma_store_wait<0>();
    }
}

/* a 16-bit tensor of random values, rows padded to 16 bytes (+16) */
static std::vector<uint16_t> tensor(int rank, const uint64_t *dims, uint64_t *strides) {
    uint64_t s = (dims[0] * 2 + 15) / 16 * 16 + 16;
    for (int i = 1; i < rank; i++) {
        strides[i - 1] = s;
        s *= dims[i];
    }
    std::vector<uint16_t> h((rank > 1 ? s : dims[0] * 2) / 2);
    for (auto &v : h) v = (uint16_t)rnd();
    return h;
}

static CUtensorMap map_of(int rank, void *base, const uint64_t *dims, const uint64_t *strides,
                          const uint32_t *box, const uint32_t *estride, int swizzle) {
    char err[300] = "";
    CUtensorMap m;
    const CUtensorMapSwizzle sw = swizzle == 128 ? CU_TENSOR_MAP_SWIZZLE_128B
                                  : swizzle == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                  : swizzle == 32 ? CU_TENSOR_MAP_SWIZZLE_32B
                                                  : CU_TENSOR_MAP_SWIZZLE_NONE;
    if (ra_tensor_map_tiled(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (unsigned)rank, base, dims,
                            strides, box, estride, sw, err, sizeof err) != 0) {
        fprintf(stderr, "ptx_conformance: %s\n", err);
        exit(2);
    }
    return m;
}

struct TmaCfg {
    const char *name;
    int rank;
    uint64_t dims[5];
    uint32_t box[5], estride[5];
    int swizzle, nbox;
    int coords[4][5];
};

static void tma_family() {
    static const TmaCfg cfgs[] = {
        {"1d, none", 1, {1000}, {256}, {1}, 0, 3, {{0}, {900}, {-100}}},
        {"2d, 128B", 2, {100, 37}, {64, 16}, {1, 1}, 128, 4,
         {{0, 0}, {50, 30}, {-8, -3}, {200, 0}}},
        {"2d, 64B", 2, {100, 37}, {32, 8}, {1, 1}, 64, 2, {{3, 5}, {90, -2}}},
        {"2d, 32B", 2, {100, 37}, {16, 8}, {1, 1}, 32, 2, {{16, 36}, {-9, 0}}},
        {"3d, 64B, element strides", 3, {32, 5, 7}, {32, 4, 3}, {1, 2, 1}, 64, 2,
         {{0, 1, 2}, {0, -1, 5}}},
        {"4d, 32B, element strides", 4, {16, 3, 4, 5}, {16, 2, 3, 2}, {1, 1, 2, 1}, 32, 3,
         {{0, 0, 0, 0}, {-4, 2, 1, 4}, {8, 1, -1, 3}}},
        {"5d, none", 5, {8, 2, 3, 2, 2}, {8, 2, 2, 2, 2}, {1, 1, 1, 1, 1}, 0, 2,
         {{0, 0, 0, 0, 0}, {0, 1, 2, 1, 1}}},
    };
    CK(cudaFuncSetAttribute(k_tma, cudaFuncAttributeMaxDynamicSharedMemorySize, kTmaSmem));
    for (const TmaCfg &c : cfgs) {
        uint64_t strides[4] = {0, 0, 0, 0};
        const std::vector<uint16_t> h = tensor(c.rank, c.dims, strides);
        Dev<uint16_t> dt(h);
        const CUtensorMap m = map_of(c.rank, dt.p, c.dims, strides, c.box, c.estride, c.swizzle);
        unsigned elems = c.box[0];
        for (int i = 1; i < c.rank; i++) elems *= (c.box[i] + c.estride[i] - 1) / c.estride[i];
        std::vector<int> coords;
        for (int b = 0; b < 4; b++) coords.insert(coords.end(), c.coords[b], c.coords[b] + 5);
        Dev<int> dc(coords);
        Dev<uint16_t> out((size_t)elems * c.nbox);
        GO(RA_LAUNCH(k_tma, 1, 64, kTmaSmem, 0)(m, c.rank, dc.p, c.nbox, elems * 2, out.p,
                                                g_timeout));
        digest_waited(std::string("cp.async.bulk.tensor.") + std::to_string(c.rank) + "d load, " +
                   (c.name + 4),
               out);
    }
    {
        const uint64_t dims[2] = {100, 37};
        uint64_t strides[1];
        std::vector<uint16_t> h = tensor(2, dims, strides);
        Dev<uint16_t> dt(h);
        const uint32_t box[2] = {64, 16}, one[2] = {1, 1};
        const CUtensorMap m = map_of(2, dt.p, dims, strides, box, one, 128);
        std::vector<uint16_t> img(64 * 16);
        for (auto &v : img) v = (uint16_t)rnd();
        Dev<uint16_t> dimg(img);
        CK(cudaFuncSetAttribute(k_tma_store, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                kTmaSmem));
        GO(RA_LAUNCH(k_tma_store, 1, 64, kTmaSmem, 0)(m, dimg.p, 50, 30));
        GO(RA_LAUNCH(k_tma_store, 1, 64, kTmaSmem, 0)(m, dimg.p, -20, -5));
        digest("cp.async.bulk.tensor.2d store, 128B, fence.proxy.async", dt);
    }
}

/* ---- main --------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    const char *expected = nullptr;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--expected") == 0 && i + 1 < argc) {
            expected = argv[++i];
        } else {
            fprintf(stderr, "usage: ptx_conformance [--expected FILE]\n");
            return 2;
        }
    }
    int dev = 0, major = 0, minor = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    CK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    if (major != 9) {
        fprintf(stderr, "ptx_conformance: needs an sm_90 device, this one is sm_%d%d\n", major,
                minor);
        return 2;
    }
    CK(cudaMalloc((void **)&g_timeout, 4));
    CK(cudaMemset(g_timeout, 0, 4));
    sm80_family();
    wgmma_family();
    sync_family();
    tma_family();
    wgmma_bwd_family();
    std::string all;
    printf("# tools/ptx_conformance.cu: FNV-1a 64 digests of each PTX instruction's outputs\n"
           "# on fixed inputs (one per instruction ringattn's emulated GPU models, and one over\n"
           "# all).  Made by the emulated GPU (csrc/emu) and checked there by\n"
           "# tests/test_ptx_conformance.py; tools/gpu_check.sh ptx compares a real sm_90 GPU's\n"
           "# run with them.  Where a GPU differs, the GPU is right: fix the emulator's model,\n"
           "# then regenerate this file with the emulated build's ptx_conformance > FILE.\n");
    for (const auto &d : g_digests) {
        char line[300];
        snprintf(line, sizeof line, "%-72s %016llx\n", d.first.c_str(),
                 (unsigned long long)d.second);
        all += line;
        fputs(line, stdout);
    }
    digest("overall", all.data(), all.size());
    printf("%-72s %016llx\n", "overall", (unsigned long long)g_digests.back().second);
    if (expected == nullptr) return 0;
    FILE *f = fopen(expected, "r");
    if (f == nullptr) {
        fprintf(stderr, "ptx_conformance: cannot read %s\n", expected);
        return 2;
    }
    std::vector<std::pair<std::string, std::string>> want;
    char buf[400];
    while (fgets(buf, sizeof buf, f) != nullptr) {
        std::string l(buf);
        while (!l.empty() && (l.back() == '\n' || l.back() == ' ')) l.pop_back();
        if (l.empty() || l[0] == '#') continue;
        const size_t sp = l.find_last_of(' ');
        std::string name = l.substr(0, sp);
        while (!name.empty() && name.back() == ' ') name.pop_back();
        want.emplace_back(name, l.substr(sp + 1));
    }
    fclose(f);
    int bad = 0, same = 0;
    for (const auto &w : want) {
        bool found = false;
        for (const auto &d : g_digests) {
            if (d.first != w.first) continue;
            found = true;
            char got[20];
            snprintf(got, sizeof got, "%016llx", (unsigned long long)d.second);
            if (w.second == got) {
                same++;
            } else {
                printf("DIFFERS %s: %s, expected %s\n", w.first.c_str(), got, w.second.c_str());
                bad++;
            }
        }
        if (!found) {
            printf("MISSING %s\n", w.first.c_str());
            bad++;
        }
    }
    if (want.size() != g_digests.size()) {
        printf("ptx_conformance: %zu digests here, %zu expected\n", g_digests.size(),
               want.size());
        bad++;
    }
    printf("ptx_conformance: %d of %zu digests match %s\n", same, want.size(), expected);
    return bad ? 1 : 0;
}
