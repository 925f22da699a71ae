"""The ring: attention over a sequence sharded across ranks.

Each rank holds a shard of q, k, v along the sequence (``layout``: DESIGN §4).
Forward: the rank keeps its q and a float32 running state (out, lse); k/v
blocks travel around the ring (send to r+1, receive from r-1), double
buffered, the transfer of the next block started before the kernel on the
current one so the two overlap.  Each block merges into the running state by
the LSE rule inside the kernel (``accumulate``), so nothing is rounded to the
input dtype between steps.  Blocks entirely in the causal future are skipped.

Backward: each rank keeps q, out, lse, dout and accumulates dq; dk/dv
accumulators (float32) travel with their k/v blocks and, after p hops, arrive
back at their owner.  Only kv heads travel (GQA cuts traffic by H/H_kv).
Memory per rank is O(n/p).

Shapes (local shard of n_r tokens): q, out, dout (B, n_r, H, D); k, v
(B, n_r, H_kv, D); lse (B, H, n_r) float32 (float64 for float64 inputs).
"""

import os
import time

from . import _C, checks
from .agreement import MAX_SEQ_LEN, agree, describe
from .interop import kind_of, from_buffer, to_buffer
from .layout import check_layout

__all__ = ["ring_attention", "ring_attention_backward"]


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


def _pairs(plan, q_rank, k_rank, causal):
    """Pieces of two shards that have any visible key, as
    ((q_off, q_len), (k_off, k_len), positions): local row ranges and the
    kernels' position keywords."""
    out = []
    for q_off, q_start, q_stride, q_len in plan.local_pieces(q_rank):
        q_last = q_start + q_stride * (q_len - 1)
        for k_off, k_start, k_stride, k_len in plan.local_pieces(k_rank):
            if causal and k_start > q_last:
                continue  # entirely in the causal future
            positions = dict(q_pos_offset=q_start, q_pos_stride=q_stride,
                             k_pos_offset=k_start, k_pos_stride=k_stride)
            out.append(((q_off, q_len), (k_off, k_len), positions))
    return out


class _KVBlocks:
    """Two flat buffers that hold packed blocks (m, B, L, H_kv, D) in turn.

    A block from a rank with L tokens occupies the first m*B*L*H_kv*D
    elements, so one allocation of the largest shard serves every step.
    """

    def __init__(self, m, B, Hkv, D, max_len, dtype, device, count=2):
        self.m, self.B, self.Hkv, self.D = m, B, Hkv, D
        size = max(1, m * B * max_len * Hkv * D)
        self.flat = [_C.empty((size,), dtype, *device) for _ in range(count)]

    def view(self, i, length):
        numel = self.m * self.B * length * self.Hkv * self.D
        return self.flat[i].narrow(0, 0, numel).reshape(
            (self.m, self.B, length, self.Hkv, self.D))

    def part(self, packed, j):
        """Part j (B, L, H_kv, D) of a packed block (m, B, L, H_kv, D)."""
        _, B, L, Hkv, D = packed.shape
        return packed.narrow(0, j, 1).reshape((B, L, Hkv, D))


_DEVICE_CODES = {"cpu": 1, "cuda": 2}


def _device(buf):
    kind, idx = buf.device
    return (_DEVICE_CODES[kind], idx)


