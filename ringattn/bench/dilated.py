"""``ringattn bench --dilated``: LongNet dilated attention against dense
attention of the same length, on the CPU.

Local table: time of ``dilated_attention`` (forward, backward) next to dense
causal ``attention`` for n = 16k, 32k, 64k (dense is skipped above
--dense-max, default 32k, where it takes minutes on a laptop-sized CPU).
Ring table: p = 4 ranks (threads backend), contiguous layout: wall time of
the dilated and the dense ring forward and the bytes each rank sent.
"""

import time

import numpy as np

from .timing import best_time

SEGMENTS = [2048, 4096, 8192, 16384]
RATES = [1, 2, 4, 8]


def _ring_rank(comm, cfg):
    import ringattn as ra

    n, B, H, D = cfg["n"], cfg["B"], cfg["H"], cfg["D"]
    idx = ra.shard_indices(n, comm.size, "contiguous")[comm.rank]
    rng = np.random.default_rng(comm.rank)
    q, k, v = (rng.standard_normal((B, len(idx), H, D), dtype=np.float32)
               for _ in range(3))
    out = {}
    comm.barrier()
    prof = {}
    t0 = time.perf_counter()
    ra.ring_dilated_attention(q, k, v, comm, cfg["segs"], cfg["rates"],
                              causal=True, profile=prof)
    out["dilated_s"] = time.perf_counter() - t0
    out["dilated_bytes"] = prof["bytes_sent"]
    if cfg["dense"]:
        comm.barrier()
        prof = {}
        t0 = time.perf_counter()
        ra.ring_attention(q, k, v, comm, causal=True, profile=prof)
        out["dense_s"] = time.perf_counter() - t0
        out["dense_bytes"] = prof["bytes_sent"]
    return out


def run(args):
    import ringattn as ra

    B, H, D = 1, 8, 64
    ns = [4096, 8192] if args.quick else [16384, 32768, 65536]
    segs = [s // 4 for s in SEGMENTS] if args.quick else SEGMENTS
    dense_max = 8192 if args.quick else 32768
    repeat = max(1, args.repeat if args.repeat else 1)
    lines = [f"dilated vs dense, causal, B={B}, H={H}, D={D}, float32, "
             f"segments {segs}, rates {RATES}, threads {ra.cpu_info()['threads']}",
             "",
             "| n | dilated fwd s | dilated bwd s | dense fwd s | dense bwd s "
             "| fwd speed-up |",
             "|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    for n in ns:
        rng = np.random.default_rng(n)
        q, k, v, do = (rng.standard_normal((B, n, H, D), dtype=np.float32)
                       for _ in range(4))
        out, lse = ra.dilated_attention(q, k, v, segs, RATES, causal=True,
                                        return_lse=True)
        df = best_time(lambda: ra.dilated_attention(q, k, v, segs, RATES,
                                                causal=True), repeat)
        db = best_time(lambda: ra.dilated_attention_backward(
            do, q, k, v, out, lse, segs, RATES, causal=True), repeat)
        if n <= dense_max:
            o2, l2 = ra.attention(q, k, v, causal=True, return_lse=True)
            ff = best_time(lambda: ra.attention(q, k, v, causal=True), repeat)
            fb = best_time(lambda: ra.attention_backward(do, q, k, v, o2, l2,
                                                     causal=True), repeat)
            dense = f"{ff:.2f} | {fb:.2f} | {ff / df:.1f}x"
        else:
            dense = "not run | not run | -"
        print(f"| {n} | {df:.2f} | {db:.2f} | {dense} |", flush=True)

    p = 4
    lines = ["", f"ring, p={p} ranks (threads backend), contiguous layout, "
                  "causal; bytes = what each rank sent in the forward",
              "",
              "| n | dilated ring s | dense ring s | dilated MiB/rank (max) "
              "| dense MiB/rank (max) | bytes ratio |",
              "|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    for n in ns:
        cfg = {"n": n, "B": B, "H": H, "D": D, "segs": segs, "rates": RATES,
               "dense": n <= dense_max}
        res = ra.launch(_ring_rank, p, args=(cfg,), backend="threads")
        dil_b = max(x["dilated_bytes"] for x in res)
        dil_s = max(x["dilated_s"] for x in res)
        if cfg["dense"]:
            den_b = max(x["dense_bytes"] for x in res)
            den_s = f"{max(x['dense_s'] for x in res):.2f}"
            note = ""
        else:
            # the dense ring sends p-1 blocks of k and v of n/p tokens
            den_b = (p - 1) * 2 * B * (n // p) * H * D * 4
            den_s, note = "not run", " (computed)"
        ratio = (f"{den_b / dil_b:.1f}x" if dil_b else
                 "no traffic (every segment inside a shard)")
        print(f"| {n} | {dil_s:.2f} | {den_s} | {dil_b / 2**20:.1f} | "
              f"{den_b / 2**20:.1f}{note} | {ratio} |", flush=True)
    print()
    return 0
