/*
 * comm_create.c -- the Python ways to make a communicator:
 * ringattn._C.ThreadsGroup (ranks that are threads of this process),
 * host_comm() (TCP), nccl_comm() (NCCL), and the NCCL helpers
 * nccl_unique_id() and nccl_version().  Arguments are checked here, the
 * backends' constructors run with the GIL released, and the result is a
 * Comm (comm.c).
 */
#include "comm/comm_py.h"

#include <stdlib.h>
#include <string.h>

typedef struct GroupObject {
    PyObject_HEAD
    ra_tgroup *group;
} GroupObject;

/* ---- ThreadsGroup ------------------------------------------------------ */

/* One entry of devices=: an int N, "cuda", "cuda:N" or ("cuda", N). */
static int parse_device(PyObject *item, Py_ssize_t i, int *out) {
    PyObject *index = NULL;
    if (PyLong_Check(item) && !PyBool_Check(item)) {
        index = Py_NewRef(item);
    } else if (PyUnicode_Check(item)) {
        const char *str = PyUnicode_AsUTF8(item);
        if (str == NULL) return -1;
        if (strcmp(str, "cuda") == 0) {
            *out = 0;
            return 0;
        }
        if (strncmp(str, "cuda:", 5) == 0 && str[5] >= '0' && str[5] <= '9') {
            char *end = NULL;
            long v = strtol(str + 5, &end, 10);
            if (*end == '\0' && v <= 1 << 20) {
                *out = (int)v;
                return 0;
            }
        }
    } else if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2 &&
               PyUnicode_Check(PyTuple_GET_ITEM(item, 0)) &&
               PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(item, 0),
                                                "cuda") == 0 &&
               PyLong_Check(PyTuple_GET_ITEM(item, 1)) &&
               !PyBool_Check(PyTuple_GET_ITEM(item, 1))) {
        index = Py_NewRef(PyTuple_GET_ITEM(item, 1));
    }
    if (index == NULL) {
        PyErr_Format(PyExc_ValueError, "devices[%zd] must be a CUDA device "
                     "(an int, 'cuda:N' or ('cuda', N)), got %R", i, item);
        return -1;
    }
    int overflow = 0;
    long v = PyLong_AsLongAndOverflow(index, &overflow);
    Py_DECREF(index);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow || v < 0 || v > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "devices[%zd] must be a CUDA device "
                     "index >= 0, got %R", i, item);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* devices=None or a sequence of `size` devices -> *out (PyMem_Malloc'd)
 * or NULL. */
static int parse_devices(PyObject *obj, int size, int **out) {
    *out = NULL;
    if (obj == Py_None) return 0;
    PyObject *seq = PySequence_Fast(obj, "devices must be a list of CUDA "
                                    "devices, one per rank");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n != size) {
        PyErr_Format(PyExc_ValueError, "devices must name one CUDA device per "
                     "rank: expected %d entries, got %zd", size, n);
        Py_DECREF(seq);
        return -1;
    }
    int *devs = PyMem_Malloc(sizeof(int) * (size_t)size);
    if (devs == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (parse_device(PySequence_Fast_GET_ITEM(seq, i), i, &devs[i]) < 0) {
            PyMem_Free(devs);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    *out = devs;
    return 0;
}

static PyObject *group_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"size", "timeout", "devices", NULL};
    int size;
    PyObject *tobj = Py_None, *dobj = Py_None;
    double timeout;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "i|O$O:ThreadsGroup", kwlist,
                                     &size, &tobj, &dobj))
        return NULL;
    if (ra_parse_timeout(tobj, &timeout) < 0) return NULL;
    if (size < 1) {
        PyErr_Format(PyExc_ValueError, "size must be >= 1, got %d", size);
        return NULL;
    }
    int *devices = NULL;
    if (parse_devices(dobj, size, &devices) < 0) return NULL;
    ra_tgroup *g = NULL;
    ra_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ra_tgroup_create_devices(size, timeout, devices, &g);
    Py_END_ALLOW_THREADS
    PyMem_Free(devices);
    if (st != RA_OK) return ra_raise(st);
    GroupObject *self = (GroupObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        ra_tgroup_decref(g);
        return NULL;
    }
    self->group = g;
    return (PyObject *)self;
}

