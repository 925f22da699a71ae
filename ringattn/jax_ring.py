"""The ring inside a JAX program: ``ring_attention(q, k, v, axis_name=...)``.

Called under ``jax.shard_map`` (``jax.experimental.shard_map.shard_map`` on
older JAX) with the sequence dim of q, k, v split over the mesh axis
``axis_name``: each device holds its shard in ``layout`` order (DESIGN §4;
``ringattn.shard``/``ringattn.unshard`` reorder a global array).  The p
shards all have n / p tokens, so seq_len, when given, must be p times the
local length.

Forward: the device keeps its q and a float32 (float64) running state
(out, lse); k/v blocks move to the next device with ``jax.lax.ppermute``
(XLA's collectives: NCCL on GPUs), and each block is one FFI custom call
that merges into the state in place.  The next block's transfer does not
depend on the current block's kernel, so XLA can overlap them.  Backward
(``jax.custom_vjp``): each device keeps q, out, lse, dout and accumulates dq;
dk/dv accumulators (float32) travel with their k/v blocks and get home the
shorter way: one last hop around the ring after a full lap, or back along
the hops they came.  Only kv heads travel (GQA).

Masks (DESIGN §2): segment_ids (B, n_r) are this device's tokens' ids; the
keys' ids travel with their k/v block.  window and softcap are static.  The
hops are the ring's plan for the layout (``ringattn.hops``): blocks go
``right`` hops to the next device and ``left`` hops to the previous one, as
far as a causal mask or a window lets anyone see them (a window over the
contiguous layout: only the neighbours it reaches).  Blocks move whole,
every device alike: shapes in an SPMD program are the same on every device.

Causal masking uses the tokens' global positions.  The rank is a traced
value inside shard_map, so the positions reach the kernels as a small int64
operand (one (length, start, stride) row per run of positions, from
``ringattn.layout.shard_progressions``).  Pieces entirely in the causal
future are skipped by the handler without work; partly visible ones are
trimmed to the rows and keys that see each other.  On a GPU the handler
reads that small table to the host (a copy and a wait on XLA's stream per
causal block call); non-causal rings pass no positions.

Shapes (local): q (B, n_r, H, D); k, v (B, n_r, H_kv, D).
"""

import os

import numpy as np

import jax
import jax.numpy as jnp

from . import _C
from . import jax_ffi as _ffi
from . import layout as _layout
from .checks import flag as _flag, scale_or_none as _scale
from .hops import layout_hops


