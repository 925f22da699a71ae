"""The host tables of ``ringattn bench``.

--cpu   CPU kernels (B=1, H=8, D=64; S in 1024, 4096, 8192; causal and not;
        forward and backward): time, GFLOP/s (FA2 convention: forward
        4*B*H*S^2*D, halved if causal; backward 2.5x) and the ratio to (a)
        this machine's float32 matmul rate through NumPy, measured in the
        same run, and (b) a dense NumPy attention.  Without --threads it runs
        itself twice in subprocesses: single-threaded and with every core.
--ring  ring time over single-rank time for p = 1, 2, 4 local ranks on the
        same total work, the share of transfer time hidden behind compute,
        and each rank's peak ringattn memory.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from .timing import median_time


def matmul_rate(n=2048, repeat=5):
    """float32 GFLOP/s of an n x n x n NumPy matmul on this machine."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    t = median_time(lambda: a @ b, repeat, warmup=2)
    return 2.0 * n ** 3 / t / 1e9


def _flops(B, H, S, D, causal):
    f = 4.0 * B * H * S * S * D
    return f / 2 if causal else f


def numpy_attention(q, k, v, causal, scale):
    """Dense float32 NumPy attention, one head at a time; (out, lse)."""
    import numpy as np

    B, S, H, D = q.shape
    out = np.empty_like(q)
    lse = np.empty((B, H, S), np.float32)
    mask = np.triu(np.ones((S, S), bool), 1) if causal else None
    for b in range(B):
        for h in range(H):
            s = (q[b, :, h] @ k[b, :, h].T) * scale
            if mask is not None:
                s[mask] = -np.inf
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            l = p.sum(axis=1, keepdims=True)
            out[b, :, h] = (p @ v[b, :, h]) / l
            lse[b, h] = (m + np.log(l))[:, 0]
    return out, lse


def numpy_attention_backward(dout, q, k, v, out, lse, causal, scale):
    """Dense float32 NumPy attention backward; (dq, dk, dv)."""
    import numpy as np

    B, S, H, D = q.shape
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    mask = np.triu(np.ones((S, S), bool), 1) if causal else None
    for b in range(B):
        for h in range(H):
            s = (q[b, :, h] @ k[b, :, h].T) * scale
            if mask is not None:
                s[mask] = -np.inf
            p = np.exp(s - lse[b, h][:, None])
            dv[b, :, h] = p.T @ dout[b, :, h]
            dp = dout[b, :, h] @ v[b, :, h].T
            delta = (dout[b, :, h] * out[b, :, h]).sum(axis=1, keepdims=True)
            ds = p * (dp - delta)
            dq[b, :, h] = (ds @ k[b, :, h]) * scale
            dk[b, :, h] = (ds.T @ q[b, :, h]) * scale
    return dq, dk, dv


def cpu_table(threads, seq_lens, repeat, B=1, H=8, D=64):
    """Rows of the CPU kernel table for one thread count."""
    import numpy as np

    import ringattn as ra
    from ringattn import _C

    rate = matmul_rate()
    rows = []
    scale = 1.0 / D ** 0.5
    for S in seq_lens:
        rng = np.random.default_rng(S)
        q, k, v, dout = (rng.standard_normal((B, S, H, D), dtype=np.float32)
                         for _ in range(4))
        # every ringattn timing of this S before any NumPy baseline: BLAS
        # worker threads keep spinning for a while after a NumPy call and
        # would steal the cores from the next short kernel
        res = {}
        for causal in (False, True):
            res[causal, "fwd"] = median_time(lambda: _C.attn_fwd(
                q, k, v, causal=causal, num_threads=threads), repeat)
            out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
            res[causal, "bwd"] = median_time(lambda: _C.attn_bwd(
                dout, q, k, v, out, lse, causal=causal, num_threads=threads),
                repeat)
        for causal in (False, True):
            res[causal, "np_fwd"] = median_time(
                lambda: numpy_attention(q, k, v, causal, scale), 1, warmup=0)
            np_out, np_lse = numpy_attention(q, k, v, causal, scale)
            res[causal, "np_bwd"] = median_time(lambda: numpy_attention_backward(
                dout, q, k, v, np_out, np_lse, causal, scale), 1, warmup=0)
        for causal in (False, True):
            fl = _flops(B, H, S, D, causal)
            for pas, mult in (("fwd", 1.0), ("bwd", 2.5)):
                t, tnp = res[causal, pas], res[causal, "np_" + pas]
                gflops = mult * fl / t / 1e9
                rows.append({"S": S, "causal": causal, "pass": pas,
                             "ms": t * 1e3, "gflops": gflops,
                             "vs_matmul": gflops / rate,
                             "numpy_ms": tnp * 1e3, "speedup": tnp / t})
    return rate, rows


def format_cpu_table(threads, rate, rows):
    lines = [f"threads={threads}  simd={_simd()}  NumPy float32 matmul "
             f"(2048^3): {rate:.1f} GFLOP/s", "",
             "| S | causal | pass | ringattn ms | GFLOP/s | / matmul rate "
             "| dense NumPy ms | speed-up vs NumPy |",
             "|---:|:---:|:---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['S']} | {'yes' if r['causal'] else 'no'} | "
                     f"{r['pass']} | {r['ms']:.1f} | {r['gflops']:.1f} | "
                     f"{r['vs_matmul']:.2f} | {r['numpy_ms']:.1f} | "
                     f"{r['speedup']:.1f}x |")
    return "\n".join(lines)


def _simd():
    from ringattn import _C

    return _C.cpu_simd_level()


def _env_for_threads(n):
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "RINGATTN_NUM_THREADS"):
        env[var] = str(n)
    return env


