/*
 * standin_comm.c -- the stand-in NCCL's communicators: unique ids, the
 * binding to the emulated runtime, version and error strings, init
 * (blocking, or non-blocking on a thread of its own), the async error,
 * finalize, abort and destroy.  See standin.h for the design and the wire.
 *
 * Teardown never waits for a peer: abort (and destroy after its flush)
 * sets `aborted`, makes the wake pipe readable, shuts the sockets down
 * (the peers see EOF at once), waits for the stream operations that are
 * inside the sockets to leave (they poll the wake pipe, so milliseconds),
 * joins the init thread and closes every descriptor.  Operations still
 * queued on a stream hold a reference and find `aborted` when they run.
 */
#define _GNU_SOURCE
#include "emu/nccl/standin.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

const ra_emu_rt_table *_Atomic si_rt;

/* ---- errors ------------------------------------------------------------------ */

static __thread char last_error[320];

void si_clear_error(void) { last_error[0] = '\0'; }

ncclResult_t si_fail(ncclResult_t r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return r;
}

void si_comm_set_error(ncclComm_t c, ncclResult_t r, const char *fmt, ...) {
    pthread_mutex_lock(&c->mu);
    if (!si_is_error(atomic_load(&c->state))) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->err, sizeof c->err, fmt, ap);
        va_end(ap);
        atomic_store(&c->state, (int)r);
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

ncclResult_t si_check_comm(ncclComm_t c, const char *fn) {
    if (c == NULL || c->magic != SI_COMM_LIVE)
        return si_fail(ncclInvalidArgument, "%s: comm is NULL or not a live "
                       "communicator (destroyed or aborted?)", fn);
    return ncclSuccess;
}

SI_EXPORT const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with "
        "NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with "
        "NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this "
        "issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with "
        "NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN "
        "for details)";
    case ncclRemoteError: return "remote process exited or there was a "
        "network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

/* The caller's own last error first; else the communicator's async error
 * (an error found on a stream's thread has no caller to tell). */
SI_EXPORT const char *ncclGetLastError(ncclComm_t comm) {
    if (last_error[0] != '\0' || comm == NULL || comm->magic != SI_COMM_LIVE)
        return last_error;
    return si_is_error(atomic_load(&comm->state)) ? comm->err : last_error;
}

/* ---- version, binding, ids --------------------------------------------------- */

/* The stand-in lets several ranks share one emulated device (with
 * NCCL_MULTI_RANK_GPU_ENABLE=1), which ringattn ties to NCCL 2.30; it
 * reports at least that version.  The ABI (config layout, result codes,
 * id size) is the compiled nccl.h's, which ringattn's C core reads too. */
#define SI_MULTI_RANK_VERSION NCCL_VERSION(2, 30, 0)
#if NCCL_VERSION_CODE >= SI_MULTI_RANK_VERSION
#define SI_VERSION NCCL_VERSION_CODE
#else
#define SI_VERSION SI_MULTI_RANK_VERSION
#endif

SI_EXPORT ncclResult_t ncclGetVersion(int *version) {
    si_clear_error();
    if (version == NULL)
        return si_fail(ncclInvalidArgument, "ncclGetVersion: version is NULL");
    *version = SI_VERSION;
    return ncclSuccess;
}

SI_EXPORT int raEmuNcclBind(const ra_emu_rt_table *t) {
    if (t == NULL || t->version != RA_EMU_RT_TABLE_VERSION ||
        t->enqueue == NULL || t->stream_device == NULL ||
        t->current_device == NULL || t->device_of == NULL ||
        t->mark_init == NULL)
        return -1;
    atomic_store(&si_rt, t);
    return 0;
}

/* FNV-1a, to turn NCCL_COMM_ID into the same id on every rank. */
static uint64_t fnv1a(const char *s, uint64_t h) {
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

SI_EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    si_clear_error();
    if (id == NULL)
        return si_fail(ncclInvalidArgument, "ncclGetUniqueId: id is NULL");
    memset(id, 0, sizeof *id);
    memcpy(id->internal, SI_ID_MAGIC, SI_ID_MAGIC_BYTES);
    uint8_t *rnd = (uint8_t *)id->internal + SI_ID_MAGIC_BYTES;
    size_t need = SI_NAME_BYTES + SI_SECRET_BYTES;
    const char *fixed = getenv("NCCL_COMM_ID");
    if (fixed != NULL && *fixed != '\0') {
        /* as NCCL: every rank derives the same id from the variable */
        for (size_t i = 0; i < need; i += 8) {
            uint64_t h = fnv1a(fixed, 0xcbf29ce484222325ull ^ (i * 0x9e37u));
            memcpy(rnd + i, &h, need - i < 8 ? need - i : 8);
        }
        return ncclSuccess;
    }
    size_t got = 0;
    while (got < need) {
        ssize_t k = getrandom(rnd + got, need - got, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0)
            return si_fail(ncclSystemError, "ncclGetUniqueId: getrandom "
                           "failed: %s", strerror(errno));
        got += (size_t)k;
    }
    return ncclSuccess;
}

