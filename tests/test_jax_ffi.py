"""``ringattn.jax`` as XLA FFI custom calls on the CPU: what the lowered
programs contain, bitwise agreement with the host path (the same kernels),
the float64 reference, vmap, the ring ops' position pieces, and errors.

The multi-device ring is in test_jax_ring.py; the ABI check in
test_jax_ffi_abi.py.
"""

import math

import numpy as np
import pytest

import ringattn as ra
from ringattn.testing import (assert_close, random_problem, random_qkv,
                              ref_attention, ref_attention_backward,
                              ref_dilated_attention,
                              ref_dilated_attention_backward)

jax = pytest.importorskip("jax")
jnp = jax.numpy
rj = pytest.importorskip("ringattn.jax")
from ringattn import jax_ffi  # noqa: E402  (after the JAX skip)
from ringattn.jax_ring import shard_map  # noqa: E402

rj_ffi_attention = jax_ffi.attention

SEGS, RATES = [4, 16], [1, 2]


@pytest.fixture(autouse=True)
def x64():
    jax.config.update("jax_enable_x64", True)


def _loss(f, w):
    return lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * w)


# ---- the lowered program -------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_attention_lowers_to_custom_calls_without_callbacks(rng, causal):
    q, k, v = random_qkv(rng, 1, 9, 9, 4, 2, 8)
    w = jnp.ones(q.shape, jnp.float32)
    fwd = jax.jit(lambda q, k, v: rj.attention(q, k, v, causal=causal))
    grad = jax.jit(jax.grad(_loss(lambda *a: rj.attention(*a, causal=causal), w),
                            argnums=(0, 1, 2)))
    fwd_text = fwd.lower(q, k, v).as_text()
    grad_text = grad.lower(q, k, v).as_text()
    assert "@ringattn_attn_fwd(" in fwd_text and "callback" not in fwd_text
    for target in ("ringattn_attn_fwd", "ringattn_attn_bwd_pre",
                   "ringattn_attn_bwd"):
        assert f"@{target}(" in grad_text
    assert "callback" not in grad_text


def test_dilated_lowers_to_custom_calls_without_callbacks(rng):
    q, k, v = random_qkv(rng, 1, 20, 20, 4, 2, 8)
    w = jnp.ones(q.shape, jnp.float32)
    f = lambda q, k, v: rj.dilated_attention(q, k, v, SEGS, RATES, causal=True)
    text = jax.jit(jax.grad(_loss(f, w), argnums=(0, 1, 2))).lower(q, k, v).as_text()
    for target in ("ringattn_dilated_fwd", "ringattn_attn_bwd_pre",
                   "ringattn_dilated_bwd"):
        assert f"@{target}(" in text
    assert "callback" not in text


# ---- the same kernels as the host path: the same bits ------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(37, 37), (7, 29), (29, 7), (1, 1)])
def test_attention_bitwise_equals_host_path(rng, dtype, causal, sq, sk):
    q, k, v = random_qkv(rng, 2, sq, sk, 4, 2, 16, dtype)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    out, pullback = jax.jit(lambda q, k, v: jax.vjp(
        lambda *a: rj.attention(*a, causal=causal), q, k, v))(q, k, v)
    grads = jax.jit(pullback)(jnp.asarray(dout))
    ref_out, ref_lse = ra.attention(q, k, v, causal=causal, return_lse=True)
    ref_grads = ra.attention_backward(dout, q, k, v, ref_out, ref_lse,
                                      causal=causal)
    assert np.array_equal(np.asarray(out), ref_out)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert np.array_equal(np.asarray(g), r), name


def test_dilated_bitwise_equals_host_path(rng):
    q, k, v, dout = random_problem(rng, 2, 41, 4, 2, 8, "float32")
    out, pullback = jax.vjp(lambda *a: rj.dilated_attention(
        *a, SEGS, RATES, causal=True), q, k, v)
    grads = pullback(jnp.asarray(dout))
    ref_out, ref_lse = ra.dilated_attention(q, k, v, SEGS, RATES, causal=True,
                                            return_lse=True)
    ref_grads = ra.dilated_attention_backward(dout, q, k, v, ref_out, ref_lse,
                                              SEGS, RATES, causal=True)
    assert np.array_equal(np.asarray(out), ref_out)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert np.array_equal(np.asarray(g), r), name


