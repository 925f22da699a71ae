/*
 * test_nccl_standin.h -- what the stand-in NCCL's test programs share:
 *
 * - a fake emulated CUDA runtime (test_nccl_standin_rt.c) for testing the
 *   stand-in (csrc/emu/nccl/) on its own: streams are in-order queues with
 *   a worker thread each, "device memory" is malloc'd ranges registered
 *   with a device number, mark_init counts bytes.  Its ra_emu_rt_table is
 *   what comm/nccl_loader.c hands the library in a real emulated build;
 * - checks, byte patterns, making communicators and forking ranks;
 * - the scenarios of test_nccl_standin_api.c and _fake.c.
 */
#ifndef TEST_NCCL_STANDIN_H
#define TEST_NCCL_STANDIN_H

#include "emu/nccl/standin.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct fake_stream fake_stream;

extern const ra_emu_rt_table fake_rt;

fake_stream *fake_stream_new(int device);
/* Wait until everything queued so far has run. */
void fake_stream_sync(fake_stream *s);
/* 1 when nothing is queued or running. */
int fake_stream_idle(fake_stream *s);
/* Queue a job that holds the stream until fake_stream_release. */
void fake_stream_hold(fake_stream *s);
void fake_stream_release(fake_stream *s);
void fake_stream_free(fake_stream *s);

void fake_set_device(int device);            /* the thread's current device */
void *fake_dev_alloc(int device, size_t n);  /* registered "device memory" */
void fake_dev_free(void *p);
unsigned long long fake_marked_bytes(void);  /* total of mark_init */

/* descriptors and threads of this process (leak checks) */
int fake_count_fds(void);
int fake_count_threads(void);

/* ---- checks and helpers ---- */

extern int my_rank;   /* in messages; -1 in the parent */

#define CHECK(cond, ...)                                                      \
    do {                                                                      \
        if (!(cond)) {                                                        \
            fprintf(stderr, "rank %d: FAIL %s:%d: %s: ", my_rank, __FILE__,   \
                    __LINE__, #cond);                                         \
            fprintf(stderr, __VA_ARGS__);                                     \
            fprintf(stderr, "\n");                                            \
            exit(1);                                                          \
        }                                                                     \
    } while (0)

#define NCCL_OK(call)                                                         \
    do {                                                                      \
        ncclResult_t r_ = (call);                                             \
        CHECK(r_ == ncclSuccess || r_ == ncclInProgress, "%s -> %d (%s)",     \
              #call, (int)r_, ncclGetLastError(NULL));                        \
    } while (0)

double now_s(void);
void sleep_ms(int ms);
/* byte i of the message src -> dst in iteration it */
void fill(uint8_t *p, size_t n, int src, int dst, int it);
size_t first_bad(const uint8_t *p, size_t n, int src, int dst, int it);
/* the comm's async state once it left ncclInProgress (or after limit_s) */
ncclResult_t settle(ncclComm_t c, double limit_s);
/* the comm's async error once it has one (ncclSuccess after limit_s) */
ncclResult_t wait_error(ncclComm_t c, double limit_s);
/* a ready communicator of `world` ranks on `device`, blocking init or not */
ncclComm_t make_comm(ncclUniqueId id, int world, int rank, int device,
                     int blocking);
/* ncclGroupEnd, then settle if it said ncclInProgress */
void group_end(ncclComm_t c);
/* finalize (and settle), destroy */
void close_comm(ncclComm_t c);

typedef int (*rank_fn)(int rank, int world, ncclUniqueId id, const char *arg);
/* Fork `world` ranks running fn (after raEmuNcclBind(&fake_rt)); 0 if
 * each exited 0 (or, for the ranks in `killed_mask`, died of SIGKILL).
 * All are killed after `limit_s`. */
int run_ranks(int world, rank_fn fn, const char *arg, unsigned killed_mask,
              double limit_s);

/* ---- scenarios of the other files ---- */

int api_checks(void);                        /* test_nccl_standin_api.c */
int fake_peer_scenario(const char *mode);    /* test_nccl_standin_fake.c */

#endif