/* ---- life of a communicator --------------------------------------------------- */

void si_comm_ref(ncclComm_t c) {
    pthread_mutex_lock(&c->mu);
    c->refs++;
    pthread_mutex_unlock(&c->mu);
}

static void comm_free(ncclComm_t c) {
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c->fds);
    free(c->peer_device);
    free(c->send_issued);
    free(c->recv_issued);
    free((void *)c->send_turn);
    free((void *)c->recv_turn);
    free(c);
}

void si_comm_unref(ncclComm_t c) {
    pthread_mutex_lock(&c->mu);
    int last = --c->refs == 0;
    pthread_mutex_unlock(&c->mu);
    if (last) comm_free(c);
}

static ncclComm_t comm_alloc(int nranks, int rank, int device) {
    ncclComm_t c = calloc(1, sizeof *c);
    if (c == NULL) return NULL;
    size_t n = (size_t)nranks;
    c->fds = malloc(n * sizeof *c->fds);
    c->peer_device = malloc(n * sizeof *c->peer_device);
    c->send_issued = calloc(n, sizeof *c->send_issued);
    c->recv_issued = calloc(n, sizeof *c->recv_issued);
    c->send_turn = calloc(n, sizeof *c->send_turn);
    c->recv_turn = calloc(n, sizeof *c->recv_turn);
    int mu_ok = pthread_mutex_init(&c->mu, NULL) == 0;
    int cv_ok = pthread_cond_init(&c->cv, NULL) == 0;
    if (c->fds == NULL || c->peer_device == NULL || c->send_issued == NULL ||
        c->recv_issued == NULL || c->send_turn == NULL ||
        c->recv_turn == NULL || !mu_ok || !cv_ok) {
        if (cv_ok) pthread_cond_destroy(&c->cv);
        if (mu_ok) pthread_mutex_destroy(&c->mu);
        free(c->fds);
        free(c->peer_device);
        free(c->send_issued);
        free(c->recv_issued);
        free((void *)c->send_turn);
        free((void *)c->recv_turn);
        free(c);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        c->fds[i] = -1;
        c->peer_device[i] = -1;
    }
    c->rank = rank;
    c->world = nranks;
    c->device = device;
    c->peer_device[rank] = device;
    c->refs = 1;
    c->listen_fd = -1;
    c->wake[0] = c->wake[1] = -1;
    atomic_store(&c->state, ncclInProgress);
    c->magic = SI_COMM_LIVE;
    return c;
}

/* Stop everything and close every descriptor; never waits for a peer.
 * Safe on a half-made communicator; called once, by the handle's owner. */
static void comm_teardown(ncclComm_t c) {
    pthread_mutex_lock(&c->mu);
    atomic_store(&c->aborted, 1);
    if (c->wake[1] >= 0) {
        char b = 1;
        while (write(c->wake[1], &b, 1) < 0 && errno == EINTR) {
        }
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (c->init_thread_started) {
        pthread_join(c->init_thread, NULL);
        c->init_thread_started = 0;
    }
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < c->world; i++)
        if (c->fds[i] >= 0) shutdown(c->fds[i], SHUT_RDWR);
    while (c->running > 0) pthread_cond_wait(&c->cv, &c->mu);
    for (int i = 0; i < c->world; i++)
        if (c->fds[i] >= 0) {
            close(c->fds[i]);
            c->fds[i] = -1;
        }
    if (c->listen_fd >= 0) close(c->listen_fd);
    if (c->wake[0] >= 0) close(c->wake[0]);
    if (c->wake[1] >= 0) close(c->wake[1]);
    c->listen_fd = c->wake[0] = c->wake[1] = -1;
    c->torn_down = 1;
    c->magic = 0;          /* the handle is dead; queued operations hold refs */
    pthread_mutex_unlock(&c->mu);
}

