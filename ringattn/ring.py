"""The ring: attention over a sequence sharded across ranks.

Each rank holds a shard of q, k, v along the sequence (``layout``: DESIGN §4).
Forward: the rank keeps its q and a float32 running state (out, lse); k/v
blocks travel from rank to rank, double buffered, the transfer of the next
block started before the kernel on the current one so the two overlap.
Each block merges into the running state by the LSE rule inside the kernel
(``accumulate``), so nothing is rounded to the input dtype between steps.

Which hops a block makes is the call's plan (``ringattn.hops``), the same
on every rank from the agreed data: the causal mask, the window and the
ranges of the segment ids decide which ranks see which rows of it.  Without
masks that is the plain ring -- send to r+1, receive from r-1, a block going
on until the last rank that sees it; with a window on the contiguous layout,
only the neighbours the window reaches, both ways when it has a right side,
and each hop carries only the rows still needed ahead.  Pieces that nothing
can see are never computed.  The segment ids of a block's rows travel
beside it (a second, small message).

Backward: each rank keeps q, out, lse, dout and accumulates dq; dk/dv
accumulators (float32) travel with their k/v rows, and the rows no later
hop needs go straight home to their owner (after a full lap: one last hop,
as in the plain ring).  Only kv heads travel (GQA cuts traffic by H/H_kv).
Memory per rank is O(n/p).

Shapes (local shard of n_r tokens): q, out, dout (B, n_r, H, D); k, v
(B, n_r, H_kv, D); lse (B, H, n_r) float32 (float64 for float64 inputs);
segment_ids (B, n_r) integers.

``ulysses=u`` > 1 hands the call to ``ringattn.ulysses``: an all-to-all
inside groups of u ranks, this ring across the groups.
"""

import contextlib
import os
import time

import numpy as np

from . import _C, checks
from .agreement import EMPTY_RANGE, MAX_SEQ_LEN, agree, describe, id_chunks
from .hops import HopPlan, layout_hops
from .interop import kind_of, from_buffer, to_buffer, to_device, to_numpy
from .layout import check_layout
from .lse_cotangent import check_dlse, fold_into_delta
from .masks import mask_kwargs
from .ring_blocks import Block, Packed, exchange

__all__ = ["ring_attention", "ring_attention_backward", "grads_with_delta",
           "BackwardCheck"]


def _check_comm(comm):
    for attr in ("rank", "size", "sendrecv_start", "allgather"):
        if not hasattr(comm, attr):
            raise TypeError(
                f"comm: expected a ringattn communicator (ra.init / ra.launch), "
                f"got {type(comm).__name__}")


class RingCall:
    """The checked scalar arguments of one ring call."""

    def __init__(self, comm, layout, seq_len, num_threads, timeout,
                 progress=None, profile=None):
        _check_comm(comm)
        self.layout = check_layout(layout)
        self.seq_len = checks.int_or_none(seq_len, "seq_len", 0,
                                          MAX_SEQ_LEN)
        threads = checks.int_or_none(num_threads, "num_threads", 0,
                                     checks.C_INT_MAX)
        self.timeout = checks.timeout(timeout)
        self.progress = checks.callable_or_none(progress, "progress")
        self.profile = checks.dict_or_none(profile, "profile")
        self.threads = _default_threads(comm) if threads is None else threads


def shard_buffers(named, local_check):
    """This rank's shard arrays as Buffers, checked before any communication.

    named: [(name, array)] with q, k, v first.  local_check(*buffers) runs
    the local entry point's own checks (the C core's ``check_only=True``
    call) on them, so a ring call refuses exactly what a local call would;
    then k and v must be as long as q (one shard of each).
    """
    bufs = [to_buffer(x, name) for name, x in named]
    local_check(*bufs)
    qb, kb, vb = bufs[:3]
    if kb.shape[1] != qb.shape[1] or vb.shape[1] != qb.shape[1]:
        raise ValueError(
            f"k: expected this rank's shard length {qb.shape[1]} (from q), "
            f"got {kb.shape[1]} (k) and {vb.shape[1]} (v)")
    return bufs


