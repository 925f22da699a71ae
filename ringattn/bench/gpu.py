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

Kernel families: the "family" column names the tensor-core kernels the
ringattn column ran: "sm90a" (wgmma/TMA, cuda/hopper/) where the device and
the build have them, else "sm80" (mma.sync).  Where a pass runs sm90a, the
"sm80" column times its mma.sync kernels in the same run
(RINGATTN_CUDA_KERNELS=sm80 around those calls), side by side.  The "det"
column (backward rows) times attention_backward with deterministic=True: on
sm90a the wgmma dk/dv pass and the wgmma dq pass, else the mma.sync pair.

Model: next to every ringattn time, the H100 SXM performance model's
prediction for the family that ran (ringattn/bench/model.py, fed by the
kernels' SASS counts in kernel_counts.json), with measured/model, and after
the table the model's time of each kernel (fwd_wg or fwd_tc; delta, bwd_tc,
dq_convert: the fused backward that attention_backward runs by default;
"model det": the deterministic pass's kernels and its measured time), so
that one GPU run both checks the kernels and recalibrates the model
(docs/results.md).

Accuracy (flash-attention's rule): at S = 1024, B = 2, H = 4, per dtype, D
and causal flag, the max |error| of out, dq, dk, dv against a float64
reference, for ringattn and for plain PyTorch attention computed in the
same dtype ("torch math": matmuls and softmax in that dtype, autograd);
ringattn passes when its error is at most 2x (forward) / 3x (backward)
that of torch math, plus a floor of 1e-4 * max(1, max |ref|).

Masks: at bfloat16, D = 128, B = 1, H = 16, S = 16k (the largest S asked
for), causal: plain (next to SDPA flash), a sliding window of S/4 = 4k and
8 packed documents of 2k (next to SDPA given the same mask as an explicit
boolean (S, S) matrix, whichever backend takes it), with the visible
fraction of the S x S pairs, times in ms and TFLOP/s counted on the visible
pairs only.  Their accuracy, by the rule above, at S = 1024 with the window,
the documents and a softcap at once, next to torch math with the same mask.

The speed bars of the GPU bring-up (forward >= 0.7x and backward >= 0.5x
SDPA flash at D = 128, bfloat16, S >= 4k) are reported in the last line,
with the masked rows' time as a fraction of plain causal.

Without PyTorch (with CUDA), or on the emulated GPU of a
``RINGATTN_CUDA=emulate`` build (which PyTorch cannot see), ringattn runs
alone and says so: inputs are NumPy draws uploaded with ``ra.to_device``,
times are synchronised wall times, the SDPA and torch math columns are
"-", and accuracy is judged against the float64 reference of
``ringattn.testing`` with the GPU tests' tolerance (``TOL`` * max(1, max
|ref|)).  The emulated GPU runs the kernels on the CPU: there every size
is cut to a tiny configuration (``EMULATED_SIZES``) and the times say
nothing about a GPU; it only shows that the bench runs.

