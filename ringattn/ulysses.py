"""Ulysses and hybrid (2D) sequence parallelism: an all-to-all over heads
inside groups of ranks, the ring across the groups (DESIGN §4).

``ulysses=u`` (u divides p and the query heads H) cuts the p ranks into
r = p / u groups of u consecutive ranks.  Rank g * u + j holds part j of
group g's tokens (``shard_indices(n, p, layout, ulysses=u)``: group g's
tokens are rank g's shard of the ring over r ranks).

Forward.  Inside each group one all-to-all turns (this rank's tokens, all
heads) into (the group's tokens, heads [j H/u, (j+1) H/u)) for q, k and v
together; the ring (``ringattn.ring``) then runs over the r ranks that
hold the same heads in every group, with the call's layout over groups,
so each ring position is a whole group and zigzag still balances causal
work; a second all-to-all brings out (and lse) back to the token layout.
u = 1 is the plain ring (never comes here), u = p pure Ulysses (a ring of
one rank: local attention).  Shards of unequal length (any n, n < p) are
blocks of unequal size in the all-to-all.

Backward.  dout, q, k, v, and per row lse and delta = rowsum(dout * out) -
dlse (computed where the tokens are, so out itself never travels and ranks
may differ in passing dlse) go to the head layout; the ring backward runs
over the groups; dq, dk, dv come back.

GQA.  Rank j of a group needs the kv heads its query heads read.  When u
does not divide H_kv (fewer kv heads than u, MQA), every kv head is
replicated t = u / gcd(H_kv, u) times for the exchange (H_kv * t =
lcm(H_kv, u) heads, kv head h read by replicas h t .. h t + t - 1), as
USP does: each rank then holds lcm(H_kv, u) / u of them.  The cost: the
k/v all-to-all and the ring move t times the kv bytes a divisible H_kv
would need (at most all H heads: MHA-sized k/v traffic), and the
gradients of the replicas come back in float32 and are summed on the
owner (``_C.add_``).

Sub-communicators.  The group (u ranks, color g) and the ring (r ranks,
color j) are ``comm.split`` results, made once per (comm, u) and kept on
the communicator (they close with it).  Errors of their transfers name the
ranks of the communicator that owns the transport (host, threads: the one
that was split) and the operation ("alltoall", "sendrecv").

Shapes as ``ringattn.ring``: q (B, n_r, H, D), k, v (B, n_r, H_kv, D), lse
(B, H, n_r), segment_ids (B, n_r).
"""

import math
import time

import numpy as np

from . import _C, checks
from .agreement import agree, describe
from .interop import kind_of, from_buffer
from .layout import check_ulysses, shard_progressions
from .masks import mask_kwargs
from .ring import (BackwardCheck, RingCall, RingMasks, as_result,
                   grads_with_delta, ring_attention, shard_buffers, _device)
from .ring_blocks import copy_rows

__all__ = ["ulysses_attention", "ulysses_attention_backward", "groups",
           "kv_replicas", "check_heads"]


# ---- arguments and groups ---------------------------------------------------

def check_heads(heads, heads_kv, u):
    """ValueError unless u divides the query heads (before any
    communication)."""
    if heads % u:
        raise ValueError(
            f"ulysses: the query heads H = {heads} must be divisible by "
            f"ulysses = {u} (each rank of a group takes H / u heads)")
    if heads_kv < 1 or heads % heads_kv:
        raise ValueError(f"k: expected kv heads dividing H = {heads}, got "
                         f"{heads_kv}")


def kv_replicas(heads_kv, u):
    """t: how often each kv head is replicated so that u ranks hold whole,
    equal sets of kv heads (1 when u divides H_kv)."""
    return u // math.gcd(heads_kv, u)


def groups(comm, u, timeout=None):
    """(group, ring): this rank's group of u consecutive ranks and the ring
    of the r = p / u ranks holding its place in every group.  Split once per
    (comm, u) and kept on `comm` (collective the first time)."""
    cache = getattr(comm, "__dict__", None)
    made = None if cache is None else cache.setdefault("_ulysses_groups", {})
    pair = None if made is None else made.get(u)
    if pair is not None and not (pair[0].closed or pair[1].closed):
        return pair
    g, j = divmod(comm.rank, u)
    group = comm.split(g, key=j, timeout=timeout)
    ring = comm.split(j, key=g, timeout=timeout)
    if made is not None:
        made[u] = (group, ring)
    return group, ring


