/*
 * test_nccl_standin_api.c -- the stand-in NCCL in one process: version,
 * ids, binding, init's argument checks, a rank claimed twice, and a world
 * of one: every call-time check of ncclSend/ncclRecv, group errors, the
 * self exchange, non-blocking group ends.
 */
#define _GNU_SOURCE
#include "test_nccl_standin.h"

#include <string.h>

static void ids_and_binding(void) {
    ncclComm_t c = NULL;
    ncclUniqueId a, b;
    int v = 0;
    NCCL_OK(ncclGetUniqueId(&a));
    CHECK(ncclCommInitRank(&c, 1, a, 0) == ncclSystemError && c == NULL,
          "init before raEmuNcclBind");
    CHECK(strstr(ncclGetLastError(NULL), "raEmuNcclBind"), "%s",
          ncclGetLastError(NULL));
    ra_emu_rt_table old = fake_rt;
    old.version = RA_EMU_RT_TABLE_VERSION + 1;
    CHECK(raEmuNcclBind(NULL) != 0 && raEmuNcclBind(&old) != 0,
          "bind refuses a missing or newer table");
    CHECK(raEmuNcclBind(&fake_rt) == 0, "bind");

    NCCL_OK(ncclGetVersion(&v));
    CHECK(v >= NCCL_VERSION(2, 30, 0) && v >= NCCL_VERSION_CODE, "version %d",
          v);
    NCCL_OK(ncclGetUniqueId(&b));
    CHECK(memcmp(&a, &b, sizeof a) != 0, "two ids are equal");
    setenv("NCCL_COMM_ID", "127.0.0.1:29555", 1);
    NCCL_OK(ncclGetUniqueId(&a));
    NCCL_OK(ncclGetUniqueId(&b));
    unsetenv("NCCL_COMM_ID");
    CHECK(memcmp(&a, &b, sizeof a) == 0, "NCCL_COMM_ID gives one id");
    for (int r = 0; r <= ncclNumResults; r++)
        CHECK(ncclGetErrorString((ncclResult_t)r) != NULL, "string %d", r);
}

static void init_errors(void) {
    ncclComm_t c = (ncclComm_t)1;
    ncclUniqueId id, zero;
    memset(&zero, 0, sizeof zero);
    NCCL_OK(ncclGetUniqueId(&id));
    CHECK(ncclCommInitRank(&c, 1, zero, 0) == ncclInvalidArgument && !c,
          "a foreign id");
    CHECK(ncclCommInitRank(&c, 0, id, 0) == ncclInvalidArgument, "0 ranks");
    CHECK(ncclCommInitRank(&c, 2, id, 2) == ncclInvalidArgument, "rank 2/2");
    CHECK(ncclCommInitRank(NULL, 1, id, 0) == ncclInvalidArgument, "NULL");
    ncclConfig_t raw;
    memset(&raw, 0, sizeof raw);
    CHECK(ncclCommInitRankConfig(&c, 1, id, 0, &raw) == ncclInvalidArgument,
          "a config without NCCL_CONFIG_INITIALIZER");

    /* rank 0 twice: the second cannot bind the rank's name */
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t first = NULL, second = NULL;
    int fds0 = fake_count_fds(), thr0 = fake_count_threads();
    CHECK(ncclCommInitRankConfig(&first, 2, id, 0, &cfg) == ncclInProgress,
          "non-blocking init says in progress");
    CHECK(ncclCommInitRankConfig(&second, 2, id, 0, &cfg) ==
              ncclInvalidUsage && second == NULL, "rank 0 claimed twice");
    CHECK(strstr(ncclGetLastError(NULL), "rank 0"), "%s",
          ncclGetLastError(NULL));
    CHECK(settle(first, 0.1) == ncclInProgress, "no peer: still in progress");
    double t0 = now_s();
    NCCL_OK(ncclCommAbort(first));   /* stops the init thread */
    CHECK(now_s() - t0 < 0.25, "abort during init took %.3f s",
          now_s() - t0);
    CHECK(fake_count_fds() == fds0 && fake_count_threads() == thr0,
          "fds %d -> %d, threads %d -> %d", fds0, fake_count_fds(), thr0,
          fake_count_threads());
    /* the name is free again */
    CHECK(ncclCommInitRankConfig(&second, 2, id, 0, &cfg) == ncclInProgress,
          "rank 0 after the abort");
    NCCL_OK(ncclCommDestroy(second));   /* still initialising: no wait */
}

