"""LongNet dilated attention on CUDA arrays (cuda/attn_dilated.cu).

Every test carries the ``gpu`` marker.  ``ra.dilated_attention`` and its
backward run on device arrays (ringattn's own, and PyTorch/CuPy ones where
there) and are compared with the float64 references of
``ringattn.testing`` (``ref_dilated_attention(_backward)``) on host copies
of the very inputs the kernels saw, and with the CPU kernels.  The
configurations cover each way the composition selects rows: a segment
length divisible by the rate (one strided call per offset, documents keep
pairs inside a segment), a rate at or past the segment length (one row per
segment), neither (one call per segment), several branches sharing pairs,
and GQA groups the strided heads map directly or only head by head.

Tolerance: test_cuda.py's, max |got - ref| <= tol * max(1, max |ref|) with
tol 2e-2 bfloat16, 5e-3 float16, 1e-4 float32, 1e-9 float64; huge scores:
test_huge_scores.py's rule (relative to the terms a gradient sums).
"""
import numpy as np
import pytest

ra = pytest.importorskip("ringattn")
testing = pytest.importorskip("ringattn.testing")

pytestmark = pytest.mark.gpu

from gpu_arrays import CUDA, backends_for, emu_subset, to_device, to_host  # noqa: E402

if not CUDA:
    pytest.skip(f"no CUDA device: {ra.cuda_info()['reason']}", allow_module_level=True)

from test_cuda import close  # noqa: E402  (test_cuda.py's tolerance)
import test_huge_scores as huge  # noqa: E402

CONFIGS = {  # name: (segment_lengths, dilation_rates)
    "w%r=0": ([8], [2]),
    "r>=w": ([5], [7]),
    "w%r!=0": ([7], [3]),
    "longnet": ([4, 8, 16], [1, 2, 4]),
}
HEADS = [(4, 4), (4, 2), (6, 3), (4, 1)]   # (H, H_kv): strided and per-head kv maps


def problem(seed, B, n, H, Hkv, D, dtype, backend):
    rng = np.random.default_rng(seed)
    arrays = [to_device(rng.standard_normal(s), dtype, backend)
              for s in [(B, n, H, D), (B, n, Hkv, D), (B, n, Hkv, D), (B, n, H, D)]]
    return arrays, [to_host(x) for x in arrays]


def run(arrays, segs, rates, causal):
    q, k, v, dout = arrays
    out, lse = ra.dilated_attention(q, k, v, segs, rates, causal=causal, return_lse=True)
    grads = ra.dilated_attention_backward(dout, q, k, v, out, lse, segs, rates, causal=causal)
    return (out, lse) + tuple(grads)


def reference(host, segs, rates, causal):
    q, k, v, dout = host
    out, lse = testing.ref_dilated_attention(q, k, v, segs, rates, causal=causal)
    grads = testing.ref_dilated_attention_backward(dout, q, k, v, segs, rates, causal=causal)
    return (out, lse) + tuple(grads)


def check_all(got, ref, dtype):
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        try:
            close(g, e, "float32" if name == "lse" and dtype != "float64" else dtype)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None


GRID = [pytest.param(cfg, H, Hkv, causal, id=f"{cfg}-{H}x{Hkv}-{'causal' if causal else 'full'}")
        for cfg in CONFIGS for H, Hkv in HEADS for causal in (False, True)
        if causal or (H, Hkv) in ((4, 2), (6, 3))]


@pytest.mark.parametrize("cfg,H,Hkv,causal", GRID)
def test_dilated_float32_matches_reference(cfg, H, Hkv, causal):
    """The generic kernels (float32), every way of selecting rows."""
    segs, rates = CONFIGS[cfg]
    arrays, host = problem(1, 2, 37, H, Hkv, 8, "float32", "ra")
    check_all(run(arrays, segs, rates, causal), reference(host, segs, rates, causal),
              "float32")


@pytest.mark.parametrize("backend", backends_for(["ra", "torch"]))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("cfg", ["w%r=0", "longnet"])
def test_dilated_tensor_cores_match_reference(cfg, dtype, backend):
    """16-bit, head_dim 64: the tensor-core forward and backward under
    strided rows and heads, document ids and positions."""
    segs, rates = CONFIGS[cfg]
    arrays, host = problem(2, 1, 45, 4, 2, 64, dtype, backend)
    check_all(run(arrays, segs, rates, True), reference(host, segs, rates, True), dtype)


