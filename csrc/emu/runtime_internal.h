/*
 * runtime_internal.h -- what the emulated CUDA runtime's files share
 * (runtime.cpp: devices, errors, attributes, launches, the NCCL table;
 * runtime_streams.cpp: streams, their workers, events, waits;
 * runtime_memory.cpp: allocations, copies, memsets, pointer attributes)
 * and the two extras of memory.cpp only the runtime uses.  Internal; C++
 * except the memory part.
 *
 * The model.  A stream is an in-order queue of operations run by its own
 * worker thread.  Operations are numbered 1, 2, ... per stream in the order
 * they were queued; `done` is the number finished.  An operation may wait
 * for other streams' operations first (its `deps`: an event wait, or the
 * legacy default stream's implicit ordering with the device's blocking
 * streams), always ones queued before it, so waits never form a cycle.
 * In lazy mode (RINGATTN_EMU_LAZY=1) a worker starts operation k only when
 * something observed it (`released` >= k): a host synchronisation or query,
 * or another stream's operation that depends on it starting.
 *
 * One mutex guards all of it; finishing an operation wakes every waiter
 * (done_cv).  Nothing is ever destroyed at process exit: the state is
 * leaked on purpose, workers are detached.
 */
#ifndef RA_EMU_RUNTIME_INTERNAL_H
#define RA_EMU_RUNTIME_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "emu/emu.h"

#ifdef __cplusplus
extern "C" {
#endif

/* memory.cpp: free every live allocation of `device` (cudaDeviceReset) */
void ra_emu_mem_release_device(int device);
/* memory.cpp: 0 and the owning device when [p, p + n) lies inside one live
 * allocation, else -1 */
int ra_emu_mem_range(const void *p, size_t n, int *device);

#ifdef __cplusplus
}

#include <cuda_runtime.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ra_emu_rt {

struct Stream;
typedef std::shared_ptr<Stream> StreamRef;

enum OpKind { OP_KERNEL, OP_COPY, OP_MEMSET, OP_RECORD, OP_WAIT, OP_HOST_FN, OP_CALL, OP_FREE };
enum StreamKind { S_USER, S_LEGACY, S_PER_THREAD };

/* when an event's record ran (host clock, ms); < 0 until then */
struct Timing {
    double ms = -1;
};

struct Op {
    OpKind kind;
    std::vector<std::pair<StreamRef, uint64_t>> deps;  // (stream, op number) to wait for
    ra_emu_grid grid;                  // OP_KERNEL
    void *dst = nullptr;               // OP_COPY, OP_MEMSET, OP_FREE (the block)
    const void *src = nullptr;         // OP_COPY
    size_t n = 0;
    int value = 0;                     // OP_MEMSET
    std::unique_ptr<char[]> staged;    // OP_COPY from pageable memory: the source
    std::shared_ptr<Timing> timing;    // OP_RECORD
    void (*host_fn)(void *) = nullptr; // OP_HOST_FN
    int (*call)(void *) = nullptr;     // OP_CALL (the NCCL table's enqueue)
    void *user = nullptr;
};

struct Stream {
    uint64_t handle = 0;       // its cudaStream_t; 0 for legacy / per-thread
    int device = 0;
    unsigned flags = 0;
    StreamKind kind = S_USER;
    std::deque<Op *> queue;    // queued, not started
    uint64_t enq = 0;          // operations queued so far
    uint64_t done = 0;         // operations finished
    uint64_t released = 0;     // lazy mode: may start operations <= this
    uint64_t skip_until = 0;   // cudaDeviceReset: drop operations <= this
    bool destroyed = false;    // the worker leaves once the queue is empty
    cudaError_t err = cudaSuccess;   // first error of an OP_CALL, sticky
    uint64_t err_seq = 0;            // ... and the operation that made it
    std::condition_variable cv;      // the worker waits here for work
};

struct Event {
    uint64_t handle = 0;
    int device = 0;
    unsigned flags = 0;
    StreamRef stream;          // last record, null before the first
    uint64_t seq = 0;
    std::shared_ptr<Timing> timing;
};

struct Pinned {
    size_t size;
    int device;
};

struct DeviceState {
    StreamRef legacy;
    std::vector<StreamRef> streams;  // every stream with a worker
    cudaError_t sticky = cudaSuccess;
    const char *sticky_text = nullptr;  // leaked: cudaGetErrorString hands it out
    uint64_t epoch = 0;                 // cudaDeviceReset count (per-thread streams)
};

struct Runtime {
    std::mutex mu;
    std::condition_variable done_cv;
    int ndev = 0;
    int lazy = 0;
    DeviceState dev[RA_EMU_MAX_DEVICES];
    std::unordered_map<uint64_t, StreamRef> streams;                // user streams
    std::unordered_map<uint64_t, std::shared_ptr<Event>> events;
    uint64_t next_handle = 0;
    std::map<uintptr_t, Pinned> pinned;       // cudaMallocHost blocks
    std::set<uintptr_t> pending_free;         // blocks with a cudaFreeAsync queued
    unsigned peer_enabled[RA_EMU_MAX_DEVICES] = {};  // bit p of [d]: d may access p
};

typedef std::unique_lock<std::mutex> Lock;

/* runtime.cpp */
Runtime &rt();                        // after enter() succeeded
cudaError_t enter();                  // initialise; refuse in a forked child or a host function
cudaError_t fail(cudaError_t e);      // the last error of this thread (not NotReady); e
int current_device();
void set_in_host_fn(int on);
cudaError_t sticky(int device);       // rt().mu held
void set_sticky(int device, cudaError_t e, const char *report);  // rt().mu held
cudaError_t grid_error(int kind);     // a failed grid's report kind -> its error
uint64_t new_handle();                // rt().mu held

/* runtime_streams.cpp (rt().mu held unless said) */
StreamRef resolve(cudaStream_t s);    // null: not a live stream
uint64_t enqueue(const StreamRef &s, Op *op);      // takes op; its number
void release(Stream &s, uint64_t seq);
void host_wait(Lock &lk, const StreamRef &s, uint64_t seq);
/* what a host synchronisation of `s` waits for: s itself, and for the
 * legacy stream the device's blocking streams too */
std::vector<std::pair<StreamRef, uint64_t>> sync_targets(const StreamRef &s);
void reset_streams(Lock &lk, int device);          // cudaDeviceReset's part
void sync_device(Lock &lk, int device);            // every stream of it
void count_host_sync();              // ra_emu_host_syncs' counter, once per blocking call
double now_ms();

}  // namespace ra_emu_rt

#endif /* __cplusplus */
#endif /* RA_EMU_RUNTIME_INTERNAL_H */
