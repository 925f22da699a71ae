"""The branch rule of the CUDA backward kernels (``_C.attn_bwd(...,
branches=, branch_head=, branch_head_stride=)``), against the CPU and a
float64 reference.

A call is one branch (segment length w, rate r) of LongNet dilated attention
for one dilation offset o, as a composition of dense kernels runs it: the
rows at positions o, o + r, ... (strided positions), the heads o, o + r, ...
(branch_head=o, branch_head_stride=r), documents = the branch's segments,
causal or not, and the FINAL lse and out of the dilated attention over all
branches.  Scores are huge (~1e7 and more), so every row's |lse log2 e| is
far beyond 2^13 and its band wider than log2(3): a row's dominant key reads
as P = 1 there, and a pair c branches share must read as P = 1/c (DESIGN 2,
"Dilated attention").  The
reference computes P = exp(s - lse) in float64 with the exact lse (log
multiplicity included), so it holds 1/c by itself; without the rule the
kernels give dv and dk errors of the size of |dout| and the tests fail.

out is moved off the forward's (delta = rowsum(dout out) then leaves dP -
delta nonzero at a row's key, so dq and dk show its P too).

Tolerance: ``ringattn.testing.tolerance(dtype)`` rtol (twice it for the
tensor-core kernels, which round P and dS to 16 bits) times the larger of
max |ref| and the largest sum of |terms| of the gradient (the reference's
own, as tests/test_huge_scores.py bounds them: dq and dk sum terms of
~|k| and ~|q|, huge here).
"""

import numpy as np
import pytest

ra = pytest.importorskip("ringattn")
rt = pytest.importorskip("ringattn.testing")

from gpu_arrays import CUDA, ids_to_device, to_device, to_host  # noqa: E402
from ringattn import _C  # noqa: E402

# three branches; for head 0 position 8 is selected by all three, (8, 10)
# by the first two: pairs shared by 2 and 3 branches
SEGS, RATES = [4, 8, 16], [1, 2, 4]
N = 38          # global positions; a rate-2 branch holds 19 rows
H = 4           # global query heads (= kv heads)
# factors on (q, k): scores ~1e7 or more, so that every row is one key and
# the band (16 ulps of |lse log2 e|, 2^-19 |lse log2 e|) is wider than
# log2(3): a key that 2 or 3 branches share snaps, and only the branch rule
# gives it P = 1/c (checked for every row); 16-bit q and k stay below 65504
HUGE = {"float16": (3e3, 3e3), "bfloat16": (3e3, 3e3), "float32": (1e9, 1.0)}


def problem(dtype, D, causal, seed):
    rng = np.random.default_rng(seed)
    # 1 + 0.3 N(0, 1): every score is large and positive, so that no row
    # (a causal one with few keys among them) falls short of the band
    q, k = ((1 + 0.3 * np.clip(rng.standard_normal((1, N, H, D)), -4, 4)) * f
            for f in HUGE[dtype])
    v, dout = (rng.standard_normal((1, N, H, D)) for _ in range(2))
    cast = lambda x: x.astype(rt.np_dtype(dtype)).astype(np.float64)
    q, k, v, dout = map(cast, (q, k, v, dout))
    # the final out and lse over all branches, as the CPU forward stores
    # them (float32 lse), and the exact lse in float64
    out, lse = ra.dilated_attention(*(x.astype(rt.np_dtype(dtype)) for x in (q, k, v)),
                                    SEGS, RATES, causal=causal, return_lse=True)
    pos = np.arange(N)
    bias = rt.dilated_bias(N, SEGS, RATES, H)
    _, lse64 = rt.ref_attention(q, k, v, causal=causal, q_pos=pos, k_pos=pos, bias=bias)
    # out as the kernels take it, moved off the forward's (delta = rowsum(dout
    # out)): with the true out a one-key row's dP - delta is 0 at its key, and
    # dq, dk would not show P there
    out = rt.to_numpy(out).astype(np.float64) + 0.5 * rng.standard_normal(out.shape)
    out = out.astype(rt.np_dtype(dtype)).astype(np.float64)
    return q, k, v, dout, out, rt.to_numpy(lse), lse64