``run(args) -> int``: prints the tables and a summary line; 0 when every
accuracy check passed, 1 otherwise, 2 when no GPU is there.
"""
import contextlib
import os
import statistics

from .masks import dense_mask, visible_fraction

SEQLENS = (1024, 4096, 16384)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")
TOKENS = 16384
HIDDEN = 2048
FWD_BAR, BWD_BAR = 0.7, 0.5
FWD_RULE, BWD_RULE, FLOOR = 2.0, 3.0, 1e-4
MASKED_DOCS = 8
# without torch math to compare with: tests/test_cuda.py's tolerance
TOL = {"bfloat16": 2e-2, "float16": 5e-3}
# the accuracy problem (B, S, H), the speed rows' tokens and hidden size,
# their default sequence lengths, warm-up and timed calls
SIZES = {"accuracy": (2, 1024, 4), "tokens": TOKENS, "hidden": HIDDEN,
         "seqlens": SEQLENS, "quick_seqlens": (1024,), "warmup": (3, 2), "repeats": (10, 5)}
EMULATED_SIZES = {"accuracy": (1, 128, 2), "tokens": 256, "hidden": 128,
                  "seqlens": (128,), "quick_seqlens": (128,), "warmup": (1, 1),
                  "repeats": (2, 2)}


class _Device:
    """The arrays, timer and cache of the bench: PyTorch's (`torch` given:
    CUDA events on its current stream) or ringattn's alone (``ra.to_device``
    uploads of NumPy draws, wall times between ``cuda_synchronize`` calls)."""

    def __init__(self, torch=None):
        self.torch = torch

    def randn(self, shape, dtype, seed, count=4):
        """`count` standard-normal arrays of `shape` in `dtype` on GPU 0."""
        if self.torch is not None:
            torch = self.torch
            g = torch.Generator(device="cuda").manual_seed(seed)
            return [torch.randn(*shape, device="cuda", generator=g).to(getattr(torch, dtype))
                    for _ in range(count)]
        import numpy as np

        import ringattn as ra

        rng = np.random.default_rng(seed)
        return [ra.to_device(rng.standard_normal(shape, dtype=np.float32), "cuda", dtype=dtype)
                for _ in range(count)]

    def ids(self, x):
        """(B, S) int32 NumPy ids -> on GPU 0."""
        if self.torch is not None:
            return self.torch.from_numpy(x).to("cuda")
        import ringattn as ra

        return ra.to_device(x, "cuda")

    def scaled(self, x, factor):
        if self.torch is not None:
            return x * factor
        import ringattn as ra

        host = self.host(x) * factor
        return ra.to_device(host, "cuda", dtype=x.dtype)

    def host(self, x):
        """A device array as float64 NumPy."""
        if self.torch is not None:
            return x.double().cpu().numpy()
        import ringattn as ra

        return ra.to_device(x, "cpu", dtype="float64").numpy()

    def time_ms(self, fn, warmup, repeats):
        if self.torch is not None:
            return _time_ms(fn, warmup, repeats)
        import ringattn as ra

        from .timing import median_time

        return 1e3 * median_time(fn, repeats, warmup=warmup,
                                 sync=lambda: ra._C.cuda_synchronize(0))

    def empty_cache(self):
        if self.torch is not None:
            self.torch.cuda.empty_cache()
        else:
            import ringattn as ra

            ra._C.cuda_empty_cache()


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


def _sdpa_fns(q, k, v, dout, causal, backend, attn_mask=None):
    """(forward, backward) closures for SDPA with one backend ("flash",
    "cudnn", or None for whichever takes an explicit `attn_mask`, a boolean
    (S_q, S_k) matrix, True where visible); None where the backend refuses
    the inputs."""
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
          None: None}[backend]
    # SDPA wants (B, H, S, D); transposed views of BSHD keep D contiguous
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v))
    dt = dout.transpose(1, 2)
    F = torch.nn.functional

    def fwd():
        with sdpa_kernel([be]) if be is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask,
                                                  is_causal=causal and attn_mask is None)

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


def _torch_attention(q, k, v, dout, causal, visible=None, softcap=None):
    """(out, dq, dk, dv), BSHD, of plain PyTorch attention computed in the
    inputs' dtype (matmuls and softmax in that dtype, as flash-attention's
    tests build their same-precision reference; SDPA's math backend would
    upcast 16-bit inputs to float32), gradients by autograd.  visible: a
    boolean (S_q, S_k) mask (True where a key is visible) instead of the
    causal one; softcap: scores s -> softcap * tanh(s / softcap)."""
    import torch

    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    scores = (qt * q.shape[-1] ** -0.5) @ kt.transpose(-1, -2)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    elif causal:
        S_q, S_k = scores.shape[-2:]
        hidden = torch.ones(S_q, S_k, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vt
    grads = torch.autograd.grad(out, (qt, kt, vt), dout.transpose(1, 2))
    return [out.transpose(1, 2)] + [g.transpose(1, 2) for g in grads]


MASK_CASES = ("causal", "window", "docs", "all")


def mask_spec(name, S):
    """(sorted ids (S,) int32 or None, window or None, softcap or None) of
    a causal mask case over S tokens: "causal" (none), "window" (S/4, 0),
    "docs" (8 equal packed documents), "all" (those two and softcap 30)."""
    import numpy as np

    if name not in MASK_CASES:
        raise ValueError(f"name: expected one of {MASK_CASES}, got {name!r}")
    ids = window = softcap = None
    if name in ("window", "all"):
        window = (S // 4, 0)
    if name in ("docs", "all"):
        ids = (np.arange(S) // max(1, S // MASKED_DOCS)).astype(np.int32)
    if name == "all":
        softcap = 30.0
    return ids, window, softcap


def mask_keywords(ids, window, softcap, B, to_device):
    """ringattn's mask keywords of a mask_spec for B rows; to_device turns
    the (B, S) int32 ids into an array on the GPU."""
    import numpy as np

    kw = {}
    if window is not None:
        kw["window"] = window
    if ids is not None:
        kw["segment_ids"] = to_device(np.repeat(ids[None], B, axis=0))
    if softcap is not None:
        kw["softcap"] = softcap
    return kw


def _masked_inputs(name, S, B=1, dev=None):
    """(mask keywords with the ids on the GPU, ids, window, softcap)."""
    dev = dev or _Device(_torch_or_none())
    ids, window, softcap = mask_spec(name, S)
    kw = mask_keywords(ids, window, softcap, B, dev.ids)
    return kw, ids, window, softcap


def _torch_or_none():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def accuracy_rows(dtypes, dims, dev=None, sizes=SIZES):
    """One row per (dtype, D, causal), and one masked row per dtype
    (masked_accuracy_row): errors of ringattn and torch math vs float64,
    and whether ringattn meets the rule (without PyTorch: the errors of
    ringattn vs the host's float64 reference, and TOL)."""
    import ringattn as ra

    dev = dev or _Device(_torch_or_none())
    rows = []
    B, S, H = sizes["accuracy"]
    for dtype in dtypes:
        for D in dims:
            for causal in (False, True):
                q, k, v, dout = dev.randn((B, S, H, D), dtype, D + causal)
                out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
                mine = [out] + list(ra.attention_backward(dout, q, k, v, out, lse,
                                                          causal=causal))
                if dev.torch is not None:
                    ref = _torch_attention(*(x.double() for x in (q, k, v, dout)), causal)
                    math = _torch_attention(q, k, v, dout, causal)
                    errs = _errors(mine, ref, math)
                    del ref, math
                else:
                    errs = _host_errors(dev, mine, (q, k, v, dout), dtype, causal=causal)
                ok = all(e[3] for e in errs)
                rows.append({"dtype": dtype, "D": D, "causal": causal, "errs": errs, "ok": ok})
                del q, k, v, dout, out, lse, mine
        rows.append(masked_accuracy_row(dtype, B, S, H, max(dims), dev))
    return rows


def _errors(mine, ref, math):
    """[(name, ringattn error, torch math error, meets the rule)] of out,
    dq, dk, dv against the float64 reference."""
    errs = []
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        r = ref[i]
        e_ra = (mine[i].double() - r).abs().max().item()
        e_pt = (math[i].double() - r).abs().max().item()
        rule = FWD_RULE if i == 0 else BWD_RULE
        floor = FLOOR * max(1.0, r.abs().max().item())
        errs.append((name, e_ra, e_pt, e_ra == e_ra and e_ra <= rule * e_pt + floor))  # NaN fails
    return errs


def _host_errors(dev, mine, inputs, dtype, **mask):
    """_errors without PyTorch: [(name, ringattn error, None, error <= TOL *
    max(1, max |ref|))] against ringattn.testing's float64 reference of the
    inputs as the kernels saw them (`mask`: causal, window, segment ids,
    softcap)."""
    import numpy as np

    from ringattn import testing

    q, k, v, dout = (dev.host(x) for x in inputs)
    ref_out, _ = testing.ref_attention(q, k, v, **mask)
    refs = [ref_out] + list(testing.ref_attention_backward(dout, q, k, v, **mask))
    errs = []
    for name, got, r in zip(("out", "dq", "dk", "dv"), mine, refs):
        e_ra = float(np.abs(dev.host(got) - r).max(initial=0.0))
        bound = TOL[dtype] * max(1.0, float(np.abs(r).max(initial=0.0)))
        errs.append((name, e_ra, None, e_ra == e_ra and e_ra <= bound))  # NaN fails
    return errs


def masked_accuracy_row(dtype, B, S, H, D, dev=None):
    """The accuracy row of one dtype with a window, packed documents and a
    softcap at once (causal), torch math given the same mask."""
    import ringattn as ra

    dev = dev or _Device(_torch_or_none())
    kw, ids, window, softcap = _masked_inputs("all", S, B, dev)
    q, k, v, dout = dev.randn((B, S, H, D), dtype, D + 7)
    q = dev.scaled(q, 3)  # scores that reach the cap
    out, lse = ra.attention(q, k, v, causal=True, return_lse=True, **kw)
    mine = [out] + list(ra.attention_backward(dout, q, k, v, out, lse, causal=True, **kw))
    if dev.torch is not None:
        visible = dev.torch.from_numpy(dense_mask(S, ids, window)).to("cuda")
        ref = _torch_attention(*(x.double() for x in (q, k, v, dout)), True, visible, softcap)
        math = _torch_attention(q, k, v, dout, True, visible, softcap)
        errs = _errors(mine, ref, math)
    else:
        import numpy as np

        seg = np.repeat(ids[None], B, axis=0)
        errs = _host_errors(dev, mine, (q, k, v, dout), dtype, causal=True,
                            segment_ids=seg, window=window, softcap=softcap)
    return {"dtype": dtype, "D": D, "causal": True, "mask": "window+docs+softcap",
            "errs": errs, "ok": all(e[3] for e in errs)}


@contextlib.contextmanager
def kernel_family(name):
    """RINGATTN_CUDA_KERNELS=name (read by ringattn at every call) inside
    the block, the caller's setting after it."""
    old = os.environ.get("RINGATTN_CUDA_KERNELS")
    os.environ["RINGATTN_CUDA_KERNELS"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["RINGATTN_CUDA_KERNELS"]
        else:
            os.environ["RINGATTN_CUDA_KERNELS"] = old


def forward_family():
    """The tensor-core family ringattn's forward runs here ("sm90a" or
    "sm80"; cuda_info())."""
    import ringattn as ra

    return ra.cuda_info().get("forward_kernels") or "sm80"


def backward_family():
    """The tensor-core family ringattn's backward runs here ("sm90a" or
    "sm80"; cuda_info())."""
    import ringattn as ra

    return ra.cuda_info().get("backward_kernels") or "sm80"


def _speed_one(dtype, D, S, causal, warmup, repeats, dev=None, sizes=SIZES):
    """{(pass, backend): ms} for one configuration (SDPA's backends only
    with PyTorch; backend "sm80": ringattn's mma.sync forward and backward,
    where the default family is sm90a; ("bwd", "det"): ringattn's backward
    with deterministic=True)."""
    import ringattn as ra

    dev = dev or _Device(_torch_or_none())
    H, B = sizes["hidden"] // D, max(1, sizes["tokens"] // S)
    q, k, v, dout = dev.randn((B, S, H, D), dtype, S + D)
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
    ms = {("fwd", "ra"): dev.time_ms(
              lambda: ra.attention(q, k, v, causal=causal, return_lse=True), warmup, repeats),
          ("bwd", "ra"): dev.time_ms(
              lambda: ra.attention_backward(dout, q, k, v, out, lse, causal=causal),
              warmup, repeats)}
    if forward_family() == "sm90a":
        with kernel_family("sm80"):
            ms[("fwd", "sm80")] = dev.time_ms(
                lambda: ra.attention(q, k, v, causal=causal, return_lse=True), warmup, repeats)
    if backward_family() == "sm90a":
        with kernel_family("sm80"):
            ms[("bwd", "sm80")] = dev.time_ms(
                lambda: ra.attention_backward(dout, q, k, v, out, lse, causal=causal),
                warmup, repeats)
    # deterministic=True (dq in a pass of its own: the same bits every run)
    ms[("bwd", "det")] = dev.time_ms(
        lambda: ra.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                      deterministic=True), warmup, repeats)
    if dev.torch is None:
        return ms
    for be in ("flash", "cudnn"):
        fwd, bwd = _sdpa_fns(q, k, v, dout, causal, be)
        if fwd is not None:
            ms[("fwd", be)] = _time_ms(fwd, warmup, repeats)
        if bwd is not None:
            ms[("bwd", be)] = _time_ms(bwd, warmup, repeats)
    return ms


def speed_rows(dtypes, dims, seqlens, warmup, repeats, echo=print, dev=None, sizes=SIZES):
    """One row per (pass, dtype, causal, D, S) with TFLOP/s of ringattn
    (its kernel family), ringattn's mma.sync kernels where that family is
    sm90a, SDPA flash and SDPA cuDNN (None where a backend cannot run), and
    for the backward ringattn's deterministic=True ("det", with its own
    "det_ms" and "det_model")."""
    dev = dev or _Device(_torch_or_none())
    fwd_family, bwd_family = forward_family(), backward_family()
    rows = []
    for dtype in dtypes:
        for D in dims:
            H = sizes["hidden"] // D
            for S in seqlens:
                B = max(1, sizes["tokens"] // S)
                for causal in (False, True):
                    ms = _speed_one(dtype, D, S, causal, warmup, repeats, dev, sizes)
                    dev.empty_cache()
                    flops = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
                    for pas, mult in (("fwd", 1.0), ("bwd", 2.5)):
                        tf = {name: (None if (pas, name) not in ms else
                                     flops * mult / (ms[(pas, name)] * 1e-3) / 1e12)
                              for name in ("ra", "sm80", "flash", "cudnn", "det")}
                        family = fwd_family if pas == "fwd" else bwd_family
                        row = {"pass": pas, "dtype": dtype, "causal": causal, "D": D, "S": S,
                               "B": B, "H": H, "family": family, **tf,
                               "ms": ms.get((pas, "ra")),
                               "model": model_prediction(pas, dtype, D, S, causal, B, H,
                                                         family)}
                        if pas == "bwd":
                            row["det_ms"] = ms.get(("bwd", "det"))
                            row["det_model"] = model_prediction(pas, dtype, D, S, causal, B,
                                                                H, family, deterministic=True)
                        rows.append(row)
                        echo(format_speed_row(row))
    return rows


SPEED_HEAD = (f"{'pass':4} {'dtype':8} {'causal':6} {'D':>4} {'S':>6} {'B':>3} {'H':>3} "
              f"{'family':>6} {'ringattn':>9} {'sm80':>9} {'flash':>9} {'cudnn':>9} "
              f"{'ra/flash':>8} {'ra ms':>8} {'model ms':>8} {'ra/model':>8} {'det':>9}  "
              "(TFLOP/s; ms)")


def model_prediction(pas, dtype, D, S, causal, B, H, family="sm80", deterministic=False):
    """The H100 model's seconds by kernel of the kernel family that ran
    (ringattn/bench/model.py), or None where it has no counts for them."""
    from . import model

    try:
        return model.predict(pas, dtype, D, S, causal, B, H, family=family,
                             deterministic=deterministic)
    except (OSError, ValueError, KeyError):
        return None


def format_speed_row(r):
    def fmt(x):
        return f"{x:9.1f}" if x is not None else f"{'-':>9}"

    ratio = f"{r['ra'] / r['flash']:8.2f}" if (r["ra"] and r["flash"]) else f"{'-':>8}"
    pred = r.get("model")
    ms = f"{r['ms']:8.3g}" if r.get("ms") else f"{'-':>8}"
    mdl = f"{pred['total'] * 1e3:8.3g}" if pred else f"{'-':>8}"
    vs = (f"{r['ms'] / (pred['total'] * 1e3):8.3g}" if (pred and r.get("ms"))
          else f"{'-':>8}")
    return (f"{r['pass']:4} {r['dtype']:8} {str(r['causal']):6} {r['D']:4d} {r['S']:6d} "
            f"{r['B']:3d} {r['H']:3d} {r.get('family', 'sm80'):>6} {fmt(r['ra'])} "
            f"{fmt(r.get('sm80'))} {fmt(r['flash'])} {fmt(r['cudnn'])} {ratio} "
            f"{ms} {mdl} {vs} {fmt(r.get('det'))}")


def format_model_rows(rows):
    """Per row the model's time of each kernel, and how the measured pass
    time compares: the lines that recalibrate the model after a GPU run (a
    backward row's deterministic=True pass on a line "model det" of its
    own, left out of the median)."""
    def line(r, label, pred, ms):
        kernels = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in pred.items() if k != "total")
        meas = f"; measured {ms:.3f} ms" if ms else ""
        return (f"model {label:4} {r['dtype']:8} {str(r['causal']):6} {r['D']:4d} "
                f"{r['S']:6d}: {kernels} ms{meas}")

    lines = []
    ratios = []
    for r in rows:
        pred = r.get("model")
        if not pred:
            continue
        lines.append(line(r, r["pass"], pred, r.get("ms")))
        if r.get("ms"):
            ratios.append(r["ms"] / (pred["total"] * 1e3))
        if r.get("det_model"):
            lines.append(line(r, "det", r["det_model"], r.get("det_ms")))
    if ratios:
        ratios.sort()
        lines.append(f"measured/model: median {ratios[len(ratios) // 2]:.2f}, "
                     f"range {ratios[0]:.2f}-{ratios[-1]:.2f} over {len(ratios)} rows "
                     "(0.92-1.13 on the H100 baseline the model is calibrated on)")
    return lines


def format_accuracy_row(r):
    parts = [f"{n} {a:.2e}/{'-' if b is None else f'{b:.2e}'}{'' if g else ' FAIL'}"
             for n, a, b, g in r["errs"]]
    mask = f" {r['mask']}" if r.get("mask") else ""
    return (f"{'ok  ' if r['ok'] else 'FAIL'} {r['dtype']:8} D={r['D']:<3d} "
            f"causal={str(r['causal']):5}{mask}  " + ", ".join(parts))


def masked_speed_rows(S, warmup, repeats, echo=print, dev=None, sizes=SIZES):
    """One row per mask case ("causal", "window", "docs") at bfloat16,
    D = 128, B = 1, H = 16, causal: the visible fraction, ringattn's and
    SDPA's times (ms) and TFLOP/s on the visible pairs (SDPA: flash for
    plain causal, the explicit boolean mask otherwise; None where it cannot
    run, e.g. out of memory, or without PyTorch)."""
    import ringattn as ra

    dev = dev or _Device(_torch_or_none())
    D, B = 128, 1
    H = max(1, sizes["hidden"] // D)
    q, k, v, dout = dev.randn((B, S, H, D), "bfloat16", S)
    rows = []
    for name in ("causal", "window", "docs"):
        kw, ids, window, _ = _masked_inputs(name, S, 1, dev)
        out, lse = ra.attention(q, k, v, causal=True, return_lse=True, **kw)
        ms = {("fwd", "ra"): dev.time_ms(
                  lambda: ra.attention(q, k, v, causal=True, return_lse=True, **kw),
                  warmup, repeats),
              ("bwd", "ra"): dev.time_ms(
                  lambda: ra.attention_backward(dout, q, k, v, out, lse, causal=True, **kw),
                  warmup, repeats)}
        if dev.torch is not None:
            torch = dev.torch
            mask = None
            try:
                if kw:
                    mask = torch.from_numpy(dense_mask(S, ids, window)).to("cuda")
                fwd, bwd = _sdpa_fns(q, k, v, dout, True, None if kw else "flash", mask)
                if fwd is not None:
                    ms[("fwd", "sdpa")] = _time_ms(fwd, warmup, repeats)
                if bwd is not None:
                    ms[("bwd", "sdpa")] = _time_ms(bwd, warmup, repeats)
            except RuntimeError:   # out of memory: the SDPA cells stay empty
                pass
            del mask
        dev.empty_cache()
        visible = visible_fraction(S, True, ids, window)
        flops = 4.0 * B * H * D * visible * S * S
        row = {"case": name, "S": S, "visible": visible}
        for pas, mult in (("fwd", 1.0), ("bwd", 2.5)):
            for who in ("ra", "sdpa"):
                t = ms.get((pas, who))
                row[f"{pas}_{who}_ms"] = t
                row[f"{pas}_{who}_tf"] = None if t is None else flops * mult / (t * 1e-3) / 1e12
        rows.append(row)
        echo(format_masked_row(row))
    return rows


MASKED_HEAD = (f"{'case':7} {'S':>6} {'visible':>7} {'fwd ms':>8} {'bwd ms':>8} "
               f"{'sdpa fwd':>8} {'sdpa bwd':>8} {'fwd TF/s':>8} {'bwd TF/s':>8} "
               f"{'sdpa fwd':>8} {'sdpa bwd':>8}")


def format_masked_row(r):
    def fmt(x, f):
        return f"{x:8{f}}" if x is not None else f"{'-':>8}"

    return (f"{r['case']:7} {r['S']:6d} {r['visible']:7.3f} "
            + " ".join(fmt(r[f"{p}_{w}_ms"], ".2f") for w in ("ra", "sdpa") for p in ("fwd", "bwd"))
            + " " + " ".join(fmt(r[f"{p}_{w}_tf"], ".1f") for w in ("ra", "sdpa")
                             for p in ("fwd", "bwd")))


def masked_summary(rows):
    """ "window 0.27/0.31, docs 0.14/0.16 of causal time (fwd/bwd)" """
    base = next((r for r in rows if r["case"] == "causal"), None)
    parts = []
    for r in rows:
        if r["case"] == "causal" or base is None:
            continue
        ratios = [r[f"{p}_ra_ms"] / base[f"{p}_ra_ms"] for p in ("fwd", "bwd")]
        parts.append(f"{r['case']} {ratios[0]:.2f}/{ratios[1]:.2f}")
    return ", ".join(parts) + " of causal time (fwd/bwd)" if parts else "n/a"


def speed_bars(rows):
    """min ra/flash ratio at D = 128, bfloat16, S >= 4096, per pass."""
    out = {}
    for pas in ("fwd", "bwd"):
        ratios = [r["ra"] / r["flash"] for r in rows
                  if r["pass"] == pas and r["D"] == 128 and r["dtype"] == "bfloat16"
                  and r["S"] >= 4096 and r["ra"] and r["flash"]]
        out[pas] = min(ratios) if ratios else None
    return out


def run(args=None) -> int:
    import ringattn as ra

    if not ra.cuda_available():
        why = f"no usable GPU: {ra.cuda_info()['reason']}"
        print(f"bench --gpu: {why}")
        print(f"bench-gpu: FAIL {why.split(':')[0]}")
        return 2
    info = ra.cuda_info()
    emulated = bool(info.get("emulated"))
    torch = _torch_or_none()
    if torch is None:
        try:
            import torch as _t  # noqa: F401
            alone = "PyTorch sees no CUDA device"
        except ImportError:
            alone = "PyTorch is not installed"
    dev = _Device(torch)
    sizes = EMULATED_SIZES if emulated else SIZES
    quick = bool(getattr(args, "quick", False))
    warmup = sizes["warmup"][quick]
    repeats = sizes["repeats"][quick]
    seq_arg = getattr(args, "seq_lens", "") or ""
    seqlens = tuple(int(s) for s in seq_arg.split(",") if s.strip()) or (
        sizes["quick_seqlens"] if quick else sizes["seqlens"])
    B_acc, S_acc, H_acc = sizes["accuracy"]
    tokens, hidden = sizes["tokens"], sizes["hidden"]

    if torch is not None:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"ringattn {ra.__version__}")
    else:
        print(f"device: {info.get('device_name') or 'CUDA device 0'}, ringattn {ra.__version__}")
        print(f"ringattn alone ({alone}): the SDPA and torch math columns are skipped (-), "
              f"inputs are uploaded with ra.to_device, times are synchronised wall times")
    if emulated:
        print("EMULATED GPU (RINGATTN_CUDA=emulate): the kernels run on the CPU, every size "
              "is cut to a tiny configuration, and the times say nothing about a GPU")
    if torch is not None:
        rule = (f"ringattn <= {FWD_RULE:g}x (out) / {BWD_RULE:g}x (grads) torch math + "
                f"{FLOOR:g} * max(1, max|ref|)")
        versus = "ringattn / torch math (same dtype)"
    else:
        rule = ("ringattn <= " + ", ".join(f"{t:g} ({d})" for d, t in TOL.items())
                + " * max(1, max|ref|)")
        versus = "ringattn / - (no torch math)"
    print(f"accuracy at S={S_acc}, B={B_acc}, H={H_acc}: max |err| vs float64, {versus}; "
          f"rule: {rule}")
    acc = accuracy_rows(DTYPES, HEAD_DIMS, dev, sizes)
    for r in acc:
        print(format_accuracy_row(r), flush=True)
    print()
    timer = "CUDA events" if torch is not None else "synchronised wall time"
    print(f"speed: B*S = {tokens}, H*D = {hidden}; median of {repeats} after {warmup} "
          f"warm-up calls, {timer}")
    print("TFLOP/s = flops / time, flops (flash-attention 2 convention): forward "
          "4*B*H*S^2*D, halved when causal; backward 2.5x the forward")
    fam, bfam = forward_family(), backward_family()
    print(f"family: the tensor-core kernels of the ringattn column (forward {fam}, backward "
          f"{bfam}); sm80: ringattn's mma.sync kernels in the same run"
          + ("" if "sm90a" in (fam, bfam) else " (- : the column is sm80 already)"))
    print(SPEED_HEAD)
    print("-" * len(SPEED_HEAD), flush=True)
    rows = speed_rows(DTYPES, HEAD_DIMS, seqlens, warmup, repeats,
                      echo=lambda line: print(line, flush=True), dev=dev, sizes=sizes)
    bars = speed_bars(rows)
    print()
    print("model: the H100 SXM performance model's time per kernel (docs/results.md; "
          "ringattn/bench/model.py, counts from tools/sass_report.py)"
          + (" -- the measured times here are not an H100's" if emulated else ""))
    for line in format_model_rows(rows):
        print(line, flush=True)
    S_masked = max(seqlens)
    H_masked = max(1, hidden // 128)
    print()
    sdpa = ("sdpa: flash for causal, the explicit boolean mask otherwise"
            if torch is not None else "no sdpa (no PyTorch)")
    print(f"masked: bfloat16, D=128, B=1, H={H_masked}, S={S_masked}, causal; window "
          f"({S_masked // 4}, 0) and {MASKED_DOCS} packed documents; {sdpa}; "
          "TFLOP/s on the visible pairs")
    print(MASKED_HEAD)
    print("-" * len(MASKED_HEAD), flush=True)
    masked = masked_speed_rows(S_masked, warmup, repeats,
                               echo=lambda line: print(line, flush=True), dev=dev, sizes=sizes)
    n_ok = sum(r["ok"] for r in acc)

    def bar(name, got, want):
        if got is None:
            return f"{name} ra/flash n/a"
        return f"{name} ra/flash {got:.2f} ({'meets' if got >= want else 'below'} {want})"

    notes = ([] if torch is not None else ["no PyTorch: SDPA columns skipped"]) + (
        ["EMULATED GPU, tiny sizes: times are not GPU times"] if emulated else [])
    print(f"bench-gpu: accuracy {'PASS' if n_ok == len(acc) else 'FAIL'} "
          f"({n_ok}/{len(acc)}); D128 bf16 S>=4k: "
          f"{bar('fwd', bars['fwd'], FWD_BAR)}, {bar('bwd', bars['bwd'], BWD_BAR)}; "
          f"masked S={S_masked}: {masked_summary(masked)}"
          + "".join(f"; {n}" for n in notes))
    return 0 if n_ok == len(acc) else 1


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seq-lens", dest="seq_lens", default="")
    sys.exit(run(ap.parse_args()))
