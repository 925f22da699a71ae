"""Ulysses and hybrid sequence parallelism on 4 ranks that are threads of
this process.

``ulysses=u`` groups the 4 ranks into 4 / u groups of u: inside a group an
all-to-all gives every rank the group's tokens for H / u of the heads, the
ring runs across the groups, and a second all-to-all brings the output
back to each rank's own tokens.  u = 1 is the plain ring, u = 2 hybrid
(2 groups of 2), u = 4 pure Ulysses.  Here H = 8 query heads share
H_kv = 2 kv heads, so u = 4 replicates each kv head twice for the exchange.
Every result is compared with single-rank attention over the whole
sequence; the script exits with an error if one disagrees.

    python examples/ulysses_threads.py
"""

import sys

import numpy as np

import ringattn as ra

N, B, H, H_KV, D, P = 2048, 1, 8, 2, 64, 4
TOLERANCE = 1e-4      # float32 relative to the largest value


def rank_fn(comm, q, k, v, dout, u):
    """Runs on every rank: its shard for ulysses=u, forward and backward."""
    def shard(x):
        return ra.shard(x, comm.rank, comm.size, "zigzag", ulysses=u)

    q_r, k_r, v_r, dout_r = map(shard, (q, k, v, dout))
    kw = dict(causal=True, layout="zigzag", ulysses=u)
    out, lse = ra.ring_attention(q_r, k_r, v_r, comm, return_lse=True, **kw)
    dq, dk, dv = ra.ring_attention_backward(dout_r, q_r, k_r, v_r, out, lse,
                                            comm, **kw)
    return out, dq, dk, dv


def main():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, N, H, D), dtype=np.float32)
    k = rng.standard_normal((B, N, H_KV, D), dtype=np.float32)
    v = rng.standard_normal((B, N, H_KV, D), dtype=np.float32)
    dout = rng.standard_normal((B, N, H, D), dtype=np.float32)
    ref_out, ref_lse = ra.attention(q, k, v, causal=True, return_lse=True)
    ref = (ref_out,) + tuple(ra.attention_backward(dout, q, k, v, ref_out,
                                                   ref_lse, causal=True))
    worst = 0.0
    for u in (1, 2, 4):
        results = ra.launch(rank_fn, P, args=(q, k, v, dout, u),
                            backend="threads")
        got = [ra.unshard([r[i] for r in results], "zigzag", ulysses=u)
               for i in range(4)]
        for name, g, want in zip(("out", "dq", "dk", "dv"), got, ref):
            err = float(np.abs(g - want).max() / np.abs(want).max())
            print(f"u={u} {name}: max |ring - single| / max |single| = "
                  f"{err:.2e}")
            worst = max(worst, err)
    if not worst <= TOLERANCE:     # also catches NaN
        sys.exit(f"FAIL: Ulysses and the single rank differ by {worst:.2e} "
                 f"(tolerance {TOLERANCE:g})")
    print("PASS: ring, hybrid and Ulysses agree with single-rank attention")


if __name__ == "__main__":
    main()
