/*
 * test_memory.cpp -- the emulated GPU's device memory (memory.cpp): the
 * arena, allocations, redzones, the quarantine and the shadow answers of
 * ra_emu_mem_check that the memory checker relies on.
 */
#include "emu_test.h"
#include "emu/runtime_internal.h"

static size_t kCap() {   // the quarantine's size (memory.cpp)
    size_t per = ra_emu_arena_per_device;
    return per / 16 < ((size_t)64 << 20) ? per / 16 : (size_t)64 << 20;
}

TEST(arena_layout) {
    CHECK_EQ(ra_emu_mem_init(), 0);
    const int n = ra_emu_config()->devices;
    CHECK(ra_emu_arena_per_device >= ra_emu_config()->mem_bytes);
    CHECK_EQ(ra_emu_arena_hi - ra_emu_arena_lo, ra_emu_arena_per_device * n);
    for (int d = 0; d < n; d++) {
        void *p = ra_emu_mem_alloc(d, 100);
        CHECK(p != nullptr);
        CHECK_EQ(ra_emu_mem_device_of(p), d);
        CHECK((uintptr_t)p >= ra_emu_arena_lo + d * ra_emu_arena_per_device);
        CHECK((uintptr_t)p < ra_emu_arena_lo + (d + 1) * ra_emu_arena_per_device);
        CHECK_EQ(ra_emu_mem_free(p), 0);
    }
    CHECK(ra_emu_mem_alloc(-1, 100) == nullptr);
    CHECK(ra_emu_mem_alloc(n, 100) == nullptr);
    int local = 0;
    CHECK_EQ(ra_emu_mem_device_of(&local), -1);
    CHECK_EQ(ra_emu_mem_device_of(nullptr), -1);
}

TEST(alignment_poison_and_find) {
    std::vector<void *> ps;
    for (size_t n : {1, 7, 255, 256, 257, 1000, 4096, 100000}) {
        unsigned char *p = (unsigned char *)ra_emu_mem_alloc(0, n);
        CHECK(p != nullptr);
        CHECK_EQ((uintptr_t)p % 256, 0);
        bool poisoned = true;
        for (size_t i = 0; i < n; i++) poisoned &= p[i] == 0xff;
        CHECK(poisoned);
        void *base = nullptr;
        size_t size = 0;
        CHECK_EQ(ra_emu_mem_find(p + n - 1, &base, &size), 0);
        CHECK(base == p);
        CHECK_EQ(size, n);
        CHECK_EQ(ra_emu_mem_find(p + n, &base, &size), -1);
        CHECK_EQ(ra_emu_mem_find(p - 1, &base, &size), -1);
        CHECK_EQ(ra_emu_mem_range(p, n, nullptr), 0);
        CHECK_EQ(ra_emu_mem_range(p + 1, n, nullptr), -1);
        ps.push_back(p);
    }
    /* distinct blocks never touch: at least one 256-byte redzone between */
    std::sort(ps.begin(), ps.end());
    for (size_t i = 1; i < ps.size(); i++) {
        void *base = nullptr;
        size_t size = 0;
        ra_emu_mem_find(ps[i - 1], &base, &size);
        CHECK((uintptr_t)ps[i] >= (uintptr_t)base + size + 256);
    }
    for (void *p : ps) CHECK_EQ(ra_emu_mem_free(p), 0);
}

TEST(shadow_answers) {
    unsigned char *p = (unsigned char *)ra_emu_mem_alloc(0, 1000);
    uintptr_t bad = 0;
    /* fresh: addressable, not initialised */
    CHECK_EQ(ra_emu_mem_check(p, 4, 1, 0, &bad), 0);                  // write
    CHECK_EQ(ra_emu_mem_check(p, 4, 0, 0, &bad), 0);                  // read, no init needed
    CHECK_EQ(ra_emu_mem_check(p, 4, 0, 1, &bad), RA_EMU_UNINIT_GLOBAL);
    CHECK(bad == (uintptr_t)p);
    CHECK_EQ(ra_emu_mem_check(p, 4, 1, 1, &bad), 0);                  // a write needs no init
    ra_emu_mem_mark_init(p, 4);
    CHECK_EQ(ra_emu_mem_check(p, 4, 0, 1, &bad), 0);
    CHECK_EQ(ra_emu_mem_check(p + 2, 4, 0, 1, &bad), RA_EMU_UNINIT_GLOBAL);
    CHECK(bad == (uintptr_t)p + 4);
    /* every size and alignment up to 16, across word boundaries */
    ra_emu_mem_mark_init(p, 64);
    for (size_t off = 0; off < 24; off++)
        for (size_t n = 1; n <= 16; n++) CHECK_EQ(ra_emu_mem_check(p + off, n, 0, 1, &bad), 0);
    CHECK_EQ(ra_emu_mem_check(p + 60, 8, 0, 1, &bad), RA_EMU_UNINIT_GLOBAL);
    CHECK(bad == (uintptr_t)p + 64);
    /* the padding after the 1000 bytes and the redzones are out of bounds */
    CHECK_EQ(ra_emu_mem_check(p + 1000, 1, 1, 0, &bad), RA_EMU_OOB_GLOBAL);
    CHECK_EQ(ra_emu_mem_check(p + 996, 8, 1, 0, &bad), RA_EMU_OOB_GLOBAL);
    CHECK(bad == (uintptr_t)p + 1000);
    CHECK_EQ(ra_emu_mem_check(p - 1, 1, 0, 0, &bad), RA_EMU_OOB_GLOBAL);
    CHECK_EQ(ra_emu_mem_check(p - 256, 16, 1, 0, &bad), RA_EMU_OOB_GLOBAL);
    CHECK_EQ(ra_emu_mem_check(p + 1000 + 256, 4, 1, 0, &bad), RA_EMU_OOB_GLOBAL);
    /* longer ranges (copies) */
    ra_emu_mem_mark_init(p, 1000);
    CHECK_EQ(ra_emu_mem_check(p, 1000, 0, 1, &bad), 0);
    CHECK_EQ(ra_emu_mem_check(p, 1001, 0, 1, &bad), RA_EMU_OOB_GLOBAL);
    CHECK(bad == (uintptr_t)p + 1000);
    /* host memory */
    int local = 0;
    CHECK_EQ(ra_emu_mem_check(&local, 4, 0, 0, &bad), RA_EMU_HOST_MEMORY);
    CHECK(bad == (uintptr_t)&local);
    CHECK_EQ(ra_emu_mem_check(p, 0, 0, 1, &bad), 0);
    CHECK_EQ(ra_emu_mem_free(p), 0);
}