class _Call:
    """What a Ulysses call settles before its first transfer."""

    def __init__(self, comm, u, layout, call, qb, kb):
        self.u = check_ulysses(u, comm.size)
        self.layout = layout
        self.call = call
        B, _, H, D = qb.shape
        self.heads, self.heads_kv = H, kb.shape[2]
        check_heads(H, self.heads_kv, self.u)
        self.replicas = kv_replicas(self.heads_kv, self.u)
        self.dev = _device(qb)
        self.alltoall_s = 0.0
        self.alltoall_bytes = 0

    def settle(self, comm, plan):
        """After the agreement: the groups and the token counts of my
        group's members (seq_len n)."""
        self.n = plan.n
        self.group, self.ring = groups(comm, self.u, self.call.timeout)
        g = comm.rank // self.u
        p = comm.size
        self.lengths = [sum(x for _, _, x in shard_progressions(
            self.n, p, self.layout, g * self.u + j, self.u))
            for j in range(self.u)]

    def inner_kw(self):
        """The ring's keywords shared by forward and backward."""
        call = self.call
        return dict(layout=self.layout, seq_len=self.n,
                    progress=call.progress, num_threads=call.threads,
                    timeout=call.timeout)

    def report(self, profile, inner):
        """The ring's profile plus the all-to-alls: their bytes count in
        bytes_sent and their time in wait_s (time blocked communicating)."""
        if profile is None:
            return
        profile.update(inner)
        profile["alltoall_s"] = self.alltoall_s
        profile["alltoall_bytes"] = self.alltoall_bytes
        profile["wait_s"] = inner.get("wait_s", 0.0) + self.alltoall_s
        profile["bytes_sent"] = inner.get("bytes_sent", 0) + \
            self.alltoall_bytes


# ---- the all-to-alls ---------------------------------------------------------

