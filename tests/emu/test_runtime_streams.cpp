/*
 * test_runtime_streams.cpp -- streams, events and the lazy mode of the
 * emulated CUDA runtime: in-order queues run asynchronously to the host,
 * the legacy default stream's implicit ordering, events across streams and
 * devices, invalid handles, many host threads at once.  Each test holds in
 * both modes (RINGATTN_EMU_LAZY=0 and 1); some check more in one of them.
 */
#include "emu_test.h"

struct SleepWrite {
    int *where;
    int value;
    int ms;
};

static void CUDART_CB sleep_then_write(void *p) {
    SleepWrite *w = (SleepWrite *)p;
    sleep_ms(w->ms);
    *w->where = w->value;
}

/* A later copy on the same stream sees what a slow host function wrote;
 * one on another stream does not, unless it waits for an event. */
TEST(stream_order) {
    cudaStream_t a, b;
    OK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    OK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    int *pin = nullptr, *d = nullptr;
    OK(cudaMallocHost(&pin, sizeof(int)));
    OK(cudaMalloc(&d, 3 * sizeof(int)));
    *pin = 1;
    Gate g;
    SleepWrite w = {pin, 42, 30};
    OK(cudaLaunchHostFunc(a, gate_fn, &g));
    OK(cudaLaunchHostFunc(a, sleep_then_write, &w));
    OK(cudaMemcpyAsync(d, pin, sizeof(int), cudaMemcpyHostToDevice, a));
    cudaEvent_t ev;
    OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    OK(cudaEventRecord(ev, a));
    OK(cudaMemcpyAsync(d + 1, pin, sizeof(int), cudaMemcpyHostToDevice, b));   // no wait
    OK(cudaStreamSynchronize(b));
    g.open = 1;
    OK(cudaStreamWaitEvent(b, ev, 0));
    OK(cudaMemcpyAsync(d + 2, d, sizeof(int), cudaMemcpyDeviceToDevice, b));
    int back[3] = {0, 0, 0};
    OK(cudaMemcpyAsync(back, d, sizeof back, cudaMemcpyDeviceToHost, b));
    CHECK_EQ(back[0], 42);   // same stream: after the write
    CHECK_EQ(back[1], 1);    // another stream, no wait: before it
    CHECK_EQ(back[2], 42);   // another stream after an event wait
    OK(cudaEventDestroy(ev));
    OK(cudaStreamDestroy(a));
    OK(cudaStreamDestroy(b));
    OK(cudaFree(d));
    OK(cudaFreeHost(pin));
}

/* Lazy mode: nothing starts until the host observes it, so a read without
 * a wait sees stale data every time.  Default mode: work starts at once. */
TEST(lazy_or_eager_start) {
    cudaStream_t s;
    OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    unsigned char *d = nullptr;
    OK(cudaMalloc(&d, 64));
    std::atomic<int> flag{0};
    OK(cudaMemsetAsync(d, 7, 64, s));
    OK(cudaLaunchHostFunc(s, set_flag_fn, &flag));
    if (lazy()) {
        sleep_ms(30);
        CHECK_EQ(flag.load(), 0);
        CHECK_EQ(d[0], 0xff);                 // the host peeks: still the poison
    } else {
        CHECK(eventually([&] { return flag.load() == 1; }));
        CHECK_EQ(d[0], 7);
    }
    OK(cudaStreamSynchronize(s));
    CHECK_EQ(flag.load(), 1);
    CHECK_EQ(d[63], 7);

    /* each kind of observation releases the work it looks at */
    auto queued = [&](cudaStream_t st, std::atomic<int> &f) {
        f = 0;
        OK(cudaLaunchHostFunc(st, set_flag_fn, &f));
        if (lazy()) {
            sleep_ms(10);
            CHECK_EQ(f.load(), 0);
        }
    };
    cudaEvent_t ev;
    OK(cudaEventCreate(&ev));
    queued(s, flag);                                   // a stream query
    CHECK(eventually([&] { return cudaStreamQuery(s) == cudaSuccess; }));
    CHECK_EQ(flag.load(), 1);
    queued(s, flag);                                   // an event query
    OK(cudaEventRecord(ev, s));
    CHECK(eventually([&] { return cudaEventQuery(ev) == cudaSuccess; }));
    CHECK_EQ(flag.load(), 1);
    queued(s, flag);                                   // an event synchronize
    OK(cudaEventRecord(ev, s));
    OK(cudaEventSynchronize(ev));
    CHECK_EQ(flag.load(), 1);
    queued(s, flag);                                   // a device synchronize
    OK(cudaDeviceSynchronize());
    CHECK_EQ(flag.load(), 1);
    queued(s, flag);                                   // another stream waits, is observed
    OK(cudaEventRecord(ev, s));
    cudaStream_t t;
    OK(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking));
    OK(cudaStreamWaitEvent(t, ev, 0));
    OK(cudaStreamSynchronize(t));
    CHECK_EQ(flag.load(), 1);
    queued(0, flag);                                   // a synchronous copy on legacy
    int one = 0;
    OK(cudaMemcpy(&one, d, sizeof(int), cudaMemcpyDeviceToHost));
    CHECK_EQ(flag.load(), 1);
    queued(s, flag);                                   // cudaFree (a device sync)
    void *p = nullptr;
    OK(cudaMalloc(&p, 16));
    OK(cudaFree(p));
    CHECK_EQ(flag.load(), 1);
    queued(t, flag);                                   // a stream destroy
    OK(cudaStreamDestroy(t));
    CHECK(eventually([&] { return flag.load() == 1; }));
    OK(cudaEventDestroy(ev));
    OK(cudaStreamDestroy(s));
    OK(cudaFree(d));
}

