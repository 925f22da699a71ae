"""The cotangent of lse (``dlse=``) in every public backward entry point.

A cotangent g of lse adds g_i * P_ij to dS (d lse_i / d s_ij = P_ij), which
the kernels get as delta - g.  Checked against
``ringattn.testing.ref_attention_backward(..., dlse=g)`` (float64) locally,
with masks and GQA, over rings of thread ranks (p in {2, 3}, every layout),
and for dilated attention (merged lse) locally and over the ring; the
dilated rule is also checked by finite differences of the LongNet-style
per-branch reference, independent of the bias form.  Tolerance:
``ringattn.testing.tolerance(dtype)`` (max |a - ref| <= atol + rtol *
max |ref|; rtol 1e-10 for float64, 2e-5 for float32).
"""

import numpy as np
import pytest

import ringattn as ra
from ringattn.testing import (assert_close, dilated_bias, random_qkv,
                              ref_attention, ref_attention_backward,
                              ref_dilated_attention_by_branches,
                              ref_segment_ids)

LAYOUTS = ("contiguous", "zigzag", "striped")
SEGS, RATES = [5, 12], [1, 2]
LAUNCH_TIMEOUT = 120


def _problem(rng, B, S_q, S_k, H, H_kv, D, dtype):
    q, k, v = random_qkv(rng, B, S_q, S_k, H, H_kv, D, dtype)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    acc = np.float64 if dtype == "float64" else np.float32
    dlse = rng.standard_normal((B, H, S_q)).astype(acc)
    return q, k, v, dout, dlse


def _check(got, ref, dtype, names=("dq", "dk", "dv")):
    for name, g, r in zip(names, got, ref):
        assert_close(g, r, dtype, name)


# ---- local attention -------------------------------------------------------

MASKS = [
    dict(),
    dict(softcap=1.5),
    dict(window=(3, 2)),
    dict(window=(4, 0), softcap=2.0),
    dict(docs=True),
    dict(docs=True, window=(None, 3), softcap=3.0),
]


def _docs(rng, B, n):
    cu = np.concatenate([[0], np.sort(rng.choice(np.arange(1, n), 3,
                                                 replace=False)), [n]])
    return np.repeat(ref_segment_ids(cu, n), B, axis=0)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("S_q, S_k, H, H_kv", [(13, 13, 4, 2), (7, 23, 3, 1),
                                               (1, 1, 2, 2)])
def test_attention_backward_dlse(rng, dtype, mask, causal, S_q, S_k, H, H_kv):
    mask = dict(mask)
    q, k, v, dout, dlse = _problem(rng, 2, S_q, S_k, H, H_kv, 5, dtype)
    if mask.pop("docs", False):
        if S_q == S_k and S_q > 3:
            mask["segment_ids"] = _docs(rng, 2, S_q)
        else:       # ids of their own for the keys; some rows see no key
            mask["segment_ids"] = rng.integers(0, 2, (2, S_q), np.int32)
            mask["kv_segment_ids"] = rng.integers(0, 2, (2, S_k), np.int32)
    kw = dict(causal=causal, **mask)
    q = 4 * q                                     # the softcap bites
    out, lse = ra.attention(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = ref_attention(q, k, v, **kw)
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")
    got = ra.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **kw)
    # delta from the kernel's own (rounded) out, as the kernels take it
    ref = ref_attention_backward(dout, q, k, v, out=out, dlse=dlse, **kw)
    _check(got, ref, dtype)


def test_dlse_none_and_zeros_agree_exactly(rng):
    q, k, v, dout, dlse = _problem(rng, 1, 17, 17, 4, 2, 8, "float32")
    out, lse = ra.attention(q, k, v, causal=True, return_lse=True)
    plain = ra.attention_backward(dout, q, k, v, out, lse, causal=True)
    zero = ra.attention_backward(dout, q, k, v, out, lse, causal=True,
                                 dlse=np.zeros_like(dlse))
    for a, b in zip(plain, zero):
        np.testing.assert_array_equal(a, b)


def test_dlse_alone_gives_no_dv(rng):
    """lse does not depend on v: with dout = 0 only dq, dk move."""
    q, k, v, dout, dlse = _problem(rng, 1, 11, 19, 2, 1, 4, "float64")
    out, lse = ra.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = ra.attention_backward(np.zeros_like(dout), q, k, v, out, lse,
                                       causal=True, dlse=dlse)
    assert not dv.any() and np.abs(dq).max() > 0 and np.abs(dk).max() > 0
    ref = ref_attention_backward(np.zeros_like(dout), q, k, v, causal=True,
                                 dlse=dlse)
    _check((dq, dk, dv), ref, "float64")


