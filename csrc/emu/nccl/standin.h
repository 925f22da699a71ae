/*
 * standin.h -- ringattn's stand-in NCCL: the internal interface of its
 * three files (not a header users or the C core read; they read nccl.h).
 *
 * The stand-in is a separate shared library (ringattn/_emu_nccl*.so, built
 * only with RINGATTN_CUDA=emulate) that comm/nccl_loader.c opens in place
 * of libnccl.so.2.  It implements the NCCL calls ringattn makes between
 * real processes on one machine, one per rank, on the emulated GPU's
 * streams:
 *
 *   standin_comm.c  unique ids, binding to the emulated runtime, version,
 *                   errors, communicator init (blocking or not), async
 *                   error, finalize, abort, destroy
 *   standin_wire.c  the wire: abstract-namespace Unix sockets, the hello
 *                   handshake, bounded reads and writes that notice abort
 *   standin_xfer.c  ncclGroupStart/End, ncclSend/Recv: checks at call time,
 *                   one stream operation per (communicator, stream) that
 *                   moves all of a group's messages concurrently
 *
 * Wire protocol (native byte order: every rank is on this machine).
 *   Unique id (128 bytes): "RAEMUNC1", 16 random bytes naming the
 *   rendezvous, 32 random bytes of secret, zeros (with NCCL_COMM_ID set,
 *   name and secret are derived from it: every rank makes the same id, as
 *   with NCCL).  Rank r of a world of n listens on the abstract socket
 *   "\0ringattn-emu-nccl-<name hex>-<r>" (a second process claiming rank
 *   r cannot bind it); rank r connects to every rank below it and accepts
 *   every rank above, so each pair has one stream socket.  Both ends must
 *   be this user's processes (SO_PEERCRED); the secret is sent only then.
 *   Hello: both directions send one si_hello (80 bytes); the receiver
 *   checks magic, wire version, name, secret, world size, both ranks and
 *   that no rank is connected twice.
 *   Data: each ncclSend is one si_frame (24 bytes: magic, kind, sequence
 *   number, byte count) and then the bytes.  The k-th send from A to B is
 *   the k-th receive on B from A: the receiver checks the frame's sequence
 *   number and that its byte count equals the receive's before it reads a
 *   single payload byte, so nothing a peer sends is ever sized by the
 *   peer.  Nothing received is interpreted beyond these fixed fields.
 */
#ifndef RA_EMU_NCCL_STANDIN_H
#define RA_EMU_NCCL_STANDIN_H

#include <nccl.h>

#include "emu/emu.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define SI_EXPORT __attribute__((visibility("default")))

/* ---- the unique id and the wire ------------------------------------------ */

#define SI_ID_MAGIC "RAEMUNC1"        /* 8 bytes, no terminator on the wire */
#define SI_ID_MAGIC_BYTES 8
#define SI_NAME_BYTES 16
#define SI_SECRET_BYTES 32
#define SI_MAX_RANKS 4096             /* world sizes the stand-in accepts */
#define SI_WIRE_VERSION 1u
#define SI_HELLO_MAGIC 0x48454152u    /* "RAEH" */
#define SI_FRAME_MAGIC 0x44414552u    /* "READ" */
#define SI_FRAME_DATA 1u

typedef struct si_hello {
    uint32_t magic;                   /* SI_HELLO_MAGIC */
    uint32_t version;                 /* SI_WIRE_VERSION */
    uint32_t world;                   /* the sender's world size */
    uint32_t from;                    /* the sender's rank */
    uint32_t to;                      /* the rank it means to reach */
    int32_t device;                   /* the sender's emulated device */
    uint32_t flags;                   /* 0 (reserved) */
    uint32_t reserved;                /* 0 */
    uint8_t name[SI_NAME_BYTES];      /* the unique id's rendezvous name */
    uint8_t secret[SI_SECRET_BYTES];  /* the unique id's secret */
} si_hello;

typedef struct si_frame {
    uint32_t magic;                   /* SI_FRAME_MAGIC */
    uint32_t kind;                    /* SI_FRAME_DATA */
    uint64_t seq;                     /* k: the sender's k-th send to us */
    uint64_t nbytes;                  /* payload bytes that follow */
} si_frame;

