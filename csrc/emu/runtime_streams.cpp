/*
 * runtime_streams.cpp -- streams, their worker threads, events and every
 * host wait of the emulated CUDA runtime (the model: runtime_internal.h).
 *
 * Streams.  User streams live in a registry keyed by their handle (a
 * number never reused, never dereferenced), so a destroyed or garbage
 * handle is cudaErrorInvalidResourceHandle.  Handle 0 and cudaStreamLegacy
 * name the current device's legacy default stream, cudaStreamPerThread
 * this host thread's stream of the current device (blocking; its worker
 * leaves when the thread exits).  An operation queued on the legacy stream
 * first waits for the work queued so far on the device's blocking streams;
 * one queued on a blocking stream first waits for the legacy stream's
 * work so far; cudaStreamNonBlocking streams take no part.
 *
 * Workers.  One detached thread per stream runs its queue in order.  After
 * a device fault (its sticky error) kernels, copies, memsets and host
 * functions are dropped, as on a dead context; records, waits, frees and
 * the stand-in NCCL's transfers still run, so nobody waits forever.
 */
#include "emu/runtime_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include <atomic>
#include <chrono>
#include <string>
#include <system_error>
#include <thread>

namespace ra_emu_rt {

double now_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

namespace {

std::atomic<uint64_t> g_host_syncs{0};

/* ---- running one operation (without the lock) ---- */

/* The device bytes of a copy or memset must still be a live allocation when
 * it runs (a cudaFreeAsync may have come first): else a memory fault. */
int check_range(const void *p, size_t n, int is_write, const char *what) {
    if (ra_emu_mem_device_of(p) < 0) return 0;
    uintptr_t bad = 0;
    int kind = ra_emu_mem_check(p, n, is_write, 0, &bad);
    if (kind != 0)
        ra_emu_report((ra_emu_report_kind)kind, "%s %s device memory at %p (%zu bytes from %p): %s",
                      what, is_write ? "writes" : "reads", (void *)bad, n, p,
                      kind == RA_EMU_FREED_GLOBAL ? "freed" : "not allocated");
    return kind;
}

/* How an operation ended: a device fault (the report kind), or an error
 * of the stream (an OP_CALL's value). */
struct Outcome {
    int fault = 0;
    cudaError_t stream_err = cudaSuccess;
};

Outcome run_op(Op &op, bool dead) {
    Outcome out;
    switch (op.kind) {
    case OP_KERNEL:
        if (!dead) out.fault = ra_emu_grid_run(&op.grid);
        break;
    case OP_COPY: {
        if (dead) break;
        const void *src = op.staged ? (const void *)op.staged.get() : op.src;
        out.fault = check_range(op.dst, op.n, 1, "a copy");
        if (out.fault == 0) out.fault = check_range(src, op.n, 0, "a copy");
        if (out.fault != 0) break;
        memmove(op.dst, src, op.n);
        ra_emu_mem_mark_init(op.dst, op.n);
        break;
    }
    case OP_MEMSET:
        if (dead) break;
        out.fault = check_range(op.dst, op.n, 1, "a memset");
        if (out.fault != 0) break;
        memset(op.dst, op.value, op.n);
        ra_emu_mem_mark_init(op.dst, op.n);
        break;
    case OP_RECORD:
        op.timing->ms = now_ms();
        break;
    case OP_WAIT:
        break;
    case OP_HOST_FN:
        if (dead) break;
        set_in_host_fn(1);
        op.host_fn(op.user);
        set_in_host_fn(0);
        break;
    case OP_CALL: {
        const int r = op.call(op.user);
        if (r != 0) out.stream_err = r > 0 ? (cudaError_t)r : cudaErrorUnknown;
        break;
    }
    case OP_FREE:
        (void)ra_emu_mem_free(op.dst);
        break;
    }
    return out;
}

/* What is left of an operation that did not run. */
void drop_op(Op &op) {
    if (op.kind == OP_KERNEL && op.grid.free_args != nullptr) op.grid.free_args(op.grid.args);
}

/* The text of report number `first` (0-based since the last clear): the
 * one a failed operation made.  Reports past the first 200 are not kept
 * (config.cpp): then no text. */
std::string report_line(long first) {
    std::string all = ra_emu_reports_text();
    size_t at = 0;
    long i = 0;
    if (ra_emu_reports_count() <= first) first = ra_emu_reports_count() - 1;  // cleared since
    for (; i < first && at < all.size(); i++) {
        const size_t nl = all.find('\n', at);
        at = nl == std::string::npos ? all.size() : nl + 1;
    }
    if (first < 0 || i < first || at >= all.size()) return "";
    const size_t end = all.find('\n', at);
    return all.substr(at, end == std::string::npos ? std::string::npos : end - at);
}

void worker(StreamRef s) {
    Runtime &R = rt();
    Lock lk(R.mu);
    for (;;) {
        while (s->queue.empty() ||
               (R.lazy && s->done + 1 > s->released && s->done + 1 > s->skip_until)) {
            if (s->destroyed && s->queue.empty()) {
                std::vector<StreamRef> &all = R.dev[s->device].streams;
                for (size_t i = 0; i < all.size(); i++)
                    if (all[i] == s) {
                        all.erase(all.begin() + (long)i);
                        break;
                    }
                return;
            }
            s->cv.wait(lk);
        }
        Op *op = s->queue.front();
        const uint64_t seq = s->done + 1;
        for (auto &d : op->deps) {
            if (seq <= s->skip_until) break;
            release(*d.first, d.second);
            while (d.first->done < d.second && seq > s->skip_until) R.done_cv.wait(lk);
        }
        s->queue.pop_front();
        const bool skip = seq <= s->skip_until;
        const bool dead = sticky(s->device) != cudaSuccess;
        const long reports = ra_emu_reports_count();   // the fault's report comes after
        lk.unlock();
        Outcome r;
        if (skip) drop_op(*op);
        else r = run_op(*op, dead);
        if (op->kind == OP_KERNEL && !skip && op->grid.free_args != nullptr)
            op->grid.free_args(op->grid.args);
        std::string line = r.fault != 0 ? report_line(reports) : std::string();
        const OpKind kind = op->kind;
        void *freed = op->dst;
        delete op;
        lk.lock();
        if (r.fault != 0) {
            set_sticky(s->device, kind == OP_KERNEL ? grid_error(r.fault) : cudaErrorIllegalAddress,
                       line.c_str());
        } else if (r.stream_err != cudaSuccess && s->err == cudaSuccess) {
            s->err = r.stream_err;
            s->err_seq = seq;
        }
        if (kind == OP_FREE) R.pending_free.erase((uintptr_t)freed);
        s->done = seq;
        R.done_cv.notify_all();
    }
}

StreamRef make_stream(int device, unsigned flags, StreamKind kind) {
    StreamRef s = std::make_shared<Stream>();
    s->device = device;
    s->flags = flags;
    s->kind = kind;
    try {
        std::thread(worker, s).detach();
    } catch (const std::system_error &) {
        return nullptr;
    }
    rt().dev[device].streams.push_back(s);
    return s;
}

/* ---- this host thread's per-thread default streams ---- */

struct PerThread {
    StreamRef s[RA_EMU_MAX_DEVICES];
    uint64_t epoch[RA_EMU_MAX_DEVICES];
};

thread_local PerThread *tl_per_thread;
pthread_key_t g_pt_key;
pthread_once_t g_pt_once = PTHREAD_ONCE_INIT;

/* the thread exits: its streams finish their work, then their workers */
void per_thread_exit(void *p) {
    PerThread *pt = (PerThread *)p;
    {
        Lock lk(rt().mu);
        for (auto &s : pt->s)
            if (s) {
                s->destroyed = true;
                release(*s, s->enq);
                s->cv.notify_one();
            }
    }
    tl_per_thread = nullptr;
    delete pt;
}

void pt_key_create() { pthread_key_create(&g_pt_key, per_thread_exit); }

StreamRef per_thread_stream(int d) {
    if (tl_per_thread == nullptr) {
        pthread_once(&g_pt_once, pt_key_create);
        tl_per_thread = new PerThread();
        pthread_setspecific(g_pt_key, tl_per_thread);
    }
    PerThread &pt = *tl_per_thread;
    if (!pt.s[d] || pt.s[d]->destroyed || pt.epoch[d] != rt().dev[d].epoch) {
        pt.s[d] = make_stream(d, 0, S_PER_THREAD);
        pt.epoch[d] = rt().dev[d].epoch;
    }
    return pt.s[d];
}

}  // namespace

/* ---- the shared helpers (runtime_internal.h) ---- */

StreamRef resolve(cudaStream_t handle) {
    Runtime &R = rt();
    const uintptr_t h = (uintptr_t)handle;
    const int d = current_device();
    if (h == 0 || handle == cudaStreamLegacy) {
        if (!R.dev[d].legacy) R.dev[d].legacy = make_stream(d, 0, S_LEGACY);
        return R.dev[d].legacy;
    }
    if (handle == cudaStreamPerThread) return per_thread_stream(d);
    auto it = R.streams.find((uint64_t)h);
    return it == R.streams.end() ? nullptr : it->second;
}

uint64_t enqueue(const StreamRef &s, Op *op) {
    DeviceState &dv = rt().dev[s->device];
    if (s->kind == S_LEGACY) {
        for (const StreamRef &t : dv.streams)
            if (t != s && !(t->flags & cudaStreamNonBlocking) && t->enq > t->done)
                op->deps.push_back({t, t->enq});
    } else if (!(s->flags & cudaStreamNonBlocking) && dv.legacy && dv.legacy->enq > dv.legacy->done) {
        op->deps.push_back({dv.legacy, dv.legacy->enq});
    }
    s->queue.push_back(op);
    const uint64_t seq = ++s->enq;
    s->cv.notify_one();
    return seq;
}

void release(Stream &s, uint64_t seq) {
    if (seq > s.released) {
        s.released = seq;
        s.cv.notify_one();
    }
}

void host_wait(Lock &lk, const StreamRef &s, uint64_t seq) {
    release(*s, seq);
    while (s->done < seq) rt().done_cv.wait(lk);
}

std::vector<std::pair<StreamRef, uint64_t>> sync_targets(const StreamRef &s) {
    std::vector<std::pair<StreamRef, uint64_t>> out{{s, s->enq}};
    if (s->kind == S_LEGACY)
        for (const StreamRef &t : rt().dev[s->device].streams)
            if (t != s && !(t->flags & cudaStreamNonBlocking)) out.push_back({t, t->enq});
    return out;
}

void count_host_sync() { g_host_syncs.fetch_add(1, std::memory_order_relaxed); }

void sync_device(Lock &lk, int device) {
    std::vector<StreamRef> all = rt().dev[device].streams;
    for (const StreamRef &t : all) host_wait(lk, t, t->enq);
}

void reset_streams(Lock &lk, int device) {
    Runtime &R = rt();
    DeviceState &dv = R.dev[device];
    std::vector<StreamRef> all = dv.streams;
    for (const StreamRef &t : all) {
        t->skip_until = t->enq;
        t->cv.notify_one();
    }
    R.done_cv.notify_all();   // workers waiting on other streams re-check
    for (const StreamRef &t : all)
        while (t->done < t->enq) R.done_cv.wait(lk);
    for (const StreamRef &t : all) {
        t->destroyed = true;
        t->err = cudaSuccess;
        t->cv.notify_one();
    }
    for (auto it = R.streams.begin(); it != R.streams.end();)
        it = it->second->device == device ? R.streams.erase(it) : std::next(it);
    for (auto it = R.events.begin(); it != R.events.end();)
        it = it->second->device == device ? R.events.erase(it) : std::next(it);
    dv.legacy = nullptr;
    dv.epoch++;
}

}  // namespace ra_emu_rt