def test_dlse_strided_view(rng):
    """A non-contiguous dlse (a transposed view) is read by its strides."""
    q, k, v, dout, dlse = _problem(rng, 2, 9, 9, 3, 3, 4, "float64")
    out, lse = ra.attention(q, k, v, return_lse=True)
    view = np.ascontiguousarray(dlse.transpose(0, 2, 1)).transpose(0, 2, 1)
    assert not view.flags.c_contiguous
    got = ra.attention_backward(dout, q, k, v, out, lse, dlse=view)
    _check(got, ref_attention_backward(dout, q, k, v, dlse=dlse), "float64")


# ---- dilated attention -----------------------------------------------------

@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, H, H_kv", [(29, 4, 2), (13, 3, 1)])
def test_dilated_attention_backward_dlse(rng, dtype, causal, n, H, H_kv):
    q, k, v, dout, dlse = _problem(rng, 2, n, n, H, H_kv, 6, dtype)
    out, lse = ra.dilated_attention(q, k, v, SEGS, RATES, causal=causal,
                                    return_lse=True)
    bias = dilated_bias(n, SEGS, RATES, H)
    ref_out, ref_lse = ref_attention(q, k, v, causal=causal, bias=bias)
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")
    got = ra.dilated_attention_backward(dout, q, k, v, out, lse, SEGS, RATES,
                                        causal=causal, dlse=dlse)
    ref = ref_attention_backward(dout, q, k, v, causal=causal, bias=bias,
                                 out=out, dlse=dlse)
    _check(got, ref, dtype)
    attn = ra.DilatedAttention(SEGS, RATES, causal=causal)
    _check(attn.backward(dout, q, k, v, out, lse, dlse=dlse), ref, dtype)


def test_dilated_merged_lse_gradient_by_finite_differences(rng):
    """The merged lse = log sum_b exp(lse_b) of the branches, built the
    LongNet way (per branch, then merged), differentiated numerically: its
    gradient is what dlse= adds (the derivation in ringattn.lse_cotangent).
    Central differences, step 1e-5, float64: truncation ~1e-10."""
    n, H, D, segs, rates = 11, 2, 3, [4, 8], [1, 2]
    q, k, v, _, g = _problem(rng, 1, n, n, H, 1, D, "float64")
    out, lse = ra.dilated_attention(q, k, v, segs, rates, causal=True,
                                    return_lse=True)
    dq, dk, dv = ra.dilated_attention_backward(
        np.zeros_like(q), q, k, v, out, lse, segs, rates, causal=True,
        dlse=g)
    assert not dv.any()

    def loss(q, k):
        lse = ref_dilated_attention_by_branches(q, k, v, segs, rates,
                                                causal=True)[1]
        return float(np.sum(np.where(np.isfinite(lse), lse, 0.0) * g))

    eps = 1e-5
    for x, grad, name in ((q, dq, "dq"), (k, dk, "dk")):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus, minus = x.copy(), x.copy()
            plus[idx] += eps
            minus[idx] -= eps
            args = (plus, k) if name == "dq" else (q, plus)
            back = (minus, k) if name == "dq" else (q, minus)
            numeric[idx] = (loss(*args) - loss(*back)) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, rtol=0, atol=1e-7,
                                   err_msg=name)


# ---- rings of thread ranks -------------------------------------------------

def _ring_rank(comm, q, k, v, dout, dlse, layout, kw, dilated):
    r, p = comm.rank, comm.size
    qs, ks, vs, ds = (ra.shard(x, r, p, layout) for x in (q, k, v, dout))
    gs = ra.shard(dlse, r, p, layout, axis=2)
    kw = dict(kw, layout=layout)
    if "segment_ids" in kw:
        kw["segment_ids"] = ra.shard(kw["segment_ids"], r, p, layout, axis=1)
    if dilated:
        out, lse = ra.ring_dilated_attention(qs, ks, vs, comm, SEGS, RATES,
                                             return_lse=True, **kw)
        grads = ra.ring_dilated_attention_backward(
            ds, qs, ks, vs, out, lse, comm, SEGS, RATES, dlse=gs, **kw)
    else:
        out, lse = ra.ring_attention(qs, ks, vs, comm, return_lse=True, **kw)
        grads = ra.ring_attention_backward(ds, qs, ks, vs, out, lse, comm,
                                           dlse=gs, **kw)
    return (out, lse) + tuple(grads)