static void *init_main(void *arg) {
    ncclComm_t c = (ncclComm_t)arg;
    if (si_connect_all(c) == ncclSuccess) {
        pthread_mutex_lock(&c->mu);
        if (atomic_load(&c->state) == ncclInProgress)
            atomic_store(&c->state, ncclSuccess);
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
    }
    return NULL;
}

/* The unique id's fields, checked. */
static ncclResult_t read_id(const ncclUniqueId *id, uint8_t *name,
                            uint8_t *secret) {
    if (memcmp(id->internal, SI_ID_MAGIC, SI_ID_MAGIC_BYTES) != 0)
        return si_fail(ncclInvalidArgument, "ncclCommInitRank: the unique id "
                       "was not made by ringattn's stand-in NCCL "
                       "(ncclGetUniqueId of this library)");
    memcpy(name, id->internal + SI_ID_MAGIC_BYTES, SI_NAME_BYTES);
    memcpy(secret, id->internal + SI_ID_MAGIC_BYTES + SI_NAME_BYTES,
           SI_SECRET_BYTES);
    return ncclSuccess;
}

/* config->blocking, or 1; the config must come from NCCL_CONFIG_INITIALIZER. */
static ncclResult_t read_config(const ncclConfig_t *config, int *blocking) {
    *blocking = 1;
    if (config == NULL) return ncclSuccess;
    if (config->magic != 0xcafebeef ||
        config->size < offsetof(ncclConfig_t, blocking) + sizeof(int))
        return si_fail(ncclInvalidArgument, "ncclCommInitRankConfig: config "
                       "was not initialised with NCCL_CONFIG_INITIALIZER");
    if (config->blocking != NCCL_CONFIG_UNDEF_INT) {
        if (config->blocking != 0 && config->blocking != 1)
            return si_fail(ncclInvalidArgument, "ncclCommInitRankConfig: "
                           "config.blocking must be 0 or 1, got %d",
                           config->blocking);
        *blocking = config->blocking;
    }
    return ncclSuccess;
}

SI_EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks,
                                              ncclUniqueId commId, int rank,
                                              ncclConfig_t *config) {
    si_clear_error();
    const ra_emu_rt_table *t = atomic_load(&si_rt);
    uint8_t name[SI_NAME_BYTES] = {0}, secret[SI_SECRET_BYTES] = {0};
    int blocking = 1;
    ncclResult_t r;
    if (comm == NULL)
        return si_fail(ncclInvalidArgument, "ncclCommInitRank: comm is NULL");
    *comm = NULL;
    if (t == NULL)
        return si_fail(ncclSystemError, "ringattn's stand-in NCCL is not "
                       "bound to the emulated CUDA runtime (raEmuNcclBind "
                       "was not called)");
    if (nranks < 1 || nranks > SI_MAX_RANKS)
        return si_fail(ncclInvalidArgument, "ncclCommInitRank: nranks %d is "
                       "not in [1, %d]", nranks, SI_MAX_RANKS);
    if (rank < 0 || rank >= nranks)
        return si_fail(ncclInvalidArgument, "ncclCommInitRank: rank %d is not "
                       "in [0, %d)", rank, nranks);
    if ((r = read_id(&commId, name, secret)) != ncclSuccess) return r;
    if ((r = read_config(config, &blocking)) != ncclSuccess) return r;
    int device = t->current_device();
    if (device < 0)
        return si_fail(ncclUnhandledCudaError, "ncclCommInitRank: no current "
                       "emulated CUDA device");
    ncclComm_t c = comm_alloc(nranks, rank, device);
    if (c == NULL)
        return si_fail(ncclSystemError, "ncclCommInitRank: out of memory");
    memcpy(c->name, name, sizeof name);
    memcpy(c->secret, secret, sizeof secret);
    c->blocking = blocking;
    const char *multi = getenv("NCCL_MULTI_RANK_GPU_ENABLE");
    c->multi_rank = multi != NULL && strcmp(multi, "1") == 0;
    if (pipe2(c->wake, O_CLOEXEC | O_NONBLOCK) != 0) {
        r = si_fail(ncclSystemError, "ncclCommInitRank: pipe: %s",
                    strerror(errno));
        goto fail;
    }
    if (nranks == 1) {
        atomic_store(&c->state, ncclSuccess);
        *comm = c;
        return ncclSuccess;
    }
    /* bind at once: a rank claimed twice fails here, in the caller */
    if ((r = si_listen(c)) != ncclSuccess) goto fail;
    if (!blocking) {
        if (pthread_create(&c->init_thread, NULL, init_main, c) != 0) {
            r = si_fail(ncclSystemError, "ncclCommInitRank: cannot start the "
                        "init thread");
            goto fail;
        }
        c->init_thread_started = 1;
        *comm = c;
        return ncclInProgress;
    }
    if ((r = si_connect_all(c)) != ncclSuccess) {
        si_fail(r, "%s", c->err);
        goto fail;
    }
    atomic_store(&c->state, ncclSuccess);
    *comm = c;
    return ncclSuccess;
fail:
    comm_teardown(c);
    si_comm_unref(c);
    return r;
}