@pytest.mark.parametrize("dtype", ["float64", pytest.param("float32", marks=emu_subset())])
def test_dilated_wide_matches_reference(dtype):
    """A longer sequence over several segments of every branch."""
    segs, rates = [16, 32], [1, 4]
    arrays, host = problem(3, 1, 83, 8, 2, 16, dtype, "ra")
    check_all(run(arrays, segs, rates, False), reference(host, segs, rates, False), dtype)


def test_dilated_matches_the_cpu_kernels():
    """The same inputs through the CPU kernels: out, lse and the gradients
    agree within twice the tolerance (each is within it of the reference)."""
    segs, rates = [6, 12], [1, 3]
    arrays, host = problem(4, 2, 29, 6, 2, 16, "float32", "ra")
    got = run(arrays, segs, rates, True)
    cpu = run([x.astype(np.float32) for x in host], segs, rates, True)
    for name, g, c in zip(("out", "lse", "dq", "dk", "dv"), got, cpu):
        g, c = to_host(g), np.asarray(c, np.float64)
        fin = np.isfinite(c)
        assert np.array_equal(np.isfinite(g), fin), name
        err = np.abs(g[fin] - c[fin]).max(initial=0.0)
        assert err <= 2e-4 * max(1.0, np.abs(c[fin]).max(initial=0.0)), (name, err)


def test_rows_no_branch_selects_are_empty():
    """A rate past the heads leaves rows alone: out 0, lse -inf, grads 0."""
    segs, rates = [4], [3]        # head 0 selects offset 0 only; n = 10
    arrays, host = problem(5, 1, 10, 1, 1, 8, "float32", "ra")
    got = [to_host(x) for x in run(arrays, segs, rates, False)]
    unselected = [i for i in range(10) if (i % 4) % 3 != 0]
    assert np.all(got[0][:, unselected] == 0)
    assert np.all(np.isneginf(got[1][:, :, unselected]))
    assert np.all(got[2][:, unselected] == 0) and np.all(got[3][:, unselected] == 0)
    check_all(got, reference(host, segs, rates, False), "float32")


def test_running_state_and_positions():
    """_C.dilated_fwd with position offsets, then continuing its float32
    running state (the dilated ring's local steps): keys in two chunks."""
    from ringattn import _C
    segs, rates = [8, 16], [1, 2]
    arrays, host = problem(6, 1, 24, 4, 2, 16, "float32", "ra")
    q, k, v, _ = arrays
    out = to_device(np.zeros((1, 12, 4, 16)), "float32", "ra")
    lse = to_device(np.zeros((1, 4, 12)), "float32", "ra")
    for lo in (0, 12):   # queries 12..23; keys 0..11, then 12..23
        _C.dilated_fwd(q.narrow(1, 12, 12), k.narrow(1, lo, 12), v.narrow(1, lo, 12),
                       segs, rates, causal=True, out=out, lse=lse, accumulate=lo > 0,
                       q_pos_offset=12, k_pos_offset=lo)
    ref_out, ref_lse = testing.ref_dilated_attention(*host[:3], segs, rates, causal=True)
    close(out, ref_out[:, 12:], "float32")
    close(lse, ref_lse[:, :, 12:], "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dilated_backward_with_huge_scores(dtype):
    """Pairs two branches share, rows whose scores are ~1e9: each branch's
    share of P is 1/2 (the backward's branch rule), as on the CPU."""
    q, k, v, dout = huge.problem(dtype, n=16)
    dev = [to_device(np.asarray(x, np.float64), dtype, "ra") for x in (q, k, v, dout)]
    got = run(dev, huge.SEGS, huge.RATES, True)
    bias = testing.dilated_bias(16, huge.SEGS, huge.RATES, q.shape[2])
    bad = huge.check(tuple(to_host(x) for x in got), q, k, v, dout, dtype, bias=bias)
    assert not bad, "\n".join(bad)
