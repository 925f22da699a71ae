"""ra.attention / ra.attention_backward against the float64 reference.

Each case compares with ``ringattn.testing.ref_attention[_backward]`` using
``testing.tolerance(dtype)``: max |got - ref| <= atol + rtol * max |ref|
with (rtol, atol) = float64 (1e-10, 1e-12), float32 (2e-5, 1e-6),
float16 (2e-3, 1e-5), bfloat16 (1.6e-2, 1e-4).  lse is float32 arithmetic
for every storage dtype (float64 for float64), so it is held to the
float32 (float64) tolerance.  Backward references take delta =
rowsum(dout * out) from the `out` handed to the kernel (as the kernels do),
so a float16/bfloat16 out's rounding is not charged to the backward kernel.

The grid is not a full cartesian product: every value of every axis
(S in 1, 7, 113, 1023; S_q < S_k and S_q > S_k; D in 1, 8, 59, 64, 128, 256;
GQA ratios 1, 2, 4 and MQA; causal on/off; four dtypes) appears, with the
large sizes paired with small ones, so the file runs in well under a minute.
"""

import numpy as np
import pytest

import ringattn as ra
from ringattn import testing as rt

DTYPES = ["float32", "float64", "float16", "bfloat16"]

# (B, S_q, S_k, H, H_kv, D)
SHAPES = [
    pytest.param((1, 1, 1, 1, 1, 8), id="S1-D8"),
    pytest.param((2, 7, 7, 4, 2, 59), id="S7-gqa2-D59"),
    pytest.param((1, 113, 113, 4, 1, 64), id="S113-mqa-D64"),
    pytest.param((1, 113, 7, 8, 2, 128), id="Sq113-Sk7-gqa4-D128"),
    pytest.param((2, 7, 113, 2, 2, 1), id="Sq7-Sk113-D1"),
    pytest.param((1, 1023, 1023, 2, 1, 64), id="S1023-mqa-D64"),
    pytest.param((1, 1023, 113, 2, 2, 8), id="Sq1023-Sk113-D8"),
    pytest.param((1, 33, 50, 2, 2, 256), id="Sq33-Sk50-D256"),
]


def lse_dtype(dtype):
    return "float64" if dtype == "float64" else "float32"


