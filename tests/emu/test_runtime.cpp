/*
 * test_runtime.cpp -- the emulated CUDA runtime's devices, attributes,
 * errors, memory calls, copies, launches and the stand-in NCCL's table.
 * Streams, events and the lazy mode: test_runtime_streams.cpp.
 */
#include "emu_test.h"

#include <sys/wait.h>

static std::string str(const char *s) { return s != nullptr ? s : "(null)"; }

TEST(devices_and_current_device) {
    int n = 0, d = -1;
    OK(cudaGetDeviceCount(&n));
    CHECK_EQ(n, ra_emu_config()->devices);
    OK(cudaGetDevice(&d));
    CHECK_EQ(d, 0);
    OK(cudaSetDevice(1));
    OK(cudaGetDevice(&d));
    CHECK_EQ(d, 1);
    std::thread([] {   // per host thread, 0 at first
        int dd = -1;
        cudaGetDevice(&dd);
        CHECK_EQ(dd, 0);
    }).join();
    CHECK_EQ(cudaSetDevice(n), cudaErrorInvalidDevice);
    CHECK_EQ(cudaSetDevice(-1), cudaErrorInvalidDevice);
    CHECK_EQ(cudaGetLastError(), cudaErrorInvalidDevice);
    OK(cudaGetDevice(&d));
    CHECK_EQ(d, 1);
    OK(cudaSetDevice(0));
    CHECK_EQ(cudaGetDeviceCount(nullptr), cudaErrorInvalidValue);
}

TEST(h100_attributes_and_versions) {
    const std::pair<cudaDeviceAttr, int> want[] = {
        {cudaDevAttrMaxThreadsPerBlock, 1024}, {cudaDevAttrMaxBlockDimX, 1024},
        {cudaDevAttrMaxBlockDimY, 1024}, {cudaDevAttrMaxBlockDimZ, 64},
        {cudaDevAttrMaxGridDimX, 2147483647}, {cudaDevAttrMaxGridDimY, 65535},
        {cudaDevAttrMaxGridDimZ, 65535}, {cudaDevAttrMaxSharedMemoryPerBlock, 49152},
        {cudaDevAttrTotalConstantMemory, 65536}, {cudaDevAttrWarpSize, 32},
        {cudaDevAttrMaxRegistersPerBlock, 65536}, {cudaDevAttrMultiProcessorCount, 132},
        {cudaDevAttrIntegrated, 0}, {cudaDevAttrConcurrentKernels, 1},
        {cudaDevAttrL2CacheSize, 50 << 20}, {cudaDevAttrMaxThreadsPerMultiProcessor, 2048},
        {cudaDevAttrUnifiedAddressing, 1}, {cudaDevAttrComputeCapabilityMajor, 9},
        {cudaDevAttrComputeCapabilityMinor, 0},
        {cudaDevAttrMaxSharedMemoryPerMultiprocessor, 233472},
        {cudaDevAttrMaxSharedMemoryPerBlockOptin, 232448},
        {cudaDevAttrMemoryPoolsSupported, 1},
    };
    for (int d = 0; d < 2; d++)
        for (auto &w : want) {
            int v = -1;
            OK(cudaDeviceGetAttribute(&v, w.first, d));
            CHECK_EQ(v, w.second);
        }
    int v = 0;
    OK(cudaDeviceGetAttribute(&v, cudaDevAttrClockRate, 0));
    CHECK(v > 1000000);
    CHECK_EQ(cudaDeviceGetAttribute(&v, (cudaDeviceAttr)9999, 0), cudaErrorInvalidValue);
    CHECK_EQ(cudaDeviceGetAttribute(&v, cudaDevAttrWarpSize, 7), cudaErrorInvalidDevice);
    CHECK_EQ(cudaDeviceGetAttribute(nullptr, cudaDevAttrWarpSize, 0), cudaErrorInvalidValue);
    OK(cudaRuntimeGetVersion(&v));
    CHECK_EQ(v, 13000);
    OK(cudaDriverGetVersion(&v));
    CHECK_EQ(v, 13000);
    (void)cudaGetLastError();
}