def shard_map(f, mesh, in_specs, out_specs, check=True):
    """``jax.shard_map`` (``jax.experimental.shard_map.shard_map`` on older
    JAX); check=False turns off its replication/varying-axes checks."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs,
                             out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as legacy

    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                  check_rep=check)


def _axis_size(axis_name):
    size = getattr(jax.lax, "axis_size", None)
    if size is not None:
        return int(size(axis_name))
    return int(jax.lax.psum(1, axis_name))


def position_table(n, p, layout):
    """(p, P, 3) int64: rank r's shard as P runs (length, start, stride) of
    global positions, padded with empty runs so every rank has P rows."""
    progs = [_layout.shard_progressions(n, p, layout, r) for r in range(p)]
    width = max(1, max(len(x) for x in progs))
    table = np.zeros((p, width, 3), np.int64)
    table[:, :, 2] = 1
    for r, runs in enumerate(progs):
        for i, (start, stride, length) in enumerate(runs):
            table[r, i] = (length, start, stride)
    return table


def _threads(p):
    """CPU kernel threads per device: the p devices of a host share its
    cores (0, the kernels' default, when RINGATTN_NUM_THREADS is set)."""
    if os.environ.get("RINGATTN_NUM_THREADS"):
        return 0
    return max(1, _C.cpu_num_threads() // p)


class _Ring:
    """What every step of one ring call needs (all static but the rank)."""

    def __init__(self, axis_name, p, n, layout, causal, scale, masks):
        self.axis_name, self.p = axis_name, p
        self.causal, self.scale, self.masks = causal, scale, masks
        self.table = position_table(n, p, layout)
        hops = layout_hops(n, p, 0, layout, causal, masks.window)
        self.hops = {"right": hops.right, "left": hops.left}
        self.threads = _threads(p)
        self.shift = {"right": [(i, (i + 1) % p) for i in range(p)],
                      "left": [(i, (i - 1) % p) for i in range(p)]}

    def trips(self):
        """(trip, hops) of the trips blocks make (the right one may have
        none: step 0 is the local block)."""
        return [(t, self.hops[t]) for t in ("right", "left") if self.hops[t]]

    def positions(self, trip, d):
        """Position operand for the block this device holds after d hops
        of `trip` (None when neither causal nor a window: positions do not
        matter then)."""
        if not self.causal and self.masks.window is None:
            return None
        rank = jax.lax.axis_index(self.axis_name)
        owner = (rank - d if trip == "right" else rank + d) % self.p
        table = jnp.asarray(self.table)
        rows = jnp.concatenate([table[rank], table[owner]])
        return rows, self.table.shape[1]

    def send_on(self, x, trip="right"):
        return jax.lax.ppermute(x, self.axis_name, self.shift[trip])

    def kw(self, trip, d, q_ids, kv_ids):
        """The block op's keywords after d hops of `trip` (ids: this
        device's and the block's, or None)."""
        ids = None if q_ids is None else (q_ids, kv_ids)
        return dict(causal=self.causal, scale=self.scale,
                    positions=self.positions(trip, d),
                    num_threads=self.threads,
                    masks=_ffi.Masks(self.masks.window, self.masks.softcap,
                                     ids))

    def forward(self, q, k, v, ids):
        acc = _ffi.acc_dtype(q.dtype)
        out, lse = _ffi.fwd(q, k, v, out_dtype=acc,
                            **self.kw("right", 0, ids, ids))
        for trip, hops in self.trips():
            kv = (k, v, ids)
            for d in range(1, hops + 1):
                kv = self.send_on(kv, trip)
                out, lse = _ffi.fwd_acc(q, kv[0], kv[1], out, lse,
                                        **self.kw(trip, d, ids, kv[2]))
        return out.astype(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, ids, dlse=None):
        delta = _ffi.bwd_preprocess(dout, out, num_threads=self.threads)
        if dlse is not None:
            # d lse_i / d s_ij = P_ij: a cotangent of lse enters as delta - g
            delta = delta - dlse.astype(delta.dtype)
        acc = _ffi.acc_dtype(q.dtype)
        dq, dk, dv = _ffi.bwd(dout, q, k, v, lse, delta, grad_dtype=acc,
                              **self.kw("right", 0, ids, ids))
        home = (dk, dv)
        for trip, hops in self.trips():
            kv, dkv = (k, v, ids), home
            for d in range(1, hops + 1):
                kv, dkv = self.send_on((kv, dkv), trip)
                dq, *dkv = _ffi.bwd_acc(dout, q, kv[0], kv[1], lse, delta,
                                        dq, *dkv,
                                        **self.kw(trip, d, ids, kv[2]))
            # home the shorter way: on around the ring, or back
            back = "left" if trip == "right" else "right"
            way, steps = (trip, self.p - hops) if self.p - hops <= hops \
                else (back, hops)
            dkv = tuple(dkv)
            for _ in range(steps):
                dkv = self.send_on(dkv, way)
            home = dkv
        dk, dv = home
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def ring_attention(q, k, v, *, axis_name, causal=False, scale=None,
                   layout="contiguous", seq_len=None, return_lse=False,
                   segment_ids=None, window=None, softcap=None):
    """Exact attention over the sequence sharded along mesh axis `axis_name`.

    Call under ``jax.shard_map``.  q: (B, n_r, H, D); k, v: (B, n_r, H_kv,
    D): this device's shard in `layout` ('contiguous' | 'zigzag' |
    'striped'); segment_ids (B, n_r): its tokens' document ids (int32 in
    the kernels); window=(left, right) and softcap as ``ringattn.attention``
    (static).  Returns out (B, n_r, H, D) in q's dtype, or (out, lse) with
    return_lse (lse (B, H, n_r) float32, float64 for float64 inputs);
    differentiable, through lse too.
    """
    _ffi.check_qkv(q, k, v)
    scale = _scale(scale)
    if not isinstance(layout, str) or layout not in _layout.LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(map(repr, _layout.LAYOUTS))}, "
                         f"got {layout!r}")
    n_r = q.shape[1]
    if k.shape[1] != n_r:
        raise ValueError(f"k: expected this device's shard length {n_r} (from "
                         f"q), got {k.shape[1]}")
    masks = _ffi.check_masks(q, k, segment_ids, None, window, softcap,
                             axis_name=axis_name)
    p = _axis_size(axis_name)
    n = p * n_r
    if seq_len is not None and seq_len != n:
        raise ValueError(f"seq_len: expected {n} ({p} devices x {n_r} tokens "
                         f"per shard), got {seq_len}")
    if any(len(ix) != n_r for ix in _layout.shard_indices(n, p, layout)):
        raise ValueError(f"seq_len: {layout} shards of {n} tokens over {p} "
                         f"devices are not all {n_r} long")
    if n >= 2 ** 31 and not jax.config.jax_enable_x64:
        raise ValueError(f"seq_len: {n} positions need int64: enable "
                         "jax_enable_x64")
    ring = _Ring(axis_name, p, n, layout, bool(causal), scale, masks)
    ids = () if masks.ids is None else (masks.ids[0],)

    return_lse = _flag(return_lse, "return_lse")

    def outputs(out, lse):
        return (out, lse) if return_lse else out

    def one(ids):
        return ids[0] if ids else None

    @jax.custom_vjp
    def f(q, k, v, *ids):
        return outputs(*ring.forward(q, k, v, one(ids)))

    def f_fwd(q, k, v, *ids):
        out, lse = ring.forward(q, k, v, one(ids))
        return outputs(out, lse), (q, k, v, out, lse, ids)

    def f_bwd(res, cotangent):
        q, k, v, out, lse, ids = res
        dout, dlse = cotangent if return_lse else (cotangent, None)
        grads = ring.backward(dout.astype(out.dtype), q, k, v, out, lse,
                              one(ids), dlse)
        return grads + tuple(np.zeros(x.shape, jax.dtypes.float0)
                             for x in ids)

    f.defvjp(f_fwd, f_bwd)
    return f(q, k, v, *ids)