_Static_assert(sizeof(si_hello) == 80, "si_hello is 80 bytes on the wire");
_Static_assert(sizeof(si_frame) == 24, "si_frame is 24 bytes on the wire");
_Static_assert(NCCL_UNIQUE_ID_BYTES >=
                   SI_ID_MAGIC_BYTES + SI_NAME_BYTES + SI_SECRET_BYTES,
               "the unique id holds magic, name and secret");

/* ---- the communicator ------------------------------------------------------ */

#define SI_COMM_LIVE 0x52414e43u      /* ncclComm.magic while the handle is valid */

/* Reference counted: the user's handle holds one reference, every queued
 * stream operation another, so an operation that a stream runs after
 * ncclCommAbort/Destroy still finds the (aborted) communicator.  The
 * sockets are closed by abort/destroy once no operation is inside them
 * (`running`); what is left after that is memory only. */
struct ncclComm {
    uint32_t magic;
    int rank, world, device;
    int blocking;                     /* config.blocking (default 1) */
    int multi_rank;                   /* NCCL_MULTI_RANK_GPU_ENABLE=1 */
    uint8_t name[SI_NAME_BYTES], secret[SI_SECRET_BYTES];

    pthread_mutex_t mu;               /* guards everything below not atomic */
    pthread_cond_t cv;                /* running, outstanding changes */
    int refs;
    int running;                      /* operations using the sockets now */
    int outstanding;                  /* enqueued, not finished */
    int finalizing;                   /* ncclCommFinalize was called */
    int torn_down;                    /* sockets closed */
    char err[320];                    /* the async error's text */

    _Atomic int state;                /* ncclInProgress (init), ncclSuccess,
                                         or the async error */
    _Atomic int aborted;              /* abort/destroy began: stop at once */
    _Atomic int settle_once;          /* report ncclInProgress once more
                                         (non-blocking ncclGroupEnd) */

    int *fds;                         /* per peer: its socket, -1 for self */
    int *peer_device;                 /* per peer: its device (hello) */
    uint64_t *send_issued, *recv_issued;   /* next sequence number, per peer
                                              (under mu, at enqueue) */
    _Atomic uint64_t *send_turn, *recv_turn;  /* sequence number whose turn
                                                 it is on the wire */
    int listen_fd;                    /* held for the comm's life: a second
                                         process claiming this rank fails */
    int wake[2];                      /* pipe, readable once aborted */
    pthread_t init_thread;
    int init_thread_started;
};

/* ---- standin_comm.c ------------------------------------------------------- */

/* The library's one export beside NCCL's: comm/nccl_loader.c looks it up
 * with dlsym and calls it right after dlopen with the emulated runtime's
 * table.  0, or -1 when the table is missing or of another version. */
SI_EXPORT int raEmuNcclBind(const ra_emu_rt_table *t);

extern const ra_emu_rt_table *_Atomic si_rt;   /* raEmuNcclBind's table */

/* ncclInvalidArgument unless `c` is a live handle (text set). */
ncclResult_t si_check_comm(ncclComm_t c, const char *fn);
/* Record an error for the caller's thread (ncclGetLastError); returns r. */
ncclResult_t si_fail(ncclResult_t r, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Forget the caller's last error (every API entry does). */
void si_clear_error(void);
/* Fail the communicator asynchronously: the first error wins. */
void si_comm_set_error(ncclComm_t c, ncclResult_t r, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Take / drop a reference (the last drop frees the memory). */
void si_comm_ref(ncclComm_t c);
void si_comm_unref(ncclComm_t c);
static inline int si_is_error(int state) {
    return state != ncclSuccess && state != ncclInProgress;
}

/* ---- standin_wire.c --------------------------------------------------------- */

/* The rendezvous socket name of `rank` into sa (returns its length for
 * bind/connect). */
struct sockaddr_un;
unsigned si_sockaddr(const uint8_t name[SI_NAME_BYTES], int rank,
                     struct sockaddr_un *sa);
/* Bind and listen on this rank's name (init's first, synchronous step). */
ncclResult_t si_listen(ncclComm_t c);
/* Connect to every lower rank, accept every higher one, check the hellos
 * and the devices.  Returns when all pairs are connected, on an error (the
 * text in c->err's form via si_comm_set_error) or once c->aborted. */
ncclResult_t si_connect_all(ncclComm_t c);
/* Sleep up to `ms` milliseconds, or less once c is aborted: 1 if aborted. */
int si_nap(ncclComm_t c, int ms);

#endif /* RA_EMU_NCCL_STANDIN_H */
