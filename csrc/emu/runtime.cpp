/*
 * runtime.cpp -- the emulated CUDA runtime's devices, errors, attributes,
 * kernel launches and the table the stand-in NCCL uses (emu.h).  Streams
 * and events are in runtime_streams.cpp, memory calls in
 * runtime_memory.cpp; what they share in runtime_internal.h.
 *
 * Devices.  RINGATTN_EMU_DEVICES H100 SXM parts (compute capability 9.0);
 * the current device is per host thread (0 at first).
 *
 * Errors.  Every failing call sets the calling thread's last error
 * (cudaGetLastError returns and clears it, cudaPeekAtLastError only
 * returns it); a query's cudaErrorNotReady is not an error.  A fault of a
 * kernel (a report of the SIMT layer or the checker), or of a copy that
 * ran into freed memory, gives its device a sticky error that every later
 * call on that device returns, until cudaDeviceReset; cudaGetErrorString
 * of it carries the first report.  In a process forked after the runtime
 * started, every call fails with cudaErrorInitializationError, as the real
 * driver's does; a host function (cudaLaunchHostFunc) calling a stream or
 * memory function gets cudaErrorNotPermitted.
 */
#include "emu/runtime_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>

namespace ra_emu_rt {

namespace {

pthread_once_t g_once = PTHREAD_ONCE_INIT;
Runtime *g_rt;                   // leaked on purpose: workers may outlive exit
cudaError_t g_init_err = cudaErrorInitializationError;
volatile int g_forked;

thread_local int tl_device;
thread_local cudaError_t tl_last;
thread_local int tl_in_host_fn;

void on_fork_child() {
    if (g_rt != nullptr) g_forked = 1;   // its workers did not come along
}

void init() {
    if (ra_emu_mem_init() != 0) return;
    const ra_emu_settings *cfg = ra_emu_config();
    Runtime *r = new Runtime();
    r->ndev = cfg->devices;
    r->lazy = cfg->lazy;
    r->next_handle = (uint64_t)0x7e5a0000ull << 16;
    g_rt = r;
    pthread_atfork(nullptr, nullptr, on_fork_child);
    g_init_err = cudaSuccess;
}

/* "unless in a host function": the pure queries may be called from one */
cudaError_t start(bool from_host_fn_ok) {
    pthread_once(&g_once, init);
    if (g_forked) return cudaErrorInitializationError;
    if (g_init_err != cudaSuccess) return g_init_err;
    if (!from_host_fn_ok && tl_in_host_fn) return cudaErrorNotPermitted;
    return cudaSuccess;
}

struct ErrorText {
    cudaError_t code;
    const char *name, *text;
};

const ErrorText kErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorCudartUnloading, "cudaErrorCudartUnloading", "driver shutting down"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration",
     "invalid configuration argument"},
    {cudaErrorInvalidPitchValue, "cudaErrorInvalidPitchValue", "invalid pitch argument"},
    {cudaErrorInvalidDevicePointer, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection",
     "invalid copy direction for memcpy"},
    {cudaErrorInsufficientDriver, "cudaErrorInsufficientDriver",
     "CUDA driver version is insufficient for CUDA runtime version"},
    {cudaErrorInvalidDeviceFunction, "cudaErrorInvalidDeviceFunction", "invalid device function"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorNoKernelImageForDevice, "cudaErrorNoKernelImageForDevice",
     "no kernel image is available for execution on the device"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorIllegalState, "cudaErrorIllegalState",
     "the operation cannot be performed in the present state"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress",
     "an illegal memory access was encountered"},
    {cudaErrorLaunchOutOfResources, "cudaErrorLaunchOutOfResources",
     "too many resources requested for launch"},
    {cudaErrorLaunchTimeout, "cudaErrorLaunchTimeout", "the launch timed out and was terminated"},
    {cudaErrorPeerAccessAlreadyEnabled, "cudaErrorPeerAccessAlreadyEnabled",
     "peer access is already enabled"},
    {cudaErrorPeerAccessNotEnabled, "cudaErrorPeerAccessNotEnabled", "peer access has not been enabled"},
    {cudaErrorContextIsDestroyed, "cudaErrorContextIsDestroyed", "context is destroyed"},
    {cudaErrorAssert, "cudaErrorAssert", "device-side assert triggered"},
    {cudaErrorMisalignedAddress, "cudaErrorMisalignedAddress", "misaligned address"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorNotPermitted, "cudaErrorNotPermitted", "operation not permitted"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};

const ErrorText *error_entry(cudaError_t e) {
    for (const ErrorText &t : kErrors)
        if (t.code == e) return &t;
    return nullptr;
}

/* why this thread's last launch was refused (ra_emu_grid_validate's text) */
thread_local cudaError_t tl_launch_err;
thread_local const char *tl_launch_why;

/* "<text> (ringattn emulated GPU: <detail>)", made once per pair, leaked */
const char *with_detail(const char *text, const char *detail) {
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    static std::map<std::pair<std::string, std::string>, std::string *> *made;
    pthread_mutex_lock(&mu);
    if (made == nullptr) made = new std::map<std::pair<std::string, std::string>, std::string *>();
    std::string *&s = (*made)[{text, detail}];
    if (s == nullptr) s = new std::string(std::string(text) + " (ringattn emulated GPU: " +
                                          detail + ")");
    const char *out = s->c_str();
    pthread_mutex_unlock(&mu);
    return out;
}

}  // namespace

