"""ringattn.jax with the mask arguments a JAX program hands over: 64-bit
(and uint32) segment ids under jax.jit are range-checked when the program
runs, never truncated (ids 0 and 2**32 are two documents, or an error),
in ringattn.jax.attention and in the shard_map ring alike; window sides
that are NumPy or JAX integer scalars are read through operator.index, with
or without jax_enable_x64, and a traced side is a TypeError naming window.
Results are checked against the float64 reference (float64 tolerance).
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import ringattn as ra
from ringattn import testing as rt

pytest.importorskip("jax")


def _problem(rng, n=12):
    return rt.random_qkv(rng, 1, n, n, 2, 1, 8, "float64")


def _run(code, devices=1, x64=True):
    """Run `code` in a fresh interpreter (JAX's x64 flag and device count
    are set once per process); its stdout."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(ra.__file__)))
    path = os.pathsep.join([here] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu",
               JAX_ENABLE_X64="1" if x64 else "0",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


# ---- 64-bit ids under jit ---------------------------------------------------

WIDE = [("int64", 2**32), ("int64", -2**31 - 1), ("uint64", 2**63 + 5),
        ("uint32", 2**31)]


@pytest.mark.parametrize("dtype, bad", WIDE, ids=[f"{d}-{b}" for d, b in WIDE])
@pytest.mark.parametrize("which", ["segment_ids", "kv_segment_ids"])
def test_wide_ids_outside_int32_are_refused_under_jit(jax_module, rng, dtype, bad, which):
    jax, jnp = jax_module, jax_module.numpy
    import ringattn.jax as rj

    q, k, v = _problem(rng)
    ids = np.zeros((1, 12), dtype)
    ids[0, 6:] = bad                    # truncated to int32, 2**32 would be 0
    kw = dict(segment_ids=jnp.asarray(np.zeros((1, 12), dtype)))
    kw[which] = jnp.asarray(ids)
    f = jax.jit(lambda q, kw: rj.attention(q, k, v, **kw))
    with pytest.raises(Exception, match=f"{which}: expected ids that fit in int32"):
        np.asarray(f(q, kw))
    with pytest.raises(ValueError, match=which):      # eager: the C core's check
        rj.attention(q, k, v, **kw)


@pytest.mark.parametrize("dtype", ["int64", "uint64", "uint32"])
def test_wide_ids_inside_int32_give_the_reference_under_jit(jax_module, rng, dtype):
    """Ids at the ends of int32, as a 64-bit type: documents stay apart,
    forward and gradient."""
    jax, jnp = jax_module, jax_module.numpy
    import ringattn.jax as rj

    q, k, v = _problem(rng)
    hi = 2**31 - 1
    lo = 0 if dtype.startswith("u") else -2**31
    ids = np.repeat(np.array([lo, hi, lo + 1], dtype), 4)[None]
    f = jax.jit(lambda q, k, v, ids: rj.attention(q, k, v, causal=True, segment_ids=ids))
    out = f(q, k, v, jnp.asarray(ids))
    ref, _ = rt.ref_attention(q, k, v, causal=True, segment_ids=ids)
    rt.assert_close(np.asarray(out), ref, "float64")
    dout = rng.standard_normal(q.shape)
    grads = jax.vjp(lambda q, k, v: f(q, k, v, jnp.asarray(ids)), q, k, v)[1](dout)
    refs = rt.ref_attention_backward(dout, q, k, v, causal=True, segment_ids=ids)
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        rt.assert_close(np.asarray(g), r, "float64", name)


def test_wide_ids_under_vmap(jax_module, rng):
    """vmap over a stack of int64 ids: the check walks every stacked row."""
    jax, jnp = jax_module, jax_module.numpy
    import ringattn.jax as rj

    q, k, v = _problem(rng)
    good = np.repeat(np.array([0, 2**31 - 1], np.int64), 6)[None]
    bad = good.copy()
    bad[0, 11] = 2**40
    f = jax.jit(jax.vmap(lambda ids: rj.attention(q, k, v, segment_ids=ids)))
    got = f(jnp.asarray(np.stack([good, good[:, ::-1]])))
    for i, ids in enumerate((good, good[:, ::-1])):
        rt.assert_close(np.asarray(got[i]), rt.ref_attention(q, k, v, segment_ids=ids)[0],
                        "float64", f"out[{i}]")
    with pytest.raises(Exception, match=r"segment_ids: .*\[0, 11\]"):
        np.asarray(f(jnp.asarray(np.stack([good, bad]))))


def test_wide_ids_in_the_shard_map_ring():
    """Two devices under shard_map: int64 ids 0 and 2**32 are an error when
    the program runs; in-range int64 ids give the reference."""
    out = _run("""
        import numpy as np, jax, jax.numpy as jnp
        from jax.sharding import PartitionSpec as P
        import ringattn.jax as rj
        from ringattn.jax_ring import shard_map
        from ringattn import testing as rt
        q, k, v = rt.random_qkv(np.random.default_rng(0), 1, 12, 12, 2, 1, 8, "float64")
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("sp",))
        spec = P(None, "sp")
        ring = jax.jit(shard_map(lambda q, k, v, ids: rj.ring_attention(
            q, k, v, axis_name="sp", causal=True, segment_ids=ids), mesh,
            (spec,) * 4, spec))
        bad = np.zeros((1, 12), np.int64)
        bad[0, 6:] = 2**32
        try:
            np.asarray(ring(q, k, v, jnp.asarray(bad)))
            print("no error")
        except Exception as err:
            print("error:", "segment_ids: expected ids that fit in int32" in str(err))
        ids = np.repeat(np.array([-2**31, 2**31 - 1], np.int64), 6)[None]
        got = np.asarray(ring(q, k, v, jnp.asarray(ids)))
        ref, _ = rt.ref_attention(q, k, v, causal=True, segment_ids=ids)
        rt.assert_close(got, ref, "float64")
        print("close")
    """, devices=2)
    assert out.split() == ["error:", "True", "close"], out


# ---- window sides -----------------------------------------------------------

WINDOW_CODE = """
    import numpy as np, jax, jax.numpy as jnp
    import ringattn.jax as rj
    from ringattn import testing as rt
    q, k, v = rt.random_qkv(np.random.default_rng(1), 1, 10, 10, 2, 1, 8, "float32")
    ref, _ = rt.ref_attention(q, k, v, causal=True, window=(1, 0))
    for w in [(jnp.int32(1), 0), (np.int64(1), jnp.int32(0)), [np.uint8(1), None],
              (jnp.asarray(1), 0)]:
        eager = rj.attention(q, k, v, causal=True, window=w)
        jitted = jax.jit(lambda q: rj.attention(q, k, v, causal=True, window=w))(q)
        for got in (eager, jitted):
            rt.assert_close(np.asarray(got), ref, "float32")
    try:
        jax.jit(lambda q, s: rj.attention(q, k, v, causal=True, window=(s, 0)))(
            q, jnp.int32(1))
        print("no error")
    except TypeError as err:
        print("TypeError", str(err).startswith("window:"))
"""


@pytest.mark.parametrize("x64", [False, True])
def test_window_sides_from_numpy_and_jax_scalars(x64):
    out = _run(WINDOW_CODE, x64=x64)
    assert out.split() == ["TypeError", "True"], out


@pytest.mark.parametrize("window, error", [((-1, 0), ValueError), ((1.5, 0), TypeError),
                                           ((True, 0), TypeError), ((1,), TypeError),
                                           ("ab", TypeError)])
def test_bad_window_sides_name_window(jax_module, rng, window, error):
    import ringattn.jax as rj

    q, k, v = _problem(rng)
    with pytest.raises(error, match="^window: "):
        rj.attention(q, k, v, window=window)


def test_window_beyond_every_position_is_unbounded(jax_module, rng):
    """2**63 (past int64) and 2**61 read as unbounded, as ra.attention does."""
    import ringattn.jax as rj

    q, k, v = _problem(rng)
    ref, _ = rt.ref_attention(q, k, v, causal=True, window=(None, 0))
    for side in (2**61, 2**63, 10**30):
        got = rj.attention(q, k, v, causal=True, window=(side, 0))
        rt.assert_close(np.asarray(got), ref, "float64")
        rt.assert_close(ra.attention(q, k, v, causal=True, window=(side, 0)), ref,
                        "float64")
