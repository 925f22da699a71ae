/*
 * comm_threads_cuda.c -- CUDA device memory between thread ranks: the
 * "threads" backend of a group made with devices (one CUDA device per
 * rank; several ranks may share one).
 *
 * A transfer of device memory never blocks the host.  Posting it records a
 * "ready" event on the rank's stream (the caller's, default ringattn's
 * compute stream of its device): the kernels that wrote the send block or
 * still read the receive block come before it.  When a send meets its
 * receive (comm_threads.c, the rank that arrives second), the copy is
 * queued on the receiver's copy stream after both ready events, as a
 * device copy on one device or a peer copy (cudaMemcpyPeerAsync) between
 * two; an event recorded after it is waited on by both ranks' streams at
 * once, before either request finishes.  So the receiver's next kernels
 * read the bytes that arrived, the sender's next kernels may overwrite its
 * send block, and memory freed afterwards (stream-ordered on the compute
 * stream, cuda_rt.c) is reused only after the copy: also when a request
 * fails, since the ordering is queued before it can finish.
 *
 * Peer access is enabled between every pair of the group's devices that
 * allows it both ways; a copy between two such devices is one
 * cudaMemcpyPeerAsync.  Between devices that do not allow it the bytes go
 * through the receiver's pinned staging buffer: device to host on the
 * sender's copy stream, then host to device on the receiver's, the
 * staging buffer reused in stream order (one staged copy into a rank is
 * queued at a time; the next one's download waits for the previous
 * upload).  Deadlines, abort and the named errors are the host path's:
 * only the bytes move differently.
 */
#include "comm/comm_threads_internal.h"
#include "core/cuda_rt.h"

#include <string.h>

#ifdef RA_WITH_CUDA

#include <cuda_runtime.h>

/* A receiving rank's pinned staging buffer (devices without peer
 * access). */
struct tstage {
    pthread_mutex_t mu;       /* one staged copy queued at a time */
    int init;
    void *host;               /* cudaMallocHost */
    size_t bytes;
    cudaEvent_t last;         /* after the last upload from it, or NULL */
};

/* A device request's CUDA state (ra_req.impl). */
typedef struct tdev_req {
    cudaEvent_t ready;        /* recorded on `stream` at post */
    cudaStream_t stream;      /* the rank's ordering stream */
    int device;
} tdev_req;

#define CU(call, what)                                                       \
    do {                                                                     \
        cudaError_t e_ = (call);                                             \
        if (e_ != cudaSuccess) {                                             \
            st = ra_cuda_status((int)e_, what, __FILE__, __LINE__);          \
            goto exit;                                                       \
        }                                                                    \
    } while (0)

static ra_status rank_stream(ra_tgroup *g, int rank);

ra_status ra_tcuda_group_init(ra_tgroup *g) {
    int count = ra_cuda_device_count();
    const char *why = NULL;
    if (!ra_cuda_available(&why)) {
        ra_set_error(RA_ERR_VALUE, "devices needs CUDA, which is not "
                     "available: %s", why);
        return RA_ERR_VALUE;
    }
    for (int r = 0; r < g->size; r++) {
        if (g->devices[r] < 0 || g->devices[r] >= count) {
            ra_set_error(RA_ERR_VALUE, "devices[%d] must be a CUDA device in "
                         "[0, %d), got %d", r, count, g->devices[r]);
            return RA_ERR_VALUE;
        }
    }
    /* peer access between the devices in use (a process-wide setting) */
    ra_status st = RA_OK;
    for (int a = 0; a < count && st == RA_OK; a++) {
        int used_a = 0;
        for (int r = 0; r < g->size; r++) used_a |= g->devices[r] == a;
        if (!used_a) continue;
        int prev = 0;
        RA_CHECK(ra_cuda_enter_device(a, &prev));
        for (int b = 0; b < count; b++) {
            int used_b = 0, can = 0;
            for (int r = 0; r < g->size; r++) used_b |= g->devices[r] == b;
            if (b == a || !used_b || st != RA_OK) continue;
            cudaError_t e = cudaDeviceCanAccessPeer(&can, a, b);
            if (e != cudaSuccess) {
                st = ra_cuda_status((int)e, "cudaDeviceCanAccessPeer",
                                    __FILE__, __LINE__);
                continue;
            }
            if (!can) continue;
            e = cudaDeviceEnablePeerAccess(b, 0);
            if (e == cudaErrorPeerAccessAlreadyEnabled)
                (void)cudaGetLastError();
            else if (e != cudaSuccess)
                st = ra_cuda_status((int)e, "cudaDeviceEnablePeerAccess",
                                    __FILE__, __LINE__);
        }
        ra_cuda_leave_device(a, prev);
    }
    for (int r = 0; r < g->size && st == RA_OK; r++)
        st = rank_stream(g, r);
    size_t n = (size_t)g->size;
    if (st == RA_OK) {
        g->direct = ra_host_calloc(n * n);
        g->stages = ra_host_calloc(sizeof(struct tstage) * n);
        if (g->direct == NULL || g->stages == NULL) st = RA_ERR_NOMEM;
    }
    for (int a = 0; a < g->size && st == RA_OK; a++) {
        pthread_mutex_init(&g->stages[a].mu, NULL);
        g->stages[a].init = 1;
        for (int b = 0; b < g->size && st == RA_OK; b++) {
            int da = g->devices[a], db = g->devices[b], ab = 1, ba = 1;
            if (da != db) {
                CU(cudaDeviceCanAccessPeer(&ab, da, db),
                   "cudaDeviceCanAccessPeer");
                CU(cudaDeviceCanAccessPeer(&ba, db, da),
                   "cudaDeviceCanAccessPeer");
            }
            g->direct[(size_t)a * n + b] = ab && ba;
        }
    }
exit:
    return st;
}