TEST(error_names_and_strings) {
    /* every code's name and text are compared with the CUDA toolkit's own
     * runtime by tests/test_emu_runtime.py (tests/emu/print_errors.c);
     * here: what the runtime answers for codes it does not know */
    CHECK(str(cudaGetErrorName(cudaSuccess)) == "cudaSuccess");
    CHECK(str(cudaGetErrorName((cudaError_t)12345)) == "unrecognized error code");
    CHECK(str(cudaGetErrorString((cudaError_t)12345)) == "unrecognized error code");
}

TEST(last_error_per_thread) {
    (void)cudaGetLastError();
    CHECK_EQ(cudaSetDevice(99), cudaErrorInvalidDevice);
    CHECK_EQ(cudaPeekAtLastError(), cudaErrorInvalidDevice);
    CHECK_EQ(cudaPeekAtLastError(), cudaErrorInvalidDevice);
    std::thread([] { CHECK_EQ(cudaGetLastError(), cudaSuccess); }).join();
    CHECK_EQ(cudaGetLastError(), cudaErrorInvalidDevice);
    CHECK_EQ(cudaGetLastError(), cudaSuccess);
    CHECK_EQ(cudaPeekAtLastError(), cudaSuccess);
    /* a later success does not clear it */
    CHECK_EQ(cudaFree((void *)0x1234), cudaErrorInvalidValue);
    int d;
    OK(cudaGetDevice(&d));
    CHECK_EQ(cudaGetLastError(), cudaErrorInvalidValue);
}

TEST(malloc_free_and_info) {
    size_t free0 = 0, total = 0, free1 = 0;
    OK(cudaMemGetInfo(&free0, &total));
    CHECK_EQ(total, ra_emu_arena_per_device);
    void *p = nullptr;
    OK(cudaMalloc(&p, 1000));
    CHECK(p != nullptr);
    CHECK_EQ((uintptr_t)p % 256, 0);
    CHECK_EQ(ra_emu_mem_device_of(p), 0);
    OK(cudaMemGetInfo(&free1, &total));
    CHECK_EQ(free0 - free1, 1024);
    CHECK_EQ(cudaFree((char *)p + 1), cudaErrorInvalidValue);
    OK(cudaFree(p));
    CHECK_EQ(cudaFree(p), cudaErrorInvalidValue);            // twice
    int local = 0;
    CHECK_EQ(cudaFree(&local), cudaErrorInvalidValue);       // host memory
    OK(cudaFree(nullptr));
    void *z = (void *)0x1;
    OK(cudaMalloc(&z, 0));
    CHECK(z == nullptr);
    CHECK_EQ(cudaMalloc(nullptr, 10), cudaErrorInvalidValue);
    CHECK_EQ(cudaMalloc(&z, (size_t)1 << 60), cudaErrorMemoryAllocation);
    OK(cudaSetDevice(1));
    OK(cudaMalloc(&p, 64));
    CHECK_EQ(ra_emu_mem_device_of(p), 1);
    OK(cudaSetDevice(0));
    OK(cudaFree(p));            // a block of another device
    (void)cudaGetLastError();
}

