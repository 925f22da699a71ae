/*
 * comm_request.c -- ringattn._C.Request: one asynchronous sendrecv
 * (Comm.sendrecv_start).  It keeps its send and receive Buffers alive until
 * the transfer finished, waits with the GIL released in slices so Ctrl-C
 * still reaches a stuck rank, and, when dropped in flight, fails the
 * communicator rather than let the backend touch freed memory.
 */
#include "comm/comm_py.h"

/* wait in slices so that Ctrl-C reaches a rank stuck in a long wait */
#define WAIT_SLICE 0.25

int ra_request_wait(RequestObject *self, double timeout) {
    ra_req *r = self->req;
    double until = r->deadline, msg_timeout = r->timeout;
    if (timeout > 0 && ra_now() + timeout < until) {
        until = ra_now() + timeout;
        msg_timeout = timeout;
    }
    int done = ra_comm_test(r);
    while (!done && ra_now() < until) {
        double slice = ra_now() + WAIT_SLICE;
        if (slice > until) slice = until;
        Py_BEGIN_ALLOW_THREADS
        done = ra_req_wait_done(r, slice);
        Py_END_ALLOW_THREADS
        if (!done && PyErr_CheckSignals() < 0) {
            /* the ring cannot resume half-way: fail the communicator */
            ra_comm_abort(r->comm, "interrupted while waiting");
            Py_BEGIN_ALLOW_THREADS
            ra_comm_wait(r, -1);
            Py_END_ALLOW_THREADS
            return -1;
        }
    }
    ra_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ra_comm_wait_until(r, until, msg_timeout);
    Py_END_ALLOW_THREADS
    if (st != RA_OK) {
        ra_raise(st);
        return -1;
    }
    Py_CLEAR(self->send);
    Py_CLEAR(self->recv);
    return 0;
}

static PyObject *request_wait(RequestObject *self, PyObject *args,
                              PyObject *kw) {
    static char *kwlist[] = {"timeout", NULL};
    PyObject *tobj = Py_None;
    double timeout;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O:wait", kwlist, &tobj))
        return NULL;
    if (ra_parse_timeout(tobj, &timeout) < 0) return NULL;
    if (ra_request_wait(self, timeout) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *request_test(RequestObject *self, PyObject *unused) {
    (void)unused;
    if (!ra_comm_test(self->req)) Py_RETURN_FALSE;
    if (ra_request_wait(self, -1) < 0) return NULL;
    Py_RETURN_TRUE;
}

static PyObject *request_get_done(RequestObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(ra_comm_test(self->req));
}

static int request_traverse(RequestObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->comm);
    Py_VISIT(self->send);
    Py_VISIT(self->recv);
    return 0;
}

static void request_dealloc(RequestObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->req != NULL) {
        if (!ra_comm_test(self->req)) {
            /* dropped in flight: the transfer's buffers are about to go, so
             * the communicator cannot continue */
            ra_comm_abort(self->req->comm,
                          "a pending request was dropped without wait()");
            Py_BEGIN_ALLOW_THREADS
            ra_comm_wait(self->req, -1);
            Py_END_ALLOW_THREADS
        }
        ra_req_release(self->req);
        self->req = NULL;
    }
    Py_CLEAR(self->send);
    Py_CLEAR(self->recv);
    Py_CLEAR(self->comm);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMethodDef request_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))request_wait,
     METH_VARARGS | METH_KEYWORDS,
     "wait(timeout=None)\n--\n\nBlock (GIL released) until the transfer "
     "finished.  Raises CommError on failure or when the deadline passes."},
    {"test", (PyCFunction)request_test, METH_NOARGS,
     "test()\n--\n\nTrue when finished (raises CommError if it failed)."},
    {"__reduce__", ra_refuse_pickle, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef request_getset[] = {
    {"done", (getter)request_get_done, NULL, "True once finished", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot request_slots[] = {
    {Py_tp_dealloc, request_dealloc},
    {Py_tp_traverse, request_traverse},
    {Py_tp_methods, request_methods},
    {Py_tp_getset, request_getset},
    {Py_tp_doc, "An asynchronous sendrecv (Comm.sendrecv_start).  Keeps its "
                "buffers alive until finished."},
    {0, NULL},
};

static PyType_Spec request_spec = {
    .name = "ringattn._C.Request",
    .basicsize = sizeof(RequestObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = request_slots,
};

int ra_request_exec(PyObject *m, ra_module_state *st) {
    st->RequestType = (PyTypeObject *)PyType_FromModuleAndSpec(
        m, &request_spec, NULL);
    if (st->RequestType == NULL) return -1;
    return PyModule_AddType(m, st->RequestType);
}