static ra_status rank_stream(ra_tgroup *g, int rank) {
    int dev = g->devices[rank], prev = 0;
    RA_CHECK(ra_cuda_enter_device(dev, &prev));
    ra_status st = RA_OK;
    cudaStream_t s = NULL;
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
       "cudaStreamCreateWithFlags");
    g->copy_streams[rank] = s;
exit:
    ra_cuda_leave_device(dev, prev);
    return st;
}

void ra_tcuda_group_free(ra_tgroup *g) {
    size_t n = (size_t)g->size;
    for (int r = 0; r < g->size; r++)
        if (g->copy_streams[r] != NULL)
            (void)cudaStreamDestroy((cudaStream_t)g->copy_streams[r]);
    for (int r = 0; g->stages != NULL && r < g->size; r++) {
        struct tstage *t = &g->stages[r];
        if (!t->init) continue;
        if (t->last != NULL) {
            (void)cudaEventSynchronize(t->last);    /* uploads from it */
            (void)cudaEventDestroy(t->last);
        }
        if (t->host != NULL) (void)cudaFreeHost(t->host);
        pthread_mutex_destroy(&t->mu);
    }
    ra_host_free(g->stages, sizeof(struct tstage) * n);
    ra_host_free(g->direct, n * n);
}

ra_status ra_tcuda_post(ra_req *q, char *err, size_t n) {
    tdev_req *d = ra_host_calloc(sizeof *d);
    if (d == NULL) {
        ra_snprintf(err, n, "out of host memory");
        return RA_ERR_NOMEM;
    }
    d->device = q->x.device_id;
    ra_status st = RA_OK;
    void *stream = q->x.stream;
    int prev = 0, entered = 0;
    if (stream == NULL &&
        (st = ra_cuda_compute_stream(d->device, &stream)) != RA_OK)
        goto exit;
    d->stream = (cudaStream_t)stream;
    if ((st = ra_cuda_enter_device(d->device, &prev)) != RA_OK) goto exit;
    entered = 1;
    CU(cudaEventCreateWithFlags(&d->ready, cudaEventDisableTiming),
       "cudaEventCreateWithFlags");
    CU(cudaEventRecord(d->ready, d->stream), "cudaEventRecord");
exit:
    if (entered) ra_cuda_leave_device(d->device, prev);
    if (st != RA_OK) {
        ra_snprintf(err, n, "%s", ra_last_error());
        if (d->ready != NULL) (void)cudaEventDestroy(d->ready);
        ra_host_free(d, sizeof *d);
        return st;
    }
    q->impl = d;
    return RA_OK;
}

/* `from`'s send block into `to`'s receive block through the receiver's
 * pinned staging buffer (devices without peer access); *done is recorded
 * on the receiver's copy stream after the upload.  Receiver's device
 * entered by the caller (it stays so on return). */