/* The legacy default stream waits for the device's blocking streams and
 * they wait for it; non-blocking streams take no part. */
TEST(legacy_stream_semantics) {
    cudaStream_t blocking, nonblocking;
    OK(cudaStreamCreate(&blocking));
    OK(cudaStreamCreateWithFlags(&nonblocking, cudaStreamNonBlocking));
    unsigned flags = 9;
    OK(cudaStreamGetFlags(blocking, &flags));
    CHECK_EQ(flags, 0);
    OK(cudaStreamGetFlags(nonblocking, &flags));
    CHECK_EQ(flags, cudaStreamNonBlocking);
    std::atomic<int> legacy_ran{0}, after_ran{0};

    /* blocking stream busy -> legacy work waits */
    Gate g;
    OK(cudaLaunchHostFunc(blocking, gate_fn, &g));
    OK(cudaLaunchHostFunc(cudaStreamLegacy, set_flag_fn, &legacy_ran));
    OK(cudaStreamQuery(cudaStreamLegacy) == cudaErrorNotReady ? cudaSuccess : cudaErrorUnknown);
    sleep_ms(20);
    CHECK_EQ(legacy_ran.load(), 0);
    g.open = 1;
    OK(cudaStreamSynchronize(0));
    CHECK_EQ(legacy_ran.load(), 1);

    /* legacy busy -> later work on a blocking stream waits, not on a
     * non-blocking one */
    Gate g2;
    legacy_ran = 0;
    OK(cudaLaunchHostFunc(0, gate_fn, &g2));
    OK(cudaLaunchHostFunc(blocking, set_flag_fn, &after_ran));
    OK(cudaLaunchHostFunc(nonblocking, set_flag_fn, &legacy_ran));
    OK(cudaStreamSynchronize(nonblocking));
    CHECK_EQ(legacy_ran.load(), 1);
    CHECK_EQ(cudaStreamQuery(blocking), cudaErrorNotReady);
    CHECK_EQ(after_ran.load(), 0);
    g2.open = 1;
    OK(cudaStreamSynchronize(blocking));
    CHECK_EQ(after_ran.load(), 1);

    /* non-blocking busy -> legacy does not wait */
    Gate g3;
    legacy_ran = 0;
    OK(cudaLaunchHostFunc(nonblocking, gate_fn, &g3));
    OK(cudaLaunchHostFunc(0, set_flag_fn, &legacy_ran));
    OK(cudaStreamSynchronize(0));
    CHECK_EQ(legacy_ran.load(), 1);
    CHECK_EQ(cudaStreamQuery(nonblocking), cudaErrorNotReady);
    CHECK_EQ(cudaGetLastError(), cudaSuccess);      // NotReady is not an error
    g3.open = 1;
    OK(cudaStreamSynchronize(nonblocking));

    /* the per-thread stream is blocking, and one per host thread */
    Gate g4;
    std::atomic<int> pts_ran{0};
    OK(cudaLaunchHostFunc(cudaStreamPerThread, gate_fn, &g4));
    std::thread([&] {
        OK(cudaLaunchHostFunc(cudaStreamPerThread, set_flag_fn, &pts_ran));
        OK(cudaStreamSynchronize(cudaStreamPerThread));   // not this thread's gate
    }).join();
    CHECK_EQ(pts_ran.load(), 1);
    legacy_ran = 0;
    OK(cudaLaunchHostFunc(0, set_flag_fn, &legacy_ran));
    sleep_ms(20);
    CHECK_EQ(legacy_ran.load(), 0);
    g4.open = 1;
    OK(cudaStreamSynchronize(0));
    CHECK_EQ(legacy_ran.load(), 1);
    OK(cudaStreamGetFlags(cudaStreamPerThread, &flags));
    CHECK_EQ(flags, 0);
    int dev = -1;
    OK(cudaStreamGetDevice(cudaStreamPerThread, &dev));
    CHECK_EQ(dev, 0);

    /* a thread that exits with work queued on its stream: the work still runs */
    Gate g5;
    std::atomic<int> orphan{0};
    std::thread([&] {
        OK(cudaLaunchHostFunc(cudaStreamPerThread, gate_fn, &g5));
        OK(cudaLaunchHostFunc(cudaStreamPerThread, set_flag_fn, &orphan));
    }).join();
    g5.open = 1;
    OK(cudaDeviceSynchronize());
    CHECK_EQ(orphan.load(), 1);

    OK(cudaStreamDestroy(blocking));
    OK(cudaStreamDestroy(nonblocking));
}

