"""Calls ringattn's registered XLA FFI targets directly with
``jax.ffi.ffi_call``, for tests/test_jax_ffi_results.py.

A separate process, so that a handler that crashes (writing past a
result, say) fails the calling test instead of killing pytest.  Reads a
JSON list of cases on stdin, each ``{"name", "target", "args": [[shape,
dtype] or [shape, dtype, values], ...], "results": [[shape, dtype], ...], "aliases": {arg: result},
"attrs": {name: int list or bool}}``, runs them in order and prints one
JSON line per case as it finishes: ``{"name", "error"}`` (the exception's
message, or null when the call succeeded), flushed before the next case
starts, so the parent knows which case a crash happened in.

usage: python ffi_call_worker.py < CASES.json
"""

import json
import sys

import numpy as np

import jax

import ringattn.jax  # noqa: F401  (registers the targets)


def _value(v):
    if isinstance(v, bool):
        return v
    if isinstance(v, float):
        return np.float64(v)
    if isinstance(v, int):
        return np.int64(v)
    return np.asarray(v, np.int64)


def _arg(spec, rng):
    """[shape, dtype]: random floats or integer zeros; [shape, dtype,
    values]: those values."""
    shape, dtype = spec[:2]
    if len(spec) > 2:
        return np.asarray(spec[2], dtype).reshape(shape)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return np.zeros(shape, dtype)


def run_case(case, rng):
    args = [_arg(spec, rng) for spec in case["args"]]
    results = tuple(jax.ShapeDtypeStruct(tuple(shape), dtype)
                    for shape, dtype in case["results"])
    aliases = {int(a): r for a, r in case.get("aliases", {}).items()} or None
    attrs = {k: _value(v) for k, v in case.get("attrs", {}).items()}
    call = jax.ffi.ffi_call(case["target"], results,
                            vmap_method="expand_dims",
                            input_output_aliases=aliases)
    jax.block_until_ready(call(*args, **attrs))


def main():
    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(7)
    for case in json.load(sys.stdin):
        try:
            run_case(case, rng)
            error = None
        except Exception as exc:   # the handler's error, reported back
            error = str(exc)
        print(json.dumps({"name": case["name"], "error": error}), flush=True)


if __name__ == "__main__":
    main()
