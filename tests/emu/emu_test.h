/*
 * emu_test.h -- a small harness for the emulated runtime's C++ tests
 * (tests/test_emu_runtime.py builds and runs them), and stand-ins for the
 * four functions of simt.cpp the runtime calls, so that the runtime and
 * device memory are tested on their own: a "kernel" here is a host
 * function run once on the stream's worker thread; it fails the grid by
 * calling ra_emu_report like the checker does.
 *
 * Each test is a function registered with TEST(name); main() runs every
 * test (or those named on the command line) and exits non-zero if a CHECK
 * failed.
 */
#ifndef RA_EMU_TEST_H
#define RA_EMU_TEST_H

#include <cuda_runtime.h>

#include "emu/emu.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

/* ---- the harness --------------------------------------------------------- */

static std::atomic<int> g_failures{0};

#define CHECK(cond)                                                                    \
    do {                                                                               \
        if (!(cond)) {                                                                 \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);   \
            g_failures++;                                                              \
        }                                                                              \
    } while (0)

#define CHECK_EQ(a, b)                                                                 \
    do {                                                                               \
        long long ra_a_ = (long long)(a), ra_b_ = (long long)(b);                      \
        if (ra_a_ != ra_b_) {                                                          \
            fprintf(stderr, "%s:%d: CHECK_EQ failed: %s == %lld, %s == %lld\n",        \
                    __FILE__, __LINE__, #a, ra_a_, #b, ra_b_);                         \
            g_failures++;                                                              \
        }                                                                              \
    } while (0)

/* a CUDA call that must succeed */
#define OK(call) CHECK_EQ((call), cudaSuccess)

struct TestCase {
    const char *name;
    void (*fn)();
};

static std::vector<TestCase> &test_cases() {
    static std::vector<TestCase> *all = new std::vector<TestCase>();
    return *all;
}

struct TestRegistrar {
    TestRegistrar(const char *name, void (*fn)()) { test_cases().push_back({name, fn}); }
};

#define TEST(name)                                                                     \
    static void name();                                                                \
    static TestRegistrar name##_registrar(#name, name);                                \
    static void name()

static bool lazy() { return ra_emu_config()->lazy != 0; }

static void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

/* wait until pred() or `ms` have passed; pred() */
static bool eventually(const std::function<bool()> &pred, int ms = 5000) {
    for (int i = 0; i < ms; i++) {
        if (pred()) return true;
        sleep_ms(1);
    }
    return pred();
}

int main(int argc, char **argv) {
    int ran = 0;
    for (const TestCase &t : test_cases()) {
        bool wanted = argc < 2;
        for (int i = 1; i < argc; i++) wanted |= strcmp(argv[i], t.name) == 0;
        if (!wanted) continue;
        const int before = g_failures;
        t.fn();
        (void)cudaGetLastError();
        printf("%s %s\n", g_failures == before ? "ok  " : "FAIL", t.name);
        fflush(stdout);
        ran++;
    }
    printf("%d test(s), %d failed check(s)%s\n", ran, g_failures.load(),
           lazy() ? " (lazy mode)" : "");
    return g_failures == 0 && ran > 0 ? 0 : 1;
}

/* ---- a gate a host function waits at (the stream is busy until opened) ---- */

struct Gate {
    std::atomic<int> open{0};
    std::atomic<int> entered{0};
};

static void CUDART_CB gate_fn(void *p) {
    Gate *g = (Gate *)p;
    g->entered = 1;
    while (!g->open) sleep_ms(1);
}

static void CUDART_CB set_flag_fn(void *p) { ((std::atomic<int> *)p)->store(1); }

/* ---- stand-ins for simt.cpp ---------------------------------------------- */

static thread_local int tl_grid_failed;

extern "C" void ra_emu_report_fail_current(ra_emu_report_kind kind, const char *text) {
    (void)text;
    if (tl_grid_failed == 0) tl_grid_failed = (int)kind;
}

extern "C" int ra_emu_grid_validate(const ra_emu_grid *g, size_t smem_limit, const char **why) {
    const unsigned long long threads = (unsigned long long)g->block.x * g->block.y * g->block.z;
    *why = nullptr;
    if (threads == 0 || g->grid.x == 0 || g->grid.y == 0 || g->grid.z == 0) {
        *why = "a grid or block dimension is 0";
        return cudaErrorInvalidConfiguration;
    }
    if (threads > 1024 || g->block.z > 64) {
        *why = "more than 1024 threads per block";
        return cudaErrorInvalidConfiguration;
    }
    if (g->smem > smem_limit) {
        *why = "more dynamic shared memory than allowed";
        return cudaErrorInvalidValue;
    }
    return 0;
}

extern "C" int ra_emu_grid_run(const ra_emu_grid *g) {
    tl_grid_failed = 0;
    g->thunk(g->args);
    const int k = tl_grid_failed;
    tl_grid_failed = 0;
    return k;
}

static pthread_mutex_t g_smem_mu = PTHREAD_MUTEX_INITIALIZER;
static std::map<const void *, int> *g_smem;

extern "C" int ra_emu_func_set_smem(const void *func, int bytes) {
    if (bytes < 0 || bytes > RA_EMU_SMEM_OPTIN) return cudaErrorInvalidValue;
    pthread_mutex_lock(&g_smem_mu);
    if (g_smem == nullptr) g_smem = new std::map<const void *, int>();
    (*g_smem)[func] = bytes;
    pthread_mutex_unlock(&g_smem_mu);
    return 0;
}

extern "C" size_t ra_emu_func_smem_limit(const void *func) {
    pthread_mutex_lock(&g_smem_mu);
    int v = 0;
    if (g_smem != nullptr && g_smem->count(func)) v = (*g_smem)[func];
    pthread_mutex_unlock(&g_smem_mu);
    return v > RA_EMU_SMEM_DEFAULT ? (size_t)v : (size_t)RA_EMU_SMEM_DEFAULT;
}

/* A "kernel": body() once on the stream's worker, as grid (1,1,1) x block. */
static int g_kernel_identity;

static cudaError_t launch(cudaStream_t stream, std::function<void()> body,
                          dim3 block = dim3(1, 1, 1), size_t smem = 0,
                          const void *func = &g_kernel_identity) {
    auto *pack = new std::function<void()>(std::move(body));
    return raEmuLaunchKernel(
        func, "test_kernel", "emu_test.h", 1, 1, 1, block.x, block.y, block.z, smem, stream,
        [](void *a) { (*(std::function<void()> *)a)(); }, pack,
        [](void *a) { delete (std::function<void()> *)a; });
}

#endif /* RA_EMU_TEST_H */
