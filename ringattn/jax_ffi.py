"""ringattn's kernels as XLA FFI custom calls (used by ``ringattn.jax``).

The handlers are C functions in the extension (csrc/xla/) written against
XLA's FFI C ABI; ``register()`` hands them to ``jax.ffi`` for the CPU and,
in a CUDA build, for CUDA devices (where they launch on the stream XLA
gives them, into XLA's buffers).  Under ``jax.jit`` each op below is one
``custom_call`` in the lowered program: no host callback, no copy.

Every op works under ``jax.vmap`` (``vmap_method="expand_dims"``: the
handlers fold or loop over the leading batch dims) and is not itself
differentiable; ``attention`` and ``dilated_attention`` here carry a
``jax.custom_vjp`` built from the backward ops.

Shapes: q, out, dout, dq (B, S_q, H, D); k, v, dk, dv (B, S_k, H_kv, D);
lse, delta (B, H, S_q) float32 (float64 for float64 inputs).
"""

import inspect
import math

import numpy as np

import jax
import jax.numpy as jnp

from . import _C
from . import dilated as _dilated

_registered = False


def register():
    """Register every ringattn FFI target with JAX (once per process)."""
    global _registered
    if _registered:
        return
    for platform, targets in _C.ffi_targets().items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform,
                                        api_version=1)
    _registered = True


def acc_dtype(dtype):
    """The dtype of running states and lse: float64 for float64, else float32."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


_SDS_PARAMS = inspect.signature(jax.ShapeDtypeStruct).parameters


def _sds(shape, dtype, like):
    """A result's shape and dtype, varying over the same shard_map axes as
    the operand `like` (XLA checks these types inside shard_map; the field
    is ``manual_axis_type`` in newer JAX, ``vma`` in older)."""
    aval = jax.typeof(like) if hasattr(jax, "typeof") else None
    mat = getattr(aval, "mat", None)
    if "manual_axis_type" in _SDS_PARAMS and mat is not None and not mat.empty:
        sharding = jax.sharding.NamedSharding(aval.sharding.mesh,
                                              jax.sharding.PartitionSpec())
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding,
                                    manual_axis_type=mat)
    vma = getattr(aval, "vma", None)
    if "vma" in _SDS_PARAMS and vma:
        return jax.ShapeDtypeStruct(tuple(shape), dtype, vma=vma)
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _call(target, results, args, attrs, aliases=None):
    return jax.ffi.ffi_call(target, results, vmap_method="expand_dims",
                            input_output_aliases=aliases)(*args, **attrs)


def _attrs(causal, scale, D, num_threads):
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale}")
    return dict(causal=bool(causal), scale=np.float64(scale),
                num_threads=np.int64(num_threads))


def _with_positions(args, attrs, positions):
    """Append the (P, 3) int64 position table of a ring block, if any."""
    if positions is None:
        return args, attrs
    table, q_pieces = positions
    return args + [table], dict(attrs, q_pieces=np.int64(q_pieces))


def check_qkv(q, k, v):
    """ValueError/TypeError naming the argument unless q (B, S_q, H, D) and
    k, v (B, S_k, H_kv, D) share a float dtype and H % H_kv == 0."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name}: expected 4 dimensions (batch, seq, heads, "
                             f"head_dim), got shape {getattr(x, 'shape', None)}")
    if jnp.dtype(q.dtype) not in (jnp.float32, jnp.float64, jnp.float16,
                                  jnp.bfloat16):
        raise TypeError(f"q: expected float32, float64, float16 or bfloat16, "
                        f"got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} (the dtype of q), "
                            f"got {x.dtype}")
    B, _, H, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"v: expected the shape of k {k.shape}, got {v.shape}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k: expected batch {B} and head_dim {D} (from q), got "
                         f"shape {k.shape}")
    if k.shape[2] < 1 or H % k.shape[2]:
        raise ValueError(f"k: expected a number of kv heads that divides q's {H} "
                         f"heads, got {k.shape[2]}")
    if not 1 <= D <= 256:
        raise ValueError(f"q: expected head_dim in 1..256, got {D}")


