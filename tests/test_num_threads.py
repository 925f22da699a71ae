"""num_threads means one thing at every C entry point (and in the XLA
handlers, tests/test_jax_ffi_results.py): None or 0 is the default
(RINGATTN_NUM_THREADS, else OpenMP's), 1..4096 that many threads; anything
else is refused before any work, and the result never depends on it."""

import numpy as np
import pytest

from ringattn import _C

B, S, H, D = 1, 7, 2, 4


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, S, H, D)).astype(np.float32)
               for _ in range(3))
    out, lse = (np.from_dlpack(x) for x in _C.attn_fwd(q, k, v))
    return q, k, v, out, lse


def _calls():
    q, k, v, out, lse = _arrays()
    return {
        "attn_fwd": lambda **kw: _C.attn_fwd(q, k, v, **kw),
        "dilated_fwd": lambda **kw: _C.dilated_fwd(q, k, v, [4], [1], **kw),
        "attn_bwd": lambda **kw: _C.attn_bwd(q, q, k, v, out, lse, **kw),
        "dilated_bwd": lambda **kw: _C.dilated_bwd(q, q, k, v, out, lse, [4],
                                                   [1], **kw),
        "attn_bwd_preprocess": lambda **kw: _C.attn_bwd_preprocess(q, out,
                                                                   **kw),
        "merge": lambda **kw: _C.merge(out, lse, q, lse, **kw),
    }


NAMES = list(_calls())


def _result(x):
    xs = x if isinstance(x, tuple) else (x,)
    return [np.from_dlpack(a).copy() for a in xs]


@pytest.mark.parametrize("name", NAMES)
def test_default_and_counts_give_one_result(name):
    call = _calls()[name]
    want = _result(call())
    for n in (None, 0, 1, 3, np.int64(2)):
        for got, ref in zip(_result(call(num_threads=n)), want):
            np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [-1, 4097, 2 ** 40, 2 ** 70])
def test_out_of_range_is_a_value_error(name, n):
    with pytest.raises(ValueError,
                       match=rf"^num_threads: expected None or 0 .* or "
                             rf"1\.\.4096, got {n}$"):
        _calls()[name](num_threads=n)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", ["2", 2.0, True])
def test_not_an_int_is_a_type_error(name, n):
    with pytest.raises(TypeError, match="^num_threads: expected an int or None"):
        _calls()[name](num_threads=n)
