"""NaN and infinities in q, k, v (DESIGN 2): a NaN score (NaN in q or k, or
an infinity times 0, or +inf minus +inf) makes every row that sees it NaN,
out and lse, and in the backward dq of those rows and dk, dv of the keys
they see, as NumPy, flash-attn and jax.nn.dot_product_attention do; a row
that sees no key stays (0, -inf) and rows that do not see the NaN keep
their values.  Checked against the float64 reference (ringattn.testing,
which writes that behaviour down) with the dtype's tolerance, on the plain
kernels, every SIMD level, the dilated path, the merge, the comm ring and
the XLA FFI handlers.

The backward kernels may make more NaN than the reference: a NaN input
multiplies the exact zeros of the masked pairs that share its tile
(0 * NaN), so their gradients are compared with extra_nan=True; every NaN
the reference has must be there.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import ringattn as ra
from ringattn import testing as rt

N_Q, N_K, H, H_KV, D = 150, 140, 4, 2, 8   # S_q > S_k: causal rows 0..9 see nothing


def _spoil(case, q, k, v):
    """Put the case's non-finite values into copies of q, k, v."""
    q, k, v = q.copy(), k.copy(), v.copy()
    if case == "q_nan":
        q[0, 70, 1, 3] = np.nan
    elif case == "k_nan":
        k[0, 0, 0, 5] = np.nan               # seen by every non-empty row of heads 0, 1
        k[1, 100, 1, 0] = np.nan
    elif case == "inf_times_zero":
        q[0, 80, 2, 4] = np.inf
        k[0, :, 1, 4] = 0.0                  # inf * 0: NaN scores of row 80, head 2
    elif case == "plus_inf":
        q[1, 90, 3, 0] = np.inf              # +inf and -inf scores: inf - inf
    elif case == "v_nan":
        v[0, 30, 0, 2] = np.nan
    return q, k, v


CASES = ["q_nan", "k_nan", "inf_times_zero", "plus_inf", "v_nan"]
MASKS = {
    "full": dict(),
    "causal": dict(causal=True),
    "masked": dict(causal=True, window=(50, 0), softcap=2.5,
                   segment_ids=np.repeat([0, 1], [75, 75])[None].repeat(2, 0),
                   kv_segment_ids=np.repeat([0, 1], [65, 75])[None].repeat(2, 0)),
}


def _problem(rng, case, dtype):
    q, k, v = rt.random_qkv(rng, 2, N_Q, N_K, H, H_KV, D, "float64")
    q, k, v = _spoil(case, q, k, v)
    dt = rt.np_dtype(dtype)
    dout = rng.standard_normal(q.shape).astype(dt)
    with np.errstate(invalid="ignore", over="ignore"):
        return q.astype(dt), k.astype(dt), v.astype(dt), dout


def _check(q, k, v, dout, dtype, case, kw, got_fwd, got_bwd):
    """got_* against the reference; the forward's NaN exactly (v's NaN may
    reach more rows of its tile), the backward's at least."""
    ref_out, ref_lse = rt.ref_attention(q, k, v, **kw)
    # a soft cap turns an infinite score into a finite one: no NaN there
    capped_inf = case == "plus_inf" and kw.get("softcap")
    assert np.isnan(ref_out).any() != bool(capped_inf), "the case tests nothing"
    out, lse = got_fwd
    rt.assert_close(out, ref_out, dtype, "out", extra_nan=case == "v_nan")
    rt.assert_close(lse, ref_lse, "float64" if dtype == "float64" else "float32",
                    "lse")
    ref_grads = rt.ref_attention_backward(dout, q, k, v, out=out, **kw)
    for name, g, r in zip(("dq", "dk", "dv"), got_bwd, ref_grads):
        rt.assert_close(g, r, dtype, name, extra_nan=True)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_nan_reaches_the_rows_that_see_it(rng, dtype, case, mask):
    q, k, v, dout = _problem(rng, case, dtype)
    kw = MASKS[mask]
    out, lse = ra.attention(q, k, v, return_lse=True, **kw)
    grads = ra.attention_backward(dout, q, k, v, out, lse, **kw)
    _check(q, k, v, dout, dtype, case, kw, (out, lse), grads)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_nan_in_half_precision_storage(rng, dtype):
    pytest.importorskip("ml_dtypes")
    q, k, v, dout = _problem(rng, "k_nan", dtype)
    out, lse = ra.attention(q, k, v, return_lse=True, causal=True)
    grads = ra.attention_backward(dout, q, k, v, out, lse, causal=True)
    _check(q, k, v, dout, dtype, "k_nan", dict(causal=True), (out, lse), grads)


def test_rows_that_see_no_key_stay_empty_beside_nan(rng):
    """Causal rows 0..9 see no key: (0, -inf) and zero dq, never NaN, while
    key 0 (the first every other row sees) is NaN."""
    q, k, v, dout = _problem(rng, "k_nan", "float32")
    out, lse = ra.attention(q, k, v, return_lse=True, causal=True)
    dq, _, _ = ra.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert (np.all(out[:, :10] == 0) and np.all(np.isneginf(lse[:, :, :10]))
            and np.all(dq[:, :10] == 0) and np.isnan(out[0, 10:, :2]).all())