TEST(pinned_memory_and_pointer_attributes) {
    void *h = nullptr, *d0 = nullptr, *d1 = nullptr;
    OK(cudaMallocHost(&h, 5000));
    CHECK(h != nullptr);
    OK(cudaMalloc(&d0, 256));
    OK(cudaSetDevice(1));
    OK(cudaMalloc(&d1, 256));
    OK(cudaSetDevice(0));
    cudaPointerAttributes a;
    OK(cudaPointerGetAttributes(&a, d0));
    CHECK_EQ(a.type, cudaMemoryTypeDevice);
    CHECK_EQ(a.device, 0);
    CHECK(a.devicePointer == d0 && a.hostPointer == nullptr);
    OK(cudaPointerGetAttributes(&a, (char *)d1 + 100));
    CHECK_EQ(a.type, cudaMemoryTypeDevice);
    CHECK_EQ(a.device, 1);
    OK(cudaPointerGetAttributes(&a, (char *)h + 4999));
    CHECK_EQ(a.type, cudaMemoryTypeHost);
    CHECK_EQ(a.device, 0);
    CHECK(a.hostPointer == (char *)h + 4999);
    int local = 0;
    OK(cudaPointerGetAttributes(&a, &local));
    CHECK_EQ(a.type, cudaMemoryTypeUnregistered);
    CHECK_EQ(a.device, -2);
    CHECK(a.devicePointer == nullptr && a.hostPointer == nullptr);
    OK(cudaFree(d1));
    OK(cudaPointerGetAttributes(&a, d1));            // freed: no allocation holds it
    CHECK_EQ(a.type, cudaMemoryTypeUnregistered);
    CHECK_EQ(cudaPointerGetAttributes(nullptr, d0), cudaErrorInvalidValue);
    CHECK_EQ(cudaFreeHost(&local), cudaErrorInvalidValue);
    CHECK_EQ(cudaFreeHost((char *)h + 1), cudaErrorInvalidValue);
    OK(cudaFreeHost(h));
    OK(cudaPointerGetAttributes(&a, h));
    CHECK_EQ(a.type, cudaMemoryTypeUnregistered);
    OK(cudaFreeHost(nullptr));
    OK(cudaFree(d0));
    (void)cudaGetLastError();
}

TEST(copies_of_every_kind) {
    const size_t n = 3000;
    std::vector<unsigned char> a(n), b(n);
    for (size_t i = 0; i < n; i++) a[i] = (unsigned char)(i * 7 + 1);
    unsigned char *d = nullptr, *e = nullptr, *f = nullptr, *pin = nullptr;
    OK(cudaMalloc(&d, n));
    OK(cudaMalloc(&e, n));
    OK(cudaSetDevice(1));
    OK(cudaMalloc(&f, n));
    OK(cudaSetDevice(0));
    OK(cudaMallocHost(&pin, n));
    OK(cudaMemcpy(d, a.data(), n, cudaMemcpyHostToDevice));
    OK(cudaMemcpy(e, d, n, cudaMemcpyDeviceToDevice));
    OK(cudaMemcpy(f, e, n, cudaMemcpyDefault));                 // across devices
    OK(cudaMemcpy(pin, f, n, cudaMemcpyDeviceToHost));
    OK(cudaMemcpy(b.data(), pin, n, cudaMemcpyHostToHost));
    CHECK(a == b);
    /* cudaMemcpyDefault infers all four */
    std::vector<unsigned char> c(n, 0);
    OK(cudaMemset(d, 0, n));
    OK(cudaMemcpy(d, a.data(), n, cudaMemcpyDefault));
    OK(cudaMemcpy(e, d, n, cudaMemcpyDefault));
    OK(cudaMemcpy(c.data(), e, n, cudaMemcpyDefault));
    CHECK(c == a);
    OK(cudaMemcpy(pin, c.data(), n, cudaMemcpyDefault));
    CHECK(memcmp(pin, a.data(), n) == 0);
    /* async forms, then a wait */
    cudaStream_t s;
    OK(cudaStreamCreate(&s));
    OK(cudaMemsetAsync(e, 0x5a, n, s));
    OK(cudaMemcpyAsync(pin, e, n, cudaMemcpyDeviceToHost, s));
    OK(cudaStreamSynchronize(s));
    CHECK(pin[0] == 0x5a && pin[n - 1] == 0x5a);
    OK(cudaMemcpyAsync(e + 1, a.data(), n - 1, cudaMemcpyHostToDevice, s));   // unaligned
    OK(cudaMemcpyAsync(c.data(), e, n, cudaMemcpyDeviceToHost, s));
    CHECK(c[0] == 0x5a && memcmp(c.data() + 1, a.data(), n - 1) == 0);
    OK(cudaMemset(d, 0x11, 10));
    OK(cudaMemcpy(c.data(), d, 10, cudaMemcpyDeviceToHost));
    CHECK(c[0] == 0x11 && c[9] == 0x11);
    OK(cudaMemcpy(nullptr, nullptr, 0, cudaMemcpyDefault));      // nothing to do
    OK(cudaStreamDestroy(s));
    OK(cudaFree(d));
    OK(cudaFree(e));
    OK(cudaFree(f));
    OK(cudaFreeHost(pin));
}

