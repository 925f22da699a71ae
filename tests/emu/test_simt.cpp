/*
 * test_simt.cpp -- the emulated GPU's SIMT layer: kernels that must work
 * (barriers, shuffles, votes, atomics, shared memory, 2-D blocks, launch
 * limits) and deliberately broken kernels each of which the emulator must
 * flag (issue 18, item 4): a missing __syncthreads between a shared write
 * and another warp's read; a cp.async destination read before its wait;
 * out-of-bounds shared and global accesses; a host pointer in a kernel; a
 * shuffle from a lane outside the mask; a barrier deadlock.
 *
 * Built by tests/test_emu_simt.py with the kernels instrumented
 * (-fsanitize=thread hooks = the checker).  Usage: test_simt [case]; with
 * no case every working case runs; a broken case exits 0 only if the
 * emulator reported what it must (the report's kind is checked).
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

#include "emu/emu.h"
#include "emu/ptx.h"
#include "kernel_test.h"

#define EXPECT(c)                                                                  \
    do {                                                                           \
        if (!(c)) {                                                                \
            fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #c);       \
            exit(1);                                                               \
        }                                                                          \
    } while (0)

static unsigned char *smem() { return ra_emu_dynamic_smem(); }

/* ---- kernels that must work -------------------------------------------------- */

__global__ void k_index(int *out) {
    const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    out[b * (blockDim.x * blockDim.y * blockDim.z) + t] = (int)(b * 100000 + t);
}

