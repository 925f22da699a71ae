/*
 * emu.h -- the emulated GPU's internal interface (C, also read by C++).
 *
 * The emulated GPU (built with RINGATTN_CUDA=emulate, see README.md here)
 * has four parts that talk through this header:
 *
 *   memory.cpp   device memory: one reserved address range per device, an
 *                allocator with redzones and a quarantine, and shadow state
 *                (addressable / freed / initialised) per byte
 *   runtime.cpp  the CUDA runtime API of include/cuda_runtime.h: devices,
 *                current device, streams (in-order queues run by a worker
 *                thread each), events, copies, errors, attributes
 *   simt.cpp     kernels: a grid's blocks on a pool of worker threads, each
 *                block's threads as fibers that really interleave (barriers,
 *                warp collectives), the launch checks of an sm_90 device
 *   check.cpp    the memory checker: every load and store of kernel code
 *                (the kernels are compiled with the compiler's thread
 *                sanitizer instrumentation, whose hooks land here) checked
 *                against device memory's shadow and the block's shared
 *                memory shadow: out of bounds, freed, uninitialised, host
 *                memory, races between threads of a block, cp.async
 *                destinations read before their wait
 *
 * and the stand-in NCCL (nccl/) reaches the runtime through the table
 * ra_emu_rt_table, handed to it when nccl_loader.c opens it.
 *
 * Nothing here is for users: the public face is the CUDA runtime API of
 * include/cuda_runtime.h and RINGATTN_EMU_* environment variables.
 */
#ifndef RA_EMU_H
#define RA_EMU_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- limits of the emulated device (an sm_90 part) -------------------- */

#define RA_EMU_MAX_DEVICES 8
#define RA_EMU_MAX_THREADS 1024            /* threads per block */
#define RA_EMU_SMEM_DEFAULT (48 * 1024)    /* dynamic shared memory without opt-in */
#define RA_EMU_SMEM_OPTIN (227 * 1024)     /* cudaDevAttrMaxSharedMemoryPerBlockOptin */
#define RA_EMU_SMEM_PER_SM (228 * 1024)
#define RA_EMU_SM_COUNT 132
#define RA_EMU_WARP 32

/* ---- settings (read once from the environment) ------------------------ */

typedef struct ra_emu_settings {
    int devices;       /* RINGATTN_EMU_DEVICES, default 2, 1..RA_EMU_MAX_DEVICES */
    size_t mem_bytes;  /* RINGATTN_EMU_MEMORY (bytes, suffix K/M/G), per device;
                          default 16 GiB of address space (committed on use) */
    int workers;       /* RINGATTN_EMU_WORKERS: block worker threads, default
                          the number of CPUs */
    int check;         /* RINGATTN_EMU_CHECK: 1 (default) checks every kernel
                          access, 0 turns the checker off (faster) */
    int schedule;      /* RINGATTN_EMU_SCHEDULE: order in which a block's
                          threads run between sync points:
                          0 forward (default), 1 reverse, 2 random */
    uint64_t seed;     /* RINGATTN_EMU_SEED for schedule 2 */
    int lazy;          /* RINGATTN_EMU_LAZY=1: stream work starts only when the
                          host observes it (sync, query, event wait, ...) */
    int quiet;         /* RINGATTN_EMU_QUIET=1: reports are not printed */
    int peer;          /* RINGATTN_EMU_PEER=0: cudaDeviceCanAccessPeer says no
                          (default 1: every pair of devices may be peers) */
} ra_emu_settings;

const ra_emu_settings *ra_emu_config(void);

/* ---- reports ------------------------------------------------------------ */

/* What the checker and the SIMT layer find.  The first report of a grid
 * fails the grid: the device gets a sticky error (cudaErrorIllegalAddress
 * for the memory kinds, cudaErrorLaunchFailure for the others), as a real
 * device does after a fault, and the report's text is what
 * cudaGetErrorString returns for it. */
typedef enum ra_emu_report_kind {
    RA_EMU_OOB_GLOBAL = 1,     /* global access outside any live allocation */
    RA_EMU_FREED_GLOBAL,       /* global access to freed memory */
    RA_EMU_UNINIT_GLOBAL,      /* read of device memory never written */
    RA_EMU_PEER_GLOBAL,        /* another device's memory (no peer access) */
    RA_EMU_HOST_MEMORY,        /* a kernel touched host memory */
    RA_EMU_OOB_SHARED,         /* shared access past the block's allocation */
    RA_EMU_UNINIT_SHARED,      /* read of shared memory never written */
    RA_EMU_RACE_SHARED,        /* two threads, one writes, no barrier between */
    RA_EMU_CP_ASYNC_PENDING,   /* cp.async destination touched before its wait */
    RA_EMU_MISALIGNED,         /* misaligned address (ldmatrix, cp.async, ...) */
    RA_EMU_SYNC,               /* barrier / warp collective misuse, deadlock */
    RA_EMU_TRAP                /* __trap, assert, a fault in the emulator */
} ra_emu_report_kind;

/* Record a report against the kernel that runs on this thread (or, off a
 * kernel, against the calling stream operation).  printf-style text.  The
 * first report of a grid wins; later ones are counted. */
