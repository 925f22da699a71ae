/*
 * test_hopper.cpp -- the emulated GPU's Hopper instructions, through the
 * kernels' own wrappers (cuda/hopper/ptx_sm90.cuh), against results this
 * file computes from the PTX ISA's tables by code that shares nothing with
 * the emulator:
 *
 *   wgmma.mma_async m64nNk16 f32 += {f16, bf16}: every lane's accumulator
 *     registers (register i of lane l in warp w: row 16w + l/4 +
 *     8((i>>1)&1), column 8(i>>2) + 2(l%4) + (i&1)), A from registers (the
 *     mma.m16n8k16 A fragment of rows 16w..) or from a descriptor, B from a
 *     descriptor; operands placed in shared memory as a bulk tensor copy
 *     or the canonical core-matrix tiling places them: K-major rows of the
 *     swizzle span (32/64/128 bytes; the 16-byte chunk XORed with address
 *     bits 7..), M/N-major rows of k, core matrices of 8 x 16 bytes without
 *     swizzle (LBO, SBO as the PTX ISA defines them); several k-steps by
 *     advancing the descriptor, scale-d 0 and 1, N from 8 to 256
 *   stmatrix x1/x2/x4/.trans, elect.sync, setmaxnreg, named barriers
 *
 * and deliberately wrong uses, each of which must be flagged with the
 * report named in tests/test_emu_hopper.py: an accumulator read before
 * its wgmma.wait_group, a descriptor pointing outside shared memory,
 * setmaxnreg not warpgroup-uniform, a wgmma's shared operand overwritten
 * before the wait, a generic write read by wgmma with no fence.proxy.async,
 * a wgmma with no wgmma.fence, an A-fragment register written before the
 * wait, named barrier counts that never meet; and a wrong descriptor stride
 * or swizzle must give a wrong product.
 *
 * Usage: test_hopper [case]; no case runs every working case.
 */
#include "hopper/ptx_sm90.cuh"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

#include "emu/emu.h"
#include "kernel_test.h"

using namespace ra::sm90;

/* ---- reference data ---------------------------------------------------------------- */

/* small integers: exact in f16, bf16 and every float sum below */
static uint16_t bits16(float x, bool bf16) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if (bf16) return (uint16_t)(u >> 16);
    if (x == 0) return 0;
    const int sign = x < 0;
    float ax = sign ? -x : x;
    int e = 0;
    while (ax >= 2) { ax /= 2; e++; }
    while (ax < 1) { ax *= 2; e--; }
    return (uint16_t)((sign << 15) | ((e + 15) << 10) | (int)((ax - 1) * 1024 + 0.5f));
}
static float aval(int m, int k) { return (float)((m * 7 + k * 3) % 9 - 4); }
static float bval(int k, int n) { return (float)((k * 5 + n * 11) % 7 - 3); }
static float cval(int m, int n) { return (float)(m - n) * 0.25f; }

/* An operand of `rows` (M or N) x kt (K) elements in shared memory.
 * sw: 0 none, else the swizzle span in bytes (32, 64, 128); mn: M/N-major. */
struct Operand {
    int sw;
    bool mn;
    uint32_t lbo, sbo, off;   /* byte offsets; off: the tile's place in shared memory */
};

static uint32_t swizzle(uint32_t a, int sw) {
    if (sw == 0) return a;
    const uint32_t rows = (uint32_t)sw / 16 - 1;   /* 1, 3, 7 */
    return a ^ (((a >> 7) & rows) << 4);
}

/* where element (r, k) lies (from the tile's start), as a bulk copy of
 * span-wide rows or the core-matrix tiling places it */
