/*
 * comm_groups.c -- the Python face of the collectives over groups of
 * ranks: Comm.split (sub-communicators, comm_split.c) and Comm.alltoall
 * (blocks of any size to and from every rank, comm_core.c or the backend's
 * own).  Arguments are checked here, with errors naming them, before any
 * communication; the calls run with the GIL released.
 */
#include "comm/comm_py.h"
#include "core/buffer.h"

#include <string.h>

/* ---- split -------------------------------------------------------------- */

/* An int in [lo, hi] (NumPy integers too) or None (-> none_value). */
static int parse_int_arg(PyObject *obj, const char *name, long lo, long hi,
                         int none_value, int *out) {
    if (obj == Py_None) {
        *out = none_value;
        return 0;
    }
    long long v;
    if (ra_parse_index(obj, name, "an int or None", lo, hi, " or None",
                       &v) < 0)
        return -1;
    *out = (int)v;
    return 0;
}

PyObject *ra_comm_split_py(CommObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"color", "key", "timeout", NULL};
    PyObject *color_obj, *key_obj = Py_None, *tobj = Py_None;
    double timeout;
    int color, key;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O$O:split", kwlist,
                                     &color_obj, &key_obj, &tobj))
        return NULL;
    if (ra_parse_timeout(tobj, &timeout) < 0) return NULL;
    if (ra_comm_usable(self, "split") < 0) return NULL;
    if (parse_int_arg(color_obj, "color", 0, INT32_MAX, -1, &color) < 0 ||
        parse_int_arg(key_obj, "key", INT32_MIN, INT32_MAX, self->comm->rank,
                      &key) < 0)
        return NULL;
    /* forget the splits closed since the last one */
    if (self->children != NULL) {
        for (Py_ssize_t i = PyList_GET_SIZE(self->children) - 1; i >= 0;
             i--) {
            CommObject *kid = (CommObject *)PyList_GET_ITEM(self->children, i);
            if (kid->comm == NULL || atomic_load(&kid->comm->closed))
                if (PySequence_DelItem(self->children, i) < 0) return NULL;
        }
    }
    ra_comm *c = NULL;
    ra_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ra_comm_split(self->comm, color, key, timeout, &c);
    Py_END_ALLOW_THREADS
    if (st != RA_OK) return ra_raise(st);
    if (c == NULL) Py_RETURN_NONE;
    CommObject *kid = (CommObject *)ra_comm_wrap(c, NULL);
    if (kid == NULL) return NULL;
    kid->parent = Py_NewRef((PyObject *)self);
    /* another thread may have closed this communicator while the split
     * ran (GIL released): then its new split closes at once, and telling
     * its members, fails theirs too */
    if (self->closing || atomic_load(&self->comm->closed)) {
        PyObject *r = PyObject_CallMethod((PyObject *)kid, "close", NULL);
        Py_XDECREF(r);
        Py_DECREF(kid);
        if (r == NULL) return NULL;
        ra_module_state *mst = ra_state_get();
        PyErr_Format(mst ? mst->CommError : PyExc_RuntimeError,
                     "rank %d: split: communicator is closed",
                     self->comm->rank);
        return NULL;
    }
    if (self->children == NULL && (self->children = PyList_New(0)) == NULL) {
        Py_DECREF(kid);
        return NULL;
    }
    if (PyList_Append(self->children, (PyObject *)kid) < 0) {
        Py_DECREF(kid);
        return NULL;
    }
    return (PyObject *)kid;
}

/* ---- alltoall ----------------------------------------------------------- */

/* The blocks of one side: `size` Buffers (or NULL for None), their data
 * pointers and byte counts. */
typedef struct side {
    PyObject **bufs;
    void **data;
    size_t *nbytes;
} side;

static void side_free(side *s, int n) {
    if (s->bufs != NULL)
        for (int i = 0; i < n; i++) Py_XDECREF(s->bufs[i]);
    PyMem_Free(s->bufs);
    PyMem_RawFree(s->data);
    PyMem_RawFree(s->nbytes);
}

static int side_parse(CommObject *self, PyObject *seq_obj, const char *name,
                      int writable, side *s) {
    int n = self->comm->size;
    char item_name[64];
    memset(s, 0, sizeof *s);
    PyObject *seq = PySequence_Fast(seq_obj, "");
    if (seq == NULL) {
        PyErr_Format(PyExc_TypeError, "%s must be a list or tuple of %d "
                     "arrays (or None), got %s", name, n,
                     Py_TYPE(seq_obj)->tp_name);
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%s must have one entry per rank (%d), "
                     "got %zd", name, n, PySequence_Fast_GET_SIZE(seq));
        goto fail;
    }
    s->bufs = PyMem_Calloc((size_t)n, sizeof(PyObject *));
    s->data = PyMem_RawCalloc((size_t)n, sizeof(void *));
    s->nbytes = PyMem_RawCalloc((size_t)n, sizeof(size_t));
    if (s->bufs == NULL || s->data == NULL || s->nbytes == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (int i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (item == Py_None) continue;
        ra_snprintf(item_name, sizeof item_name, "%s[%d]", name, i);
        ra_buffer *b = ra_comm_parse_buffer(self, item, item_name, writable);
        if (b == NULL) goto fail;
        s->bufs[i] = (PyObject *)b;
        s->data[i] = b->data;
        s->nbytes[i] = (size_t)ra_buffer_numel(b) * ra_buffer_elsize(b);
    }
    Py_DECREF(seq);
    return 0;
fail:
    Py_DECREF(seq);
    side_free(s, n);
    memset(s, 0, sizeof *s);
    return -1;
}

PyObject *ra_comm_alltoall_py(CommObject *self, PyObject *args,
                              PyObject *kw) {
    static char *kwlist[] = {"sends", "recvs", "timeout", NULL};
    PyObject *sends_obj, *recvs_obj, *tobj = Py_None;
    double timeout;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$O:alltoall", kwlist,
                                     &sends_obj, &recvs_obj, &tobj))
        return NULL;
    if (ra_parse_timeout(tobj, &timeout) < 0) return NULL;
    if (ra_comm_usable(self, "alltoall") < 0) return NULL;
    ra_comm *c = self->comm;
    int n = c->size;
    side send, recv;
    if (side_parse(self, sends_obj, "sends", 0, &send) < 0) return NULL;
    if (side_parse(self, recvs_obj, "recvs", 1, &recv) < 0) {
        side_free(&send, n);
        return NULL;
    }
    PyObject *result = NULL;
    if (send.nbytes[c->rank] != recv.nbytes[c->rank]) {
        PyErr_Format(PyExc_ValueError,
                     "sends[%d] (to this rank) has %zu bytes but recvs[%d] "
                     "holds %zu bytes", c->rank, send.nbytes[c->rank],
                     c->rank, recv.nbytes[c->rank]);
        goto out;
    }
    ra_a2a a;
    memset(&a, 0, sizeof a);
    a.send = (const void *const *)send.data;
    a.send_nbytes = send.nbytes;
    a.recv = (void *const *)recv.data;
    a.recv_nbytes = recv.nbytes;
    a.device_type = c->vt->device_type;
    a.device_id = c->device_id;
    ra_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ra_comm_alltoall(c, &a, timeout);
    Py_END_ALLOW_THREADS
    if (st != RA_OK) {
        ra_raise(st);
        goto out;
    }
    result = Py_NewRef(Py_None);
out:
    side_free(&send, n);
    side_free(&recv, n);
    return result;
}
