"""Dilated (LongNet) attention over the ring.

A branch whose segments lie inside one rank's shard is computed locally by
the dilated CPU kernel, with no communication.  For a branch whose segments
span shards, each rank receives from every other rank only the rows of the
shared segments that its heads select (offset h mod r), and only the kv heads
that read them; with causal masking only keys at or before its last selected
query.  The bytes on the wire therefore shrink by the branch's dilation rate.
Received rows are computed with the dense kernel over affine positions (a
selected row set is an arithmetic progression of global positions), merging
into the same float32 running state by the LSE rule.

Backward: the same exchange brings the rows in; dk/dv contributions for
them go back to their owner in the reverse direction and are added there.

Exchange schedule: p-1 rounds; in round d rank u sends to u+d and receives
from u-d, so every pair meets exactly once per direction and nobody waits on
a rank that is not sending to it.  Both sides derive the block lists from
the agreed plan, so sizes always match.
"""

import math

from . import _C, checks
from .agreement import agree, describe
from .dilated import check_config
from .interop import from_buffer, kind_of
from .lse_cotangent import check_dlse, fold_into_delta
from .ring import RingCall, _device, as_result, empty_state, shard_buffers

__all__ = ["ring_dilated_attention", "ring_dilated_attention_backward"]


def _select(piece, seg_lo, seg_hi, r, o, pos_max=None):
    """Rows of a shard piece in segment [seg_lo, seg_hi) at offset o (mod r).

    piece: (local_offset, start, stride, length), positions start + stride*i.
    Returns (local_first, local_step, pos_first, pos_step, count) or None.
    """
    off, start, stride, length = piece
    hi = seg_hi if pos_max is None else min(seg_hi, pos_max + 1)
    i0 = max(0, -((start - seg_lo) // stride))
    i1 = min(length, -((start - hi) // stride))
    if i0 >= i1:
        return None
    period = r // math.gcd(stride, r)
    first = None
    for i in range(i0, min(i1, i0 + period)):
        if (start + stride * i - seg_lo) % r == o:
            first = i
            break
    if first is None:
        return None
    count = (i1 - 1 - first) // period + 1
    if count == 1:      # no step taken: keep it small (a huge rate's would
        period = 1      # leave the positions' int64 bound)
    return (off + first, period, start + stride * first, stride * period, count)


def _pieces(plan, rank):
    return plan.local_pieces(rank)


def _blocks(plan, u, t, segs, rates, H, Hkv, causal):
    """Blocks of rows rank t sends rank u: one per (branch, segment, offset,
    t piece, kv head).  Each block: dict(branch, g, heads, k=(select tuple),
    qs=[select tuples of u's query rows])."""
    if plan.lengths[u] == 0 or plan.lengths[t] == 0:
        return []
    n = plan.n
    group = H // Hkv
    u_pieces = _pieces(plan, u)
    t_pieces = _pieces(plan, t)
    t_lo = min(p[1] for p in t_pieces)
    t_hi = max(p[1] + p[2] * (p[3] - 1) for p in t_pieces)
    out = []
    for b, (w, r) in enumerate(zip(segs, rates)):
        seg_ids = set()
        for _, start, stride, length in u_pieces:
            last = start + stride * (length - 1)
            s_lo, s_hi = start // w, last // w
            # only segments that can also hold rows of t
            s_lo, s_hi = max(s_lo, t_lo // w), min(s_hi, t_hi // w)
            seg_ids.update(range(s_lo, s_hi + 1))
        for s in sorted(seg_ids):
            seg_lo, seg_hi = s * w, min((s + 1) * w, n)
            for o in range(min(r, seg_hi - seg_lo)):
                heads = [h for h in range(o, H, r)]
                if not heads:
                    continue
                qs = [x for x in (_select(p, seg_lo, seg_hi, r, o)
                                  for p in u_pieces) if x is not None]
                if not qs:
                    continue
                qmax = max(x[2] + x[3] * (x[4] - 1) for x in qs)
                for tp in t_pieces:
                    ks = _select(tp, seg_lo, seg_hi, r, o,
                                 qmax if causal else None)
                    if ks is None:
                        continue
                    for g in sorted({h // group for h in heads}):
                        out.append({"branch": b, "g": g, "k": ks, "qs": qs,
                                    "heads": [h for h in heads if h // group == g]})
    return out


def _block_numel(blk, B, D):
    return 2 * B * blk["k"][4] * D


def _pack(blocks, kb, vb, B, D, dtype, dev):
    """Gather the blocks' rows of local k, v into one flat buffer (on k's
    device: strided copies, no host round trip)."""
    total = sum(_block_numel(x, B, D) for x in blocks)
    if not total:
        return None
    buf = _C.empty((total,), dtype, *dev)
    for blk, (k_dst, v_dst) in zip(blocks, _views(buf, blocks, B, D)):
        k_dst.copy_(_rows(kb, blk))
        v_dst.copy_(_rows(vb, blk))
    return buf


def _rows(b, blk):
    """The (B, count, 1, D) rows of block `blk` in a local k/v-shaped buffer."""
    first, step, _, _, count = blk["k"]
    return b.narrow(1, first, count, step).narrow(2, blk["g"], 1)


def _views(buf, blocks, B, D):
    """(k, v) views (B, count, 1, D) of each block inside a flat buffer."""
    views, pos = [], 0
    for blk in blocks:
        count = blk["k"][4]
        numel = _block_numel(blk, B, D)
        packed = buf.narrow(0, pos, numel).reshape((2, B, count, 1, D))
        views.append(tuple(packed.narrow(0, j, 1).reshape((B, count, 1, D))
                           for j in (0, 1)))
        pos += numel
    return views


def _local_pairs(plan, r):
    pieces = _pieces(plan, r)
    return [(a, b) for a in pieces for b in pieces]


def _exchange(comm, send, dst, recv, src, tag, timeout):
    if send is None and recv is None:
        return None
    return comm.sendrecv_start(send, dst if send is not None else None,
                               recv, src if recv is not None else None,
                               step=tag, timeout=timeout)


def _prepare(comm, named, segment_lengths, dilation_rates, causal, scale,
             call, op, local_check):
    """Checked configuration, this rank's Buffers and the agreed plan."""
    segs, rates = check_config(segment_lengths, dilation_rates)
    bufs = shard_buffers(named, lambda *b: local_check(segs, rates, *b))
    qb, kb = bufs[0], bufs[1]
    plan = agree(comm, describe(op, qb, kb, causal, scale, call.layout,
                                call.seq_len, segs, rates), call.timeout)
    return segs, rates, bufs, plan


def _rounds(plan, comm, segs, rates, H, Hkv, causal):
    """[(d, dst, send_blocks, src, recv_blocks)] for rounds with traffic."""
    p, u = comm.size, comm.rank
    rounds = []
    for d in range(1, p):
        dst, src = (u + d) % p, (u - d) % p
        send = _blocks(plan, dst, u, segs, rates, H, Hkv, causal)
        recv = _blocks(plan, u, src, segs, rates, H, Hkv, causal)
        if send or recv:
            rounds.append((d, dst, send, src, recv))
    return rounds


def ring_dilated_attention(q, k, v, comm, segment_lengths, dilation_rates, *,
                           causal=False, scale=None, layout="contiguous",
                           seq_len=None, return_lse=False, num_threads=None,
                           timeout=None, profile=None):
    """Dilated attention over the sequence sharded across `comm`'s ranks.

    Shapes as ``ring_attention``: q (B, n_r, H, D), k, v (B, n_r, H_kv, D),
    this rank's shard in `layout`.  Returns out (B, n_r, H, D) in q's dtype
    (and lse (B, H, n_r) with return_lse=True).  profile: a dict filled with
    {"bytes_sent", "rounds"} (the exchange rounds with traffic to or from
    this rank).  Arguments are checked as ``dilated_attention`` checks
    them, before any communication; timeout as ``ring_attention``.
    """
    causal, return_lse = (checks.flag(causal, "causal"),
                          checks.flag(return_lse, "return_lse"))
    call = RingCall(comm, layout, seq_len, num_threads, timeout,
                    profile=profile)
    kind = kind_of(q)
    segs, rates, (qb, kb, vb), plan = _prepare(
        comm, [("q", q), ("k", k), ("v", v)], segment_lengths, dilation_rates,
        causal, scale, call, "dilated_fwd",
        lambda segs, rates, q, k, v: _C.dilated_fwd(
            q, k, v, segs, rates, causal=causal, scale=scale,
            check_only=True))
    threads, timeout, profile = call.threads, call.timeout, call.profile
    B, n_r, H, D = qb.shape
    Hkv = kb.shape[2]
    dev = _device(qb)
    acc = "float64" if qb.dtype == "float64" else "float32"
    out, lse = empty_state(B, n_r, H, D, acc, dev)
    u = comm.rank

    # local part: every pair of this rank's stride-1 pieces through the
    # dilated kernel; pieces with stride > 1 (striped) go through blocks
    local_blocks = []
    for qp, kp in _local_pairs(plan, u):
        if qp[2] == 1 and kp[2] == 1:
            _C.dilated_fwd(qb.narrow(1, qp[0], qp[3]), kb.narrow(1, kp[0], kp[3]),
                           vb.narrow(1, kp[0], kp[3]), segs, rates,
                           causal=causal, scale=scale,
                           out=out.narrow(1, qp[0], qp[3]),
                           lse=lse.narrow(2, qp[0], qp[3]), accumulate=True,
                           q_pos_offset=qp[1], k_pos_offset=kp[1],
                           num_threads=threads)
    if any(pc[2] != 1 for pc in _pieces(plan, u)):
        local_blocks = _blocks(plan, u, u, segs, rates, H, Hkv, causal)
        views = [(kb.narrow(1, x["k"][0], x["k"][4], x["k"][1]).narrow(2, x["g"], 1),
                  vb.narrow(1, x["k"][0], x["k"][4], x["k"][1]).narrow(2, x["g"], 1))
                 for x in local_blocks]
        _forward_blocks(local_blocks, views, qb, out, lse, causal, scale, threads)

    # rounds are pipelined: the rows of round i+1 travel while round i's
    # rows are computed (requests complete in order on every rank)
    sent = 0
    pending = None
    rounds = _rounds(plan, comm, segs, rates, H, Hkv, causal)
    for item in rounds + [None]:
        d = None if item is None else item[0]
        if d is not None:
            _, dst, send, src, recv = item
            send_buf = _pack(send, kb, vb, B, D, qb.dtype, dev) if send else None
            total = sum(_block_numel(x, B, D) for x in recv)
            recv_buf = _C.empty((total,), qb.dtype, *dev) if recv else None
            req = _exchange(comm, send_buf, dst, recv_buf, src, d, timeout)
            if send_buf is not None:
                sent += send_buf.nbytes
        if pending is not None:
            p_req, p_recv, p_buf, _ = pending
            if p_req is not None:
                p_req.wait()
            if p_recv:
                _forward_blocks(p_recv, _views(p_buf, p_recv, B, D), qb, out,
                                lse, causal, scale, threads)
            pending = None
        if d is not None:
            pending = (req, recv, recv_buf, send_buf)
    if profile is not None:
        profile.update(bytes_sent=sent, rounds=len(rounds))
    out_final = as_result(out, qb, kind)
    if return_lse:
        return out_final, from_buffer(lse, kind)
    return out_final


def _forward_blocks(blocks, views, qb, out, lse, causal, scale, threads):
    for blk, (k_blk, v_blk) in zip(blocks, views):
        _, _, k_pos, k_step, _ = blk["k"]
        for h in blk["heads"]:
            for q_first, q_step, q_pos, q_pstep, q_count in blk["qs"]:
                _C.attn_fwd(
                    qb.narrow(1, q_first, q_count, q_step).narrow(2, h, 1),
                    k_blk, v_blk, causal=causal, scale=scale,
                    out=out.narrow(1, q_first, q_count, q_step).narrow(2, h, 1),
                    lse=lse.narrow(1, h, 1).narrow(2, q_first, q_count, q_step),
                    accumulate=True, q_pos_offset=q_pos, q_pos_stride=q_pstep,
                    k_pos_offset=k_pos, k_pos_stride=k_step,
                    num_threads=threads)


def _backward_blocks(blocks, views, grad_views, qb, doutb, lseb, delta, dq,
                     causal, scale, threads, branches):
    """The exchanged rows' gradients; branches=(segs, rates) tells the
    kernel which (query, key) pairs several branches share."""
    for blk, (k_blk, v_blk), (dk_blk, dv_blk) in zip(blocks, views, grad_views):
        _, _, k_pos, k_step, _ = blk["k"]
        for h in blk["heads"]:
            for q_first, q_step, q_pos, q_pstep, q_count in blk["qs"]:
                rows = lambda b: b.narrow(1, q_first, q_count, q_step).narrow(2, h, 1)
                bhs = lambda b: b.narrow(1, h, 1).narrow(2, q_first, q_count, q_step)
                _C.attn_bwd(rows(doutb), rows(qb), k_blk, v_blk, None, bhs(lseb),
                            causal=causal, scale=scale, dq=rows(dq), dk=dk_blk,
                            dv=dv_blk, delta=bhs(delta), accumulate=True,
                            q_pos_offset=q_pos, q_pos_stride=q_pstep,
                            k_pos_offset=k_pos, k_pos_stride=k_step,
                            num_threads=threads, branches=branches,
                            branch_head=h)


def ring_dilated_attention_backward(dout, q, k, v, out, lse, comm,
                                    segment_lengths, dilation_rates, *,
                                    causal=False, scale=None,
                                    layout="contiguous", seq_len=None,
                                    dlse=None, num_threads=None,
                                    timeout=None):
    """Gradients of ``ring_dilated_attention`` for this rank's shard:
    (dq, dk, dv) in the inputs' dtypes.  dlse: None, or the cotangent of
    this rank's (merged) lse (B, H, n_r) in lse's dtype, whose gradient is
    added (``ringattn.lse_cotangent``)."""
    causal = checks.flag(causal, "causal")
    call = RingCall(comm, layout, seq_len, num_threads, timeout)
    kind = kind_of(q)
    dlse_buf = None

    def local_check(segs, rates, q, k, v, dout, out, lse):
        nonlocal dlse_buf
        _C.dilated_bwd(dout, q, k, v, out, lse, segs, rates, causal=causal,
                       scale=scale, check_only=True)
        dlse_buf = check_dlse(dlse, q)

    segs, rates, (qb, kb, vb, doutb, outb, lseb), plan = _prepare(
        comm, [("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out),
               ("lse", lse)], segment_lengths, dilation_rates, causal, scale,
        call, "dilated_bwd", local_check)
    threads, timeout = call.threads, call.timeout
    B, n_r, H, D = qb.shape
    Hkv = kb.shape[2]
    dev = _device(qb)
    acc = "float64" if qb.dtype == "float64" else "float32"
    u = comm.rank
    delta = fold_into_delta(
        _C.attn_bwd_preprocess(doutb, outb, num_threads=threads), dlse_buf,
        kind)
    lse_c = _C.empty(tuple(lseb.shape), acc, *dev)
    lse_c.copy_(lseb)            # compact, the layout delta has
    dq = _C.zeros((B, n_r, H, D), acc, *dev)
    dk = _C.zeros((B, n_r, Hkv, D), acc, *dev)
    dv = _C.zeros((B, n_r, Hkv, D), acc, *dev)

    for qp, kp in _local_pairs(plan, u):
        if qp[2] == 1 and kp[2] == 1:
            _C.dilated_bwd(doutb.narrow(1, qp[0], qp[3]), qb.narrow(1, qp[0], qp[3]),
                           kb.narrow(1, kp[0], kp[3]), vb.narrow(1, kp[0], kp[3]),
                           None, lse_c.narrow(2, qp[0], qp[3]), segs, rates,
                           causal=causal, scale=scale,
                           dq=dq.narrow(1, qp[0], qp[3]),
                           dk=dk.narrow(1, kp[0], kp[3]),
                           dv=dv.narrow(1, kp[0], kp[3]),
                           delta=delta.narrow(2, qp[0], qp[3]), accumulate=True,
                           q_pos_offset=qp[1], k_pos_offset=kp[1],
                           num_threads=threads)
    if any(pc[2] != 1 for pc in _pieces(plan, u)):
        blocks = _blocks(plan, u, u, segs, rates, H, Hkv, causal)
        sel = lambda b, x: b.narrow(1, x["k"][0], x["k"][4], x["k"][1]).narrow(2, x["g"], 1)
        _backward_blocks(blocks, [(sel(kb, x), sel(vb, x)) for x in blocks],
                         [(sel(dk, x), sel(dv, x)) for x in blocks],
                         qb, doutb, lse_c, delta, dq, causal, scale, threads,
                         (segs, rates))

    for d, dst, send, src, recv in _rounds(plan, comm, segs, rates, H, Hkv,
                                           causal):
        # rows in: k/v of the blocks this rank needs from src
        send_buf = _pack(send, kb, vb, B, D, qb.dtype, dev) if send else None
        recv_total = sum(_block_numel(x, B, D) for x in recv)
        recv_buf = _C.empty((recv_total,), qb.dtype, *dev) if recv else None
        req = _exchange(comm, send_buf, dst, recv_buf, src, 2 * d, timeout)
        if req is not None:
            req.wait()
        grad_out = None
        if recv:
            grad_out = _C.zeros((recv_total,), acc, *dev)
            _backward_blocks(recv, _views(recv_buf, recv, B, D),
                             _views(grad_out, recv, B, D), qb, doutb, lse_c,
                             delta, dq, causal, scale, threads, (segs, rates))
        # gradients out: back to src; ours come back from dst
        send_total = sum(_block_numel(x, B, D) for x in send)
        grad_in = _C.empty((send_total,), acc, *dev) if send else None
        req = _exchange(comm, grad_out, src, grad_in, dst, 2 * d + 1, timeout)
        if req is not None:
            req.wait()
        if send:
            for blk, (dk_in, dv_in) in zip(send, _views(grad_in, send, B, D)):
                _C.add_(_rows(dk, blk), dk_in)
                _C.add_(_rows(dv, blk), dv_in)
    return tuple(as_result(g, like, kind)
                 for g, like in ((dq, qb), (dk, kb), (dv, vb)))
