"""``ringattn.jax`` on CUDA devices: the FFI handlers launch ringattn's CUDA
kernels on XLA's stream, into XLA's buffers.  Needs a CUDA build of
ringattn, a GPU and a CUDA-enabled jaxlib (``pip install "jax[cuda12]"``);
skipped otherwise (always on the emulated GPU of a ``RINGATTN_CUDA=emulate``
build: XLA's GPU backend cannot see it).

    python -m pytest -q -m gpu tests/test_jax_ffi_gpu.py
"""

import numpy as np
import pytest

import ringattn as ra
from ringattn.testing import (assert_close, random_problem, ref_attention,
                              ref_attention_backward)

pytestmark = pytest.mark.gpu

jax = pytest.importorskip("jax")
jnp = jax.numpy


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.fixture(scope="module")
def gpus():
    devices = _gpus()
    if not devices:
        why = "JAX has no GPU backend here (install jax[cuda12])"
        if ra.cuda_info().get("emulated"):
            why += "; XLA cannot run on ringattn's emulated GPU"
        pytest.skip(why)
    if "CUDA" not in ra._C.ffi_targets():
        pytest.skip("ringattn was built without CUDA")
    import ringattn.jax  # noqa: F401  (registers the targets)

    jax.config.update("jax_enable_x64", True)
    return devices


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,H,Hkv,D", [(113, 4, 2, 64), (257, 8, 8, 128),
                                       (7, 2, 1, 40)])
def test_attention_on_gpu_matches_reference(gpus, rng, dtype, causal, n, H, Hkv, D):
    import ringattn.jax as rj

    q, k, v, dout = random_problem(rng, 2, n, H, Hkv, D, dtype)
    put = lambda x: jax.device_put(jnp.asarray(x), gpus[0])
    step = jax.jit(lambda q, k, v, g: (lambda o, pb: (o,) + pb(g))(
        *jax.vjp(lambda *a: rj.attention(*a, causal=causal), q, k, v)))
    args = [put(x) for x in (q, k, v, dout)]
    text = step.lower(*args).as_text()
    assert "@ringattn_attn_fwd(" in text and "callback" not in text
    got = step(*args)
    assert all(list(g.devices())[0].platform == "gpu" for g in got)
    ref_out, _ = ref_attention(q, k, v, causal=causal)
    refs = (ref_out,) + tuple(ref_attention_backward(dout, q, k, v,
                                                     causal=causal))
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, refs):
        assert_close(np.asarray(g.astype(jnp.float32)), r, dtype, name)


def test_merge_on_gpu(gpus, rng):
    import ringattn.jax as rj

    o1, o2 = (rng.standard_normal((2, 9, 3, 8)).astype(np.float32) for _ in "ab")
    l1, l2 = (rng.standard_normal((2, 3, 9)).astype(np.float32) for _ in "ab")
    l1[0, 0, :3] = l2[0, 0, :3] = -np.inf
    put = lambda x: jax.device_put(jnp.asarray(x), gpus[0])
    got = jax.jit(rj.merge)(*(put(x) for x in (o1, l1, o2, l2)))
    for g, r in zip(got, ra.merge(o1, l1, o2, l2)):
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("causal", [False, True])
def test_shard_map_ring_on_gpus(gpus, rng, layout, causal):
    """The ring over every visible GPU (one GPU: p = 1), NCCL moving k/v."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    import ringattn.jax as rj

    p = len(gpus)
    n = 48 * p
    q, k, v, dout = random_problem(rng, 1, n, 4, 2, 64, "float32")
    order = np.concatenate(ra.shard_indices(n, p, layout))
    mesh = jax.sharding.Mesh(np.array(gpus), ("sp",))
    spec = P(None, "sp")
    place = lambda x: jax.device_put(jnp.asarray(x[:, order]),
                                     NamedSharding(mesh, spec))
    from ringattn.jax_ring import shard_map

    ring = shard_map(lambda q, k, v: rj.ring_attention(
        q, k, v, axis_name="sp", causal=causal, layout=layout), mesh, spec, spec)
    step = jax.jit(lambda q, k, v, g: (lambda o, pb: (o,) + pb(g))(
        *jax.vjp(ring, q, k, v)))
    got = [np.asarray(x)[:, np.argsort(order)]
           for x in step(*(place(x) for x in (q, k, v, dout)))]
    pos = np.arange(n)
    kw = dict(causal=causal, q_pos=pos, k_pos=pos)
    refs = (ref_attention(q, k, v, **kw)[0],) + tuple(
        ref_attention_backward(dout, q, k, v, **kw))
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, refs):
        assert_close(g, r, "float32", name)