static ra_status staged_copy(ra_tgroup *g, ra_req *from, ra_req *to,
                             cudaEvent_t *done) {
    tdev_req *s = from->impl, *r = to->impl;
    size_t nbytes = from->x.send_nbytes;
    struct tstage *t = &g->stages[to->comm->rank];
    cudaStream_t down = (cudaStream_t)g->copy_streams[from->comm->rank];
    cudaStream_t up = (cudaStream_t)g->copy_streams[to->comm->rank];
    cudaEvent_t mid = NULL;
    int prev = 0, entered = 0;
    ra_status st = RA_OK;
    pthread_mutex_lock(&t->mu);
    if (t->last == NULL)
        CU(cudaEventCreateWithFlags(&t->last, cudaEventDisableTiming),
           "cudaEventCreateWithFlags");
    if (t->bytes < nbytes) {
        /* grown (rarely: the ring's block sizes repeat): the uploads from
         * the old buffer end first, a host wait */
        CU(cudaEventSynchronize(t->last), "cudaEventSynchronize");
        if (t->host != NULL) (void)cudaFreeHost(t->host);
        t->host = NULL;
        t->bytes = 0;
        CU(cudaMallocHost(&t->host, nbytes), "cudaMallocHost");
        t->bytes = nbytes;
    }
    /* download on the sender's device, after its kernels and the last
     * upload from the buffer */
    if ((st = ra_cuda_enter_device(s->device, &prev)) != RA_OK) goto exit;
    entered = 1;
    CU(cudaStreamWaitEvent(down, s->ready, 0), "cudaStreamWaitEvent");
    CU(cudaStreamWaitEvent(down, t->last, 0), "cudaStreamWaitEvent");
    CU(cudaMemcpyAsync(t->host, from->x.send, nbytes, cudaMemcpyDeviceToHost,
                       down), "cudaMemcpyAsync");
    CU(cudaEventCreateWithFlags(&mid, cudaEventDisableTiming),
       "cudaEventCreateWithFlags");
    CU(cudaEventRecord(mid, down), "cudaEventRecord");
    ra_cuda_leave_device(s->device, prev);
    entered = 0;
    /* upload on the receiver's */
    CU(cudaStreamWaitEvent(up, mid, 0), "cudaStreamWaitEvent");
    CU(cudaStreamWaitEvent(up, r->ready, 0), "cudaStreamWaitEvent");
    CU(cudaMemcpyAsync(to->x.recv, t->host, nbytes, cudaMemcpyHostToDevice,
                       up), "cudaMemcpyAsync");
    CU(cudaEventRecord(t->last, up), "cudaEventRecord");
    CU(cudaEventCreateWithFlags(done, cudaEventDisableTiming),
       "cudaEventCreateWithFlags");
    CU(cudaEventRecord(*done, up), "cudaEventRecord");
exit:
    if (entered) ra_cuda_leave_device(s->device, prev);
    if (mid != NULL) (void)cudaEventDestroy(mid);     /* the wait keeps it */
    pthread_mutex_unlock(&t->mu);
    return st;
}

ra_status ra_tcuda_copy(ra_tgroup *g, ra_req *from, ra_req *to, char *err,
                        size_t n) {
    size_t nbytes = from->x.send_nbytes;
    tdev_req *s = from->impl, *r = to->impl;
    if (nbytes == 0) return RA_OK;
    int rdev = r->device, sdev = s->device, prev = 0, entered = 0;
    cudaStream_t cs = (cudaStream_t)g->copy_streams[to->comm->rank];
    cudaEvent_t done = NULL;
    ra_status st = RA_OK;
    if ((st = ra_cuda_enter_device(rdev, &prev)) != RA_OK) goto exit;
    entered = 1;
    if (!g->direct[(size_t)from->comm->rank * (size_t)g->size +
                   (size_t)to->comm->rank]) {
        if ((st = staged_copy(g, from, to, &done)) != RA_OK) goto exit;
    } else {
        CU(cudaStreamWaitEvent(cs, s->ready, 0), "cudaStreamWaitEvent");
        if (r != s)
            CU(cudaStreamWaitEvent(cs, r->ready, 0), "cudaStreamWaitEvent");
        if (to->x.recv != from->x.send) {
            if (rdev == sdev)
                CU(cudaMemcpyAsync(to->x.recv, from->x.send, nbytes,
                                   cudaMemcpyDeviceToDevice, cs),
                   "cudaMemcpyAsync");
            else
                CU(cudaMemcpyPeerAsync(to->x.recv, rdev, from->x.send, sdev,
                                       nbytes, cs),
                   "cudaMemcpyPeerAsync");
        }
        CU(cudaEventCreateWithFlags(&done, cudaEventDisableTiming),
           "cudaEventCreateWithFlags");
        CU(cudaEventRecord(done, cs), "cudaEventRecord");
    }
    CU(cudaStreamWaitEvent(r->stream, done, 0), "cudaStreamWaitEvent");
    if (s->stream != r->stream) {
        ra_cuda_leave_device(rdev, prev);
        entered = 0;
        if ((st = ra_cuda_enter_device(sdev, &prev)) != RA_OK) goto exit;
        entered = 1;
        rdev = sdev;
        CU(cudaStreamWaitEvent(s->stream, done, 0), "cudaStreamWaitEvent");
    }
exit:
    if (done != NULL) (void)cudaEventDestroy(done);   /* the waits keep it */
    if (entered) ra_cuda_leave_device(rdev, prev);
    if (st != RA_OK) ra_snprintf(err, n, "%s", ra_last_error());
    return st;
}

