/*
 * comm_harness.c -- standalone checks of the ringattn transports without
 * Python: host ranks are fork()ed processes, threads ranks are pthreads.
 * Build and run: sh tests/c/run_comm_harness.sh
 */
#include "comm/comm.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define EXPECT(cond, ...)                                                     \
    do {                                                                      \
        if (!(cond)) {                                                        \
            fprintf(stderr, "rank %d: FAILED %s:%d: ", rank, __FILE__,        \
                    __LINE__);                                                \
            fprintf(stderr, __VA_ARGS__);                                     \
            fprintf(stderr, "\n");                                            \
            return 1;                                                         \
        }                                                                     \
    } while (0)

static ra_xfer ring_xfer(ra_comm *c, void *s, void *r, size_t n, int step) {
    ra_xfer x;
    memset(&x, 0, sizeof x);
    x.kind = RA_XFER_DATA;
    x.step = step;
    x.send = s;
    x.send_nbytes = n;
    x.dst = (c->rank + 1) % c->size;
    x.recv = r;
    x.recv_nbytes = n;
    x.src = (c->rank - 1 + c->size) % c->size;
    x.device_type = RA_DEV_CPU;
    return x;
}

/* the ring / collective body every transport runs */
static int body(ra_comm *c, int scenario) {
    int rank = c->rank, p = c->size;
    size_t sizes[] = {0, 1, 7, 4093, (size_t)64 << 20};
    for (int si = 0; si < 5; si++) {
        size_t n = sizes[si];
        unsigned char *s = malloc(n + 1), *r = malloc(n + 1);
        for (size_t i = 0; i < n; i++) s[i] = (unsigned char)(rank * 31 + i);
        ra_xfer x = ring_xfer(c, s, r, n, si);
        ra_status st = ra_comm_sendrecv(c, &x, "sendrecv", 30);
        EXPECT(st == RA_OK, "sendrecv %zu: %s", n, ra_last_error());
        int prev = (rank - 1 + p) % p;
        for (size_t i = 0; i < n; i++)
            EXPECT(r[i] == (unsigned char)(prev * 31 + i), "data %zu", i);
        free(s);
        free(r);
    }
    EXPECT(ra_comm_barrier(c, 10) == RA_OK, "barrier: %s", ra_last_error());
    char item[32];
    snprintf(item, sizeof item, "rank-%d", rank);
    void *all;
    size_t total, lens[16];
    EXPECT(ra_comm_allgather(c, item, strlen(item), &all, &total, lens, 10) ==
               RA_OK, "allgather: %s", ra_last_error());
    size_t off = 0;
    for (int i = 0; i < p; i++) {
        char want[32];
        snprintf(want, sizeof want, "rank-%d", i);
        EXPECT(lens[i] == strlen(want) &&
                   memcmp((char *)all + off, want, lens[i]) == 0,
               "allgather item %d", i);
        off += lens[i];
    }
    ra_host_free(all, total);
    if (scenario == 0) {            /* split by parity, alltoall on it */
        ra_comm *half = NULL;
        EXPECT(ra_comm_split(c, rank % 2, -rank, 10, &half) == RA_OK &&
                   half != NULL, "split: %s", ra_last_error());
        int hp = half->size, hr = half->rank;
        EXPECT(hp == (p - rank % 2 + 1) / 2, "split size %d", hp);
        const void *sends[16];
        void *recvs[16];
        size_t sn[16], rn[16];
        unsigned char sbuf[16][8], rbuf[16][8];
        for (int i = 0; i < hp; i++) {
            sn[i] = (size_t)(hr + 2 * i) % 5;
            rn[i] = (size_t)(i + 2 * hr) % 5;
            memset(sbuf[i], 100 + rank, sizeof sbuf[i]);
            memset(rbuf[i], 0, sizeof rbuf[i]);
            sends[i] = sbuf[i];
            recvs[i] = rbuf[i];
        }
        ra_a2a a = {sends, sn, recvs, rn, RA_DEV_CPU, 0, NULL};
        EXPECT(ra_comm_alltoall(half, &a, 10) == RA_OK, "alltoall: %s",
               ra_last_error());
        for (int j = 0; j < hp; j++) {
            /* member j of the split is the (j+1)-th highest of its parity */
            int from = half->members[j];
            for (size_t b = 0; b < rn[j]; b++)
                EXPECT(rbuf[j][b] == 100 + from, "block %d byte %zu", j, b);
        }
        EXPECT(ra_comm_barrier(c, 10) == RA_OK, "barrier after split: %s",
               ra_last_error());
        ra_comm_free(half);
        EXPECT(ra_comm_barrier(c, 10) == RA_OK, "barrier after free: %s",
               ra_last_error());
    }
    if (scenario == 1) {            /* size mismatch */
        char s[16], r[16];
        ra_xfer x = ring_xfer(c, s, r, 8, 99);
        if (rank == 0) x.recv_nbytes = 16;
        ra_status st = ra_comm_sendrecv(c, &x, "sendrecv", 10);
        /* a host sender whose bytes fit the socket may finish; the next
         * operation fails */
        if (st == RA_OK) st = ra_comm_barrier(c, 5);
        EXPECT(st != RA_OK, "mismatch not detected");
        fprintf(stderr, "rank %d mismatch -> %s\n", rank, ra_last_error());
        if (rank == 0)
            EXPECT(strstr(ra_last_error(), "16") &&
                       strstr(ra_last_error(), "8 bytes"),
                   "message: %s", ra_last_error());
        st = ra_comm_barrier(c, 5);
        EXPECT(st == RA_ERR_COMM && strstr(ra_last_error(), "failed state"),
               "after failure: %s", ra_last_error());
    }
    if (scenario == 2) {            /* rank 1 dies mid-ring */
        char s[16], r[16];
        if (rank == 1) _exit(3);
        ra_xfer x = ring_xfer(c, s, r, 16, 5);
        double t0 = ra_now();
        ra_status st = ra_comm_sendrecv(c, &x, "sendrecv", 20);
        if (st == RA_OK) st = ra_comm_sendrecv(c, &x, "sendrecv", 20);
        fprintf(stderr, "rank %d after death (%.2f s) -> %s\n", rank,
                ra_now() - t0, ra_last_error());
        EXPECT(st != RA_OK && ra_now() - t0 < 5, "death not seen");
        EXPECT(strstr(ra_last_error(), "rank 1"), "names rank 1");
    }
    if (scenario == 3) {            /* stuck peer: rank 1 never sends */
        char s[16], r[16];
        if (rank == 1) {
            sleep(3);
            return 0;
        }
        ra_xfer x = ring_xfer(c, s, r, 16, 5);
        ra_status st = ra_comm_sendrecv(c, &x, "sendrecv", 1.0);
        fprintf(stderr, "rank %d stuck -> %s\n", rank, ra_last_error());
        EXPECT(st != RA_OK, "timeout not seen");
    }
    return 0;
}

