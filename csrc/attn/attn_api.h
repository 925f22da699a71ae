/*
 * attn_api.h -- the attention functions of ringattn._C, as the module's
 * init sees them: attn_api.c (attn_fwd, dilated_fwd, init_state, the CPU
 * queries) and attn_api_bwd.c (attn_bwd, dilated_bwd, attn_bwd_preprocess,
 * merge).  Argument checks are in attn_args.h, the kernels' params in
 * attn_params.h.
 */
#ifndef RA_ATTN_API_H
#define RA_ATTN_API_H

#include "core/module.h"

/* The backward entry points and the merge (attn_api_bwd.c). */
extern PyMethodDef ra_attn_bwd_functions[];

/* Add every attention function to the module (called by module exec). */
int ra_attn_exec(PyObject *m, ra_module_state *st);

#endif /* RA_ATTN_API_H */
