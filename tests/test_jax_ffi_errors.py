"""Error ownership of ringattn's XLA FFI handlers, seen from a stand-in
for XLA (tests/ffi_fake_frame.py calls the handlers with hand-built call
frames): a failed call returns exactly one error, made by XLA's API
(error_create) or -- when an XLA API call failed -- the very error XLA
returned, never dropped; a good call returns none and makes none; and a
failure is never reported as success, even when XLA's API cannot make an
error (the process then aborts with a message)."""

import os
import subprocess
import sys

import numpy as np
import pytest

import ringattn as ra
from ringattn import _C

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ffi_fake_frame import FakeXla, qkv_case  # noqa: E402

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "ffi_fake_frame.py")
INVALID_ARGUMENT = 3


def test_a_good_call_returns_no_error_and_makes_none():
    xla = FakeXla()
    args, rets = qkv_case()
    assert xla.call("ringattn_attn_fwd", args, rets) is None
    assert xla.errors == []
    want, want_lse = ra.attention(*args, return_lse=True)
    np.testing.assert_allclose(rets[0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rets[1], want_lse, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["too-few-operands", "bad-result-shape"])
def test_a_failed_call_returns_the_one_error_it_made(case):
    xla = FakeXla()
    args, rets = qkv_case()
    if case == "too-few-operands":
        args, expect = args[:2], "expected 3 to 6 operands, got 2"
    else:
        rets[1] = np.zeros((1, 2, 7), np.float32)
        expect = "lse: expected shape (1, 2, 8)"
    err = xla.call("ringattn_attn_fwd", args, rets)
    assert len(xla.errors) == 1
    sentinel, message, errc = xla.errors[0]
    assert err == sentinel
    assert message.startswith("ringattn_attn_fwd: ") and expect in message
    assert errc == INVALID_ARGUMENT
    # the message of one call never leaks into the next
    args, rets = qkv_case()
    assert xla.call("ringattn_attn_fwd", args, rets) is None
    assert len(xla.errors) == 1


@pytest.mark.parametrize("mode", ["no-error-create", "null-error"])
def test_a_failure_xla_cannot_be_told_of_is_never_a_success(mode):
    proc = subprocess.run([sys.executable, HARNESS, mode], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout
    assert "the failed call returned" not in proc.stdout
    assert "ringattn_attn_fwd failed and XLA's FFI API gave no way to " \
           "report it" in proc.stderr
    assert "expected 3 to 6 operands" in proc.stderr


def test_a_good_call_needs_no_error_create():
    xla = FakeXla(error_create=False)
    args, rets = qkv_case()
    assert xla.call("ringattn_attn_fwd", args, rets) is None


@pytest.mark.skipif("CUDA" not in _C.ffi_targets(),
                    reason="a CPU-only build has no CUDA handlers")
def test_the_stream_getters_error_is_handed_back_not_leaked():
    """XLA's error from stream_get is the caller's to own: the CUDA handler
    returns that very object (before any CUDA call, so no GPU is needed)
    and makes no other."""
    xla = FakeXla(stream_error=0xABC0)
    args, rets = qkv_case()
    err = xla.call("ringattn_attn_fwd", args, rets, platform="CUDA")
    assert err == 0xABC0
    assert xla.errors == []
