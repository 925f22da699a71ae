/*
 * comm.c -- the Python face of the communicators: ringattn._C.Comm, and
 * ra_comm_exec, which adds it, Request (comm_request.c) and the
 * constructors (comm_create.c) to the module.
 *
 * This file checks arguments (turning any array-like into a Buffer, with
 * errors naming the argument), releases the GIL around everything that can
 * block, and dispatches to the backend through ra_comm's vtable.  The
 * transports know nothing of Python (comm_core.c, comm_host.c,
 * comm_threads.c, comm_nccl.c).
 */
#include "comm/comm_py.h"
#include "core/buffer.h"

#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <string.h>
#include <structmember.h>

/* ---- helpers ----------------------------------------------------------- */

PyObject *ra_refuse_pickle(PyObject *self, PyObject *unused) {
    (void)unused;
    PyErr_Format(PyExc_TypeError,
                 "cannot pickle '%s': it wraps live connections; create it "
                 "in each process instead (ra.init / ra.launch)",
                 Py_TYPE(self)->tp_name);
    return NULL;
}

int ra_parse_timeout(PyObject *obj, double *out) {
    *out = -1;
    if (obj == NULL || obj == Py_None) return 0;
    double t = PyFloat_AsDouble(obj);
    if (t == -1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError,
                     "timeout must be a number of seconds or None, got %s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (!(t > 0) || !isfinite(t)) {
        PyErr_Format(PyExc_ValueError,
                     "timeout must be a positive number of seconds, got %R",
                     obj);
        return -1;
    }
    *out = t;
    return 0;
}

int ra_comm_usable(CommObject *self, const char *op) {
    if (self->comm == NULL) {
        ra_module_state *st = ra_state_get();
        PyErr_Format(st ? st->CommError : PyExc_RuntimeError,
                     "%s: communicator is closed", op);
        return -1;
    }
    ra_status s = ra_comm_check_usable(self->comm, op);
    if (s != RA_OK) {
        ra_raise(s);
        return -1;
    }
    return 0;
}

int ra_parse_index(PyObject *obj, const char *name, const char *what,
                   long long lo, long long hi, const char *suffix,
                   long long *out) {
    PyObject *index = PyBool_Check(obj) ? NULL : PyNumber_Index(obj);
    if (index == NULL) {
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_TypeError))
            return -1;
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be %s, got %s", name, what,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(index, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        Py_DECREF(index);
        return -1;
    }
    if (overflow || v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "%s must be in [%lld, %lld]%s, got %S",
                     name, lo, hi, suffix, index);
        Py_DECREF(index);
        return -1;
    }
    Py_DECREF(index);
    *out = v;
    return 0;
}

/* Peer argument: None -> -1, else a rank in [0, size). */
static int parse_peer(PyObject *obj, const char *name, int size, int *out) {
    *out = -1;
    if (obj == Py_None) return 0;
    long long v;
    if (ra_parse_index(obj, name, "a rank (int) or None", LLONG_MIN,
                       LLONG_MAX, "", &v) < 0)
        return -1;
    if (v < 0 || v >= size) {
        PyErr_Format(PyExc_ValueError, "%s must be a rank in [0, %d), got "
                     "%lld", name, size, v);
        return -1;
    }
    *out = (int)v;
    return 0;
}

ra_buffer *ra_comm_parse_buffer(CommObject *self, PyObject *obj,
                                const char *name, int writable) {
    ra_buffer *b = ra_buffer_from_object(obj, name, -1);
    if (b == NULL) return NULL;
    const ra_comm_vtable *vt = self->comm->vt;
    int host_ok = b->device_type == RA_DEV_CPU ||
                  b->device_type == RA_DEV_CUDA_HOST;
    if ((vt->device_type == RA_DEV_CPU && !host_ok) ||
        (vt->device_type == RA_DEV_CUDA && b->device_type != RA_DEV_CUDA)) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be %s memory for the '%s' backend, got memory "
                     "on device type %d (id %d)", name,
                     vt->device_type == RA_DEV_CUDA ? "CUDA device" : "host",
                     vt->name, b->device_type, b->device_id);
        goto fail;
    }
    if (vt->device_type == RA_DEV_CUDA &&
        b->device_id != self->comm->device_id) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be on CUDA device %d (this communicator's), "
                     "got device %d", name, self->comm->device_id,
                     b->device_id);
        goto fail;
    }
    if (!ra_buffer_is_contiguous(b)) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be contiguous (row-major); copy it first "
                     "(e.g. numpy.ascontiguousarray)", name);
        goto fail;
    }
    if (writable && b->readonly) {
        PyErr_Format(PyExc_ValueError, "%s must be writable, got a read-only "
                     "array", name);
        goto fail;
    }
    return b;