def forward(q, k, v, **kw):
    out, lse = ra.attention(q, k, v, return_lse=True, **kw)
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference(rng, shape, causal, dtype):
    q, k, v = rt.random_qkv(rng, *shape, dtype)
    out, lse = forward(q, k, v, causal=causal)
    ref_out, ref_lse = rt.ref_attention(q, k, v, causal=causal)
    rt.assert_close(out, ref_out, dtype, name="out")
    rt.assert_close(lse, ref_lse, lse_dtype(dtype), name="lse")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_matches_reference(rng, shape, causal, dtype):
    q, k, v = rt.random_qkv(rng, *shape, dtype)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    out, lse = forward(q, k, v, causal=causal)
    grads = ra.attention_backward(dout, q, k, v, out, lse, causal=causal)
    ref = rt.ref_attention_backward(dout, q, k, v, causal=causal, out=out)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        rt.assert_close(got, want, dtype, name=name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scale", [0.05, 0.3, 2.0])
def test_custom_scale(rng, scale, dtype):
    q, k, v = rt.random_qkv(rng, 1, 37, 41, 4, 2, 32, dtype)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    out, lse = forward(q, k, v, causal=True, scale=scale)
    grads = ra.attention_backward(dout, q, k, v, out, lse, causal=True, scale=scale)
    ref_out, ref_lse = rt.ref_attention(q, k, v, causal=True, scale=scale)
    ref_grads = rt.ref_attention_backward(dout, q, k, v, causal=True, scale=scale,
                                          out=out)
    for name, got, want, dt in zip(("out", "lse", "dq", "dk", "dv"),
                                   (out, lse) + tuple(grads),
                                   (ref_out, ref_lse) + tuple(ref_grads),
                                   (dtype, "float32", dtype, dtype, dtype)):
        rt.assert_close(got, want, dt, name=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_result_types_and_shapes(rng, dtype):
    q, k, v = rt.random_qkv(rng, 2, 5, 9, 4, 2, 8, dtype)
    out, lse = forward(q, k, v)
    grads = ra.attention_backward(np.ones_like(q), q, k, v, out, lse)
    kinds = [(type(x), x.dtype, x.shape) for x in (out, lse) + tuple(grads)]
    want_lse = np.dtype(lse_dtype(dtype))
    assert kinds == [(np.ndarray, q.dtype, q.shape), (np.ndarray, want_lse, (2, 4, 5)),
                     (np.ndarray, q.dtype, q.shape), (np.ndarray, k.dtype, k.shape),
                     (np.ndarray, v.dtype, v.shape)]


def test_return_lse_false_returns_only_out(rng):
    q, k, v = rt.random_qkv(rng, 1, 3, 3, 1, 1, 4, "float32")
    out = ra.attention(q, k, v)
    assert isinstance(out, np.ndarray) and out.shape == q.shape


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_causal_rows_are_zero_and_minus_inf(rng, dtype):
    # S_q > S_k, causal, bottom-right: query rows 0..S_q-S_k-1 see no key
    q, k, v = rt.random_qkv(rng, 2, 9, 4, 2, 1, 16, dtype)
    out, lse = forward(q, k, v, causal=True)
    dq, dk, dv = ra.attention_backward(np.ones_like(q), q, k, v, out, lse, causal=True)
    out64, lse64, dq64 = rt.to_numpy(out), rt.to_numpy(lse), rt.to_numpy(dq)
    assert (np.all(out64[:, :5] == 0) and np.all(np.isneginf(lse64[:, :, :5]))
            and np.all(np.isfinite(lse64[:, :, 5:])) and np.all(dq64[:, :5] == 0)
            and all(np.isfinite(rt.to_numpy(x)).all() for x in (out, dq, dk, dv)))


@pytest.mark.parametrize("S_q,S_k", [(0, 5), (5, 0), (0, 0)])
def test_zero_length_sequences(rng, S_q, S_k):
    q, k, v = rt.random_qkv(rng, 1, S_q, S_k, 2, 2, 8, "float32")
    out, lse = forward(q, k, v)
    dq, dk, dv = ra.attention_backward(np.ones_like(q), q, k, v, out, lse)
    assert (out.shape == q.shape and np.all(out == 0) and np.all(np.isneginf(lse))
            and dq.shape == q.shape and dk.shape == k.shape and np.all(dk == 0)
            and np.all(dv == 0))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_large_scores_do_not_overflow(rng, dtype):
    """Scores far beyond exp's range (|s| up to ~1e3) stay finite and exact.

    A score s carries a rounding error of ~|s| * eps, which moves its softmax
    weight by that relative amount, so the tolerance here is conditioning
    aware: rtol = tolerance(dtype).rtol + 4 * eps * max|s|.
    """
    q, k, v = rt.random_qkv(rng, 1, 17, 17, 2, 2, 16, dtype, scale=8.0)
    out, lse = forward(q, k, v, causal=True, scale=1.0)
    ref_out, ref_lse = rt.ref_attention(q, k, v, causal=True, scale=1.0)
    max_score = float(np.abs(np.einsum("bqhd,bkhd->bhqk", q, k)).max())
    rtol = rt.tolerance(dtype)[0] + 4 * np.finfo(dtype).eps * max_score
    err_out, _, max_out = rt.max_error(out, ref_out)
    err_lse, _, max_lse = rt.max_error(lse, ref_lse)
    assert max_score > 700 and np.isfinite(out).all() and \
        err_out <= rtol * max_out and err_lse <= rtol * max_lse, (err_out, err_lse, rtol)


# ------------------------------------------------------------- strided input

def _transposed_views(rng, dtype):
    """q from (B, H, S, D) storage, k/v from one packed (B, S, 2, H_kv, D) array."""
    B, S, H, H_kv, D = 2, 19, 4, 2, 24
    q = rng.standard_normal((B, H, S, D)).astype(rt.np_dtype(dtype)).transpose(0, 2, 1, 3)
    kv = rng.standard_normal((B, S, 2, H_kv, D)).astype(rt.np_dtype(dtype))
    return q, kv[:, :, 0], kv[:, :, 1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_on_strided_views(rng, dtype):
    q, k, v = _transposed_views(rng, dtype)
    out, lse = forward(q, k, v, causal=True)
    ref_out, ref_lse = rt.ref_attention(q, k, v, causal=True)
    rt.assert_close(out, ref_out, dtype, name="out")
    rt.assert_close(lse, ref_lse, lse_dtype(dtype), name="lse")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_backward_on_strided_views(rng, dtype):
    q, k, v = _transposed_views(rng, dtype)
    B, S, H, D = q.shape
    dout = rng.standard_normal((B, H, S, D)).astype(q.dtype).transpose(0, 2, 1, 3)
    out, lse = forward(q, k, v, causal=True)
    out_view = np.ascontiguousarray(out.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    lse_storage = np.zeros((B, H + 1, S), dtype=lse.dtype)
    lse_storage[:, :H] = lse
    lse_view = lse_storage[:, :H]  # batch stride (H + 1) * S, last dim contiguous
    grads = ra.attention_backward(dout, q, k, v, out_view, lse_view, causal=True)
    ref = rt.ref_attention_backward(dout, q, k, v, causal=True, out=out)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        rt.assert_close(got, want, dtype, name=name)


def test_negative_sequence_stride(rng):
    q, k, v = rt.random_qkv(rng, 1, 12, 12, 2, 2, 8, "float32")
    q, k, v = q[:, ::-1], k[:, ::-1], v[:, ::-1]
    out, lse = forward(q, k, v, causal=True)
    ref_out, ref_lse = rt.ref_attention(q, k, v, causal=True)
    rt.assert_close(out, ref_out, "float32", name="out")
    rt.assert_close(lse, ref_lse, "float32", name="lse")


def test_strided_head_dim_is_copied_or_refused(rng):
    """A last dimension with stride 2 is computed right or refused with ValueError."""
    q, k, v = rt.random_qkv(rng, 1, 11, 11, 2, 2, 16, "float32")
    q_strided = q[..., ::2]
    k_half, v_half = np.ascontiguousarray(k[..., :8]), np.ascontiguousarray(v[..., :8])
    try:
        out = ra.attention(q_strided, k_half, v_half, causal=True)
    except ValueError as exc:
        assert "q" in str(exc)
        return
    rt.assert_close(out, rt.ref_attention(q_strided, k_half, v_half, causal=True)[0],
                    "float32", name="out")


def test_zero_strides_broadcast_input(rng):
    """A kv head broadcast with stride 0 (legal: last dim contiguous) is read right."""
    q, k, v = rt.random_qkv(rng, 1, 9, 9, 4, 1, 8, "float32")
    k4 = np.broadcast_to(k, (1, 9, 4, 8))
    v4 = np.broadcast_to(v, (1, 9, 4, 8))
    out = ra.attention(q, k4, v4, causal=True)
    rt.assert_close(out, rt.ref_attention(q, k, v, causal=True)[0], "float32", name="out")


def test_inputs_are_not_modified(rng):
    q, k, v = rt.random_qkv(rng, 1, 13, 13, 2, 1, 8, "float32")
    dout = rng.standard_normal(q.shape).astype(np.float32)
    before = [x.copy() for x in (q, k, v, dout)]
    out, lse = forward(q, k, v, causal=True)
    out_before, lse_before = out.copy(), lse.copy()
    ra.attention_backward(dout, q, k, v, out, lse, causal=True)
    after = [q, k, v, dout, out, lse]
    assert all(np.array_equal(a, b) for a, b in
               zip(after, before + [out_before, lse_before]))


def test_read_only_inputs(rng):
    q, k, v = rt.random_qkv(rng, 1, 6, 6, 2, 2, 8, "float32")
    for x in (q, k, v):
        x.flags.writeable = False
    out = ra.attention(q, k, v)
    rt.assert_close(out, rt.ref_attention(q, k, v)[0], "float32", name="out")


def test_concurrent_calls_from_threads_agree(rng):
    """Kernels release the GIL: calls from several threads give the serial results."""
    import threading

    cases = [rt.random_qkv(rng, 1, 57, 61, 4, 2, 32, "float32") for _ in range(4)]
    serial = [ra.attention(*c, causal=True) for c in cases]
    results, errors = [[] for _ in cases], []

    def worker(i):
        try:
            for _ in range(10):
                results[i].append(ra.attention(*cases[i], causal=True))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(np.array_equal(r, serial[i])
                              for i in range(len(cases)) for r in results[i])