TEST(copy_errors) {
    const size_t n = 512;
    std::vector<unsigned char> h(n);
    unsigned char *d = nullptr, *pin = nullptr;
    OK(cudaMalloc(&d, n));
    OK(cudaMallocHost(&pin, n));
    const cudaError_t bad = cudaErrorInvalidValue;
    CHECK_EQ(cudaMemcpy(h.data(), h.data(), n, cudaMemcpyHostToDevice), bad);   // dst host
    CHECK_EQ(cudaMemcpy(pin, h.data(), n, cudaMemcpyHostToDevice), bad);        // pinned is host
    CHECK_EQ(cudaMemcpy(d, d, n, cudaMemcpyHostToDevice), bad);                 // src device
    CHECK_EQ(cudaMemcpy(d, d, n, cudaMemcpyDeviceToHost), bad);                 // dst device
    CHECK_EQ(cudaMemcpy(h.data(), h.data(), n, cudaMemcpyDeviceToHost), bad);   // src host
    CHECK_EQ(cudaMemcpy(d, h.data(), n, cudaMemcpyDeviceToDevice), bad);
    CHECK_EQ(cudaMemcpy(h.data(), d, n, cudaMemcpyHostToHost), bad);
    CHECK_EQ(cudaMemcpy(d, h.data(), n + 1, cudaMemcpyHostToDevice), bad);      // past the block
    CHECK_EQ(cudaMemcpy(d + 1, h.data(), n, cudaMemcpyDefault), bad);
    CHECK_EQ(cudaMemcpy(d - 256, h.data(), 16, cudaMemcpyDefault), bad);        // a redzone
    CHECK_EQ(cudaMemcpy(pin, h.data(), n + 1, cudaMemcpyHostToHost), bad);      // past pinned
    CHECK_EQ(cudaMemcpy(d, nullptr, n, cudaMemcpyHostToDevice), bad);
    CHECK_EQ(cudaMemcpy(d, h.data(), n, (cudaMemcpyKind)7), cudaErrorInvalidMemcpyDirection);
    CHECK_EQ(cudaMemcpyAsync(d, h.data(), n, cudaMemcpyHostToDevice, (cudaStream_t)0xdead0),
             cudaErrorInvalidResourceHandle);
    CHECK_EQ(cudaMemset(h.data(), 0, n), bad);                                  // pageable
    CHECK_EQ(cudaMemset(d, 0, n + 1), bad);
    CHECK_EQ(cudaMemsetAsync(d + n, 0, 1, 0), bad);
    OK(cudaMemset(pin, 3, n));                                                  // pinned: fine
    CHECK(pin[n - 1] == 3);
    CHECK_EQ(cudaGetLastError(), bad);
    OK(cudaFree(d));
    CHECK_EQ(cudaMemcpy(d, h.data(), n, cudaMemcpyHostToDevice), bad);          // freed
    OK(cudaFreeHost(pin));
    (void)cudaGetLastError();
}

