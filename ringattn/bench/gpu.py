"""``ringattn bench --gpu``: ringattn's CUDA kernels next to PyTorch SDPA's
flash and cuDNN backends, measured in the same run, with their accuracy.

Speed: bfloat16 and float16, D in {64, 128}, S in {1k, 4k, 16k}, causal and
not, B * S = 16384 tokens and H * D = 2048 (so every row does the same
work), forward and backward.  Each time is the median of ``repeats`` calls
after ``warmup`` calls, between CUDA events on PyTorch's current stream
(ringattn imports the inputs after that stream's work and hands its output
back to it, so the events bracket its kernels).  TFLOP/s follow
flash-attention 2's convention: forward 4 * B * H * S^2 * D, halved when
causal; backward 2.5 times the forward's count.

Accuracy (flash-attention's rule): at S = 1024, B = 2, H = 4, per dtype, D
and causal flag, the max |error| of out, dq, dk, dv against a float64
reference, for ringattn and for plain PyTorch attention computed in the
same dtype ("torch math": matmuls and softmax in that dtype, autograd);
ringattn passes when its error is at most 2x (forward) / 3x (backward)
that of torch math, plus a floor of 1e-4 * max(1, max |ref|).

The speed bars of the GPU bring-up (forward >= 0.7x and backward >= 0.5x
SDPA flash at D = 128, bfloat16, S >= 4k) are reported in the last line.

``run(args) -> int``: prints the tables and a summary line; 0 when every
accuracy check passed, 1 otherwise, 2 when no GPU or PyTorch is there.
"""
import statistics

SEQLENS = (1024, 4096, 16384)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")
TOKENS = 16384
HIDDEN = 2048
FWD_BAR, BWD_BAR = 0.7, 0.5
FWD_RULE, BWD_RULE, FLOOR = 2.0, 3.0, 1e-4


