/*
 * ffi_targets.h -- the hook through which csrc/xla/ adds
 * ringattn._C.ffi_targets() to the module (ffi_targets.c).
 */
#ifndef RA_XLA_FFI_TARGETS_H
#define RA_XLA_FFI_TARGETS_H

#include "core/module.h"

/* Adds ffi_targets() -> {platform: {target name: PyCapsule}}. */
int ra_xla_exec(PyObject *m, ra_module_state *st);

#endif /* RA_XLA_FFI_TARGETS_H */
