/*
 * test_nccl_standin_loader.c -- comm/nccl_loader.c of an emulated build
 * (RA_CUDA_EMULATED) opening the stand-in NCCL:
 *
 *   test_nccl_standin_loader STANDIN.so NOBIND.so
 *
 * STANDIN.so is the stand-in built as a library, NOBIND.so a library with
 * NCCL's symbols but no raEmuNcclBind (test_nccl_standin_nobind.c).  The
 * loader must never try libnccl.so.2, must refuse NOBIND.so with a clear
 * message, and must bind STANDIN.so to the runtime's table (here the fake
 * one) so that a transfer through its function table runs on our stream.
 * This program links STANDIN.so too (the helpers call NCCL directly): the
 * dlopen finds the same copy.
 */
#define _GNU_SOURCE
#include "comm/nccl_loader.h"
#include "test_nccl_standin.h"

#include <stdarg.h>
#include <string.h>

static char message[2048];

void ra_set_error(ra_status st, const char *fmt, ...) {
    (void)st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
}

const ra_emu_rt_table *ra_emu_runtime_table(void) { return &fake_rt; }

int main(int argc, char **argv) {
    CHECK(argc == 3, "usage: %s STANDIN.so NOBIND.so", argv[0]);
    ncclComm_t c = NULL;
    ncclUniqueId id;
    NCCL_OK(ncclGetUniqueId(&id));
    CHECK(ncclCommInitRank(&c, 1, id, 0) == ncclSystemError,
          "not bound before the loader ran");

    unsetenv("RINGATTN_NCCL_LIBRARY");
    CHECK(ra_nccl_load(NULL) == RA_ERR_NCCL, "nothing to load");
    CHECK(strstr(message, "stand-in") && !strstr(message, "libnccl.so.2:"),
          "never the system's NCCL: %s", message);
    CHECK(ra_nccl_load(argv[2]) == RA_ERR_NCCL, "a library without bind");
    CHECK(strstr(message, "raEmuNcclBind"), "%s", message);
    setenv("RINGATTN_NCCL_LIBRARY", argv[2], 1);   /* tried first, refused */
    CHECK(ra_nccl_load(argv[1]) == RA_OK, "the stand-in: %s", message);

    int major = 0, minor = 0, patch = 0;
    unsigned char uid[RA_NCCL_ID_BYTES];
    CHECK(ra_nccl_version(NULL, &major, &minor, &patch) == RA_OK, "version");
    CHECK(major == 2 && minor >= 30, "version %d.%d.%d", major, minor, patch);
    CHECK(ra_nccl_unique_id(NULL, uid) == RA_OK &&
          memcmp(uid, SI_ID_MAGIC, SI_ID_MAGIC_BYTES) == 0, "unique id");

    /* a self exchange through the loaded table, as comm_nccl_xfer.c does */
    fake_stream *s = fake_stream_new(0);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    memcpy(id.internal, uid, sizeof uid);
    ncclResult_t r = ra_nccl_lib.CommInitRankConfig(&c, 1, id, 0, &cfg);
    CHECK(r == ncclSuccess || r == ncclInProgress, "init %d", (int)r);
    uint8_t *a = fake_dev_alloc(0, 1000), *b = fake_dev_alloc(0, 1000);
    fill(a, 1000, 0, 0, 3);
    NCCL_OK(ra_nccl_lib.GroupStart());
    NCCL_OK(ra_nccl_lib.Send(a, 1000, ncclUint8, 0, c, (cudaStream_t)s));
    NCCL_OK(ra_nccl_lib.Recv(b, 1000, ncclUint8, 0, c, (cudaStream_t)s));
    NCCL_OK(ra_nccl_lib.GroupEnd());
    CHECK(settle(c, 2) == ncclSuccess, "settled");
    fake_stream_sync(s);
    CHECK(first_bad(b, 1000, 0, 0, 3) == 1000, "the bytes arrived");
    char text[256];
    ra_nccl_describe(ncclRemoteError, c, text, sizeof text);
    CHECK(strstr(text, "remote process"), "%s", text);
    NCCL_OK(ra_nccl_lib.CommDestroy(c));
    fake_dev_free(a);
    fake_dev_free(b);
    fake_stream_free(s);
    printf("loader: ok\n");
    return 0;
}
