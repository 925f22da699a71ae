"""JAX autodiff for ringattn (``import ringattn.jax``; imports JAX lazily).

``attention``, ``merge`` and (on the CPU) ``dilated_attention`` run the
kernels as XLA FFI custom calls (ringattn/jax_ffi.py): under ``jax.jit``
they work on XLA's own buffers and stream, forward and ``jax.grad``, and
``jax.vmap`` batches them.  ``ring_attention(q, k, v, axis_name=...)`` is
the ring inside a JAX program (under ``jax.shard_map``;
ringattn/jax_ring.py), and with ``ulysses_axis=...`` Ulysses or hybrid
sequence parallelism there (ringattn/jax_ulysses.py).

Host callbacks (``_make``): ``dilated_attention`` off the CPU, through
``jax.pure_callback``; the comm-object ring wrappers
(``ring_attention(q, k, v, comm)``, ``ring_dilated_attention``), whose
forward and backward call ringattn's ring through ordered ``io_callback``,
so every rank issues its communication in program order (not under
``jax.vmap``); device arrays are staged through the host there.

Shapes as ``ringattn.attention``: q (B, S_q, H, D); k, v (B, S_k, H_kv, D).
With ``return_lse=True`` each returns (out, lse), lse (B, H, S_q) float32
(float64 for float64 inputs), and ``jax.grad`` flows through lse too.
"""

import numpy as np

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.experimental import io_callback

from . import dilated as _dilated
from . import jax_ffi as _ffi
from . import jax_ring as _jax_ring
from . import jax_ulysses as _jax_ulysses
from . import ring as _ring
from . import ring_dilated as _ring_dilated
from .checks import flag, ulysses_degree

__all__ = ["attention", "dilated_attention", "ring_attention",
           "ring_dilated_attention", "merge"]

_ffi.register()
merge = _ffi.merge