# ---- ops -------------------------------------------------------------------

def fwd(q, k, v, *, causal=False, scale=None, out_dtype=None, positions=None,
        num_threads=0):
    """(out, lse) of attention.  out_dtype: q's (default) or the acc dtype.
    positions: None (local, bottom-right aligned) or (table, q_pieces)."""
    B, Sq, H, D = q.shape
    acc = acc_dtype(q.dtype)
    results = (_sds(q.shape, out_dtype or q.dtype, q), _sds((B, H, Sq), acc, q))
    args, attrs = _with_positions([q, k, v], _attrs(causal, scale, D, num_threads),
                                  positions)
    return _call("ringattn_attn_fwd", results, args, attrs)


def fwd_acc(q, k, v, out, lse, *, causal=False, scale=None, positions=None,
            num_threads=0):
    """Merge this k/v block into the running state (out, lse) (acc dtype),
    in place where XLA can: the ring's block step."""
    results = (_sds(out.shape, out.dtype, q), _sds(lse.shape, lse.dtype, q))
    args, attrs = _with_positions([q, k, v, out, lse],
                                  _attrs(causal, scale, q.shape[3], num_threads),
                                  positions)
    return _call("ringattn_attn_fwd_acc", results, args, attrs,
                 aliases={3: 0, 4: 1})


def bwd_preprocess(dout, out, *, num_threads=0):
    """delta = rowsum(dout * out): (B, H, S_q) acc dtype."""
    B, Sq, H, _ = dout.shape
    return _call("ringattn_attn_bwd_pre",
                 (_sds((B, H, Sq), acc_dtype(dout.dtype), dout),), [dout, out],
                 dict(num_threads=np.int64(num_threads)))[0]


def bwd(dout, q, k, v, lse, delta, *, causal=False, scale=None,
        grad_dtype=None, positions=None, num_threads=0):
    """(dq, dk, dv) of one call (deterministic), in grad_dtype (q's by
    default, or the acc dtype)."""
    gd = grad_dtype or q.dtype
    results = (_sds(q.shape, gd, q), _sds(k.shape, gd, q), _sds(v.shape, gd, q))
    args, attrs = _with_positions([dout, q, k, v, lse, delta],
                                  _attrs(causal, scale, q.shape[3], num_threads),
                                  positions)
    return _call("ringattn_attn_bwd", results, args, attrs)


def bwd_acc(dout, q, k, v, lse, delta, dq, dk, dv, *, causal=False,
            scale=None, positions=None, num_threads=0):
    """Add this block's gradients into (dq, dk, dv) (acc dtype, in place
    where XLA can)."""
    results = tuple(_sds(g.shape, g.dtype, q) for g in (dq, dk, dv))
    args, attrs = _with_positions([dout, q, k, v, lse, delta, dq, dk, dv],
                                  _attrs(causal, scale, q.shape[3], num_threads),
                                  positions)
    return _call("ringattn_attn_bwd_acc", results, args, attrs,
                 aliases={6: 0, 7: 1, 8: 2})


def merge(out1, lse1, out2, lse2):
    """LSE merge of two partial results: (out, lse), out in the wider of the
    two outputs' dtypes.  Not differentiable."""
    out_dtype = out1.dtype
    if jnp.dtype(out2.dtype).itemsize > jnp.dtype(out_dtype).itemsize and \
            jnp.dtype(out2.dtype) in (jnp.float32, jnp.float64):
        out_dtype = out2.dtype
    return _call("ringattn_merge", (_sds(out1.shape, out_dtype, out1),
                                    _sds(lse1.shape, lse1.dtype, out1)),
                 [out1, lse1, out2, lse2], {})


