"""``ringattn bench --ulysses``: the plain ring, hybrid and pure Ulysses on
p = 4 CPU ranks (host backend, one process each), u = 1, 2, 4, causal:
time forward and backward, the bytes each rank sends, the time in the
all-to-alls and in ring waits, and each rank's peak ringattn memory.

Every configuration runs the same problem (the same q, k, v, dout rows);
one small untimed call per u makes the sub-communicators first, so the
table shows the steady state of a training step.
"""

import os

from .timing import best_ring_step

__all__ = ["run"]

P = 4
US = (1, 2, 4)


def _rank(comm, cfg):
    import numpy as np

    import ringattn as ra
    from ringattn.layout import shard_positions

    p, r, u = comm.size, comm.rank, cfg["u"]
    n, B, H, Hkv, D = cfg["n"], cfg["B"], cfg["H"], cfg["Hkv"], cfg["D"]
    kw = dict(causal=True, layout="zigzag", num_threads=cfg["threads"],
              ulysses=u)
    # the groups (comm.split) are made by the first call: an untimed one
    small = np.zeros((B, len(shard_positions(16 * p, p, "zigzag", r, u)), H,
                      D), np.float32)
    ra.ring_attention(small, small[:, :, :Hkv], small[:, :, :Hkv], comm,
                      **kw)
    pos = shard_positions(n, p, "zigzag", r, u)
    rng = np.random.default_rng([cfg["seed"], r])
    q, dout = (rng.standard_normal((B, len(pos), H, D), dtype=np.float32)
               for _ in range(2))
    k, v = (rng.standard_normal((B, len(pos), Hkv, D), dtype=np.float32)
            for _ in range(2))
    ra.reset_peak_memory_stats()
    base = ra.memory_stats()["cpu"]["current"]
    fwd_s, bwd_s, fwd, bwd = best_ring_step(comm, q, k, v, dout,
                                            dict(kw, seq_len=n),
                                            cfg["repeat"])
    a2a = fwd.get("alltoall_s", 0.0) + bwd.get("alltoall_s", 0.0)
    return {"rank": r, "fwd_s": fwd_s, "bwd_s": bwd_s, "alltoall_s": a2a,
            "ring_wait_s": fwd["wait_s"] + bwd["wait_s"] - a2a,
            "compute_s": fwd["compute_s"] + bwd["compute_s"],
            "sent_fwd": fwd["bytes_sent"], "sent_bwd": bwd["bytes_sent"],
            "a2a_bytes": fwd.get("alltoall_bytes", 0) +
            bwd.get("alltoall_bytes", 0),
            "peak": ra.memory_stats()["cpu"]["peak"] - base}


def run(args):
    """Print the table row by row; returns the exit status."""
    import ringattn as ra

    seq = [int(s) for s in (args.seq_lens or "").split(",") if s]
    n = seq[0] if seq else (2048 if args.quick else 16384)
    B, H, Hkv, D = 1, 8, 8, 64
    ncores = os.cpu_count() or 1
    threads = max(1, ncores // P)
    print(f"Ulysses and hybrid on one machine: p={P} host ranks "
          f"(processes), n={n}, B={B}, H={H}, H_kv={Hkv}, D={D}, float32, "
          f"causal, zigzag over the groups; {ncores} cores shared by the "
          f"ranks ({threads} kernel thread(s) each); best of {args.repeat}\n"
          "\n| u | groups | fwd s | bwd s | all-to-all s | ring wait s "
          "| compute s | MiB sent/rank fwd | MiB sent/rank bwd "
          "| of which all-to-all | peak MiB/rank |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
          flush=True)
    rows = []
    for u in US:
        cfg = {"n": n, "B": B, "H": H, "Hkv": Hkv, "D": D, "u": u,
               "repeat": args.repeat, "threads": threads, "seed": 0}
        res = ra.launch(_rank, P, args=(cfg,), backend="host")
        mib = 2.0 ** 20
        row = {"u": u, "groups": P // u,
               "fwd_s": max(x["fwd_s"] for x in res),
               "bwd_s": max(x["bwd_s"] for x in res),
               "alltoall_s": max(x["alltoall_s"] for x in res),
               "ring_wait_s": max(x["ring_wait_s"] for x in res),
               "compute_s": max(x["compute_s"] for x in res),
               "fwd_mib": max(x["sent_fwd"] for x in res) / mib,
               "bwd_mib": max(x["sent_bwd"] for x in res) / mib,
               "a2a_mib": max(x["a2a_bytes"] for x in res) / mib,
               "peak_mib": max(x["peak"] for x in res) / mib}
        rows.append(row)
        print(f"| {u} | {row['groups']} | {row['fwd_s']:.2f} | "
              f"{row['bwd_s']:.2f} | {row['alltoall_s']:.3f} | "
              f"{row['ring_wait_s']:.3f} | {row['compute_s']:.2f} | "
              f"{row['fwd_mib']:.1f} | {row['bwd_mib']:.1f} | "
              f"{row['a2a_mib']:.1f} | {row['peak_mib']:.1f} |", flush=True)
    print("\nu = 1: the plain ring; u = 4: pure Ulysses (no ring); bytes are "
          "what each rank sends (the largest over the ranks), the "
          "all-to-alls' included; peak: ringattn's own memory per rank "
          "during the timed calls.")
    return 0