TEST(copies_and_memsets_initialise) {
    unsigned char *d = nullptr;
    uintptr_t bad = 0;
    OK(cudaMalloc(&d, 1024));
    CHECK_EQ(ra_emu_mem_check(d, 1, 0, 1, &bad), RA_EMU_UNINIT_GLOBAL);
    std::vector<unsigned char> h(1024, 1), back(1024);
    OK(cudaMemcpy(back.data(), d, 1024, cudaMemcpyDeviceToHost));   // uninitialised: fine
    CHECK(back[0] == 0xff);                                          // the poison
    OK(cudaMemcpy(d, h.data(), 100, cudaMemcpyHostToDevice));
    OK(cudaMemset(d + 500, 0, 100));
    OK(cudaDeviceSynchronize());
    CHECK_EQ(ra_emu_mem_check(d, 100, 0, 1, &bad), 0);
    CHECK_EQ(ra_emu_mem_check(d + 100, 1, 0, 1, &bad), RA_EMU_UNINIT_GLOBAL);
    CHECK_EQ(ra_emu_mem_check(d + 500, 100, 0, 1, &bad), 0);
    CHECK_EQ(ra_emu_mem_check(d + 499, 2, 0, 1, &bad), RA_EMU_UNINIT_GLOBAL);
    OK(cudaFree(d));
}

/* A pageable source is copied aside at the call; a pinned one is read when
 * the copy runs.  Device -> pageable host returns once the copy is done. */
TEST(pageable_and_pinned_copy_timing) {
    cudaStream_t s;
    OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    int *d = nullptr, *pin = nullptr;
    OK(cudaMalloc(&d, 2 * sizeof(int)));
    OK(cudaMallocHost(&pin, sizeof(int)));
    Gate g;
    OK(cudaLaunchHostFunc(s, gate_fn, &g));
    int pageable = 1;
    *pin = 1;
    OK(cudaMemcpyAsync(d, &pageable, sizeof(int), cudaMemcpyHostToDevice, s));
    OK(cudaMemcpyAsync(d + 1, pin, sizeof(int), cudaMemcpyHostToDevice, s));
    pageable = 2;
    *pin = 2;
    g.open = 1;
    int back[2] = {0, 0};
    OK(cudaMemcpyAsync(back, d, sizeof back, cudaMemcpyDeviceToHost, s));   // waits
    CHECK_EQ(back[0], 1);
    CHECK_EQ(back[1], 2);
    /* device -> pinned is asynchronous: nothing there before a wait */
    Gate g2;
    pin[0] = 0;
    OK(cudaLaunchHostFunc(s, gate_fn, &g2));
    OK(cudaMemcpyAsync(pin, d, sizeof(int), cudaMemcpyDeviceToHost, s));
    sleep_ms(20);
    CHECK_EQ(pin[0], 0);
    g2.open = 1;
    OK(cudaStreamSynchronize(s));
    CHECK_EQ(pin[0], 1);
    OK(cudaStreamDestroy(s));
    OK(cudaFree(d));
    OK(cudaFreeHost(pin));
}

/* cudaMemcpy device -> device on the legacy stream returns at once, and
 * waits for the work before it on blocking streams. */
TEST(sync_copy_device_to_device_is_asynchronous) {
    cudaStream_t blocking;
    OK(cudaStreamCreate(&blocking));
    int *a = nullptr, *b = nullptr, one = 1, back = 0;
    OK(cudaMalloc(&a, sizeof(int)));
    OK(cudaMalloc(&b, sizeof(int)));
    OK(cudaMemset(b, 0, sizeof(int)));
    Gate g;
    OK(cudaLaunchHostFunc(blocking, gate_fn, &g));
    OK(cudaMemcpyAsync(a, &one, sizeof(int), cudaMemcpyHostToDevice, blocking));
    OK(cudaMemcpy(b, a, sizeof(int), cudaMemcpyDeviceToDevice));   // returns while gated
    g.open = 1;
    OK(cudaMemcpy(&back, b, sizeof(int), cudaMemcpyDeviceToHost));
    CHECK_EQ(back, 1);
    OK(cudaStreamDestroy(blocking));
    OK(cudaFree(a));
    OK(cudaFree(b));
}

