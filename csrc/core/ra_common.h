/*
 * ra_common.h -- types, status codes and helpers shared by every C file of
 * the ringattn core.  Nothing here touches Python: kernels, transports and
 * allocators return an ra_status and leave a message with ra_set_error();
 * core/errors.c turns that pair into a Python exception in one place.
 */
#ifndef RA_COMMON_H
#define RA_COMMON_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status codes ------------------------------------------------------ */
typedef enum ra_status {
    RA_OK = 0,
    RA_ERR_NOMEM,      /* MemoryError */
    RA_ERR_VALUE,      /* ValueError: shapes, lengths, layouts */
    RA_ERR_TYPE,       /* TypeError: dtypes */
    RA_ERR_BUFFER,     /* BufferError: DLPack export/import */
    RA_ERR_OVERFLOW,   /* OverflowError / ValueError: sizes that overflow */
    RA_ERR_CUDA,       /* RuntimeError: CUDA runtime failure */
    RA_ERR_NCCL,       /* CommError: NCCL failure */
    RA_ERR_COMM,       /* CommError: transport failure, dead peer */
    RA_ERR_TIMEOUT,    /* CommError: a deadline passed */
    RA_ERR_SYSTEM,     /* OSError: a system call failed (errno kept) */
    RA_ERR_UNSUPPORTED,/* RuntimeError / NotImplementedError */
    RA_ERR_INTERNAL    /* RuntimeError: a bug */
} ra_status;

/* Thread-local error message for the last failing call on this thread. */
void ra_set_error(ra_status st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
const char *ra_last_error(void);
void ra_clear_error(void);

/* Messages hold user and peer text (an abort reason, say) and are cut to
 * fixed buffers: a cut never splits a UTF-8 character.  ra_utf8_cut: the
 * length of the longest prefix of s[0..n) that ends on a character
 * boundary (n, unless s ends inside a multi-byte sequence).  ra_snprintf:
 * snprintf whose cut is one (the return value is vsnprintf's). */
size_t ra_utf8_cut(const char *s, size_t n);
int ra_snprintf(char *dst, size_t cap, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* CHECK: return the status of a failing call.  CHECKGOTO: keep the status in
 * `st` and jump to a cleanup label. */
#define RA_CHECK(call)                                                        \
    do {                                                                      \
        ra_status ra_check_st_ = (call);                                      \
        if (ra_check_st_ != RA_OK) return ra_check_st_;                       \
    } while (0)
#define RA_CHECKGOTO(call, st, label)                                         \
    do {                                                                      \
        (st) = (call);                                                        \
        if ((st) != RA_OK) goto label;                                        \
    } while (0)

/* ---- dtypes ------------------------------------------------------------ */
/* The element types ringattn computes with.  Other DLPack types may sit in a
 * Buffer (so that errors can name them) but no kernel accepts them. */
typedef enum ra_dtype {
    RA_FLOAT32 = 0,
    RA_FLOAT64 = 1,
    RA_FLOAT16 = 2,
    RA_BFLOAT16 = 3,
    RA_DTYPE_OTHER = 15
} ra_dtype;

static inline size_t ra_dtype_size(ra_dtype t) {
    switch (t) {
    case RA_FLOAT32: return 4;
    case RA_FLOAT64: return 8;
    case RA_FLOAT16: return 2;
    case RA_BFLOAT16: return 2;
    default: return 0;
    }
}
const char *ra_dtype_name(ra_dtype t);

/* dtype of arithmetic state (running max/sum, accumulators, lse) */
static inline ra_dtype ra_acc_dtype(ra_dtype t) {
    return t == RA_FLOAT64 ? RA_FLOAT64 : RA_FLOAT32;
}

/* ---- devices ----------------------------------------------------------- */
/* Values are DLPack's DLDeviceType codes. */
typedef enum ra_device_type {
    RA_DEV_CPU = 1,
    RA_DEV_CUDA = 2,
    RA_DEV_CUDA_HOST = 3,
    RA_DEV_CUDA_MANAGED = 13
} ra_device_type;

/* ---- host memory ------------------------------------------------------- */
/* Every byte ringattn allocates goes through these so that memory_stats()
 * sees it.  Safe without the GIL.  Host blocks are 64-byte aligned. */
#define RA_HOST_ALIGN 64
void *ra_host_alloc(size_t nbytes);          /* NULL + ra_set_error on failure */
void *ra_host_calloc(size_t nbytes);
void ra_host_free(void *ptr, size_t nbytes); /* nbytes as passed to alloc */

/* Statistics per device kind: index 0 = host, 1 = cuda. */
enum { RA_MEMKIND_HOST = 0, RA_MEMKIND_CUDA = 1, RA_MEMKIND_COUNT = 2 };
void ra_memstats_add(int kind, int64_t nbytes);  /* + alloc, - free */
void ra_memstats_get(int kind, int64_t *current, int64_t *peak,
                     int64_t *n_allocs);
void ra_memstats_reset_peak(int kind);

/* ---- small helpers ----------------------------------------------------- */
/* a*b with overflow detection; returns 0 on overflow */
static inline int ra_mul_ok(int64_t a, int64_t b, int64_t *out) {
#if defined(__GNUC__)
    return !__builtin_mul_overflow(a, b, out);
#else
    if (a != 0 && b > INT64_MAX / a) return 0;
    *out = a * b;
    return 1;
#endif
}

/* Thread count for CPU kernels: RINGATTN_NUM_THREADS, else OpenMP's default.
 * `requested` > 0 overrides both.  Never more than RA_MAX_THREADS (a team
 * of billions would abort the OpenMP runtime). */
#define RA_MAX_THREADS 4096
int ra_cpu_num_threads(int requested);
/* Threads for a call of about `work` flops: ra_cpu_num_threads(requested),
 * fewer for small calls so that waking a team never costs more than the
 * work it shares (and oversubscribed ranks do not spin on tiny blocks). */
int ra_cpu_threads_for(int requested, double work);

/* Monotonic clock in seconds. */
double ra_now(void);

#ifdef __cplusplus
}
#endif
#endif /* RA_COMMON_H */
