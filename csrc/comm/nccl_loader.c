/*
 * nccl_loader.c -- the NCCL library, resolved at run time, and the two
 * entry points that need nothing but the library (ra_nccl_version,
 * ra_nccl_unique_id).
 *
 * libnccl is opened with dlopen at first use, never linked, so importing
 * ringattn works where NCCL is missing.  Tried in order:
 * $RINGATTN_NCCL_LIBRARY, "libnccl.so.2", then a path the Python layer
 * found (the NVIDIA pip wheel's nvidia/nccl/lib/libnccl.so.2).  Every
 * symbol the backend calls is looked up at once, so an NCCL too old for
 * it is refused with the missing name.
 *
 * On the emulated GPU (RA_CUDA_EMULATED) the library is ringattn's
 * stand-in NCCL (csrc/emu/nccl, ringattn/_emu_nccl*.so, whose path the
 * Python layer passes as the fallback): "libnccl.so.2" is never tried (a
 * real NCCL would look for a real GPU), and the library gets the emulated
 * runtime's table through its raEmuNcclBind right after dlopen.
 */
#include "comm/nccl_loader.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef RA_WITH_NCCL

#include <cuda_runtime_api.h>    /* CUDART_VERSION: the wheel to name */
#include <dlfcn.h>

#ifdef RA_CUDA_EMULATED
#include "emu/emu.h"             /* ra_emu_runtime_table */
#endif

/* The NVIDIA wheel that carries an NCCL for the CUDA major version this
 * build's runtime belongs to (the wheels are per CUDA major). */
#if CUDART_VERSION >= 13000
#define RA_NCCL_WHEEL "nvidia-nccl-cu13"
#elif CUDART_VERSION >= 12000
#define RA_NCCL_WHEEL "nvidia-nccl-cu12"
#else
#define RA_NCCL_WHEEL "nvidia-nccl-cu11"
#endif
#define RA_STR2(x) #x
#define RA_STR(x) RA_STR2(x)

_Static_assert(NCCL_UNIQUE_ID_BYTES == RA_NCCL_ID_BYTES,
               "RA_NCCL_ID_BYTES must match NCCL_UNIQUE_ID_BYTES");

ra_nccl_api ra_nccl_lib;
static pthread_mutex_t api_mu = PTHREAD_MUTEX_INITIALIZER;
static void *api_handle;

/* Resolve every symbol of `h` into *a; on a missing one name it in `why`. */
static int resolve_api(void *h, ra_nccl_api *a, char *why, size_t n) {
    struct { const char *name; void **slot; int required; } syms[] = {
        {"ncclGetVersion", (void **)&a->GetVersion, 1},
        {"ncclGetUniqueId", (void **)&a->GetUniqueId, 1},
        {"ncclCommInitRankConfig", (void **)&a->CommInitRankConfig, 1},
        {"ncclCommGetAsyncError", (void **)&a->CommGetAsyncError, 1},
        {"ncclCommAbort", (void **)&a->CommAbort, 1},
        {"ncclCommFinalize", (void **)&a->CommFinalize, 1},
        {"ncclCommDestroy", (void **)&a->CommDestroy, 1},
        {"ncclGroupStart", (void **)&a->GroupStart, 1},
        {"ncclGroupEnd", (void **)&a->GroupEnd, 1},
        {"ncclSend", (void **)&a->Send, 1},
        {"ncclRecv", (void **)&a->Recv, 1},
        {"ncclGetErrorString", (void **)&a->GetErrorString, 1},
        {"ncclGetLastError", (void **)&a->GetLastError, 0},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        *syms[i].slot = dlsym(h, syms[i].name);
        if (*syms[i].slot == NULL && syms[i].required) {
            snprintf(why, n, "has no symbol %s (NCCL >= 2.14 is needed)",
                     syms[i].name);
            return -1;
        }
    }
#ifdef RA_CUDA_EMULATED
    /* the stand-in reaches the emulated streams through this table */
    int (*bind)(const ra_emu_rt_table *) =
        (int (*)(const ra_emu_rt_table *))dlsym(h, "raEmuNcclBind");
    if (bind == NULL) {
        snprintf(why, n, "has no symbol raEmuNcclBind: not ringattn's "
                 "stand-in NCCL, which the emulated GPU needs");
        return -1;
    }
    if (bind(ra_emu_runtime_table()) != 0) {
        snprintf(why, n, "refused the emulated runtime's table (version %d): "
                 "the stand-in NCCL was built from other sources than "
                 "ringattn._C", RA_EMU_RT_TABLE_VERSION);
        return -1;
    }
#endif
    return 0;
}

