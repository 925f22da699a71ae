/*
 * runtime_memory.cpp -- the emulated CUDA runtime's memory calls:
 * allocations (device, stream-ordered, pinned host), copies, memsets and
 * pointer attributes.
 *
 * Where a pointer lives: device memory is memory.cpp's arena (and must lie
 * inside one live allocation, for the whole length), pinned memory a block
 * of cudaMallocHost, anything else pageable host memory.  An explicit copy
 * kind must match (a host pointer where a device pointer belongs, or the
 * reverse, is cudaErrorInvalidValue); cudaMemcpyDefault infers it.
 *
 * When a copy returns follows the runtime's documented behaviour, the
 * weakest guarantee each case has:
 *   cudaMemcpyAsync  host -> device: pageable sources are copied aside at
 *                    the call, pinned ones read when the copy runs;
 *                    device -> pageable host: returns once done;
 *                    device -> pinned host, device -> device: asynchronous;
 *                    host -> host: returns once done.
 *   cudaMemcpy       on the legacy default stream; pageable host -> device
 *                    returns once the work before it is done and the source
 *                    is copied aside (the copy itself may still be queued);
 *                    device -> device returns at once; all others once done.
 *   cudaMemset       device memory: asynchronous; pinned memory: returns
 *                    once done.  cudaMemsetAsync: asynchronous.
 * Copies and memsets mark the bytes they write initialised; a copy of
 * never-written device bytes is fine (only kernels are checked for that).
 */
#include "emu/runtime_internal.h"

#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <new>

using namespace ra_emu_rt;

namespace {

enum Where { W_PAGEABLE, W_PINNED, W_DEVICE };

struct Place {
    Where where;
    int device;
    bool ok;      // [p, p + n) inside one block (always, for pageable memory)
};

/* rt().mu held (the pinned table) */
Place place_of(const void *p, size_t n) {
    Place pl = {W_PAGEABLE, -1, true};
    if (ra_emu_mem_device_of(p) >= 0) {
        pl.where = W_DEVICE;
        pl.ok = ra_emu_mem_range(p, n, &pl.device) == 0;
        return pl;
    }
    const std::map<uintptr_t, Pinned> &pin = rt().pinned;
    auto it = pin.upper_bound((uintptr_t)p);
    if (it != pin.begin()) {
        --it;
        const size_t at = (uintptr_t)p - it->first;
        if (at < it->second.size) {
            pl.where = W_PINNED;
            pl.device = it->second.device;
            pl.ok = n <= it->second.size - at;
        }
    }
    return pl;
}

size_t page_round(size_t n) {
    const size_t ps = (size_t)sysconf(_SC_PAGESIZE);
    return (n + ps - 1) / ps * ps;
}

cudaError_t copy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind,
                 cudaStream_t stream, bool sync_api) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    if ((unsigned)kind > (unsigned)cudaMemcpyDefault) return fail(cudaErrorInvalidMemcpyDirection);
    Runtime &R = rt();
    Lock lk(R.mu);
    StreamRef s = resolve(sync_api ? cudaStreamLegacy : stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    if ((e = sticky(s->device)) != cudaSuccess) return fail(e);
    if (n == 0) return cudaSuccess;
    if (dst == nullptr || src == nullptr) return fail(cudaErrorInvalidValue);
    const Place pd = place_of(dst, n), ps = place_of(src, n);
    if (!pd.ok || !ps.ok) return fail(cudaErrorInvalidValue);
    const bool to_dev = pd.where == W_DEVICE, from_dev = ps.where == W_DEVICE;
    bool fits = true;
    switch (kind) {
    case cudaMemcpyHostToHost: fits = !from_dev && !to_dev; break;
    case cudaMemcpyHostToDevice: fits = !from_dev && to_dev; break;
    case cudaMemcpyDeviceToHost: fits = from_dev && !to_dev; break;
    case cudaMemcpyDeviceToDevice: fits = from_dev && to_dev; break;
    default: break;
    }
    if (!fits) return fail(cudaErrorInvalidValue);

    Op *op = new (std::nothrow) Op();
    if (op == nullptr) return fail(cudaErrorMemoryAllocation);
    op->kind = OP_COPY;
    op->dst = dst;
    op->src = src;
    op->n = n;
    const bool staged = !from_dev && to_dev && ps.where == W_PAGEABLE;
    if (staged) {
        /* the caller may reuse its buffer on return: take the bytes now */
        lk.unlock();
        op->staged.reset(new (std::nothrow) char[n]);
        if (op->staged) memcpy(op->staged.get(), src, n);
        lk.lock();
        if (!op->staged) {
            delete op;
            return fail(cudaErrorMemoryAllocation);
        }
        s = resolve(sync_api ? cudaStreamLegacy : stream);
        if (!s) {
            delete op;
            return fail(cudaErrorInvalidResourceHandle);
        }
    }
    const uint64_t seq = enqueue(s, op);
    /* op belongs to the worker now; what it waits for first: */
    const std::vector<std::pair<StreamRef, uint64_t>> before = op->deps;
    bool wait_done;
    if (!from_dev && !to_dev) wait_done = true;                            // host -> host
    else if (from_dev && !to_dev) wait_done = !sync_api ? pd.where == W_PAGEABLE : true;
    else if (from_dev && to_dev) wait_done = false;                        // device -> device
    else wait_done = sync_api && !staged;                                  // host -> device
    if (wait_done) {
        count_host_sync();
        host_wait(lk, s, seq);
        return fail(sticky(s->device));
    }
    if (sync_api && staged) {   // the work before it, not the copy itself
        count_host_sync();
        host_wait(lk, s, seq - 1);
        for (auto &d : before) host_wait(lk, d.first, d.second);
        return fail(sticky(s->device));
    }
    return cudaSuccess;
}