def test_merge_bitwise_equals_host_path(rng):
    o1, o2 = (rng.standard_normal((2, 9, 3, 8)).astype(np.float32) for _ in "ab")
    l1, l2 = (rng.standard_normal((2, 3, 9)).astype(np.float32) for _ in "ab")
    l2[0, 1, :4] = -np.inf
    l1[0, 1, :2] = -np.inf      # two empty rows merge to (0, -inf)
    got = jax.jit(rj.merge)(o1, l1, o2, l2)
    for g, r in zip(got, ra.merge(o1, l1, o2, l2)):
        assert np.array_equal(np.asarray(g), r)


# ---- against the float64 reference --------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,H,Hkv,D", [(1, 1, 1, 1), (7, 4, 1, 8), (113, 6, 3, 24)])
def test_attention_grad_matches_reference(rng, causal, n, H, Hkv, D):
    q, k, v, dout = random_problem(rng, 2, n, H, Hkv, D)
    out, pullback = jax.vjp(lambda *a: rj.attention(*a, causal=causal), q, k, v)
    assert_close(np.asarray(out), ref_attention(q, k, v, causal=causal)[0],
                 "float64", "out")
    ref = ref_attention_backward(dout, q, k, v, causal=causal)
    for name, g, r in zip(("dq", "dk", "dv"), pullback(jnp.asarray(dout)), ref):
        assert_close(np.asarray(g), r, "float64", name)


def test_lse_cotangent_matches_jax_autodiff(rng):
    """With return_lse the lse's cotangent flows into q and k: checked
    against JAX's own autodiff of a float64 jnp attention."""
    q, k, v = random_qkv(rng, 1, 23, 19, 4, 2, 8, "float64")
    w_out = rng.standard_normal((1, 23, 4, 8))
    w_lse = rng.standard_normal((1, 4, 23))

    def dense(q, k, v):
        kk, vv = (jnp.repeat(x, 2, axis=2) for x in (k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / jnp.sqrt(8.0)
        pos_q, pos_k = jnp.arange(23)[:, None] + 19 - 23, jnp.arange(19)[None]
        s = jnp.where(pos_k <= pos_q, s, -jnp.inf)
        lse = jax.nn.logsumexp(s, axis=-1)
        p = jnp.where(jnp.isfinite(lse)[..., None], jnp.exp(s - lse[..., None]), 0)
        return jnp.einsum("bhqk,bkhd->bqhd", p, vv), lse

    def loss(f):
        def value(q, k, v):
            out, lse = f(q, k, v)
            lse = jnp.where(jnp.isfinite(lse), lse, 0)
            return jnp.sum(out * w_out) + jnp.sum(lse * w_lse)
        return jax.grad(value, argnums=(0, 1, 2))

    got = loss(lambda *a: rj_ffi_attention(*a, causal=True, return_lse=True))(q, k, v)
    ref = loss(dense)(q, k, v)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert_close(np.asarray(g), np.asarray(r), "float64", name)


def test_dilated_grad_matches_reference(rng):
    q, k, v, dout = random_problem(rng, 1, 37, 4, 2, 8)
    out, pullback = jax.vjp(lambda *a: rj.dilated_attention(
        *a, SEGS, RATES, causal=False), q, k, v)
    assert_close(np.asarray(out),
                 ref_dilated_attention(q, k, v, SEGS, RATES)[0], "float64", "out")
    ref = ref_dilated_attention_backward(dout, q, k, v, SEGS, RATES)
    for name, g, r in zip(("dq", "dk", "dv"), pullback(jnp.asarray(dout)), ref):
        assert_close(np.asarray(g), r, "float64", name)


# ---- vmap ------------------------------------------------------------------------

@pytest.mark.parametrize("batched", ["all", "q only", "k and v"])
def test_vmap_matches_a_loop(rng, batched):
    """vmap over a leading axis: all operands batched (one folded kernel
    call) or some shared (the handler loops over the vmap index)."""
    N = 3
    q, k, v, w = (rng.standard_normal((N, 2, 11, 4, 8)) for _ in range(4))
    k, v = k[:, :, :, :2], v[:, :, :, :2]
    axes = {"all": (0, 0, 0), "q only": (0, None, None),
            "k and v": (None, 0, 0)}[batched]
    pick = lambda x, ax, i: x[i] if ax == 0 else x[0]
    args = [x if ax == 0 else x[0] for x, ax in zip((q, k, v), axes)]

    def loss(q, k, v, w):
        return jnp.sum(rj.attention(q, k, v, causal=True) * w)

    f = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2)),
                         in_axes=axes + (0,)))
    (vals, grads) = f(*args, w)
    for i in range(N):
        qi, ki, vi = (pick(x, ax, i) for x, ax in zip((q, k, v), axes))
        val_i, grads_i = jax.value_and_grad(loss, argnums=(0, 1, 2))(qi, ki, vi, w[i])
        assert np.allclose(np.asarray(vals[i]), np.asarray(val_i), rtol=1e-12)
        for g, gi in zip(grads, grads_i):   # the kernels' own bits
            assert np.array_equal(np.asarray(g[i]), np.asarray(gi))