Runtime &rt() { return *g_rt; }
cudaError_t enter() { return start(false); }
int current_device() { return tl_device; }
void set_in_host_fn(int on) { tl_in_host_fn = on; }

cudaError_t fail(cudaError_t e) {
    if (e != cudaSuccess && e != cudaErrorNotReady) {
        tl_last = e;
        tl_launch_why = nullptr;    // the detail belongs to a refused launch only
    }
    return e;
}

cudaError_t sticky(int device) { return g_rt->dev[device].sticky; }

void set_sticky(int device, cudaError_t e, const char *report) {
    DeviceState &dv = g_rt->dev[device];
    if (dv.sticky != cudaSuccess) return;       // the first fault stays
    dv.sticky = e;
    const ErrorText *t = error_entry(e);
    dv.sticky_text = report != nullptr && *report != '\0' && t != nullptr
                         ? with_detail(t->text, report) : nullptr;
}

cudaError_t grid_error(int kind) {
    if (kind == RA_EMU_MISALIGNED) return cudaErrorMisalignedAddress;
    if (kind >= RA_EMU_OOB_GLOBAL && kind < RA_EMU_MISALIGNED) return cudaErrorIllegalAddress;
    return cudaErrorLaunchFailure;
}

uint64_t new_handle() { return g_rt->next_handle += 0x10; }

}  // namespace ra_emu_rt

using namespace ra_emu_rt;

/* ---- devices ------------------------------------------------------------- */

extern "C" cudaError_t cudaGetDeviceCount(int *count) {
    cudaError_t e = start(true);
    if (e != cudaSuccess) return fail(e);
    if (count == nullptr) return fail(cudaErrorInvalidValue);
    *count = rt().ndev;
    return cudaSuccess;
}

extern "C" cudaError_t cudaSetDevice(int device) {
    cudaError_t e = start(true);
    if (e != cudaSuccess) return fail(e);
    if (device < 0 || device >= rt().ndev) return fail(cudaErrorInvalidDevice);
    tl_device = device;
    return cudaSuccess;
}

extern "C" cudaError_t cudaGetDevice(int *device) {
    cudaError_t e = start(true);
    if (e != cudaSuccess) return fail(e);
    if (device == nullptr) return fail(cudaErrorInvalidValue);
    *device = tl_device;
    return cudaSuccess;
}

extern "C" cudaError_t cudaDeviceReset(void) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    Runtime &R = rt();
    Lock lk(R.mu);
    const int d = tl_device;
    reset_streams(lk, d);
    ra_emu_mem_release_device(d);
    if (tl_last == R.dev[d].sticky) tl_last = cudaSuccess;   // it was that fault
    R.dev[d].sticky = cudaSuccess;
    R.dev[d].sticky_text = nullptr;
    return cudaSuccess;
}