cudaError_t fill(void *p, int value, size_t n, cudaStream_t stream, bool sync_api) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    Runtime &R = rt();
    Lock lk(R.mu);
    StreamRef s = resolve(sync_api ? cudaStreamLegacy : stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    if ((e = sticky(s->device)) != cudaSuccess) return fail(e);
    if (n == 0) return cudaSuccess;
    if (p == nullptr) return fail(cudaErrorInvalidValue);
    const Place pl = place_of(p, n);
    if (pl.where == W_PAGEABLE || !pl.ok) return fail(cudaErrorInvalidValue);
    Op *op = new Op();
    op->kind = OP_MEMSET;
    op->dst = p;
    op->n = n;
    op->value = value & 0xff;
    const uint64_t seq = enqueue(s, op);
    if (sync_api && pl.where == W_PINNED) {
        count_host_sync();
        host_wait(lk, s, seq);
        return fail(sticky(s->device));
    }
    return cudaSuccess;
}

/* p is the start of a live device allocation with no free queued (lock held) */
bool freeable(void *p) {
    void *base = nullptr;
    return ra_emu_mem_find(p, &base, nullptr) == 0 && base == p &&
           rt().pending_free.count((uintptr_t)p) == 0;
}

}  // namespace

/* ---- allocations --------------------------------------------------------- */

extern "C" cudaError_t cudaMalloc(void **ptr, size_t size) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    if (ptr == nullptr) return fail(cudaErrorInvalidValue);
    Lock lk(rt().mu);
    const int d = current_device();
    if ((e = sticky(d)) != cudaSuccess) return fail(e);
    lk.unlock();   // poisoning a big block takes a while: not under the runtime's lock
    *ptr = nullptr;
    if (size == 0) return cudaSuccess;
    *ptr = ra_emu_mem_alloc(d, size);
    return *ptr != nullptr ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}

/* Waits for all work of the block's device (and of the current one) first,
 * as the real cudaFree does: a block is never reused under queued work. */
extern "C" cudaError_t cudaFree(void *ptr) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    Lock lk(rt().mu);
    const int cur = current_device();
    if (ptr == nullptr) return fail(sticky(cur));
    const int d = ra_emu_mem_device_of(ptr);
    if (d < 0 || !freeable(ptr)) return fail(cudaErrorInvalidValue);
    if ((e = sticky(d)) != cudaSuccess) return fail(e);
    count_host_sync();
    sync_device(lk, d);
    if (cur != d) sync_device(lk, cur);
    if ((e = sticky(d)) != cudaSuccess) return fail(e);
    if (!freeable(ptr) || ra_emu_mem_free(ptr) != 0) return fail(cudaErrorInvalidValue);
    return cudaSuccess;
}

extern "C" cudaError_t cudaMallocAsync(void **ptr, size_t size, cudaStream_t stream) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    if (ptr == nullptr) return fail(cudaErrorInvalidValue);
    Lock lk(rt().mu);
    StreamRef s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    if ((e = sticky(s->device)) != cudaSuccess) return fail(e);
    const int d = s->device;
    lk.unlock();
    *ptr = nullptr;
    if (size == 0) return cudaSuccess;
    *ptr = ra_emu_mem_alloc(d, size);   // usable by work queued from now on
    return *ptr != nullptr ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}

extern "C" cudaError_t cudaFreeAsync(void *ptr, cudaStream_t stream) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    Runtime &R = rt();
    Lock lk(R.mu);
    StreamRef s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    if ((e = sticky(s->device)) != cudaSuccess) return fail(e);
    if (ptr == nullptr) return cudaSuccess;
    if (!freeable(ptr)) return fail(cudaErrorInvalidValue);
    R.pending_free.insert((uintptr_t)ptr);
    Op *op = new Op();
    op->kind = OP_FREE;
    op->dst = ptr;
    enqueue(s, op);
    return cudaSuccess;
}

extern "C" cudaError_t cudaMallocHost(void **ptr, size_t size) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    if (ptr == nullptr) return fail(cudaErrorInvalidValue);
    *ptr = nullptr;
    if (size == 0) return cudaSuccess;
    void *p = mmap(nullptr, page_round(size), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return fail(cudaErrorMemoryAllocation);
    Lock lk(rt().mu);
    rt().pinned[(uintptr_t)p] = Pinned{size, current_device()};
    *ptr = p;
    return cudaSuccess;
}