using namespace ra_emu_rt;

/* ---- streams ------------------------------------------------------------- */

extern "C" cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    if (stream == nullptr || (flags & ~(unsigned)cudaStreamNonBlocking) != 0)
        return fail(cudaErrorInvalidValue);
    Runtime &R = rt();
    Lock lk(R.mu);
    const int d = current_device();
    if ((e = sticky(d)) != cudaSuccess) return fail(e);
    StreamRef s = make_stream(d, flags, S_USER);
    if (!s) return fail(cudaErrorMemoryAllocation);
    s->handle = new_handle();
    R.streams[s->handle] = s;
    *stream = (cudaStream_t)(uintptr_t)s->handle;
    return cudaSuccess;
}

extern "C" cudaError_t cudaStreamCreate(cudaStream_t *stream) {
    return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

extern "C" cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    Runtime &R = rt();
    Lock lk(R.mu);
    auto it = R.streams.find((uint64_t)(uintptr_t)stream);
    if (it == R.streams.end()) return fail(cudaErrorInvalidResourceHandle);
    StreamRef s = it->second;
    R.streams.erase(it);
    s->destroyed = true;      // queued work still runs; then the worker leaves
    release(*s, s->enq);
    s->cv.notify_one();
    return fail(sticky(s->device));
}

extern "C" cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    Lock lk(rt().mu);
    StreamRef s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    count_host_sync();
    for (auto &t : sync_targets(s)) host_wait(lk, t.first, t.second);
    if ((e = sticky(s->device)) != cudaSuccess) return fail(e);
    return fail(s->err);
}

