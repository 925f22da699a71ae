"""Masks through the autodiff wrappers: ``ringattn.jax`` (XLA FFI locally,
host callbacks over ringattn's communicator) and ``ringattn.torch``, forward
and gradients -- through out and through lse, soft-capped scores included
-- against the float64 reference.  (The shard_map ring: test_jax_ring.py.)
"""

import numpy as np
import pytest

import ringattn as ra
from ringattn.testing import (assert_close, random_problem, ref_attention,
                              ref_attention_backward, ref_segment_ids)

LAYOUT = "zigzag"


def _problem(rng, n=29, S_k=None, H=4, H_kv=2, D=8):
    """q (scaled up: the softcap bites), k, v, dout, dlse, and ids."""
    S_k = n if S_k is None else S_k
    q, k, v, dout = random_problem(rng, 2, n, H, H_kv, D, "float64")
    if S_k != n:
        k, v = (rng.standard_normal((2, S_k, H_kv, D)) for _ in range(2))
    dlse = rng.standard_normal((2, H, n))
    ids = np.concatenate([ref_segment_ids([0, 1, 9, 20], n),
                          ref_segment_ids([0, 14], n)])
    kv_ids = np.concatenate([ref_segment_ids([0, 1, 9, 20], S_k),
                             ref_segment_ids([0, 14], S_k)])
    return 6 * q, k, v, dout, dlse, ids, kv_ids


MASKS = [
    dict(causal=True, window=(5, 0)),
    dict(causal=False, window=(2, 7), softcap=1.5),
    dict(causal=True, softcap=3.0, docs=True),
    dict(causal=False, window=(None, 3), docs=True, softcap=2.0),
]
IDS = ["sliding", "window-softcap", "docs-softcap", "all"]


def _split(mask):
    """(causal, the mask keywords but ids, documents?)"""
    mask = dict(mask)
    return mask.pop("causal"), mask.pop("docs", False), mask


def _reference(q, k, v, dout, dlse, causal, kw, ids=None, kv_ids=None,
               global_positions=False):
    if global_positions:
        pos = np.arange(q.shape[1])
        kw = dict(kw, q_pos=pos, k_pos=pos)
    kw = dict(kw, causal=causal, segment_ids=ids, kv_segment_ids=kv_ids)
    out, lse = ref_attention(q, k, v, **kw)
    grads = ref_attention_backward(dout, q, k, v, dlse=dlse, **kw)
    return out, lse, grads


# ---- JAX, local (XLA FFI) ---------------------------------------------------

@pytest.mark.parametrize("S_k", [29, 41], ids=["square", "sq<sk"])
@pytest.mark.parametrize("mask", MASKS, ids=IDS)
def test_jax_attention_with_masks_matches_reference(jax_module, rng, mask,
                                                    S_k):
    """Under jit: out, lse and the gradients of a loss reading both."""
    jax, jnp = jax_module, jax_module.numpy
    import ringattn.jax as rj

    causal, docs, kw = _split(mask)
    q, k, v, dout, dlse, ids, kv_ids = _problem(rng, S_k=S_k)
    if docs:
        kw = dict(kw, segment_ids=ids, kv_segment_ids=kv_ids)

    def loss(q, k, v):
        out, lse = rj.attention(q, k, v, causal=causal, return_lse=True, **kw)
        return jnp.sum(out * dout) + jnp.sum(lse * dlse), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(
        loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    ref = _reference(q, k, v, dout, dlse, causal,
                     {x: y for x, y in kw.items() if "segment" not in x},
                     ids if docs else None, kv_ids if docs else None)
    assert_close(np.asarray(out), ref[0], "float64", "out")
    assert_close(np.asarray(lse), ref[1], "float64", "lse")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref[2]):
        assert_close(np.asarray(g), r, "float64", name)


def test_jax_masked_program_is_custom_calls(jax_module, rng):
    """Ids become operands of the custom calls: no host callback."""
    jax, jnp = jax_module, jax_module.numpy
    import ringattn.jax as rj

    q, k, v, dout, _, ids, _ = _problem(rng)
    loss = lambda q, k, v, ids: jnp.sum(rj.attention(
        q, k, v, segment_ids=ids, window=(3, 0), softcap=2.0) * dout)
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
        q, k, v, ids).as_text()
    assert "@ringattn_attn_bwd(" in text and "callback" not in text


def test_jax_vmap_over_ids_matches_a_loop(jax_module, rng):
    """vmap over a stack of problems with their own ids (the handlers walk
    the ids' leading dims like the other operands')."""
    jax, jnp = jax_module, jax_module.numpy
    import ringattn.jax as rj

    q, k, v, _, _, ids, _ = _problem(rng)
    qs, ks, vs = (jnp.stack([x, 2 * x]) for x in (q, k, v))
    idss = jnp.stack([ids, ids[::-1]])
    f = lambda q, k, v, ids: rj.attention(q, k, v, causal=True,
                                          segment_ids=ids, softcap=4.0)
    got = jax.jit(jax.vmap(f))(qs, ks, vs, idss)
    for i in range(2):
        ref, _ = ref_attention(qs[i], ks[i], vs[i], causal=True,
                               segment_ids=np.asarray(idss[i]), softcap=4.0)
        assert_close(np.asarray(got[i]), ref, "float64", f"out[{i}]")


