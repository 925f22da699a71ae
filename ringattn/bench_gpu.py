"""GPU kernel throughput of ringattn next to PyTorch SDPA (flash, cuDNN).

``run(args) -> str`` times, in one process and with CUDA events (median of
``args.repeats`` calls after ``args.warmup`` warm-up calls), the bf16
forward and backward of ringattn and of PyTorch's scaled_dot_product_attention
with the flash and cuDNN backends, for 16k tokens per batch (B * S = 16384),
H * D = 2048, D in {64, 128}, S in {512 .. 16384}, causal and not.

TFLOP/s use flash-attention 2's convention: forward 4 * B * H * S^2 * D,
halved when causal; backward 2.5 times the forward.  The table is printed
and returned.  Inputs are PyTorch CUDA tensors (BSHD); ringattn receives and
returns them zero-copy through DLPack, so the events on PyTorch's current
stream bracket ringattn's kernels (the import waits on PyTorch's stream,
the export makes PyTorch's stream wait on ringattn's).
"""
import statistics

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
TOKENS = 16384
HIDDEN = 2048


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
    """(forward, backward) closures for SDPA with one backend, or None."""
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
        return None

    def bwd():
        torch.autograd.grad(out, (qt, kt, vt), dt, retain_graph=True)

    try:
        bwd()
    except RuntimeError:
        return fwd, None
    return fwd, bwd


class Unavailable(RuntimeError):
    """This machine cannot run the GPU table (the message says why)."""


def run(args=None) -> str:
    import ringattn as ra

    if not ra.cuda_available():
        raise Unavailable(f"no usable GPU: {ra.cuda_info()['reason']}")
    try:
        import torch
    except ImportError:
        raise Unavailable("PyTorch is needed for the SDPA baselines and the "
                          "CUDA events (pip install torch)") from None

    warmup = getattr(args, "warmup", 3) if args is not None else 3
    repeats = getattr(args, "repeats", 10) if args is not None else 10
    seqlens = getattr(args, "seqlens", None) or SEQLENS
    dims = getattr(args, "head_dims", None) or HEAD_DIMS
    if not torch.cuda.is_available():
        raise Unavailable("PyTorch sees no CUDA device")

    head = (f"{'pass':4} {'causal':6} {'D':>4} {'S':>6} {'B':>3} {'H':>3} "
            f"{'ringattn':>9} {'flash':>9} {'cudnn':>9} {'ra/flash':>8}  (TFLOP/s)")
    lines = [f"device: {torch.cuda.get_device_name()}  bf16, B*S = {TOKENS}, H*D = {HIDDEN}",
             head, "-" * len(head)]
    print("\n".join(lines), flush=True)
    for D in dims:
        H = HIDDEN // D
        for S in seqlens:
            B = max(1, TOKENS // S)
            for causal in (False, True):
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, dout = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16,
                                             generator=g) for _ in range(4))
                flops = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
                out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
                res = {}
                res[("fwd", "ra")] = _time_ms(
                    lambda: ra.attention(q, k, v, causal=causal, return_lse=True), warmup, repeats)
                res[("bwd", "ra")] = _time_ms(
                    lambda: ra.attention_backward(dout, q, k, v, out, lse, causal=causal),
                    warmup, repeats)
                for be in ("flash", "cudnn"):
                    fns = _sdpa_fns(q, k, v, dout, causal, be)
                    if fns is None:
                        continue
                    res[("fwd", be)] = _time_ms(fns[0], warmup, repeats)
                    if fns[1] is not None:
                        res[("bwd", be)] = _time_ms(fns[1], warmup, repeats)
                for pas, mult in (("fwd", 1.0), ("bwd", 2.5)):
                    def tf(name):
                        ms = res.get((pas, name))
                        return None if ms is None else flops * mult / (ms * 1e-3) / 1e12
                    r, f, c = tf("ra"), tf("flash"), tf("cudnn")
                    fmt = lambda x: f"{x:9.1f}" if x is not None else f"{'-':>9}"  # noqa: E731
                    ratio = f"{r / f:8.2f}" if (r and f) else f"{'-':>8}"
                    line = (f"{pas:4} {str(causal):6} {D:4d} {S:6d} {B:3d} {H:3d} "
                            f"{fmt(r)} {fmt(f)} {fmt(c)} {ratio}")
                    print(line, flush=True)
                    lines.append(line)
                del q, k, v, dout, out, lse
                torch.cuda.empty_cache()
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seqlens", type=int, nargs="*")
    ap.add_argument("--head-dims", dest="head_dims", type=int, nargs="*")
    try:
        run(ap.parse_args())
    except Unavailable as e:
        raise SystemExit(f"bench --gpu: {e}")