/* block sum through shared memory: tree reduction with barriers */
__global__ void k_block_sum(const float *x, float *out, int n) {
    float *s = (float *)smem();
    const unsigned t = threadIdx.x;
    const int i = blockIdx.x * blockDim.x + t;
    s[t] = i < n ? x[i] : 0.f;
    __syncthreads();
    for (unsigned h = blockDim.x / 2; h > 0; h /= 2) {
        if (t < h) s[t] += s[t + h];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = s[0];
}

/* warp sums with shuffles (xor butterfly, down, idx broadcast), votes */
__global__ void k_warp(const float *x, float *out, unsigned *votes) {
    const unsigned lane = threadIdx.x % 32, w = threadIdx.x / 32;
    float v = x[threadIdx.x];
    float a = v;
    for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
    float d = v;
    for (int o = 16; o > 0; o >>= 1) d += __shfl_down_sync(0xffffffffu, d, o);
    d = __shfl_sync(0xffffffffu, d, 0);
    const double up = __shfl_up_sync(0xffffffffu, (double)lane, 1);
    out[threadIdx.x * 3 + 0] = a;
    out[threadIdx.x * 3 + 1] = d;
    out[threadIdx.x * 3 + 2] = (float)up;
    const unsigned ballot = __ballot_sync(0xffffffffu, lane % 3 == 0);
    const int any = __any_sync(0xffffffffu, lane == 31), all = __all_sync(0xffffffffu, lane < 31);
    if (lane == 0) votes[w * 3 + 0] = ballot, votes[w * 3 + 1] = any, votes[w * 3 + 2] = all;
    /* half-warp shuffles with a partial mask */
    if (lane < 16) {
        const float h = __shfl_xor_sync(0x0000ffffu, v, 8, 16);
        out[96 * 3 + threadIdx.x] = h;
    }
}

__global__ void k_atomic(int *counter, float *fsum, const float *x) {
    atomicAdd(counter, 1);
    atomicAdd(fsum, x[threadIdx.x]);
    atomicMax(counter + 1, (int)(blockIdx.x * blockDim.x + threadIdx.x));
}

/* cp.async done right: copy a tile, wait, barrier, read another thread's */
__global__ void k_cp_async(const float *x, float *out) {
    float *s = (float *)smem();
    const unsigned t = threadIdx.x;
    ra_emu_cp_async(s + 4 * t, x + 4 * t, 16, 16);
    ra_emu_cp_async(s + 4 * (t + blockDim.x), x, 16, 0); /* zero fill */
    ra_emu_cp_async_commit();
    ra_emu_cp_async_wait(0);
    __syncthreads();
    const unsigned o = (t + 1) % blockDim.x;
    for (int i = 0; i < 4; i++) out[4 * t + i] = s[4 * o + i] + s[4 * (o + blockDim.x) + i];
}

/* block sums through a static __shared__ array */
__global__ void k_static_sum(const float *x, float *out) {
    __shared__ float buf[128];
    const unsigned t = threadIdx.x;
    buf[t] = x[blockIdx.x * 128 + t];
    __syncthreads();
    for (unsigned h = 64; h > 0; h /= 2) {
        if (t < h) buf[t] += buf[t + h];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = buf[0];
}

/* ---- broken kernels --------------------------------------------------------------- */

/* the missing barrier of k_missing_barrier, in static shared memory */
__global__ void k_static_missing_barrier(float *out) {
    __shared__ float s[128];
    s[threadIdx.x] = -1.f;
    __syncthreads();
    s[threadIdx.x] = (float)threadIdx.x;
    out[threadIdx.x] = s[(threadIdx.x + 32) % 128];
}

/* every thread writes its slot, then reads the next warp's: no
 * __syncthreads between (the slots were initialised, with a barrier) */
__global__ void k_missing_barrier(float *out) {
    float *s = (float *)smem();
    s[threadIdx.x] = -1.f;
    __syncthreads();
    s[threadIdx.x] = (float)threadIdx.x;
    out[threadIdx.x] = s[(threadIdx.x + 32) % blockDim.x];
}
/* the same with a barrier: fine */
__global__ void k_with_barrier(float *out) {
    float *s = (float *)smem();
    s[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = s[(threadIdx.x + 32) % blockDim.x];
}
/* a buffer overwritten while another warp may still read it (no barrier at
 * the end of the first use) */
__global__ void k_war(float *out) {
    float *s = (float *)smem();
    s[threadIdx.x] = 1.f;
    __syncthreads();
    const float v = s[(threadIdx.x + 32) % blockDim.x];
    s[threadIdx.x] = 2.f;
    out[threadIdx.x] = v;
}
__global__ void k_cp_async_early_read(const float *x, float *out) {
    float *s = (float *)smem();
    ra_emu_cp_async(s + 4 * threadIdx.x, x + 4 * threadIdx.x, 16, 16);
    ra_emu_cp_async_commit();
    out[threadIdx.x] = s[4 * threadIdx.x];  /* before the wait */
    ra_emu_cp_async_wait(0);
}
__global__ void k_oob_shared(float *out) {
    float *s = (float *)smem();
    s[threadIdx.x] = 1.f;
    __syncthreads();
    out[threadIdx.x] = s[threadIdx.x + blockDim.x];  /* one block past the allocation */
}
__global__ void k_oob_global(float *out, int n) {
    out[threadIdx.x] = 1.f;  /* launched with more threads than out has */
    (void)n;
}
__global__ void k_host_pointer(float *host) { host[threadIdx.x] = 1.f; }
__global__ void k_shfl_outside_mask(float *out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x < 16) v = __shfl_sync(0x0000ffffu, v, 20);
    out[threadIdx.x] = v;
}
/* half of warp 0 waits at the barrier, the other half in a shuffle that
 * needs the first half */
__global__ void k_deadlock(float *out) {
    if (threadIdx.x < 16) {
        __syncthreads();
    } else {
        out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
        __syncthreads();
    }
}
__global__ void k_uninit_shared(float *out) {
    float *s = (float *)smem();
    out[threadIdx.x] = s[threadIdx.x];
}
__global__ void k_uninit_global(const float *x, float *out) { out[threadIdx.x] = x[threadIdx.x]; }
__global__ void k_freed(float *out) { out[threadIdx.x] = 1.f; }
__global__ void k_fill(float *out) { out[threadIdx.x] = 1.f; }

/* ---- driver ---------------------------------------------------------------------------- */

template <typename T>
struct Dev {
    T *p = nullptr;
    size_t n = 0;
    explicit Dev(size_t n_) : n(n_) { CK(cudaMalloc((void **)&p, n * sizeof(T))); }
    ~Dev() { (void)cudaFree(p); }
    void up(const std::vector<T> &h) { CK(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice)); }
    std::vector<T> down() {
        std::vector<T> h(n);
        CK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
        return h;
    }
};

static int run_ok(void) {
    {   /* indices, 3-D grid and block */
        Dev<int> out(2 * 3 * 2 * 4 * 5 * 3);
        CK(RA_EMU_LAUNCH(k_index, dim3(2, 3, 2), dim3(4, 5, 3), 0, 0)(out.p));
        CK(cudaDeviceSynchronize());
        std::vector<int> h = out.down();
        for (unsigned b = 0; b < 12; b++)
            for (unsigned t = 0; t < 60; t++) EXPECT(h[b * 60 + t] == (int)(b * 100000 + t));
    }
    {   /* block sums, 37 blocks of 256 threads */
        const int n = 37 * 256 - 11;
        std::vector<float> x(n);
        for (int i = 0; i < n; i++) x[i] = (float)((i * 7) % 13) - 6.f;
        Dev<float> dx(n), out(37);
        dx.up(x);
        CK(RA_EMU_LAUNCH(k_block_sum, 37, 256, 256 * sizeof(float), 0)(dx.p, out.p, n));
        CK(cudaDeviceSynchronize());
        std::vector<float> h = out.down();
        for (int b = 0; b < 37; b++) {
            double s = 0;
            for (int i = b * 256; i < (b + 1) * 256 && i < n; i++) s += x[i];
            EXPECT(fabs(h[b] - s) < 1e-3);
        }
    }
    {   /* shuffles and votes, 3 warps */
        std::vector<float> x(96);
        for (int i = 0; i < 96; i++) x[i] = (float)(i % 32) * 0.5f + (float)(i / 32);
        Dev<float> dx(96), out(96 * 3 + 96);
        Dev<unsigned> votes(9);
        dx.up(x);
        CK(cudaMemset(out.p, 0, out.n * sizeof(float)));
        CK(RA_EMU_LAUNCH(k_warp, 1, 96, 0, 0)(dx.p, out.p, votes.p));
        CK(cudaDeviceSynchronize());
        std::vector<float> h = out.down();
        std::vector<unsigned> v = votes.down();
        for (int w = 0; w < 3; w++) {
            double s = 0;
            for (int l = 0; l < 32; l++) s += x[w * 32 + l];
            for (int l = 0; l < 32; l++) {
                const int i = w * 32 + l;
                EXPECT(fabs(h[i * 3] - s) < 1e-4);
                EXPECT(fabs(h[i * 3 + 1] - s) < 1e-4);
                EXPECT(h[i * 3 + 2] == (float)(l == 0 ? 0 : l - 1));
                if (l < 16) EXPECT(h[96 * 3 + i] == x[w * 32 + (l ^ 8)]);
            }
            EXPECT(v[w * 3] == 0x49249249u);
            EXPECT(v[w * 3 + 1] == 1 && v[w * 3 + 2] == 0);
        }
    }
    {   /* atomics from 8 blocks of 64 */
        Dev<int> cnt(2);
        Dev<float> fs(1), x(64);
        std::vector<float> hx(64, 0.25f);
        x.up(hx);
        CK(cudaMemset(cnt.p, 0, 8));
        CK(cudaMemset(fs.p, 0, 4));
        CK(RA_EMU_LAUNCH(k_atomic, 8, 64, 0, 0)(cnt.p, fs.p, x.p));
        CK(cudaDeviceSynchronize());
        std::vector<int> c = cnt.down();
        EXPECT(c[0] == 512 && c[1] == 511);
        EXPECT(fs.down()[0] == 128.f);
    }
    {   /* cp.async done right */
        std::vector<float> x(4 * 64);
        for (int i = 0; i < 256; i++) x[i] = (float)i;
        Dev<float> dx(256), out(256);
        dx.up(x);
        CK(RA_EMU_LAUNCH(k_cp_async, 1, 64, 2 * 256 * sizeof(float), 0)(dx.p, out.p));
        CK(cudaDeviceSynchronize());
        std::vector<float> h = out.down();
        for (int t = 0; t < 64; t++)
            for (int i = 0; i < 4; i++) EXPECT(h[4 * t + i] == x[4 * ((t + 1) % 64) + i]);
    }
    {   /* static shared memory, 9 blocks */
        std::vector<float> x(9 * 128);
        for (int i = 0; i < 9 * 128; i++) x[i] = (float)(i % 17);
        Dev<float> dx(9 * 128), out(9);
        dx.up(x);
        CK(RA_EMU_LAUNCH(k_static_sum, 9, 128, 0, 0)(dx.p, out.p));
        CK(cudaDeviceSynchronize());
        std::vector<float> h = out.down();
        for (int b = 0; b < 9; b++) {
            double s = 0;
            for (int i = 0; i < 128; i++) s += x[b * 128 + i];
            EXPECT(h[b] == (float)s);
        }
    }
    {   /* a barrier makes the same exchange right */
        Dev<float> out(128);
        CK(RA_EMU_LAUNCH(k_with_barrier, 1, 128, 128 * sizeof(float), 0)(out.p));
        CK(cudaDeviceSynchronize());
        std::vector<float> h = out.down();
        for (int t = 0; t < 128; t++) EXPECT(h[t] == (float)((t + 32) % 128));
    }
    {   /* launch limits: too many threads, too much shared memory, opt-in */
        Dev<float> out(2048);
        EXPECT(RA_EMU_LAUNCH(k_with_barrier, 1, 1025, 0, 0)(out.p) == cudaErrorInvalidConfiguration);
        EXPECT(cudaGetLastError() == cudaErrorInvalidConfiguration);
        EXPECT(RA_EMU_LAUNCH(k_with_barrier, 1, 128, 64 * 1024, 0)(out.p) == cudaErrorInvalidValue);
        EXPECT(cudaGetLastError() == cudaErrorInvalidValue);
        CK(cudaFuncSetAttribute(k_with_barrier, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
        CK(RA_EMU_LAUNCH(k_with_barrier, 1, 128, 64 * 1024, 0)(out.p));
        CK(cudaDeviceSynchronize());
        EXPECT(RA_EMU_LAUNCH(k_with_barrier, 1, 128, 228 * 1024, 0)(out.p) == cudaErrorInvalidValue);
        (void)cudaGetLastError();
        EXPECT(RA_EMU_LAUNCH(k_with_barrier, dim3(1, 70000), 128, 0, 0)(out.p) == cudaErrorInvalidConfiguration);
        (void)cudaGetLastError();
    }
    EXPECT(ra_emu_reports_count() == 0);
    printf("ok\n");
    return 0;
}

/* Run a broken case; it must end in a report whose text has `want`. */
static int run_broken(const char *name) {
    const std::string c = name;
    std::string want;
    Dev<float> out(128), x(512);
    std::vector<float> hx(512, 1.f);
    x.up(hx);
    cudaError_t e = cudaSuccess;
    if (c == "missing_barrier") {
        want = "race on __shared__";
        e = RA_EMU_LAUNCH(k_missing_barrier, 1, 128, 128 * sizeof(float), 0)(out.p);
        if (!ra_emu_config()->check) {
            /* without the checker the result itself shows it, in any order */
            CK(e);
            CK(cudaDeviceSynchronize());
            std::vector<float> h = out.down();
            for (int t = 0; t < 128; t++)
                if (h[t] != (float)((t + 32) % 128)) {
                    printf("flagged: thread %d read %g, not %d\n", t, h[t], (t + 32) % 128);
                    return 0;
                }
            fprintf(stderr, "case %s: the result is right without a barrier\n", name);
            return 1;
        }
    } else if (c == "static_missing_barrier") {
        want = "race on __shared__";
        e = RA_EMU_LAUNCH(k_static_missing_barrier, 1, 128, 0, 0)(out.p);
    } else if (c == "war") {
        want = "race on __shared__";
        e = RA_EMU_LAUNCH(k_war, 1, 128, 128 * sizeof(float), 0)(out.p);
    } else if (c == "cp_async_early_read") {
        want = "before the cp.async.wait_group";
        e = RA_EMU_LAUNCH(k_cp_async_early_read, 1, 64, 64 * 16, 0)(x.p, out.p);
    } else if (c == "oob_shared") {
        want = "__shared__ read of 4 bytes at offset 512";
        e = RA_EMU_LAUNCH(k_oob_shared, 1, 128, 128 * sizeof(float), 0)(out.p);
    } else if (c == "oob_global") {
        want = "outside every allocation";
        e = RA_EMU_LAUNCH(k_oob_global, 1, 256, 0, 0)(out.p, 128);
    } else if (c == "host_pointer") {
        static float host[128];
        want = "host memory";
        e = RA_EMU_LAUNCH(k_host_pointer, 1, 128, 0, 0)(host);
    } else if (c == "shfl_outside_mask") {
        want = "not in the mask";
        e = RA_EMU_LAUNCH(k_shfl_outside_mask, 1, 32, 0, 0)(out.p);
    } else if (c == "deadlock") {
        want = "deadlock";
        e = RA_EMU_LAUNCH(k_deadlock, 1, 96, 0, 0)(out.p);
    } else if (c == "uninit_shared") {
        want = "which no thread of the block has written";
        e = RA_EMU_LAUNCH(k_uninit_shared, 1, 32, 128, 0)(out.p);
    } else if (c == "uninit_global") {
        Dev<float> fresh(128);
        want = "memory never written";
        e = RA_EMU_LAUNCH(k_uninit_global, 1, 32, 0, 0)(fresh.p, out.p);
        if (e == cudaSuccess) e = cudaDeviceSynchronize();
    } else if (c == "use_after_free") {
        float *p = nullptr;
        CK(cudaMalloc((void **)&p, 512));
        CK(cudaFree(p));
        want = "freed memory";
        e = RA_EMU_LAUNCH(k_freed, 1, 32, 0, 0)(p);
    } else if (c == "host_reads_without_wait") {
        /* the kernel runs on a non-blocking stream; the host copies its
         * output on the legacy stream, which does not wait for it (with
         * RINGATTN_EMU_LAZY=1 the stream starts only when observed, so the
         * copy sees the old contents every time) */
        cudaStream_t s;
        CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        CK(cudaMemset(out.p, 0, out.n * sizeof(float)));
        CK(cudaDeviceSynchronize());
        CK(RA_EMU_LAUNCH(k_fill, 1, 128, 0, s)(out.p));
        std::vector<float> early = out.down();   /* no wait: the bug */
        CK(cudaStreamSynchronize(s));
        std::vector<float> late = out.down();
        CK(cudaStreamDestroy(s));
        int stale = 0;
        for (int i = 0; i < 128; i++) stale += early[i] != 1.f;
        bool right = true;
        for (int i = 0; i < 128; i++) right = right && late[i] == 1.f;
        if (stale && right) {
            printf("flagged: %d of 128 outputs read before the stream ran\n", stale);
            return 0;
        }
        fprintf(stderr, "case %s: not flagged (stale %d, right after the wait %d)\n", name,
                stale, (int)right);
        return 1;
    } else {
        fprintf(stderr, "unknown case %s\n", name);
        return 2;
    }
    return expect_flagged(name, e, want.c_str());
}

int main(int argc, char **argv) {
    if (argc > 1) return run_broken(argv[1]);
    return run_ok();
}
