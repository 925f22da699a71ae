/*
 * status.c -- the thread-local "last error" that C code leaves beside a
 * failing ra_status, plus small process-wide helpers (thread count, clock,
 * dtype names).  Python-free: errors.c does the mapping to exceptions.
 */
#include "core/ra_common.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static _Thread_local char ra_error_buf[1024];

size_t ra_utf8_cut(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t j = n;
    /* back over at most 3 continuation bytes to the sequence's lead */
    while (j > 0 && n - j < 3 && (u[j - 1] & 0xC0) == 0x80) j--;
    if (j == 0) return n;
    const unsigned char lead = u[j - 1];
    if (lead < 0xC0) return n;             /* ASCII or a stray byte: as is */
    const size_t len = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
    return j - 1 + len > n ? j - 1 : n;    /* incomplete: cut before it */
}

static int vformat(char *dst, size_t cap, const char *fmt, va_list ap) {
    const int k = vsnprintf(dst, cap, fmt, ap);
    if (cap > 0 && k >= 0 && (size_t)k >= cap)
        dst[ra_utf8_cut(dst, cap - 1)] = '\0';
    return k;
}

int ra_snprintf(char *dst, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const int k = vformat(dst, cap, fmt, ap);
    va_end(ap);
    return k;
}

void ra_set_error(ra_status st, const char *fmt, ...) {
    (void)st;
    va_list ap;
    va_start(ap, fmt);
    vformat(ra_error_buf, sizeof ra_error_buf, fmt, ap);
    va_end(ap);
}

const char *ra_last_error(void) { return ra_error_buf; }

void ra_clear_error(void) { ra_error_buf[0] = '\0'; }

const char *ra_dtype_name(ra_dtype t) {
    switch (t) {
    case RA_FLOAT32: return "float32";
    case RA_FLOAT64: return "float64";
    case RA_FLOAT16: return "float16";
    case RA_BFLOAT16: return "bfloat16";
    default: return "unsupported";
    }
}

int ra_cpu_num_threads(int requested) {
    if (requested > RA_MAX_THREADS) return RA_MAX_THREADS;
    if (requested > 0) return requested;
    const char *env = getenv("RINGATTN_NUM_THREADS");
    if (env != NULL && *env != '\0') {
        char *end = NULL;
        long n = strtol(env, &end, 10);
        if (end != env && n > 0 && n <= RA_MAX_THREADS) return (int)n;
    }
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

int ra_cpu_threads_for(int requested, double work) {
    int nt = ra_cpu_num_threads(requested);
    /* ~4 MFLOP per thread: well above the cost of starting a team */
    double cap = work / 4.0e6;
    if (cap < 1.0) return 1;
    if (cap < (double)nt) nt = (int)cap;
    return nt < 1 ? 1 : nt;
}

double ra_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
