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

Masks (DESIGN §2): a ``Masks`` holds the window and softcap, which become
attributes, and the segment ids (B, S_q) and (B, S_k), which become two
int32 operands after the others (csrc/xla/ffi_args.h).
"""

import inspect
import math

import numpy as np

import jax
import jax.numpy as jnp

from . import _C
from . import dilated as _dilated
from .checks import scale_or_none, window_sides

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
    scale = scale_or_none(scale)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    return dict(causal=bool(causal), scale=np.float64(scale),
                num_threads=np.int64(num_threads))


def _with_positions(args, attrs, positions, masks=None):
    """Append the (P, 3) int64 position table of a ring block, if any, then
    the masks' id operands and attributes."""
    if positions is not None:
        table, q_pieces = positions
        args, attrs = args + [table], dict(attrs, q_pieces=np.int64(q_pieces))
    if masks is not None:
        args, attrs = masks.apply(args, attrs)
    return args, attrs


class Masks:
    """Checked mask arguments of a call: window (left, right) with None or
    ints per side, softcap (float) and segment ids (q's rows, k's rows) as
    int32 arrays; each None when unused."""

    def __init__(self, window=None, softcap=None, ids=None):
        self.window = window_sides(window)
        self.softcap = softcap
        self.ids = ids

    def apply(self, args, attrs):
        attrs = dict(attrs)
        if self.window is not None:
            for name, side in zip(("window_left", "window_right"),
                                  self.window):
                attrs[name] = np.int64(-1 if side is None else side)
        if self.softcap is not None:
            attrs["softcap"] = np.float64(self.softcap)
        if self.ids is not None:
            attrs["segment_ids"] = True
            args = args + list(self.ids)
        return args, attrs

    def with_kv_ids(self, kv_ids):
        """The same masks with other keys' ids (a ring block's)."""
        if self.ids is None:
            return self
        return Masks(self.window, self.softcap, (self.ids[0], kv_ids))


def _host_or_zeros(x):
    """x's values, or zeros of its shape and dtype when it has none yet (a
    tracer inside jit / grad / vmap)."""
    if isinstance(x, jax.core.Tracer):
        return np.zeros(x.shape, x.dtype)
    return np.asarray(x)


_WIDE_IDS = (jnp.int64, jnp.uint64, jnp.uint32)


