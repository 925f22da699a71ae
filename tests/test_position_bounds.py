"""Position keywords of the C entry points are bounded: every position
offset + stride * i stays inside +-2^60 (|offset| + stride * rows < 2^60,
checked without overflow), so no position arithmetic in a kernel --
differences, offset + window side -- can overflow int64.  Out of range is
a ValueError naming the keyword, the bound and the value, before any work;
values just inside run and agree with the reference.  (The XLA handlers'
position tables: tests/test_jax_ffi_results.py.)"""

import numpy as np
import pytest

import ringattn as ra
from ringattn import _C

B, S, H, D = 1, 8, 2, 4
LIMIT = 2 ** 60


def _qkv(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, S, H, D)).astype(np.float32)
            for _ in range(3)]


def _fwd(**kw):
    q, k, v = _qkv()
    return _C.attn_fwd(q, k, v, causal=True, **kw)


def _bwd(**kw):
    q, k, v = _qkv()
    out, lse = _C.attn_fwd(q, k, v)
    return _C.attn_bwd(q, q, k, v, out, lse, causal=True, **kw)


def _dilated_fwd(**kw):
    q, k, v = _qkv()
    return _C.dilated_fwd(q, k, v, [4], [1], **kw)


def _dilated_bwd(**kw):
    q, k, v = _qkv()
    out, lse = _C.dilated_fwd(q, k, v, [4], [1])
    return _C.dilated_bwd(q, q, k, v, out, lse, [4], [1], **kw)


DENSE = [_fwd, _bwd]
ALL = DENSE + [_dilated_fwd, _dilated_bwd]

BAD_DENSE = [
    (dict(q_pos_offset=LIMIT), "q_pos_offset, q_pos_stride"),
    (dict(q_pos_offset=-LIMIT), "q_pos_offset, q_pos_stride"),
    (dict(q_pos_offset=LIMIT - S), "q_pos_offset, q_pos_stride"),
    (dict(q_pos_offset=-(LIMIT - S)), "q_pos_offset, q_pos_stride"),
    (dict(q_pos_stride=2 ** 58), "q_pos_offset, q_pos_stride"),
    (dict(q_pos_stride=2 ** 62), "q_pos_offset, q_pos_stride"),
    (dict(k_pos_offset=LIMIT - 1), "k_pos_offset, k_pos_stride"),
    (dict(k_pos_stride=2 ** 63 - 1), "k_pos_offset, k_pos_stride"),
    (dict(k_pos_offset=2 ** 63 - 1), "k_pos_offset, k_pos_stride"),
    (dict(k_pos_offset=-(2 ** 63)), "k_pos_offset, k_pos_stride"),
    # beyond int64: a ValueError naming the keyword, not an OverflowError
    (dict(q_pos_offset=2 ** 70), "q_pos_offset"),
    (dict(k_pos_stride=-(2 ** 70)), "k_pos_stride"),
]


@pytest.mark.parametrize("call", DENSE, ids=lambda f: f.__name__)
@pytest.mark.parametrize("kw,names", BAD_DENSE,
                         ids=[str(kw) for kw, _ in BAD_DENSE])
def test_dense_positions_out_of_range(call, kw, names):
    with pytest.raises(ValueError) as info:
        call(**kw)
    msg = str(info.value)
    assert msg.startswith(names + ":"), msg
    assert "2^60" in msg
    value = next(iter(kw.values()))
    if abs(value) < 2 ** 63:
        assert str(value) in msg, msg


@pytest.mark.parametrize("call", DENSE, ids=lambda f: f.__name__)
@pytest.mark.parametrize("kw", [dict(q_pos_stride=0), dict(k_pos_stride=-1)],
                         ids=str)
def test_dense_stride_below_one(call, kw):
    name, value = next(iter(kw.items()))
    with pytest.raises(ValueError,
                       match=f"^{name}: expected >= 1, got {value}$"):
        call(**kw)


BAD_DILATED = [
    (dict(q_pos_offset=LIMIT - 4, k_pos_offset=0), "q_pos_offset"),
    (dict(q_pos_offset=0, k_pos_offset=-LIMIT), "k_pos_offset"),
    (dict(q_pos_offset=0, k_pos_offset=2 ** 64), "k_pos_offset"),
]


@pytest.mark.parametrize("call", [_dilated_fwd, _dilated_bwd],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("kw,name", BAD_DILATED,
                         ids=[str(kw) for kw, _ in BAD_DILATED])
def test_dilated_positions_out_of_range(call, kw, name):
    with pytest.raises(ValueError, match="^" + name):
        call(**kw)


@pytest.mark.parametrize("call", ALL, ids=lambda f: f.__name__)
def test_not_an_int_is_a_type_error(call):
    with pytest.raises(TypeError, match="k_pos_offset: expected an int"):
        call(k_pos_offset=1.5)


def test_positions_just_inside_the_bound_run_and_are_right():
    """Shifting q and k by the same amount changes nothing: near +2^60 and
    near -2^60 the result is the plain causal one."""
    q, k, v = _qkv(1)
    want, want_lse = ra.attention(q, k, v, causal=True, return_lse=True)
    for base in (LIMIT - S - 1, -(LIMIT - S - 1)):
        out, lse = (np.from_dlpack(x) for x in _C.attn_fwd(
            q, k, v, causal=True, q_pos_offset=base, k_pos_offset=base))
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-6)
        dout = np.ones_like(q)
        got = _C.attn_bwd(dout, q, k, v, out, lse, causal=True,
                          q_pos_offset=base, k_pos_offset=base)
        ref = ra.attention_backward(dout, q, k, v, want, want_lse, causal=True)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(np.from_dlpack(g), r, rtol=1e-4, atol=1e-5)
