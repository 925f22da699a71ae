/*
 * nccl_loader.h -- the NCCL library, opened with dlopen at first use
 * (nccl_loader.c): its function table and the error text of its results.
 * Internal to the nccl backend (nccl_loader.c, comm_nccl*.c).
 */
#ifndef RA_NCCL_LOADER_H
#define RA_NCCL_LOADER_H

#include "comm/comm.h"

/* The backend is compiled when the CUDA part is and setup.py found nccl.h
 * (the toolkit, NCCL_HOME, the system, or the NVIDIA pip wheel's
 * nvidia/nccl/include); the build defines RA_NO_NCCL_HEADERS otherwise.
 * Only the declarations come from nccl.h: the library is opened at run
 * time. */
#if defined(RA_WITH_CUDA) && !defined(RA_NO_NCCL_HEADERS)
#define RA_WITH_NCCL 1
#endif

#ifdef RA_WITH_CUDA
#define RA_NCCL_NO_CUDA_MSG                                                   \
    "ringattn was built without NCCL's header nccl.h, so without the nccl "   \
    "backend: pip install nvidia-nccl-cu13 (CUDA 13) or nvidia-nccl-cu12 "    \
    "(CUDA 12), or set NCCL_HOME, then reinstall ringattn"
#else
#define RA_NCCL_NO_CUDA_MSG                                                   \
    "ringattn was built without CUDA: the nccl backend needs a CUDA build "   \
    "(RINGATTN_CUDA=1 with a CUDA toolkit)"
#endif

#ifdef RA_WITH_NCCL

#include <nccl.h>

typedef struct ra_nccl_api {
    __typeof__(ncclGetVersion) *GetVersion;
    __typeof__(ncclGetUniqueId) *GetUniqueId;
    __typeof__(ncclCommInitRankConfig) *CommInitRankConfig;
    __typeof__(ncclCommGetAsyncError) *CommGetAsyncError;
    __typeof__(ncclCommAbort) *CommAbort;
    __typeof__(ncclCommFinalize) *CommFinalize;
    __typeof__(ncclCommDestroy) *CommDestroy;
    __typeof__(ncclGroupStart) *GroupStart;
    __typeof__(ncclGroupEnd) *GroupEnd;
    __typeof__(ncclSend) *Send;
    __typeof__(ncclRecv) *Recv;
    __typeof__(ncclGetErrorString) *GetErrorString;
    __typeof__(ncclGetLastError) *GetLastError;   /* optional (NCCL < 2.13) */
} ra_nccl_api;

/* Filled by ra_nccl_load; read-only afterwards. */
extern ra_nccl_api ra_nccl_lib;

/* Open NCCL once per process ($RINGATTN_NCCL_LIBRARY, "libnccl.so.2",
 * then `fallback`); later calls return at once.  On failure the error
 * names every path tried and why it did not do. */
ra_status ra_nccl_load(const char *fallback);

/* "<error string> (<NCCL's last error>)" of `r` into buf[n]. */
void ra_nccl_describe(ncclResult_t r, ncclComm_t comm, char *buf, size_t n);

#else /* !RA_WITH_NCCL */

static inline ra_status ra_nccl_unsupported(void) {
    ra_set_error(RA_ERR_UNSUPPORTED, "%s", RA_NCCL_NO_CUDA_MSG);
    return RA_ERR_UNSUPPORTED;
}

#endif /* RA_WITH_NCCL */
#endif /* RA_NCCL_LOADER_H */
