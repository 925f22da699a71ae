"""Ring attention on 4 ranks that are threads of this process.

Each rank holds a zigzag shard of a causal sequence; K/V blocks travel
around the ring and partial results merge by log-sum-exp.  The gathered
result is compared with single-rank attention over the whole sequence; the
script exits with an error if they disagree.

    python examples/ring_threads.py
"""

import sys

import numpy as np

import ringattn as ra

N, B, H, H_KV, D, P = 4096, 1, 8, 2, 64, 4
TOLERANCE = 1e-4      # float32 relative to the largest value


def rank_fn(comm, q, k, v, dout):
    """Runs on every rank: shard, ring forward and backward, return shards."""
    def shard(x):
        return ra.shard(x, comm.rank, comm.size, "zigzag")

    q_r, k_r, v_r, dout_r = map(shard, (q, k, v, dout))
    out, lse = ra.ring_attention(q_r, k_r, v_r, comm, causal=True,
                                 layout="zigzag", return_lse=True)
    dq, dk, dv = ra.ring_attention_backward(dout_r, q_r, k_r, v_r, out, lse,
                                            comm, causal=True, layout="zigzag")
    return out, dq, dk, dv


def main():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, N, H, D), dtype=np.float32)
    k = rng.standard_normal((B, N, H_KV, D), dtype=np.float32)
    v = rng.standard_normal((B, N, H_KV, D), dtype=np.float32)
    dout = rng.standard_normal((B, N, H, D), dtype=np.float32)

    results = ra.launch(rank_fn, P, args=(q, k, v, dout), backend="threads")
    out, dq, dk, dv = (ra.unshard([r[i] for r in results], "zigzag")
                       for i in range(4))

    ref_out, ref_lse = ra.attention(q, k, v, causal=True, return_lse=True)
    ref = ra.attention_backward(dout, q, k, v, ref_out, ref_lse, causal=True)
    worst = 0.0
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv),
                               (ref_out,) + tuple(ref)):
        err = float(np.abs(got - want).max() / np.abs(want).max())
        print(f"{name}: max |ring - single| / max |single| = {err:.2e}")
        worst = max(worst, err)
    if not worst <= TOLERANCE:     # also catches NaN
        sys.exit(f"FAIL: the ring and the single rank differ by {worst:.2e} "
                 f"(tolerance {TOLERANCE:g})")
    print("PASS: the ring agrees with single-rank attention")


if __name__ == "__main__":
    main()