extern "C" cudaError_t cudaStreamQuery(cudaStream_t stream) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    Lock lk(rt().mu);
    StreamRef s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    if ((e = sticky(s->device)) != cudaSuccess) return fail(e);
    bool busy = false;
    for (auto &t : sync_targets(s)) {
        release(*t.first, t.second);
        busy |= t.first->done < t.second;
    }
    if (busy) return cudaErrorNotReady;
    return fail(s->err);
}

extern "C" cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                                           unsigned int flags) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    if (flags != 0) return fail(cudaErrorInvalidValue);
    Runtime &R = rt();
    Lock lk(R.mu);
    StreamRef s = resolve(stream);
    auto ev = R.events.find((uint64_t)(uintptr_t)event);
    if (!s || ev == R.events.end()) return fail(cudaErrorInvalidResourceHandle);
    if ((e = sticky(s->device)) != cudaSuccess) return fail(e);
    const Event &E = *ev->second;
    if (!E.stream) return cudaSuccess;           // never recorded: nothing to wait for
    Op *op = new Op();
    op->kind = OP_WAIT;
    op->deps.push_back({E.stream, E.seq});       // the record as it is now
    enqueue(s, op);
    return cudaSuccess;
}

extern "C" cudaError_t cudaStreamGetFlags(cudaStream_t stream, unsigned int *flags) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    if (flags == nullptr) return fail(cudaErrorInvalidValue);
    Lock lk(rt().mu);
    StreamRef s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    *flags = s->flags;
    return cudaSuccess;
}