def ring_attention(q, k, v, comm, *, causal=False, scale=None,
                   layout="contiguous", seq_len=None, return_lse=False,
                   progress=None, num_threads=None, timeout=None,
                   profile=None):
    """Exact attention over the sequence sharded across `comm`'s ranks.

    q: (B, n_r, H, D), k, v: (B, n_r, H_kv, D): this rank's shard in
    `layout` ('contiguous' | 'zigzag' | 'striped'), n_r =
    len(shard_indices(seq_len, p, layout)[rank]).  Causal masking uses the
    tokens' global positions.  seq_len=None: ranks exchange shard lengths.
    Returns out (B, n_r, H, D) in q's dtype, and lse (B, H, n_r) float32
    (float64 for float64) with return_lse=True.  progress(step, steps) is
    called after each ring step.  profile: a dict to fill with
    {"compute_s", "wait_s", "steps", "bytes_sent"} (time in kernels, time
    blocked waiting for transfers, ring steps, bytes this rank sent).
    timeout: seconds each wait of this call may take (the agreement and
    every transfer; default the communicator's), else ``CommError``.
    Arguments are checked as ``attention`` checks them, before any
    communication.
    """
    causal, return_lse = (checks.flag(causal, "causal"),
                          checks.flag(return_lse, "return_lse"))
    call = RingCall(comm, layout, seq_len, num_threads, timeout, progress,
                    profile)
    kind = kind_of(q)
    qb, kb, vb = shard_buffers(
        [("q", q), ("k", k), ("v", v)],
        lambda q, k, v: _C.attn_fwd(q, k, v, causal=causal, scale=scale,
                                    check_only=True))
    plan = agree(comm, describe("fwd", qb, kb, causal, scale, call.layout,
                                call.seq_len), call.timeout)
    out, lse = _ring_forward(qb, kb, vb, comm, plan, causal, scale,
                             call.progress, call.threads, call.timeout,
                             call.profile)
    out_final = as_result(out, qb, kind)
    if return_lse:
        return out_final, from_buffer(lse, kind)
    return out_final


def _ring_forward(qb, kb, vb, comm, plan, causal, scale, progress, threads,
                  timeout, profile=None):
    p, r = plan.world_size, plan.rank
    B, n_r, H, D = qb.shape
    Hkv = kb.shape[2]
    dev = _device(qb)
    acc = "float64" if qb.dtype == "float64" else "float32"
    out, lse = empty_state(B, n_r, H, D, acc, dev)
    # the same double-buffered path for every p, so per-rank memory is the
    # same function of the shard length whatever the world size
    blocks = _KVBlocks(2, B, Hkv, D, max(plan.lengths), qb.dtype, dev)
    cur = blocks.view(0, n_r)
    blocks.part(cur, 0).copy_(kb)
    blocks.part(cur, 1).copy_(vb)
    cur_i = 0
    compute_s = wait_s = 0.0
    sent = 0
    for step in range(p):
        src_rank = (r - step) % p          # whose block we hold now
        req = None
        if step < p - 1:
            nxt_len = plan.lengths[(r - step - 1) % p]
            nxt = blocks.view(1 - cur_i, nxt_len)
            req = comm.sendrecv_start(cur, (r + 1) % p, nxt, (r - 1) % p,
                                      step=step, timeout=timeout)
            sent += cur.nbytes
        t0 = time.perf_counter()
        k_blk, v_blk = blocks.part(cur, 0), blocks.part(cur, 1)
        for (q_off, q_len), (k_off, k_len), positions in _pairs(
                plan, r, src_rank, causal):
            _C.attn_fwd(qb.narrow(1, q_off, q_len),
                        k_blk.narrow(1, k_off, k_len),
                        v_blk.narrow(1, k_off, k_len),
                        causal=causal, scale=scale,
                        out=out.narrow(1, q_off, q_len),
                        lse=lse.narrow(2, q_off, q_len), accumulate=True,
                        num_threads=threads, **positions)
        t1 = time.perf_counter()
        if req is not None:
            req.wait()
            cur_i = 1 - cur_i
            cur = nxt
        t2 = time.perf_counter()
        compute_s += t1 - t0
        wait_s += t2 - t1
        if progress is not None:
            progress(step + 1, p)
    if profile is not None:
        profile.update(compute_s=compute_s, wait_s=wait_s, steps=p,
                       bytes_sent=sent)
    return out, lse