def _ids_int32(ids, which, axis_name=None):
    """Segment ids (B, S) as the int32 the kernels read, never truncated.
    Known ids were checked by the C core (a value outside int32 is a
    ValueError).  Traced ids of a wider type (int64 and uint64 with
    jax_enable_x64, uint32) are counted outside int32 in the program, and
    the ringattn_ids_check handler refuses to pass them on when it runs if
    any are (ids 0 and 2**32 would be one document).  axis_name: the ring's
    mesh axis; the counts of all its devices are summed first, so every
    device stops at the check (none left waiting in a collective)."""
    ids = jnp.asarray(ids)
    if not isinstance(ids, jax.core.Tracer) or jnp.dtype(ids.dtype) not in _WIDE_IDS:
        return ids.astype(jnp.int32)
    info = jnp.iinfo(jnp.int32)
    outside = ids > jnp.asarray(info.max, ids.dtype)
    if jnp.issubdtype(ids.dtype, jnp.signedinteger):
        outside = outside | (ids < jnp.asarray(info.min, ids.dtype))
    local = jnp.sum(outside, dtype=jnp.int32)
    first = jnp.argmax(outside.reshape(-1)).astype(jnp.int32)
    total = local if axis_name is None else jax.lax.psum(local, axis_name)
    report = jnp.stack([total, local, first // ids.shape[1], first % ids.shape[1]])
    cast = ids.astype(jnp.int32)
    return jax.ffi.ffi_call("ringattn_ids_check", _sds(ids.shape, jnp.int32, ids),
                            vmap_method="broadcast_all",
                            input_output_aliases={0: 0})(
        cast, report, which=np.int64(which))


def check_masks(q, k, segment_ids=None, kv_segment_ids=None, window=None,
                softcap=None, axis_name=None):
    """The mask arguments of a call on q (B, S_q, ...) and k (B, S_k, ...),
    checked by the C core's own checks (the same errors as
    ``ringattn.attention``; traced ids are checked for shape and dtype, and
    for their range when the program runs), as a ``Masks``.  axis_name:
    the ring's mesh axis (``_ids_int32``)."""
    B, Sq, Sk = q.shape[0], q.shape[1], k.shape[1]
    window = window_sides(window)
    dummy_q = np.zeros((B, Sq, 1, 1), np.float32)
    dummy_k = np.zeros((B, Sk, 1, 1), np.float32)
    kw = dict(window=window, softcap=softcap)
    for name, ids in (("segment_ids", segment_ids),
                      ("kv_segment_ids", kv_segment_ids)):
        if ids is not None:
            if not hasattr(ids, "shape") or not hasattr(ids, "dtype"):
                ids = np.asarray(ids)
            kw[name] = _host_or_zeros(ids)
    _C.attn_fwd(dummy_q, dummy_k, dummy_k, check_only=True, **kw)
    ids = None
    if segment_ids is not None:
        q_ids = _ids_int32(segment_ids, 0, axis_name)
        kv_ids = q_ids if kv_segment_ids is None else \
            _ids_int32(kv_segment_ids, 1, axis_name)
        ids = (q_ids, kv_ids)
    return Masks(window, None if softcap is None else float(softcap), ids)


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
        num_threads=0, masks=None):
    """(out, lse) of attention.  out_dtype: q's (default) or the acc dtype.
    positions: None (local, bottom-right aligned) or (table, q_pieces).
    masks: None or a ``Masks``."""
    B, Sq, H, D = q.shape
    acc = acc_dtype(q.dtype)
    results = (_sds(q.shape, out_dtype or q.dtype, q), _sds((B, H, Sq), acc, q))
    args, attrs = _with_positions([q, k, v], _attrs(causal, scale, D, num_threads),
                                  positions, masks)
    return _call("ringattn_attn_fwd", results, args, attrs)


def fwd_acc(q, k, v, out, lse, *, causal=False, scale=None, positions=None,
            num_threads=0, masks=None):
    """Merge this k/v block into the running state (out, lse) (acc dtype),
    in place where XLA can: the ring's block step."""
    results = (_sds(out.shape, out.dtype, q), _sds(lse.shape, lse.dtype, q))
    args, attrs = _with_positions([q, k, v, out, lse],
                                  _attrs(causal, scale, q.shape[3], num_threads),
                                  positions, masks)
    return _call("ringattn_attn_fwd_acc", results, args, attrs,
                 aliases={3: 0, 4: 1})


def bwd_preprocess(dout, out, *, num_threads=0):
    """delta = rowsum(dout * out): (B, H, S_q) acc dtype."""
    B, Sq, H, _ = dout.shape
    return _call("ringattn_attn_bwd_pre",
                 (_sds((B, H, Sq), acc_dtype(dout.dtype), dout),), [dout, out],
                 dict(num_threads=np.int64(num_threads)))[0]


def bwd(dout, q, k, v, lse, delta, *, causal=False, scale=None,
        grad_dtype=None, positions=None, num_threads=0, masks=None):
    """(dq, dk, dv) of one call (deterministic), in grad_dtype (q's by
    default, or the acc dtype)."""
    gd = grad_dtype or q.dtype
    results = (_sds(q.shape, gd, q), _sds(k.shape, gd, q), _sds(v.shape, gd, q))
    args, attrs = _with_positions([dout, q, k, v, lse, delta],
                                  _attrs(causal, scale, q.shape[3], num_threads),
                                  positions, masks)
    return _call("ringattn_attn_bwd", results, args, attrs)


def bwd_acc(dout, q, k, v, lse, delta, dq, dk, dv, *, causal=False,
            scale=None, positions=None, num_threads=0, masks=None):
    """Add this block's gradients into (dq, dk, dv) (acc dtype, in place
    where XLA can)."""
    results = tuple(_sds(g.shape, g.dtype, q) for g in (dq, dk, dv))
    args, attrs = _with_positions([dout, q, k, v, lse, delta, dq, dk, dv],
                                  _attrs(causal, scale, q.shape[3], num_threads),
                                  positions, masks)
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
    """custom_vjp over (q, k, v, *ids) returning out, or (out, lse):
    forward(q, k, v, *ids) -> (out, lse); backward(dout, q, k, v, lse,
    delta, *ids) -> (dq, dk, dv); ids (integer segment ids) get no
    gradient.  A cotangent g of lse enters as delta - g (the gradient of
    lse_i with respect to score s_ij is P_ij), so one backward kernel
    serves both."""
    @jax.custom_vjp
    def f(q, k, v, *ids):
        out, lse = forward(q, k, v, *ids)
        return (out, lse) if return_lse else out

    def f_fwd(q, k, v, *ids):
        out, lse = forward(q, k, v, *ids)
        return ((out, lse) if return_lse else out), (q, k, v, out, lse, ids)

    def f_bwd(res, cotangent):
        q, k, v, out, lse, ids = res
        dout, dlse = cotangent if return_lse else (cotangent, None)
        dout = dout.astype(out.dtype)
        delta = bwd_preprocess(dout, out)
        if dlse is not None:
            delta = delta - dlse.astype(delta.dtype)
        no_grad = tuple(np.zeros(x.shape, jax.dtypes.float0) for x in ids)
        return tuple(backward(dout, q, k, v, lse, delta, *ids)) + no_grad

    f.defvjp(f_fwd, f_bwd)
    return f


def attention(q, k, v, *, causal=False, scale=None, return_lse=False,
              segment_ids=None, kv_segment_ids=None, window=None,
              softcap=None):
    """Differentiable attention: out (B, S_q, H, D) in q's dtype, or (out,
    lse) with return_lse (lse (B, H, S_q) float32, float64 for float64).
    Masks as ``ringattn.attention`` (segment ids travel as int32)."""
    check_qkv(q, k, v)
    masks = check_masks(q, k, segment_ids, kv_segment_ids, window, softcap)
    ids = masks.ids or ()

    def with_ids(ids):
        return Masks(masks.window, masks.softcap, ids or None)

    return _vjp(
        lambda q, k, v, *ids: fwd(q, k, v, causal=causal, scale=scale,
                                  masks=with_ids(ids)),
        lambda *a: bwd(*a[:6], causal=causal, scale=scale,
                       masks=with_ids(a[6:])),
        bool(return_lse))(q, k, v, *ids)


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