static PyObject *group_comm(GroupObject *self, PyObject *args) {
    int rank;
    if (!PyArg_ParseTuple(args, "i:comm", &rank)) return NULL;
    ra_comm *c = NULL;
    ra_status st = ra_tgroup_comm(self->group, rank, &c);
    if (st != RA_OK) return ra_raise(st);
    return ra_comm_wrap(c, (PyObject *)self);
}

static PyObject *group_abort(GroupObject *self, PyObject *args,
                             PyObject *kw) {
    static char *kwlist[] = {"reason", NULL};
    const char *reason = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|z:abort", kwlist, &reason))
        return NULL;
    /* quick (no waiting); keeping the GIL keeps every Comm alive meanwhile */
    ra_tgroup_abort(self->group, reason);
    Py_RETURN_NONE;
}

static PyObject *group_get_size(GroupObject *self, void *x) {
    (void)x;
    return PyLong_FromLong(ra_tgroup_size(self->group));
}

static void group_dealloc(GroupObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    ra_tgroup_decref(self->group);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMethodDef group_methods[] = {
    {"comm", (PyCFunction)group_comm, METH_VARARGS,
     "comm(rank)\n--\n\nThe communicator of `rank` (once per rank)."},
    {"abort", (PyCFunction)(void (*)(void))group_abort,
     METH_VARARGS | METH_KEYWORDS,
     "abort(reason=None)\n--\n\nFail every rank's communicator at once."},
    {"__reduce__", ra_refuse_pickle, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyObject *group_get_devices(GroupObject *self, void *x) {
    (void)x;
    int n = ra_tgroup_size(self->group);
    if (ra_tgroup_device(self->group, 0) < 0) Py_RETURN_NONE;
    PyObject *t = PyTuple_New(n);
    if (t == NULL) return NULL;
    for (int r = 0; r < n; r++) {
        PyObject *d = Py_BuildValue("(si)", "cuda",
                                    ra_tgroup_device(self->group, r));
        if (d == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, r, d);
    }
    return t;
}

static PyObject *group_get_staged(GroupObject *self, void *x) {
    (void)x;
    int n = ra_tgroup_size(self->group);
    PyObject *out = PyList_New(0);
    for (int a = 0; out != NULL && a < n; a++) {
        for (int b = 0; b < n; b++) {
            if (!ra_tgroup_staged(self->group, a, b)) continue;
            PyObject *pair = Py_BuildValue("(ii)", a, b);
            if (pair == NULL || PyList_Append(out, pair) < 0) {
                Py_XDECREF(pair);
                Py_CLEAR(out);
                break;
            }
            Py_DECREF(pair);
        }
    }
    return out;
}

static PyGetSetDef group_getset[] = {
    {"size", (getter)group_get_size, NULL, "number of ranks", NULL},
    {"devices", (getter)group_get_devices, NULL,
     "each rank's CUDA device as ('cuda', N), or None (host memory)", NULL},
    {"staged", (getter)group_get_staged, NULL,
     "the (src, dst) rank pairs whose copies go through pinned host memory "
     "(their GPUs allow no peer access)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot group_slots[] = {
    {Py_tp_new, group_new},
    {Py_tp_dealloc, group_dealloc},
    {Py_tp_methods, group_methods},
    {Py_tp_getset, group_getset},
    {Py_tp_doc, "ThreadsGroup(size, timeout=None, *, devices=None): ranks "
                "that are threads of this process; group.comm(rank) gives "
                "each its Comm (backend 'threads').  devices: one CUDA "
                "device per rank (int, 'cuda:N' or ('cuda', N); ranks may "
                "share one): the ranks then move CUDA memory of their "
                "device."},
    {0, NULL},
};

static PyType_Spec group_spec = {
    .name = "ringattn._C.ThreadsGroup",
    .basicsize = sizeof(GroupObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = group_slots,
};

/* ---- module functions -------------------------------------------------- */

static PyObject *py_host_comm(PyObject *m, PyObject *args, PyObject *kw) {
    (void)m;
    static char *kwlist[] = {"rank", "world_size", "master_addr",
                             "master_port", "token", "timeout", NULL};
    int rank, size, port = 0;
    const char *addr = "127.0.0.1", *token = "";
    PyObject *tobj = Py_None;
    double timeout;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ii|sisO:host_comm", kwlist,
                                     &rank, &size, &addr, &port, &token,
                                     &tobj))
        return NULL;
    if (ra_parse_timeout(tobj, &timeout) < 0) return NULL;
    if (size < 1) {
        PyErr_Format(PyExc_ValueError, "world_size must be >= 1, got %d",
                     size);
        return NULL;
    }
    if (rank < 0 || rank >= size) {
        PyErr_Format(PyExc_ValueError, "rank must be in [0, %d), got %d",
                     size, rank);
        return NULL;
    }
    ra_comm *c = NULL;
    ra_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ra_host_comm_create(rank, size, addr, port, token, timeout, &c);
    Py_END_ALLOW_THREADS
    if (st != RA_OK) return ra_raise(st);
    return ra_comm_wrap(c, NULL);
}

static PyObject *py_nccl_comm(PyObject *m, PyObject *args, PyObject *kw) {
    (void)m;
    static char *kwlist[] = {"rank", "world_size", "device", "unique_id",
                             "master_addr", "master_port", "token",
                             "timeout", "library", NULL};
    ra_nccl_options o;
    memset(&o, 0, sizeof o);
    PyObject *id_obj = Py_None, *tobj = Py_None;
    const char *addr = "127.0.0.1", *token = "", *library = NULL;
    Py_buffer id_view = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iii|OsisOz:nccl_comm", kwlist,
                                     &o.rank, &o.size, &o.device, &id_obj,
                                     &addr, &o.master_port, &token, &tobj,
                                     &library))
        return NULL;
    if (ra_parse_timeout(tobj, &o.timeout) < 0) return NULL;
    if (o.size < 1) {
        PyErr_Format(PyExc_ValueError, "world_size must be >= 1, got %d",
                     o.size);
        return NULL;
    }
    if (o.rank < 0 || o.rank >= o.size) {
        PyErr_Format(PyExc_ValueError, "rank must be in [0, %d), got %d",
                     o.size, o.rank);
        return NULL;
    }
    if (o.device < 0) {
        PyErr_Format(PyExc_ValueError, "device must be a CUDA device index "
                     ">= 0, got %d", o.device);
        return NULL;
    }
    if (id_obj != Py_None) {
        if (PyObject_GetBuffer(id_obj, &id_view, PyBUF_SIMPLE) < 0)
            return NULL;
        if (id_view.len != RA_NCCL_ID_BYTES) {
            PyErr_Format(PyExc_ValueError, "unique_id must be %d bytes "
                         "(ra.nccl_unique_id()), got %zd bytes",
                         RA_NCCL_ID_BYTES, id_view.len);
            PyBuffer_Release(&id_view);
            return NULL;
        }
        o.unique_id = (const unsigned char *)id_view.buf;
    } else if (o.size > 1 && o.master_port <= 0) {
        PyErr_SetString(PyExc_ValueError,
                        "nccl_comm needs unique_id, or master_port for the "
                        "host rendezvous, when world_size > 1");
        return NULL;
    }
    o.master_addr = addr;
    o.token = token;
    o.library = library;
    ra_comm *c = NULL;
    ra_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ra_nccl_comm_create(&o, &c);
    Py_END_ALLOW_THREADS
    if (id_obj != Py_None) PyBuffer_Release(&id_view);
    if (st != RA_OK) return ra_raise(st);
    return ra_comm_wrap(c, NULL);
}

static PyObject *py_nccl_unique_id(PyObject *m, PyObject *args,
                                   PyObject *kw) {
    (void)m;
    static char *kwlist[] = {"library", NULL};
    const char *library = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|z:nccl_unique_id", kwlist,
                                     &library))
        return NULL;
    unsigned char id[RA_NCCL_ID_BYTES];
    ra_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ra_nccl_unique_id(library, id);
    Py_END_ALLOW_THREADS
    if (st != RA_OK) return ra_raise(st);
    return PyBytes_FromStringAndSize((const char *)id, RA_NCCL_ID_BYTES);
}