TEST(events) {
    cudaStream_t s;
    OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t e0, e1, quiet;
    OK(cudaEventCreate(&e0));
    OK(cudaEventCreate(&e1));
    OK(cudaEventCreateWithFlags(&quiet, cudaEventDisableTiming));
    CHECK_EQ(cudaEventCreateWithFlags(&quiet, 0x80), cudaErrorInvalidValue);
    OK(cudaEventQuery(e0));                           // never recorded: complete
    OK(cudaEventSynchronize(e0));
    float ms = -1;
    CHECK_EQ(cudaEventElapsedTime(&ms, e0, e1), cudaErrorInvalidResourceHandle);
    Gate g;
    (void)cudaGetLastError();
    OK(cudaLaunchHostFunc(s, gate_fn, &g));
    OK(cudaEventRecord(e0, s));
    SleepWrite w = {new int(0), 1, 30};
    OK(cudaLaunchHostFunc(s, sleep_then_write, &w));
    OK(cudaEventRecord(e1, s));
    OK(cudaEventRecord(quiet, s));
    CHECK_EQ(cudaEventQuery(e1), cudaErrorNotReady);
    CHECK_EQ(cudaPeekAtLastError(), cudaSuccess);    // a query does not set it
    CHECK_EQ(cudaEventElapsedTime(&ms, e0, e1), cudaErrorNotReady);
    g.open = 1;
    OK(cudaEventSynchronize(e1));
    CHECK_EQ(*w.where, 1);
    OK(cudaEventElapsedTime(&ms, e0, e1));
    CHECK(ms >= 25 && ms < 5000);
    OK(cudaEventSynchronize(quiet));
    CHECK_EQ(cudaEventElapsedTime(&ms, e0, quiet), cudaErrorInvalidResourceHandle);
    /* recording again re-arms */
    Gate g2;
    OK(cudaLaunchHostFunc(s, gate_fn, &g2));
    OK(cudaEventRecord(e1, s));
    CHECK_EQ(cudaEventQuery(e1), cudaErrorNotReady);
    OK(cudaEventQuery(e0));
    g2.open = 1;
    OK(cudaEventSynchronize(e1));
    /* destroy while a wait on it is queued: the wait keeps its snapshot */
    Gate g3;
    cudaStream_t t;
    OK(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking));
    OK(cudaLaunchHostFunc(s, gate_fn, &g3));
    OK(cudaEventRecord(e1, s));
    OK(cudaStreamWaitEvent(t, e1, 0));
    OK(cudaEventRecord(e1, t));                       // re-record elsewhere: same snapshot
    OK(cudaEventDestroy(e1));
    std::atomic<int> after{0};
    OK(cudaLaunchHostFunc(t, set_flag_fn, &after));
    CHECK_EQ(cudaStreamQuery(t), cudaErrorNotReady);
    sleep_ms(20);
    CHECK_EQ(after.load(), 0);
    g3.open = 1;
    OK(cudaStreamSynchronize(t));
    CHECK_EQ(after.load(), 1);
    CHECK_EQ(cudaEventQuery(e1), cudaErrorInvalidResourceHandle);
    CHECK_EQ(cudaStreamWaitEvent(t, e0, 1), cudaErrorInvalidValue);
    delete w.where;
    OK(cudaEventDestroy(e0));
    OK(cudaEventDestroy(quiet));
    OK(cudaStreamDestroy(s));
    OK(cudaStreamDestroy(t));
    (void)cudaGetLastError();
}