def test_nested_vmap_of_dilated(rng):
    q, k, v = (rng.standard_normal((2, 3, 1, 20, 2, 4)) for _ in range(3))
    f = lambda q, k, v: rj.dilated_attention(q, k, v, SEGS, RATES, causal=True)
    got = jax.jit(jax.vmap(jax.vmap(f)))(q, k, v)
    for i in range(2):
        for j in range(3):
            ref = ra.dilated_attention(q[i, j], k[i, j], v[i, j], SEGS, RATES,
                                       causal=True)
            assert np.array_equal(np.asarray(got[i, j]), ref)


# ---- the ring's block ops --------------------------------------------------------

def _pieces(runs):
    return np.array([[n, s, st] for s, st, n in runs], np.int64)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_block_ops_over_position_pieces(rng, dtype):
    """A zigzag shard's two runs against another shard's two runs: forward
    from a fresh state then accumulated into, backward likewise, against
    the reference with those global positions."""
    n, p = 40, 2
    prog = [ra.layout.shard_progressions(n, p, "zigzag", r) for r in range(p)]
    pos = ra.shard_indices(n, p, "zigzag")
    q, k0, v0 = random_qkv(rng, 1, 20, 20, 4, 2, 8, dtype)
    _, k1, v1 = random_qkv(rng, 1, 20, 20, 4, 2, 8, dtype)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    acc = jax_ffi.acc_dtype(q.dtype)
    table = lambda src: (np.concatenate([_pieces(prog[1]), _pieces(prog[src])]),
                         len(prog[1]))
    kw = dict(causal=True, scale=None)
    out, lse = jax_ffi.fwd(q, k1, v1, out_dtype=acc, positions=table(1), **kw)
    out, lse = jax_ffi.fwd_acc(q, k0, v0, out, lse, positions=table(0), **kw)
    k, v = np.concatenate([k1, k0], 1), np.concatenate([v1, v0], 1)
    ref_out, ref_lse = ref_attention(q, k, v, causal=True, q_pos=pos[1],
                                     k_pos=np.concatenate([pos[1], pos[0]]))
    assert_close(np.asarray(out), ref_out, dtype, "out")
    assert_close(np.asarray(lse), ref_lse, dtype, "lse")
    delta = jax_ffi.bwd_preprocess(jnp.asarray(dout), out.astype(q.dtype))
    dq, dk1, dv1 = jax_ffi.bwd(dout, q, k1, v1, lse, delta, grad_dtype=acc,
                               positions=table(1), **kw)
    dq, dk0, dv0 = jax_ffi.bwd_acc(dout, q, k0, v0, lse, delta, dq,
                                   jnp.zeros(k0.shape, acc), jnp.zeros(k0.shape, acc),
                                   positions=table(0), **kw)
    ref = ref_attention_backward(dout, q, k, v, causal=True, q_pos=pos[1],
                                 k_pos=np.concatenate([pos[1], pos[0]]),
                                 out=np.asarray(out.astype(q.dtype)))
    assert_close(np.asarray(dq), ref[0], dtype, "dq")
    assert_close(np.concatenate([dk1, dk0], 1), ref[1], dtype, "dk")
    assert_close(np.concatenate([dv1, dv0], 1), ref[2], dtype, "dv")