def run_cpu(args):
    """Print the CPU table(s); returns (status, tables) where tables is a
    list of {"threads", "rate", "rows"} (one per thread count)."""
    seq_lens = ([int(s) for s in (args.seq_lens or "").split(",") if s]
                or ([256, 512] if args.quick else [1024, 4096, 8192]))
    if args.threads:
        rate, rows = cpu_table(args.threads, seq_lens, args.repeat)
        print(format_cpu_table(args.threads, rate, rows), flush=True)
        table = {"threads": args.threads, "rate": rate, "rows": rows}
        if args.rows_json:
            with open(args.rows_json, "w") as f:
                json.dump(table, f)
        return 0, [table]
    ncores = os.cpu_count() or 1
    status, tables = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sorted({1, ncores}):
            rows_json = os.path.join(tmp, f"threads{n}.json")
            cmd = [sys.executable, "-m", "ringattn", "bench", "--cpu",
                   "--threads", str(n), "--repeat", str(args.repeat),
                   "--seq-lens", ",".join(map(str, seq_lens)),
                   "--rows-json", rows_json]
            code = subprocess.call(cmd, env=_env_for_threads(n))
            status |= code
            if code == 0:
                with open(rows_json) as f:
                    tables.append(json.load(f))
            print()
    return status, tables


# ---- ring ---------------------------------------------------------------


def _ring_rank(comm, cfg):
    import numpy as np

    import ringattn as ra
    from ringattn.layout import shard_positions

    p, r = comm.size, comm.rank
    n, B, H, D = cfg["n"], cfg["B"], cfg["H"], cfg["D"]
    pos = shard_positions(n, p, cfg["layout"], r)
    rng = np.random.default_rng(r)
    q, k, v = (rng.standard_normal((B, len(pos), H, D), dtype=np.float32)
               for _ in range(3))
    best = None
    # each rank is its own process: ringattn's statistics are this rank's
    ra.reset_peak_memory_stats()
    base = ra.memory_stats()["cpu"]["current"]
    for _ in range(cfg["repeat"]):
        comm.barrier()
        prof = {}
        t0 = time.perf_counter()
        ra.ring_attention(q, k, v, comm, causal=cfg["causal"],
                          layout=cfg["layout"], seq_len=n,
                          num_threads=cfg["threads"], profile=prof)
        t = time.perf_counter() - t0
        if best is None or t < best[0]:
            best = (t, prof)
    peak = ra.memory_stats()["cpu"]["peak"] - base
    # the same transfers with no compute: the time the ring must hide
    from ringattn import _C

    blk = _C.empty((2 * B * len(pos) * H * D,), "float32")
    rcv = _C.empty((2 * B * max(len(x) for x in ra.shard_indices(n, p, cfg["layout"])) * H * D,), "float32")
    xfer = []
    for _ in range(cfg["repeat"]):
        comm.barrier()
        t0 = time.perf_counter()
        for step in range(p - 1):
            src_len = len(shard_positions(n, p, cfg["layout"], (r - step - 1) % p))
            comm.sendrecv(blk, (r + 1) % p, rcv.narrow(0, 0, 2 * B * src_len * H * D),
                          (r - 1) % p, step=step)
        xfer.append(time.perf_counter() - t0)
    return {"rank": r, "time": best[0], "wait": best[1]["wait_s"],
            "compute": best[1]["compute_s"], "xfer": min(xfer),
            "bytes": best[1]["bytes_sent"], "peak": peak}


def run_ring(args):
    """Print the ring table row by row; returns (status, rows)."""
    import numpy as np

    import ringattn as ra

    n = getattr(args, "seq_len", None) or (2048 if args.quick else 8192)
    B, H, D = 1, 8, 64
    ncores = os.cpu_count() or 1
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, n, H, D), dtype=np.float32)
               for _ in range(3))
    print(f"ring on one machine: n={n}, B={B}, H={H}, D={D}, float32, "
          f"zigzag, host backend; {ncores} cores shared by the ranks\n\n"
          "| p | causal | single-rank s | ring s | ring / single | compute s "
          "| exposed wait s | transfer s | hidden share | MiB sent/rank "
          "| peak MiB/rank |\n"
          "|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
          flush=True)
    rows = []
    for causal in (False, True):
        single = median_time(lambda: ra.attention(q, k, v, causal=causal),
                              args.repeat)
        for p in (1, 2, 4):
            cfg = {"n": n, "B": B, "H": H, "D": D, "layout": "zigzag",
                   "causal": causal, "repeat": args.repeat,
                   "threads": max(1, ncores // p)}
            res = ra.launch(_ring_rank, p, args=(cfg,), backend="host")
            row = {"p": p, "causal": causal, "single_s": single,
                   "ring_s": max(x["time"] for x in res),
                   "wait_s": max(x["wait"] for x in res),
                   "compute_s": max(x["compute"] for x in res),
                   "xfer_s": max(x["xfer"] for x in res),
                   "sent_mib": max(x["bytes"] for x in res) / 2 ** 20,
                   "peak_mib": max(x["peak"] for x in res) / 2 ** 20}
            rows.append(row)
            xfer = row["xfer_s"]
            hidden = (f"{1.0 - min(1.0, row['wait_s'] / xfer):.0%}"
                      if p > 1 and xfer > 0 else "n/a")
            print(f"| {p} | {'yes' if causal else 'no'} | {single:.3f} | "
                  f"{row['ring_s']:.3f} | {row['ring_s'] / single:.2f} | "
                  f"{row['compute_s']:.3f} | {row['wait_s']:.3f} | "
                  f"{xfer:.3f} | {hidden} | {row['sent_mib']:.1f} | "
                  f"{row['peak_mib']:.1f} |", flush=True)
    print()
    return 0, rows
