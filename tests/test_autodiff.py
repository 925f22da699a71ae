"""Framework autodiff wrappers: ``ringattn.jax`` (custom_vjp, under jit and
grad) and ``ringattn.torch`` (autograd.Function), checked against the float64
reference gradients, locally and over a ring of thread ranks."""

import numpy as np
import pytest

import ringattn as ra
from ringattn.testing import (assert_close, ref_attention_backward,
                              ref_dilated_attention_backward)

SEGS, RATES = [4, 16], [1, 2]


def _inputs(rng, n=37, H=4, Hkv=2, D=8, dtype=np.float64):
    q = rng.standard_normal((1, n, H, D)).astype(dtype)
    k = rng.standard_normal((1, n, Hkv, D)).astype(dtype)
    v = rng.standard_normal((1, n, Hkv, D)).astype(dtype)
    w = rng.standard_normal((1, n, H, D)).astype(dtype)
    return q, k, v, w


# ---- JAX ---------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_jax_grad_matches_reference(jax_module, rng, jit, causal):
    jax, jnp = jax_module, jax_module.numpy
    import ringattn.jax as rj

    q, k, v, w = _inputs(rng)
    loss = lambda q, k, v: jnp.sum(rj.attention(q, k, v, causal=causal) * w)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    if jit:
        grad = jax.jit(grad)
    got = grad(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    ref = ref_attention_backward(w, q, k, v, causal=causal)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert_close(np.asarray(g), r, "float64", name)


def test_jax_dilated_grad_matches_reference(jax_module, rng):
    jax, jnp = jax_module, jax_module.numpy
    import ringattn.jax as rj

    q, k, v, w = _inputs(rng)
    loss = lambda q, k, v: jnp.sum(
        rj.dilated_attention(q, k, v, SEGS, RATES, causal=True) * w)
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    ref = ref_dilated_attention_backward(w, q, k, v, SEGS, RATES, causal=True)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert_close(np.asarray(g), r, "float64", name)


def _jax_ring_rank(comm, q, k, v, w, dilated):
    import jax
    import jax.numpy as jnp

    import ringattn.jax as rj

    jax.config.update("jax_enable_x64", True)
    shard = lambda x: jnp.asarray(ra.shard(x, comm.rank, comm.size, "zigzag"))
    wl = shard(w)

    def loss(q, k, v):
        if dilated:
            out = rj.ring_dilated_attention(q, k, v, comm, SEGS, RATES,
                                            causal=True, layout="zigzag")
        else:
            out = rj.ring_attention(q, k, v, comm, causal=True, layout="zigzag")
        return jnp.sum(out * wl)

    return [np.asarray(g) for g in
            jax.grad(loss, argnums=(0, 1, 2))(shard(q), shard(k), shard(v))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dilated", [False, True])
def test_jax_ring_grad_matches_reference(jax_module, rng, dilated):
    q, k, v, w = _inputs(rng)
    res = ra.launch(_jax_ring_rank, 3, args=(q, k, v, w, dilated),
                    backend="threads")
    got = [ra.unshard([r[i] for r in res], "zigzag") for i in range(3)]
    if dilated:
        ref = ref_dilated_attention_backward(w, q, k, v, SEGS, RATES, causal=True)
    else:
        n = q.shape[1]
        ref = ref_attention_backward(w, q, k, v, causal=True,
                                     q_pos=np.arange(n), k_pos=np.arange(n))
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert_close(g, r, "float64", name)


# ---- PyTorch -----------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_torch_grad_matches_reference(rng, causal):
    torch = pytest.importorskip("torch")
    import ringattn.torch as rt

    q, k, v, w = _inputs(rng)
    qt, kt, vt = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = rt.attention(qt, kt, vt, causal=causal)
    (out * torch.tensor(w)).sum().backward()
    ref = ref_attention_backward(w, q, k, v, causal=causal)
    for name, t, r in zip(("dq", "dk", "dv"), (qt, kt, vt), ref):
        assert_close(t.grad.numpy(), r, "float64", name)


def test_torch_dilated_grad_matches_reference(rng):
    torch = pytest.importorskip("torch")
    import ringattn.torch as rt

    q, k, v, w = _inputs(rng)
    qt, kt, vt = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = rt.dilated_attention(qt, kt, vt, SEGS, RATES, causal=True)
    (out * torch.tensor(w)).sum().backward()
    ref = ref_dilated_attention_backward(w, q, k, v, SEGS, RATES, causal=True)
    for name, t, r in zip(("dq", "dk", "dv"), (qt, kt, vt), ref):
        assert_close(t.grad.numpy(), r, "float64", name)