/* Waits for every device's work first: a queued copy may still read it. */
extern "C" cudaError_t cudaFreeHost(void *ptr) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    if (ptr == nullptr) return cudaSuccess;
    Runtime &R = rt();
    Lock lk(R.mu);
    if (R.pinned.count((uintptr_t)ptr) == 0) return fail(cudaErrorInvalidValue);
    count_host_sync();
    for (int d = 0; d < R.ndev; d++) sync_device(lk, d);
    auto it = R.pinned.find((uintptr_t)ptr);
    if (it == R.pinned.end()) return fail(cudaErrorInvalidValue);   // freed meanwhile
    const size_t size = it->second.size;
    R.pinned.erase(it);
    lk.unlock();
    munmap(ptr, page_round(size));
    return cudaSuccess;
}

extern "C" cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    if (free_bytes == nullptr || total_bytes == nullptr) return fail(cudaErrorInvalidValue);
    Lock lk(rt().mu);
    const int d = current_device();
    if ((e = sticky(d)) != cudaSuccess) return fail(e);
    size_t used = 0, total = 0;
    ra_emu_mem_info(d, &used, &total);
    *free_bytes = total - used;
    *total_bytes = total;
    return cudaSuccess;
}

extern "C" cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes,
                                                const void *ptr) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    if (attributes == nullptr) return fail(cudaErrorInvalidValue);
    memset(attributes, 0, sizeof *attributes);
    Lock lk(rt().mu);
    const Place pl = place_of(ptr, 1);
    if (pl.where == W_DEVICE && pl.ok) {
        attributes->type = cudaMemoryTypeDevice;
        attributes->device = pl.device;
        attributes->devicePointer = (void *)ptr;
    } else if (pl.where == W_PINNED) {
        attributes->type = cudaMemoryTypeHost;
        attributes->device = pl.device;
        attributes->devicePointer = (void *)ptr;   // mapped: the same address
        attributes->hostPointer = (void *)ptr;
    } else {   // pageable, or device addresses no allocation holds
        attributes->type = cudaMemoryTypeUnregistered;
        attributes->device = -2;
    }
    return cudaSuccess;
}

/* ---- copies and memsets -------------------------------------------------- */

extern "C" cudaError_t cudaMemcpy(void *dst, const void *src, size_t count,
                                  enum cudaMemcpyKind kind) {
    return copy(dst, src, count, kind, nullptr, true);
}

extern "C" cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count,
                                       enum cudaMemcpyKind kind, cudaStream_t stream) {
    return copy(dst, src, count, kind, stream, false);
}

/* ---- peers ----------------------------------------------------------------- */

extern "C" cudaError_t cudaDeviceCanAccessPeer(int *can_access, int device, int peer_device) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    if (can_access == nullptr) return fail(cudaErrorInvalidValue);
    const int n = rt().ndev;
    if (device < 0 || device >= n || peer_device < 0 || peer_device >= n)
        return fail(cudaErrorInvalidDevice);
    *can_access = device != peer_device && ra_emu_config()->peer;
    return cudaSuccess;
}

extern "C" cudaError_t cudaDeviceEnablePeerAccess(int peer_device, unsigned int flags) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    if (flags != 0) return fail(cudaErrorInvalidValue);
    Runtime &R = rt();
    const int d = current_device();
    if (peer_device < 0 || peer_device >= R.ndev) return fail(cudaErrorInvalidDevice);
    if (peer_device == d || !ra_emu_config()->peer) return fail(cudaErrorInvalidDevice);
    Lock lk(R.mu);
    if (R.peer_enabled[d] & (1u << peer_device)) return fail(cudaErrorPeerAccessAlreadyEnabled);
    R.peer_enabled[d] |= 1u << peer_device;
    return cudaSuccess;
}

/* dst must lie in dst_device's memory and src in src_device's; the copy
 * runs on `stream` as any device -> device copy, with or without peer access
 * (the bytes move the same way: only the speed would differ) */
extern "C" cudaError_t cudaMemcpyPeerAsync(void *dst, int dst_device, const void *src,
                                           int src_device, size_t count, cudaStream_t stream) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    const int n = rt().ndev;
    if (dst_device < 0 || dst_device >= n || src_device < 0 || src_device >= n)
        return fail(cudaErrorInvalidDevice);
    if (count == 0) return cudaSuccess;
    int dd = -1, sd = -1;
    if (ra_emu_mem_range(dst, count, &dd) != 0 || ra_emu_mem_range(src, count, &sd) != 0 ||
        dd != dst_device || sd != src_device)
        return fail(cudaErrorInvalidValue);
    return copy(dst, src, count, cudaMemcpyDeviceToDevice, stream, false);
}

extern "C" cudaError_t cudaMemset(void *ptr, int value, size_t count) {
    return fill(ptr, value, count, nullptr, true);
}

extern "C" cudaError_t cudaMemsetAsync(void *ptr, int value, size_t count, cudaStream_t stream) {
    return fill(ptr, value, count, stream, false);
}
