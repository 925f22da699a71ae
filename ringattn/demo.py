"""``ringattn demo``: a ring over local ranks, checked against one rank.

Every rank generates only its own shard of q, k, v and dout (rows are drawn
from a generator seeded per chunk of positions, so any rank can produce any
rows without holding the rest), runs ``ring_attention`` forward and backward,
and returns its values at a few sampled global positions together with its
timings, the bytes it sent and peak ringattn memory.  The parent then runs
the same problem on one rank (``attention`` / ``attention_backward`` over
the whole sequence) and reports the largest difference at the sampled rows.

``--ulysses U``: Ulysses inside groups of U ranks and the ring across the
groups (``ring_attention(..., ulysses=U)``; shards from ``shard_positions(
..., ulysses=U)``).

Masks: ``--window LEFT[,RIGHT]`` and ``--docs N`` (N packed documents of
random lengths, the same on every rank from the seed) go to both runs; the
demo prints how much of the score matrix they leave visible.

Backends: ``host`` and ``threads`` run CPU ranks; ``nccl`` runs one process
per rank on the GPUs (ranks share a GPU where there are fewer GPUs than
ranks, which NCCL allows from 2.30 on), uploads each rank's rows with
``ra.to_device`` and runs the single-rank check on the first GPU.
``auto`` is ``nccl`` where that can run, else ``host``.
"""

import math
import os
import sys
import time

import numpy as np

_CHUNK = 512


