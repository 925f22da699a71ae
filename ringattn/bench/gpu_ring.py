"""``ringattn bench --ring --gpu``: the ring on the GPUs of this machine,
over NCCL and on thread ranks, against one device doing the same work.

Two kinds of ranks, bfloat16, B = 1, H = 16, D = 128, zigzag layout,
causal and not, forward and backward, n = ``--seq-len`` (default 16384,
4096 with ``--quick``):

  nccl     p = 1..4 processes (``ra.launch(backend="nccl")``); when the
           machine has fewer than p GPUs, several ranks share one, which
           NCCL allows from 2.30 on with NCCL_MULTI_RANK_GPU_ENABLE=1
  threads  p = 2, 4, 8 threads of this process
           (``ra.launch(backend="threads", devices=...)``, rank r on GPU
           r % GPUs): device copies between ranks of one GPU, peer copies
           between GPUs, no NCCL

Columns:

  single   one device, ``ra.attention`` / ``attention_backward`` on the
           whole sequence (median wall time, synchronised)
  ring     the slowest rank's median wall time of ``ring_attention`` /
           ``ring_attention_backward`` (barrier first, synchronised after)
  xfer     the same ring steps' transfers alone (k/v blocks; in the
           backward k/v and the float32 dk/dv blocks), no compute
  exposed  max(0, ring - single * share), share = 1 / p of the work per
           rank when each rank has its own GPU, 1 when the ranks share one
           (time-sliced, they do the whole work on it between them)
  hidden   1 - min(1, exposed / xfer): the share of transfer time that the
           ring hid behind compute (n/a for p = 1, which sends nothing)

The arrays are ringattn's own (``ra.to_device``): no framework is needed.
``run(args) -> int``: prints the table and a summary line; 0 when every
row that could run ran (NCCL rows are skipped, with the reason, where NCCL
cannot be loaded), 1 when a ring failed, 2 when there is no GPU.
"""
import os

from .timing import median_time

B, H, D = 1, 16, 128
DTYPE = "bfloat16"
TILE = 4096          # random rows generated on the host, repeated on the GPU


def _random(shape, seed, device):
    """A bfloat16 device array of `shape` (B, n, h, d): TILE random rows
    uploaded once and repeated along the sequence on the device (timing
    does not depend on the values; the host never holds the whole array)."""
    import numpy as np

    import ringattn as ra
    from ringattn.testing import np_dtype

    n = shape[1]
    rows = min(n, TILE)
    tile = np.random.default_rng(seed).standard_normal(
        (shape[0], rows) + tuple(shape[2:]), dtype=np.float32)
    tile = ra.to_device(tile.astype(np_dtype(DTYPE)), device)
    out = ra.empty(tuple(shape), DTYPE, device)
    for start in range(0, n, rows):
        m = min(rows, n - start)
        out.narrow(1, start, m).copy_(tile.narrow(1, 0, m))
    return out


def _sync(device):
    from ringattn import _C

    _C.cuda_synchronize(device[1])


def _rank(comm, n, repeat):
    """{causal: this rank's median ring and transfer-only times, forward and
    backward (seconds)} for causal False and True: one launch serves both."""
    return {causal: _rank_times(comm, n, causal, repeat) for causal in (False, True)}


def _rank_times(comm, n, causal, repeat):
    import ringattn as ra
    from ringattn.layout import shard_positions

    p, r, dev = comm.size, comm.rank, comm.device
    n_r = len(shard_positions(n, p, "zigzag", r))
    q, k, v, dout = (_random((B, n_r, H, D), 4 * r + i, dev) for i in range(4))

    def sync():
        _sync(dev)
        comm.barrier()

    state = {}

    def fwd():
        state["out"], state["lse"] = ra.ring_attention(
            q, k, v, comm, causal=causal, layout="zigzag", seq_len=n, return_lse=True)

    def bwd():
        ra.ring_attention_backward(dout, q, k, v, state["out"], state["lse"], comm,
                                   causal=causal, layout="zigzag", seq_len=n)

    res = {"fwd": median_time(fwd, repeat, sync=sync), "bwd": median_time(bwd, repeat, sync=sync)}
    # the same transfers alone: k/v blocks (input dtype) for p - 1 steps;
    # the backward adds its float32 dk/dv blocks on every step
    lens = [len(shard_positions(n, p, "zigzag", i)) for i in range(p)]
    kv = ra.empty((2 * B * max(lens) * H * D,), DTYPE, dev)
    kv_in = ra.empty((2 * B * max(lens) * H * D,), DTYPE, dev)
    dkv = ra.empty((2 * B * max(lens) * H * D,), "float32", dev)
    dkv_in = ra.empty((2 * B * max(lens) * H * D,), "float32", dev)
    mine = 2 * B * n_r * H * D

    def steps(with_dkv):
        def go():
            for step in range(p):
                m = 2 * B * lens[(r - step - 1) % p] * H * D
                if step < p - 1:
                    comm.sendrecv(kv.narrow(0, 0, mine), (r + 1) % p, kv_in.narrow(0, 0, m),
                                  (r - 1) % p, step=step)
                if with_dkv:
                    comm.sendrecv(dkv.narrow(0, 0, mine), (r + 1) % p, dkv_in.narrow(0, 0, m),
                                  (r - 1) % p, step=step)
        return go

    res["xfer_fwd"] = median_time(steps(False), repeat, sync=sync) if p > 1 else 0.0
    res["xfer_bwd"] = median_time(steps(True), repeat, sync=sync) if p > 1 else 0.0
    return res