extern "C" cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device) {
    cudaError_t e = start(true);
    if (e != cudaSuccess) return fail(e);
    if (value == nullptr) return fail(cudaErrorInvalidValue);
    if (device < 0 || device >= rt().ndev) return fail(cudaErrorInvalidDevice);
    int v;
    switch (attr) {   // an H100 SXM5
    case cudaDevAttrMaxThreadsPerBlock: v = RA_EMU_MAX_THREADS; break;
    case cudaDevAttrMaxBlockDimX: v = 1024; break;
    case cudaDevAttrMaxBlockDimY: v = 1024; break;
    case cudaDevAttrMaxBlockDimZ: v = 64; break;
    case cudaDevAttrMaxGridDimX: v = 0x7fffffff; break;
    case cudaDevAttrMaxGridDimY: v = 65535; break;
    case cudaDevAttrMaxGridDimZ: v = 65535; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: v = RA_EMU_SMEM_DEFAULT; break;
    case cudaDevAttrTotalConstantMemory: v = 65536; break;
    case cudaDevAttrWarpSize: v = RA_EMU_WARP; break;
    case cudaDevAttrMaxRegistersPerBlock: v = 65536; break;
    case cudaDevAttrClockRate: v = 1980000; break;           // kHz
    case cudaDevAttrMultiProcessorCount: v = RA_EMU_SM_COUNT; break;
    case cudaDevAttrIntegrated: v = 0; break;
    case cudaDevAttrConcurrentKernels: v = 1; break;
    case cudaDevAttrPciBusId: v = 0x18 + 0x10 * device; break;
    case cudaDevAttrL2CacheSize: v = 50 << 20; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: v = 2048; break;
    case cudaDevAttrUnifiedAddressing: v = 1; break;
    case cudaDevAttrComputeCapabilityMajor: v = 9; break;
    case cudaDevAttrComputeCapabilityMinor: v = 0; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: v = RA_EMU_SMEM_PER_SM; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: v = RA_EMU_SMEM_OPTIN; break;
    case cudaDevAttrMemoryPoolsSupported: v = 1; break;
    default: return fail(cudaErrorInvalidValue);
    }
    *value = v;
    return cudaSuccess;
}

extern "C" cudaError_t cudaDriverGetVersion(int *version) {
    if (version == nullptr) return fail(cudaErrorInvalidValue);
    *version = 13000;
    return cudaSuccess;
}

extern "C" cudaError_t cudaRuntimeGetVersion(int *version) {
    if (version == nullptr) return fail(cudaErrorInvalidValue);
    *version = CUDART_VERSION;
    return cudaSuccess;
}

/* ---- errors -------------------------------------------------------------- */

extern "C" cudaError_t cudaGetLastError(void) {
    cudaError_t e = start(true);
    if (e != cudaSuccess) return e;
    e = tl_last;
    tl_last = cudaSuccess;
    if (e == cudaSuccess) {
        Lock lk(rt().mu);
        e = sticky(tl_device);
    }
    return e;
}

extern "C" cudaError_t cudaPeekAtLastError(void) {
    cudaError_t e = start(true);
    if (e != cudaSuccess) return e;
    if (tl_last != cudaSuccess) return tl_last;
    Lock lk(rt().mu);
    return sticky(tl_device);
}

extern "C" const char *cudaGetErrorName(cudaError_t error) {
    const ErrorText *t = error_entry(error);
    return t != nullptr ? t->name : "unrecognized error code";
}

extern "C" const char *cudaGetErrorString(cudaError_t error) {
    const ErrorText *t = error_entry(error);
    if (t == nullptr) return "unrecognized error code";
    if (error == tl_launch_err && tl_launch_why != nullptr)
        return with_detail(t->text, tl_launch_why);
    if (start(true) == cudaSuccess && error != cudaSuccess) {
        /* a sticky fault: the current device's first, else any device's */
        Lock lk(rt().mu);
        const DeviceState &cur = rt().dev[tl_device];
        if (cur.sticky == error && cur.sticky_text != nullptr) return cur.sticky_text;
        for (int d = 0; d < rt().ndev; d++)
            if (rt().dev[d].sticky == error && rt().dev[d].sticky_text != nullptr)
                return rt().dev[d].sticky_text;
    }
    return t->text;
}