def demo_rows(seed, shape_bhd, kv_heads, positions, dtype="float32"):
    """q, k, v, dout rows at global `positions`.

    shape_bhd = (B, H, D).  Returns arrays (B, len, H, D) for q and dout and
    (B, len, H_kv, D) for k and v; identical for the same position whichever
    rank asks.
    """
    B, H, D = shape_bhd
    positions = np.asarray(positions, dtype=np.int64)
    outs = [np.empty((B, len(positions), h, D), np.float32)
            for h in (H, kv_heads, kv_heads, H)]
    if len(positions):
        chunks = np.unique(positions // _CHUNK)
        for c in chunks:
            sel = np.nonzero(positions // _CHUNK == c)[0]
            rows = positions[sel] - c * _CHUNK
            rng = np.random.default_rng([seed, int(c)])
            for i, h in enumerate((H, kv_heads, kv_heads, H)):
                block = rng.standard_normal((B, _CHUNK, h, D), dtype=np.float32)
                outs[i][:, sel] = block[:, rows]
    if dtype != "float32":
        from .testing import np_dtype

        outs = [o.astype(np_dtype(dtype)) for o in outs]
    return outs


class _Bar:
    """Progress of rank 0's ring steps on stderr: a bar redrawn in place on a
    terminal, one plain line per step otherwise (logs, pipes, CI)."""

    def __init__(self, label, stream=None):
        self.label, self.t0 = label, time.perf_counter()
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.redraw = bool(isatty and isatty())

    def __call__(self, step, steps):
        el = time.perf_counter() - self.t0
        head = f"  {self.label:8s} ring step {step}/{steps}"
        if self.redraw:
            width = 24
            done = int(width * step / steps)
            self.stream.write(f"\r{head} [{'#' * done}{'.' * (width - done)}]"
                              f" {el:6.1f} s")
            if step == steps:
                self.stream.write("\n")
        else:
            self.stream.write(f"{head}  {el:6.1f} s\n")
        self.stream.flush()


def demo_documents(seed, n, count):
    """cu_seqlens [0, ..., n] of `count` documents of random lengths >= 1
    packed into n tokens (the same for every rank: seeded)."""
    rng = np.random.default_rng([seed, 7])
    cuts = np.sort(rng.choice(np.arange(1, n), size=count - 1, replace=False))
    return [0] + [int(x) for x in cuts] + [n]


def _masks(cfg, positions):
    """The mask keywords of this demo for the tokens at `positions`."""
    kw = {}
    if cfg["window"] is not None:
        kw["window"] = tuple(cfg["window"])
    if cfg["docs"] is not None:
        from .masks import segment_ids

        ids = segment_ids(cfg["docs"], cfg["n"])[:, positions]
        kw["segment_ids"] = np.repeat(ids, cfg["batch"], axis=0)
    return kw


def _on(device, arrays):
    """`arrays` (NumPy) as ringattn Buffers on `device`; as they are on the
    host."""
    import ringattn as ra

    if device[0] == "cpu":
        return arrays
    return [ra.to_device(a, device) for a in arrays]


def _on_device_masks(kw, device):
    if "segment_ids" in kw:
        kw = dict(kw, segment_ids=_on(device, [kw["segment_ids"]])[0])
    return kw


def _finish(device):
    """Wait for the kernels queued on `device` (nothing to wait for on the
    host: the CPU kernels return when done)."""
    if device[0] == "cuda":
        from . import _C

        _C.cuda_synchronize(device[1])


def _rank_main(comm, cfg):
    import ringattn as ra

    from .interop import to_numpy
    from .layout import shard_positions

    p, r = comm.size, comm.rank
    n, B, H, Hkv, D = cfg["n"], cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    pos = shard_positions(n, p, cfg["layout"], r, cfg["ulysses"])
    device = comm.device
    mem = device[0]
    q, k, v, dout = _on(device, demo_rows(cfg["seed"], (B, H, D), Hkv, pos,
                                          cfg["dtype"]))
    masks = _on_device_masks(_masks(cfg, pos), device)
    kw = {"causal": cfg["causal"], "layout": cfg["layout"], "seq_len": n,
          "ulysses": cfg["ulysses"], **masks}
    if mem == "cpu":
        kw["num_threads"] = cfg["threads"]
    else:
        # one untimed ring, forward and backward: NCCL connects its peers
        # and CUDA loads the kernels on first use
        o, lse = ra.ring_attention(q, k, v, comm, return_lse=True, **kw)
        ra.ring_attention_backward(dout, q, k, v, o, lse, comm, **kw)
        del o, lse
        _finish(device)
    own_memory = cfg["per_rank_memory"]
    comm.barrier()
    if own_memory:
        ra.reset_peak_memory_stats()
        base = ra.memory_stats()[mem]["current"]
    show = r == 0 and cfg["progress"]
    fwd, bwd = {}, {}
    t0 = time.perf_counter()
    out, lse = ra.ring_attention(q, k, v, comm, return_lse=True,
                                 progress=_Bar("forward") if show else None,
                                 profile=fwd, **kw)
    _finish(device)
    t1 = time.perf_counter()
    comm.barrier()
    t2 = time.perf_counter()
    dq, dk, dv = ra.ring_attention_backward(
        dout, q, k, v, out, lse, comm,
        progress=_Bar("backward") if show else None, profile=bwd, **kw)
    _finish(device)
    t3 = time.perf_counter()
    comm.barrier()
    peak = ra.memory_stats()[mem]["peak"] - base if own_memory else None
    samples = np.asarray(cfg["samples"], dtype=np.int64)
    mine = np.nonzero(np.isin(pos, samples))[0]
    out, lse, dq, dk, dv = (np.asarray(to_numpy(a), dtype=np.float64)
                            for a in (out, lse, dq, dk, dv))
    return {
        "rank": r, "tokens": len(pos), "fwd_s": t1 - t0, "bwd_s": t3 - t2,
        "peak_bytes": peak, "sent": fwd["bytes_sent"] + bwd["bytes_sent"],
        "steps": fwd["steps"], "device": f"{device[0]}:{device[1]}",
        "positions": pos[mine],
        "out": out[:, mine], "lse": lse[:, :, mine],
        "dq": dq[:, mine], "dk": dk[:, mine], "dv": dv[:, mine],
    }


def _flops(B, H, n, D, causal, visible=None):
    """Forward FLOPs: 4 B H D per visible score (n^2, halved if causal,
    without masks)."""
    if visible is not None:
        return 4.0 * B * H * D * visible
    f = 4.0 * B * H * n * n * D
    return f / 2 if causal else f


def _describe_masks(cfg, causal):
    """One line: the masks and the share of the scores they leave visible,
    and how many (query, key) pairs that is (None, None without masks)."""
    from .bench.masks import visible_fraction
    from .masks import segment_ids

    if cfg["window"] is None and cfg["docs"] is None:
        return None, None
    n = cfg["n"]
    parts = []
    if cfg["window"] is not None:
        parts.append(f"window {tuple(cfg['window'])}")
    if cfg["docs"] is not None:
        lengths = np.diff(cfg["docs"])
        parts.append(f"{len(lengths)} documents of {lengths.min()}.."
                     f"{lengths.max()} tokens")
    ids = None if cfg["docs"] is None else segment_ids(cfg["docs"], n)
    seen = round(visible_fraction(n, causal, ids, cfg["window"]) * n ** 2)
    base = round(visible_fraction(n, causal) * n ** 2)
    line = (f"masks: {', '.join(parts)}: {seen / n ** 2:.2%} of the {n} x "
            f"{n} scores visible ({seen / base:.2%} of "
            f"{'causal' if causal else 'full'} attention)")
    return line, seen


def relative_error(got, ref):
    """max |got - ref| / max |ref| over the entries where ref is finite (0
    when both are all zero); inf where ref is not finite and got differs
    (an empty row's lse is -inf on both sides)."""
    finite = np.isfinite(ref)
    if np.any(got[~finite] != ref[~finite]):
        return math.inf
    err = float(np.max(np.abs(got[finite] - ref[finite]), initial=0.0))
    scale = float(np.max(np.abs(ref[finite]), initial=0.0))
    if scale == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return err / scale


def _compare(results, ref):
    """Per quantity, max |ring - ref| / max |ref| over every sampled row."""
    ref = {key: np.asarray(full, dtype=np.float64) for key, full in ref.items()}
    got = {key: [] for key in ref}
    want = {key: [] for key in ref}
    for res in results:
        pos = res["positions"]
        for key, full in ref.items():
            rows = full[:, :, pos] if key == "lse" else full[:, pos]
            got[key].append(res[key].ravel())
            want[key].append(rows.ravel())
    return {key: relative_error(np.concatenate(got[key]),
                                np.concatenate(want[key])) for key in ref}


def nccl_plan(ranks):
    """Can `ranks` NCCL ranks run on this machine's GPUs?  (ok, why not,
    whether the ranks must share GPUs: NCCL_MULTI_RANK_GPU_ENABLE=1)."""
    import ringattn as ra

    info = ra.cuda_info()
    if not info["available"]:
        return False, f"no usable CUDA device ({info['reason']})", False
    version = ra.nccl_version()
    if version is None:
        return False, ("NCCL cannot be loaded (pip install nvidia-nccl-cu13 "
                       "or nvidia-nccl-cu12, or set RINGATTN_NCCL_LIBRARY)"), \
            False
    if ranks <= info["devices"]:
        return True, "", False
    if version >= (2, 30, 0):
        return True, "", True
    return False, (f"{ranks} ranks on {info['devices']} GPU(s) need NCCL >= "
                   f"2.30 to share a GPU, found "
                   f"{'.'.join(map(str, version))}"), False


def choose_backend(backend, ranks):
    """(backend to run, note for the header or None): ``auto`` is ``nccl``
    where nccl_plan says it can run, else ``host`` (with the reason when
    a GPU is there but cannot be used).  On the emulated GPU of a
    ``RINGATTN_CUDA=emulate`` build ``auto`` is ``host``: the CPU kernels
    are the fast way to run on a CPU (``--backend nccl`` runs the ring on
    the emulated GPU)."""
    if backend != "auto":
        return backend, None
    import ringattn as ra

    if ra.cuda_info().get("emulated"):
        return "host", ("auto picked host: the GPU is ringattn's emulated GPU "
                        "(--backend nccl runs there, slowly)")
    ok, why, _ = nccl_plan(ranks)
    if ok:
        return "nccl", None
    if ra.cuda_info()["available"]:
        return "host", f"auto picked host: {why}"
    return "host", None


def _launch(cfg, ranks, backend):
    """ra.launch of the ranks; for nccl with more ranks than GPUs, with
    NCCL_MULTI_RANK_GPU_ENABLE=1 in the ranks' environment (restored after)."""
    import ringattn as ra

    share = backend == "nccl" and nccl_plan(ranks)[2]
    old = os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE")
    if share:
        os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    try:
        return ra.launch(_rank_main, ranks, args=(cfg,), backend=backend)
    finally:
        if share:
            if old is None:
                os.environ.pop("NCCL_MULTI_RANK_GPU_ENABLE", None)
            else:
                os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = old


def run(args):
    """The demo for parsed ``ringattn demo`` arguments (checked by the
    CLI); returns the exit status: 0 PASS, 1 FAIL."""
    import ringattn as ra

    n, p = args.seq_len, args.ranks
    causal = not args.no_causal
    rng = np.random.default_rng(args.seed + 1)
    samples = np.sort(rng.choice(n, size=min(args.samples, n), replace=False))
    backend, note = choose_backend(args.backend, p)
    gpu = backend == "nccl"
    threads = args.threads or max(1, (os.cpu_count() or 1) // p)
    # the threads backend's ranks share one process and so one allocator:
    # ringattn's memory statistics cannot tell them apart
    per_rank_memory = backend != "threads"
    cfg = {"n": n, "batch": args.batch, "heads": args.heads,
           "kv_heads": args.kv_heads or args.heads, "head_dim": args.head_dim,
           "layout": args.layout, "causal": causal, "seed": args.seed,
           "dtype": args.dtype, "samples": samples.tolist(),
           "threads": threads, "progress": not args.quiet,
           "per_rank_memory": per_rank_memory, "window": args.window,
           "ulysses": args.ulysses,
           "docs": None if args.docs is None else
           demo_documents(args.seed, n, args.docs)}
    B, H, Hkv, D = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    if gpu:
        info = ra.cuda_info()
        count = info["devices"]
        kind = "EMULATED GPU(s) (RINGATTN_CUDA=emulate: the kernels run on " \
            "the CPU; times are not GPU times)" if info.get("emulated") else "GPU(s)"
        where = (f"nccl backend, {min(p, count)} {kind}"
                 f"{', shared by the ranks' if p > count else ''}")
    else:
        where = f"{backend} backend, {threads} kernel thread(s) each"
    u = args.ulysses
    split = "" if u == 1 else (
        f", Ulysses over all {p} ranks" if u == p else
        f", Ulysses in {p // u} groups of {u} ranks, the ring across them")
    print(f"ringattn demo: {p} ranks ({where}), {n} tokens, batch {B}, "
          f"{H} heads ({Hkv} kv), head_dim {D}, {args.dtype}, "
          f"{'causal' if causal else 'full'}, {args.layout} layout{split}",
          flush=True)
    if note is not None:
        print(note, flush=True)
    mask_line, visible = _describe_masks(cfg, causal)
    if mask_line is not None:
        print(mask_line, flush=True)
    ra.reset_peak_memory_stats()
    base = ra.memory_stats()["cpu"]["current"]
    t0 = time.perf_counter()
    try:
        results = _launch(cfg, p, backend)
    except Exception as e:      # noqa: BLE001 - auto says so and goes on
        if not (gpu and args.backend == "auto"):
            raise
        first = (str(e).splitlines() or [""])[0]
        print(f"auto: the nccl run failed ({type(e).__name__}: {first}); "
              f"running the ranks on the host backend instead "
              f"(--backend nccl shows the whole error)", flush=True)
        backend, gpu = "host", False
        cfg["per_rank_memory"] = per_rank_memory = True
        t0 = time.perf_counter()
        results = _launch(cfg, p, backend)
    wall = time.perf_counter() - t0
    process_peak = ra.memory_stats()["cpu"]["peak"] - base
    results.sort(key=lambda x: x["rank"])
    mem = "cuda" if gpu else "cpu"

    device = ("cuda", 0) if gpu else ("cpu", 0)
    print(f"checking against a single-rank run of the whole sequence on "
          f"{device[0]}:{device[1]} ...", flush=True)
    full = demo_rows(args.seed, (B, H, D), Hkv, np.arange(n), args.dtype)
    full = _on(device, full)
    masks = _on_device_masks(_masks(cfg, np.arange(n)), device)
    ra.reset_peak_memory_stats()
    base = ra.memory_stats()[mem]["current"]
    if gpu:     # load the kernels before the clock starts, as the ranks did
        ra.attention_backward(full[3], full[0], full[1], full[2],
                              *ra.attention(full[0], full[1], full[2],
                                            causal=causal, return_lse=True,
                                            **masks),
                              causal=causal, **masks)
        _finish(device)
    s0 = time.perf_counter()
    out, lse = ra.attention(full[0], full[1], full[2], causal=causal,
                            return_lse=True, **masks)
    _finish(device)
    s1 = time.perf_counter()
    grads = ra.attention_backward(full[3], full[0], full[1], full[2], out, lse,
                                  causal=causal, **masks)
    _finish(device)
    s2 = time.perf_counter()
    single_peak = ra.memory_stats()[mem]["peak"] - base
    from .interop import to_numpy

    err = _compare(results, {"out": to_numpy(out), "lse": to_numpy(lse),
                             "dq": to_numpy(grads[0]), "dk": to_numpy(grads[1]),
                             "dv": to_numpy(grads[2])})

    flops = _flops(B, H, n, D, causal, visible)
    fwd_ring = max(x["fwd_s"] for x in results)
    bwd_ring = max(x["bwd_s"] for x in results)
    mib = lambda nbytes: f"{nbytes / 2**20:>9.1f}"
    print()
    where = f" {'device':>7}" if gpu else ""
    print(f"{'rank':>4} {'tokens':>7}{where} {'peak MiB':>9} {'fwd s':>7} "
          f"{'bwd s':>7} {'sent MiB':>9} {'steps':>5}")
    for x in results:
        peak = mib(x["peak_bytes"]) if per_rank_memory else f"{'-':>9}"
        where = f" {x['device']:>7}" if gpu else ""
        print(f"{x['rank']:>4} {x['tokens']:>7}{where} {peak} "
              f"{x['fwd_s']:>7.3f} {x['bwd_s']:>7.3f} {mib(x['sent'])} "
              f"{x['steps']:>5}")
    where = f" {'cuda:0':>7}" if gpu else ""
    print(f"{'1':>4} {n:>7}{where} {mib(single_peak)} {s1 - s0:>7.3f} "
          f"{s2 - s1:>7.3f}   <- single rank, whole sequence")
    if gpu:
        print(f"peak MiB: ringattn's own CUDA memory (memory_stats()['cuda']);"
              f" times are synchronised wall times of one call after an "
              f"untimed one")
    if not per_rank_memory:
        print(f"peak MiB per rank: not measurable with the threads backend "
              f"(one process, one allocator); all {p} ranks together peaked "
              f"at {process_peak / 2**20:.1f} MiB (--backend host measures "
              f"each rank's own)")
    print()
    print(f"ring forward : {fwd_ring:7.2f} s  {flops / fwd_ring / 1e9:8.1f} GFLOP/s  "
          f"{B * n / fwd_ring:10.0f} tokens/s")
    print(f"ring backward: {bwd_ring:7.2f} s  {2.5 * flops / bwd_ring / 1e9:8.1f} GFLOP/s  "
          f"{B * n / bwd_ring:10.0f} tokens/s")
    print(f"launch + ring wall time: {wall:.1f} s")
    tol = {"float32": 1e-4, "float64": 1e-10, "float16": 2e-2,
           "bfloat16": 5e-2}[args.dtype]
    worst = max(err.values())
    print("max |ring - single rank| / max |single rank| on %d sampled rows: %s"
          % (len(samples), ", ".join(f"{k} {v:.2e}" for k, v in err.items())))
    ok = worst <= tol and all(math.isfinite(v) for v in err.values())
    print(f"{'PASS' if ok else 'FAIL'} (tolerance {tol:g})")
    return 0 if ok else 1
