/*
 * test_nccl_standin.c -- the stand-in NCCL (csrc/emu/nccl/) between real
 * processes, on the fake runtime of test_nccl_standin_rt.c.
 *
 *   test_nccl_standin SCENARIO [ARG]
 *
 * api          one process: version, ids, binding, argument and usage
 *              errors, groups, self exchange, a rank claimed twice
 * ring W       W ranks: ring exchanges of random sizes (0 B .. 3 MiB),
 *              nested groups, non-blocking and blocking init, data read
 *              when the stream reaches the op, no fd/thread left after
 * alltoall     4 ranks: every rank sends every rank (itself too) variable
 *              sizes in one (nested) group
 * killed       rank 1 is SIGKILLed while rank 0's receive waits on it
 * abort        ncclCommAbort while an op waits on a silent peer
 * mismatch     a send of 100 bytes meets a receive of 64
 * dupdev       two ranks on one device without NCCL_MULTI_RANK_GPU_ENABLE
 * fake MODE    rank 1 is a fake peer speaking the wire by hand, badly
 *
 * Exit status 0 when every check passed; each failure prints a line.
 * The ranks are fork()ed from a parent that has no threads.
 */
#define _GNU_SOURCE
#include "test_nccl_standin.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- ring ----------------------------------------------------------------------- */

static size_t ring_size(int it, int src) {
    static const size_t sizes[] = {0, 1, 4097, (3u << 20) + 5, 65536, 7};
    return sizes[(size_t)(it * 5 + src * 3) % 6];
}

static int ring_rank(int rank, int world, ncclUniqueId id, const char *arg) {
    (void)arg;
    int fds0 = fake_count_fds(), thr0 = fake_count_threads();
    int dev = rank % 2;
    fake_stream *s = fake_stream_new(dev);
    ncclComm_t c = make_comm(id, world, rank, dev, rank % 2 == 0);
    int next = (rank + 1) % world, prev = (rank + world - 1) % world;
    for (int it = 0; it < 8; it++) {
        size_t ns = ring_size(it, rank), nr = ring_size(it, prev);
        uint8_t *send = fake_dev_alloc(dev, ns), *recv = fake_dev_alloc(dev, nr);
        memset(recv, 0xee, nr);
        unsigned long long marked = fake_marked_bytes();
        int hold = it == 1;   /* the bytes are read when the stream gets there */
        if (hold) fake_stream_hold(s);
        else fill(send, ns, rank, next, it);
        NCCL_OK(ncclGroupStart());
        if (it % 2 == 0) NCCL_OK(ncclGroupStart());    /* nested */
        NCCL_OK(ncclSend(send, ns, ncclUint8, next, c, (cudaStream_t)s));
        if (it % 2 == 0) group_end(c);
        NCCL_OK(ncclRecv(recv, nr, ncclUint8, prev, c, (cudaStream_t)s));
        group_end(c);
        if (hold) {
            sleep_ms(20);
            CHECK(nr == 0 || recv[0] == 0xee, "received before the stream ran");
            fill(send, ns, rank, next, it);
            fake_stream_release(s);
        }
        fake_stream_sync(s);
        ncclResult_t st;
        NCCL_OK(ncclCommGetAsyncError(c, &st));
        CHECK(st == ncclSuccess || st == ncclInProgress, "async error %d: %s",
              (int)st, ncclGetLastError(c));
        size_t bad = first_bad(recv, nr, prev, rank, it);
        CHECK(bad == nr, "iteration %d: byte %zu of %zu from rank %d", it, bad,
              nr, prev);
        CHECK(fake_marked_bytes() - marked == nr, "mark_init %llu of %zu",
              fake_marked_bytes() - marked, nr);
        fake_dev_free(send);
        fake_dev_free(recv);
    }
    close_comm(c);
    fake_stream_free(s);
    CHECK(fake_count_fds() == fds0, "fds %d -> %d", fds0, fake_count_fds());
    CHECK(fake_count_threads() == thr0, "threads %d -> %d", thr0,
          fake_count_threads());
    return 0;
}

/* ---- all-to-all (sizes in float32 elements) ------------------------------------ */

static size_t a2a_count(int src, int dst, int it) {
    return (size_t)((src * 7 + dst * 3 + it * 11) % 5) * 3001 * (it % 2);
}

