"""JAX autodiff for ringattn (``import ringattn.jax``; imports JAX lazily).

``attention`` and ``dilated_attention`` run the kernels as XLA FFI custom
calls (ringattn/jax_ffi.py): under ``jax.jit`` they work on XLA's own
buffers and stream, forward and ``jax.grad``, and ``jax.vmap`` batches them.
``ring_attention(q, k, v, axis_name=...)`` is the ring inside a JAX program
(under ``jax.shard_map``; ringattn/jax_ring.py).

The comm-object ring wrappers (``ring_attention(q, k, v, comm)``,
``ring_dilated_attention``) are a ``jax.custom_vjp`` whose forward and
backward call ringattn's ring through ordered ``io_callback``, so every rank
issues its communication in program order; device arrays are staged through
the host there.

Shapes as ``ringattn.attention``: q (B, S_q, H, D); k, v (B, S_k, H_kv, D).
"""

import numpy as np

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from . import dilated as _dilated
from . import jax_ffi as _ffi
from . import jax_ring as _jax_ring
from . import ring as _ring
from . import ring_dilated as _ring_dilated

__all__ = ["attention", "dilated_attention", "ring_attention",
           "ring_dilated_attention", "merge"]

_ffi.register()
merge = _ffi.merge


def _sds(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _lse_sds(q):
    B, S, H, _ = q.shape
    dt = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    return jax.ShapeDtypeStruct((B, H, S), dt)


def _host(arrays):
    return [np.asarray(a) for a in arrays]


def _make(forward, backward, ordered):
    """custom_vjp over (q, k, v) from host functions:
    forward(q, k, v) -> (out, lse); backward(dout, q, k, v, out, lse) ->
    (dq, dk, dv)."""
    def call(fn, shapes, *args):
        host = lambda *a: tuple(np.asarray(x) for x in fn(*_host(a)))
        if ordered:
            return io_callback(host, shapes, *args, ordered=True)
        return jax.pure_callback(host, shapes, *args,
                                 vmap_method="sequential")

    @jax.custom_vjp
    def f(q, k, v):
        return call(forward, (_sds(q), _lse_sds(q)), q, k, v)[0]

    def f_fwd(q, k, v):
        out, lse = call(forward, (_sds(q), _lse_sds(q)), q, k, v)
        return out, (q, k, v, out, lse)

    def f_bwd(res, dout):
        q, k, v, out, lse = res
        return tuple(call(backward, (_sds(q), _sds(k), _sds(v)), dout, q, k,
                          v, out, lse))

    f.defvjp(f_fwd, f_bwd)
    return f


def attention(q, k, v, *, causal=False, scale=None):
    """Differentiable ``ringattn.attention`` for JAX arrays (one XLA FFI
    custom call forward, two backward)."""
    return _ffi.attention(q, k, v, causal=causal, scale=scale)


def dilated_attention(q, k, v, segment_lengths, dilation_rates, *,
                      causal=False, scale=None):
    """Differentiable ``ringattn.dilated_attention`` for JAX arrays (XLA FFI
    custom calls on the CPU; host callbacks on other platforms)."""
    segs, rates = _dilated.check_config(segment_lengths, dilation_rates)
    f = _make(
        lambda q, k, v: _dilated.dilated_attention(
            q, k, v, segs, rates, causal=causal, scale=scale, return_lse=True),
        lambda do, q, k, v, o, l: _dilated.dilated_attention_backward(
            do, q, k, v, o, l, segs, rates, causal=causal, scale=scale),
        ordered=False)
    return _ffi.dilated_attention(q, k, v, segs, rates, causal=causal,
                                  scale=scale, host_fallback=f)


def ring_attention(q, k, v, comm=None, *, axis_name=None, causal=False,
                   scale=None, layout="contiguous", seq_len=None):
    """Differentiable ``ringattn.ring_attention``.

    With ``axis_name``: the ring inside a JAX program, called under
    ``jax.shard_map`` over that mesh axis (see ``ringattn.jax_ring``).
    With ``comm``: this rank's shard over ringattn's communicator.
    """
    if (comm is None) == (axis_name is None):
        raise TypeError("ring_attention: pass exactly one of comm (ringattn's "
                        "communicator) or axis_name (a shard_map mesh axis)")
    if axis_name is not None:
        return _jax_ring.ring_attention(q, k, v, axis_name=axis_name,
                                        causal=causal, scale=scale,
                                        layout=layout, seq_len=seq_len)
    kw = dict(causal=causal, scale=scale, layout=layout, seq_len=seq_len)
    f = _make(
        lambda q, k, v: _ring.ring_attention(q, k, v, comm, return_lse=True,
                                             **kw),
        lambda do, q, k, v, o, l: _ring.ring_attention_backward(
            do, q, k, v, o, l, comm, **kw),
        ordered=True)
    return f(q, k, v)


def ring_dilated_attention(q, k, v, comm, segment_lengths, dilation_rates, *,
                           causal=False, scale=None, layout="contiguous",
                           seq_len=None):
    """Differentiable ``ringattn.ring_dilated_attention`` on this rank's
    shard."""
    segs, rates = _dilated.check_config(segment_lengths, dilation_rates)
    kw = dict(causal=causal, scale=scale, layout=layout, seq_len=seq_len)
    f = _make(
        lambda q, k, v: _ring_dilated.ring_dilated_attention(
            q, k, v, comm, segs, rates, return_lse=True, **kw),
        lambda do, q, k, v, o, l: _ring_dilated.ring_dilated_attention_backward(
            do, q, k, v, o, l, comm, segs, rates, **kw),
        ordered=True)
    return f(q, k, v)
