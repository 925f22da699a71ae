/*
 * test_nccl_standin_fake.c -- a fake rank 1 that speaks the stand-in's
 * wire by hand (standin.h) and gets it wrong in one way per MODE; the real
 * rank 0 must report an error, never crash or allocate what a peer asks.
 *
 *   hello_magic hello_secret hello_world hello_short  -> init fails
 *   (hello_short: 10 bytes of hello, then the connection closes)
 *   frame_magic frame_seq frame_huge frame_truncated garbage
 *                                                      -> the receive fails
 */
#define _GNU_SOURCE
#include "test_nccl_standin.h"

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static const char *mode;

static void put(int fd, const void *p, size_t n) {
    const char *c = (const char *)p;
    while (n > 0) {
        ssize_t k = send(fd, c, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return;         /* rank 0 gave up on us: fine */
        c += k;
        n -= (size_t)k;
    }
}

static int fake_rank(ncclUniqueId id) {
    uint8_t name[SI_NAME_BYTES], secret[SI_SECRET_BYTES];
    memcpy(name, id.internal + SI_ID_MAGIC_BYTES, sizeof name);
    memcpy(secret, id.internal + SI_ID_MAGIC_BYTES + SI_NAME_BYTES,
           sizeof secret);
    struct sockaddr_un sa;
    unsigned len = si_sockaddr(name, 0, &sa);
    int fd = -1;
    for (int tries = 0; tries < 2000; tries++) {
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (connect(fd, (struct sockaddr *)&sa, len) == 0) break;
        close(fd);
        fd = -1;
        sleep_ms(5);
    }
    CHECK(fd >= 0, "cannot reach rank 0");
    si_hello h;
    memset(&h, 0, sizeof h);
    h.magic = SI_HELLO_MAGIC;
    h.version = SI_WIRE_VERSION;
    h.world = 2;
    h.from = 1;
    h.to = 0;
    h.device = 1;
    memcpy(h.name, name, sizeof name);
    memcpy(h.secret, secret, sizeof secret);
    if (strcmp(mode, "hello_magic") == 0) h.magic ^= 1;
    if (strcmp(mode, "hello_secret") == 0) h.secret[7] ^= 0x40;
    if (strcmp(mode, "hello_world") == 0) h.world = 3;
    if (strcmp(mode, "hello_short") == 0) {   /* 10 bytes, then gone */
        put(fd, &h, 10);
        close(fd);
        return 0;
    }
    put(fd, &h, sizeof h);
    if (strncmp(mode, "hello", 5) != 0) {
        si_hello back;
        size_t got = 0;
        while (got < sizeof back) {
            ssize_t k = recv(fd, (char *)&back + got, sizeof back - got, 0);
            CHECK(k > 0, "rank 0's hello");
            got += (size_t)k;
        }
        CHECK(back.magic == SI_HELLO_MAGIC && back.from == 0 && back.to == 1,
              "rank 0's hello is right");
        si_frame f = {SI_FRAME_MAGIC, SI_FRAME_DATA, 0, 64};
        uint8_t junk[4096];
        for (size_t i = 0; i < sizeof junk; i++)
            junk[i] = (uint8_t)(i * 2654435761u >> 13);
        if (strcmp(mode, "frame_magic") == 0) f.magic = 0x12345678;
        if (strcmp(mode, "frame_seq") == 0) f.seq = 5;
        if (strcmp(mode, "frame_huge") == 0) f.nbytes = 1ull << 60;
        if (strcmp(mode, "garbage") == 0) {
            put(fd, junk, sizeof junk);
        } else {
            put(fd, &f, sizeof f);
            put(fd, junk, strcmp(mode, "frame_truncated") == 0 ? 10 : 64);
        }
        if (strcmp(mode, "frame_truncated") == 0) {
            close(fd);
            return 0;
        }
    }
    /* until rank 0 closes (it aborts after its error), at most 10 s */
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    char sink[256];
    for (int i = 0; i < 100 && poll(&pf, 1, 100) >= 0; i++)
        if ((pf.revents & (POLLIN | POLLHUP)) &&
            recv(fd, sink, sizeof sink, MSG_DONTWAIT) == 0)
            break;
    close(fd);
    return 0;
}

static int real_rank(ncclUniqueId id) {
    int fds0 = fake_count_fds();
    ncclComm_t c = NULL;
    fake_set_device(0);
    ncclResult_t want = strcmp(mode, "hello_world") == 0 ? ncclInvalidUsage
                        : strcmp(mode, "frame_huge") == 0 ? ncclInvalidUsage
                                                          : ncclRemoteError;
    if (strncmp(mode, "hello", 5) == 0) {
        ncclResult_t r = ncclCommInitRank(&c, 2, id, 0);
        CHECK(r == want && c == NULL, "init returned %d: %s", (int)r,
              ncclGetLastError(NULL));
        CHECK(fake_count_fds() == fds0, "fds %d -> %d", fds0,
              fake_count_fds());
        return 0;
    }
    fake_stream *s = fake_stream_new(0);
    NCCL_OK(ncclCommInitRank(&c, 2, id, 0));
    uint8_t *b = fake_dev_alloc(0, 64);
    NCCL_OK(ncclRecv(b, 64, ncclUint8, 1, c, (cudaStream_t)s));
    ncclResult_t st = wait_error(c, 5);
    CHECK(st == want, "mode %s: async %d: %s", mode, (int)st,
          ncclGetLastError(c));
    fprintf(stderr, "rank 0 (%s): %s\n", mode, ncclGetLastError(c));
    fake_stream_sync(s);
    NCCL_OK(ncclCommAbort(c));
    fake_dev_free(b);
    fake_stream_free(s);
    CHECK(fake_count_fds() == fds0, "fds %d -> %d", fds0, fake_count_fds());
    return 0;
}

static int fake_main(int rank, int world, ncclUniqueId id, const char *arg) {
    (void)world;
    mode = arg;
    return rank == 0 ? real_rank(id) : fake_rank(id);
}

int fake_peer_scenario(const char *m) {
    static const char *modes[] = {
        "hello_magic", "hello_secret", "hello_world", "hello_short",
        "frame_magic", "frame_seq", "frame_huge", "frame_truncated",
        "garbage",
    };
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++)
        if (strcmp(m, modes[i]) == 0) return run_ranks(2, fake_main, m, 0, 30);
    fprintf(stderr, "unknown fake-peer mode %s\n", m);
    return 2;
}