def as_result(buf, like, kind):
    """`buf` cast to `like`'s dtype, as an array of `kind`."""
    if buf.dtype != like.dtype:
        buf = buf.astype(like.dtype)
    return from_buffer(buf, kind)


def _default_threads(comm):
    """Kernel threads per rank: ranks on one machine share its cores.

    threads backend: the cores are split over the ranks of this process;
    host backend: over LOCAL_WORLD_SIZE ranks (set by ``ra.launch`` and
    ``ringattn launch``).  0 (the kernels' default) otherwise, or when
    RINGATTN_NUM_THREADS is set.
    """
    if os.environ.get("RINGATTN_NUM_THREADS"):
        return 0
    if getattr(comm, "backend", "") == "threads" and comm.size > 1:
        return max(1, _C.cpu_num_threads() // comm.size)
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 1:
        return max(1, _C.cpu_num_threads() // int(local))
    return 0


def empty_state(B, n, H, D, acc, dev):
    """A running state (out, lse) = (0, -inf): no key seen yet."""
    out = _C.empty((B, n, H, D), acc, *dev)
    lse = _C.empty((B, H, n), acc, *dev)
    _C.init_state(out, lse)
    return out, lse



_DEVICE_CODES = {"cpu": 1, "cuda": 2}


def _device(buf):
    kind, idx = buf.device
    return (_DEVICE_CODES[kind], idx)


# ---- masks -----------------------------------------------------------------

def _int32_ids(ids, host):
    """int32 segment ids on the device of `ids` as a Buffer (host: their
    values on the host as int32; the C core has checked they fit)."""
    buf = to_buffer(ids, "segment_ids")
    if buf.dtype == "int32":
        return buf
    if buf.device[0] == "cpu":
        return to_buffer(np.ascontiguousarray(host), "segment_ids")
    return to_device(np.ascontiguousarray(host), buf.device)


def _id_range(ids, rows):
    """(min, max) of a chunk's ids (B, rows); EMPTY_RANGE without rows, and
    any range for a batch of 0 (nothing is computed then)."""
    if not rows:
        return EMPTY_RANGE
    if not ids.size:
        return (0, 0)
    return int(ids.min()), int(ids.max())


class RingMasks:
    """This rank's mask arguments, after the C core checked them.

    window: None or (left, right), ints or None per side; softcap: None or
    a float; ids: None or this rank's segment ids (B, n_r) as an int32
    Buffer on q's device, and chunk_ranges their (min, max) per chunk of
    the shard (``agreement.id_chunks``) for the agreement.
    """

    def __init__(self, segment_ids, window, softcap, layout):
        self.window = checks.window_sides(window)
        self.softcap = None if softcap is None else float(softcap)
        self.ids = self.chunk_ranges = None
        if segment_ids is not None:
            host = np.asarray(to_numpy(segment_ids)).astype(np.int32)
            self.ids = _int32_ids(segment_ids, host)
            self.chunk_ranges = [_id_range(host[:, off:off + rows], rows)
                                 for off, rows in
                                 id_chunks(host.shape[1], layout)]

    def kernel_kw(self):
        """The kernels' window / softcap keywords (none when unused)."""
        kw = {}
        if self.window is not None:
            kw["window"] = self.window
        if self.softcap is not None:
            kw["softcap"] = self.softcap
        return kw

    def describe(self):
        return dict(window=self.window, softcap=self.softcap,
                    id_ranges=self.chunk_ranges)


def hop_plan(plan, causal, window):
    """The HopPlan of an agreed call (cached when no segment ids enter)."""
    if plan.id_ranges is not None:
        return HopPlan(plan, causal, window, plan.id_ranges)
    return layout_hops(plan.n, plan.world_size, plan.rank, plan.layout,
                       causal, window)


class _Step:
    """The call's plan, masks and the kernels' shared keywords."""

    def __init__(self, hops, masks, causal, scale, threads):
        self.hops, self.masks = hops, masks
        self.kw = dict(causal=causal, scale=scale, num_threads=threads,
                       **masks.kernel_kw())

    def calls(self, s, block_ids, row0):
        """[(q rows, k rows, keywords)] of this rank against block s."""
        for (q_off, q_len), (k_off, k_len), positions in \
                self.hops.calls(s, row0):
            kw = dict(self.kw, **positions)
            if self.masks.ids is not None:
                kw["segment_ids"] = self.masks.ids.narrow(1, q_off, q_len)
                kw["kv_segment_ids"] = block_ids.narrow(1, k_off, k_len)
            yield (q_off, q_len), (k_off, k_len), kw


class _Profile:
    def __init__(self):
        self.compute_s = self.wait_s = 0.0
        self.sent = 0

    def start(self, comm, send, dst, recv, src, step, timeout):
        """exchange() of a block: send and recv are (data, ids) pairs (ids
        may be None) or None; the bytes sent are counted."""
        reqs = []
        for i in range(2):
            s = None if send is None else send[i]
            r = None if recv is None else recv[i]
            if s is not None:
                self.sent += s.nbytes
            req = exchange(comm, s, dst, r, src, step, timeout)
            if req is not None:
                reqs.append(req)
        return reqs

    @contextlib.contextmanager
    def computing(self):
        """Count the time inside as kernel time."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.compute_s += time.perf_counter() - t0

    def wait(self, reqs):
        t0 = time.perf_counter()
        for req in reqs:
            req.wait()
        self.wait_s += time.perf_counter() - t0

    def report(self, profile, hops):
        if profile is not None:
            steps = hops.steps()
            profile.update(compute_s=self.compute_s, wait_s=self.wait_s,
                           steps=steps,
                           steps_skipped=hops.world_size - steps,
                           bytes_sent=self.sent)


def _prepare(comm, op, named, local_check, causal, scale, call, masks_args):
    """Checked buffers, masks, the agreed plan and its hops: everything a
    ring call settles before its first transfer."""
    bufs = shard_buffers(named, local_check)
    masks = RingMasks(*masks_args, call.layout)
    plan = agree(comm, describe(op, bufs[0], bufs[1], causal, scale,
                                call.layout, call.seq_len,
                                **masks.describe()), call.timeout)
    return bufs, masks, plan, hop_plan(plan, causal, masks.window)


def ring_attention(q, k, v, comm, *, causal=False, scale=None,
                   layout="contiguous", seq_len=None, return_lse=False,
                   segment_ids=None, window=None, softcap=None,
                   progress=None, num_threads=None, timeout=None,
                   profile=None, ulysses=1):
    """Exact attention over the sequence sharded across `comm`'s ranks.

    q: (B, n_r, H, D), k, v: (B, n_r, H_kv, D): this rank's shard in
    `layout` ('contiguous' | 'zigzag' | 'striped'), n_r =
    len(shard_indices(seq_len, p, layout)[rank]).  seq_len=None: ranks
    exchange shard lengths.  Masks (DESIGN §2) with the tokens' global
    positions: segment_ids (B, n_r) integer ids of this rank's tokens (the
    ids of the keys travel with their k/v), window=(left, right), softcap;
    causal masking too.  Every rank passes the same causal, scale, layout,
    window and softcap, and all or none pass segment_ids.
    Returns out (B, n_r, H, D) in q's dtype, and lse (B, H, n_r) float32
    (float64 for float64) with return_lse=True.  progress(step, steps) is
    called after each ring step.  profile: a dict to fill with
    {"compute_s", "wait_s", "steps", "steps_skipped", "bytes_sent"} (time
    in kernels, time blocked waiting for transfers, ring steps taken and
    not needed, bytes this rank sent).  timeout: seconds each wait of this
    call may take (the agreement and every transfer; default the
    communicator's), else ``CommError``.  Arguments are checked as
    ``attention`` checks them, before any communication.

    ulysses=u (u divides p and H): Ulysses inside groups of u consecutive
    ranks, this ring across the p / u groups (``ringattn.ulysses``); the
    shards are ``shard_indices(seq_len, p, layout, ulysses=u)``.  u = 1 is
    the plain ring, u = p pure Ulysses.
    """
    if checks.ulysses_degree(ulysses) != 1:
        from .ulysses import ulysses_attention

        return ulysses_attention(
            q, k, v, comm, checks.ulysses_degree(ulysses), causal=causal,
            scale=scale, layout=layout, seq_len=seq_len,
            return_lse=return_lse, segment_ids=segment_ids, window=window,
            softcap=softcap, progress=progress, num_threads=num_threads,
            timeout=timeout, profile=profile)
    causal, return_lse = (checks.flag(causal, "causal"),
                          checks.flag(return_lse, "return_lse"))
    call = RingCall(comm, layout, seq_len, num_threads, timeout, progress,
                    profile)
    kind = kind_of(q)
    mask_kw = mask_kwargs(segment_ids, None, window, softcap)
    (qb, kb, vb), masks, plan, hops = _prepare(
        comm, "fwd", [("q", q), ("k", k), ("v", v)],
        lambda q, k, v: _C.attn_fwd(q, k, v, causal=causal, scale=scale,
                                    check_only=True, **mask_kw),
        causal, scale, call, (segment_ids, window, softcap))
    step = _Step(hops, masks, causal, scale, call.threads)
    out, lse = _ring_forward(qb, kb, vb, comm, step, call)
    out_final = as_result(out, qb, kind)
    if return_lse:
        return out_final, from_buffer(lse, kind)
    return out_final


def _trip_ends(hops, trip):
    """(rank this trip sends to, rank it receives from)."""
    p, r = hops.world_size, hops.rank
    if trip == "right":
        return (r + 1) % p, (r - 1) % p
    return (r - 1) % p, (r + 1) % p


def _step_index(hops, trip, d):
    """The comm step of hop d + 1 of `trip` (one count over both trips)."""
    return d if trip == "right" else hops.right + d


def _kv_hop(comm, prof, kv, hops, trip, d, cur, timeout):
    """Start hop d + 1 of `trip` for the k/v blocks: send the rows of ours
    that go on (packed into slot 0 from our own inputs, slot 2 when cut
    from a block that arrived), receive the next into slot (d + 1) % 2.
    Returns (requests, the next Block or None)."""
    dst, src = _trip_ends(hops, trip)
    lo, hi = hops.rows(trip, hops.block_at(trip, d), d + 1)
    send = kv.outgoing(0 if d == 0 else 2, cur, lo, hi) if hi > lo else None
    nlo, nhi = hops.rows(trip, hops.block_at(trip, d + 1), d + 1)
    nxt = kv.block((d + 1) % 2, nhi - nlo, (nlo, nhi)) if nhi > nlo else None
    reqs = prof.start(comm, send, dst, None if nxt is None else nxt.packed,
                      src, _step_index(hops, trip, d), timeout)
    return reqs, nxt


def _kv_slots(hops, B, Hkv, D, dtype, dev, masks=None):
    """The k/v (or dk/dv) slots of a call.  The plain ring (``hops.lap``)
    holds two whole blocks from the start whatever p is, so per-rank
    memory is one function of the shard length for every world size;
    other plans size their slots by the rows they move (O(window))."""
    with_ids = masks is not None and masks.ids is not None
    if hops.lap:
        slots = Packed(2, B, Hkv, D, max(hops.lengths), dtype, dev, with_ids)
        slots.reserve(2)
        return slots
    return Packed(2, B, Hkv, D, hops.max_rows(), dtype, dev, with_ids)


def _walk(hops, call):
    """Every step of a call: (trip, its hops, d, s, compute) for the block
    of rank s held after d hops of `trip` (d = 0: our own), compute when
    this rank sees any of it; progress(step, steps) after each step.  The
    right trip always comes (its step 0 is the local block), the left one
    when it has hops."""
    done, total = 0, hops.steps()
    for trip in HopPlan.TRIPS:
        n_hops = hops.hops(trip)
        if trip == "left" and n_hops == 0:
            continue
        for d in range(n_hops + 1):
            s = hops.block_at(trip, d)
            local = d == 0 and trip == "right"
            yield trip, n_hops, d, s, local or (d > 0 and hops.needs(s))
            if local or d > 0:
                done += 1
                if call.progress is not None:
                    call.progress(done, total)


def _ring_forward(qb, kb, vb, comm, step, call):
    hops, masks = step.hops, step.masks
    B, n_r, H, D = qb.shape
    dev = _device(qb)
    acc = "float64" if qb.dtype == "float64" else "float32"
    out, lse = empty_state(B, n_r, H, D, acc, dev)
    kv = _kv_slots(hops, B, kb.shape[2], D, qb.dtype, dev, masks)
    prof = _Profile()
    for trip, n_hops, d, s, compute in _walk(hops, call):
        if d == 0:
            cur = Block(kb, vb, masks.ids, (0, n_r))
        reqs, nxt = _kv_hop(comm, prof, kv, hops, trip, d, cur,
                            call.timeout) if d < n_hops else ([], None)
        if compute:
            with prof.computing():
                for (q_off, q_len), (k_off, k_len), kw in step.calls(
                        s, cur.ids, cur.rows[0]):
                    _C.attn_fwd(qb.narrow(1, q_off, q_len),
                                cur.k.narrow(1, k_off, k_len),
                                cur.v.narrow(1, k_off, k_len),
                                out=out.narrow(1, q_off, q_len),
                                lse=lse.narrow(2, q_off, q_len),
                                accumulate=True, **kw)
        prof.wait(reqs)
        cur = nxt
    prof.report(call.profile, hops)
    return out, lse


def ring_attention_backward(dout, q, k, v, out, lse, comm, *, causal=False,
                            scale=None, layout="contiguous", seq_len=None,
                            segment_ids=None, window=None, softcap=None,
                            dlse=None, progress=None, num_threads=None,
                            timeout=None, profile=None, ulysses=1):
    """Gradients of ``ring_attention`` for this rank's shard.

    dout, q, out: (B, n_r, H, D); k, v: (B, n_r, H_kv, D); lse: (B, H, n_r)
    as returned by ``ring_attention(..., return_lse=True)``.  dlse: None,
    or the cotangent of this rank's lse (B, H, n_r) in lse's dtype, whose
    gradient is added (``ringattn.lse_cotangent``; ranks may differ in
    passing it).  Returns (dq, dk, dv) in the inputs' dtypes; dk/dv are
    this rank's keys' gradients summed over every rank's queries.
    Arguments, masks, profile, timeout and ulysses as ``ring_attention``.
    """
    if checks.ulysses_degree(ulysses) != 1:
        from .ulysses import ulysses_attention_backward

        return ulysses_attention_backward(
            dout, q, k, v, out, lse, comm, checks.ulysses_degree(ulysses),
            causal=causal, scale=scale, layout=layout, seq_len=seq_len,
            segment_ids=segment_ids, window=window, softcap=softcap,
            dlse=dlse, progress=progress, num_threads=num_threads,
            timeout=timeout, profile=profile)
    causal = checks.flag(causal, "causal")
    call = RingCall(comm, layout, seq_len, num_threads, timeout, progress,
                    profile)
    kind = kind_of(q)
    local_check = BackwardCheck(causal, scale, segment_ids, window, softcap,
                                dlse)
    bufs, masks, plan, hops = _prepare(
        comm, "bwd", [("q", q), ("k", k), ("v", v), ("dout", dout),
                      ("out", out), ("lse", lse)], local_check,
        causal, scale, call, (segment_ids, window, softcap))
    qb, kb, vb, doutb, outb, lseb = bufs
    step = _Step(hops, masks, causal, scale, call.threads)
    delta = local_check.delta(doutb, outb, call.threads, kind)
    dq, dk, dv = _ring_backward(doutb, qb, kb, vb, delta, lseb, comm, step,
                                call)
    return tuple(as_result(g, like, kind)
                 for g, like in ((dq, qb), (dk, kb), (dv, vb)))


class BackwardCheck:
    """The local checks of a backward call on this rank's Buffers (q, k, v,
    dout, out, lse): the C core's own (``check_only``) and dlse's; then
    delta = rowsum(dout * out) - dlse."""

    def __init__(self, causal, scale, segment_ids, window, softcap, dlse):
        self.kw = dict(causal=causal, scale=scale,
                       **mask_kwargs(segment_ids, None, window, softcap))
        self.dlse, self.dlse_buf = dlse, None

    def __call__(self, q, k, v, dout, out, lse):
        _C.attn_bwd(dout, q, k, v, out, lse, check_only=True, **self.kw)
        self.dlse_buf = check_dlse(self.dlse, q)

    def delta(self, doutb, outb, threads, kind):
        """delta (B, H, n_r) in lse's dtype, dlse folded in."""
        return fold_into_delta(
            _C.attn_bwd_preprocess(doutb, outb, num_threads=threads),
            self.dlse_buf, kind)


def grads_with_delta(dout, q, k, v, lse, delta, comm, *, causal, scale,
                     layout, seq_len, segment_ids, window, softcap, progress,
                     num_threads, timeout, profile):
    """The ring backward from a given delta = rowsum(dout * out) - dlse
    (B, H, n_r) in lse's dtype: (dq, dk, dv) as Buffers in the accumulator
    dtype (float32, float64 for float64 inputs), not cast.  For the ring
    part of ``ringattn.ulysses``; arguments as ``ring_attention_backward``
    (Buffers), checked and agreed the same way."""
    causal = checks.flag(causal, "causal")
    call = RingCall(comm, layout, seq_len, num_threads, timeout, progress,
                    profile)
    mask_kw = mask_kwargs(segment_ids, None, window, softcap)
    bufs, masks, plan, hops = _prepare(
        comm, "bwd", [("q", q), ("k", k), ("v", v), ("dout", dout),
                      ("lse", lse)],
        lambda q, k, v, dout, lse: _C.attn_bwd(
            dout, q, k, v, dout, lse, causal=causal, scale=scale,
            check_only=True, **mask_kw),
        causal, scale, call, (segment_ids, window, softcap))
    qb, kb, vb, doutb, lseb = bufs
    step = _Step(hops, masks, causal, scale, call.threads)
    return _ring_backward(doutb, qb, kb, vb, delta, lseb, comm, step, call)


class _Home:
    """This rank's dk/dv (2, B, n_r, H_kv, D), and the rows of them that
    arrive from the rank holding our block once no later hop needs them.

    With ``hops.lap`` (whole blocks, the full lap to the right) our dk/dv
    leave from dk/dv slot 0 and come back whole after the last hop, into
    the slot no block needs then, as in the plain ring; otherwise they live
    in a buffer of their own and arrive in pieces.
    """

    def __init__(self, dkv, hops, n_r, dev, acc):
        self.dkv, self.lap, self.n_r = dkv, hops.lap, n_r
        if self.lap:
            self.grads = dkv.view(0, n_r)[0]
            self.grads.zero_()
        else:
            self.grads = _C.zeros((2, dkv.B, n_r, dkv.Hkv, dkv.D), acc,
                                  *dev)
        self.arriving = None

    def exchange(self, comm, prof, hops, trip, d, held, timeout):
        """After hop d: send the final rows of the block whose dk/dv we
        hold (`held`) to its owner; receive ours."""
        s = hops.block_at(trip, d)
        out_runs = hops.home_rows(trip, s, d)
        send = None
        if out_runs:
            send = self.dkv.gather(3, held, out_runs,
                                   hops.grad_rows(trip, s, d)[0])
        in_runs = hops.home_rows(trip, hops.rank, d)
        recv = None
        if self.lap and in_runs:        # the slot no block needs now
            recv = self.dkv.view((d + 1) % 2, self.n_r)[0]
            self.grads = recv
        elif in_runs == [(0, self.n_r)]:
            recv = self.grads
        elif in_runs:
            recv = self.dkv.view(4, sum(b - a for a, b in in_runs))[0]
            self.arriving = (recv, in_runs)
        return prof.start(comm, (send, None), s, (recv, None),
                          hops.holder(trip, hops.rank, d),
                          _step_index(hops, trip, d - 1), timeout)

    def settle(self):
        """Write the rows that arrived into our dk/dv."""
        if self.arriving is not None:
            recv, runs = self.arriving
            Packed.scatter(self.grads, recv, runs)
            self.arriving = None


def _ring_backward(doutb, qb, kb, vb, delta, lseb, comm, step, call):
    """dk/dv travel with their k/v rows; rows no later hop needs go
    straight home (``_Home``).  dk/dv slots: 0, 1 the travelling ones (a
    block's dk/dv that arrive on hop d land in slot d % 2; our own rows
    leave from slot 0), 2 a cut that goes on, 3 and 4 rows going home and
    arriving home."""
    hops, masks = step.hops, step.masks
    B, n_r, H, D = qb.shape
    Hkv = kb.shape[2]
    dev = _device(qb)
    acc = "float64" if qb.dtype == "float64" else "float32"
    dq = _C.zeros((B, n_r, H, D), acc, *dev)
    kv = _kv_slots(hops, B, Hkv, D, qb.dtype, dev, masks)
    dkv = _kv_slots(hops, B, Hkv, D, acc, dev)
    home = _Home(dkv, hops, n_r, dev, acc)
    prof, pending, arrived = _Profile(), [], None
    for trip, n_hops, d, s, compute in _walk(hops, call):
        if d == 0:
            cur, grads = Block(kb, vb, masks.ids, (0, n_r)), home.grads
        else:           # this block's dk/dv, and rows of ours, arrive
            prof.wait(pending)
            home.settle()
            grads = arrived
        reqs, nxt = _kv_hop(comm, prof, kv, hops, trip, d, cur,
                            call.timeout) if d < n_hops else ([], None)
        if compute:
            with prof.computing():
                _bwd_block(step, doutb, qb, lseb, delta, dq, cur, grads, s)
        prof.wait(reqs)
        pending, arrived = [], None
        if d < n_hops:
            pending, arrived = _grad_hop(comm, prof, dkv, hops, trip, d,
                                         grads, call.timeout)
        if d > 0:
            pending += home.exchange(comm, prof, hops, trip, d, grads,
                                     call.timeout)
        if d == n_hops:
            prof.wait(pending)
            home.settle()
        cur = nxt
    prof.report(call.profile, hops)
    return dq, Packed.part(home.grads, 0), Packed.part(home.grads, 1)


def _grad_hop(comm, prof, dkv, hops, trip, d, grads, timeout):
    """Start hop d + 1 of `trip` for the dk/dv: ours of the rows that go
    on (packed into slot 0 from our own, slot 2 when cut), and the next
    block's into slot (d + 1) % 2.  Returns (requests, where they land)."""
    dst, src = _trip_ends(hops, trip)
    s = hops.block_at(trip, d)
    lo, hi = hops.grad_rows(trip, s, d + 1)
    send = None
    if hi > lo:
        base = 0 if d == 0 else hops.grad_rows(trip, s, d)[0]
        send = dkv.gather(0 if d == 0 else 2, grads, [(lo, hi)], base)
    nlo, nhi = hops.grad_rows(trip, hops.block_at(trip, d + 1), d + 1)
    arrived = dkv.view((d + 1) % 2, nhi - nlo)[0] if nhi > nlo else None
    reqs = prof.start(comm, (send, None), dst, (arrived, None), src,
                      _step_index(hops, trip, d), timeout)
    return reqs, arrived


def _bwd_block(step, doutb, qb, lseb, delta, dq, block, grads, s):
    """Add this rank's gradients against block s (k/v `block`, dk/dv
    `grads` (2, B, L, H_kv, D) of the same rows) into dq and grads."""
    dk_blk, dv_blk = Packed.part(grads, 0), Packed.part(grads, 1)
    for (q_off, q_len), (k_off, k_len), kw in step.calls(s, block.ids,
                                                         block.rows[0]):
        _C.attn_bwd(doutb.narrow(1, q_off, q_len),
                    qb.narrow(1, q_off, q_len),
                    block.k.narrow(1, k_off, k_len),
                    block.v.narrow(1, k_off, k_len),
                    None, lseb.narrow(2, q_off, q_len),
                    dq=dq.narrow(1, q_off, q_len),
                    dk=dk_blk.narrow(1, k_off, k_len),
                    dv=dv_blk.narrow(1, k_off, k_len),
                    delta=delta.narrow(2, q_off, q_len), accumulate=True,
                    **kw)