/* The block to itself is a device copy and in-place send blocks are set
 * aside in device scratch, both on the compute stream (which the
 * transfers then wait for); the rest are comm_core.c's pairwise steps. */
ra_status ra_tcuda_alltoall(ra_comm *c, const ra_a2a *a, double timeout) {
    int p = c->size, me = c->rank, dev = c->device_id;
    ra_status st = ra_comm_alltoall_check_self(c, a);
    if (st != RA_OK) return st;
    size_t total = 0;
    unsigned char *staged = ra_host_alloc((size_t)p);
    const void **send = ra_host_alloc(sizeof(void *) * (size_t)p);
    char *scratch = NULL;
    if (staged == NULL || send == NULL) {
        st = RA_ERR_NOMEM;
        goto done;
    }
    if ((st = ra_a2a_staged(me, p, a, staged, &total)) != RA_OK) goto done;
    if (total > 0 &&
        (st = ra_cuda_malloc(dev, total, (void **)&scratch)) != RA_OK)
        goto done;
    size_t off = 0;
    for (int i = 0; i < p && st == RA_OK; i++) {
        send[i] = a->send[i];
        if (!staged[i]) continue;
        st = ra_cuda_memcpy(dev, scratch + off, 1, a->send[i], 1,
                            a->send_nbytes[i], 0);
        send[i] = scratch + off;
        off += a->send_nbytes[i];
    }
    if (st == RA_OK && a->send_nbytes[me] > 0 && send[me] != a->recv[me])
        st = ra_cuda_memcpy(dev, a->recv[me], 1, send[me], 1,
                            a->send_nbytes[me], 0);
    if (st == RA_OK && p > 1) {
        ra_a2a b = *a;
        b.send = send;
        st = ra_comm_alltoall_steps(c, &b, timeout);
    }
done:
    if (scratch != NULL) {
        char keep[RA_COMM_MSG_LEN];
        ra_snprintf(keep, sizeof keep, "%s", ra_last_error());
        (void)ra_cuda_free(dev, scratch, total);   /* stream-ordered */
        if (st != RA_OK) ra_set_error(st, "%s", keep);
    }
    ra_host_free(send, sizeof(void *) * (size_t)p);
    ra_host_free(staged, (size_t)p);
    return st;
}

void ra_tcuda_req_done(ra_req *q) {
    tdev_req *d = q->impl;
    if (d == NULL) return;
    q->impl = NULL;
    if (d->ready != NULL) (void)cudaEventDestroy(d->ready);
    ra_host_free(d, sizeof *d);
}

#else /* no CUDA in this build: a group with devices cannot be made */

ra_status ra_tcuda_group_init(ra_tgroup *g) {
    (void)g;
    ra_set_error(RA_ERR_VALUE, "devices needs CUDA, which is not available: "
                 "ringattn was built without CUDA");
    return RA_ERR_VALUE;
}

void ra_tcuda_group_free(ra_tgroup *g) { (void)g; }

ra_status ra_tcuda_post(ra_req *q, char *err, size_t n) {
    (void)q;
    ra_snprintf(err, n, "ringattn was built without CUDA");
    return RA_ERR_UNSUPPORTED;
}

ra_status ra_tcuda_copy(ra_tgroup *g, ra_req *from, ra_req *to, char *err,
                        size_t n) {
    (void)g;
    (void)from;
    (void)to;
    ra_snprintf(err, n, "ringattn was built without CUDA");
    return RA_ERR_UNSUPPORTED;
}

ra_status ra_tcuda_alltoall(ra_comm *c, const ra_a2a *a, double timeout) {
    (void)a;
    (void)timeout;
    ra_set_error(RA_ERR_UNSUPPORTED, "rank %d: alltoall: ringattn was built "
                 "without CUDA", c->rank);
    return RA_ERR_UNSUPPORTED;
}

void ra_tcuda_req_done(ra_req *q) { (void)q; }

#endif