static int alltoall_rank(int rank, int world, ncclUniqueId id,
                         const char *arg) {
    (void)arg;
    fake_stream *s = fake_stream_new(0);
    ncclComm_t c = make_comm(id, world, rank, 0, rank != 2);
    for (int it = 0; it < 4; it++) {
        uint8_t *send[8], *recv[8];
        NCCL_OK(ncclGroupStart());
        for (int p = 0; p < world; p++) {
            size_t ns = a2a_count(rank, p, it) * 4, nr = a2a_count(p, rank, it) * 4;
            send[p] = fake_dev_alloc(0, ns);
            recv[p] = fake_dev_alloc(0, nr);
            fill(send[p], ns, rank, p, it);
            NCCL_OK(ncclGroupStart());
            NCCL_OK(ncclSend(send[p], ns / 4, ncclFloat32, p, c,
                             (cudaStream_t)s));
            NCCL_OK(ncclGroupEnd());
        }
        for (int k = 1; k <= world; k++) {   /* another order than the sends */
            int p = (rank + k) % world;
            NCCL_OK(ncclRecv(recv[p], a2a_count(p, rank, it), ncclFloat32, p,
                             c, (cudaStream_t)s));
        }
        group_end(c);
        fake_stream_sync(s);
        for (int p = 0; p < world; p++) {
            size_t nr = a2a_count(p, rank, it) * 4;
            size_t bad = first_bad(recv[p], nr, p, rank, it);
            CHECK(bad == nr, "it %d: byte %zu of %zu from %d", it, bad, nr, p);
            fake_dev_free(send[p]);
            fake_dev_free(recv[p]);
        }
    }
    close_comm(c);
    fake_stream_free(s);
    return 0;
}

/* ---- failures ------------------------------------------------------------------- */

/* one good exchange with the other rank of a world of 2 */
static void exchange(ncclComm_t c, fake_stream *s, int rank, size_t n) {
    uint8_t *a = fake_dev_alloc(0, n), *b = fake_dev_alloc(0, n);
    fill(a, n, rank, 1 - rank, 0);
    NCCL_OK(ncclGroupStart());
    NCCL_OK(ncclSend(a, n, ncclUint8, 1 - rank, c, (cudaStream_t)s));
    NCCL_OK(ncclRecv(b, n, ncclUint8, 1 - rank, c, (cudaStream_t)s));
    group_end(c);
    fake_stream_sync(s);
    CHECK(first_bad(b, n, 1 - rank, rank, 0) == n, "exchange");
    fake_dev_free(a);
    fake_dev_free(b);
}

static int killed_rank(int rank, int world, ncclUniqueId id, const char *arg) {
    (void)arg;
    int fds0 = fake_count_fds();
    fake_stream *s = fake_stream_new(0);
    setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 1);
    ncclComm_t c = make_comm(id, world, rank, 0, 0);
    exchange(c, s, rank, 1000);
    if (rank == 1) {
        sleep_ms(300);
        raise(SIGKILL);
    }
    size_t n = 1 << 20;
    uint8_t *b = fake_dev_alloc(0, n);
    double t0 = now_s();
    NCCL_OK(ncclRecv(b, n, ncclUint8, 1, c, (cudaStream_t)s));
    ncclResult_t st = wait_error(c, 5);
    double waited = now_s() - t0;
    CHECK(st == ncclRemoteError, "async error %d", (int)st);
    CHECK(waited < 0.3 + 1.0, "took %.2f s", waited);
    CHECK(strstr(ncclGetLastError(c), "rank 1") != NULL, "text: %s",
          ncclGetLastError(c));
    fake_stream_sync(s);   /* the op finished: the stream moved on */
    CHECK(ncclSend(b, 1, ncclUint8, 1, c, (cudaStream_t)s) == ncclRemoteError,
          "a failed communicator refuses work");
    double t1 = now_s();
    NCCL_OK(ncclCommAbort(c));
    CHECK(now_s() - t1 < 0.25, "abort took %.3f s", now_s() - t1);
    fake_dev_free(b);
    fake_stream_free(s);
    CHECK(fake_count_fds() == fds0, "fds %d -> %d", fds0, fake_count_fds());
    return 0;
}