extern "C" cudaError_t cudaStreamGetDevice(cudaStream_t stream, int *device) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    if (device == nullptr) return fail(cudaErrorInvalidValue);
    Lock lk(rt().mu);
    StreamRef s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    *device = s->device;
    return cudaSuccess;
}

extern "C" cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *userData) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    if (fn == nullptr) return fail(cudaErrorInvalidValue);
    Lock lk(rt().mu);
    StreamRef s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    if ((e = sticky(s->device)) != cudaSuccess) return fail(e);
    Op *op = new Op();
    op->kind = OP_HOST_FN;
    op->host_fn = fn;
    op->user = userData;
    enqueue(s, op);
    return cudaSuccess;
}

extern "C" cudaError_t cudaDeviceSynchronize(void) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    Lock lk(rt().mu);
    const int d = current_device();
    count_host_sync();
    sync_device(lk, d);
    return fail(sticky(d));
}

/* ---- events -------------------------------------------------------------- */

extern "C" cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    const unsigned known = cudaEventBlockingSync | cudaEventDisableTiming | 0x4 /* interprocess */;
    if (event == nullptr || (flags & ~known) != 0) return fail(cudaErrorInvalidValue);
    Runtime &R = rt();
    Lock lk(R.mu);
    const int d = current_device();
    if ((e = sticky(d)) != cudaSuccess) return fail(e);
    auto ev = std::make_shared<Event>();
    ev->handle = new_handle();
    ev->device = d;
    ev->flags = flags;
    R.events[ev->handle] = ev;
    *event = (cudaEvent_t)(uintptr_t)ev->handle;
    return cudaSuccess;
}

extern "C" cudaError_t cudaEventCreate(cudaEvent_t *event) {
    return cudaEventCreateWithFlags(event, cudaEventDefault);
}

extern "C" cudaError_t cudaEventDestroy(cudaEvent_t event) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    Runtime &R = rt();
    Lock lk(R.mu);
    auto it = R.events.find((uint64_t)(uintptr_t)event);
    if (it == R.events.end()) return fail(cudaErrorInvalidResourceHandle);
    R.events.erase(it);   // queued records and waits keep what they need
    return cudaSuccess;
}

