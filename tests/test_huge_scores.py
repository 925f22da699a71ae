"""Huge but finite scores: the CPU backward stays finite and right.

With q scaled by 1e9 (float32) or 1e18 (float64) every softmax row is one
key; the backward's P = 2^(S - L) must give that key P = 1 although L, kept
in the acc dtype, is off by ulps of its huge value (DESIGN §2: lse float32).
Checked locally, dilated, and through the ring and the dilated ring, in
every dtype, against the float64 reference (max-subtracted softmax); the
rings also on thread ranks with CUDA arrays (marked gpu).

Tolerance: ``ringattn.testing.tolerance(dtype)`` rtol times the larger of
max |ref| and the size of the terms a gradient sums (dq: scale |dS| |k|,
dk: scale |dS| |q| with |dS| <= 2 D |dout| |v|; dv: |dout|): the exact dk
and dq are 0 here while every term is ~1e9, so a relative error can only be
measured against the terms.
"""

import numpy as np
import pytest

import ringattn as ra
from ringattn import testing as rt

LAUNCH_TIMEOUT = 60
SEGS, RATES = [4, 8], [1, 2]

# dtype -> factor on q (within the dtype's range)
HUGE = {"float32": 1e9, "float64": 1e18, "float16": 2e3, "bfloat16": 1e9}


def problem(dtype, n=13, B=1, H=4, H_kv=2, D=16, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.standard_normal(s)
                     for s in [(B, n, H, D), (B, n, H_kv, D), (B, n, H_kv, D),
                               (B, n, H, D)])
    q = np.clip(q, -4, 4) * HUGE[dtype]
    cast = lambda x: x.astype(rt.np_dtype(dtype))
    return cast(q), cast(k), cast(v), cast(dout)


def check(got, q, k, v, dout, dtype, bias=None):
    """got: (out, lse, dq, dk, dv) of a causal call over global positions."""
    f64 = lambda x: rt.to_numpy(x).astype(np.float64)
    pos = np.arange(q.shape[1])
    kw = dict(causal=True, q_pos=pos, k_pos=pos, bias=bias)
    ref_out, ref_lse = rt.ref_attention(q, k, v, **kw)
    # delta from the kernel's own (rounded) out, as the kernels take it
    ref = (ref_out, ref_lse) + rt.ref_attention_backward(
        dout, q, k, v, out=got[0], **kw)
    D = q.shape[-1]
    scale = 1 / np.sqrt(D)
    ds = 2 * D * np.abs(f64(dout)).max() * np.abs(f64(v)).max()
    terms = {"dq": scale * ds * np.abs(f64(k)).max(),
             "dk": scale * ds * np.abs(f64(q)).max(),
             "dv": np.abs(f64(dout)).max()}
    rtol, atol = rt.tolerance(dtype)
    bad = []
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        a = f64(a)
        if not np.isfinite(a).all():
            bad.append(f"{name}: non-finite values")
            continue
        err = float(np.abs(a - r).max())
        bound = atol + rtol * max(float(np.abs(r).max()), terms.get(name, 0))
        if not err <= bound:
            bad.append(f"{name}: max error {err:.3e} > {bound:.3e}")
    return bad


DTYPES = ["float32", "float64", "float16", "bfloat16"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_local_backward_with_huge_scores(dtype):
    q, k, v, dout = problem(dtype)
    out, lse = ra.attention(q, k, v, causal=True, return_lse=True)
    grads = ra.attention_backward(dout, q, k, v, out, lse, causal=True)
    bad = check((out, lse) + grads, q, k, v, dout, dtype)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dilated_backward_with_huge_scores(dtype):
    q, k, v, dout = problem(dtype, n=16)
    out, lse = ra.dilated_attention(q, k, v, SEGS, RATES, causal=True,
                                    return_lse=True)
    grads = ra.dilated_attention_backward(dout, q, k, v, out, lse, SEGS,
                                         RATES, causal=True)
    bias = rt.dilated_bias(16, SEGS, RATES, q.shape[2])
    bad = check((out, lse) + grads, q, k, v, dout, dtype, bias=bias)
    assert not bad, "\n".join(bad)


def ring_body(comm, q, k, v, dout, layout, dilated):
    r, p, dev = comm.rank, comm.size, getattr(comm, "device", None)
    qs, ks, vs, ds = (ra.shard(x, r, p, layout) for x in (q, k, v, dout))
    if dev is not None:         # thread ranks on a CUDA device
        qs, ks, vs, ds = (ra.to_device(x, dev) for x in (qs, ks, vs, ds))
    if dilated:
        out, lse = ra.ring_dilated_attention(qs, ks, vs, comm, SEGS, RATES,
                                             causal=True, layout=layout,
                                             return_lse=True)
        grads = ra.ring_dilated_attention_backward(
            ds, qs, ks, vs, out, lse, comm, SEGS, RATES, causal=True,
            layout=layout)
    else:
        out, lse = ra.ring_attention(qs, ks, vs, comm, causal=True,
                                     layout=layout, return_lse=True)
        grads = ra.ring_attention_backward(ds, qs, ks, vs, out, lse, comm,
                                           causal=True, layout=layout)
    res = (out, lse) + tuple(grads)
    if dev is not None:
        res = tuple(ra.to_device(x, "cpu").numpy() for x in res)
    return res


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("dilated", [False, True], ids=["dense", "dilated"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ring_backward_with_huge_scores(dtype, dilated, layout):
    n = 16
    q, k, v, dout = problem(dtype, n=n)
    results = ra.launch(ring_body, 3, args=(q, k, v, dout, layout, dilated),
                        backend="threads", timeout=LAUNCH_TIMEOUT)
    got = [ra.unshard([res[i] for res in results], layout,
                      axis=2 if i == 1 else 1) for i in range(5)]
    bias = rt.dilated_bias(n, SEGS, RATES, q.shape[2]) if dilated else None
    bad = check(got, q, k, v, dout, dtype, bias=bias)
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
@pytest.mark.skipif(not ra.cuda_available(), reason="no CUDA device")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dilated", [False, True], ids=["dense", "dilated"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ring_backward_with_huge_scores_on_cuda(dtype, dilated):
    """The same through thread ranks on a CUDA device (the CUDA kernels'
    exponent rule; dilated: pairs two branches share get half each)."""
    n, layout = 16, "zigzag"
    q, k, v, dout = problem(dtype, n=n)
    results = ra.launch(ring_body, 3, args=(q, k, v, dout, layout, dilated),
                        backend="threads", timeout=LAUNCH_TIMEOUT,
                        devices=[0, 0, 0])
    got = [ra.unshard([res[i] for res in results], layout,
                      axis=2 if i == 1 else 1) for i in range(5)]
    bias = rt.dilated_bias(n, SEGS, RATES, q.shape[2]) if dilated else None
    bad = check(got, q, k, v, dout, dtype, bias=bias)
    assert not bad, "\n".join(bad)