def branch_reference(q, k, v, dout, out, lse64, w, r, o, causal):
    """float64 gradients of branch (w, r), offset o: the dense backward over
    the pairs it selects with the final (exact) lse; delta from out."""
    D = q.shape[-1]
    scale = 1 / np.sqrt(D)
    pos = np.arange(o, N, r)
    seg = pos // w
    vis = seg[:, None] == seg[None, :]
    if causal:
        vis &= pos[None, :] <= pos[:, None]
    grads = [np.zeros((1, len(pos), H // r, D)) for _ in range(3)]
    terms = [0.0, 0.0, 0.0]   # the largest sum of |terms| of each gradient
    for j, h in enumerate(range(o, H, r)):
        qh, kh, vh, dh = (x[0, pos, h] for x in (q, k, v, dout))
        s = scale * qh @ kh.T
        with np.errstate(under="ignore", over="ignore"):
            p = np.where(vis, np.exp(s - lse64[0, h, pos][:, None]), 0.0)
        delta = (dout[0, pos, h] * out[0, pos, h]).sum(-1)
        ds = p * (dh @ vh.T - delta[:, None])
        grads[0][0, :, j] = scale * ds @ kh
        grads[1][0, :, j] = scale * ds.T @ qh
        grads[2][0, :, j] = p.T @ dh
        for n, t in enumerate((scale * np.abs(ds) @ np.abs(kh), scale * np.abs(ds).T @ np.abs(qh),
                               p.T @ np.abs(dh))):
            terms[n] = max(terms[n], float(t.max()))
    return grads, terms


def check(got, ref, terms, dtype, slack=1):
    terms = dict(zip(("dq", "dk", "dv"), terms))
    rtol, atol = rt.tolerance(dtype)
    rtol *= slack
    bad = []
    for name, a, b in zip(("dq", "dk", "dv"), got, ref):
        a = to_host(a)
        if not np.isfinite(a).all():
            bad.append(f"{name}: non-finite values")
            continue
        err = float(np.abs(a - b).max())
        bound = atol + rtol * max(float(np.abs(b).max()), terms[name])
        if not err <= bound:
            bad.append(f"{name}: max error {err:.3e} > {bound:.3e}")
    return bad


def run_branch(dtype, D, causal, w, r, o, device, deterministic, seed=0):
    q, k, v, dout, out, lse, lse64 = problem(dtype, D, causal, seed)
    pos = np.arange(o, N, r)
    heads = list(range(o, H, r))
    # the rule matters where the band holds -log2(c): every row's does (where
    # the band is about as wide as the lse's rounding, x = -log2(c) may land
    # on either side of it; the rule promises nothing there)
    l2 = np.abs(lse[0][heads][:, pos]) * np.log2(np.e)
    assert (l2 * 2.0 ** -19 >= 4).all(), "the band is too narrow for the rule"
    pick = lambda x: np.ascontiguousarray(x[:, pos][:, :, heads])
    qb, kb, vb, db, ob = map(pick, (q, k, v, dout, out))
    lb = np.ascontiguousarray(lse[:, heads][:, :, pos]).astype(np.float32)
    ids = (pos // w).astype(np.int32)[None]
    if device:
        put = lambda x: to_device(x, dtype, "ra")
        args = [put(x) for x in (db, qb, kb, vb, ob)] + [ra.to_device(lb, "cuda:0")]
        ids = ids_to_device(ids, "ra")
    else:
        args = [x.astype(rt.np_dtype(dtype)) for x in (db, qb, kb, vb, ob)] + [lb]
    got = _C.attn_bwd(*args, causal=causal, deterministic=deterministic,
                      q_pos_offset=int(o), q_pos_stride=r, k_pos_offset=int(o), k_pos_stride=r,
                      branches=(SEGS, RATES), branch_head=o, branch_head_stride=r,
                      segment_ids=ids)
    ref, terms = branch_reference(q, k, v, dout, out, lse64, w, r, o, causal)
    return [to_host(g) for g in got], ref, terms


# (dtype, D, deterministic): the fused tensor-core pass (of the device's
# family: test_branch_rule_on_each_tensor_core_kernel runs each), the split
# tensor-core pair, the generic kernels
FAMILIES = [("float16", 64, False), ("bfloat16", 64, True), ("float32", 24, True)]


@pytest.mark.parametrize("dtype,D,det", FAMILIES, ids=["fused", "split", "generic"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("o", [0, 1])
def test_cpu_branch_rule_with_head_stride(dtype, D, det, causal, o):
    """The CPU backward's rule with strided heads (branch_head_stride) and
    positions, documents and causal, against the float64 reference."""
    w, r = SEGS[1], RATES[1]
    cpu, ref, terms = run_branch(dtype, D, causal, w, r, o, False, det, seed=o)
    bad = check(cpu, ref, terms, dtype)
    assert not bad, "CPU vs float64:\n" + "\n".join(bad)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device (real or emulated)")
@pytest.mark.parametrize("dtype,D,det", FAMILIES, ids=["fused", "split", "generic"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("o", [0, 1])
def test_branch_rule_matches_cpu_and_reference(dtype, D, det, causal, o):
    w, r = SEGS[1], RATES[1]   # the rate-2 branch: strided rows and heads
    got, ref, terms = run_branch(dtype, D, causal, w, r, o, True, det, seed=o)
    cpu, _, _ = run_branch(dtype, D, causal, w, r, o, False, det, seed=o)
    # the tensor-core kernels round P and dS to the 16-bit mma operands
    # (the CPU keeps them in float32): twice the tolerance for them
    slack = 2 if D in (64, 128) else 1
    bad = check(got, ref, terms, dtype, slack)
    assert not bad, "CUDA vs float64:\n" + "\n".join(bad)
    bad = check(cpu, ref, terms, dtype)
    assert not bad, "CPU vs float64:\n" + "\n".join(bad)
    bad = check(got, cpu, terms, dtype, slack)
    assert not bad, "CUDA vs CPU:\n" + "\n".join(bad)


def bwd_counts():
    return _C.cuda_bwd_kernel_counts()


# the 16-bit backward of each tensor-core family the device has: "sm90a"
# (the wgmma kernel, the default on the Hopper family; deterministic=True
# its dk/dv pass) and "sm80" (the fused mma.sync kernel, or the split
# pair, forced there)
FUSED = (["sm90a", "sm80"] if CUDA and ra.cuda_info()["backward_kernels"] == "sm90a"
         else ["sm80"])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device (real or emulated)")
@pytest.mark.parametrize("kernel", FUSED)
@pytest.mark.parametrize("dtype,D", [("bfloat16", 128), ("float16", 64)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("det", [False, True], ids=["fused", "deterministic"])
def test_branch_rule_on_each_tensor_core_kernel(monkeypatch, kernel, dtype, D, causal, det):
    """The rule in each family's backward, fused and deterministic (the
    kernel that ran checked), against the float64 reference and the CPU;
    offset 1 (strided heads from 1)."""
    if kernel == ra.cuda_info()["backward_kernels"]:
        monkeypatch.delenv("RINGATTN_CUDA_KERNELS", raising=False)
    else:
        monkeypatch.setenv("RINGATTN_CUDA_KERNELS", kernel)
    w, r, o = SEGS[1], RATES[1], 1
    before = bwd_counts()
    got, ref, terms = run_branch(dtype, D, causal, w, r, o, True, det, seed=D + causal)
    after = bwd_counts()
    assert after[kernel] == before[kernel] + 1, (before, after)
    monkeypatch.delenv("RINGATTN_CUDA_KERNELS", raising=False)
    cpu, _, _ = run_branch(dtype, D, causal, w, r, o, False, det, seed=D + causal)
    bad = check(got, ref, terms, dtype, 2)
    assert not bad, "CUDA vs float64:\n" + "\n".join(bad)
    bad = check(got, cpu, terms, dtype, 2)
    assert not bad, "CUDA vs CPU:\n" + "\n".join(bad)


def test_branch_head_stride_checks():
    x = np.zeros((1, 3, 2, 8), np.float32)
    lse = np.zeros((1, 2, 3), np.float32)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="branch_head_stride: expected >= 1"):
            _C.attn_bwd(x, x, x, x, x, lse, branches=([4], [2]), branch_head_stride=bad)
    with pytest.raises(TypeError):
        _C.attn_bwd(x, x, x, x, x, lse, branches=([4], [2]), branch_head_stride=1.5)
    with pytest.raises(ValueError, match="window or softcap"):
        _C.attn_bwd(x, x, x, x, x, lse, branches=([4], [2]), softcap=5.0)