static void call_checks(fake_stream *s, fake_stream *other) {
    ncclUniqueId id;
    NCCL_OK(ncclGetUniqueId(&id));
    ncclComm_t c = make_comm(id, 1, 0, 0, 1);
    cudaStream_t st = (cudaStream_t)s;
    char host[64];
    uint8_t *d0 = fake_dev_alloc(0, 100), *d0b = fake_dev_alloc(0, 100);
    uint8_t *d1 = fake_dev_alloc(1, 100);
    struct { const void *buf; size_t n; int dt, peer; ncclComm_t comm;
             cudaStream_t st; ncclResult_t want; const char *text; } bad[] = {
        {host, 4, ncclUint8, 0, c, st, ncclInvalidArgument, "device memory"},
        {d1, 4, ncclUint8, 0, c, st, ncclInvalidArgument, "another device"},
        {d0, 101, ncclUint8, 0, c, st, ncclInvalidArgument, "101 bytes"},
        {d0, 26, ncclFloat32, 0, c, st, ncclInvalidArgument, "104 bytes"},
        {d0, 4, ncclUint8, 1, c, st, ncclInvalidArgument, "peer 1"},
        {d0, 4, ncclUint8, -1, c, st, ncclInvalidArgument, "peer -1"},
        {d0, 4, 42, 0, c, st, ncclInvalidArgument, "datatype"},
        {d0, 4, ncclUint8, 0, NULL, st, ncclInvalidArgument, "comm"},
        {d0, 4, ncclUint8, 0, c, (cudaStream_t)other, ncclInvalidArgument,
         "another device"},
        {d0, (size_t)-1 / 2, ncclFloat64, 0, c, st, ncclInvalidArgument,
         "overflows"},
        {d0, 4, ncclUint8, 0, c, st, ncclInvalidUsage, "one group"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ncclResult_t r = ncclSend(bad[i].buf, bad[i].n,
                                  (ncclDataType_t)bad[i].dt, bad[i].peer,
                                  bad[i].comm, bad[i].st);
        CHECK(r == bad[i].want, "case %zu: %d", i, (int)r);
        CHECK(strstr(ncclGetLastError(NULL), bad[i].text), "case %zu: %s", i,
              ncclGetLastError(NULL));
    }
    unsigned long long marked = fake_marked_bytes();
    /* a bad call spoils its group: nothing runs */
    memset(d0b, 0xee, 100);
    fill(d0, 100, 0, 0, 1);
    NCCL_OK(ncclGroupStart());
    NCCL_OK(ncclSend(d0, 100, ncclUint8, 0, c, st));
    NCCL_OK(ncclRecv(d0b, 100, ncclUint8, 0, c, st));
    CHECK(ncclRecv(host, 4, ncclUint8, 0, c, st) == ncclInvalidArgument, "x");
    CHECK(ncclGroupEnd() == ncclInvalidArgument, "the group fails");
    CHECK(strstr(ncclGetLastError(NULL), "device memory"), "%s",
          ncclGetLastError(NULL));
    fake_stream_sync(s);
    CHECK(d0b[0] == 0xee && fake_marked_bytes() == marked, "nothing ran");
    /* self pairs must match */
    NCCL_OK(ncclGroupStart());
    NCCL_OK(ncclSend(d0, 100, ncclUint8, 0, c, st));
    NCCL_OK(ncclRecv(d0b, 64, ncclUint8, 0, c, st));
    CHECK(ncclGroupEnd() == ncclInvalidUsage, "self size mismatch");
    NCCL_OK(ncclGroupStart());
    NCCL_OK(ncclSend(d0, 100, ncclUint8, 0, c, st));
    CHECK(ncclGroupEnd() == ncclInvalidUsage, "a send to self alone");
    CHECK(ncclGroupEnd() == ncclInvalidUsage, "GroupEnd without GroupStart");
    /* a good self exchange, nested, with an empty pair of NULLs */
    NCCL_OK(ncclGroupStart());
    NCCL_OK(ncclRecv(d0b, 100 / 4, ncclFloat32, 0, c, st));
    NCCL_OK(ncclSend(d0, 100 / 4, ncclFloat32, 0, c, st));
    NCCL_OK(ncclGroupStart());
    NCCL_OK(ncclSend(NULL, 0, ncclFloat64, 0, c, st));
    NCCL_OK(ncclRecv(NULL, 0, ncclFloat64, 0, c, st));
    NCCL_OK(ncclGroupEnd());
    group_end(c);
    fake_stream_sync(s);
    CHECK(first_bad(d0b, 100, 0, 0, 1) == 100, "self exchange");
    CHECK(fake_marked_bytes() - marked == 100, "marked %llu",
          fake_marked_bytes() - marked);
    close_comm(c);

    /* non-blocking: GroupEnd says in progress, then settles */
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    NCCL_OK(ncclCommInitRankConfig(&c, 1, id, 0, &cfg));
    CHECK(settle(c, 1) == ncclSuccess, "world of one is ready");
    NCCL_OK(ncclGroupStart());
    NCCL_OK(ncclSend(d0, 100, ncclUint8, 0, c, st));
    NCCL_OK(ncclRecv(d0b, 100, ncclUint8, 0, c, st));
    CHECK(ncclGroupEnd() == ncclInProgress, "non-blocking group end");
    CHECK(settle(c, 1) == ncclSuccess, "settles");
    close_comm(c);
    fake_dev_free(d0);
    fake_dev_free(d0b);
    fake_dev_free(d1);
}

int api_checks(void) {
    int fds0 = fake_count_fds();
    ids_and_binding();
    init_errors();
    fake_stream *s = fake_stream_new(0), *other = fake_stream_new(1);
    call_checks(s, other);
    fake_stream_free(s);
    fake_stream_free(other);
    CHECK(fake_count_fds() == fds0, "fds %d -> %d", fds0, fake_count_fds());
    return 0;
}