static int run_host(int p, int scenario) {
    int port = 29000 + (getpid() % 20000);
    pid_t pids[16];
    for (int r = 0; r < p; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            ra_comm *c;
            int rank = r;
            ra_status st = ra_host_comm_create(r, p, "127.0.0.1", port,
                                               "secret", 30, &c);
            if (st != RA_OK) {
                fprintf(stderr, "rank %d: create: %s\n", r, ra_last_error());
                _exit(2);
            }
            int rc = body(c, scenario);
            (void)rank;
            ra_comm_free(c);
            _exit(rc);
        }
    }
    int bad = 0;
    for (int r = 0; r < p; r++) {
        int status;
        waitpid(pids[r], &status, 0);
        int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
        if (scenario == 2 && r == 1) continue;
        if (code != 0) bad = 1;
    }
    printf("host p=%d scenario=%d: %s\n", p, scenario, bad ? "FAIL" : "ok");
    return bad;
}

typedef struct targ {
    ra_tgroup *g;
    int rank, scenario, rc;
} targ;

static void *tmain(void *arg) {
    targ *t = arg;
    ra_comm *c;
    if (ra_tgroup_comm(t->g, t->rank, &c) != RA_OK) {
        t->rc = 2;
        return NULL;
    }
    t->rc = body(c, t->scenario);
    ra_comm_free(c);
    return NULL;
}

static int run_threads(int p, int scenario) {
    ra_tgroup *g;
    ra_tgroup_create(p, 30, &g);
    pthread_t th[16];
    targ a[16];
    for (int r = 0; r < p; r++) {
        a[r] = (targ){g, r, scenario, 0};
        pthread_create(&th[r], NULL, tmain, &a[r]);
    }
    int bad = 0;
    for (int r = 0; r < p; r++) {
        pthread_join(th[r], NULL);
        bad |= a[r].rc != 0;
    }
    ra_tgroup_decref(g);
    printf("threads p=%d scenario=%d: %s\n", p, scenario, bad ? "FAIL" : "ok");
    return bad;
}

int main(void) {
    signal(SIGPIPE, SIG_DFL);   /* a stray SIGPIPE must not happen */
    int bad = 0;
    for (int p = 1; p <= 4; p++) bad |= run_host(p, 0);
    bad |= run_host(3, 1);
    bad |= run_host(3, 2);
    bad |= run_host(2, 3);
    for (int p = 1; p <= 4; p++) bad |= run_threads(p, 0);
    bad |= run_threads(3, 1);
    printf(bad ? "FAILED\n" : "ALL OK\n");
    return bad;
}
