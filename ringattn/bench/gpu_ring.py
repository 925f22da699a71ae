"""``ringattn bench --ring --gpu``: the ring over NCCL on the GPUs of this
machine, against one device doing the same work.

For p = 1..4 ranks (processes started by ``ra.launch(backend="nccl")``; when
the machine has fewer than p GPUs, several ranks share one, which NCCL
allows from 2.30 on with NCCL_MULTI_RANK_GPU_ENABLE=1), bfloat16, B = 1,
H = 16, D = 128, zigzag layout, causal and not, forward and backward:

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

``run(args) -> int``: prints the table and a summary line; 0 when every
row ran, 1 when a ring failed, 2 when no GPU, NCCL or PyTorch is there.
"""
import os

from .timing import median_time

B, H, D = 1, 16, 128
DTYPE = "bfloat16"


def _rank(comm, n, repeat):
    """{causal: this rank's median ring and transfer-only times, forward and
    backward (seconds)} for causal False and True: one launch serves both."""
    return {causal: _rank_times(comm, n, causal, repeat) for causal in (False, True)}


def _rank_times(comm, n, causal, repeat):
    import torch

    import ringattn as ra
    from ringattn.layout import shard_positions

    p, r = comm.size, comm.rank
    dev = comm.device[1]
    torch.cuda.set_device(dev)
    n_r = len(shard_positions(n, p, "zigzag", r))
    g = torch.Generator(device=f"cuda:{dev}").manual_seed(r)
    q, k, v, dout = (torch.randn(B, n_r, H, D, device=f"cuda:{dev}", dtype=torch.bfloat16,
                                 generator=g) for _ in range(4))

    def sync():
        torch.cuda.synchronize(dev)
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
    kv = torch.empty(2 * B * max(lens) * H * D, device=f"cuda:{dev}", dtype=torch.bfloat16)
    kv_in = torch.empty_like(kv)
    dkv = torch.empty(2 * B * max(lens) * H * D, device=f"cuda:{dev}", dtype=torch.float32)
    dkv_in = torch.empty_like(dkv)

    def steps(with_dkv):
        def go():
            for step in range(p):
                src_len = lens[(r - step - 1) % p]
                m = 2 * B * src_len * H * D
                if step < p - 1:
                    comm.sendrecv(kv[:2 * B * n_r * H * D], (r + 1) % p, kv_in[:m], (r - 1) % p,
                                  step=step)
                if with_dkv:
                    comm.sendrecv(dkv[:2 * B * n_r * H * D], (r + 1) % p, dkv_in[:m],
                                  (r - 1) % p, step=step)
        return go

    res["xfer_fwd"] = median_time(steps(False), repeat, sync=sync) if p > 1 else 0.0
    res["xfer_bwd"] = median_time(steps(True), repeat, sync=sync) if p > 1 else 0.0
    return res


def _single(n, causal, repeat):
    """Median seconds of one device doing the whole forward / backward."""
    import torch

    import ringattn as ra

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(B, n, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
                     for _ in range(4))
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
    sync = torch.cuda.synchronize
    return {"fwd": median_time(lambda: ra.attention(q, k, v, causal=causal, return_lse=True),
                               repeat, sync=sync),
            "bwd": median_time(lambda: ra.attention_backward(dout, q, k, v, out, lse, causal=causal),
                               repeat, sync=sync)}


def _can_run(p, n_gpus, nccl):
    """(ok, why not, needs the multi-rank switch)."""
    if p <= n_gpus:
        return True, "", False
    if nccl is not None and nccl >= (2, 30, 0):
        return True, "", True
    return False, f"{p} ranks need {p} GPUs or NCCL >= 2.30 (have {n_gpus}, NCCL {nccl})", False


def run(args=None) -> int:
    import ringattn as ra
    from .gpu import preflight

    torch = preflight("bench --ring --gpu", "bench-gpu-ring")
    if torch is None:
        return 2
    nccl = ra.nccl_version()
    if nccl is None:
        print("bench --ring --gpu: NCCL cannot be loaded (pip install nvidia-nccl-cu13, or "
              "RINGATTN_NCCL_LIBRARY)")
        print("bench-gpu-ring: FAIL no NCCL")
        return 2
    quick = bool(getattr(args, "quick", False))
    n = 4096 if quick else 16384
    seq_arg = getattr(args, "seq_lens", "") or ""
    if seq_arg.strip():
        n = int(seq_arg.split(",")[0])
    repeat = 3 if quick else 5
    n_gpus = ra.cuda_info()["devices"]
    print(f"ring over NCCL {'.'.join(map(str, nccl))} on {n_gpus} x "
          f"{torch.cuda.get_device_name()}: n={n}, B={B}, H={H}, D={D}, {DTYPE}, zigzag; "
          f"median of {repeat}, wall time synchronised")
    print("exposed = max(0, ring - single * share) (share = 1/p with a GPU per rank, 1 when "
          "the ranks share one); hidden = 1 - min(1, exposed / xfer)")
    head = ("| p | GPUs | causal | pass | single s | ring s | ring / single | xfer s "
            "| exposed s | hidden |")
    print(head)
    print("|---:|---:|:---:|:---:|---:|---:|---:|---:|---:|---:|", flush=True)
    status, done = 0, 0
    single = {causal: _single(n, causal, repeat) for causal in (False, True)}
    for p in (1, 2, 3, 4):
        ok, why, share_gpu = _can_run(p, n_gpus, nccl)
        if not ok:
            print(f"| {p} | - | - | - | skipped: {why} |")
            continue
        old = os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE")
        if share_gpu:
            os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
        try:
            res = ra.launch(_rank, p, args=(n, repeat), backend="nccl", timeout=300)
        except Exception as e:      # noqa: BLE001 - reported, the bench goes on
            print(f"| {p} | - | - | - | FAILED: {type(e).__name__}: "
                  f"{str(e).splitlines()[0]} |")
            status = 1
            continue
        finally:
            if share_gpu and old is None:
                os.environ.pop("NCCL_MULTI_RANK_GPU_ENABLE", None)
        gpus = min(p, n_gpus)
        share = 1.0 if gpus < p else 1.0 / p
        for causal in (False, True):
            for pas in ("fwd", "bwd"):
                one = single[causal][pas]
                ring = max(x[causal][pas] for x in res)
                xfer = max(x[causal]["xfer_" + pas] for x in res)
                exposed = max(0.0, ring - one * share)
                hidden = f"{1.0 - min(1.0, exposed / xfer):.0%}" if p > 1 and xfer > 0 else "n/a"
                print(f"| {p} | {gpus} | {'yes' if causal else 'no'} | {pas} | "
                      f"{one:.4f} | {ring:.4f} | {ring / one:.2f} | "
                      f"{xfer:.4f} | {exposed:.4f} | {hidden} |", flush=True)
        done += 1
    print(f"bench-gpu-ring: {'PASS' if status == 0 else 'FAIL'} ({done} ring runs, "
          f"NCCL {'.'.join(map(str, nccl))}, {n_gpus} GPU(s))")
    return status


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seq-lens", dest="seq_lens", default="")
    sys.exit(run(ap.parse_args()))