def ring_attention_backward(dout, q, k, v, out, lse, comm, *, causal=False,
                            scale=None, layout="contiguous", seq_len=None,
                            progress=None, num_threads=None, timeout=None):
    """Gradients of ``ring_attention`` for this rank's shard.

    dout, q, out: (B, n_r, H, D); k, v: (B, n_r, H_kv, D); lse: (B, H, n_r)
    as returned by ``ring_attention(..., return_lse=True)``.  Returns
    (dq, dk, dv) in the inputs' dtypes; dk/dv are this rank's keys'
    gradients summed over every rank's queries.  Arguments and timeout as
    ``ring_attention``.
    """
    causal = checks.flag(causal, "causal")
    call = RingCall(comm, layout, seq_len, num_threads, timeout, progress)
    kind = kind_of(q)
    qb, kb, vb, doutb, outb, lseb = shard_buffers(
        [("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out),
         ("lse", lse)],
        lambda q, k, v, dout, out, lse: _C.attn_bwd(
            dout, q, k, v, out, lse, causal=causal, scale=scale,
            check_only=True))
    plan = agree(comm, describe("bwd", qb, kb, causal, scale, call.layout,
                                call.seq_len), call.timeout)
    dq, dk, dv = _ring_backward(doutb, qb, kb, vb, outb, lseb, comm, plan,
                                causal, scale, call.progress, call.threads,
                                call.timeout)
    return tuple(as_result(g, like, kind)
                 for g, like in ((dq, qb), (dk, kb), (dv, vb)))


def _ring_backward(doutb, qb, kb, vb, outb, lseb, comm, plan, causal, scale,
                   progress, threads, timeout):
    p, r = plan.world_size, plan.rank
    B, n_r, H, D = qb.shape
    Hkv = kb.shape[2]
    dev = _device(qb)
    acc = "float64" if qb.dtype == "float64" else "float32"
    # checks out/dout/lse shapes and computes delta = rowsum(dout * out)
    delta = _C.attn_bwd_preprocess(doutb, outb, num_threads=threads)
    dq = _C.zeros((B, n_r, H, D), acc, *dev)
    max_len = max(plan.lengths)
    dkv = _KVBlocks(2, B, Hkv, D, max_len, acc, dev)
    kv = _KVBlocks(2, B, Hkv, D, max_len, qb.dtype, dev)
    kv_cur, kv_i = kv.view(0, n_r), 0
    kv.part(kv_cur, 0).copy_(kb)
    kv.part(kv_cur, 1).copy_(vb)
    dkv_cur, dkv_i = dkv.view(0, n_r), 0
    dkv_cur.zero_()
    dkv_req = None
    for step in range(p):
        src_rank = (r - step) % p
        if dkv_req is not None:       # this block's dk/dv from the previous rank
            dkv_req.wait()
            dkv_i = 1 - dkv_i
            dkv_cur = dkv_nxt
        kv_req = None
        if step < p - 1:
            kv_nxt = kv.view(1 - kv_i, plan.lengths[(r - step - 1) % p])
            kv_req = comm.sendrecv_start(kv_cur, (r + 1) % p, kv_nxt,
                                         (r - 1) % p, step=step, timeout=timeout)
        k_blk, v_blk = kv.part(kv_cur, 0), kv.part(kv_cur, 1)
        dk_blk, dv_blk = dkv.part(dkv_cur, 0), dkv.part(dkv_cur, 1)
        for (q_off, q_len), (k_off, k_len), positions in _pairs(
                plan, r, src_rank, causal):
            _C.attn_bwd(doutb.narrow(1, q_off, q_len),
                        qb.narrow(1, q_off, q_len),
                        k_blk.narrow(1, k_off, k_len),
                        v_blk.narrow(1, k_off, k_len),
                        None, lseb.narrow(2, q_off, q_len),
                        causal=causal, scale=scale,
                        dq=dq.narrow(1, q_off, q_len),
                        dk=dk_blk.narrow(1, k_off, k_len),
                        dv=dv_blk.narrow(1, k_off, k_len),
                        delta=delta.narrow(2, q_off, q_len), accumulate=True,
                        num_threads=threads, **positions)
        if kv_req is not None:
            kv_req.wait()
            kv_i = 1 - kv_i
            kv_cur = kv_nxt
        # dk/dv move on with their block; after the last step they reach
        # their owner, and ours arrives from the previous rank (p = 1: a
        # copy to ourselves)
        home_len = plan.lengths[(r - step - 1) % p]
        dkv_nxt = dkv.view(1 - dkv_i, home_len)
        dkv_req = comm.sendrecv_start(dkv_cur, (r + 1) % p, dkv_nxt,
                                      (r - 1) % p, step=step, timeout=timeout)
        if progress is not None:
            progress(step + 1, p)
    if dkv_req is not None:
        dkv_req.wait()
        dkv_cur = dkv_nxt
    return dq, dkv.part(dkv_cur, 0), dkv.part(dkv_cur, 1)
