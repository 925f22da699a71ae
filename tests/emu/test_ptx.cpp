/*
 * test_ptx.cpp -- fidelity of the emulated ldmatrix and mma.sync (issue 18,
 * item 5): the kernels' own wrappers (cuda/mma.cuh: ra::ldmatrix_x4,
 * ra::ldmatrix_x4_trans, ra::mma_16816) are run on the emulated GPU and
 * every lane's registers are compared with fragments this file builds from
 * the PTX ISA's tables, by code that shares nothing with mma.cuh or the
 * emulator:
 *
 *   ldmatrix .m8n8 .x4 .b16: thread 8i+j gives the address of row j of
 *     matrix i; thread l receives in register i the two 16-bit elements of
 *     matrix i at row l>>2, columns 2*(l&3) and 2*(l&3)+1 (lower half: the
 *     lower column); with .trans the elements at rows 2*(l&3), 2*(l&3)+1 of
 *     column l>>2.
 *   mma .m16n8k16 .row.col, groupID = l>>2, threadID_in_group = l&3:
 *     A: a0,a1 = A[groupID][2*tig + 0/1], a2,a3 = A[groupID+8][2*tig + 0/1],
 *        a4,a5 = A[groupID][2*tig+8 + 0/1], a6,a7 = A[groupID+8][2*tig+8 + 0/1]
 *        (a0..a7 are the 16-bit elements of the four .b32 registers)
 *     B: b0,b1 = B[2*tig + 0/1][groupID], b2,b3 = B[2*tig+8 + 0/1][groupID]
 *     C/D: c0,c1 = C[groupID][2*tig + 0/1], c2,c3 = C[groupID+8][2*tig + 0/1]
 *
 * A case "wrong_lane" uses an mma fragment built with a wrong lane mapping
 * and ldmatrix row addresses given by the wrong lanes (the mistakes a kernel
 * could make) and must NOT match: the emulated GPU shows a wrong lane index
 * as a wrong result.
 */
#include "mma.cuh"
#include "kernel_test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

/* a row permutation so that the lanes' addresses matter */
static const int kPerm[8] = {5, 2, 7, 0, 3, 6, 1, 4};

/* 32 rows of 8 uint16 (4 matrices) in shared memory -> each lane's 4 regs */
__global__ void k_ldmatrix(const uint16_t *tile, uint32_t *out, int trans, int wrong) {
    uint16_t *s = (uint16_t *)ra::dynamic_smem();
    for (int i = threadIdx.x; i < 32 * 8; i += 32) s[i] = tile[i];
    __syncthreads();
    /* wrong: each lane gives the address of the next lane's row */
    const int l = threadIdx.x, m = l / 8, j = (l + wrong) % 8;
    const void *row = s + (m * 8 + kPerm[j]) * 8;
    uint32_t r[4];
    if (trans) ra::ldmatrix_x4_trans(r, row);
    else ra::ldmatrix_x4(r, row);
    for (int i = 0; i < 4; i++) out[l * 4 + i] = r[i];
}

template <typename T>
__global__ void k_mma(const uint32_t *a, const uint32_t *b, const float *c, float *d) {
    const int l = threadIdx.x;
    uint32_t ar[4] = {a[l * 4], a[l * 4 + 1], a[l * 4 + 2], a[l * 4 + 3]};
    float cr[4] = {c[l * 4], c[l * 4 + 1], c[l * 4 + 2], c[l * 4 + 3]};
    ra::mma_16816<T>(cr, ar, b[l * 2], b[l * 2 + 1]);
    for (int i = 0; i < 4; i++) d[l * 4 + i] = cr[i];
}

/* ---- reference fragments (PTX ISA tables) ----------------------------------------- */

static uint16_t bits16(float x, bool bf16) {
    /* the test's values are small integers: exact in both formats */
    uint32_t u;
    memcpy(&u, &x, 4);
    if (bf16) return (uint16_t)(u >> 16);
    if (x == 0) return 0;
    const int sign = x < 0;
    float ax = x < 0 ? -x : x;
    int e = 0;
    while (ax >= 2) { ax /= 2; e++; }
    while (ax < 1) { ax *= 2; e--; }
    const int mant = (int)((ax - 1) * 1024 + 0.5f);
    return (uint16_t)((sign << 15) | ((e + 15) << 10) | mant);
}
static uint32_t pack(uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); }