static uint32_t place(const Operand &o, int r, int k) {
    if (o.sw == 0) {
        /* core matrices of 8 rows x 16 bytes: K-major rows are r, M/N-major
         * rows are k; SBO apart along r, LBO apart along k */
        const int row = o.mn ? k : r, col = o.mn ? r : k;
        return (uint32_t)((r / 8) * o.sbo + (k / 8) * o.lbo + (row % 8) * 16 + (col % 8) * 2);
    }
    const int per_row = o.sw / 2;   /* elements in a span-wide row */
    if (!o.mn)   /* row r holds k = 0 .. per_row - 1; 8-row groups SBO apart */
        return (uint32_t)((r / 8) * o.sbo + (r % 8) * o.sw + k * 2);
    /* row k holds per_row consecutive r; r blocks LBO apart, 8-k groups SBO apart */
    return (uint32_t)((r / per_row) * o.lbo + (k / 8) * o.sbo + (k % 8) * o.sw +
                      (r % per_row) * 2);
}

/* the descriptor start offset of k-step s (k = 16 s .. 16 s + 15) */
static uint32_t kstep_bytes(const Operand &o) {
    if (o.sw == 0) return 2 * o.lbo;
    return o.mn ? 2 * o.sbo : 32;
}

static Swizzle desc_swizzle(int sw) {
    return sw == 128 ? SWIZZLE_128B : sw == 64 ? SWIZZLE_64B : sw == 32 ? SWIZZLE_32B
                                                                        : SWIZZLE_NONE;
}

/* ---- the wgmma kernel ---------------------------------------------------------------- */

struct WgArgs {
    const unsigned char *img;
    unsigned img_bytes;
    const uint32_t *afrag;   /* RS: 4 registers per thread per k-step */
    const float *c;
    float *d;
    Operand a, b;
    int ksteps, accumulate;
};

