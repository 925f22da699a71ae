/*
 * cuda_rt.h -- the CUDA runtime as the C core sees it: device memory (with a
 * caching pool), ringattn's compute stream per device, kernel launches on
 * it, and stream ordering for DLPack.  Implemented in cuda_rt.c.  When
 * ringattn is built without CUDA (RA_WITH_CUDA undefined) every function
 * still exists and returns RA_ERR_UNSUPPORTED with a message saying why.
 * cuda/ reads this header too (nvcc): it stays free of Python.
 *
 * Importing ringattn never needs a GPU, a driver or NCCL: the CUDA runtime
 * is linked statically and only touched when a CUDA function is called.
 */
#ifndef RA_CUDA_RT_H
#define RA_CUDA_RT_H

#include "core/ra_common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* the most devices ringattn keeps per-device state for */
#define RA_CUDA_MAX_DEVICES 64

/* 1 if CUDA kernels were compiled in and a device is usable; otherwise 0
 * and *why (static string or thread-local message) says why. */
int ra_cuda_available(const char **why);
int ra_cuda_built(void);                 /* compiled with CUDA at all */
int ra_cuda_device_count(void);          /* 0 when unavailable */
/* 1 when the CUDA part runs on the emulated GPU (csrc/emu, cuda_emu.c) */
int ra_cuda_emulated(void);

/* Device memory.  Counted in memory_stats()["cuda"].  The caching pool is on
 * unless RINGATTN_CUDA_CACHING=0 (for compute-sanitizer runs). */
ra_status ra_cuda_malloc(int device, size_t nbytes, void **ptr);
ra_status ra_cuda_free(int device, void *ptr, size_t nbytes);
ra_status ra_cuda_memset_zero(int device, void *ptr, size_t nbytes);
void ra_cuda_empty_cache(void);

/* ringattn's compute stream on `device` (created on first use; a
 * non-blocking stream).  Returned as an opaque cudaStream_t. */
ra_status ra_cuda_compute_stream(int device, void **stream);

/* Who may still use exported memory after its consumer let go of it:
 * only ringattn's compute stream, streams the device's legacy default
 * stream synchronises with (the legacy stream, per-thread default streams,
 * blocking streams), or streams ringattn cannot name. */
enum { RA_SHARED_NONE = 0, RA_SHARED_LEGACY = 1, RA_SHARED_UNKNOWN = 2 };

/* DLPack producer side: make `consumer_stream` (a cudaStream_t value as an
 * integer; 1 = legacy default, 2 = per-thread default, -1 = the consumer
 * orders itself) wait for all work queued so far on our compute stream,
 * through an event.  `block`: the start of the ra_cuda_malloc block being
 * exported (NULL for memory ringattn does not own); a block read on
 * another stream than the compute stream is not reused after its free
 * before that reading is done (see cuda_rt.c).  *shared: how the
 * consumer's stream relates to ours (RA_SHARED_*). */
ra_status ra_cuda_export_sync(int device, void *block,
                              intptr_t consumer_stream, int *shared);

/* The stream-ordered lifetime of memory ringattn borrowed (an array
 * imported through DLPack; cuda_lifetime.c).  ringattn lets go of such an
 * array on `device`: `release(arg)` (the producer's deleter) runs once the
 * work queued so far on the device's compute stream has completed -- from
 * a later poll, with the GIL held and no host wait on the way -- and the
 * device's legacy default stream (with every stream that synchronises with
 * it) is ordered after that work.  `shared` (RA_SHARED_*): where else the
 * memory was handed on (a Buffer viewing it exported through DLPack): to
 * streams the legacy stream synchronises with, whose work so far the
 * release then waits for as well, or to streams ringattn cannot name,
 * when the device is synchronised first (a host wait).  Call with the GIL
 * held.  Without CUDA, or without a usable device, release(arg) runs at
 * once. */
void ra_cuda_release_after(int device, int shared, void (*release)(void *),
                           void *arg);
/* Run the releases whose work has completed (GIL held): called at every
 * call into ringattn that takes arrays, and after a synchronisation. */
void ra_cuda_poll_releases(void);
/* Wait for the work of every pending release and run them all (GIL held;
 * at exit: the one host wait of this scheme). */
void ra_cuda_drain_releases(void);
long ra_cuda_pending_releases(void);

/* Host <-> device and device <-> device copies of contiguous bytes, ordered
 * on the compute stream; `sync` waits for completion. */
ra_status ra_cuda_memcpy(int device, void *dst, int dst_is_device,
                         const void *src, int src_is_device, size_t nbytes,
                         int sync);
ra_status ra_cuda_synchronize(int device);

/* A kernel launcher: queue the work `params` describes on `stream` (a
 * cudaStream_t) and return.  Callers adapt cuda/'s extern "C" launchers to
 * this shape. */
typedef ra_status (*ra_cuda_launcher)(const void *params, void *stream);

/* Run `launch(params, stream)` on `device`'s compute stream with the device
 * made current around it and the GIL released (call it holding the GIL).
 * Without CUDA: RA_ERR_UNSUPPORTED before `launch` is looked at (it may be
 * NULL there). */
ra_status ra_cuda_launch(int device, ra_cuda_launcher launch,
                         const void *params);

/* Make `device` current for a kernel launch (the launchers in cuda/ launch
 * on the current device; their `stream` must belong to it), keeping the
 * caller's device in *prev; ra_cuda_leave_device(device, prev) restores
 * it. */
ra_status ra_cuda_enter_device(int device, int *prev);
void ra_cuda_leave_device(int device, int prev);

/* The one mapping of a cudaError_t (as int) to an ra_status with an
 * ra_set_error message naming `what` and the source location (cuda/'s
 * CUDA_CHECK reports through it too). */
ra_status ra_cuda_status(int err, const char *what, const char *file,
                         int line);

#ifdef __cplusplus
}
#endif
#endif /* RA_CUDA_RT_H */
