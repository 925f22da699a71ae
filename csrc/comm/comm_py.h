/*
 * comm_py.h -- what the Python face of the communicators shares between
 * its files: comm.c (the Comm type and ra_comm_exec), comm_request.c (the
 * Request type), comm_create.c (ThreadsGroup and the module functions
 * that make communicators) and comm_groups.c (Comm.split, Comm.alltoall).
 * Internal; the C core is comm.h.
 */
#ifndef RA_COMM_PY_H
#define RA_COMM_PY_H

#include "core/module.h"
#include "comm/comm.h"

typedef struct CommObject {
    PyObject_HEAD
    ra_comm *comm;
    PyObject *group;          /* ThreadsGroup keeping a threads comm's group */
    PyObject *parent;         /* the Comm split from (its transport), or NULL */
    PyObject *children;       /* list of the Comms split from this one, or
                               * NULL; closed with it */
    PyObject *dict;           /* instance attributes (__dict__: the
                               * Ulysses groups kept on it, ulysses.py) */
    int closing;              /* close() began (set with the GIL held) */
} CommObject;

typedef struct RequestObject {
    PyObject_HEAD
    PyObject *comm;           /* CommObject */
    PyObject *send;           /* Buffers kept alive while in flight */
    PyObject *recv;
    ra_req *req;
} RequestObject;

/* ---- comm.c ------------------------------------------------------------- */

/* Add Comm, Request, ThreadsGroup and the constructors to the module
 * (called by module exec). */
int ra_comm_exec(PyObject *m, ra_module_state *st);

/* __reduce__ of every communicator type: a TypeError naming the type. */
PyObject *ra_refuse_pickle(PyObject *self, PyObject *unused);
/* None -> -1 (backend default); else a positive finite float. */
int ra_parse_timeout(PyObject *obj, double *out);
/* An integer argument: an int or anything with __index__ (NumPy integers)
 * but not a bool, else TypeError "<name> must be <what>, got <type>";
 * outside [lo, hi] ValueError "<name> must be in [lo, hi]<suffix>, got
 * <value>".  0, or -1 with the exception set. */
int ra_parse_index(PyObject *obj, const char *name, const char *what,
                   long long lo, long long hi, const char *suffix,
                   long long *out);
/* A new Comm owning `c` (freed here if that fails); `group` (or NULL) is
 * kept alive with it. */
PyObject *ra_comm_wrap(ra_comm *c, PyObject *group);

/* 0, or -1 with CommError set when the communicator is closed or failed. */
int ra_comm_usable(CommObject *self, const char *op);
/* Array-like -> Buffer the communicator can move (its memory kind and
 * device, contiguous, writable when asked). */
struct ra_buffer *ra_comm_parse_buffer(CommObject *self, PyObject *obj,
                                       const char *name, int writable);

/* ---- comm_groups.c ------------------------------------------------------ */

PyObject *ra_comm_split_py(CommObject *self, PyObject *args, PyObject *kw);
PyObject *ra_comm_alltoall_py(CommObject *self, PyObject *args,
                              PyObject *kw);

/* ---- comm_request.c ----------------------------------------------------- */

/* Wait with the GIL released, in slices, honouring signals; the request's
 * own deadline (or `timeout` > 0, if sooner) bounds it.  0, or -1 with an
 * exception set. */
int ra_request_wait(RequestObject *self, double timeout);
int ra_request_exec(PyObject *m, ra_module_state *st);

/* ---- comm_create.c ------------------------------------------------------ */

int ra_comm_create_exec(PyObject *m, ra_module_state *st);

#endif /* RA_COMM_PY_H */
