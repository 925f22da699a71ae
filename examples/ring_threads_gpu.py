"""Ring attention on 4 thread ranks on this machine's GPUs: no launcher, no NCCL.

One Python process, one thread per rank, each rank on a GPU (rank r on GPU
r % device_count; with one GPU all four share it).  Each rank holds a
quarter of a causal sequence (zigzag shards, as CUDA arrays on its GPU);
K/V blocks travel around the ring by device copies (same GPU) or peer copies
(between GPUs), ordered on the GPU with events, so the host never waits per
step.  Forward and backward run through the ring; then one rank alone
recomputes two slices of the sequence and the script compares:

* the first `check` queries, against keys [0, check): out and dq;
* the last `check` queries, against all keys: out and dq, and dk, dv of the
  last `check` keys (under the causal mask only those queries see them).

    python examples/ring_threads_gpu.py                  # 1,048,576 tokens
    python examples/ring_threads_gpu.py --seq-len 65536 --dtype float32

It prints the times (to results on the host) and ringattn's peak device
memory, and PASS or FAIL (exit status 1).
"""

import argparse
import sys
import time

import numpy as np

import ringattn as ra
from ringattn.testing import np_dtype

LAYOUT = "zigzag"
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}


def host(x):
    """A device array as float32 NumPy (bfloat16 widened)."""
    return ra.to_device(x, "cpu").numpy().astype(np.float32)


def rank_fn(comm, q, k, v, dout):
    """Runs on every rank (a thread): upload its shard, ring forward and
    backward on its GPU, return its shards on the host and its times."""
    r, p, dev = comm.rank, comm.size, comm.device
    q_r, k_r, v_r, dout_r = (ra.to_device(ra.shard(x, r, p, LAYOUT), dev)
                             for x in (q, k, v, dout))
    comm.barrier()
    start = time.perf_counter()
    out, lse = ra.ring_attention(q_r, k_r, v_r, comm, causal=True,
                                 layout=LAYOUT, return_lse=True)
    lse_host = host(lse)                    # waits for this GPU's work
    comm.barrier()
    forward = time.perf_counter() - start
    grads = ra.ring_attention_backward(dout_r, q_r, k_r, v_r, out, lse, comm,
                                       causal=True, layout=LAYOUT)
    grads = [host(g) for g in grads]
    comm.barrier()
    backward = time.perf_counter() - start - forward
    return (host(out), lse_host, *grads), (forward, backward)


def one_rank(q, k, v, dout, lo, hi, device):
    """Queries [lo, hi) against keys [0, hi) on one GPU (causal, bottom-right
    aligned: query i sees keys <= i): out, dq, dk, dv on the host."""
    qs, ks, vs, ds = (ra.to_device(np.ascontiguousarray(x[:, a:hi]), device)
                      for x, a in ((q, lo), (k, 0), (v, 0), (dout, lo)))
    out, lse = ra.attention(qs, ks, vs, causal=True, return_lse=True)
    grads = ra.attention_backward(ds, qs, ks, vs, out, lse, causal=True)
    return [host(x) for x in (out, *grads)]


def compare(name, got, want, tol):
    err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    print(f"  {name}: max |ring - single rank| / max |single rank| = "
          f"{err:.2e}")
    return err <= tol           # False for NaN too


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=1 << 20)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(TOLERANCE))
    ap.add_argument("--check", type=int, default=2048,
                    help="tokens in each slice one rank recomputes")
    args = ap.parse_args(argv)
    if not ra.cuda_available():
        sys.exit(f"no CUDA device: {ra.cuda_info()['reason']}")
    n, p, check = args.seq_len, args.ranks, min(args.check, args.seq_len)
    ndev = ra.cuda_info()["devices"]
    devices = [r % ndev for r in range(p)]
    print(f"{n} tokens, {p} thread ranks on GPUs {devices}"
          f"{' (emulated)' if ra.cuda_info().get('emulated') else ''}, "
          f"H {args.heads}, H_kv {args.kv_heads}, D {args.head_dim}, "
          f"{args.dtype}, causal, {LAYOUT}")

    rng = np.random.default_rng(0)
    dt = np_dtype(args.dtype)

    def randn(h):
        return rng.standard_normal((1, n, h, args.head_dim),
                                   dtype=np.float32).astype(dt)

    q, k, v, dout = (randn(args.heads), randn(args.kv_heads),
                     randn(args.kv_heads), randn(args.heads))

    ra.reset_peak_memory_stats()
    results = ra.launch(rank_fn, p, args=(q, k, v, dout), backend="threads",
                        devices=devices)
    forward = max(t[0] for _, t in results)
    backward = max(t[1] for _, t in results)
    peak = ra.memory_stats()["cuda"]["peak"]
    print(f"ring forward {forward:.3f} s, backward {backward:.3f} s "
          f"(to results on the host); peak device memory {peak / 2**20:.1f} "
          f"MiB (all ranks)")
    out, _, dq, dk, dv = (ra.unshard([res[i] for res, _ in results], LAYOUT,
                                     axis=2 if i == 1 else 1)
                          for i in range(5))

    tol, ok = TOLERANCE[args.dtype], True
    print(f"first {check} queries (one rank):")
    ref = one_rank(q, k, v, dout, 0, check, f"cuda:{devices[0]}")
    for name, got, want in zip(("out", "dq"), (out, dq), ref[:2]):
        ok &= compare(name, got[:, :check], want, tol)
    print(f"last {check} queries (one rank, all {n} keys):")
    ref = one_rank(q, k, v, dout, n - check, n, f"cuda:{devices[0]}")
    ok &= compare("out", out[:, n - check:], ref[0], tol)
    ok &= compare("dq", dq[:, n - check:], ref[1], tol)
    ok &= compare("dk", dk[:, n - check:], ref[2][:, n - check:], tol)
    ok &= compare("dv", dv[:, n - check:], ref[3][:, n - check:], tol)
    if not ok:
        print(f"FAIL: the ring and one rank differ (tolerance {tol:g})")
        return 1
    print("PASS: the ring on thread ranks agrees with one rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