static PyObject *py_nccl_version(PyObject *m, PyObject *args, PyObject *kw) {
    (void)m;
    static char *kwlist[] = {"library", NULL};
    const char *library = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|z:nccl_version", kwlist,
                                     &library))
        return NULL;
    int major = 0, minor = 0, patch = 0;
    ra_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ra_nccl_version(library, &major, &minor, &patch);
    Py_END_ALLOW_THREADS
    if (st != RA_OK) return ra_raise(st);
    return Py_BuildValue("(iii)", major, minor, patch);
}

static PyMethodDef comm_module_functions[] = {
    {"host_comm", (PyCFunction)(void (*)(void))py_host_comm,
     METH_VARARGS | METH_KEYWORDS,
     "host_comm(rank, world_size, master_addr='127.0.0.1', master_port=0, "
     "token='', timeout=None)\n--\n\nJoin a TCP ('host') communicator: rank "
     "0 serves the rendezvous on (master_addr, master_port); every "
     "connection proves `token`.  Blocks until all ranks joined or the "
     "timeout passed (CommError)."},
    {"nccl_comm", (PyCFunction)(void (*)(void))py_nccl_comm,
     METH_VARARGS | METH_KEYWORDS,
     "nccl_comm(rank, world_size, device, unique_id=None, "
     "master_addr='127.0.0.1', master_port=0, token='', timeout=None, "
     "library=None)\n--\n\nJoin an NCCL ('nccl') communicator on CUDA "
     "device `device`.  unique_id: 128 bytes from nccl_unique_id() shared "
     "by all ranks; None: rank 0 makes one and hands it out over a host "
     "rendezvous on (master_addr, master_port) proving `token` (kept for "
     "barrier/allgather).  library: a libnccl.so.2 path tried after "
     "RINGATTN_NCCL_LIBRARY and libnccl.so.2.  Blocks until all ranks "
     "joined or the timeout passed (CommError)."},
    {"nccl_unique_id", (PyCFunction)(void (*)(void))py_nccl_unique_id,
     METH_VARARGS | METH_KEYWORDS,
     "nccl_unique_id(library=None)\n--\n\nA fresh 128-byte NCCL unique id "
     "(bytes) for nccl_comm."},
    {"nccl_version", (PyCFunction)(void (*)(void))py_nccl_version,
     METH_VARARGS | METH_KEYWORDS,
     "nccl_version(library=None)\n--\n\n(major, minor, patch) of the NCCL "
     "library ringattn loads; raises if it cannot load."},
    {NULL, NULL, 0, NULL},
};

int ra_comm_create_exec(PyObject *m, ra_module_state *st) {
    (void)st;
    PyTypeObject *group_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(m, &group_spec, NULL);
    if (group_type == NULL) return -1;
    int rc = PyModule_AddType(m, group_type);   /* the module keeps it */
    Py_DECREF(group_type);
    if (rc < 0) return -1;
    return PyModule_AddFunctions(m, comm_module_functions);
}