fail:
    Py_DECREF(b);
    return NULL;
}

/* ---- Comm -------------------------------------------------------------- */

PyObject *ra_comm_wrap(ra_comm *c, PyObject *group) {
    ra_module_state *st = ra_state_get();
    CommObject *self = PyObject_GC_New(CommObject, st->CommType);
    if (self == NULL) {
        Py_BEGIN_ALLOW_THREADS
        ra_comm_free(c);
        Py_END_ALLOW_THREADS
        return NULL;
    }
    self->comm = c;
    self->group = Py_XNewRef(group);
    self->parent = self->children = self->dict = NULL;
    self->closing = 0;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static RequestObject *comm_start(CommObject *self, PyObject *args,
                                 PyObject *kw, const char *fname) {
    static char *kwlist[] = {"send", "dst", "recv", "src", "step", "timeout",
                             NULL};
    PyObject *send_obj, *dst_obj, *recv_obj, *src_obj, *step_obj = NULL;
    PyObject *tobj = Py_None;
    long long step = -1;
    double timeout;
    char fmt[64];
    ra_snprintf(fmt, sizeof fmt, "OOOO|$OO:%s", fname);
    if (!PyArg_ParseTupleAndKeywords(args, kw, fmt, kwlist, &send_obj,
                                     &dst_obj, &recv_obj, &src_obj, &step_obj,
                                     &tobj))
        return NULL;
    if (step_obj != NULL &&
        ra_parse_index(step_obj, "step", "an int", LLONG_MIN, LLONG_MAX, "",
                       &step) < 0)
        return NULL;
    if (ra_parse_timeout(tobj, &timeout) < 0) return NULL;
    if (ra_comm_usable(self, fname) < 0) return NULL;
    ra_comm *c = self->comm;
    ra_xfer x;
    memset(&x, 0, sizeof x);
    x.kind = RA_XFER_DATA;
    x.step = step;
    x.device_id = c->device_id;
    x.device_type = c->vt->device_type;
    if (parse_peer(dst_obj, "dst", c->size, &x.dst) < 0 ||
        parse_peer(src_obj, "src", c->size, &x.src) < 0)
        return NULL;
    if ((send_obj == Py_None) != (x.dst < 0)) {
        PyErr_SetString(PyExc_ValueError,
                        send_obj == Py_None
                            ? "send is None but dst is given: pass both or "
                              "neither"
                            : "dst is None but send is given: pass both or "
                              "neither");
        return NULL;
    }
    if ((recv_obj == Py_None) != (x.src < 0)) {
        PyErr_SetString(PyExc_ValueError,
                        recv_obj == Py_None
                            ? "recv is None but src is given: pass both or "
                              "neither"
                            : "src is None but recv is given: pass both or "
                              "neither");
        return NULL;
    }
    if ((x.dst == c->rank) != (x.src == c->rank)) {
        PyErr_Format(PyExc_ValueError,
                     "a send to self needs a receive from self: dst=%d, "
                     "src=%d on rank %d", x.dst, x.src, c->rank);
        return NULL;
    }
    ra_module_state *mst = ra_state_get();
    RequestObject *req = PyObject_GC_New(RequestObject, mst->RequestType);
    if (req == NULL) return NULL;
    req->comm = Py_NewRef((PyObject *)self);
    req->send = req->recv = NULL;
    req->req = NULL;
    PyObject_GC_Track(req);
    if (send_obj != Py_None) {
        ra_buffer *b = ra_comm_parse_buffer(self, send_obj, "send", 0);
        if (b == NULL) goto fail;
        req->send = (PyObject *)b;
        x.send = b->data;
        x.send_nbytes = (size_t)ra_buffer_numel(b) * ra_buffer_elsize(b);
        x.device_id = b->device_id;
    }
    if (recv_obj != Py_None) {
        ra_buffer *b = ra_comm_parse_buffer(self, recv_obj, "recv", 1);
        if (b == NULL) goto fail;
        req->recv = (PyObject *)b;
        x.recv = b->data;
        x.recv_nbytes = (size_t)ra_buffer_numel(b) * ra_buffer_elsize(b);
    }
    ra_status st;
    ra_req *r = NULL;
    Py_BEGIN_ALLOW_THREADS
    st = ra_comm_start(c, &x, "sendrecv", timeout, &r);
    Py_END_ALLOW_THREADS
    if (st != RA_OK) {
        ra_raise(st);
        goto fail;
    }
    req->req = r;
    return req;
fail:
    Py_DECREF(req);
    return NULL;
}

static PyObject *comm_sendrecv_start(CommObject *self, PyObject *args,
                                     PyObject *kw) {
    return (PyObject *)comm_start(self, args, kw, "sendrecv_start");
}

static PyObject *comm_sendrecv(CommObject *self, PyObject *args,
                               PyObject *kw) {
    RequestObject *req = comm_start(self, args, kw, "sendrecv");
    if (req == NULL) return NULL;
    int rc = ra_request_wait(req, -1);
    Py_DECREF(req);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *comm_barrier(CommObject *self, PyObject *args,
                              PyObject *kw) {
    static char *kwlist[] = {"timeout", NULL};
    PyObject *tobj = Py_None;
    double timeout;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O:barrier", kwlist, &tobj))
        return NULL;
    if (ra_parse_timeout(tobj, &timeout) < 0) return NULL;
    if (ra_comm_usable(self, "barrier") < 0) return NULL;
    ra_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ra_comm_barrier(self->comm, timeout);
    Py_END_ALLOW_THREADS
    if (st != RA_OK) return ra_raise(st);
    Py_RETURN_NONE;
}

static PyObject *comm_allgather(CommObject *self, PyObject *args,
                                PyObject *kw) {
    static char *kwlist[] = {"obj", "timeout", NULL};
    Py_buffer view;
    PyObject *tobj = Py_None;
    double timeout;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*|$O:allgather", kwlist,
                                     &view, &tobj))
        return NULL;
    PyObject *result = NULL;
    size_t *lens = NULL;
    void *all = NULL;
    size_t total = 0;
    if (ra_parse_timeout(tobj, &timeout) < 0 ||
        ra_comm_usable(self, "allgather") < 0)
        goto out;
    if ((size_t)view.len > RA_ALLGATHER_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "obj must be at most %zu bytes, got %zd bytes",
                     RA_ALLGATHER_MAX, view.len);
        goto out;
    }
    ra_comm *c = self->comm;
    lens = PyMem_RawCalloc((size_t)c->size, sizeof(size_t));
    if (lens == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    ra_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ra_comm_allgather(c, view.buf, (size_t)view.len, &all, &total, lens,
                           timeout);
    Py_END_ALLOW_THREADS
    if (st != RA_OK) {
        ra_raise(st);
        goto out;
    }
    result = PyList_New(c->size);
    if (result == NULL) goto out;
    size_t off = 0;
    for (int i = 0; i < c->size; i++) {
        PyObject *item =
            PyBytes_FromStringAndSize((char *)all + off, (Py_ssize_t)lens[i]);
        if (item == NULL) {
            Py_CLEAR(result);
            goto out;
        }
        PyList_SET_ITEM(result, i, item);
        off += lens[i];
    }
out:
    if (all != NULL) ra_host_free(all, total);
    PyMem_RawFree(lens);
    PyBuffer_Release(&view);
    return result;
}