ra_status ra_nccl_load(const char *fallback) {
    pthread_mutex_lock(&api_mu);
    if (api_handle != NULL) {
        pthread_mutex_unlock(&api_mu);
        return RA_OK;
    }
    const char *env = getenv("RINGATTN_NCCL_LIBRARY");
#ifdef RA_CUDA_EMULATED
    const char *candidates[3] = {env, fallback, NULL};
#else
    const char *candidates[3] = {env, "libnccl.so.2", fallback};
#endif
    char tried[1024] = "";
    size_t used = 0;
    for (int i = 0; i < 3; i++) {
        const char *path = candidates[i];
        if (path == NULL || *path == '\0') continue;
        char why[256];
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (h == NULL) {
            const char *e = dlerror();
            snprintf(why, sizeof why, "%s", e ? e : "cannot be opened");
        } else {
            ra_nccl_api a;
            memset(&a, 0, sizeof a);
            if (resolve_api(h, &a, why, sizeof why) == 0) {
                ra_nccl_lib = a;
                api_handle = h;
                pthread_mutex_unlock(&api_mu);
                return RA_OK;
            }
            dlclose(h);
        }
        int k = snprintf(tried + used, sizeof tried - used, "%s%s: %s",
                         used ? "; " : "", path, why);
        if (k > 0) used += (size_t)k;
        if (used >= sizeof tried) used = sizeof tried - 1;
    }
    pthread_mutex_unlock(&api_mu);
#ifdef RA_CUDA_EMULATED
    ra_set_error(RA_ERR_NCCL,
                 "cannot load the emulated GPU's stand-in NCCL for the 'nccl' "
                 "backend; tried %s. It is ringattn/_emu_nccl*.so of a "
                 "RINGATTN_CUDA=emulate build (or set RINGATTN_NCCL_LIBRARY "
                 "to its path)", used ? tried : "nothing (no candidate path)");
#else
    ra_set_error(RA_ERR_NCCL,
                 "cannot load NCCL for the 'nccl' backend; tried %s. Install "
                 "it (pip install " RA_NCCL_WHEEL ": ringattn was built "
                 "with CUDA runtime " RA_STR(CUDART_VERSION) "; "
                 "nvidia-nccl-cu13 is for CUDA 13, nvidia-nccl-cu12 for "
                 "CUDA 12) or set RINGATTN_NCCL_LIBRARY to the path of "
                 "libnccl.so.2",
                 used ? tried : "nothing (no candidate path)");
#endif
    return RA_ERR_NCCL;
}

void ra_nccl_describe(ncclResult_t r, ncclComm_t comm, char *buf,
                      size_t n) {
    const char *what = ra_nccl_lib.GetErrorString(r);
    const char *last =
        ra_nccl_lib.GetLastError ? ra_nccl_lib.GetLastError(comm) : NULL;
    if (last != NULL && *last != '\0')
        snprintf(buf, n, "%s (%s)", what ? what : "unknown", last);
    else
        snprintf(buf, n, "%s", what ? what : "unknown NCCL error");
}

ra_status ra_nccl_version(const char *library, int *major, int *minor,
                          int *patch) {
    RA_CHECK(ra_nccl_load(library));
    int code = 0;
    ncclResult_t r = ra_nccl_lib.GetVersion(&code);
    if (r != ncclSuccess) {
        char d[256];
        ra_nccl_describe(r, NULL, d, sizeof d);
        ra_set_error(RA_ERR_NCCL, "ncclGetVersion failed: %s", d);
        return RA_ERR_NCCL;
    }
    /* NCCL_VERSION(X, Y, Z): X*1000 + Y*100 + Z before 2.9, X*10000 +
     * Y*100 + Z since */
    if (code >= 10000) {
        *major = code / 10000;
        *minor = (code % 10000) / 100;
    } else {
        *major = code / 1000;
        *minor = (code % 1000) / 100;
    }
    *patch = code % 100;
    return RA_OK;
}

ra_status ra_nccl_unique_id(const char *library,
                            unsigned char out[RA_NCCL_ID_BYTES]) {
    RA_CHECK(ra_nccl_load(library));
    ncclUniqueId id;
    ncclResult_t r = ra_nccl_lib.GetUniqueId(&id);
    if (r != ncclSuccess) {
        char d[256];
        ra_nccl_describe(r, NULL, d, sizeof d);
        ra_set_error(RA_ERR_NCCL, "ncclGetUniqueId failed: %s", d);
        return RA_ERR_NCCL;
    }
    memcpy(out, id.internal, RA_NCCL_ID_BYTES);
    return RA_OK;
}

#else /* !RA_WITH_NCCL */

ra_status ra_nccl_version(const char *library, int *major, int *minor,
                          int *patch) {
    (void)library;
    *major = *minor = *patch = 0;
    return ra_nccl_unsupported();
}

ra_status ra_nccl_unique_id(const char *library,
                            unsigned char out[RA_NCCL_ID_BYTES]) {
    (void)library;
    (void)out;
    return ra_nccl_unsupported();
}

#endif /* RA_WITH_NCCL */