/* An event of device 0 orders a stream of device 1; events are recorded
 * only on streams of their own device. */
TEST(events_across_devices) {
    cudaStream_t s0, s1;
    cudaEvent_t e0;
    OK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
    OK(cudaEventCreateWithFlags(&e0, cudaEventDisableTiming));
    int *d0 = nullptr, *d1 = nullptr, *pin = nullptr;
    OK(cudaMalloc(&d0, sizeof(int)));
    OK(cudaMallocHost(&pin, sizeof(int)));
    OK(cudaSetDevice(1));
    OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    OK(cudaMalloc(&d1, sizeof(int)));
    CHECK_EQ(cudaEventRecord(e0, s1), cudaErrorInvalidResourceHandle);   // other device
    CHECK_EQ(cudaEventRecord(e0, 0), cudaErrorInvalidResourceHandle);    // device 1's legacy
    OK(cudaEventRecord(e0, s0));     // its own device's stream, whatever is current
    OK(cudaSetDevice(0));
    Gate g;
    *pin = 5;
    OK(cudaLaunchHostFunc(s0, gate_fn, &g));
    OK(cudaMemcpyAsync(d0, pin, sizeof(int), cudaMemcpyHostToDevice, s0));
    OK(cudaEventRecord(e0, s0));
    OK(cudaSetDevice(1));
    OK(cudaStreamWaitEvent(s1, e0, 0));
    OK(cudaMemcpyAsync(d1, d0, sizeof(int), cudaMemcpyDeviceToDevice, s1));
    CHECK_EQ(cudaStreamQuery(s1), cudaErrorNotReady);
    g.open = 1;
    int back = 0;
    OK(cudaMemcpyAsync(&back, d1, sizeof(int), cudaMemcpyDeviceToHost, s1));
    CHECK_EQ(back, 5);
    OK(cudaEventQuery(e0));          // from another device: fine
    OK(cudaStreamDestroy(s1));
    OK(cudaFree(d1));
    OK(cudaSetDevice(0));
    OK(cudaStreamDestroy(s0));
    OK(cudaEventDestroy(e0));
    OK(cudaFree(d0));
    OK(cudaFreeHost(pin));
    (void)cudaGetLastError();
}

TEST(invalid_handles) {
    const cudaError_t bad = cudaErrorInvalidResourceHandle;
    cudaStream_t garbage = (cudaStream_t)0xdeadbeef0ull, s;
    cudaEvent_t junk = (cudaEvent_t)0x1234560ull, ev;
    OK(cudaEventCreate(&ev));
    unsigned flags;
    int dev;
    void *p = nullptr;
    CHECK_EQ(cudaStreamSynchronize(garbage), bad);
    CHECK_EQ(cudaStreamQuery(garbage), bad);
    CHECK_EQ(cudaStreamDestroy(garbage), bad);
    CHECK_EQ(cudaStreamWaitEvent(garbage, ev, 0), bad);
    CHECK_EQ(cudaStreamGetFlags(garbage, &flags), bad);
    CHECK_EQ(cudaStreamGetDevice(garbage, &dev), bad);
    CHECK_EQ(cudaLaunchHostFunc(garbage, set_flag_fn, nullptr), bad);
    CHECK_EQ(cudaEventRecord(ev, garbage), bad);
    CHECK_EQ(cudaMemsetAsync(nullptr, 0, 0, garbage), bad);
    CHECK_EQ(cudaMallocAsync(&p, 16, garbage), bad);
    CHECK_EQ(cudaFreeAsync(nullptr, garbage), bad);
    CHECK_EQ(cudaEventQuery(junk), bad);
    CHECK_EQ(cudaEventSynchronize(junk), bad);
    CHECK_EQ(cudaEventDestroy(junk), bad);
    CHECK_EQ(cudaEventRecord(junk, 0), bad);
    CHECK_EQ(cudaStreamWaitEvent(0, junk, 0), bad);
    float ms;
    CHECK_EQ(cudaEventElapsedTime(&ms, junk, ev), bad);
    CHECK_EQ(cudaStreamDestroy(0), bad);
    CHECK_EQ(cudaStreamDestroy(cudaStreamPerThread), bad);
    /* destroyed handles are dead too, and queued work still ran */
    OK(cudaStreamCreate(&s));
    std::atomic<int> ran{0};
    Gate g;
    OK(cudaLaunchHostFunc(s, gate_fn, &g));
    OK(cudaLaunchHostFunc(s, set_flag_fn, &ran));
    OK(cudaStreamDestroy(s));                        // returns at once
    CHECK_EQ(cudaStreamSynchronize(s), bad);
    CHECK_EQ(cudaStreamDestroy(s), bad);
    g.open = 1;
    CHECK(eventually([&] { return ran.load() == 1; }));
    OK(cudaEventDestroy(ev));
    CHECK_EQ(cudaEventQuery(ev), bad);
    CHECK_EQ(cudaStreamCreateWithFlags(&s, 0x10), cudaErrorInvalidValue);
    CHECK_EQ(cudaStreamCreate(nullptr), cudaErrorInvalidValue);
    CHECK_EQ(cudaGetLastError(), cudaErrorInvalidValue);
}