TEST(launch_checks) {
    std::atomic<int> ran{0};
    OK(launch(0, [&] { ran++; }, dim3(256)));
    OK(cudaDeviceSynchronize());
    CHECK_EQ(ran.load(), 1);
    /* refused launches queue nothing, free their arguments, set the last error */
    CHECK_EQ(launch(0, [&] { ran++; }, dim3(2048)), cudaErrorInvalidConfiguration);
    CHECK_EQ(cudaPeekAtLastError(), cudaErrorInvalidConfiguration);
    CHECK(str(cudaGetErrorString(cudaErrorInvalidConfiguration)).find("1024 threads") !=
          std::string::npos);
    CHECK_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
    CHECK_EQ(launch(0, [&] { ran++; }, dim3(0)), cudaErrorInvalidConfiguration);
    static int big_kernel;
    CHECK_EQ(launch(0, [&] { ran++; }, dim3(32), 100 * 1024, &big_kernel), cudaErrorInvalidValue);
    OK(cudaFuncSetAttribute(&big_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            100 * 1024));
    OK(launch(0, [&] { ran++; }, dim3(32), 100 * 1024, &big_kernel));
    CHECK_EQ(cudaFuncSetAttribute(&big_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  300 * 1024), cudaErrorInvalidValue);
    CHECK_EQ(cudaFuncSetAttribute(nullptr, cudaFuncAttributeMaxDynamicSharedMemorySize, 0),
             cudaErrorInvalidDeviceFunction);
    OK(cudaFuncSetAttribute(&big_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 50));
    OK(cudaDeviceSynchronize());
    CHECK_EQ(ran.load(), 2);
    /* a stream of another device: refused, as on a GPU */
    cudaStream_t s1;
    OK(cudaSetDevice(1));
    OK(cudaStreamCreate(&s1));
    OK(cudaSetDevice(0));
    CHECK_EQ(launch(s1, [&] { ran++; }), cudaErrorInvalidResourceHandle);
    CHECK_EQ(launch((cudaStream_t)0xbad0, [&] { ran++; }), cudaErrorInvalidResourceHandle);
    OK(cudaSetDevice(1));
    OK(launch(s1, [&] { ran++; }));
    OK(cudaStreamSynchronize(s1));
    OK(cudaStreamDestroy(s1));
    OK(cudaSetDevice(0));
    CHECK_EQ(ran.load(), 3);
    (void)cudaGetLastError();
}

/* A kernel fault: every later call on the device returns it; the other
 * device goes on; cudaDeviceReset clears it with the device's memory. */
TEST(sticky_errors) {
    const struct { ra_emu_report_kind kind; cudaError_t err; } cases[] = {
        {RA_EMU_OOB_GLOBAL, cudaErrorIllegalAddress},
        {RA_EMU_RACE_SHARED, cudaErrorIllegalAddress},
        {RA_EMU_MISALIGNED, cudaErrorMisalignedAddress},
        {RA_EMU_SYNC, cudaErrorLaunchFailure},
    };
    for (auto &c : cases) {
        OK(cudaSetDevice(1));
        void *keep = nullptr, *other = nullptr;
        OK(cudaMalloc(&keep, 64));
        OK(cudaSetDevice(0));
        void *p = nullptr;
        OK(cudaMalloc(&p, 64));
        cudaStream_t s;
        OK(cudaStreamCreate(&s));
        std::atomic<int> later{0};
        const ra_emu_report_kind kind = c.kind;
        Gate g;                              // both queued before the fault happens
        OK(cudaLaunchHostFunc(s, gate_fn, &g));
        OK(launch(s, [kind] { ra_emu_report(kind, "test fault number %d", (int)kind); }));
        OK(launch(s, [&] { later = 1; }));   // after the fault: dropped
        g.open = 1;
        CHECK_EQ(cudaStreamSynchronize(s), c.err);
        CHECK_EQ(later.load(), 0);
        CHECK_EQ(cudaGetLastError(), c.err);
        CHECK_EQ(cudaGetLastError(), c.err);          // sticky: not cleared
        CHECK_EQ(cudaMalloc(&other, 64), c.err);
        CHECK_EQ(cudaDeviceSynchronize(), c.err);
        CHECK_EQ(cudaMemset(p, 0, 64), c.err);
        CHECK_EQ(launch(0, [] {}), c.err);
        char want[64];
        snprintf(want, sizeof want, "test fault number %d", (int)kind);
        CHECK(str(cudaGetErrorString(c.err)).find(want) != std::string::npos);
        /* the other device is fine */
        OK(cudaSetDevice(1));
        OK(cudaDeviceSynchronize());
        OK(cudaMalloc(&other, 64));
        OK(cudaFree(other));
        OK(cudaSetDevice(0));
        OK(cudaDeviceReset());
        OK(cudaGetLastError());
        CHECK_EQ(cudaStreamSynchronize(s), cudaErrorInvalidResourceHandle);   // reset ended it
        CHECK_EQ(cudaFree(p), cudaErrorInvalidValue);                         // and its memory
        OK(cudaMalloc(&p, 64));
        OK(cudaFree(p));
        OK(cudaSetDevice(1));
        OK(cudaFree(keep));
        OK(cudaSetDevice(0));
        (void)cudaGetLastError();
    }
    ra_emu_reports_clear();
}