@pytest.mark.parametrize("kw,error,name", [
    (dict(window=(-1, 0)), ValueError, "window"),
    (dict(window=(1, 2, 3)), TypeError, "window"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(segment_ids=np.zeros((2, 5), np.int32)), ValueError, "segment_ids"),
    (dict(segment_ids=np.zeros((2, 29), np.float32)), TypeError,
     "segment_ids"),
    (dict(kv_segment_ids=np.zeros((2, 29), np.int32)), ValueError,
     "kv_segment_ids"),
])
def test_jax_bad_masks_raise_named_errors(jax_module, rng, kw, error, name):
    """The C core's own checks, at trace time, under jit too."""
    jax = jax_module
    import ringattn.jax as rj

    q, k, v, *_ = _problem(rng)
    with pytest.raises(error, match=name):
        rj.attention(q, k, v, **kw)
    with pytest.raises(error, match=name):
        jax.jit(lambda q: rj.attention(q, k, v, **kw))(q)


# ---- rings over ringattn's communicator -------------------------------------

def _ring_rank(comm, framework, q, k, v, dout, dlse, ids, causal, kw):
    """This rank's (out, lse, dq, dk, dv) of a loss over out and lse."""
    shard = lambda x, axis=1: ra.shard(x, comm.rank, comm.size, LAYOUT, axis)
    kw = dict(kw, causal=causal, layout=LAYOUT)
    if ids is not None:
        kw["segment_ids"] = shard(ids)
    w, g = shard(dout), shard(dlse, 2)
    if framework == "jax":
        import jax
        import jax.numpy as jnp

        import ringattn.jax as rj

        jax.config.update("jax_enable_x64", True)

        def loss(q, k, v):
            out, lse = rj.ring_attention(q, k, v, comm, return_lse=True, **kw)
            return jnp.sum(out * w) + jnp.sum(lse * g), (out, lse)

        (_, (out, lse)), grads = jax.value_and_grad(
            loss, argnums=(0, 1, 2), has_aux=True)(shard(q), shard(k),
                                                   shard(v))
        return [np.asarray(x) for x in (out, lse) + tuple(grads)]
    import torch

    import ringattn.torch as rt

    ts = [torch.tensor(shard(x), requires_grad=True) for x in (q, k, v)]
    if "segment_ids" in kw:
        kw["segment_ids"] = torch.tensor(kw["segment_ids"])
    out, lse = rt.ring_attention(*ts, comm, return_lse=True, **kw)
    ((out * torch.tensor(w)).sum() + (lse * torch.tensor(g)).sum()).backward()
    return [x.detach().numpy() for x in (out, lse)] + \
        [t.grad.numpy() for t in ts]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("framework", ["jax", "torch"])
@pytest.mark.parametrize("mask", MASKS, ids=IDS)
def test_comm_ring_wrappers_with_masks(rng, framework, mask):
    """3 thread ranks, zigzag: forward and gradients through out and lse."""
    pytest.importorskip(framework)
    causal, docs, kw = _split(mask)
    q, k, v, dout, dlse, ids, _ = _problem(rng)
    res = ra.launch(_ring_rank, 3, args=(framework, q, k, v, dout, dlse,
                                         ids if docs else None, causal, kw),
                    backend="threads", timeout=120)
    got = [ra.unshard([r[i] for r in res], LAYOUT, axis=2 if i == 1 else 1)
           for i in range(5)]
    ref = _reference(q, k, v, dout, dlse, causal, kw,
                     ids if docs else None, global_positions=True)
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got,
                          ref[:2] + tuple(ref[2])):
        assert_close(g, r, "float64", name)


# ---- PyTorch, local ---------------------------------------------------------

@pytest.mark.parametrize("mask", MASKS, ids=IDS)
def test_torch_attention_with_masks_matches_reference(rng, mask):
    torch = pytest.importorskip("torch")
    import ringattn.torch as rt

    causal, docs, kw = _split(mask)
    q, k, v, dout, dlse, ids, kv_ids = _problem(rng, S_k=35)
    tkw = dict(kw)
    if docs:
        tkw.update(segment_ids=torch.tensor(ids),
                   kv_segment_ids=torch.tensor(kv_ids))
    ts = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    out, lse = rt.attention(*ts, causal=causal, return_lse=True, **tkw)
    ((out * torch.tensor(dout)).sum() +
     (lse * torch.tensor(dlse)).sum()).backward()
    ref = _reference(q, k, v, dout, dlse, causal, kw,
                     ids if docs else None, kv_ids if docs else None)
    assert_close(out.detach().numpy(), ref[0], "float64", "out")
    assert_close(lse.detach().numpy(), ref[1], "float64", "lse")
    for name, t, r in zip(("dq", "dk", "dv"), ts, ref[2]):
        assert_close(t.grad.numpy(), r, "float64", name)


def test_torch_softcap_lse_passes_gradcheck(rng):
    """torch.autograd.gradcheck through out and lse with a softcap."""
    torch = pytest.importorskip("torch")
    import ringattn.torch as rt

    q, k, v = (torch.tensor(rng.standard_normal((1, 6, 2, 4)) * 3,
                            requires_grad=True) for _ in range(3))

    def f(q, k, v):
        out, lse = rt.attention(q, k, v, causal=True, window=(3, 1),
                                softcap=1.5, return_lse=True)
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-6)
