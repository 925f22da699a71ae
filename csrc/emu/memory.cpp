/*
 * memory.cpp -- device memory of the emulated GPU (emu.h, "device memory").
 *
 * Address space.  One range is reserved for all devices (PROT_NONE,
 * MAP_NORESERVE): device d owns [arena_lo + d * per_device, ... +
 * per_device), per_device = RINGATTN_EMU_MEMORY rounded up to 2 MiB.  Each
 * device's range is made readable and writable from its start up to a
 * high-water mark that grows in 64 MiB steps as allocations need it; past
 * it a stray access still faults.  Physical memory is committed on first
 * touch only.
 *
 * Allocations.  Best fit over a device's free extents (by size, then
 * address; neighbours coalesce).  A chunk is
 *     [redzone | user bytes, rounded up to 256 | redzone]
 * with redzones of at least 256 bytes (1/16 of the size for big blocks, at
 * most 1 MiB), so user pointers are 256-byte aligned and every allocation
 * has unaddressable bytes on both sides.  New user bytes are poisoned with
 * 0xff (NaN in every float dtype).  A freed block goes to its device's
 * quarantine (FIFO, at most 1/16 of the device and 64 MiB) and its chunk is
 * reused only after it leaves, so a use after free is seen as one; the data
 * pages of a large freed block are given back at the free (madvise), its
 * shadow pages when it leaves the quarantine.
 *
 * Shadow.  One byte per byte, in a second reserved range of the arena's
 * size (shadow(p) = shadow_lo + (p - arena_lo)):
 *     0x00  not addressable (redzone, padding, never allocated) -- what a
 *           fresh page reads, so only live and quarantined bytes cost memory
 *     0x01  addressable, not initialised
 *     0x03  addressable and initialised (bit 1: written by a kernel, a copy,
 *           a memset or a transfer)
 *     0x04  freed (in the quarantine)
 * ra_emu_mem_check, called for every kernel load and store, reads the
 * 8-byte-aligned shadow words covering the access (at most three for 16
 * bytes) with relaxed atomic loads and compares them under a mask: no lock,
 * no division.  Updates of the initialised bit store exactly the bytes of
 * the access, so threads writing neighbouring bytes never undo each other.
 *
 * Thread safety: the allocator's tables are under one mutex; the shadow is
 * read and written lock-free as above.  Every table is allocated once and
 * never destroyed (the process may exit while stream workers still run).
 */
#include "emu/emu.h"
#include "emu/runtime_internal.h"

#include <pthread.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define RA_EMU_ASAN_POISON(p, n) __asan_poison_memory_region((const void *)(p), (n))
#define RA_EMU_ASAN_UNPOISON(p, n) __asan_unpoison_memory_region((const void *)(p), (n))
#else
#define RA_EMU_ASAN_POISON(p, n) ((void)(p), (void)(n))
#define RA_EMU_ASAN_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#include <deque>
#include <map>
#include <set>
#include <utility>

extern "C" {
uintptr_t ra_emu_arena_lo, ra_emu_arena_hi, ra_emu_arena_per_device;
}