/* A copy that runs into a block freed in stream order faults the device. */
TEST(free_async_is_stream_ordered) {
    cudaStream_t s;
    OK(cudaStreamCreate(&s));
    int *d = nullptr, one = 1, back = 0;
    OK(cudaMallocAsync((void **)&d, sizeof(int), s));
    OK(cudaMemcpyAsync(d, &one, sizeof(int), cudaMemcpyHostToDevice, s));
    OK(cudaMemcpyAsync(&back, d, sizeof(int), cudaMemcpyDeviceToHost, s));
    CHECK_EQ(back, 1);
    Gate g;
    OK(cudaLaunchHostFunc(s, gate_fn, &g));
    OK(cudaFreeAsync(d, s));
    CHECK_EQ(cudaFreeAsync(d, s), cudaErrorInvalidValue);     // already queued
    CHECK_EQ(cudaFree(d), cudaErrorInvalidValue);
    CHECK(ra_emu_mem_find(d, nullptr, nullptr) == 0);         // not yet
    g.open = 1;
    OK(cudaStreamSynchronize(s));
    CHECK(ra_emu_mem_find(d, nullptr, nullptr) == -1);
    /* a copy queued before the free but run after it (another stream) */
    OK(cudaMallocAsync((void **)&d, sizeof(int), s));
    cudaStream_t t;
    OK(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking));
    Gate g2;
    OK(cudaLaunchHostFunc(t, gate_fn, &g2));
    OK(cudaMemcpyAsync(d, &one, sizeof(int), cudaMemcpyHostToDevice, t));
    OK(cudaFreeAsync(d, s));
    OK(cudaStreamSynchronize(s));
    g2.open = 1;
    CHECK_EQ(cudaStreamSynchronize(t), cudaErrorIllegalAddress);
    CHECK(str(cudaGetErrorString(cudaErrorIllegalAddress)).find("freed") != std::string::npos);
    OK(cudaDeviceReset());
    ra_emu_reports_clear();
    (void)cudaGetLastError();
}

/* cudaFree waits for the device's queued work, on every stream. */
TEST(free_synchronises_the_device) {
    cudaStream_t s;
    OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    void *p = nullptr;
    OK(cudaMalloc(&p, 64));
    std::atomic<int> flag{0};
    OK(cudaLaunchHostFunc(s, [](void *f) {
        sleep_ms(50);
        ((std::atomic<int> *)f)->store(1);
    }, &flag));
    OK(cudaFree(p));
    CHECK_EQ(flag.load(), 1);
    OK(cudaStreamDestroy(s));
}

static void CUDART_CB calls_cuda(void *p) {
    int *out = (int *)p;
    void *q = nullptr;
    out[0] = cudaMalloc(&q, 16);
    out[1] = cudaStreamSynchronize(0);
    int d = -1;
    out[2] = cudaGetDevice(&d);
}