void ra_emu_report(ra_emu_report_kind kind, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Every report since the process started (or the last clear), newest
 * last, as one newline-separated text (tests read it): a copy owned by the
 * calling thread, valid until its next call; the count. */
const char *ra_emu_reports_text(void);
long ra_emu_reports_count(void);
void ra_emu_reports_clear(void);

/* ---- device memory (memory.cpp) ----------------------------------------- */

/* All devices' memory lies in one reserved range [arena_lo, arena_hi):
 * device d owns [arena_lo + d * arena_per_device, ... + arena_per_device).
 * The checker's fast test is one subtraction and compare. */
extern uintptr_t ra_emu_arena_lo, ra_emu_arena_hi, ra_emu_arena_per_device;

int ra_emu_mem_init(void);                 /* 0 ok; reserves the range */
/* cudaMalloc: 256-byte aligned, redzones around, contents poisoned (0xff
 * bytes: NaN in every float dtype), shadow addressable but uninitialised.
 * NULL when the device's memory is exhausted. */
void *ra_emu_mem_alloc(int device, size_t nbytes);
/* cudaFree: 0 ok, -1 if p is not the start of a live allocation. */
int ra_emu_mem_free(void *p);
/* The device owning p (-1: not device memory), and the live allocation
 * containing p (*base, *size; returns -1 if none). */
int ra_emu_mem_device_of(const void *p);
int ra_emu_mem_find(const void *p, void **base, size_t *size);
/* Shadow queries and updates for [p, p + n): ra_emu_mem_check returns 0 if
 * every byte is addressable (and, for reads with `need_init`, initialised),
 * otherwise the report kind of the first bad byte, its address in *bad. */
int ra_emu_mem_check(const void *p, size_t n, int is_write, int need_init,
                     uintptr_t *bad);
void ra_emu_mem_mark_init(const void *p, size_t n);
/* bytes in use / total of a device (cudaMemGetInfo) */
void ra_emu_mem_info(int device, size_t *used, size_t *total);

/* ---- kernels (simt.cpp) -------------------------------------------------- */

typedef struct ra_emu_dim3 { unsigned x, y, z; } ra_emu_dim3;

/* One kernel launch as the stream queue holds it.  `args` is a heap block
 * the launch template made (the kernel's arguments, copied); `thunk(args)`
 * runs the kernel body for the current thread; `free_args(args)` frees it
 * when the grid is done or dropped. */
typedef struct ra_emu_grid {
    const void *func;            /* the kernel's identity (function pointer) */
    const char *name;            /* as written at the launch site */
    const char *site;            /* "file:line" of the launch */
    ra_emu_dim3 grid, block;
    size_t smem;                 /* dynamic shared memory bytes */
    int device;
    void (*thunk)(void *args);
    void *args;
    void (*free_args)(void *args);
} ra_emu_grid;

/* Check a launch configuration as the runtime does at launch time: 0, or a
 * cudaError_t value (cudaErrorInvalidConfiguration, cudaErrorInvalidValue
 * for too much shared memory, ...) with a message for the last error. */
int ra_emu_grid_validate(const ra_emu_grid *g, size_t smem_limit,
                         const char **why);
/* Run every block of the grid on the worker pool; returns when all have
 * finished (or, after a report, when the blocks running have stopped; the
 * rest are not started).  0, or the ra_emu_report_kind of the first report
 * (ra_emu_reports_text has its text): RA_EMU_OOB_GLOBAL .. RA_EMU_MISALIGNED
 * are memory faults (cudaErrorIllegalAddress, RA_EMU_MISALIGNED
 * cudaErrorMisalignedAddress), the others cudaErrorLaunchFailure. */
int ra_emu_grid_run(const ra_emu_grid *g);

/* cudaFuncSetAttribute(MaxDynamicSharedMemorySize) bookkeeping */
int ra_emu_func_set_smem(const void *func, int bytes);
size_t ra_emu_func_smem_limit(const void *func);

/* ---- test hooks of the runtime (runtime_streams.cpp) --------------------- */

/* How many times the host has blocked on device work so far: every
 * cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize,
 * cudaFree and cudaFreeHost (they wait for the device), and every copy or
 * memset that returns only once its work (or the work before it) is done.
 * Tests count the host synchronisations of a call with it. */
uint64_t ra_emu_host_syncs(void);
/* Lazy mode (RINGATTN_EMU_LAZY) on (1) or off (0) from now on, or left as
 * it is (-1); returns the previous setting, or -1 when the runtime cannot
 * start. */
int ra_emu_set_lazy(int on);

/* ---- the stand-in NCCL's view of the runtime ----------------------------- */

/* Handed to the stand-in NCCL library by nccl_loader.c after dlopen, through
 * its exported function `raEmuNcclBind(const ra_emu_rt_table *)`. */
typedef struct ra_emu_rt_table {
    int version;                 /* RA_EMU_RT_TABLE_VERSION */
    /* Queue fn(arg) on `stream` (a cudaStream_t) in order with its other
     * work; fn runs on the stream's worker thread, may block (it is the
     * transfer "kernel" of a grouped send/recv) and returns 0, or a
     * cudaError_t value that becomes the stream's error.  0 or a
     * cudaError_t value for the enqueue itself. */
    int (*enqueue)(void *stream, int (*fn)(void *arg), void *arg);
    /* the device of a stream (-1: bad handle); the calling thread's
     * current device */
    int (*stream_device)(void *stream);
    int (*current_device)(void);
    /* the device owning every byte of [p, p + n), or -1 */
    int (*device_of)(const void *p, size_t n);
    /* shadow bookkeeping for bytes a transfer writes into device memory */
    void (*mark_init)(const void *p, size_t n);
} ra_emu_rt_table;

#define RA_EMU_RT_TABLE_VERSION 1

const ra_emu_rt_table *ra_emu_runtime_table(void);

#ifdef __cplusplus
}
#endif
#endif /* RA_EMU_H */