def test_future_block_leaves_state_untouched(rng):
    """A k/v block entirely in the causal future adds nothing (and is
    skipped without a kernel call): the running state comes back as is."""
    q, k, v = random_qkv(rng, 1, 6, 6, 2, 2, 8)
    out = rng.standard_normal(q.shape).astype(np.float32)
    lse = rng.standard_normal((1, 2, 6)).astype(np.float32)
    table = (np.array([[6, 0, 1], [6, 6, 1]], np.int64), 1)
    got = jax_ffi.fwd_acc(q, k, v, out, lse, causal=True, positions=table)
    assert np.array_equal(np.asarray(got[0]), out)
    assert np.array_equal(np.asarray(got[1]), lse)


@pytest.mark.parametrize("x64", [True, False])
def test_ring_on_one_device_in_process(rng, x64):
    """shard_map over a 1-device mesh: the ring is local attention.  Without
    jax_enable_x64 the position table is int32."""
    from jax.sharding import PartitionSpec as P

    dtype = "float64" if x64 else "float32"
    q, k, v = random_qkv(rng, 1, 13, 13, 4, 2, 8, dtype)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("sp",))
    f = shard_map(lambda q, k, v: rj.ring_attention(
        q, k, v, axis_name="sp", causal=True, layout="zigzag"), mesh,
        P(None, "sp"), P(None, "sp"))
    jax.config.update("jax_enable_x64", x64)
    try:
        got = jax.jit(f)(q, k, v)
    finally:
        jax.config.update("jax_enable_x64", True)
    assert_close(np.asarray(got), ref_attention(q, k, v, causal=True)[0],
                 dtype, "out")


# ---- errors ---------------------------------------------------------------------

def test_bad_arguments_raise_before_any_work(rng):
    q, k, v = random_qkv(rng, 1, 8, 8, 4, 3, 8)
    with pytest.raises(ValueError, match="k: expected a number of kv heads"):
        rj.attention(q, k, v)
    q, k, v = random_qkv(rng, 1, 8, 8, 4, 2, 8)
    with pytest.raises(TypeError, match="k: expected dtype float32"):
        rj.attention(q, k.astype(np.float64), v)
    with pytest.raises(ValueError, match="q: expected 4 dimensions"):
        rj.attention(q[0], k, v)
    with pytest.raises(ValueError, match="scale: expected a finite number"):
        rj.attention(q, k, v, scale=math.inf)
    with pytest.raises(ValueError, match="k: dilated attention expects"):
        rj.dilated_attention(q, k[:, :5], v[:, :5], SEGS, RATES)
    with pytest.raises(TypeError, match="exactly one of comm"):
        rj.ring_attention(q, k, v)


def test_ring_checks_its_arguments(rng):
    from jax.sharding import PartitionSpec as P

    q, k, v = random_qkv(rng, 1, 8, 8, 4, 2, 8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("sp",))

    def run(**kw):
        return shard_map(lambda q, k, v: rj.ring_attention(
            q, k, v, axis_name="sp", **kw), mesh, P(None, "sp"),
            P(None, "sp"))(q, k, v)

    with pytest.raises(ValueError, match="seq_len: expected 8"):
        run(seq_len=9)
    with pytest.raises(ValueError, match="layout: expected one of"):
        run(layout="diagonal")


def test_handler_rejects_bad_operands_with_a_clear_error(rng):
    """The C handler checks what it is given too (an XLA error naming the
    operand, never a crash), e.g. a position table that does not cover q."""
    q, k, v = random_qkv(rng, 1, 8, 8, 2, 2, 8)
    table = (np.array([[5, 0, 1], [8, 0, 1]], np.int64), 1)
    with pytest.raises(Exception, match="positions: the q pieces cover 5 rows, "
                                        "expected 8"):
        jax.block_until_ready(jax_ffi.fwd(q, k, v, positions=table, causal=True))
    with pytest.raises(Exception, match="ringattn_attn_fwd: lse: expected shape"):
        jax.block_until_ready(jax.ffi.ffi_call(
            "ringattn_attn_fwd", (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                  jax.ShapeDtypeStruct((1, 2, 7), np.float32)),
            vmap_method="expand_dims")(q, k, v))