TEST(host_functions_may_not_call_cuda) {
    int out[3] = {-1, -1, -1};
    OK(cudaLaunchHostFunc(0, calls_cuda, out));
    OK(cudaStreamSynchronize(0));
    CHECK_EQ(out[0], cudaErrorNotPermitted);
    CHECK_EQ(out[1], cudaErrorNotPermitted);
    CHECK_EQ(out[2], cudaSuccess);
    CHECK_EQ(cudaLaunchHostFunc(0, nullptr, nullptr), cudaErrorInvalidValue);
    (void)cudaGetLastError();
}

static int call_count(void *p) {
    ((std::atomic<int> *)p)->fetch_add(1);
    return 0;
}
static int call_fails(void *) { return cudaErrorLaunchFailure; }

TEST(nccl_table) {
    const ra_emu_rt_table *t = ra_emu_runtime_table();
    CHECK(t != nullptr);
    CHECK_EQ(t->version, RA_EMU_RT_TABLE_VERSION);
    cudaStream_t s;
    OK(cudaSetDevice(1));
    OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CHECK_EQ(t->current_device(), 1);
    OK(cudaSetDevice(0));
    CHECK_EQ(t->current_device(), 0);
    CHECK_EQ(t->stream_device(s), 1);
    CHECK_EQ(t->stream_device(nullptr), 0);
    CHECK_EQ(t->stream_device((void *)0xdead0), -1);
    std::atomic<int> n{0};
    CHECK_EQ(t->enqueue(s, call_count, &n), 0);
    CHECK_EQ(t->enqueue((void *)0xdead0, call_count, &n), cudaErrorInvalidResourceHandle);
    OK(cudaStreamSynchronize(s));
    CHECK_EQ(n.load(), 1);
    /* a failing transfer: the stream's error, for events recorded after it */
    cudaEvent_t before, after;
    OK(cudaSetDevice(1));
    OK(cudaEventCreate(&before));
    OK(cudaEventCreate(&after));
    OK(cudaEventRecord(before, s));
    CHECK_EQ(t->enqueue(s, call_fails, nullptr), 0);
    OK(cudaEventRecord(after, s));
    CHECK_EQ(cudaStreamSynchronize(s), cudaErrorLaunchFailure);
    OK(cudaEventSynchronize(before));
    CHECK_EQ(cudaEventSynchronize(after), cudaErrorLaunchFailure);
    CHECK_EQ(cudaEventQuery(after), cudaErrorLaunchFailure);
    OK(cudaEventDestroy(before));
    OK(cudaEventDestroy(after));
    OK(cudaStreamDestroy(s));
    OK(cudaSetDevice(0));
    /* device_of and mark_init */
    unsigned char *d = nullptr;
    OK(cudaMalloc(&d, 100));
    CHECK_EQ(t->device_of(d, 100), 0);
    CHECK_EQ(t->device_of(d + 50, 50), 0);
    CHECK_EQ(t->device_of(d, 101), -1);
    int local = 0;
    CHECK_EQ(t->device_of(&local, 4), -1);
    uintptr_t bad = 0;
    t->mark_init(d, 10);
    CHECK_EQ(ra_emu_mem_check(d, 10, 0, 1, &bad), 0);
    CHECK_EQ(ra_emu_mem_check(d + 10, 1, 0, 1, &bad), RA_EMU_UNINIT_GLOBAL);
    OK(cudaFree(d));
    (void)cudaGetLastError();
}

/* In a child forked after the runtime started, every call fails cleanly. */
TEST(forked_child_is_refused) {
    void *p = nullptr;
    OK(cudaMalloc(&p, 16));
    pid_t pid = fork();
    if (pid == 0) {
        void *q = nullptr;
        int rc = cudaMalloc(&q, 16) == cudaErrorInitializationError &&
                 cudaStreamSynchronize(0) == cudaErrorInitializationError ? 0 : 1;
        _exit(rc);
    }
    int status = -1;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    OK(cudaFree(p));
}