static int abort_rank(int rank, int world, ncclUniqueId id, const char *arg) {
    (void)arg;
    setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 1);
    fake_stream *s = fake_stream_new(0), *s2 = fake_stream_new(0);
    ncclComm_t c = make_comm(id, world, rank, 0, 1);
    exchange(c, s, rank, 3000);
    uint8_t *b = fake_dev_alloc(0, 4096);
    if (rank == 1) {
        /* silent, then finds rank 0 gone (it aborted) */
        sleep_ms(1500);
        double t0 = now_s();
        NCCL_OK(ncclRecv(b, 4096, ncclUint8, 0, c, (cudaStream_t)s));
        fake_stream_sync(s);
        ncclResult_t st;
        NCCL_OK(ncclCommGetAsyncError(c, &st));
        CHECK(st == ncclRemoteError, "peer's abort seen as %d", (int)st);
        CHECK(now_s() - t0 < 0.5, "took %.2f s", now_s() - t0);
        NCCL_OK(ncclCommDestroy(c));   /* failed: returns at once */
    } else {
        NCCL_OK(ncclRecv(b, 4096, ncclUint8, 1, c, (cudaStream_t)s));
        fake_stream_hold(s2);          /* an op that has not started yet */
        NCCL_OK(ncclRecv(b, 4096, ncclUint8, 1, c, (cudaStream_t)s2));
        sleep_ms(200);
        CHECK(!fake_stream_idle(s), "the receive cannot have finished");
        double t0 = now_s();
        NCCL_OK(ncclCommAbort(c));
        double t_abort = now_s() - t0;
        fake_stream_sync(s);
        double t_done = now_s() - t0;
        CHECK(t_abort < 0.25 && t_done < 0.25, "abort %.3f s, op %.3f s",
              t_abort, t_done);
        fake_stream_release(s2);       /* runs after the abort: ends at once */
        fake_stream_sync(s2);
        CHECK(now_s() - t0 < 0.5, "queued op took %.3f s", now_s() - t0);
    }
    fake_dev_free(b);
    fake_stream_free(s);
    fake_stream_free(s2);
    return 0;
}

static int mismatch_rank(int rank, int world, ncclUniqueId id,
                         const char *arg) {
    (void)arg;
    setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 1);
    fake_stream *s = fake_stream_new(0);
    ncclComm_t c = make_comm(id, world, rank, 0, 1);
    uint8_t *b = fake_dev_alloc(0, 100);
    if (rank == 0) {
        fill(b, 100, 0, 1, 0);
        NCCL_OK(ncclSend(b, 100, ncclUint8, 1, c, (cudaStream_t)s));
        fake_stream_sync(s);
    } else {
        NCCL_OK(ncclRecv(b, 64, ncclUint8, 0, c, (cudaStream_t)s));
        fake_stream_sync(s);
        ncclResult_t st;
        NCCL_OK(ncclCommGetAsyncError(c, &st));
        CHECK(st == ncclInvalidUsage, "mismatch reported as %d", (int)st);
        CHECK(strstr(ncclGetLastError(c), "size mismatch") != NULL, "%s",
              ncclGetLastError(c));
    }
    /* both sides can go: rank 0's send was delivered into the socket */
    sleep_ms(100);
    NCCL_OK(ncclCommAbort(c));
    fake_dev_free(b);
    fake_stream_free(s);
    return 0;
}

static int dupdev_rank(int rank, int world, ncclUniqueId id, const char *arg) {
    (void)arg;
    unsetenv("NCCL_MULTI_RANK_GPU_ENABLE");
    ncclComm_t c = NULL;
    fake_set_device(1);
    ncclResult_t r = ncclCommInitRank(&c, world, id, rank);
    CHECK(r == ncclInvalidUsage && c == NULL, "init returned %d", (int)r);
    CHECK(strstr(ncclGetLastError(NULL), "NCCL_MULTI_RANK_GPU_ENABLE"), "%s",
          ncclGetLastError(NULL));
    return 0;
}

int main(int argc, char **argv) {
    const char *what = argc > 1 ? argv[1] : "";
    const char *arg = argc > 2 ? argv[2] : "";
    int rc;
    setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 1);   /* the ring shares devices */
    if (strcmp(what, "api") == 0)
        rc = api_checks();
    else if (strcmp(what, "ring") == 0)
        rc = run_ranks(atoi(arg), ring_rank, arg, 0, 120);
    else if (strcmp(what, "alltoall") == 0)
        rc = run_ranks(4, alltoall_rank, arg, 0, 120);
    else if (strcmp(what, "killed") == 0)
        rc = run_ranks(2, killed_rank, arg, 2u, 30);
    else if (strcmp(what, "abort") == 0)
        rc = run_ranks(2, abort_rank, arg, 0, 30);
    else if (strcmp(what, "mismatch") == 0)
        rc = run_ranks(2, mismatch_rank, arg, 0, 30);
    else if (strcmp(what, "dupdev") == 0)
        rc = run_ranks(2, dupdev_rank, arg, 0, 30);
    else if (strcmp(what, "fake") == 0)
        rc = fake_peer_scenario(arg);
    else {
        fprintf(stderr, "usage: %s api|ring W|alltoall|killed|abort|mismatch|"
                "dupdev|fake MODE\n", argv[0]);
        return 2;
    }
    printf("%s %s: %s\n", what, arg, rc == 0 ? "ok" : "FAILED");
    return rc;
}
