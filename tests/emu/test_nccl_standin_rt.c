/*
 * test_nccl_standin_rt.c -- the fake emulated runtime and the helpers of
 * test_nccl_standin.h (for the stand-in NCCL's own tests).
 */
#define _GNU_SOURCE
#include "test_nccl_standin.h"

#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- streams --------------------------------------------------------------- */

typedef struct job {
    int (*fn)(void *);
    void *arg;
    struct job *next;
} job;

struct fake_stream {
    int device;
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    job *head, *tail;
    int busy, stop, held;
    int err;
};

static void *stream_main(void *arg) {
    fake_stream *s = (fake_stream *)arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (s->head == NULL && !s->stop) pthread_cond_wait(&s->cv, &s->mu);
        if (s->head == NULL) break;
        job *j = s->head;
        s->head = j->next;
        if (s->head == NULL) s->tail = NULL;
        s->busy = 1;
        pthread_mutex_unlock(&s->mu);
        int e = j->fn(j->arg);
        free(j);
        pthread_mutex_lock(&s->mu);
        if (e != 0 && s->err == 0) s->err = e;
        s->busy = 0;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

fake_stream *fake_stream_new(int device) {
    fake_stream *s = calloc(1, sizeof *s);
    s->device = device;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_create(&s->th, NULL, stream_main, s);
    return s;
}

static int fake_enqueue(void *stream, int (*fn)(void *), void *arg) {
    fake_stream *s = (fake_stream *)stream;
    if (s == NULL) return 400;   /* cudaErrorInvalidResourceHandle */
    job *j = calloc(1, sizeof *j);
    if (j == NULL) return 2;
    j->fn = fn;
    j->arg = arg;
    pthread_mutex_lock(&s->mu);
    if (s->tail) s->tail->next = j;
    else s->head = j;
    s->tail = j;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

void fake_stream_sync(fake_stream *s) {
    pthread_mutex_lock(&s->mu);
    while (s->head != NULL || s->busy) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

int fake_stream_idle(fake_stream *s) {
    pthread_mutex_lock(&s->mu);
    int idle = s->head == NULL && !s->busy;
    pthread_mutex_unlock(&s->mu);
    return idle;
}

static int hold_job(void *arg) {
    fake_stream *s = (fake_stream *)arg;
    pthread_mutex_lock(&s->mu);
    while (s->held) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

void fake_stream_hold(fake_stream *s) {
    pthread_mutex_lock(&s->mu);
    s->held = 1;
    pthread_mutex_unlock(&s->mu);
    fake_enqueue(s, hold_job, s);
}

void fake_stream_release(fake_stream *s) {
    pthread_mutex_lock(&s->mu);
    s->held = 0;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

void fake_stream_free(fake_stream *s) {
    fake_stream_sync(s);
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->th, NULL);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static int fake_stream_device(void *stream) {
    return stream ? ((fake_stream *)stream)->device : -1;
}

/* ---- devices and memory ------------------------------------------------------ */

static __thread int cur_device;

void fake_set_device(int device) { cur_device = device; }

static int fake_current_device(void) { return cur_device; }

#define MAX_RANGES 256
static struct { char *p; size_t n; int device; } ranges[MAX_RANGES];
static pthread_mutex_t ranges_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic unsigned long long marked;

void *fake_dev_alloc(int device, size_t n) {
    char *p = malloc(n ? n : 1);
    pthread_mutex_lock(&ranges_mu);
    for (int i = 0; i < MAX_RANGES; i++)
        if (ranges[i].p == NULL) {
            ranges[i].p = p;
            ranges[i].n = n;
            ranges[i].device = device;
            break;
        }
    pthread_mutex_unlock(&ranges_mu);
    return p;
}

void fake_dev_free(void *p) {
    pthread_mutex_lock(&ranges_mu);
    for (int i = 0; i < MAX_RANGES; i++)
        if (ranges[i].p == p) ranges[i].p = NULL;
    pthread_mutex_unlock(&ranges_mu);
    free(p);
}

static int fake_device_of(const void *p, size_t n) {
    const char *c = (const char *)p;
    int dev = -1;
    pthread_mutex_lock(&ranges_mu);
    for (int i = 0; i < MAX_RANGES; i++)
        if (ranges[i].p != NULL && c >= ranges[i].p &&
            (size_t)(c - ranges[i].p) <= ranges[i].n &&
            n <= ranges[i].n - (size_t)(c - ranges[i].p)) {
            dev = ranges[i].device;
            break;
        }
    pthread_mutex_unlock(&ranges_mu);
    return dev;
}

static void fake_mark_init(const void *p, size_t n) {
    if (fake_device_of(p, n) < 0) {
        fprintf(stderr, "mark_init on non-device memory %p+%zu\n", p, n);
        abort();
    }
    atomic_fetch_add(&marked, (unsigned long long)n);
}

unsigned long long fake_marked_bytes(void) { return atomic_load(&marked); }

const ra_emu_rt_table fake_rt = {
    .version = RA_EMU_RT_TABLE_VERSION,
    .enqueue = fake_enqueue,
    .stream_device = fake_stream_device,
    .current_device = fake_current_device,
    .device_of = fake_device_of,
    .mark_init = fake_mark_init,
};

/* ---- leak checks ------------------------------------------------------------------ */

static int count_dir(const char *path) {
    DIR *d = opendir(path);
    if (d == NULL) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n - (strcmp(path, "/proc/self/fd") == 0);   /* opendir's own */
}

int fake_count_fds(void) { return count_dir("/proc/self/fd"); }
/* ThreadSanitizer starts threads of its own: the ASan build counts ours */
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define UNDER_TSAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__) && !defined(UNDER_TSAN)
#define UNDER_TSAN 1
#endif
int fake_count_threads(void) {
#ifdef UNDER_TSAN
    return 0;
#else
    return count_dir("/proc/self/task");
#endif
}

/* ---- helpers ---------------------------------------------------------------- */

int my_rank = -1;

double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

void sleep_ms(int ms) { poll(NULL, 0, ms); }

static uint8_t pattern(int src, int dst, int it, size_t i) {
    return (uint8_t)(src * 131 + dst * 31 + it * 7 + i * 13 + (i >> 9));
}

void fill(uint8_t *p, size_t n, int src, int dst, int it) {
    for (size_t i = 0; i < n; i++) p[i] = pattern(src, dst, it, i);
}

size_t first_bad(const uint8_t *p, size_t n, int src, int dst, int it) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != pattern(src, dst, it, i)) return i;
    return n;
}

/* Wait for the communicator's async state to leave ncclInProgress. */
ncclResult_t settle(ncclComm_t c, double limit_s) {
    double end = now_s() + limit_s;
    ncclResult_t st = ncclInProgress;
    while (now_s() < end) {
        CHECK(ncclCommGetAsyncError(c, &st) == ncclSuccess, "async query");
        if (st != ncclInProgress) return st;
        sleep_ms(1);
    }
    return st;
}

/* A communicator of `world` ranks on `device`, blocking or not. */
ncclResult_t wait_error(ncclComm_t c, double limit_s) {
    double end = now_s() + limit_s;
    ncclResult_t st = ncclSuccess;
    while (now_s() < end) {
        CHECK(ncclCommGetAsyncError(c, &st) == ncclSuccess, "async query");
        if (st != ncclSuccess && st != ncclInProgress) return st;
        sleep_ms(1);
    }
    return ncclSuccess;
}

ncclComm_t make_comm(ncclUniqueId id, int world, int rank, int device,
                            int blocking) {
    ncclComm_t c = NULL;
    fake_set_device(device);
    if (blocking) {
        NCCL_OK(ncclCommInitRank(&c, world, id, rank));
    } else {
        ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
        cfg.blocking = 0;
        ncclResult_t r = ncclCommInitRankConfig(&c, world, id, rank, &cfg);
        CHECK(r == ncclInProgress || (world == 1 && r == ncclSuccess),
              "non-blocking init returned %d", (int)r);
        CHECK(settle(c, 20) == ncclSuccess, "init did not settle: %s",
              ncclGetLastError(c));
    }
    int n = -1, me = -1, dev = -1;
    NCCL_OK(ncclCommCount(c, &n));
    NCCL_OK(ncclCommUserRank(c, &me));
    NCCL_OK(ncclCommCuDevice(c, &dev));
    CHECK(n == world && me == rank && dev == device, "%d %d %d", n, me, dev);
    return c;
}

/* GroupEnd that may say ncclInProgress; then the comm must settle. */
void group_end(ncclComm_t c) {
    ncclResult_t r = ncclGroupEnd();
    CHECK(r == ncclSuccess || r == ncclInProgress, "group end %d: %s", (int)r,
          ncclGetLastError(c));
    if (r == ncclInProgress)
        CHECK(settle(c, 5) == ncclSuccess, "group did not settle");
}

void close_comm(ncclComm_t c) {
    ncclResult_t r = ncclCommFinalize(c);
    CHECK(r == ncclSuccess || r == ncclInProgress, "finalize %d", (int)r);
    if (r == ncclInProgress) CHECK(settle(c, 20) == ncclSuccess, "finalize");
    NCCL_OK(ncclCommDestroy(c));
}

/* ---- process orchestration ----------------------------------------------------- */

/* Fork `world` ranks running fn; 0 if each exited 0 (or, for the ranks in
 * `killed_mask`, died of SIGKILL).  All are killed after `limit_s`. */
int run_ranks(int world, rank_fn fn, const char *arg,
                     unsigned killed_mask, double limit_s) {
    ncclUniqueId id;
    if (ncclGetUniqueId(&id) != ncclSuccess) return 1;
    pid_t pids[8];
    fflush(NULL);
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            my_rank = r;
            if (raEmuNcclBind(&fake_rt) != 0) exit(3);
            exit(fn(r, world, id, arg));
        }
    }
    int bad = 0, left = world;
    double end = now_s() + limit_s;
    while (left > 0) {
        int status;
        pid_t p = waitpid(-1, &status, WNOHANG);
        if (p == 0) {
            if (now_s() > end) {
                fprintf(stderr, "timeout: killing the ranks\n");
                for (int r = 0; r < world; r++) kill(pids[r], SIGKILL);
                end = now_s() + 1e9;
                bad = 1;
            }
            sleep_ms(5);
            continue;
        }
        if (p < 0) break;
        left--;
        int r = 0;
        while (r < world && pids[r] != p) r++;
        int ok = (WIFEXITED(status) && WEXITSTATUS(status) == 0) ||
                 ((killed_mask >> r & 1) && WIFSIGNALED(status) &&
                  WTERMSIG(status) == SIGKILL);
        if (!ok) {
            fprintf(stderr, "rank %d ended with status 0x%x\n", r, status);
            bad = 1;
        }
    }
    return bad;
}