static PyObject *comm_abort(CommObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"reason", NULL};
    const char *reason = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|z:abort", kwlist, &reason))
        return NULL;
    if (self->comm != NULL && !atomic_load(&self->comm->closed)) {
        Py_BEGIN_ALLOW_THREADS
        ra_comm_abort(self->comm, reason);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *comm_close(CommObject *self, PyObject *unused) {
    (void)unused;
    /* a split that finishes on another thread from now on closes its new
     * communicator itself (comm_groups.c) */
    self->closing = 1;
    /* the communicators split from this one first (an nccl split has
     * resources of its own) */
    if (self->children != NULL) {
        PyObject *kids = self->children;
        self->children = NULL;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(kids); i++) {
            PyObject *r = comm_close((CommObject *)PyList_GET_ITEM(kids, i),
                                     NULL);
            Py_XDECREF(r);
        }
        Py_DECREF(kids);
    }
    if (self->comm != NULL) {
        Py_BEGIN_ALLOW_THREADS
        ra_comm_close(self->comm);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *comm_enter(CommObject *self, PyObject *unused) {
    (void)unused;
    return Py_NewRef((PyObject *)self);
}

static PyObject *comm_exit(CommObject *self, PyObject *args) {
    (void)args;
    PyObject *r = comm_close(self, NULL);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static PyObject *comm_stats(CommObject *self, PyObject *unused) {
    (void)unused;
    ra_comm *c = self->comm;
    return Py_BuildValue(
        "{s:K,s:K,s:K}", "bytes_sent",
        (unsigned long long)atomic_load(&c->bytes_sent), "bytes_received",
        (unsigned long long)atomic_load(&c->bytes_received), "messages",
        (unsigned long long)atomic_load(&c->messages));
}

static PyObject *comm_get_rank(CommObject *self, void *x) {
    (void)x;
    return PyLong_FromLong(self->comm->rank);
}
static PyObject *comm_get_size(CommObject *self, void *x) {
    (void)x;
    return PyLong_FromLong(self->comm->size);
}
static PyObject *comm_get_backend(CommObject *self, void *x) {
    (void)x;
    return PyUnicode_FromString(self->comm->vt->name);
}
static PyObject *comm_get_device(CommObject *self, void *x) {
    (void)x;
    if (self->comm->vt->device_type == RA_DEV_CUDA)
        return Py_BuildValue("(si)", "cuda", self->comm->device_id);
    return Py_BuildValue("(si)", "cpu", 0);
}
static PyObject *comm_get_closed(CommObject *self, void *x) {
    (void)x;
    return PyBool_FromLong(atomic_load(&self->comm->closed));
}
static PyObject *comm_get_failed(CommObject *self, void *x) {
    (void)x;
    return PyBool_FromLong(ra_comm_is_failed(self->comm));
}
static PyObject *comm_get_timeout(CommObject *self, void *x) {
    (void)x;
    return PyFloat_FromDouble(self->comm->default_timeout);
}

static PyObject *comm_repr(CommObject *self) {
    ra_comm *c = self->comm;
    return PyUnicode_FromFormat("<ringattn.Comm backend='%s' rank=%d size=%d%s>",
                                c->vt->name, c->rank, c->size,
                                atomic_load(&c->closed)   ? " closed"
                                : ra_comm_is_failed(c)    ? " failed"
                                                          : "");
}

static int comm_traverse(CommObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->group);
    Py_VISIT(self->parent);
    Py_VISIT(self->children);
    Py_VISIT(self->dict);
    return 0;
}

/* Breaks cycles through the children and attributes; the parent stays
 * until dealloc, since a split's communicator runs on its parent's. */
static int comm_clear(CommObject *self) {
    Py_CLEAR(self->children);
    Py_CLEAR(self->dict);
    return 0;
}

static void comm_dealloc(CommObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->comm != NULL) {
        ra_comm *c = self->comm;
        self->comm = NULL;
        Py_BEGIN_ALLOW_THREADS
        ra_comm_free(c);
        Py_END_ALLOW_THREADS
    }
    Py_CLEAR(self->group);
    Py_CLEAR(self->children);
    Py_CLEAR(self->dict);
    Py_CLEAR(self->parent);      /* after the split's own comm is freed */
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

#define SENDRECV_DOC_ARGS                                                     \
    "send: array-like (contiguous host memory for host/threads) or None; "    \
    "dst: rank it goes to.  recv: writable array-like of the same byte size " \
    "as what src sends, or None; src: rank it comes from.  step: ring step, " \
    "checked against the peer's.  timeout: seconds (default: the "            \
    "communicator's, RINGATTN_TIMEOUT or 300)."

static PyMethodDef comm_methods[] = {
    {"sendrecv", (PyCFunction)(void (*)(void))comm_sendrecv,
     METH_VARARGS | METH_KEYWORDS,
     "sendrecv(send, dst, recv, src, *, step=-1, timeout=None)\n--\n\n"
     "Send `send` to rank dst and receive `recv` from rank src at once; "
     "never deadlocks in a ring.  " SENDRECV_DOC_ARGS},
    {"sendrecv_start", (PyCFunction)(void (*)(void))comm_sendrecv_start,
     METH_VARARGS | METH_KEYWORDS,
     "sendrecv_start(send, dst, recv, src, *, step=-1, timeout=None)\n--\n\n"
     "Start a sendrecv and return a Request; the transfer progresses in the "
     "background.  " SENDRECV_DOC_ARGS},
    {"barrier", (PyCFunction)(void (*)(void))comm_barrier,
     METH_VARARGS | METH_KEYWORDS,
     "barrier(timeout=None)\n--\n\nReturn once every rank entered."},
    {"allgather", (PyCFunction)(void (*)(void))comm_allgather,
     METH_VARARGS | METH_KEYWORDS,
     "allgather(obj, *, timeout=None)\n--\n\nGather a small bytes-like "
     "value (at most 1 MiB) from every rank: list of bytes by rank."},
    {"abort", (PyCFunction)(void (*)(void))comm_abort,
     METH_VARARGS | METH_KEYWORDS,
     "abort(reason=None)\n--\n\nFail the communicator: wake every waiter, "
     "stop transfers, tell the peers.  Later calls raise CommError."},
    {"close", (PyCFunction)comm_close, METH_NOARGS,
     "close()\n--\n\nRelease the connections (idempotent, bounded time)."},
    {"split", (PyCFunction)(void (*)(void))ra_comm_split_py,
     METH_VARARGS | METH_KEYWORDS,
     "split(color, key=None, *, timeout=None)\n--\n\nCollective: the ranks "
     "that pass the same color (an int >= 0) form a new Comm, ranked by "
     "(key, rank); key defaults to this rank.  color=None: this rank joins "
     "none and gets None.  host/threads: the new Comm runs on this one's "
     "connections (a failure or abort of either fails both; closing it "
     "leaves this one open); nccl: a new NCCL communicator.  Closing this "
     "Comm closes its splits."},
    {"alltoall", (PyCFunction)(void (*)(void))ra_comm_alltoall_py,
     METH_VARARGS | METH_KEYWORDS,
     "alltoall(sends, recvs, *, timeout=None)\n--\n\nSend sends[i] to rank "
     "i and receive recvs[i] from rank i, for every rank at once (size "
     "entries each; None: nothing).  Blocks may differ in size; recvs[i] "
     "must hold exactly what rank i sends.  Arrays as sendrecv's; every "
     "block moves before the deadline or CommError."},
    {"stats", (PyCFunction)comm_stats, METH_NOARGS,
     "stats()\n--\n\n{'bytes_sent', 'bytes_received', 'messages'} of this "
     "communicator (payload bytes; messages = sends)."},
    {"__enter__", (PyCFunction)comm_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)comm_exit, METH_VARARGS, NULL},
    {"__reduce__", ra_refuse_pickle, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef comm_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL,
     NULL},
    {"rank", (getter)comm_get_rank, NULL, "this rank", NULL},
    {"size", (getter)comm_get_size, NULL, "number of ranks", NULL},
    {"backend", (getter)comm_get_backend, NULL,
     "'host', 'threads' or 'nccl'", NULL},
    {"device", (getter)comm_get_device, NULL,
     "memory it moves: ('cuda', index) for nccl, ('cpu', 0) otherwise",
     NULL},
    {"closed", (getter)comm_get_closed, NULL, "True after close()", NULL},
    {"failed", (getter)comm_get_failed, NULL,
     "True after an error or abort()", NULL},
    {"timeout", (getter)comm_get_timeout, NULL,
     "default deadline of every wait, seconds", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef comm_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(CommObject, dict), READONLY,
     NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot comm_slots[] = {
    {Py_tp_dealloc, comm_dealloc},
    {Py_tp_traverse, comm_traverse},
    {Py_tp_clear, comm_clear},
    {Py_tp_members, comm_members},
    {Py_tp_repr, comm_repr},
    {Py_tp_methods, comm_methods},
    {Py_tp_getset, comm_getset},
    {Py_tp_doc, "A communicator joining `size` ranks (ra.init, ra.launch, "
                "ThreadsGroup.comm).  Every wait has a deadline; after an "
                "error it refuses all further work."},
    {0, NULL},
};

static PyType_Spec comm_spec = {
    .name = "ringattn._C.Comm",
    .basicsize = sizeof(CommObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = comm_slots,
};

int ra_comm_exec(PyObject *m, ra_module_state *st) {
    st->CommType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &comm_spec,
                                                            NULL);
    if (st->CommType == NULL) return -1;
    if (PyModule_AddType(m, st->CommType) < 0) return -1;
    if (ra_request_exec(m, st) < 0) return -1;
    return ra_comm_create_exec(m, st);
}