SI_EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks,
                                        ncclUniqueId commId, int rank) {
    return ncclCommInitRankConfig(comm, nranks, commId, rank, NULL);
}

SI_EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t comm,
                                             ncclResult_t *asyncError) {
    si_clear_error();
    ncclResult_t r = si_check_comm(comm, "ncclCommGetAsyncError");
    if (r != ncclSuccess) return r;
    if (asyncError == NULL)
        return si_fail(ncclInvalidArgument, "ncclCommGetAsyncError: "
                       "asyncError is NULL");
    int st = atomic_load(&comm->state);
    if (st == ncclSuccess) {
        pthread_mutex_lock(&comm->mu);
        if (comm->finalizing && comm->outstanding > 0) st = ncclInProgress;
        pthread_mutex_unlock(&comm->mu);
        if (st == ncclSuccess && atomic_exchange(&comm->settle_once, 0))
            st = ncclInProgress;
    }
    *asyncError = (ncclResult_t)st;
    return ncclSuccess;
}

/* Wait until no operation of `c` is queued or running, or c failed. */
static void flush(ncclComm_t c) {
    pthread_mutex_lock(&c->mu);
    while (c->outstanding > 0 && !si_is_error(atomic_load(&c->state)))
        pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

SI_EXPORT ncclResult_t ncclCommFinalize(ncclComm_t comm) {
    si_clear_error();
    ncclResult_t r = si_check_comm(comm, "ncclCommFinalize");
    if (r != ncclSuccess) return r;
    int st = atomic_load(&comm->state);
    if (st == ncclInProgress)
        return si_fail(ncclInvalidUsage, "ncclCommFinalize: the communicator "
                       "is still initialising");
    pthread_mutex_lock(&comm->mu);
    comm->finalizing = 1;
    int busy = comm->outstanding > 0;
    pthread_mutex_unlock(&comm->mu);
    if (!comm->blocking) return busy && !si_is_error(st) ? ncclInProgress
                                                         : ncclSuccess;
    flush(comm);
    st = atomic_load(&comm->state);
    return si_is_error(st) ? si_fail((ncclResult_t)st, "%s", comm->err)
                           : ncclSuccess;
}

SI_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    si_clear_error();
    if (comm == NULL) return ncclSuccess;
    ncclResult_t r = si_check_comm(comm, "ncclCommDestroy");
    if (r != ncclSuccess) return r;
    /* a healthy communicator delivers what was issued first (as a
     * finalize would); init in progress or a failure: nothing to wait for */
    if (atomic_load(&comm->state) == ncclSuccess) flush(comm);
    comm_teardown(comm);
    si_comm_unref(comm);
    return ncclSuccess;
}

SI_EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm) {
    si_clear_error();
    if (comm == NULL) return ncclSuccess;
    ncclResult_t r = si_check_comm(comm, "ncclCommAbort");
    if (r != ncclSuccess) return r;
    comm_teardown(comm);
    si_comm_unref(comm);
    return ncclSuccess;
}

SI_EXPORT ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
    si_clear_error();
    ncclResult_t r = si_check_comm(comm, "ncclCommCount");
    if (r != ncclSuccess) return r;
    if (count == NULL)
        return si_fail(ncclInvalidArgument, "ncclCommCount: count is NULL");
    *count = comm->world;
    return ncclSuccess;
}

SI_EXPORT ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
    si_clear_error();
    ncclResult_t r = si_check_comm(comm, "ncclCommUserRank");
    if (r != ncclSuccess) return r;
    if (rank == NULL)
        return si_fail(ncclInvalidArgument, "ncclCommUserRank: rank is NULL");
    *rank = comm->rank;
    return ncclSuccess;
}

SI_EXPORT ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
    si_clear_error();
    ncclResult_t r = si_check_comm(comm, "ncclCommCuDevice");
    if (r != ncclSuccess) return r;
    if (device == NULL)
        return si_fail(ncclInvalidArgument, "ncclCommCuDevice: device is "
                       "NULL");
    *device = comm->device;
    return ncclSuccess;
}
