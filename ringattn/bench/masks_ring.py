"""``ringattn bench --masks``, ring rows: a sliding window over a ring of 4
CPU ranks (host backend: real processes over loopback TCP), with and
without the window.

n = 64k tokens (8k with --quick), window (4096, 0) ((512, 0)), causal,
contiguous layout, float32, B = 1, H = 2, D = 64 (the local window table's
problem, ringattn.bench.masks), each rank with cores / 4 kernel threads.
Each row: the slowest rank's forward and backward seconds (best of
--repeat), ring steps taken, and the MiB each rank sent (forward, backward;
``profile["bytes_sent"]``).  With the window a rank sends only the last w
rows of its block to the next rank (and their dk/dv, which come back), so
its bytes do not grow with n; without it every block goes to every later
rank.
"""

import os

import numpy as np

from .masks import B, D, format_table
from .timing import best_ring_step

P, H = 4, 2

COLUMNS = [
    ("ring case", "case", "{}"),
    ("p", "p", "{}"),
    ("n", "n", "{}"),
    ("fwd s", "fwd_s", "{:.2f}"),
    ("bwd s", "bwd_s", "{:.2f}"),
    ("steps", "steps", "{}"),
    ("MiB sent per rank, fwd", "fwd_mib", "{}"),
    ("MiB sent per rank, bwd", "bwd_mib", "{}"),
]


def _rank(comm, cfg):
    """This rank's best (fwd s, bwd s) and its profiles."""
    import ringattn as ra

    pos = ra.shard_indices(cfg["n"], comm.size, "contiguous")[comm.rank]
    rng = np.random.default_rng(comm.rank)
    q, k, v, dout = (rng.standard_normal((B, len(pos), H, D),
                                         dtype=np.float32) for _ in range(4))
    kw = dict(causal=True, layout="contiguous", num_threads=cfg["threads"])
    if cfg["window"] is not None:
        kw["window"] = cfg["window"]
    return best_ring_step(comm, q, k, v, dout, kw, cfg["repeat"])


def ring_rows(n, w, repeat):
    """Rows of the causal ring over n tokens without and with window (w, 0)."""
    import ringattn as ra

    threads = max(1, (os.cpu_count() or 1) // P)
    rows = []
    for window in (None, (w, 0)):
        cfg = {"n": n, "window": window, "repeat": repeat, "threads": threads}
        res = ra.launch(_rank, P, args=(cfg,), backend="host")
        mib = lambda key: "/".join(f"{r[key]['bytes_sent'] / 2**20:.1f}"
                                   for r in res)
        rows.append({"case": "causal" if window is None else
                     f"window ({w}, 0)", "p": P, "n": n,
                     "fwd_s": max(r[0] for r in res),
                     "bwd_s": max(r[1] for r in res),
                     "steps": res[0][2]["steps"],
                     "fwd_mib": mib(2), "bwd_mib": mib(3)})
        text = format_table([rows[-1]], COLUMNS)
        print(text if window is None else text.splitlines()[-1], flush=True)
    return rows


def run(args):
    """Print the ring rows of ``ringattn bench --masks``."""
    n, w = (8192, 512) if args.quick else (65536, 4096)
    print(f"\nsliding window over a ring of {P} ranks: {n} tokens, causal, "
          f"contiguous layout, host backend, H={H}, D={D}, float32; bytes "
          f"per rank 0/1/2/3\n", flush=True)
    ring_rows(n, w, max(1, args.repeat))
    print()
    return 0