def _time_ms(fn, warmup, repeats):
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _sdpa_fns(q, k, v, dout, causal, backend):
    """(forward, backward) closures for SDPA with one backend (None where
    the backend refuses the inputs)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    # SDPA wants (B, H, S, D); transposed views of BSHD keep D contiguous
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v))
    dt = dout.transpose(1, 2)
    F = torch.nn.functional

    def fwd():
        with sdpa_kernel([be]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    try:
        out = fwd()
    except RuntimeError:
        return None, None

    def bwd():
        return torch.autograd.grad(out, (qt, kt, vt), dt, retain_graph=True)

    try:
        bwd()
    except RuntimeError:
        return fwd, None
    return fwd, bwd


def _torch_attention(q, k, v, dout, causal):
    """(out, dq, dk, dv), BSHD, of plain PyTorch attention computed in the
    inputs' dtype (matmuls and softmax in that dtype, as flash-attention's
    tests build their same-precision reference; SDPA's math backend would
    upcast 16-bit inputs to float32), gradients by autograd."""
    import torch

    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    scores = (qt * q.shape[-1] ** -0.5) @ kt.transpose(-1, -2)
    if causal:
        S_q, S_k = scores.shape[-2:]
        hidden = torch.ones(S_q, S_k, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vt
    grads = torch.autograd.grad(out, (qt, kt, vt), dout.transpose(1, 2))
    return [out.transpose(1, 2)] + [g.transpose(1, 2) for g in grads]


def accuracy_rows(dtypes, dims):
    """One row per (dtype, D, causal): errors of ringattn and torch math vs
    float64, and whether ringattn meets the rule."""
    import torch

    import ringattn as ra

    rows = []
    B, S, H = 2, 1024, 4
    for dtype in dtypes:
        tdt = getattr(torch, dtype)
        for D in dims:
            for causal in (False, True):
                g = torch.Generator(device="cuda").manual_seed(D + causal)
                base = [torch.randn(B, S, H, D, device="cuda", generator=g) for _ in range(4)]
                q, k, v, dout = (x.to(tdt) for x in base)
                ref = _torch_attention(*(x.double() for x in (q, k, v, dout)), causal)
                math = _torch_attention(q, k, v, dout, causal)
                out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
                mine = [out] + list(ra.attention_backward(dout, q, k, v, out, lse,
                                                          causal=causal))
                errs = []
                ok = True
                for i, name in enumerate(("out", "dq", "dk", "dv")):
                    r = ref[i]
                    e_ra = (mine[i].double() - r).abs().max().item()
                    e_pt = (math[i].double() - r).abs().max().item()
                    rule = FWD_RULE if i == 0 else BWD_RULE
                    floor = FLOOR * max(1.0, r.abs().max().item())
                    good = e_ra == e_ra and e_ra <= rule * e_pt + floor   # NaN fails
                    ok = ok and good
                    errs.append((name, e_ra, e_pt, good))
                rows.append({"dtype": dtype, "D": D, "causal": causal, "errs": errs, "ok": ok})
                del base, q, k, v, dout, ref, math, out, lse, mine
    return rows


def _speed_one(dtype, D, S, causal, warmup, repeats):
    """{(pass, backend): ms} for one configuration."""
    import torch

    import ringattn as ra

    H, B = HIDDEN // D, max(1, TOKENS // S)
    g = torch.Generator(device="cuda").manual_seed(S + D)
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda", dtype=getattr(torch, dtype),
                                 generator=g) for _ in range(4))
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
    ms = {("fwd", "ra"): _time_ms(
              lambda: ra.attention(q, k, v, causal=causal, return_lse=True), warmup, repeats),
          ("bwd", "ra"): _time_ms(
              lambda: ra.attention_backward(dout, q, k, v, out, lse, causal=causal),
              warmup, repeats)}
    for be in ("flash", "cudnn"):
        fwd, bwd = _sdpa_fns(q, k, v, dout, causal, be)
        if fwd is not None:
            ms[("fwd", be)] = _time_ms(fwd, warmup, repeats)
        if bwd is not None:
            ms[("bwd", be)] = _time_ms(bwd, warmup, repeats)
    return ms


def speed_rows(dtypes, dims, seqlens, warmup, repeats, echo=print):
    """One row per (pass, dtype, causal, D, S) with TFLOP/s of ringattn,
    SDPA flash and SDPA cuDNN (None where a backend cannot run)."""
    import torch

    rows = []
    for dtype in dtypes:
        for D in dims:
            H = HIDDEN // D
            for S in seqlens:
                B = max(1, TOKENS // S)
                for causal in (False, True):
                    ms = _speed_one(dtype, D, S, causal, warmup, repeats)
                    torch.cuda.empty_cache()
                    flops = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
                    for pas, mult in (("fwd", 1.0), ("bwd", 2.5)):
                        tf = {name: (None if (pas, name) not in ms else
                                     flops * mult / (ms[(pas, name)] * 1e-3) / 1e12)
                              for name in ("ra", "flash", "cudnn")}
                        row = {"pass": pas, "dtype": dtype, "causal": causal, "D": D, "S": S,
                               "B": B, "H": H, **tf}
                        rows.append(row)
                        echo(format_speed_row(row))
    return rows


SPEED_HEAD = (f"{'pass':4} {'dtype':8} {'causal':6} {'D':>4} {'S':>6} {'B':>3} {'H':>3} "
              f"{'ringattn':>9} {'flash':>9} {'cudnn':>9} {'ra/flash':>8}  (TFLOP/s)")


def format_speed_row(r):
    def fmt(x):
        return f"{x:9.1f}" if x is not None else f"{'-':>9}"

    ratio = f"{r['ra'] / r['flash']:8.2f}" if (r["ra"] and r["flash"]) else f"{'-':>8}"
    return (f"{r['pass']:4} {r['dtype']:8} {str(r['causal']):6} {r['D']:4d} {r['S']:6d} "
            f"{r['B']:3d} {r['H']:3d} {fmt(r['ra'])} {fmt(r['flash'])} {fmt(r['cudnn'])} {ratio}")


def format_accuracy_row(r):
    parts = [f"{n} {a:.2e}/{b:.2e}{'' if g else ' FAIL'}" for n, a, b, g in r["errs"]]
    return (f"{'ok  ' if r['ok'] else 'FAIL'} {r['dtype']:8} D={r['D']:<3d} "
            f"causal={str(r['causal']):5}  " + ", ".join(parts))


def speed_bars(rows):
    """min ra/flash ratio at D = 128, bfloat16, S >= 4096, per pass."""
    out = {}
    for pas in ("fwd", "bwd"):
        ratios = [r["ra"] / r["flash"] for r in rows
                  if r["pass"] == pas and r["D"] == 128 and r["dtype"] == "bfloat16"
                  and r["S"] >= 4096 and r["ra"] and r["flash"]]
        out[pas] = min(ratios) if ratios else None
    return out


def preflight(command, tag):
    """PyTorch when ringattn and PyTorch both see a GPU; otherwise None,
    after printing why and the failing summary line `tag: FAIL ...`."""
    import ringattn as ra

    why = None
    if not ra.cuda_available():
        why = f"no usable GPU: {ra.cuda_info()['reason']}"
    else:
        try:
            import torch
        except ImportError:
            torch, why = None, "PyTorch is needed for the baselines and the timing (pip install torch)"
        if torch is not None and not torch.cuda.is_available():
            why = "PyTorch sees no CUDA device"
    if why is not None:
        print(f"{command}: {why}")
        print(f"{tag}: FAIL {why.split(':')[0]}")
        return None
    return torch


def run(args=None) -> int:
    import ringattn as ra

    torch = preflight("bench --gpu", "bench-gpu")
    if torch is None:
        return 2
    quick = bool(getattr(args, "quick", False))
    warmup = 2 if quick else 3
    repeats = 5 if quick else 10
    seq_arg = getattr(args, "seq_lens", "") or ""
    seqlens = tuple(int(s) for s in seq_arg.split(",") if s.strip()) or (
        (1024,) if quick else SEQLENS)

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"ringattn {ra.__version__}")
    print("accuracy at S=1024, B=2, H=4: max |err| vs float64, ringattn / torch math "
          f"(same dtype); rule: ringattn <= {FWD_RULE:g}x (out) / {BWD_RULE:g}x (grads) "
          f"torch math + {FLOOR:g} * max(1, max|ref|)")
    acc = accuracy_rows(DTYPES, HEAD_DIMS)
    for r in acc:
        print(format_accuracy_row(r), flush=True)
    print()
    print(f"speed: B*S = {TOKENS}, H*D = {HIDDEN}; median of {repeats} after {warmup} "
          "warm-up calls, CUDA events")
    print("TFLOP/s = flops / time, flops (flash-attention 2 convention): forward "
          "4*B*H*S^2*D, halved when causal; backward 2.5x the forward")
    print(SPEED_HEAD)
    print("-" * len(SPEED_HEAD), flush=True)
    rows = speed_rows(DTYPES, HEAD_DIMS, seqlens, warmup, repeats,
                      echo=lambda line: print(line, flush=True))
    bars = speed_bars(rows)
    n_ok = sum(r["ok"] for r in acc)

    def bar(name, got, want):
        if got is None:
            return f"{name} ra/flash n/a"
        return f"{name} ra/flash {got:.2f} ({'meets' if got >= want else 'below'} {want})"

    print(f"bench-gpu: accuracy {'PASS' if n_ok == len(acc) else 'FAIL'} "
          f"({n_ok}/{len(acc)}); D128 bf16 S>=4k: "
          f"{bar('fwd', bars['fwd'], FWD_BAR)}, {bar('bwd', bars['bwd'], BWD_BAR)}")
    return 0 if n_ok == len(acc) else 1


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seq-lens", dest="seq_lens", default="")
    sys.exit(run(ap.parse_args()))
