"""Repeated calls leak neither references nor memory.

Three measures, each over many calls after a warm-up: sys.getrefcount of
every input is unchanged; ra.memory_stats()["cpu"]["current"] (bytes the C
core holds) returns to its baseline once results are dropped; and the
growth of tracemalloc's traced total (Python and PyMem_Raw allocations)
stays under a small bound (64 KiB over 200 calls, i.e. well under one
leaked result per call).
"""

import gc
import sys
import tracemalloc

import numpy as np
import pytest

import ringattn as ra
from ringattn import testing as rt

CALLS = 200
GROWTH_BOUND = 64 * 1024


def _inputs(dtype="float32"):
    rng = np.random.default_rng(7)
    q, k, v = rt.random_qkv(rng, 1, 33, 40, 4, 2, 16, dtype)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    out, lse = ra.attention(q, k, v, causal=True, return_lse=True)
    return q, k, v, dout, out, lse


def _call_attention(q, k, v, dout, out, lse):
    ra.attention(q, k, v, causal=True, return_lse=True)


def _call_backward(q, k, v, dout, out, lse):
    ra.attention_backward(dout, q, k, v, out, lse, causal=True)


def _call_merge(q, k, v, dout, out, lse):
    ra.merge(out, lse, out, lse)


def _call_dlpack(q, k, v, dout, out, lse):
    buf = ra.from_dlpack(q)
    buf.numpy()
    np.from_dlpack(ra.from_dlpack(lse))  # NumPy cannot import bfloat16 capsules
    buf.__dlpack__()
    buf.__dlpack__(max_version=(1, 0))
    np.from_dlpack(ra.empty((16,), dtype="float32"))


def _call_errors(q, k, v, dout, out, lse):
    for bad_call in (lambda: ra.attention(q, k[:, :, :1, :8], v),
                     lambda: ra.attention(q, k.astype(np.float64), v),
                     lambda: ra.attention_backward(dout, q, k, v, out, lse[:, :1]),
                     lambda: ra.merge(out, lse, out[:, :1], lse)):
        try:
            bad_call()
        except (ValueError, TypeError):
            pass


CALLERS = [_call_attention, _call_backward, _call_merge, _call_dlpack, _call_errors]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("call", CALLERS, ids=lambda f: f.__name__[6:])
def test_input_refcounts_are_unchanged(call, dtype):
    args = _inputs(dtype)
    call(*args)
    before = [sys.getrefcount(a) for a in args]
    for _ in range(CALLS):
        call(*args)
    gc.collect()
    assert [sys.getrefcount(a) for a in args] == before


@pytest.mark.parametrize("call", CALLERS, ids=lambda f: f.__name__[6:])
def test_core_memory_returns_to_baseline(call):
    args = _inputs()
    call(*args)
    gc.collect()
    baseline = ra.memory_stats()["cpu"]["current"]
    for _ in range(CALLS):
        call(*args)
    gc.collect()
    assert ra.memory_stats()["cpu"]["current"] == baseline


@pytest.mark.parametrize("call", CALLERS, ids=lambda f: f.__name__[6:])
def test_traced_memory_growth_is_bounded(call):
    args = _inputs()
    for _ in range(20):
        call(*args)
    gc.collect()
    tracemalloc.start()
    try:
        for _ in range(10):
            call(*args)
        gc.collect()
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(CALLS):
            call(*args)
        gc.collect()
        growth = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert growth < GROWTH_BOUND, f"traced memory grew by {growth} bytes over {CALLS} calls"


def test_memory_stats_count_allocations_and_peak():
    ra.reset_peak_memory_stats()
    before = ra.memory_stats()["cpu"]
    buf = ra.empty((1024,), dtype="float64")
    during = ra.memory_stats()["cpu"]
    del buf
    gc.collect()
    after = ra.memory_stats()["cpu"]
    assert (during["current"] - before["current"] >= 8192
            and during["allocations"] > before["allocations"]
            and after["current"] == before["current"]
            and after["peak"] >= during["current"])


def test_memory_stats_has_cpu_and_cuda_sections():
    stats = ra.memory_stats()
    assert all(set(stats[kind]) >= {"current", "peak", "allocations"}
               for kind in ("cpu", "cuda"))