def _sds(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _host(arrays):
    return [np.asarray(a) for a in arrays]


def _make(forward, backward, ordered, return_lse):
    """custom_vjp over (q, k, v, *ids) from host functions:
    forward(q, k, v, *ids) -> (out, lse); backward(dout, q, k, v, out, lse,
    *ids, dlse=None) -> (dq, dk, dv); ids (integer segment ids) get no
    gradient.  Returns out, or (out, lse) when return_lse; the lse is
    differentiable, its cotangent going to the same backward call as
    ``dlse=`` (symbolic zeros tell, at trace time, which outputs the loss
    reads)."""
    def call(fn, shapes, *args):
        host = lambda *a: tuple(np.asarray(x) for x in fn(*_host(a)))
        if ordered:
            return io_callback(host, shapes, *args, ordered=True)
        return jax.pure_callback(host, shapes, *args,
                                 vmap_method="sequential")

    def outputs(out, lse):
        return (out, lse) if return_lse else out

    def forward_shapes(q):
        B, S, H, _ = q.shape
        return (_sds(q),
                jax.ShapeDtypeStruct((B, H, S), _ffi.acc_dtype(q.dtype)))

    @jax.custom_vjp
    def f(q, k, v, *ids):
        return outputs(*call(forward, forward_shapes(q), q, k, v, *ids))

    def f_fwd(q, k, v, *ids):
        # symbolic_zeros: the primals come wrapped
        q, k, v = q.value, k.value, v.value
        ids = tuple(x.value for x in ids)
        out, lse = call(forward, forward_shapes(q), q, k, v, *ids)
        return outputs(out, lse), (q, k, v, out, lse, ids)

    def f_bwd(res, cotangent):
        q, k, v, out, lse, ids = res
        dout, dlse = cotangent if return_lse else (cotangent, None)
        no_dout = isinstance(dout, SymbolicZero)
        no_dlse = dlse is None or isinstance(dlse, SymbolicZero)
        shapes = (_sds(q), _sds(k), _sds(v))
        if no_dout and no_dlse:
            grads = [jnp.zeros(x.shape, x.dtype) for x in (q, k, v)]
        else:
            if no_dout:
                dout = jnp.zeros(out.shape, out.dtype)
            args = (dout, q, k, v, out, lse, *ids)
            if no_dlse:
                grads = list(call(backward, shapes, *args))
            else:
                grads = list(call(
                    lambda *a: backward(*a[:-1], dlse=a[-1]), shapes, *args,
                    dlse.astype(lse.dtype)))
        no_grad = [np.zeros(x.shape, jax.dtypes.float0) for x in ids]
        return tuple(grads + no_grad)

    f.defvjp(f_fwd, f_bwd, symbolic_zeros=True)
    return f


def attention(q, k, v, *, causal=False, scale=None, return_lse=False,
              segment_ids=None, kv_segment_ids=None, window=None,
              softcap=None):
    """Differentiable ``ringattn.attention`` for JAX arrays (one XLA FFI
    custom call forward, two backward): out, or (out, lse) with
    return_lse=True.  Masks as ``ringattn.attention``."""
    causal, return_lse = flag(causal, "causal"), flag(return_lse, "return_lse")
    return _ffi.attention(q, k, v, causal=causal, scale=scale,
                          return_lse=return_lse, segment_ids=segment_ids,
                          kv_segment_ids=kv_segment_ids, window=window,
                          softcap=softcap)


def dilated_attention(q, k, v, segment_lengths, dilation_rates, *,
                      causal=False, scale=None, return_lse=False):
    """Differentiable ``ringattn.dilated_attention`` for JAX arrays (XLA FFI
    custom calls on the CPU; host callbacks on other platforms): out, or
    (out, lse) with return_lse=True."""
    causal, return_lse = flag(causal, "causal"), flag(return_lse, "return_lse")
    segs, rates = _dilated.check_config(segment_lengths, dilation_rates)
    f = _make(
        lambda q, k, v: _dilated.dilated_attention(
            q, k, v, segs, rates, causal=causal, scale=scale, return_lse=True),
        lambda do, q, k, v, o, l, dlse=None:
            _dilated.dilated_attention_backward(
                do, q, k, v, o, l, segs, rates, causal=causal, scale=scale,
                dlse=dlse),
        ordered=False, return_lse=return_lse)
    return _ffi.dilated_attention(q, k, v, segs, rates, causal=causal,
                                  scale=scale, return_lse=return_lse,
                                  host_fallback=f)


def ring_attention(q, k, v, comm=None, *, axis_name=None, ulysses_axis=None,
                   causal=False, scale=None, layout="contiguous",
                   seq_len=None, return_lse=False, segment_ids=None,
                   window=None, softcap=None, ulysses=1):
    """Differentiable ``ringattn.ring_attention``: out, or (out, lse) with
    return_lse=True.  segment_ids (B, n_r): the ids of this shard's tokens;
    window, softcap: the same on every rank (DESIGN §2 "Masks").

    With ``axis_name``: the ring inside a JAX program, called under
    ``jax.shard_map`` over that mesh axis (see ``ringattn.jax_ring``).
    With ``ulysses_axis`` too (or alone, for pure Ulysses): heads
    all-to-all'd over that mesh axis, the ring over ``axis_name``, the
    sequence split over both with the Ulysses axis minor (see
    ``ringattn.jax_ulysses``).  With ``comm``: this rank's shard over
    ringattn's communicator, ``ulysses=u`` as ``ringattn.ring_attention``.
    """
    causal, return_lse = flag(causal, "causal"), flag(return_lse, "return_lse")
    in_program = axis_name is not None or ulysses_axis is not None
    if (comm is None) == (not in_program):
        raise TypeError("ring_attention: pass exactly one of comm (ringattn's "
                        "communicator) or axis_name / ulysses_axis (shard_map "
                        "mesh axes)")
    if in_program and ulysses_degree(ulysses) != 1:
        raise TypeError("ring_attention: ulysses=u is for comm; inside a JAX "
                        "program name the mesh axis: ulysses_axis=...")
    if ulysses_axis is not None:
        return _jax_ulysses.ulysses_attention(
            q, k, v, ulysses_axis=ulysses_axis, axis_name=axis_name,
            causal=causal, scale=scale, layout=layout, seq_len=seq_len,
            return_lse=return_lse, segment_ids=segment_ids, window=window,
            softcap=softcap)
    if axis_name is not None:
        return _jax_ring.ring_attention(q, k, v, axis_name=axis_name,
                                        causal=causal, scale=scale,
                                        layout=layout, seq_len=seq_len,
                                        return_lse=return_lse,
                                        segment_ids=segment_ids,
                                        window=window, softcap=softcap)
    kw = dict(causal=causal, scale=scale, layout=layout, seq_len=seq_len,
              window=window, softcap=softcap, ulysses=ulysses)
    ids = () if segment_ids is None else (jnp.asarray(segment_ids),)
    f = _make(
        lambda q, k, v, *ids: _ring.ring_attention(
            q, k, v, comm, return_lse=True, segment_ids=_one(ids), **kw),
        lambda do, q, k, v, o, l, *ids, dlse=None:
            _ring.ring_attention_backward(do, q, k, v, o, l, comm,
                                          segment_ids=_one(ids), dlse=dlse,
                                          **kw),
        ordered=True, return_lse=return_lse)
    return f(q, k, v, *ids)


def _one(ids):
    """The segment ids of a call (a tuple of none or one array)."""
    return ids[0] if ids else None


def ring_dilated_attention(q, k, v, comm, segment_lengths, dilation_rates, *,
                           causal=False, scale=None, layout="contiguous",
                           seq_len=None, return_lse=False):
    """Differentiable ``ringattn.ring_dilated_attention`` on this rank's
    shard: out, or (out, lse) with return_lse=True."""
    causal, return_lse = flag(causal, "causal"), flag(return_lse, "return_lse")
    segs, rates = _dilated.check_config(segment_lengths, dilation_rates)
    kw = dict(causal=causal, scale=scale, layout=layout, seq_len=seq_len)
    f = _make(
        lambda q, k, v: _ring_dilated.ring_dilated_attention(
            q, k, v, comm, segs, rates, return_lse=True, **kw),
        lambda do, q, k, v, o, l, dlse=None:
            _ring_dilated.ring_dilated_attention_backward(
                do, q, k, v, o, l, comm, segs, rates, dlse=dlse, **kw),
        ordered=True, return_lse=return_lse)
    return f(q, k, v)
