/*
 * module_state.c -- the state of the one live ringattn._C instance (see
 * module.h): where C code without a module at hand finds the types and
 * exceptions, and the state's GC support.
 */
#include "core/module.h"

static ra_module_state *ra_live_state = NULL;

ra_module_state *ra_state_get(void) { return ra_live_state; }

void ra_state_set(ra_module_state *st) { ra_live_state = st; }

int ra_state_traverse(ra_module_state *st, visitproc visit, void *arg) {
    Py_VISIT(st->BufferType);
    Py_VISIT(st->CommType);
    Py_VISIT(st->RequestType);
    Py_VISIT(st->CommError);
    return 0;
}

void ra_state_clear(ra_module_state *st) {
    Py_CLEAR(st->BufferType);
    Py_CLEAR(st->CommType);
    Py_CLEAR(st->RequestType);
    Py_CLEAR(st->CommError);
}