/* Many host threads at once (the `threads` backend): each on its own
 * stream and device, all on a shared stream per device, events between. */
TEST(many_host_threads) {
    const int T = 8, rounds = 40, n = 256;
    cudaStream_t shared[2];
    for (int d = 0; d < 2; d++) {
        OK(cudaSetDevice(d));
        OK(cudaStreamCreateWithFlags(&shared[d], cudaStreamNonBlocking));
    }
    OK(cudaSetDevice(0));
    std::vector<std::thread> ts;
    for (int t = 0; t < T; t++)
        ts.emplace_back([&, t] {
            const int d = t % 2;
            OK(cudaSetDevice(d));
            cudaStream_t mine;
            cudaEvent_t ev;
            OK(cudaStreamCreateWithFlags(&mine, t % 3 == 0 ? cudaStreamNonBlocking : 0));
            OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
            std::vector<int> h(n), back(n);
            for (int r = 0; r < rounds; r++) {
                int *a = nullptr, *b = nullptr;
                OK(cudaMalloc(&a, n * sizeof(int)));
                OK(cudaMallocAsync((void **)&b, n * sizeof(int), mine));
                for (int i = 0; i < n; i++) h[i] = t * 100000 + r * 1000 + i;
                OK(cudaMemcpyAsync(a, h.data(), n * sizeof(int), cudaMemcpyHostToDevice,
                                   shared[d]));
                OK(cudaEventRecord(ev, shared[d]));
                OK(cudaStreamWaitEvent(mine, ev, 0));
                OK(cudaMemcpyAsync(b, a, n * sizeof(int), cudaMemcpyDeviceToDevice, mine));
                OK(cudaMemcpyAsync(back.data(), b, n * sizeof(int), cudaMemcpyDeviceToHost,
                                   mine));
                if (back != h) g_failures++;
                OK(cudaFreeAsync(b, mine));
                OK(cudaFree(a));
                if (r % 10 == 0) OK(cudaStreamSynchronize(cudaStreamPerThread));
            }
            OK(cudaStreamSynchronize(mine));
            OK(cudaEventDestroy(ev));
            OK(cudaStreamDestroy(mine));
        });
    for (auto &t : ts) t.join();
    for (int d = 0; d < 2; d++) {
        OK(cudaSetDevice(d));
        OK(cudaStreamDestroy(shared[d]));
    }
    OK(cudaSetDevice(0));
}

/* cudaDeviceSynchronize waits for every stream of the current device, and
 * only of it. */
TEST(device_synchronize_scope) {
    cudaStream_t nb;
    OK(cudaStreamCreateWithFlags(&nb, cudaStreamNonBlocking));
    std::atomic<int> ran{0};
    SleepWrite w = {new int(0), 1, 30};
    OK(cudaLaunchHostFunc(nb, sleep_then_write, &w));
    OK(cudaLaunchHostFunc(nb, set_flag_fn, &ran));
    OK(cudaSetDevice(1));
    OK(cudaDeviceSynchronize());         // device 1: nothing queued
    OK(cudaSetDevice(0));
    OK(cudaDeviceSynchronize());
    CHECK_EQ(ran.load(), 1);
    CHECK_EQ(*w.where, 1);
    delete w.where;
    OK(cudaStreamDestroy(nb));
}