TEST(mark_init_touches_only_addressable_bytes) {
    unsigned char *p = (unsigned char *)ra_emu_mem_alloc(0, 40);
    uintptr_t bad = 0;
    ra_emu_mem_mark_init(p - 16, 64);   // 16 bytes of redzone, 40 bytes, 8 of padding
    CHECK_EQ(ra_emu_mem_check(p - 16, 1, 1, 0, &bad), RA_EMU_OOB_GLOBAL);
    CHECK_EQ(ra_emu_mem_check(p, 40, 0, 1, &bad), 0);
    CHECK_EQ(ra_emu_mem_check(p + 40, 1, 1, 0, &bad), RA_EMU_OOB_GLOBAL);
    ra_emu_mem_mark_init(p + 36, 8);    // an aligned word, half padding
    CHECK_EQ(ra_emu_mem_check(p + 40, 4, 1, 0, &bad), RA_EMU_OOB_GLOBAL);
    CHECK_EQ(ra_emu_mem_free(p), 0);
    ra_emu_mem_mark_init(p, 8);         // freed bytes stay freed
    CHECK_EQ(ra_emu_mem_check(p, 8, 1, 0, &bad), RA_EMU_FREED_GLOBAL);
    int local[4];
    ra_emu_mem_mark_init(local, sizeof local);   // host memory: nothing to mark
}

TEST(free_quarantine_and_reuse) {
    uintptr_t bad = 0;
    unsigned char *p = (unsigned char *)ra_emu_mem_alloc(0, 512);
    CHECK_EQ(ra_emu_mem_free(p + 1), -1);                // not the start
    CHECK_EQ(ra_emu_mem_free(p), 0);
    CHECK_EQ(ra_emu_mem_free(p), -1);                    // twice
    int local = 0;
    CHECK_EQ(ra_emu_mem_free(&local), -1);
    CHECK_EQ(ra_emu_mem_check(p, 1, 0, 0, &bad), RA_EMU_FREED_GLOBAL);
    CHECK_EQ(ra_emu_mem_check(p + 500, 8, 1, 0, &bad), RA_EMU_FREED_GLOBAL);
    CHECK_EQ(ra_emu_mem_find(p, nullptr, nullptr), -1);
    /* while quarantined the block is not handed out again */
    for (int i = 0; i < 50; i++) {
        void *q = ra_emu_mem_alloc(0, 512);
        CHECK(q != p);
        CHECK_EQ(ra_emu_mem_free(q), 0);
    }
    CHECK_EQ(ra_emu_mem_check(p, 1, 0, 0, &bad), RA_EMU_FREED_GLOBAL);
    /* freeing more than the quarantine holds pushes it out: unaddressable */
    const size_t big = kCap() / 2 + 4096;
    for (int i = 0; i < 3; i++) {
        unsigned char *q = (unsigned char *)ra_emu_mem_alloc(0, big);
        CHECK(q != nullptr);
        memset(q, 1, big);
        CHECK_EQ(ra_emu_mem_free(q), 0);
        CHECK_EQ(ra_emu_mem_check(q + big / 2, 4, 0, 0, &bad), RA_EMU_FREED_GLOBAL);
    }
    CHECK_EQ(ra_emu_mem_check(p, 1, 0, 0, &bad), RA_EMU_OOB_GLOBAL);
    /* evicted chunks are reused: blocks adding up to more than the device
     * fit one after another, each fresh (poisoned, not initialised) */
    const size_t step = ra_emu_arena_per_device / 16;
    for (int i = 0; i < 40; i++) {
        unsigned char *q = (unsigned char *)ra_emu_mem_alloc(0, step);
        CHECK(q != nullptr);
        if (q == nullptr) break;
        CHECK(q[0] == 0xff && q[step - 1] == 0xff);
        CHECK_EQ(ra_emu_mem_check(q, 1, 0, 1, &bad), RA_EMU_UNINIT_GLOBAL);
        CHECK_EQ(ra_emu_mem_check(q + step - 8, 8, 1, 0, &bad), 0);
        q[0] = 1;
        ra_emu_mem_mark_init(q, step);
        CHECK_EQ(ra_emu_mem_free(q), 0);
    }
}

