"""Ulysses and hybrid sequence parallelism inside a JAX program.

Called under ``jax.shard_map`` over a mesh with a Ulysses axis of u devices
and (for hybrid) a ring axis of r devices, the sequence dim of q, k, v
split over both with the Ulysses axis minor: ``P(None, (ring, ulysses))``,
so device (g, j) holds part j of group g's tokens, i.e. rank g u + j of
``ringattn.shard_indices(n, r u, layout, ulysses=u)`` (``ringattn.shard``
/ ``unshard`` with ``ulysses=u`` reorder a global array).  All shards have
the same length (shapes are static in an SPMD program).

``jax.lax.all_to_all`` on the Ulysses axis turns (this device's tokens,
all heads) into (the group's tokens, H / u heads) for q, k, v; the ring
(``ringattn.jax_ring``: ``jax.lax.ppermute`` and ringattn's FFI kernels)
runs over the ring axis with the layout over groups; a second all_to_all
brings out and lse back.  Without a ring axis (pure Ulysses, u = p) the
middle is one local FFI attention over the whole sequence.  Segment ids
are gathered along the Ulysses axis.  kv heads that u does not divide are
replicated (``jnp.repeat``) to lcm(H_kv, u) heads first, as the comm-object
path does (``ringattn.ulysses``); ``jax.grad`` sums the replicas' gradients
through the repeat, and differentiates the all-to-alls (their transpose is
the reverse all-to-all) and the ring's custom_vjp.

Shapes (local): q (B, n_r, H, D); k, v (B, n_r, H_kv, D); segment_ids
(B, n_r).
"""

import jax
import jax.numpy as jnp

from . import jax_ffi as _ffi
from . import jax_ring as _jax_ring
from .checks import flag as _flag
from .layout import check_layout
from .ulysses import check_heads, kv_replicas

__all__ = ["ulysses_attention"]


def _to_heads(x, axis_name, token_axis, head_axis):
    return jax.lax.all_to_all(x, axis_name, split_axis=head_axis,
                              concat_axis=token_axis, tiled=True)


def _to_tokens(x, axis_name, token_axis, head_axis):
    return jax.lax.all_to_all(x, axis_name, split_axis=token_axis,
                              concat_axis=head_axis, tiled=True)


def ulysses_attention(q, k, v, *, ulysses_axis, axis_name=None, causal=False,
                      scale=None, layout="contiguous", seq_len=None,
                      return_lse=False, segment_ids=None, window=None,
                      softcap=None):
    """Exact attention with heads all-to-all'd over mesh axis
    `ulysses_axis` and the ring over mesh axis `axis_name` (None: no ring,
    pure Ulysses).  Call under ``jax.shard_map``; arguments and results as
    ``ringattn.jax_ring.ring_attention`` (seq_len: the whole sequence, r u
    times the local length)."""
    _ffi.check_qkv(q, k, v)
    check_layout(layout)
    return_lse = _flag(return_lse, "return_lse")
    u = _jax_ring._axis_size(ulysses_axis)
    r = 1 if axis_name is None else _jax_ring._axis_size(axis_name)
    B, n_r, H, D = q.shape
    H_kv = k.shape[2]
    check_heads(H, H_kv, u)
    if k.shape[1] != n_r:
        raise ValueError(f"k: expected this device's shard length {n_r} "
                         f"(from q), got {k.shape[1]}")
    n = r * u * n_r
    if seq_len is not None and seq_len != n:
        raise ValueError(f"seq_len: expected {n} ({r} x {u} devices x {n_r} "
                         f"tokens per shard), got {seq_len}")
    # the masks' own checks, on this device's shard
    _ffi.check_masks(q, k, segment_ids, None, window, softcap)
    t = kv_replicas(H_kv, u)
    if t > 1:
        k, v = jnp.repeat(k, t, axis=2), jnp.repeat(v, t, axis=2)
    q_h, k_h, v_h = (_to_heads(x, ulysses_axis, 1, 2) for x in (q, k, v))
    ids_h = None if segment_ids is None else jax.lax.all_gather(
        segment_ids, ulysses_axis, axis=1, tiled=True)
    kw = dict(causal=causal, scale=scale, return_lse=True, window=window,
              softcap=softcap)
    if axis_name is None:
        # one group holds the whole sequence in order: local attention
        out_h, lse_h = _ffi.attention(q_h, k_h, v_h, segment_ids=ids_h,
                                      kv_segment_ids=ids_h, **kw)
    else:
        out_h, lse_h = _jax_ring.ring_attention(
            q_h, k_h, v_h, axis_name=axis_name, layout=layout, seq_len=n,
            segment_ids=ids_h, **kw)
    out = _to_tokens(out_h, ulysses_axis, 1, 2)
    if not return_lse:
        return out
    return out, _to_tokens(lse_h, ulysses_axis, 2, 1)
