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


def _jax_ulysses_rank(comm, q, k, v, w, u):
    import jax
    import jax.numpy as jnp

    import ringattn.jax as rj

    jax.config.update("jax_enable_x64", True)
    shard = lambda x: jnp.asarray(ra.shard(x, comm.rank, comm.size, "zigzag",
                                           ulysses=u))
    wl = shard(w)

    def loss(q, k, v):
        out = rj.ring_attention(q, k, v, comm, causal=True, layout="zigzag",
                                ulysses=u)
        return jnp.sum(out * wl)

    return [np.asarray(g) for g in
            jax.grad(loss, argnums=(0, 1, 2))(shard(q), shard(k), shard(v))]


def _check_ulysses_grads(rank_fn, rng, u):
    """4 thread ranks run rank_fn(comm, q, k, v, w, u) -> (dq, dk, dv) of
    sum(out * w) on their zigzag shards; the gathered gradients match the
    float64 reference."""
    q, k, v, w = _inputs(rng)
    res = ra.launch(rank_fn, 4, args=(q, k, v, w, u), backend="threads")
    got = [ra.unshard([r[i] for r in res], "zigzag", ulysses=u)
           for i in range(3)]
    n = q.shape[1]
    ref = ref_attention_backward(w, q, k, v, causal=True,
                                 q_pos=np.arange(n), k_pos=np.arange(n))
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert_close(g, r, "float64", name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("u", [2, 4])
def test_jax_ring_grad_with_ulysses_matches_reference(jax_module, rng, u):
    """ringattn.jax over the comm object with ulysses=u (4 thread ranks)."""
    _check_ulysses_grads(_jax_ulysses_rank, rng, u)


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


def _torch_ulysses_rank(comm, q, k, v, w, u):
    import torch

    import ringattn.torch as rt

    shard = lambda x: torch.tensor(ra.shard(x, comm.rank, comm.size, "zigzag",
                                            ulysses=u), requires_grad=True)
    qt, kt, vt = shard(q), shard(k), shard(v)
    out = rt.ring_attention(qt, kt, vt, comm, causal=True, layout="zigzag",
                            ulysses=u)
    (out * torch.tensor(ra.shard(w, comm.rank, comm.size, "zigzag",
                                 ulysses=u))).sum().backward()
    return [t.grad.numpy() for t in (qt, kt, vt)]


@pytest.mark.parametrize("u", [2, 4])
def test_torch_ring_grad_with_ulysses_matches_reference(rng, u):
    """ringattn.torch autograd through the comm object, ulysses=u."""
    pytest.importorskip("torch")
    _check_ulysses_grads(_torch_ulysses_rank, rng, u)


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


# ---- gradients through lse -----------------------------------------------

def _jnp_reference(jnp, q, k, v, bias):
    """(out, lse) of attention with an additive float64 score bias (0 / -inf
    masks, dilation's log-multiplicity), written in jax.numpy so jax.grad
    differentiates it; no row may be fully masked."""
    H, H_kv, D = q.shape[2], k.shape[2], q.shape[3]
    kh = jnp.repeat(k, H // H_kv, axis=2)
    vh = jnp.repeat(v, H // H_kv, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kh) / np.sqrt(D) + bias
    lse = jnp.log(jnp.sum(jnp.exp(s - s.max(-1, keepdims=True)), -1)) + s.max(-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]), vh)
    return out, lse


def _causal_bias(S_q, S_k):
    """Bottom-right aligned causal mask as a bias (1, 1, S_q, S_k)."""
    q_pos = np.arange(S_q) + S_k - S_q
    return np.where(np.arange(S_k)[None] <= q_pos[:, None], 0.0, -np.inf)[None, None]


def _lse_loss(fn, w, u, uses_out=True):
    """A loss reading lse (and out): the lse cotangent is u, out's is w."""
    def loss(q, k, v):
        out, lse = fn(q, k, v)
        return (out * w).sum() * uses_out + (lse * u).sum()
    return loss


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("causal, S_q, S_k", [(False, 13, 29), (True, 37, 37),
                                              (True, 11, 23)])
@pytest.mark.parametrize("uses_out", [True, False])
def test_jax_grad_through_lse_matches_jax_reference(jax_module, rng, jit, causal,
                                                    S_q, S_k, uses_out):
    jax, jnp = jax_module, jax_module.numpy
    import ringattn.jax as rj

    q, _, _, w = _inputs(rng, n=S_q)
    _, k, v, _ = _inputs(rng, n=S_k)
    u = rng.standard_normal((1, q.shape[2], S_q))
    bias = _causal_bias(S_q, S_k) if causal else 0.0
    ours = _lse_loss(lambda q, k, v: rj.attention(q, k, v, causal=causal,
                                                  return_lse=True), w, u, uses_out)
    ref = _lse_loss(lambda q, k, v: _jnp_reference(jnp, q, k, v, bias), w, u,
                    uses_out)
    grad = jax.grad(ours, argnums=(0, 1, 2))
    got = (jax.jit(grad) if jit else grad)(q, k, v)
    want = jax.grad(ref, argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip(("dq", "dk", "dv"), got, want):
        assert_close(np.asarray(g), np.asarray(r), "float64", name)


def test_jax_dilated_grad_through_lse_matches_jax_reference(jax_module, rng):
    jax, jnp = jax_module, jax_module.numpy
    import ringattn.jax as rj
    from ringattn.testing import dilated_bias

    q, k, v, w = _inputs(rng)
    n, H = q.shape[1], q.shape[2]
    u = rng.standard_normal((1, H, n))
    bias = dilated_bias(n, SEGS, RATES, H)[None] + _causal_bias(n, n)
    ours = _lse_loss(lambda q, k, v: rj.dilated_attention(
        q, k, v, SEGS, RATES, causal=True, return_lse=True), w, u)
    ref = _lse_loss(lambda q, k, v: _jnp_reference(jnp, q, k, v, bias), w, u)
    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(ref, argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip(("dq", "dk", "dv"), got, want):
        assert_close(np.asarray(g), np.asarray(r), "float64", name)


def _jax_ring_lse_rank(comm, q, k, v, w, u):
    import jax
    import jax.numpy as jnp

    import ringattn.jax as rj

    jax.config.update("jax_enable_x64", True)
    shard = lambda x, axis=1: jnp.asarray(
        ra.shard(x, comm.rank, comm.size, "zigzag", axis=axis))
    wl, ul = shard(w), shard(u, axis=2)

    def loss(q, k, v):
        out, lse = rj.ring_attention(q, k, v, comm, causal=True,
                                     layout="zigzag", return_lse=True)
        return (out * wl).sum() + (lse * ul).sum()

    return [np.asarray(g) for g in
            jax.grad(loss, argnums=(0, 1, 2))(shard(q), shard(k), shard(v))]


@pytest.mark.timeout(120)
def test_jax_ring_grad_through_lse_matches_jax_reference(jax_module, rng):
    jax, jnp = jax_module, jax_module.numpy
    q, k, v, w = _inputs(rng)
    n = q.shape[1]
    u = rng.standard_normal((1, q.shape[2], n))
    res = ra.launch(_jax_ring_lse_rank, 3, args=(q, k, v, w, u),
                    backend="threads")
    got = [ra.unshard([r[i] for r in res], "zigzag") for i in range(3)]
    ref = _lse_loss(lambda q, k, v: _jnp_reference(jnp, q, k, v,
                                                   _causal_bias(n, n)), w, u)
    want = jax.grad(ref, argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, np.asarray(r), "float64", name)


def test_jax_attention_returns_lse_like_ringattn(jax_module, rng):
    import ringattn.jax as rj

    q, k, v, _ = _inputs(rng)
    out, lse = rj.attention(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = ra.attention(q, k, v, causal=True, return_lse=True)
    assert_close(np.asarray(lse), ref_lse, "float64", "lse")
    assert_close(np.asarray(out), ref_out, "float64", "out")


@pytest.mark.parametrize("dilated", [False, True])
def test_torch_grad_through_lse_passes_gradcheck(rng, dilated):
    torch = pytest.importorskip("torch")
    import ringattn.torch as rt

    q, k, v, _ = _inputs(rng, n=11)
    args = tuple(torch.tensor(x, requires_grad=True) for x in (q, k, v))
    if dilated:
        fn = lambda q, k, v: rt.dilated_attention(q, k, v, [4, 8], [1, 2],
                                                  causal=True, return_lse=True)
    else:
        fn = lambda q, k, v: rt.attention(q, k, v, causal=True,
                                          return_lse=True)
    assert torch.autograd.gradcheck(fn, args)


def test_torch_double_backward_raises(rng):
    """As PyTorch's flash attention: no second derivative, and no silent
    zeros either."""
    torch = pytest.importorskip("torch")
    import ringattn.torch as rt

    q, k, v, w = _inputs(rng)
    qt, kt, vt = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = rt.attention(qt, kt, vt, causal=True)
    dq, = torch.autograd.grad((out * torch.tensor(w)).sum(), qt,
                              create_graph=True)
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(dq.sum(), qt)
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.gradgradcheck(lambda q, k, v: rt.attention(q, k, v),
                                     (qt, kt, vt))


def test_torch_first_derivative_under_create_graph_is_unchanged(rng):
    torch = pytest.importorskip("torch")
    import ringattn.torch as rt

    q, k, v, w = _inputs(rng)
    qt, kt, vt = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = rt.attention(qt, kt, vt, causal=True)
    got = torch.autograd.grad((out * torch.tensor(w)).sum(), (qt, kt, vt),
                              create_graph=True)
    ref = ref_attention_backward(w, q, k, v, causal=True)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert_close(g.detach().numpy(), r, "float64", name)


# ---- plain ra.attention on autodiff values ----------------------------------


def test_plain_attention_on_a_tensor_requiring_grad_warns_once(rng, monkeypatch):
    torch = pytest.importorskip("torch")
    from ringattn import interop

    monkeypatch.setattr(interop, "_warned_about_grad", False)
    q = torch.tensor(_inputs(rng)[0], requires_grad=True)
    with pytest.warns(UserWarning, match="ringattn.torch") as record:
        ra.attention(q, q, q)
        ra.attention(q, q, q)
    assert len([r for r in record if "ringattn.torch" in str(r.message)]) == 1


def test_plain_attention_under_jit_names_ringattn_jax(jax_module, rng):
    jax = jax_module
    q = jax.numpy.asarray(_inputs(rng)[0])
    with pytest.raises(TypeError, match="ringattn.jax"):
        jax.jit(lambda q: ra.attention(q, q, q))(q)