extern "C" cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    Runtime &R = rt();
    Lock lk(R.mu);
    StreamRef s = resolve(stream);
    auto it = R.events.find((uint64_t)(uintptr_t)event);
    if (!s || it == R.events.end()) return fail(cudaErrorInvalidResourceHandle);
    Event &E = *it->second;
    /* event and stream must belong to one device (the event's: the one
     * current at its creation) */
    if (E.device != s->device) return fail(cudaErrorInvalidResourceHandle);
    if ((e = sticky(s->device)) != cudaSuccess) return fail(e);
    Op *op = new Op();
    op->kind = OP_RECORD;
    op->timing = std::make_shared<Timing>();
    E.timing = op->timing;
    E.stream = s;
    E.seq = enqueue(s, op);
    return cudaSuccess;
}

namespace {

/* an event's state once its record has run: the device's sticky error, or
 * its stream's error if it came before the record */
cudaError_t event_result(const Event &E) {
    cudaError_t e = sticky(E.stream->device);
    if (e != cudaSuccess) return e;
    if (E.stream->err != cudaSuccess && E.stream->err_seq <= E.seq) return E.stream->err;
    return cudaSuccess;
}

}  // namespace

extern "C" cudaError_t cudaEventQuery(cudaEvent_t event) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    Runtime &R = rt();
    Lock lk(R.mu);
    auto it = R.events.find((uint64_t)(uintptr_t)event);
    if (it == R.events.end()) return fail(cudaErrorInvalidResourceHandle);
    const Event &E = *it->second;
    if (!E.stream) return cudaSuccess;           // never recorded: complete
    if ((e = sticky(E.stream->device)) != cudaSuccess) return fail(e);
    release(*E.stream, E.seq);
    if (E.stream->done < E.seq) return cudaErrorNotReady;
    return fail(event_result(E));
}

extern "C" cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    Runtime &R = rt();
    Lock lk(R.mu);
    auto it = R.events.find((uint64_t)(uintptr_t)event);
    if (it == R.events.end()) return fail(cudaErrorInvalidResourceHandle);
    std::shared_ptr<Event> E = it->second;   // it may be destroyed while we wait
    if (!E->stream) return cudaSuccess;
    StreamRef s = E->stream;
    const uint64_t seq = E->seq;
    count_host_sync();
    host_wait(lk, s, seq);
    Event snapshot = *E;
    snapshot.stream = s;
    snapshot.seq = seq;
    return fail(event_result(snapshot));
}

extern "C" cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    if (ms == nullptr) return fail(cudaErrorInvalidValue);
    Runtime &R = rt();
    Lock lk(R.mu);
    auto a = R.events.find((uint64_t)(uintptr_t)start);
    auto b = R.events.find((uint64_t)(uintptr_t)end);
    if (a == R.events.end() || b == R.events.end()) return fail(cudaErrorInvalidResourceHandle);
    const Event &A = *a->second, &B = *b->second;
    if ((A.flags | B.flags) & cudaEventDisableTiming) return fail(cudaErrorInvalidResourceHandle);
    if (!A.stream || !B.stream || A.device != B.device)
        return fail(cudaErrorInvalidResourceHandle);
    if ((e = sticky(A.device)) != cudaSuccess) return fail(e);
    release(*A.stream, A.seq);
    release(*B.stream, B.seq);
    if (A.stream->done < A.seq || B.stream->done < B.seq) return cudaErrorNotReady;
    *ms = (float)(B.timing->ms - A.timing->ms);
    return cudaSuccess;
}

/* ---- test hooks (emu.h) -------------------------------------------------- */

extern "C" uint64_t ra_emu_host_syncs(void) {
    return g_host_syncs.load(std::memory_order_relaxed);
}

extern "C" int ra_emu_set_lazy(int on) {
    if (enter() != cudaSuccess) return -1;
    Runtime &R = rt();
    Lock lk(R.mu);
    const int prev = R.lazy;
    if (on < 0) return prev;
    R.lazy = on ? 1 : 0;
    /* eager again: the workers held back by lazy mode go on */
    for (int d = 0; d < R.ndev; d++)
        for (const StreamRef &t : R.dev[d].streams) t->cv.notify_one();
    return prev;
}
