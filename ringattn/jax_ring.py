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
dk/dv accumulators (float32) travel with their k/v blocks and take one last
hop home.  Only kv heads travel (GQA).

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
from .checks import flag as _flag


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

    def __init__(self, axis_name, p, causal, scale, table):
        self.axis_name, self.p = axis_name, p
        self.causal, self.scale = causal, scale
        self.table = table
        self.threads = _threads(p)
        self.shift = [(i, (i + 1) % p) for i in range(p)]

    def positions(self, step):
        """Position operand for the block this device holds at `step` (None
        when not causal: positions do not matter then)."""
        if not self.causal:
            return None
        rank = jax.lax.axis_index(self.axis_name)
        table = jnp.asarray(self.table)
        rows = jnp.concatenate([table[rank], table[(rank - step) % self.p]])
        return rows, self.table.shape[1]

    def send_on(self, x):
        return jax.lax.ppermute(x, self.axis_name, self.shift)

    def kw(self, step):
        return dict(causal=self.causal, scale=self.scale,
                    positions=self.positions(step), num_threads=self.threads)

    def forward(self, q, k, v):
        acc = _ffi.acc_dtype(q.dtype)
        out, lse = _ffi.fwd(q, k, v, out_dtype=acc, **self.kw(0))
        kv = (k, v)
        for step in range(1, self.p):
            kv = self.send_on(kv)
            out, lse = _ffi.fwd_acc(q, *kv, out, lse, **self.kw(step))
        return out.astype(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, dlse=None):
        delta = _ffi.bwd_preprocess(dout, out, num_threads=self.threads)
        if dlse is not None:
            # d lse_i / d s_ij = P_ij: a cotangent of lse enters as delta - g
            delta = delta - dlse.astype(delta.dtype)
        acc = _ffi.acc_dtype(q.dtype)
        dq, dk, dv = _ffi.bwd(dout, q, k, v, lse, delta, grad_dtype=acc,
                              **self.kw(0))
        kv, dkv = (k, v), (dk, dv)
        for step in range(1, self.p):
            kv, dkv = self.send_on((kv, dkv))
            dq, *dkv = _ffi.bwd_acc(dout, q, *kv, lse, delta, dq, *dkv,
                                    **self.kw(step))
        if self.p > 1:
            dkv = self.send_on(tuple(dkv))   # the last hop home
        dk, dv = dkv
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def ring_attention(q, k, v, *, axis_name, causal=False, scale=None,
                   layout="contiguous", seq_len=None, return_lse=False):
    """Exact attention over the sequence sharded along mesh axis `axis_name`.

    Call under ``jax.shard_map``.  q: (B, n_r, H, D); k, v: (B, n_r, H_kv,
    D): this device's shard in `layout` ('contiguous' | 'zigzag' |
    'striped').  Returns out (B, n_r, H, D) in q's dtype, or (out, lse) with
    return_lse (lse (B, H, n_r) float32, float64 for float64 inputs);
    differentiable, through lse too.
    """
    _ffi.check_qkv(q, k, v)
    if not isinstance(layout, str) or layout not in _layout.LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(map(repr, _layout.LAYOUTS))}, "
                         f"got {layout!r}")
    n_r = q.shape[1]
    if k.shape[1] != n_r:
        raise ValueError(f"k: expected this device's shard length {n_r} (from "
                         f"q), got {k.shape[1]}")
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
    ring = _Ring(axis_name, p, bool(causal), scale, position_table(n, p, layout))

    return_lse = _flag(return_lse, "return_lse")

    def outputs(out, lse):
        return (out, lse) if return_lse else out

    @jax.custom_vjp
    def f(q, k, v):
        return outputs(*ring.forward(q, k, v))

    def f_fwd(q, k, v):
        out, lse = ring.forward(q, k, v)
        return outputs(out, lse), (q, k, v, out, lse)

    def f_bwd(res, cotangent):
        q, k, v, out, lse = res
        dout, dlse = cotangent if return_lse else (cotangent, None)
        return ring.backward(dout.astype(out.dtype), q, k, v, out, lse, dlse)

    f.defvjp(f_fwd, f_bwd)
    return f(q, k, v)