def _dilated_attrs(segs, rates, causal, scale, D):
    return dict(_attrs(causal, scale, D, 0),
                segment_lengths=np.asarray(segs, np.int64),
                dilation_rates=np.asarray(rates, np.int64))


def dilated_fwd(q, k, v, segs, rates, *, causal=False, scale=None):
    """(out, lse) of LongNet dilated attention (CPU handler)."""
    B, S, H, D = q.shape
    results = (_sds(q.shape, q.dtype, q), _sds((B, H, S), acc_dtype(q.dtype), q))
    return _call("ringattn_dilated_fwd", results, [q, k, v],
                 _dilated_attrs(segs, rates, causal, scale, D))


def dilated_bwd(dout, q, k, v, lse, delta, segs, rates, *, causal=False,
                scale=None):
    """(dq, dk, dv) of dilated attention (CPU handler)."""
    results = (_sds(q.shape, q.dtype, q), _sds(k.shape, k.dtype, q),
               _sds(v.shape, v.dtype, q))
    return _call("ringattn_dilated_bwd", results, [dout, q, k, v, lse, delta],
                 _dilated_attrs(segs, rates, causal, scale, q.shape[3]))


# ---- differentiable local attention ----------------------------------------

def _vjp(forward, backward, return_lse):
    """custom_vjp over (q, k, v) returning out, or (out, lse):
    forward(q, k, v) -> (out, lse); backward(dout, q, k, v, lse, delta) ->
    (dq, dk, dv).  A cotangent g of lse enters as delta - g (the gradient of
    lse_i with respect to score s_ij is P_ij), so one backward kernel serves
    both."""
    @jax.custom_vjp
    def f(q, k, v):
        out, lse = forward(q, k, v)
        return (out, lse) if return_lse else out

    def f_fwd(q, k, v):
        out, lse = forward(q, k, v)
        return ((out, lse) if return_lse else out), (q, k, v, out, lse)

    def f_bwd(res, cotangent):
        q, k, v, out, lse = res
        dout, dlse = cotangent if return_lse else (cotangent, None)
        dout = dout.astype(out.dtype)
        delta = bwd_preprocess(dout, out)
        if dlse is not None:
            delta = delta - dlse.astype(delta.dtype)
        return tuple(backward(dout, q, k, v, lse, delta))

    f.defvjp(f_fwd, f_bwd)
    return f


def attention(q, k, v, *, causal=False, scale=None, return_lse=False):
    """Differentiable attention: out (B, S_q, H, D) in q's dtype, or (out,
    lse) with return_lse (lse (B, H, S_q) float32, float64 for float64)."""
    check_qkv(q, k, v)
    return _vjp(
        lambda q, k, v: fwd(q, k, v, causal=causal, scale=scale),
        lambda *a: bwd(*a, causal=causal, scale=scale),
        bool(return_lse))(q, k, v)


def dilated_attention(q, k, v, segment_lengths, dilation_rates, *,
                      causal=False, scale=None, return_lse=False,
                      host_fallback=None):
    """Differentiable dilated attention: out, or (out, lse) with return_lse.
    The kernels exist on the CPU; on other platforms ``host_fallback(q, k,
    v)`` (a host-callback version with the same outputs) runs instead, chosen
    when the program is lowered."""
    segs, rates = _dilated.check_config(segment_lengths, dilation_rates)
    check_qkv(q, k, v)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k: dilated attention expects the sequence length of "
                         f"q ({q.shape[1]}), got {k.shape[1]}")
    native = _vjp(
        lambda q, k, v: dilated_fwd(q, k, v, segs, rates, causal=causal,
                                    scale=scale),
        lambda *a: dilated_bwd(*a, segs, rates, causal=causal, scale=scale),
        bool(return_lse))
    if host_fallback is None:
        return native(q, k, v)
    return jax.lax.platform_dependent(q, k, v, cpu=native, default=host_fallback)