TEST(info_counts_live_bytes) {
    size_t used0 = 0, total = 0, used = 0;
    ra_emu_mem_info(1, &used0, &total);
    CHECK_EQ(total, ra_emu_arena_per_device);
    void *p = ra_emu_mem_alloc(1, 1000);
    ra_emu_mem_info(1, &used, &total);
    CHECK_EQ(used - used0, 1024);
    ra_emu_mem_free(p);
    ra_emu_mem_info(1, &used, &total);
    CHECK_EQ(used, used0);
    size_t u = 7, t = 7;
    ra_emu_mem_info(99, &u, &t);
    CHECK_EQ(u, 0);
    CHECK_EQ(t, 0);
}

TEST(exhaustion_returns_null) {
    const size_t per = ra_emu_arena_per_device;
    CHECK(ra_emu_mem_alloc(1, per + 1) == nullptr);
    CHECK(ra_emu_mem_alloc(1, (size_t)1 << 62) == nullptr);
    CHECK(ra_emu_mem_alloc(1, ~(size_t)0) == nullptr);
    /* half the device twice does not fit (redzones); then the quarantine is
     * flushed so that the space comes back */
    void *a = ra_emu_mem_alloc(1, per / 2);
    CHECK(a != nullptr);
    void *b = ra_emu_mem_alloc(1, per / 2);
    CHECK(b == nullptr);
    CHECK_EQ(ra_emu_mem_free(a), 0);
    void *c = ra_emu_mem_alloc(1, per / 2);
    CHECK(c != nullptr);
    CHECK_EQ(ra_emu_mem_free(c), 0);
}

TEST(release_device_frees_its_blocks) {
    void *a = ra_emu_mem_alloc(1, 300), *b = ra_emu_mem_alloc(0, 300);
    ra_emu_mem_release_device(1);
    uintptr_t bad = 0;
    CHECK_EQ(ra_emu_mem_check(a, 1, 0, 0, &bad), RA_EMU_FREED_GLOBAL);
    CHECK_EQ(ra_emu_mem_check(b, 1, 0, 0, &bad), 0);
    CHECK_EQ(ra_emu_mem_free(b), 0);
}

/* Threads writing neighbouring bytes of one block never lose each other's
 * initialised bits; threads allocating and freeing at once stay apart. */
TEST(threads_share_the_shadow) {
    const int T = 8, N = 4096;
    unsigned char *p = (unsigned char *)ra_emu_mem_alloc(0, N);
    std::vector<std::thread> ts;
    for (int t = 0; t < T; t++)
        ts.emplace_back([=] {
            for (int i = t; i < N; i += T) {
                uintptr_t bad = 0;
                if (ra_emu_mem_check(p + i, 1, 1, 0, &bad) == 0) ra_emu_mem_mark_init(p + i, 1);
            }
            for (int r = 0; r < 200; r++) {
                unsigned char *q = (unsigned char *)ra_emu_mem_alloc(t % 2, 64 + 64 * t);
                uintptr_t bad = 0;
                if (q == nullptr || ra_emu_mem_check(q, 64, 0, 1, &bad) != RA_EMU_UNINIT_GLOBAL) {
                    g_failures++;
                    break;
                }
                ra_emu_mem_mark_init(q, 64);
                if (ra_emu_mem_check(q, 64, 0, 1, &bad) != 0) g_failures++;
                if (ra_emu_mem_free(q) != 0) g_failures++;
            }
        });
    for (auto &t : ts) t.join();
    uintptr_t bad = 0;
    CHECK_EQ(ra_emu_mem_check(p, N, 0, 1, &bad), 0);
    CHECK_EQ(ra_emu_mem_free(p), 0);
}

/* The checker calls this for every kernel access: report its cost. */
TEST(check_is_fast) {
    unsigned char *p = (unsigned char *)ra_emu_mem_alloc(0, 1 << 16);
    ra_emu_mem_mark_init(p, 1 << 16);
    uintptr_t bad = 0;
    long sum = 0;
    const int iters = 2000000;
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; i++) sum += ra_emu_mem_check(p + (i * 4 & 0xfff0), 4, 0, 1, &bad);
    auto t1 = std::chrono::steady_clock::now();
    CHECK_EQ(sum, 0);
    printf("  ra_emu_mem_check: %.1f ns per 4-byte read\n",
           std::chrono::duration<double, std::nano>(t1 - t0).count() / iters);
    ra_emu_mem_free(p);
}