template <typename T>
static bool mma_case(bool bf16, bool wrong_lane) {
    float A[16][16], B[16][8], C[16][8];
    for (int r = 0; r < 16; r++)
        for (int k = 0; k < 16; k++) A[r][k] = (float)((r * 3 + k * 5) % 7 - 3);
    for (int k = 0; k < 16; k++)
        for (int n = 0; n < 8; n++) B[k][n] = (float)((k * 2 + n * 3) % 5 - 2);
    for (int r = 0; r < 16; r++)
        for (int n = 0; n < 8; n++) C[r][n] = (float)(r - n) * 0.5f;
    std::vector<uint32_t> a(32 * 4), b(32 * 2);
    std::vector<float> c(32 * 4);
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, tig = l & 3;
        /* the wrong mapping: group and thread-in-group swapped roles */
        const int row = wrong_lane ? (l & 7) : g;
        a[l * 4 + 0] = pack(bits16(A[row][2 * tig], bf16), bits16(A[row][2 * tig + 1], bf16));
        a[l * 4 + 1] = pack(bits16(A[row + 8][2 * tig], bf16), bits16(A[row + 8][2 * tig + 1], bf16));
        a[l * 4 + 2] = pack(bits16(A[row][2 * tig + 8], bf16), bits16(A[row][2 * tig + 9], bf16));
        a[l * 4 + 3] = pack(bits16(A[row + 8][2 * tig + 8], bf16), bits16(A[row + 8][2 * tig + 9], bf16));
        b[l * 2 + 0] = pack(bits16(B[2 * tig][g], bf16), bits16(B[2 * tig + 1][g], bf16));
        b[l * 2 + 1] = pack(bits16(B[2 * tig + 8][g], bf16), bits16(B[2 * tig + 9][g], bf16));
        c[l * 4 + 0] = C[g][2 * tig];
        c[l * 4 + 1] = C[g][2 * tig + 1];
        c[l * 4 + 2] = C[g + 8][2 * tig];
        c[l * 4 + 3] = C[g + 8][2 * tig + 1];
    }
    uint32_t *da, *db;
    float *dc, *dd;
    CK(cudaMalloc((void **)&da, a.size() * 4));
    CK(cudaMalloc((void **)&db, b.size() * 4));
    CK(cudaMalloc((void **)&dc, c.size() * 4));
    CK(cudaMalloc((void **)&dd, c.size() * 4));
    CK(cudaMemcpy(da, a.data(), a.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(db, b.data(), b.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dc, c.data(), c.size() * 4, cudaMemcpyHostToDevice));
    CK(RA_LAUNCH((k_mma<T>), 1, 32, 0, 0)(da, db, dc, dd));
    CK(cudaDeviceSynchronize());
    std::vector<float> d(32 * 4);
    CK(cudaMemcpy(d.data(), dd, d.size() * 4, cudaMemcpyDeviceToHost));
    bool ok = true;
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, tig = l & 3;
        const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * tig, 2 * tig + 1, 2 * tig, 2 * tig + 1};
        for (int i = 0; i < 4; i++) {
            double want = C[rows[i]][cols[i]];
            for (int k = 0; k < 16; k++) want += (double)A[rows[i]][k] * B[k][cols[i]];
            if (d[l * 4 + i] != (float)want) ok = false;
        }
    }
    CK(cudaFree(da));
    CK(cudaFree(db));
    CK(cudaFree(dc));
    CK(cudaFree(dd));
    return ok;
}

static bool ldmatrix_case(bool trans, bool wrong = false) {
    std::vector<uint16_t> tile(32 * 8);
    for (int i = 0; i < 32 * 8; i++) tile[i] = (uint16_t)(i * 7 + 3);
    uint16_t *dt;
    uint32_t *dout;
    CK(cudaMalloc((void **)&dt, tile.size() * 2));
    CK(cudaMalloc((void **)&dout, 32 * 4 * 4));
    CK(cudaMemcpy(dt, tile.data(), tile.size() * 2, cudaMemcpyHostToDevice));
    CK(RA_LAUNCH(k_ldmatrix, 1, 32, 32 * 8 * 2, 0)(dt, dout, trans ? 1 : 0, wrong ? 1 : 0));
    CK(cudaDeviceSynchronize());
    std::vector<uint32_t> out(32 * 4);
    CK(cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost));
    bool ok = true;
    for (int l = 0; l < 32; l++) {
        for (int i = 0; i < 4; i++) {
            /* matrix i's row j is tile row i*8 + kPerm[j] (the address lane 8i+j gave) */
            auto M = [&](int row, int col) { return tile[(i * 8 + kPerm[row]) * 8 + col]; };
            const uint32_t want = trans
                ? pack(M(2 * (l & 3), l >> 2), M(2 * (l & 3) + 1, l >> 2))
                : pack(M(l >> 2, 2 * (l & 3)), M(l >> 2, 2 * (l & 3) + 1));
            if (out[l * 4 + i] != want) {
                if (ok && !wrong) fprintf(stderr, "ldmatrix%s lane %d reg %d: 0x%08x, want 0x%08x\n",
                                trans ? ".trans" : "", l, i, out[l * 4 + i], want);
                ok = false;
            }
        }
    }
    CK(cudaFree(dt));
    CK(cudaFree(dout));
    return ok;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "wrong_lane") == 0) {
        /* must be flagged: the result differs from the reference */
        const bool f16 = mma_case<ra::half_t>(false, true);
        const bool b16 = mma_case<ra::bf16_t>(true, true);
        const bool ld = ldmatrix_case(false, true), ldt = ldmatrix_case(true, true);
        if (f16 || b16 || ld || ldt) {
            fprintf(stderr, "a wrong fragment lane mapping gave the right result\n");
            return 1;
        }
        printf("flagged: a wrong fragment lane mapping gives a wrong product, a wrong "
               "ldmatrix row address wrong registers\n");
        return 0;
    }
    int bad = 0;
    if (!ldmatrix_case(false)) { fprintf(stderr, "FAIL ldmatrix.x4\n"); bad++; }
    if (!ldmatrix_case(true)) { fprintf(stderr, "FAIL ldmatrix.x4.trans\n"); bad++; }
    if (!mma_case<ra::half_t>(false, false)) { fprintf(stderr, "FAIL mma f16\n"); bad++; }
    if (!mma_case<ra::bf16_t>(true, false)) { fprintf(stderr, "FAIL mma bf16\n"); bad++; }
    if (bad == 0) printf("ok\n");
    return bad ? 1 : 0;
}