class _Plane:
    """One array of an all-to-all: `buf` with its token axis and head axis
    (None: every rank gets all of it, e.g. segment ids), `heads` heads per
    rank in the head layout, kv head replicas `replicas`."""

    def __init__(self, buf, token_axis, head_axis, heads, replicas=1):
        self.buf, self.token_axis, self.head_axis = buf, token_axis, head_axis
        self.heads, self.replicas = heads, replicas

    def block_shape(self, tokens, heads=None):
        shape = list(self.buf.shape)
        shape[self.token_axis] = tokens
        if self.head_axis is not None:
            shape[self.head_axis] = self.heads if heads is None else heads
        return tuple(shape)

    def pack(self, dst, i):
        """The heads of rank i (all tokens of ours) into `dst`."""
        x, ha, hk, t = self.buf, self.head_axis, self.heads, self.replicas
        if ha is None:
            copy_rows(dst, x, 0)
        elif t == 1:
            dst.copy_(x.narrow(ha, i * hk, hk))
        else:
            # replica c of rank i's heads reads kv head (i hk + c) // t
            for c in range(hk):
                dst.narrow(ha, c, 1).copy_(x.narrow(ha, (i * hk + c) // t, 1))


def _size(shape):
    return int(np.prod(shape, dtype=np.int64))


def _exchange(ucall, planes, send_shapes, recv_shapes, pack, unpack):
    """One all-to-all over the group of every plane (one dtype): block i of
    each plane packed by pack(plane, view, i), what rank j sent handed to
    unpack(plane, view, j).  send_shapes[i] / recv_shapes[j]: the planes'
    block shapes to / from that rank."""
    group = ucall.group
    u, me = group.size, group.rank
    dtype, dev = planes[0].buf.dtype, ucall.dev

    def flat(shapes):
        sizes = [sum(_size(s) for s in per) for per in shapes]
        buf = _C.empty((max(1, sum(sizes)),), dtype, *dev)
        offs = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        return buf, [buf.narrow(0, int(offs[i]), sizes[i]) for i in range(u)]

    send, sends = flat(send_shapes)
    recv, recvs = flat(recv_shapes)
    for i in range(u):
        at = 0
        for plane, shape in zip(planes, send_shapes[i]):
            pack(plane, sends[i].narrow(0, at, _size(shape)).reshape(shape), i)
            at += _size(shape)
    t0 = time.perf_counter()
    group.alltoall(sends, recvs, timeout=ucall.call.timeout)
    ucall.alltoall_s += time.perf_counter() - t0
    ucall.alltoall_bytes += sum(sends[i].nbytes for i in range(u) if i != me)
    for j in range(u):
        at = 0
        for plane, shape in zip(planes, recv_shapes[j]):
            unpack(plane, recvs[j].narrow(0, at, _size(shape)).reshape(shape),
                   j)
            at += _size(shape)


def to_heads(ucall, planes):
    """Token layout -> head layout: per plane a Buffer with the group's
    tokens (in member order) and `heads` heads."""
    lengths, me = ucall.lengths, ucall.group.rank
    n_g = sum(lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    outs = {id(p): _C.empty(p.block_shape(n_g), p.buf.dtype, *ucall.dev)
            for p in planes}

    def unpack(plane, block, j):
        dst = outs[id(plane)].narrow(plane.token_axis, int(starts[j]),
                                     lengths[j])
        copy_rows(dst, block, 0)

    u = len(lengths)
    _exchange(ucall, planes,
              [[p.block_shape(lengths[me]) for p in planes]] * u,
              [[p.block_shape(lengths[j]) for p in planes]
               for j in range(u)],
              lambda plane, view, i: plane.pack(view, i), unpack)
    return [outs[id(p)] for p in planes]


def to_tokens(ucall, planes):
    """Head layout -> token layout: per plane a Buffer with this rank's
    tokens and the heads of every rank (u * heads, replicas still apart)."""
    lengths, me = ucall.lengths, ucall.group.rank
    u = len(lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    outs = {id(p): _C.empty(p.block_shape(lengths[me], u * p.heads),
                            p.buf.dtype, *ucall.dev) for p in planes}

    def pack(plane, view, i):
        view.copy_(plane.buf.narrow(plane.token_axis, int(starts[i]),
                                    lengths[i]))

    def unpack(plane, block, j):
        outs[id(plane)].narrow(plane.head_axis, j * plane.heads,
                               plane.heads).copy_(block)

    _exchange(ucall, planes,
              [[p.block_shape(lengths[i]) for p in planes] for i in range(u)],
              [[p.block_shape(lengths[me]) for p in planes]] * u,
              pack, unpack)
    return [outs[id(p)] for p in planes]


def _sum_replicas(full, replicas, heads_kv, head_axis, dtype):
    """(.., H_kv * t, ..) gradients of replicated kv heads -> (.., H_kv, ..)
    in `dtype`: replica c of kv head h is head h t + c."""
    if replicas == 1:
        return full if full.dtype == dtype else full.astype(dtype)
    shape = list(full.shape)
    shape[head_axis] = heads_kv
    acc = "float64" if full.dtype == "float64" else "float32"
    total = _C.zeros(tuple(shape), acc, *_device(full))
    for c in range(replicas):
        _C.add_(total, full.narrow(head_axis, c, heads_kv, replicas))
    return total if total.dtype == dtype else total.astype(dtype)


def _ids_in_heads(ucall, masks):
    """The group's segment ids (B, n_g) int32, or None."""
    if masks.ids is None:
        return None
    (ids,) = to_heads(ucall, [_Plane(masks.ids, 1, None, 0)])
    return ids


# ---- forward and backward ---------------------------------------------------

def _start(comm, u, op, named, local_check, causal, scale, layout, seq_len,
           masks_args, call):
    """Checked buffers, masks and the settled call: the checks first (no
    communication), then the agreement over all p ranks, then the groups."""
    bufs = shard_buffers(named, local_check)
    ucall = _Call(comm, u, layout, call, bufs[0], bufs[1])
    masks = RingMasks(*masks_args, layout)
    plan = agree(comm, describe(op, bufs[0], bufs[1], causal, scale, layout,
                                call.seq_len, ulysses=ucall.u,
                                **masks.describe()), call.timeout)
    ucall.settle(comm, plan)
    return bufs, masks, ucall


def ulysses_attention(q, k, v, comm, ulysses, *, causal=False, scale=None,
                      layout="contiguous", seq_len=None, return_lse=False,
                      segment_ids=None, window=None, softcap=None,
                      progress=None, num_threads=None, timeout=None,
                      profile=None):
    """``ring_attention(..., ulysses=u)`` for u > 1 (see the module
    docstring); arguments and results as there."""
    causal, return_lse = (checks.flag(causal, "causal"),
                          checks.flag(return_lse, "return_lse"))
    call = RingCall(comm, layout, seq_len, num_threads, timeout, progress,
                    profile)
    check_ulysses(ulysses, comm.size)
    kind = kind_of(q)
    mask_kw = mask_kwargs(segment_ids, None, window, softcap)
    (qb, kb, vb), masks, ucall = _start(
        comm, ulysses, "fwd", [("q", q), ("k", k), ("v", v)],
        lambda q, k, v: _C.attn_fwd(q, k, v, causal=causal, scale=scale,
                                    check_only=True, **mask_kw),
        causal, scale, call.layout, seq_len, (segment_ids, window, softcap),
        call)
    u, t = ucall.u, ucall.replicas
    hq, hkv = ucall.heads // u, ucall.heads_kv * t // u
    q_h, k_h, v_h = to_heads(ucall, [_Plane(qb, 1, 2, hq),
                                     _Plane(kb, 1, 2, hkv, t),
                                     _Plane(vb, 1, 2, hkv, t)])
    inner = {}
    out_h, lse_h = ring_attention(
        q_h, k_h, v_h, ucall.ring, causal=causal, scale=scale,
        return_lse=True, segment_ids=_ids_in_heads(ucall, masks),
        window=masks.window, softcap=masks.softcap, profile=inner,
        **ucall.inner_kw())
    (out,) = to_tokens(ucall, [_Plane(out_h, 1, 2, hq)])
    lse = to_tokens(ucall, [_Plane(lse_h, 2, 1, hq)])[0] if return_lse \
        else None
    ucall.report(call.profile, inner)
    out = as_result(out, qb, kind)
    return (out, from_buffer(lse, kind)) if return_lse else out


def ulysses_attention_backward(dout, q, k, v, out, lse, comm, ulysses, *,
                               causal=False, scale=None, layout="contiguous",
                               seq_len=None, segment_ids=None, window=None,
                               softcap=None, dlse=None, progress=None,
                               num_threads=None, timeout=None, profile=None):
    """``ring_attention_backward(..., ulysses=u)`` for u > 1 (see the module
    docstring); arguments and results as there."""
    causal = checks.flag(causal, "causal")
    call = RingCall(comm, layout, seq_len, num_threads, timeout, progress,
                    profile)
    check_ulysses(ulysses, comm.size)
    kind = kind_of(q)
    local_check = BackwardCheck(causal, scale, segment_ids, window, softcap,
                                dlse)
    bufs, masks, ucall = _start(
        comm, ulysses, "bwd", [("q", q), ("k", k), ("v", v), ("dout", dout),
                               ("out", out), ("lse", lse)], local_check,
        causal, scale, call.layout, seq_len, (segment_ids, window, softcap),
        call)
    qb, kb, vb, doutb, outb, lseb = bufs
    u, t = ucall.u, ucall.replicas
    hq, hkv = ucall.heads // u, ucall.heads_kv * t // u
    # delta = rowsum(dout * out) - dlse where the tokens are
    delta = local_check.delta(doutb, outb, call.threads, kind)
    dout_h, q_h, k_h, v_h = to_heads(ucall, [
        _Plane(doutb, 1, 2, hq), _Plane(qb, 1, 2, hq),
        _Plane(kb, 1, 2, hkv, t), _Plane(vb, 1, 2, hkv, t)])
    rows = [_Plane(lseb, 2, 1, hq)]
    if delta.dtype == lseb.dtype:
        rows.append(_Plane(delta, 2, 1, hq))
        lse_h, delta_h = to_heads(ucall, rows)
    else:
        (lse_h,) = to_heads(ucall, rows)
        (delta_h,) = to_heads(ucall, [_Plane(delta, 2, 1, hq)])
    inner = {}
    dq_h, dk_h, dv_h = grads_with_delta(
        dout_h, q_h, k_h, v_h, lse_h, delta_h, ucall.ring, causal=causal,
        scale=scale, segment_ids=_ids_in_heads(ucall, masks),
        window=masks.window, softcap=masks.softcap, profile=inner,
        **ucall.inner_kw())
    # dq and unreplicated dk/dv travel in the inputs' dtype (rounded once);
    # replicas in float32, summed at home
    (dq,) = to_tokens(ucall, [_Plane(dq_h.astype(qb.dtype), 1, 2, hq)])
    kv_dtype = dk_h.dtype if t > 1 else kb.dtype
    dk_full, dv_full = to_tokens(ucall, [
        _Plane(g if g.dtype == kv_dtype else g.astype(kv_dtype), 1, 2, hkv)
        for g in (dk_h, dv_h)])
    dk = _sum_replicas(dk_full, t, ucall.heads_kv, 2, kb.dtype)
    dv = _sum_replicas(dv_full, t, ucall.heads_kv, 2, vb.dtype)
    ucall.report(call.profile, inner)
    return tuple(from_buffer(g, kind) for g in (dq, dk, dv))