/* ---- kernels ------------------------------------------------------------- */

extern "C" cudaError_t cudaFuncSetAttribute(const void *func, enum cudaFuncAttribute attr,
                                            int value) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return fail(e);
    if (func == nullptr) return fail(cudaErrorInvalidDeviceFunction);
    switch (attr) {
    case cudaFuncAttributeMaxDynamicSharedMemorySize:
        return fail((cudaError_t)ra_emu_func_set_smem(func, value));
    case cudaFuncAttributePreferredSharedMemoryCarveout:
        return fail(value >= -1 && value <= 100 ? cudaSuccess : cudaErrorInvalidValue);
    default:
        return fail(cudaErrorInvalidValue);
    }
}

extern "C" cudaError_t raEmuLaunchKernel(const void *func, const char *name, const char *site,
                                         unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                         unsigned by, unsigned bz, size_t smem,
                                         cudaStream_t stream, void (*thunk)(void *), void *args,
                                         void (*free_args)(void *)) {
    ra_emu_grid g;
    g.func = func;
    g.name = name != nullptr ? name : "?";
    g.site = site != nullptr ? site : "?";
    g.grid = {gx, gy, gz};
    g.block = {bx, by, bz};
    g.smem = smem;
    g.device = 0;
    g.thunk = thunk;
    g.args = args;
    g.free_args = free_args;
    auto refuse = [&](cudaError_t e) {
        if (free_args != nullptr) free_args(args);
        return fail(e);
    };
    cudaError_t e = enter();
    if (e != cudaSuccess) return refuse(e);
    if (func == nullptr || thunk == nullptr) return refuse(cudaErrorInvalidDeviceFunction);
    const char *why = nullptr;
    int bad = ra_emu_grid_validate(&g, ra_emu_func_smem_limit(func), &why);
    if (bad != 0) {
        refuse((cudaError_t)bad);
        tl_launch_err = (cudaError_t)bad;
        tl_launch_why = why;
        return (cudaError_t)bad;
    }
    Runtime &R = rt();
    Lock lk(R.mu);
    StreamRef s = resolve(stream);
    /* a kernel goes only to a stream of the current device */
    if (!s || s->device != tl_device) {
        lk.unlock();
        return refuse(cudaErrorInvalidResourceHandle);
    }
    if ((e = sticky(s->device)) != cudaSuccess) {
        lk.unlock();
        return refuse(e);
    }
    g.device = s->device;
    Op *op = new Op();
    op->kind = OP_KERNEL;
    op->grid = g;
    enqueue(s, op);
    return cudaSuccess;
}

/* ---- the stand-in NCCL's table ------------------------------------------- */

namespace {

/* Queued like any other work; in lazy mode released at once (with what it
 * waits for): a transfer's peer is another process, which cannot observe
 * this one's streams. */
int table_enqueue(void *stream, int (*fn)(void *), void *arg) {
    cudaError_t e = enter();
    if (e != cudaSuccess) return e;
    if (fn == nullptr) return cudaErrorInvalidValue;
    Lock lk(rt().mu);
    StreamRef s = resolve((cudaStream_t)stream);
    if (!s) return cudaErrorInvalidResourceHandle;
    Op *op = new Op();
    op->kind = OP_CALL;
    op->call = fn;
    op->user = arg;
    release(*s, enqueue(s, op));
    return 0;
}

int table_stream_device(void *stream) {
    if (start(true) != cudaSuccess) return -1;
    Lock lk(rt().mu);
    StreamRef s = resolve((cudaStream_t)stream);
    return s ? s->device : -1;
}

int table_current_device(void) { return start(true) == cudaSuccess ? tl_device : -1; }

int table_device_of(const void *p, size_t n) {
    int d = -1;
    return ra_emu_mem_range(p, n == 0 ? 1 : n, &d) == 0 ? d : -1;
}

const ra_emu_rt_table kTable = {
    RA_EMU_RT_TABLE_VERSION, table_enqueue, table_stream_device, table_current_device,
    table_device_of, ra_emu_mem_mark_init,
};

}  // namespace

extern "C" const ra_emu_rt_table *ra_emu_runtime_table(void) { return &kTable; }