/* cudaMemcpy from pageable memory to the device returns once the source is
 * copied aside, the copy itself may still be queued (lazy mode: it is);
 * cudaMemset of device memory returns at once too.  A synchronisation of
 * the legacy stream waits for the blocking streams as well. */
TEST(synchronous_calls_that_return_early) {
    unsigned char *d = nullptr;
    OK(cudaMalloc(&d, 64));
    OK(cudaMemset(d, 1, 64));
    if (lazy()) CHECK_EQ(d[0], 0xff);    // not yet
    std::vector<unsigned char> h(64, 2);
    OK(cudaMemcpy(d, h.data(), 64, cudaMemcpyHostToDevice));
    h.assign(64, 3);                     // the copy has its own bytes
    if (lazy()) CHECK_EQ(d[0], 1);       // the host peeks: the memset before it ran,
                                         // the copy did not
    OK(cudaStreamSynchronize(0));
    CHECK_EQ(d[0], 2);
    CHECK_EQ(d[63], 2);

    cudaStream_t blocking;
    OK(cudaStreamCreate(&blocking));
    SleepWrite w = {new int(0), 1, 30};
    OK(cudaLaunchHostFunc(blocking, sleep_then_write, &w));
    OK(cudaStreamSynchronize(cudaStreamLegacy));
    CHECK_EQ(*w.where, 1);
    delete w.where;
    OK(cudaStreamDestroy(blocking));
    OK(cudaFree(d));
}

/* ra_emu_host_syncs counts each call that made the host wait for device
 * work, and nothing else; ra_emu_set_lazy switches lazy mode at run time
 * (work held back starts once it is off again). */
TEST(host_sync_counter_and_lazy_switch) {
    cudaStream_t s;
    OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    unsigned char *d = nullptr;
    OK(cudaMalloc(&d, 64));
    std::vector<unsigned char> h(64, 5);
    cudaEvent_t ev;
    OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    uint64_t n = ra_emu_host_syncs();
    OK(cudaMemsetAsync(d, 1, 64, s));                               // queued
    OK(cudaMemcpyAsync(d, h.data(), 64, cudaMemcpyHostToDevice, s)); // copied aside
    OK(cudaEventRecord(ev, s));
    OK(cudaStreamWaitEvent(cudaStreamLegacy, ev, 0));
    (void)cudaEventQuery(ev);
    (void)cudaStreamQuery(s);
    CHECK_EQ(ra_emu_host_syncs(), n);
    OK(cudaStreamSynchronize(s));
    CHECK_EQ(ra_emu_host_syncs(), n + 1);
    OK(cudaEventSynchronize(ev));
    OK(cudaDeviceSynchronize());
    CHECK_EQ(ra_emu_host_syncs(), n + 3);
    OK(cudaMemcpyAsync(h.data(), d, 64, cudaMemcpyDeviceToHost, s)); // pageable: waits
    OK(cudaMemcpy(h.data(), d, 64, cudaMemcpyDeviceToHost));
    CHECK_EQ(ra_emu_host_syncs(), n + 5);
    CHECK_EQ(h[0], 5);
    void *p = nullptr;
    OK(cudaMalloc(&p, 16));
    OK(cudaFree(p));                                                 // a device sync
    CHECK_EQ(ra_emu_host_syncs(), n + 6);

    const int was = ra_emu_set_lazy(-1);
    CHECK_EQ(was, lazy() ? 1 : 0);
    CHECK_EQ(ra_emu_set_lazy(1), was);
    std::atomic<int> flag{0};
    OK(cudaLaunchHostFunc(s, set_flag_fn, &flag));
    sleep_ms(20);
    CHECK_EQ(flag.load(), 0);                 // held back: nobody looked
    CHECK_EQ(ra_emu_set_lazy(0), 1);
    CHECK(eventually([&] { return flag.load() == 1; }));
    CHECK_EQ(ra_emu_set_lazy(was), 0);
    CHECK_EQ(ra_emu_host_syncs(), n + 6);
    OK(cudaEventDestroy(ev));
    OK(cudaStreamDestroy(s));
    OK(cudaFree(d));
}