def _single(n, causal, repeat):
    """Median seconds of one device doing the whole forward / backward."""
    import ringattn as ra

    dev = ("cuda", 0)
    q, k, v, dout = (_random((B, n, H, D), 100 + i, dev) for i in range(4))
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)

    def sync():
        _sync(dev)

    return {"fwd": median_time(lambda: ra.attention(q, k, v, causal=causal, return_lse=True),
                               repeat, sync=sync),
            "bwd": median_time(lambda: ra.attention_backward(dout, q, k, v, out, lse,
                                                             causal=causal),
                               repeat, sync=sync)}


def _can_run(p, n_gpus, nccl):
    """(ok, why not, needs the multi-rank switch) for p NCCL ranks."""
    if nccl is None:
        return False, "NCCL cannot be loaded (pip install nvidia-nccl-cu13, or " \
                      "RINGATTN_NCCL_LIBRARY)", False
    if p <= n_gpus:
        return True, "", False
    if nccl >= (2, 30, 0):
        return True, "", True
    return False, f"{p} ranks need {p} GPUs or NCCL >= 2.30 (have {n_gpus}, NCCL " \
                  f"{'.'.join(map(str, nccl))})", False


def _launch(kind, p, n, repeat, n_gpus, share_gpu):
    import ringattn as ra

    if kind == "threads":
        return ra.launch(_rank, p, args=(n, repeat), backend="threads", timeout=600,
                         devices=[r % n_gpus for r in range(p)])
    old = os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE")
    if share_gpu:
        os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    try:
        return ra.launch(_rank, p, args=(n, repeat), backend="nccl", timeout=600)
    finally:
        if share_gpu and old is None:
            os.environ.pop("NCCL_MULTI_RANK_GPU_ENABLE", None)


def seq_len_of(args, quick, default=16384, quick_default=4096):
    """n from --seq-len, else the first --seq-lens entry, else the default."""
    n = getattr(args, "seq_len", None)
    if n:
        return int(n)
    seq_arg = getattr(args, "seq_lens", "") or ""
    if seq_arg.strip():
        return int(seq_arg.split(",")[0])
    return quick_default if quick else default


def run(args=None) -> int:
    import ringattn as ra

    if not ra.cuda_available():
        why = f"no usable GPU: {ra.cuda_info()['reason']}"
        print(f"bench --ring --gpu: {why}")
        print("bench-gpu-ring: FAIL no usable GPU")
        return 2
    nccl = ra.nccl_version()
    quick = bool(getattr(args, "quick", False))
    n = seq_len_of(args, quick)
    repeat = 3 if quick else 5
    info = ra.cuda_info()
    n_gpus = info["devices"]
    nccl_name = ".".join(map(str, nccl)) if nccl else "none"
    print(f"ring on {n_gpus} x {info.get('device_name', 'GPU')}: NCCL ranks (NCCL {nccl_name}) "
          f"and thread ranks; n={n}, B={B}, H={H}, D={D}, {DTYPE}, zigzag; median of "
          f"{repeat}, wall time synchronised")
    print("exposed = max(0, ring - single * share) (share = 1/p with a GPU per rank, 1 when "
          "the ranks share one); hidden = 1 - min(1, exposed / xfer)")
    print("| ranks | p | GPUs | causal | pass | single s | ring s | ring / single | xfer s "
          "| exposed s | hidden |")
    print("|:---:|---:|---:|:---:|:---:|---:|---:|---:|---:|---:|---:|", flush=True)
    status, done = 0, {"nccl": 0, "threads": 0}
    single = {causal: _single(n, causal, repeat) for causal in (False, True)}
    plan = [("nccl", p) for p in (1, 2, 3, 4)] + [("threads", p) for p in (2, 4, 8)]
    for kind, p in plan:
        share_gpu = False
        if kind == "nccl":
            ok, why, share_gpu = _can_run(p, n_gpus, nccl)
            if not ok:
                print(f"| nccl | {p} | - | - | - | skipped: {why} |")
                continue
        try:
            res = _launch(kind, p, n, repeat, n_gpus, share_gpu)
        except Exception as e:      # noqa: BLE001 - reported, the bench goes on
            print(f"| {kind} | {p} | - | - | - | FAILED: {type(e).__name__}: "
                  f"{str(e).splitlines()[0]} |")
            status = 1
            continue
        gpus = min(p, n_gpus)
        share = 1.0 if gpus < p else 1.0 / p
        for causal in (False, True):
            for pas in ("fwd", "bwd"):
                one = single[causal][pas]
                ring = max(x[causal][pas] for x in res)
                xfer = max(x[causal]["xfer_" + pas] for x in res)
                exposed = max(0.0, ring - one * share)
                hidden = f"{1.0 - min(1.0, exposed / xfer):.0%}" if p > 1 and xfer > 0 else "n/a"
                print(f"| {kind} | {p} | {gpus} | {'yes' if causal else 'no'} | {pas} | "
                      f"{one:.4f} | {ring:.4f} | {ring / one:.2f} | "
                      f"{xfer:.4f} | {exposed:.4f} | {hidden} |", flush=True)
        done[kind] += 1
    print(f"bench-gpu-ring: {'PASS' if status == 0 else 'FAIL'} ({done['nccl']} NCCL ring "
          f"runs, {done['threads']} thread ring runs, n={n}, NCCL {nccl_name}, "
          f"{n_gpus} GPU(s))")
    return status


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seq-len", dest="seq_len", type=int, default=None)
    sys.exit(run(ap.parse_args()))