namespace {

const size_t kAlign = 256;
const size_t kCommitStep = (size_t)64 << 20;
const size_t kMadviseMin = (size_t)64 << 10;   // give back pages of blocks this big
const size_t kQuarantineMax = (size_t)64 << 20;
const size_t kQuarantineEntries = 1 << 16;

const uint8_t kNone = 0x00, kUninit = 0x01, kInit = 0x03, kFreed = 0x04;
const uint64_t kOnes = 0x0101010101010101ull;
const uint64_t kInits = 0x0303030303030303ull;

struct Alloc {
    uintptr_t user;      // the pointer cudaMalloc returned
    size_t n;            // bytes asked for
    uintptr_t chunk;     // [chunk, chunk + chunk_len) with its redzones
    size_t chunk_len;
    int device;
};

struct Device {
    std::map<uintptr_t, size_t> free_by_addr;        // extent start -> length
    std::set<std::pair<size_t, uintptr_t>> free_by_size;
    std::deque<Alloc> quarantine;
    size_t quarantine_bytes = 0;
    size_t used = 0;         // user bytes (rounded to 256) of live blocks
    size_t committed = 0;    // [base, base + committed) is read-write
};

pthread_once_t g_once = PTHREAD_ONCE_INIT;
int g_init_rc = -1;
int g_devices;
uint8_t *g_shadow;           // shadow of arena_lo
size_t g_span;               // arena_hi - arena_lo
size_t g_quarantine_cap;
pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
Device *g_dev;                          // [g_devices], never freed
std::map<uintptr_t, Alloc> *g_live;     // user pointer -> block, never freed

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

size_t page_size() {
    static const size_t ps = (size_t)sysconf(_SC_PAGESIZE);
    return ps;
}

void do_init() {
    const ra_emu_settings *cfg = ra_emu_config();
    const size_t per = round_up(cfg->mem_bytes, (size_t)2 << 20);
    const size_t span = per * (size_t)cfg->devices;
    void *data = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
    if (data == MAP_FAILED) return;
    void *shadow = mmap(NULL, span, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (shadow == MAP_FAILED) {
        munmap(data, span);
        return;
    }
    g_devices = cfg->devices;
    g_shadow = (uint8_t *)shadow;
    g_span = span;
    g_dev = new Device[g_devices];
    g_live = new std::map<uintptr_t, Alloc>();
    g_quarantine_cap = per / 16 < kQuarantineMax ? per / 16 : kQuarantineMax;
    for (int d = 0; d < g_devices; d++) {
        uintptr_t base = (uintptr_t)data + (uintptr_t)d * per;
        g_dev[d].free_by_addr[base] = per;
        g_dev[d].free_by_size.insert({per, base});
    }
    ra_emu_arena_per_device = per;
    ra_emu_arena_lo = (uintptr_t)data;
    __atomic_store_n(&ra_emu_arena_hi, (uintptr_t)data + span, __ATOMIC_RELEASE);
    g_init_rc = 0;
}

inline uint8_t *shadow_of(uintptr_t a) { return g_shadow + (a - ra_emu_arena_lo); }

uintptr_t device_base(int d) {
    return ra_emu_arena_lo + (uintptr_t)d * ra_emu_arena_per_device;
}

size_t redzone_for(size_t n) {
    size_t rz = round_up(n / 16, kAlign);
    if (rz < kAlign) rz = kAlign;
    if (rz > ((size_t)1 << 20)) rz = (size_t)1 << 20;
    return rz;
}

/* ---- free extents (g_mu held) ---- */

void extent_insert(Device &dv, uintptr_t at, size_t len) {
    auto next = dv.free_by_addr.lower_bound(at);
    if (next != dv.free_by_addr.end() && at + len == next->first) {
        len += next->second;
        dv.free_by_size.erase({next->second, next->first});
        next = dv.free_by_addr.erase(next);
    }
    if (next != dv.free_by_addr.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second == at) {
            dv.free_by_size.erase({prev->second, prev->first});
            at = prev->first;
            len += prev->second;
            dv.free_by_addr.erase(prev);
        }
    }
    dv.free_by_addr[at] = len;
    dv.free_by_size.insert({len, at});
}

uintptr_t extent_take(Device &dv, size_t len) {
    auto it = dv.free_by_size.lower_bound({len, 0});
    if (it == dv.free_by_size.end()) return 0;
    const size_t have = it->first;
    const uintptr_t at = it->second;
    dv.free_by_size.erase(it);
    dv.free_by_addr.erase(at);
    if (have > len) {
        dv.free_by_addr[at + len] = have - len;
        dv.free_by_size.insert({have - len, at + len});
    }
    return at;
}

/* Give back the whole pages inside [a, a + n) (contents then read as 0). */
void discard_pages(uintptr_t a, size_t n) {
    const size_t ps = page_size();
    uintptr_t lo = round_up(a, ps), hi = (a + n) / ps * ps;
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

/* Set the shadow of [a, a + n) to `v` (bulk; for bytes no other thread
 * touches at the time). */
void shadow_fill(uintptr_t a, size_t n, uint8_t v) {
    uint8_t *s = shadow_of(a);
    if (v == kNone && n >= kMadviseMin) {
        const size_t ps = page_size();
        uintptr_t lo = round_up((uintptr_t)s, ps), hi = ((uintptr_t)s + n) / ps * ps;
        memset(s, 0, lo - (uintptr_t)s);
        madvise((void *)lo, hi - lo, MADV_DONTNEED);
        memset((void *)hi, 0, (uintptr_t)s + n - hi);
        return;
    }
    memset(s, v, n);
}

/* A block leaves the quarantine: unaddressable again, chunk reusable. */
void evict(Device &dv) {
    Alloc a = dv.quarantine.front();
    dv.quarantine.pop_front();
    dv.quarantine_bytes -= a.chunk_len;
    shadow_fill(a.user, a.n, kNone);
    extent_insert(dv, a.chunk, a.chunk_len);
}

/* Free a live block (g_mu held): shadow freed, into the quarantine. */
void retire(std::map<uintptr_t, Alloc>::iterator it) {
    Alloc a = it->second;
    g_live->erase(it);
    Device &dv = g_dev[a.device];
    dv.used -= round_up(a.n, kAlign);
    shadow_fill(a.user, a.n, kFreed);
    if (a.n >= kMadviseMin) discard_pages(a.user, a.n);
    dv.quarantine.push_back(a);
    dv.quarantine_bytes += a.chunk_len;
    while (dv.quarantine.size() > 1 && (dv.quarantine_bytes > g_quarantine_cap ||
                                        dv.quarantine.size() > kQuarantineEntries))
        evict(dv);
}

/* Make [base, base + end) of device d read-write (g_mu held). */
int commit(int d, size_t end) {
    Device &dv = g_dev[d];
    if (end <= dv.committed) return 0;
    size_t want = round_up(end, kCommitStep);
    if (want > ra_emu_arena_per_device) want = ra_emu_arena_per_device;
    if (mprotect((void *)(device_base(d) + dv.committed), want - dv.committed,
                 PROT_READ | PROT_WRITE) != 0)
        return -1;
    dv.committed = want;
    return 0;
}

/* Mask of bytes [lo, hi) of a little-endian 8-byte word, 0 <= lo < hi <= 8. */
inline uint64_t byte_mask(unsigned lo, unsigned hi) {
    uint64_t upto = hi >= 8 ? ~0ull : ((1ull << (8 * hi)) - 1);
    return upto & ~((1ull << (8 * lo)) - 1);
}

inline uint64_t load_word(const uint8_t *w) {
    return __atomic_load_n((const uint64_t *)w, __ATOMIC_RELAXED);
}

/* The report kind of the first bad byte of [a, a + n) (slow path). */
int classify(uintptr_t a, size_t n, int want_init, uintptr_t *bad) {
    for (size_t i = 0; i < n; i++) {
        uintptr_t b = a + i;
        if (b - ra_emu_arena_lo >= g_span) {
            *bad = b;
            return b < ra_emu_arena_lo || i == 0 ? RA_EMU_HOST_MEMORY : RA_EMU_OOB_GLOBAL;
        }
        uint8_t v = __atomic_load_n(shadow_of(b), __ATOMIC_RELAXED);
        int kind = 0;
        if (v == kFreed) kind = RA_EMU_FREED_GLOBAL;
        else if (!(v & 1)) kind = RA_EMU_OOB_GLOBAL;
        else if (want_init && v != kInit) kind = RA_EMU_UNINIT_GLOBAL;
        if (kind) {
            *bad = b;
            return kind;
        }
    }
    return 0;
}

}  // namespace

/* ---- emu.h --------------------------------------------------------------- */

extern "C" int ra_emu_mem_init(void) {
    pthread_once(&g_once, do_init);
    return g_init_rc;
}

extern "C" void *ra_emu_mem_alloc(int device, size_t nbytes) {
    if (ra_emu_mem_init() != 0 || device < 0 || device >= g_devices) return NULL;
    if (nbytes > ra_emu_arena_per_device) return NULL;
    const size_t user_len = round_up(nbytes == 0 ? 1 : nbytes, kAlign);
    const size_t rz = redzone_for(nbytes);
    const size_t chunk_len = user_len + 2 * rz;
    pthread_mutex_lock(&g_mu);
    Device &dv = g_dev[device];
    uintptr_t chunk = extent_take(dv, chunk_len);
    if (chunk == 0) {   // what the quarantine holds back is all there is left
        while (!dv.quarantine.empty()) evict(dv);
        chunk = extent_take(dv, chunk_len);
    }
    if (chunk == 0 || commit(device, chunk + chunk_len - device_base(device)) != 0) {
        if (chunk != 0) extent_insert(dv, chunk, chunk_len);
        pthread_mutex_unlock(&g_mu);
        return NULL;
    }
    Alloc a = {chunk + rz, nbytes, chunk, chunk_len, device};
    (*g_live)[a.user] = a;
    dv.used += user_len;
    /* built with AddressSanitizer (the checker is off then): it guards
     * the redzones and freed blocks instead */
    RA_EMU_ASAN_POISON(chunk, chunk_len);
    RA_EMU_ASAN_UNPOISON(a.user, nbytes);
    /* nobody else knows the block yet, but a free of it (a bug) must not
     * overtake these: fill under the lock */
    memset((void *)a.user, 0xff, nbytes);
    shadow_fill(a.user, nbytes, kUninit);
    pthread_mutex_unlock(&g_mu);
    return (void *)a.user;
}

extern "C" int ra_emu_mem_free(void *p) {
    if (ra_emu_mem_init() != 0) return -1;
    pthread_mutex_lock(&g_mu);
    auto it = g_live->find((uintptr_t)p);
    int rc = -1;
    if (it != g_live->end()) {
        RA_EMU_ASAN_POISON(it->second.user, it->second.n);
        retire(it);
        rc = 0;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

extern "C" int ra_emu_mem_device_of(const void *p) {
    uintptr_t off = (uintptr_t)p - ra_emu_arena_lo;
    if (__atomic_load_n(&ra_emu_arena_hi, __ATOMIC_ACQUIRE) == 0 || off >= g_span) return -1;
    return (int)(off / ra_emu_arena_per_device);
}

extern "C" int ra_emu_mem_find(const void *p, void **base, size_t *size) {
    if (ra_emu_mem_device_of(p) < 0) return -1;
    const uintptr_t a = (uintptr_t)p;
    int rc = -1;
    pthread_mutex_lock(&g_mu);
    auto it = g_live->upper_bound(a);
    if (it != g_live->begin()) {
        const Alloc &b = std::prev(it)->second;
        if (a - b.user < (b.n == 0 ? 1 : b.n)) {
            if (base != NULL) *base = (void *)b.user;
            if (size != NULL) *size = b.n;
            rc = 0;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

extern "C" int ra_emu_mem_check(const void *p, size_t n, int is_write, int need_init,
                                uintptr_t *bad) {
    const uintptr_t a = (uintptr_t)p;
    const uintptr_t off = a - ra_emu_arena_lo;
    const int want_init = !is_write && need_init;
    if (n == 0) return 0;
    if (off >= g_span || n > g_span - off) return classify(a, n, want_init, bad);
    const uint8_t *s = g_shadow + off;
    const uintptr_t first = (uintptr_t)s & ~(uintptr_t)7;
    const uintptr_t end = (uintptr_t)s + n;
    for (uintptr_t w = first; w < end; w += 8) {
        const unsigned lo = w < (uintptr_t)s ? (unsigned)((uintptr_t)s - w) : 0;
        const unsigned hi = end - w >= 8 ? 8 : (unsigned)(end - w);
        const uint64_t m = byte_mask(lo, hi);
        const uint64_t x = load_word((const uint8_t *)w);
        const uint64_t off_bits = want_init ? (x ^ kInits) : ((x & kOnes) ^ kOnes);
        if (off_bits & m) return classify(a, n, want_init, bad);
    }
    return 0;
}

extern "C" void ra_emu_mem_mark_init(const void *p, size_t n) {
    uintptr_t a = (uintptr_t)p;
    if (n == 0) return;
    /* clip to the arena: bytes outside it have no shadow */
    if (a < ra_emu_arena_lo) {
        if (a + n <= ra_emu_arena_lo) return;
        n -= ra_emu_arena_lo - a;
        a = ra_emu_arena_lo;
    }
    if (a - ra_emu_arena_lo >= g_span) return;
    if (n > g_span - (a - ra_emu_arena_lo)) n = g_span - (a - ra_emu_arena_lo);
    uint8_t *s = shadow_of(a);
    /* one store of exactly the access's bytes when it is an aligned 1, 2, 4
     * or 8 (what kernels do): only addressable bytes become initialised */
    const bool whole = n <= 8 && (n & (n - 1)) == 0 && ((uintptr_t)s & (n - 1)) == 0;
    switch (whole ? n : 0) {
    case 1:
        if (__atomic_load_n(s, __ATOMIC_RELAXED) & 1) __atomic_store_n(s, kInit, __ATOMIC_RELAXED);
        return;
    case 2: {
        uint16_t x = __atomic_load_n((uint16_t *)s, __ATOMIC_RELAXED);
        if ((x & 0x0101) == 0x0101) {
            __atomic_store_n((uint16_t *)s, (uint16_t)0x0303, __ATOMIC_RELAXED);
            return;
        }
        break;
    }
    case 4: {
        uint32_t x = __atomic_load_n((uint32_t *)s, __ATOMIC_RELAXED);
        if ((x & 0x01010101u) == 0x01010101u) {
            __atomic_store_n((uint32_t *)s, 0x03030303u, __ATOMIC_RELAXED);
            return;
        }
        break;
    }
    case 8: {
        uint64_t x = load_word(s);
        if ((x & kOnes) == kOnes) {
            __atomic_store_n((uint64_t *)s, kInits, __ATOMIC_RELAXED);
            return;
        }
        break;
    }
    default:
        break;
    }
    /* byte by byte at the edges, whole words inside */
    size_t i = 0;
    while (i < n) {
        uint8_t *b = s + i;
        if (((uintptr_t)b & 7) == 0 && n - i >= 8) {
            uint64_t x = load_word(b);
            if ((x & kOnes) == kOnes) {
                if (x != kInits) __atomic_store_n((uint64_t *)b, kInits, __ATOMIC_RELAXED);
                i += 8;
                continue;
            }
        }
        if (__atomic_load_n(b, __ATOMIC_RELAXED) == kUninit)
            __atomic_store_n(b, kInit, __ATOMIC_RELAXED);
        i++;
    }
}

extern "C" void ra_emu_mem_info(int device, size_t *used, size_t *total) {
    *used = 0;
    *total = 0;
    if (ra_emu_mem_init() != 0 || device < 0 || device >= g_devices) return;
    pthread_mutex_lock(&g_mu);
    *used = g_dev[device].used;
    pthread_mutex_unlock(&g_mu);
    *total = ra_emu_arena_per_device;
}

/* ---- runtime_internal.h -------------------------------------------------- */

extern "C" void ra_emu_mem_release_device(int device) {
    if (ra_emu_mem_init() != 0 || device < 0 || device >= g_devices) return;
    pthread_mutex_lock(&g_mu);
    for (auto it = g_live->begin(); it != g_live->end();) {
        auto next = std::next(it);
        if (it->second.device == device) retire(it);
        it = next;
    }
    pthread_mutex_unlock(&g_mu);
}

extern "C" int ra_emu_mem_range(const void *p, size_t n, int *device) {
    void *base = NULL;
    size_t size = 0;
    if (ra_emu_mem_find(p, &base, &size) != 0) return -1;
    const size_t at = (size_t)((uintptr_t)p - (uintptr_t)base);
    if (n > size - at) return -1;
    if (device != NULL) *device = ra_emu_mem_device_of(base);
    return 0;
}