template <int N, typename T, int TA, int TB, bool RS>
__global__ void k_wgmma(WgArgs p) {
    unsigned char *s = ra::dynamic_smem();
    const int tid = threadIdx.x;
    for (unsigned i = tid * 16; i < p.img_bytes; i += 128 * 16) memcpy(s + i, p.img + i, 16);
    fence_proxy_async();
    __syncthreads();
    float d[N / 2];
    for (int i = 0; i < N / 2; i++) d[i] = p.c[tid * (N / 2) + i];
    uint32_t a[4][4];
    if (RS)
        for (int ks = 0; ks < p.ksteps; ks++)
            for (int j = 0; j < 4; j++) a[ks][j] = p.afrag[(ks * 128 + tid) * 4 + j];
    wgmma_fence();
    for (int ks = 0; ks < p.ksteps; ks++) {
        const uint64_t db = make_desc(s + p.b.off + ks * kstep_bytes(p.b), p.b.lbo, p.b.sbo,
                                      desc_swizzle(p.b.sw));
        const bool acc = p.accumulate || ks > 0;
        if (RS) {
            wgmma_rs<N, T, TB>(d, a[ks], db, acc);
        } else {
            const uint64_t da = make_desc(s + p.a.off + ks * kstep_bytes(p.a), p.a.lbo,
                                          p.a.sbo, desc_swizzle(p.a.sw));
            wgmma_ss<N, T, TA, TB>(d, da, db, acc);
        }
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_operand(d);
    for (int i = 0; i < N / 2; i++) p.d[tid * (N / 2) + i] = d[i];
}

/* run one wgmma case; returns whether every register matched (prints the
 * first mismatch unless quiet) */
static int g_wgmma_cases;

template <int N, typename T, int TA, int TB, bool RS>
static bool wgmma_case(Operand oa, Operand ob, int ksteps, int accumulate, bool quiet = false,
                       const char *name = "", const Operand *read_a = nullptr,
                       const Operand *read_b = nullptr) {
    const bool bf = std::is_same<T, ra::bf16_t>::value;
    const int kt = 16 * ksteps;
    g_wgmma_cases++;
    const unsigned bytes = 65536;
    std::vector<unsigned char> img(bytes, 0);
    for (int m = 0; m < 64 && !RS; m++)
        for (int k = 0; k < kt; k++) {
            const uint32_t at = oa.off + place(oa, m, k);
            const uint16_t v = bits16(aval(m, k), bf);
            memcpy(&img[swizzle(at, oa.sw)], &v, 2);
        }
    for (int n = 0; n < N; n++)
        for (int k = 0; k < kt; k++) {
            const uint32_t at = ob.off + place(ob, n, k);
            const uint16_t v = bits16(bval(k, n), bf);
            memcpy(&img[swizzle(at, ob.sw)], &v, 2);
        }
    std::vector<uint32_t> afrag(ksteps * 128 * 4);
    for (int ks = 0; ks < ksteps && RS; ks++)
        for (int t = 0; t < 128; t++) {
            const int w = t / 32, l = t % 32, g = l / 4, q = l % 4;
            for (int j = 0; j < 4; j++) {
                const int row = 16 * w + g + 8 * (j & 1), col = 16 * ks + 2 * q + 8 * (j >> 1);
                afrag[(ks * 128 + t) * 4 + j] = (uint32_t)bits16(aval(row, col), bf) |
                                                (uint32_t)bits16(aval(row, col + 1), bf) << 16;
            }
        }
    std::vector<float> c(128 * (N / 2)), want(128 * (N / 2));
    for (int t = 0; t < 128; t++) {
        const int w = t / 32, l = t % 32, g = l / 4, q = l % 4;
        for (int i = 0; i < N / 2; i++) {
            const int row = 16 * w + g + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * q + (i & 1);
            c[t * (N / 2) + i] = cval(row, col);
            double s = accumulate ? cval(row, col) : 0.0;
            for (int k = 0; k < kt; k++) s += (double)aval(row, k) * bval(k, col);
            want[t * (N / 2) + i] = (float)s;
        }
    }
    unsigned char *dimg;
    uint32_t *dafrag;
    float *dc, *dd;
    CK(cudaMalloc((void **)&dimg, bytes));
    CK(cudaMalloc((void **)&dafrag, afrag.size() * 4));
    CK(cudaMalloc((void **)&dc, c.size() * 4));
    CK(cudaMalloc((void **)&dd, c.size() * 4));
    CK(cudaMemcpy(dimg, img.data(), bytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dafrag, afrag.data(), afrag.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dc, c.data(), c.size() * 4, cudaMemcpyHostToDevice));
    /* the descriptors describe oa, ob (or, to show that a wrong one gives a
     * wrong product, read_a, read_b) */
    WgArgs p{dimg, bytes, dafrag, dc, dd, read_a ? *read_a : oa, read_b ? *read_b : ob,
             ksteps, accumulate};
    CK(cudaFuncSetAttribute((k_wgmma<N, T, TA, TB, RS>),
                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    CK(RA_LAUNCH((k_wgmma<N, T, TA, TB, RS>), 1, 128, bytes, 0)(p));
    CK(cudaDeviceSynchronize());
    std::vector<float> d(c.size());
    CK(cudaMemcpy(d.data(), dd, d.size() * 4, cudaMemcpyDeviceToHost));
    bool ok = true;
    for (size_t i = 0; i < d.size() && ok; i++) {
        if (d[i] != want[i]) {
            if (!quiet)
                fprintf(stderr, "wgmma %s N=%d %s: thread %zu register %zu: %g, want %g\n", name,
                        N, bf ? "bf16" : "f16", i / (N / 2), i % (N / 2), d[i], want[i]);
            ok = false;
        }
    }
    CK(cudaFree(dimg));
    CK(cudaFree(dafrag));
    CK(cudaFree(dc));
    CK(cudaFree(dd));
    return ok;
}

/* the operand layouts of a case: A at byte 0, B at 32768 (both 1024-aligned) */
static Operand layout(int sw, bool mn, int rows, int kt, uint32_t off, bool loose = false) {
    Operand o;
    o.sw = sw;
    o.mn = mn;
    o.off = off;
    const uint32_t pad = loose ? 256 : 0;   /* gaps between blocks: the strides matter */
    if (sw == 0) {
        /* core matrices: along the "column" (K for K-major, M/N for MN-major)
         * LBO apart, rows of core matrices SBO apart (PTX: LBO K-direction
         * for K-major, K-direction for MN-major too; SBO the other) */
        if (!mn) {
            o.lbo = 128 + pad / 2;
            o.sbo = (uint32_t)(kt / 8) * o.lbo + pad;
        } else {
            o.sbo = loose ? 256 : 128;                   /* next 8 m/n */
            o.lbo = (uint32_t)(rows / 8) * o.sbo + pad;  /* next 8 k */
        }
    } else if (!mn) {
        o.lbo = 16;                          /* unused for swizzled K-major */
        o.sbo = 8 * (uint32_t)sw + pad * 4;   /* next 8 rows */
    } else {
        o.sbo = 8 * (uint32_t)sw;                                  /* next 8 k */
        o.lbo = (uint32_t)(kt / 8) * o.sbo + pad * 4;              /* next sw/2 m/n */
    }
    return o;
}

template <typename T, bool RS, int TA, int TB>
static int layout_grid(const char *tname) {
    int bad = 0;
    const int sws[4] = {0, 32, 64, 128};
    for (int ai = 0; ai < 4; ai++) {
        for (int loose = 0; loose < 2; loose++) {
            const int sw = sws[ai], swb = sws[(ai + 1) % 4];
            /* K-major swizzled rows hold sw/2 elements: sw / 32 k-steps */
            const int ks_a = RS || TA || sw == 0 ? 2 : sw / 32;
            const int ks_b = TB || swb == 0 ? 2 : swb / 32;
            const int ks = ks_a < ks_b ? ks_a : ks_b;
            const Operand oa = layout(sw, TA, 64, 16 * ks, 0, loose);
            const Operand ob = layout(swb, TB, 64, 16 * ks, 32768, loose);
            char name[96];
            snprintf(name, sizeof name, "%s A %s %d%s B %s %d", RS ? "RS" : "SS",
                     TA ? "MN" : "K", sw, loose ? " loose" : "", TB ? "MN" : "K",
                     sws[(ai + 1) % 4]);
            if (!wgmma_case<64, T, TA, TB, RS>(oa, ob, ks, loose, false, name)) {
                fprintf(stderr, "FAIL wgmma %s %s\n", tname, name);
                bad++;
            }
        }
    }
    return bad;
}

template <typename T>
static int wgmma_cases(const char *tname) {
    int bad = 0;
    bad += layout_grid<T, false, 0, 0>(tname);
    bad += layout_grid<T, false, 1, 0>(tname);
    bad += layout_grid<T, false, 0, 1>(tname);
    bad += layout_grid<T, false, 1, 1>(tname);
    bad += layout_grid<T, true, 0, 0>(tname);
    bad += layout_grid<T, true, 0, 1>(tname);
    /* N from 8 to 256 (the K/V tile widths and head dims of the kernels) */
    const Operand a = layout(128, false, 64, 64, 0), b128 = layout(128, false, 256, 64, 32768);
    const Operand b64 = layout(64, true, 256, 32, 32768);
    bool ok = wgmma_case<8, T, 0, 0, false>(a, b128, 4, 1) &&
              wgmma_case<16, T, 0, 0, true>(a, b128, 4, 0) &&
              wgmma_case<24, T, 0, 0, false>(a, b128, 4, 1) &&
              wgmma_case<128, T, 0, 1, false>(layout(64, false, 64, 32, 0), b64, 2, 1) &&
              wgmma_case<200, T, 0, 0, true>(a, b128, 4, 1) &&
              wgmma_case<256, T, 0, 0, false>(a, b128, 4, 0) &&
              wgmma_case<256, T, 0, 1, true>(a, b64, 2, 1);
    if (!ok) {
        fprintf(stderr, "FAIL wgmma %s N sweep\n", tname);
        bad++;
    }
    return bad;
}

/* ---- stmatrix, elect.sync, setmaxnreg, named barriers --------------------------------- */

__global__ void k_stmatrix(uint16_t *out, int num, int trans) {
    uint16_t *s = (uint16_t *)ra::dynamic_smem();
    const int l = threadIdx.x;
    uint32_t r[4];
    for (int i = 0; i < 4; i++) r[i] = (uint32_t)(l * 8 + i * 2) | (uint32_t)(l * 8 + i * 2 + 1) << 16;
    /* row j of matrix i at tile row 8i + (7 - j): the lanes' addresses matter */
    void *row = s + (8 * (l / 8) + 7 - l % 8) * 8;
    if (num == 1) stmatrix_x1(row, (const uint32_t(&)[1])r);
    else if (num == 2) stmatrix_x2(row, (const uint32_t(&)[2])r);
    else if (trans) stmatrix_x4_trans(row, r);
    else stmatrix_x4(row, r);
    __syncwarp();
    for (int i = l; i < 8 * num * 8; i += 32) out[i] = s[i];
}

static bool stmatrix_case(int num, int trans) {
    uint16_t *d;
    const int n = num * 64;
    CK(cudaMalloc((void **)&d, n * 2));
    CK(RA_LAUNCH(k_stmatrix, 1, 32, 32 * 8 * 2, 0)(d, num, trans));
    CK(cudaDeviceSynchronize());
    std::vector<uint16_t> h(n);
    CK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaFree(d));
    for (int i = 0; i < num; i++)
        for (int row = 0; row < 8; row++)
            for (int col = 0; col < 8; col++) {
                /* matrix element (row, col) comes from lane 4 row + col / 2 (transposed:
                 * element (col, row)), register i, half col % 2 */
                const int rr = trans ? col : row, cc = trans ? row : col;
                const int lane = 4 * rr + cc / 2;
                const uint16_t want = (uint16_t)(lane * 8 + i * 2 + cc % 2);
                const uint16_t got = h[(8 * i + 7 - row) * 8 + col];
                if (got != want) {
                    fprintf(stderr, "stmatrix x%d%s matrix %d (%d, %d): %u, want %u\n", num,
                            trans ? ".trans" : "", i, row, col, got, want);
                    return false;
                }
            }
    return true;
}

__global__ void k_misc(unsigned *out) {
    const unsigned t = threadIdx.x, lane = t % 32;
    uint32_t leader = 99;
    const bool me = elect_one(&leader);
    int lead2 = 0;
    unsigned mask = 0xf0f0f0f0u >> (t / 32);   /* a partial mask per warp */
    unsigned part = 77;
    if ((mask >> lane) & 1) part = ra_emu_elect(mask, &lead2);
    if (t < 128) setmaxnreg_dec<40>(); else setmaxnreg_inc<232>();
    const unsigned nreg = ra_emu_warpgroup_maxnreg();
    /* warps 0-3 hand a value to warps 4-7 through shared memory behind named
     * barrier 1 (bar.arrive by the writers, bar.sync by the readers), and
     * back behind barrier 2 */
    unsigned *s = (unsigned *)ra::dynamic_smem();
    if (t < 128) {
        s[t] = t * 3 + 1;
        named_bar_arrive(1, 256);
        named_bar_sync(2, 256);
        out[t * 5 + 4] = s[128 + t];
    } else {
        named_bar_sync(1, 256);
        s[t] = s[t - 128] + 1000;
        named_bar_arrive(2, 256);
        out[t * 5 + 4] = 0;
    }
    out[t * 5 + 0] = leader;
    out[t * 5 + 1] = me;
    out[t * 5 + 2] = part;
    out[t * 5 + 3] = nreg;
}

static bool misc_case() {
    unsigned *d;
    CK(cudaMalloc((void **)&d, 256 * 5 * 4));
    CK(RA_LAUNCH(k_misc, 1, 256, 256 * 4, 0)(d));
    CK(cudaDeviceSynchronize());
    std::vector<unsigned> h(256 * 5);
    CK(cudaMemcpy(h.data(), d, h.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaFree(d));
    for (unsigned t = 0; t < 256; t++) {
        const unsigned lane = t % 32, mask = 0xf0f0f0f0u >> (t / 32);
        const unsigned want_part = (mask >> lane) & 1 ? (unsigned)__builtin_ctz(mask) : 77;
        const unsigned want[5] = {0, lane == 0, want_part, t < 128 ? 40u : 232u,
                                  t < 128 ? t * 3 + 1 + 1000 : 0};
        for (int i = 0; i < 5; i++)
            if (h[t * 5 + i] != want[i]) {
                fprintf(stderr, "misc thread %u field %d: %u, want %u\n", t, i, h[t * 5 + i],
                        want[i]);
                return false;
            }
    }
    return true;
}

/* ---- broken uses ------------------------------------------------------------------------- */

/* one wgmma (N=64, bf16, SS, 128B swizzle) with a flaw chosen by `bug` */
__global__ void k_wgmma_bug(const unsigned char *img, float *out, int bug) {
    unsigned char *s = ra::dynamic_smem();
    const int tid = threadIdx.x;
    for (unsigned i = tid * 16; i < 32768 + 8192; i += 128 * 16) memcpy(s + i, img + i, 16);
    if (bug != 1) fence_proxy_async();   /* 1: no proxy fence */
    __syncthreads();
    float d[32];
    for (int i = 0; i < 32; i++) d[i] = 0;
    uint32_t a[4] = {0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u};
    if (bug != 2) wgmma_fence();          /* 2: no wgmma.fence */
    uint64_t da = make_desc(s, 16, 1024, SWIZZLE_128B);
    const uint64_t db = make_desc(s + 32768, 16, 1024, SWIZZLE_128B);
    if (bug == 3) da = make_desc(s + 250 * 1024, 16, 1024, SWIZZLE_128B);  /* 3: outside */
    if (bug == 6) wgmma_rs<64, ra::bf16_t>(d, a, db, false);
    else wgmma_ss<64, ra::bf16_t>(d, da, db, false);
    wgmma_commit();
    float early = 0;
    if (bug == 4) early = d[3];                                    /* 4: read before the wait */
    if (bug == 5 && tid == 5) s[32768 + 2] = 1;                    /* 5: write B(1, 0) */
    if (bug == 6) a[1] = 7;                                        /* 6: write A registers */
    wgmma_wait<0>();
    fence_operand(d);
    out[tid] = d[0] + early + (float)a[1];
}

__global__ void k_setmaxnreg_bug(int *out) {
    if (threadIdx.x < 64) setmaxnreg_inc<232>();
    else setmaxnreg_inc<240>();
    out[threadIdx.x] = 1;
}

__global__ void k_named_bug(int *out) {
    /* warps 0-1 wait for 128 threads at barrier 3; only 96 ever come */
    if (threadIdx.x < 96) named_bar_sync(3, 128);
    out[threadIdx.x] = 1;
}

static int run_broken(const char *name) {
    const std::string c = name;
    std::vector<unsigned char> img(32768 + 8192, 0);
    for (size_t i = 0; i < img.size(); i += 2) img[i + 1] = 0x3f;   /* bf16 values near 1 */
    unsigned char *dimg;
    float *out;
    CK(cudaMalloc((void **)&dimg, img.size()));
    CK(cudaMalloc((void **)&out, 1024 * 4));
    CK(cudaMemcpy(dimg, img.data(), img.size(), cudaMemcpyHostToDevice));
    CK(cudaFuncSetAttribute(k_wgmma_bug, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536));
    const struct { const char *name; int bug; } wg[] = {
        {"no_proxy_fence", 1}, {"no_wgmma_fence", 2}, {"desc_outside", 3},
        {"acc_before_wait", 4}, {"wgmma_source_overwrite", 5}, {"a_frag_write", 6}};
    cudaError_t e = cudaErrorUnknown;
    bool launched = false;
    for (const auto &w : wg) {
        if (c != w.name) continue;
        e = RA_LAUNCH(k_wgmma_bug, 1, 128, 65536, 0)(dimg, out, w.bug);
        launched = true;
    }
    if (c == "acc_before_wait_unchecked") {
        /* with the checker off, the early read sees the poison */
        CK(RA_LAUNCH(k_wgmma_bug, 1, 128, 65536, 0)(dimg, out, 4));
        CK(cudaDeviceSynchronize());
        float h[128];
        CK(cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost));
        if (h[0] != h[0]) {
            printf("flagged: the accumulator read before wgmma.wait_group is NaN poison\n");
            return 0;
        }
        fprintf(stderr, "case %s: the early read gave %g\n", name, h[0]);
        return 1;
    }
    if (c == "wrong_desc") {
        /* a wrong stride or swizzle must give a wrong product */
        const Operand a = layout(128, false, 64, 64, 0), b = layout(128, false, 64, 64, 32768);
        const Operand b_none = layout(0, false, 64, 32, 32768);
        Operand a_sbo = a, b_lbo = b_none, b_sw = b;
        a_sbo.sbo += 1024;    /* the next 8 rows one atom further */
        b_lbo.lbo += 16;      /* the second k core matrix 16 bytes off */
        b_sw.sw = 64;         /* 128B-swizzled rows read as 64B-swizzled */
        b_sw.sbo = 512;
        const bool right = wgmma_case<64, ra::bf16_t, 0, 0, false>(a, b, 4, 1, true);
        const bool sbo = wgmma_case<64, ra::bf16_t, 0, 0, false>(a, b, 4, 1, true, "", &a_sbo);
        const bool lbo =
            wgmma_case<64, ra::bf16_t, 0, 0, false>(a, b_none, 2, 1, true, "", nullptr, &b_lbo);
        const bool sw =
            wgmma_case<64, ra::bf16_t, 0, 0, true>(a, b, 2, 1, true, "", nullptr, &b_sw);
        if (right && !sbo && !lbo && !sw) {
            printf("flagged: a wrong SBO, LBO or swizzle gives a wrong product\n");
            return 0;
        }
        fprintf(stderr, "case %s: right %d, wrong sbo %d, lbo %d, swizzle %d\n", name, right,
                sbo, lbo, sw);
        return 1;
    }
    if (c == "setmaxnreg_nonuniform") {
        e = RA_LAUNCH(k_setmaxnreg_bug, 1, 128, 0, 0)((int *)out);
        launched = true;
    }
    if (c == "named_bar_deadlock") {
        e = RA_LAUNCH(k_named_bug, 1, 128, 0, 0)((int *)out);
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
    bad += wgmma_cases<ra::half_t>("f16");
    bad += wgmma_cases<ra::bf16_t>("bf16");
    for (int num = 1; num <= 4; num *= 2)
        if (!stmatrix_case(num, 0)) { fprintf(stderr, "FAIL stmatrix x%d\n", num); bad++; }
    if (!stmatrix_case(4, 1)) { fprintf(stderr, "FAIL stmatrix x4.trans\n"); bad++; }
    if (!misc_case()) { fprintf(stderr, "FAIL elect.sync / setmaxnreg / named barriers\n"); bad++; }
    if (ra_emu_reports_count() != 0) {
        fprintf(stderr, "FAIL reports:\n%s\n", ra_emu_reports_text());
        bad++;
    }
    printf("%d wgmma cases\n", g_wgmma_cases);
    if (bad == 0) printf("ok\n");
    return bad ? 1 : 0;
}