@pytest.mark.parametrize("simd", ["generic", "avx2", "avx512"])
def test_nan_on_every_simd_level(simd, tmp_path):
    """The tile kernels of every SIMD level (chosen once per process: a
    subprocess; a level the CPU lacks runs the best it has)."""
    code = (
        "import numpy as np, ringattn as ra, sys\n"
        "sys.path.insert(0, %r)\n"
        "import test_nan as t\n"
        "rng = np.random.default_rng(1)\n"
        "for dt in ('float32', 'float64'):\n"
        "    for case in t.CASES:\n"
        "        for kw in t.MASKS.values():\n"
        "            q, k, v, do = t._problem(rng, case, dt)\n"
        "            out, lse = ra.attention(q, k, v, return_lse=True, **kw)\n"
        "            g = ra.attention_backward(do, q, k, v, out, lse, **kw)\n"
        "            t._check(q, k, v, do, dt, case, kw, (out, lse), g)\n"
        "print(ra.cpu_info()['simd'])\n") % os.path.dirname(os.path.abspath(__file__))
    here = os.path.dirname(os.path.dirname(os.path.abspath(ra.__file__)))
    path = os.pathsep.join([here] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = dict(os.environ, RINGATTN_CPU_SIMD=simd, PYTHONPATH=path)
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() in (simd, "avx2", "generic")


@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_dilated_attention(rng, causal):
    n, segs, rates = 90, [16, 40, 90], [1, 2, 4]
    q, k, v = rt.random_qkv(rng, 1, n, n, 4, 2, 8, "float64")
    q[0, 33, 1, 0] = np.nan
    k[0, 60, 0, 1] = np.nan
    dout = rng.standard_normal(q.shape)
    out, lse = ra.dilated_attention(q, k, v, segs, rates, causal=causal,
                                    return_lse=True)
    ref_out, ref_lse = rt.ref_dilated_attention(q, k, v, segs, rates, causal=causal)
    assert np.isnan(ref_lse).any() and not np.isnan(ref_lse).all()
    rt.assert_close(out, ref_out, "float64", "out")
    rt.assert_close(lse, ref_lse, "float64", "lse")
    grads = ra.dilated_attention_backward(dout, q, k, v, out, lse, segs, rates,
                                          causal=causal)
    refs = rt.ref_dilated_attention_backward(dout, q, k, v, segs, rates,
                                             causal=causal)
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        rt.assert_close(g, r, "float64", name, extra_nan=True)


def test_merge_keeps_nan(rng):
    """A NaN part merged with an empty one (or a finite one) is NaN."""
    o1, o2 = rng.standard_normal((2, 1, 3, 1, 4))
    l1 = np.array([[[np.nan, np.nan, 0.5]]])
    l2 = np.array([[[-np.inf, 0.3, np.nan]]])
    out, lse = ra.merge(o1, l1, o2, l2)
    ref_out, ref_lse = rt.ref_merge(o1, l1, o2, l2)
    assert np.isnan(ref_lse).all()
    rt.assert_close(out, ref_out, "float64", "out")
    rt.assert_close(lse, ref_lse, "float64", "lse")


def _ring_body(comm, q, k, v, dout, causal):
    r, p = comm.rank, comm.size
    qs, ks, vs, ds = (ra.shard(x, r, p, "zigzag") for x in (q, k, v, dout))
    out, lse = ra.ring_attention(qs, ks, vs, comm, causal=causal, layout="zigzag",
                                 return_lse=True)
    return (out, lse) + tuple(ra.ring_attention_backward(
        ds, qs, ks, vs, out, lse, comm, causal=causal, layout="zigzag"))


@pytest.mark.parametrize("causal", [False, True])
def test_nan_through_the_ring(rng, causal):
    """NaN in a shard of q and of k, three ranks: the merged state keeps it
    across ring steps, and dk/dv bring it home."""
    n = 61
    q, k, v, dout = rt.random_problem(rng, 1, n, 2, 1, 8, "float64")
    q[0, 40, 0, 2] = np.nan
    if causal:                  # without, every row would see it
        k[0, 5, 0, 1] = np.nan
    results = ra.launch(_ring_body, 3, args=(q, k, v, dout, causal),
                        backend="threads", timeout=60)
    got = [ra.unshard([res[i] for res in results], "zigzag", axis=2 if i == 1 else 1)
           for i in range(5)]
    pos = np.arange(n)
    kw = dict(causal=causal, q_pos=pos, k_pos=pos)
    ref_out, ref_lse = rt.ref_attention(q, k, v, **kw)
    refs = (ref_out, ref_lse) + rt.ref_attention_backward(dout, q, k, v, out=got[0], **kw)
    assert np.isnan(ref_lse).any() and not np.isnan(ref_lse).all()
    for i, (name, g, r) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), got, refs)):
        rt.assert_close(g, r, "float64", name, extra_nan=i >= 2)


@pytest.mark.parametrize("case, mask", [("q_nan", "masked"), ("k_nan", "masked"),
                                        ("plus_inf", "causal")])
def test_nan_through_the_xla_handlers(rng, case, mask):
    """ringattn.jax.attention under jit (the FFI custom calls), forward and
    gradient."""
    from conftest import require_jax

    jax = require_jax()
    import jax.numpy as jnp
    import ringattn.jax as rj

    q, k, v, dout = _problem(rng, case, "float64")
    kw = MASKS[mask]
    jkw = {key: jnp.asarray(x) if key.endswith("ids") else x for key, x in kw.items()}

    @jax.jit
    def step(q, k, v, dout):
        (out, lse), pullback = jax.vjp(
            lambda q, k, v: rj.attention(q, k, v, return_lse=True, **jkw), q, k, v)
        return (out, lse) + pullback((dout, jnp.zeros_like(lse)))

    got = [np.asarray(x) for x in step(*(jnp.asarray(x) for x in (q, k, v, dout)))]
    _check(q, k, v, dout, "float64", case, kw, got[:2], got[2:])
