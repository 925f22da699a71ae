/*
 * alloc.c -- host allocation for everything ringattn owns, and the per
 * device-kind statistics behind ra.memory_stats().  No Python here: these run
 * with or without the GIL, from any thread.
 */
#include "core/ra_common.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static _Atomic int64_t ra_mem_current[RA_MEMKIND_COUNT];
static _Atomic int64_t ra_mem_peak[RA_MEMKIND_COUNT];
static _Atomic int64_t ra_mem_allocs[RA_MEMKIND_COUNT];

void ra_memstats_add(int kind, int64_t nbytes) {
    if (kind < 0 || kind >= RA_MEMKIND_COUNT) return;
    int64_t now = atomic_fetch_add(&ra_mem_current[kind], nbytes) + nbytes;
    if (nbytes > 0) {
        atomic_fetch_add(&ra_mem_allocs[kind], 1);
        int64_t peak = atomic_load(&ra_mem_peak[kind]);
        while (now > peak &&
               !atomic_compare_exchange_weak(&ra_mem_peak[kind], &peak, now)) {
        }
    }
}

void ra_memstats_get(int kind, int64_t *current, int64_t *peak,
                     int64_t *n_allocs) {
    if (kind < 0 || kind >= RA_MEMKIND_COUNT) {
        *current = *peak = *n_allocs = 0;
        return;
    }
    *current = atomic_load(&ra_mem_current[kind]);
    *peak = atomic_load(&ra_mem_peak[kind]);
    *n_allocs = atomic_load(&ra_mem_allocs[kind]);
}

void ra_memstats_reset_peak(int kind) {
    if (kind < 0 || kind >= RA_MEMKIND_COUNT) return;
    atomic_store(&ra_mem_peak[kind], atomic_load(&ra_mem_current[kind]));
}

void *ra_host_alloc(size_t nbytes) {
    if (nbytes == 0) nbytes = 1;
    size_t rounded = (nbytes + RA_HOST_ALIGN - 1) & ~(size_t)(RA_HOST_ALIGN - 1);
    if (rounded < nbytes) {
        ra_set_error(RA_ERR_NOMEM, "allocation of %zu bytes overflows", nbytes);
        return NULL;
    }
    void *p = aligned_alloc(RA_HOST_ALIGN, rounded);
    if (p == NULL) {
        ra_set_error(RA_ERR_NOMEM, "out of host memory allocating %zu bytes",
                     nbytes);
        return NULL;
    }
    ra_memstats_add(RA_MEMKIND_HOST, (int64_t)nbytes);
    return p;
}

void *ra_host_calloc(size_t nbytes) {
    void *p = ra_host_alloc(nbytes);
    if (p != NULL) memset(p, 0, nbytes);
    return p;
}

void ra_host_free(void *ptr, size_t nbytes) {
    if (ptr == NULL) return;
    if (nbytes == 0) nbytes = 1;
    free(ptr);
    ra_memstats_add(RA_MEMKIND_HOST, -(int64_t)nbytes);
}