def _run_ring(q, k, v, dout, dlse, p, layout, kw, dilated=False):
    res = ra.launch(_ring_rank, p,
                    args=(q, k, v, dout, dlse, layout, kw, dilated),
                    backend="threads", timeout=LAUNCH_TIMEOUT)
    return [ra.unshard([r[i] for r in res], layout, axis=2 if i == 1 else 1)
            for i in range(5)]


RING_MASKS = [dict(), dict(softcap=2.0, window=(5, 3)), dict(docs=True)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mask", RING_MASKS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("p", [2, 3])
def test_ring_attention_backward_dlse(rng, p, layout, causal, mask):
    n = 23
    q, k, v, dout, dlse = _problem(rng, 2, n, n, 4, 2, 5, "float64")
    kw = dict(mask, causal=causal)
    if kw.pop("docs", False):
        kw["segment_ids"] = _docs(rng, 2, n)
    got = _run_ring(q, k, v, dout, dlse, p, layout, kw)
    pos = np.arange(n)
    ref_out, ref_lse = ref_attention(q, k, v, q_pos=pos, k_pos=pos, **kw)
    ref = ref_attention_backward(dout, q, k, v, q_pos=pos, k_pos=pos,
                                 dlse=dlse, **kw)
    _check(got, (ref_out, ref_lse) + tuple(ref), "float64",
           ("out", "lse", "dq", "dk", "dv"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("p", [2, 3])
def test_ring_dilated_attention_backward_dlse(rng, p, layout, causal):
    n, H = 31, 4
    q, k, v, dout, dlse = _problem(rng, 1, n, n, H, 2, 6, "float64")
    got = _run_ring(q, k, v, dout, dlse, p, layout, dict(causal=causal),
                    dilated=True)
    bias = dilated_bias(n, SEGS, RATES, H)
    ref_out, ref_lse = ref_attention(q, k, v, causal=causal, bias=bias)
    ref = ref_attention_backward(dout, q, k, v, causal=causal, bias=bias,
                                 dlse=dlse)
    _check(got, (ref_out, ref_lse) + tuple(ref), "float64",
           ("out", "lse", "dq", "dk", "dv"))


# ---- bad dlse: a named error before any work -------------------------------

BAD = [
    (lambda g: g[:, :, :-1], ValueError, r"dlse: expected shape \(B, H, S_q\)"),
    (lambda g: g[None], ValueError, "dlse: expected shape"),
    (lambda g: g.astype(np.float16), TypeError, "dlse: expected dtype float32"),
    (lambda g: g.astype(np.float64), TypeError, "dlse: expected dtype float32"),
    (lambda g: g.tolist(), TypeError, "dlse: expected an array"),
]


@pytest.mark.parametrize("bad, error, match", BAD)
def test_local_backwards_refuse_bad_dlse(rng, bad, error, match):
    q, k, v, dout, dlse = _problem(rng, 1, 12, 12, 2, 2, 4, "float32")
    out, lse = ra.attention(q, k, v, return_lse=True)
    with pytest.raises(error, match=match):
        ra.attention_backward(dout, q, k, v, out, lse, dlse=bad(dlse))
    out, lse = ra.dilated_attention(q, k, v, SEGS, RATES, return_lse=True)
    with pytest.raises(error, match=match):
        ra.dilated_attention_backward(dout, q, k, v, out, lse, SEGS, RATES,
                                      dlse=bad(dlse))


def test_other_arguments_are_checked_before_dlse(rng):
    """With dlse the usual checks still run first and name their argument."""
    q, k, v, dout, dlse = _problem(rng, 1, 12, 12, 2, 2, 4, "float32")
    out, lse = ra.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="lse"):
        ra.attention_backward(dout, q, k, v, out, lse[:, :1], dlse=dlse)
    with pytest.raises(ValueError, match="dout"):
        ra.attention_backward(dout[:, :3], q, k, v, out, lse, dlse=dlse)


def _bad_ring_rank(comm, q, k, v, dout, dlse, dilated):
    """Every rank passes a dlse one row short: each raises before any
    communication, so none waits on another."""
    r, p = comm.rank, comm.size
    qs, ks, vs, ds = (ra.shard(x, r, p, "contiguous") for x in (q, k, v, dout))
    gs = ra.shard(dlse, r, p, "contiguous", axis=2)[:, :, 1:]
    if dilated:
        out, lse = ra.ring_dilated_attention(qs, ks, vs, comm, SEGS, RATES,
                                             return_lse=True)
        call = lambda: ra.ring_dilated_attention_backward(
            ds, qs, ks, vs, out, lse, comm, SEGS, RATES, dlse=gs, timeout=5)
    else:
        out, lse = ra.ring_attention(qs, ks, vs, comm, return_lse=True)
        call = lambda: ra.ring_attention_backward(
            ds, qs, ks, vs, out, lse, comm, dlse=gs, timeout=5)
    try:
        call()
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dilated", [False, True])
def test_ring_backwards_refuse_bad_dlse(rng, dilated):
    q, k, v, dout, dlse = _problem(rng, 1, 14, 14, 2, 2, 4, "float32")
    res = ra.launch(_bad_ring_rank, 2, args=(q, k, v, dout, dlse, dilated),
                    backend="threads", timeout=30)
    for msg in res:
        assert msg is not None and msg.startswith("dlse: expected shape")


# ---- framework autodiff through return_lse=True ----------------------------

def _framework_rank(comm, framework, q, k, v, dout, dlse, dilated, uses_out):
    """This rank's (dq, dk, dv) of sum(out * dout) * uses_out +
    sum(lse * dlse) through ringattn.jax / ringattn.torch (zigzag)."""
    r, p = comm.rank, comm.size
    shard = lambda x, axis=1: ra.shard(x, r, p, "zigzag", axis=axis)
    w, g = shard(dout), shard(dlse, 2)
    kw = dict(causal=True, layout="zigzag", return_lse=True)
    if framework == "jax":
        import jax
        import jax.numpy as jnp

        import ringattn.jax as rj

        jax.config.update("jax_enable_x64", True)

        def loss(q, k, v):
            if dilated:
                out, lse = rj.ring_dilated_attention(q, k, v, comm, SEGS,
                                                     RATES, **kw)
            else:
                out, lse = rj.ring_attention(q, k, v, comm, **kw)
            return jnp.sum(out * w) * uses_out + jnp.sum(lse * g)

        grads = jax.grad(loss, argnums=(0, 1, 2))(
            *(jnp.asarray(shard(x)) for x in (q, k, v)))
        return [np.asarray(x) for x in grads]
    import torch

    import ringattn.torch as rt

    ts = [torch.tensor(shard(x), requires_grad=True) for x in (q, k, v)]
    if dilated:
        out, lse = rt.ring_dilated_attention(*ts, comm, SEGS, RATES, **kw)
    else:
        out, lse = rt.ring_attention(*ts, comm, **kw)
    loss = (lse * torch.tensor(g)).sum()
    if uses_out:
        loss = loss + (out * torch.tensor(w)).sum()
    loss.backward()
    return [t.grad.numpy() for t in ts]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("uses_out", [True, False], ids=["out+lse", "lse"])
@pytest.mark.parametrize("dilated", [False, True], ids=["dense", "dilated"])
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_framework_ring_grad_through_lse(rng, framework, dilated, uses_out):
    pytest.importorskip(framework)
    n, H = 27, 4
    q, k, v, dout, dlse = _problem(rng, 1, n, n, H, 2, 5, "float64")
    res = ra.launch(_framework_rank, 3,
                    args=(framework, q, k, v, dout, dlse, dilated, uses_out),
                    backend="threads", timeout=LAUNCH_TIMEOUT)
    got = [ra.unshard([r[i] for r in res], "zigzag") for i in range(3)]
    pos = np.arange(n)
    bias = dilated_bias(n, SEGS, RATES, H) if dilated else None
    ref = ref_attention_backward(dout * uses_out, q, k, v, causal=True,
                                 q_pos=pos, k_pos=pos, bias=bias, dlse=dlse)
    _check(got, ref, "float64")


@pytest.mark.parametrize("dilated", [False, True], ids=["dense", "dilated"])
def test_torch_grad_through_lse_alone(rng, dilated):
    """Only lse is used: out's cotangent is None, one backward call with
    dout = 0 and dlse."""
    torch = pytest.importorskip("torch")
    import ringattn.torch as rt

    n, H = 19, 4
    q, k, v, _, dlse = _problem(rng, 2, n, n, H, 1, 6, "float64")
    ts = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    if dilated:
        _, lse = rt.dilated_attention(*ts, SEGS, RATES, causal=True,
                                      return_lse=True)
    else:
        _, lse = rt.attention(*ts, causal=True, return_lse=True)
    lse.sum().backward()          # an expanded (stride 0) cotangent of ones
    bias = dilated_bias(n, SEGS, RATES, H) if dilated else None
    ref = ref_attention_backward(np.zeros_like(q), q, k, v, causal=True,
                                 bias=bias, dlse=np.ones_like(dlse))
    _check([t.grad.numpy() for t in ts], ref, "float64")
