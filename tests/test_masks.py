"""Masks (documents, windows, soft-capping) in ra.attention / attention_backward
against the float64 reference (ringattn.testing.ref_attention[_backward] with
segment_ids, kv_segment_ids, window, softcap).

Tolerance: ``testing.tolerance(dtype)``, max |got - ref| <= atol + rtol *
max |ref| (lse at the float32 tolerance, float64 for float64), except that a
gradient is measured against the larger of its own size and dv's: where a
rule leaves each row one key (window (0, 0), length-1 documents) the exact
dq and dk are 0 and all that remains is the rounding of dP - delta, whose
size is dout's, as dv's is.  Backward references take delta from the `out`
handed to the kernel, as in test_attention.py.

The grid pairs every mask case with causal on/off, S_q == S_k and S_q !=
S_k (bottom-right alignment), GQA, odd sizes, and every dtype; larger sizes
(1023 rows) and the accumulate mode with position offsets (a key split into
two calls, as the ring makes them) come after.
"""

import numpy as np
import pytest

import ringattn as ra
from ringattn import _C
from ringattn import testing as rt

DTYPES = ["float32", "float64", "float16", "bfloat16"]


def lse_dtype(dtype):
    return "float64" if dtype == "float64" else "float32"


def sorted_docs(rng, B, n, short=True):
    """(B, n) int32 sorted ids of random documents, with length-1 documents
    among them when `short`."""
    ids = np.zeros((B, n), np.int32)
    for b in range(B):
        cuts = sorted(set(rng.integers(1, max(n, 2), size=max(1, n // 9))))
        if short and n > 3:
            cuts += [n // 2, n // 2 + 1]      # a document of one token
        ids[b] = np.searchsorted(np.array(sorted(set(cuts))), np.arange(n),
                                 side="right")
    return ids


def mask_case(name, rng, B, S_q, S_k):
    """Keyword arguments of `attention` for the mask case `name`."""
    n = max(S_q, S_k)
    if name == "docs":                       # packed documents, sorted ids
        if S_q == S_k:
            return {"segment_ids": sorted_docs(rng, B, S_q)}
        return {"segment_ids": sorted_docs(rng, B, S_q),
                "kv_segment_ids": sorted_docs(rng, B, S_k)}
    if name == "docs-few-unsorted":          # ids in no order, int64
        return {"segment_ids": rng.integers(0, 3, (B, S_q)),
                "kv_segment_ids": rng.integers(0, 3, (B, S_k))}
    if name == "docs-many":                  # mostly length-1 documents
        return {"segment_ids": rng.integers(0, max(2, S_q), (B, S_q)).astype(np.int32),
                "kv_segment_ids": rng.integers(0, max(2, S_q), (B, S_k)).astype(np.int16)}
    if name.startswith("window"):
        window = {"window00": (0, 0), "window10": (1, 0), "window01": (0, 1),
                  "window-asym": (5, 17), "window-wide": (n + 9, n + 3),
                  "window-left-none": (None, 3),
                  "window-right-none": (4, None)}[name]
        return {"window": window}
    if name == "softcap":
        return {"softcap": 2.5}
    if name == "all":
        return {"segment_ids": sorted_docs(rng, B, S_q, short=False),
                "kv_segment_ids": sorted_docs(rng, B, S_k, short=False),
                "window": (9, 2), "softcap": 4.0}
    raise AssertionError(name)


CASES = ["docs", "docs-few-unsorted", "docs-many", "window00", "window10",
         "window01", "window-asym", "window-wide", "window-left-none",
         "window-right-none", "softcap", "all"]

# (B, S_q, S_k, H, H_kv, D)
SHAPES = [
    pytest.param((1, 1, 1, 2, 1, 8), id="S1"),
    pytest.param((2, 7, 7, 4, 2, 16), id="S7-gqa2"),
    pytest.param((1, 113, 113, 4, 1, 32), id="S113-mqa"),
    pytest.param((2, 7, 130, 2, 2, 8), id="Sq7-Sk130"),
    pytest.param((1, 130, 40, 4, 2, 24), id="Sq130-Sk40-gqa2"),
]


def assert_grads_close(got, ref, dtype):
    """dq, dk, dv each within tolerance of the larger of its own size and
    dv's (see the module docstring)."""
    rtol, atol = rt.tolerance(dtype)
    floor = float(np.abs(rt.to_numpy(ref[2])).max()) if ref[2].size else 0.0
    for name, a, r in zip(("dq", "dk", "dv"), got, ref):
        a, r = rt.to_numpy(a), rt.to_numpy(r)
        assert np.isfinite(a).all(), f"{name}: not finite"
        err, where, ref_max = rt.max_error(a, r)
        bound = atol + rtol * max(ref_max, floor)
        assert err <= bound, (f"{name}: max abs error {err:.3e} at {where} "
                              f"exceeds {bound:.3e} [{dtype}]")


def check(q, k, v, dtype, causal, masks, rng, q_factor=1.0):
    """Forward and backward of attention with `masks` against the reference."""
    if q_factor != 1.0:
        q = (rt.to_numpy(q) * q_factor).astype(rt.np_dtype(dtype))
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True, **masks)
    ref_out, ref_lse = rt.ref_attention(q, k, v, causal=causal, **masks)
    rt.assert_close(out, ref_out, dtype, name="out")
    rt.assert_close(lse, ref_lse, lse_dtype(dtype), name="lse")
    dout = rng.standard_normal(out.shape).astype(rt.np_dtype(dtype))
    grads = ra.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                  **masks)
    ref = rt.ref_attention_backward(dout, q, k, v, causal=causal, out=out,
                                    **masks)
    assert_grads_close(grads, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", CASES)
def test_masks_match_reference(rng, case, shape, causal, dtype):
    q, k, v = rt.random_qkv(rng, *shape, dtype)
    masks = mask_case(case, rng, shape[0], shape[1], shape[2])
    check(q, k, v, dtype, causal, masks, rng,
          q_factor=3.0 if case in ("softcap", "all") else 1.0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case,causal", [
    ("docs", True), ("docs-few-unsorted", False), ("window-asym", True),
    ("window10", False), ("all", True), ("softcap", False)])
def test_masks_at_1023_rows(rng, case, causal, dtype):
    shape = (1, 1023, 1023, 2, 1, 32)
    q, k, v = rt.random_qkv(rng, *shape, dtype)
    masks = mask_case(case, rng, 1, 1023, 1023)
    if case == "window-asym":
        masks = {"window": (200, 61)}       # spans several key blocks
    check(q, k, v, dtype, causal, masks, rng)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_factor", [30.0, 1e4])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_with_large_scores(rng, causal, q_factor, dtype):
    """q scaled by 30 and 1e4: most capped scores sit at +-softcap, the
    result is finite and right.  For q * 1e4 a float32 score carries the
    rounding of terms of size ~1e4 (~1e-3 absolute), which moves the
    probability of a key near the cap's knee by as much: there the float32
    kernel is held to 10x the float32 tolerance (3.3x seen over 20 seeds;
    still inside the float16 one); float64 and the 16-bit dtypes keep
    theirs."""
    shape = (2, 113, 130, 4, 2, 16)
    q, k, v = rt.random_qkv(rng, *shape, dtype)
    q = (rt.to_numpy(q) * q_factor).astype(rt.np_dtype(dtype))
    masks = {"softcap": 30.0, "window": (40, 5) if causal else None}
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True, **masks)
    assert np.isfinite(rt.to_numpy(out)).all()
    assert np.isfinite(rt.to_numpy(lse)).all()
    ref_out, ref_lse = rt.ref_attention(q, k, v, causal=causal, **masks)
    dout = rng.standard_normal(out.shape).astype(rt.np_dtype(dtype))
    grads = ra.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                  **masks)
    ref = rt.ref_attention_backward(dout, q, k, v, causal=causal, out=out,
                                    **masks)
    loose = dtype == "float32" and q_factor > 100
    rtol, atol = rt.tolerance(dtype)
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv"),
                          (out, lse) + tuple(grads), (ref_out, ref_lse) + ref):
        a, r = rt.to_numpy(a), rt.to_numpy(r)
        assert np.isfinite(a).all(), name
        tol_rtol = rtol * (10 if loose else 1)
        if name == "lse":
            tol_rtol, atol_ = rt.tolerance(lse_dtype(dtype))
            tol_rtol *= 10 if loose else 1
        else:
            atol_ = atol
        err, where, ref_max = rt.max_error(a, r)
        floor = np.abs(rt.to_numpy(ref[2])).max() if name in ("dq", "dk") else 0
        bound = atol_ + tol_rtol * max(ref_max, floor)
        assert err <= bound, f"{name}: error {err:.3e} at {where} > {bound:.3e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [1e-30, 1e30])
def test_softcap_at_the_ends_of_its_range(rng, softcap, dtype):
    """The smallest cap flattens every row to the mean of v (scores ~0),
    the largest is no cap: both right, in every dtype (outside the range a
    float32 cap rounds to 0 or infinity; the argument checks refuse it)."""
    q, k, v = rt.random_qkv(rng, 2, 37, 41, 4, 2, 16, dtype)
    check(q, k, v, dtype, True, {"softcap": softcap}, rng)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", ["docs", "window-asym", "window-left-none",
                                  "window-right-none", "softcap", "all"])
@pytest.mark.parametrize("q_offset", [None, 40, -30, 500])
def test_split_keys_with_offsets(rng, case, causal, dtype, q_offset):
    """Keys split into two accumulate calls with k_pos_offset (and each
    piece's kv ids), as the ring calls the kernels, give what one call
    gives, forward and backward."""
    B, S_q, S_k, H, H_kv, D = 2, 77, 130, 4, 2, 16
    cut = 57
    q, k, v = rt.random_qkv(rng, B, S_q, S_k, H, H_kv, D, dtype)
    masks = mask_case(case, rng, B, S_q, S_k)
    q_ids, kv_ids = masks.get("segment_ids"), masks.get("kv_segment_ids")
    rest = {key: masks[key] for key in ("window", "softcap") if key in masks}
    acc = lse_dtype(dtype)
    q_pos0 = S_k - S_q if q_offset is None else q_offset
    q_pos = np.arange(S_q) + q_pos0
    pieces = [(0, cut), (cut, S_k)]

    def piece_masks(a, b):
        if q_ids is None:
            return dict(rest)
        return dict(rest, segment_ids=q_ids, kv_segment_ids=kv_ids[:, a:b])

    out = np.empty((B, S_q, H, D), acc)
    lse = np.empty((B, H, S_q), acc)
    _C.init_state(out, lse)
    for a, b in pieces:
        _C.attn_fwd(q, k[:, a:b], v[:, a:b], causal=causal, out=out, lse=lse,
                    accumulate=True, q_pos_offset=q_pos0, k_pos_offset=a,
                    **piece_masks(a, b))
    whole_out, whole_lse = _C.attn_fwd(
        q, k, v, causal=causal, out=np.empty((B, S_q, H, D), acc),
        q_pos_offset=q_pos0, **masks)
    ref_out, ref_lse = rt.ref_attention(q, k, v, causal=causal, q_pos=q_pos,
                                        k_pos=np.arange(S_k), **masks)
    rt.assert_close(out, ref_out, acc, name="out")
    rt.assert_close(lse, ref_lse, acc, name="lse")
    rt.assert_close(out, rt.to_numpy(whole_out), acc, name="out, one call")
    rt.assert_close(lse, rt.to_numpy(whole_lse), acc, name="lse, one call")

    dout = rng.standard_normal(q.shape).astype(rt.np_dtype(dtype))
    o = out.astype(rt.np_dtype(dtype))
    grads = [np.zeros(x.shape, acc) for x in (q, k, v)]
    for a, b in pieces:
        _C.attn_bwd(dout, q, k[:, a:b], v[:, a:b], o, lse, causal=causal,
                    dq=grads[0], dk=grads[1][:, a:b], dv=grads[2][:, a:b],
                    accumulate=True, q_pos_offset=q_pos0, k_pos_offset=a,
                    **piece_masks(a, b))
    ref = rt.ref_attention_backward(dout, q, k, v, causal=causal, q_pos=q_pos,
                                    k_pos=np.arange(S_k), out=o, **masks)
    assert_grads_close(grads, ref, acc)
    whole = [np.empty(x.shape, acc) for x in (q, k, v)]
    _C.attn_bwd(dout, q, k, v, o, lse, causal=causal, dq=whole[0],
                dk=whole[1], dv=whole[2], q_pos_offset=q_pos0, **masks)
    assert_grads_close(grads, whole, acc)


def test_rows_that_see_nothing_give_zero_and_minus_inf(rng):
    """Queries whose document has no key, or whose window holds no key:
    out 0, lse -inf, gradients 0, never NaN."""
    q, k, v = rt.random_qkv(rng, 1, 9, 12, 2, 1, 8, "float32")
    ids = np.array([[0, 0, 5, 5, 1, 1, 7, 1, 1]], np.int32)   # 5, 7: no keys
    kv_ids = np.array([[0] * 4 + [1] * 8], np.int32)
    out, lse = ra.attention(q, k, v, return_lse=True, segment_ids=ids,
                            kv_segment_ids=kv_ids)
    empty = np.array([2, 3, 6])
    assert (out[0, empty] == 0).all()
    assert np.isneginf(lse[0, :, empty]).all()
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = ra.attention_backward(dout, q, k, v, out, lse,
                                       segment_ids=ids, kv_segment_ids=kv_ids)
    assert (dq[0, empty] == 0).all() and np.isfinite(dk).all()
    # a window that reaches past the keys on the right only
    out, lse = ra.attention(q, k, v, return_lse=True, window=(0, None),
                            causal=True)
    ref_out, ref_lse = rt.ref_attention(q, k, v, window=(0, None), causal=True)
    rt.assert_close(out, ref_out, "float32")
    rt.assert_close(lse, ref_lse, "float32", name="lse")


@pytest.mark.parametrize("dtype", ["int8", "int16", "int64", "uint8",
                                   "uint32", "uint64"])
def test_any_integer_dtype_and_strides_give_the_int32_result(rng, dtype):
    q, k, v = rt.random_qkv(rng, 2, 50, 50, 2, 2, 8, "float64")
    ids32 = sorted_docs(rng, 2, 50)
    # a strided, transposed view of another dtype
    wide = np.zeros((50, 4), dtype)
    wide[:, ::2] = ids32.T.astype(dtype)
    ids = wide[:, ::2].T
    assert not ids.flags.c_contiguous
    want = ra.attention(q, k, v, segment_ids=ids32, causal=True)
    got = ra.attention(q, k, v, segment_ids=ids, causal=True)
    np.testing.assert_array_equal(got, want)


def test_negative_ids_and_per_batch_documents(rng):
    q, k, v = rt.random_qkv(rng, 3, 40, 40, 2, 1, 8, "float64")
    ids = np.stack([np.repeat([-5, 3, -1], [10, 20, 10]),
                    np.zeros(40, int), np.arange(40)]).astype(np.int32)
    out = ra.attention(q, k, v, segment_ids=ids)
    ref, _ = rt.ref_attention(q, k, v, segment_ids=ids)
    rt.assert_close(out, ref, "float64")


def test_no_masks_equals_unbounded_window_and_huge_softcap(rng):
    q, k, v = rt.random_qkv(rng, 1, 100, 100, 2, 2, 16, "float32")
    plain = ra.attention(q, k, v, causal=True)
    np.testing.assert_array_equal(
        ra.attention(q, k, v, causal=True, window=(None, None)), plain)
    np.testing.assert_array_equal(
        ra.attention(q, k, v, causal=True, window=(10**6, 10**6)), plain)
    rt.assert_close(ra.attention(q, k, v, causal=True, softcap=1e7),
                    rt.ref_attention(q, k, v, causal=True)[0], "float32")


def test_one_document_equals_no_documents(rng):
    q, k, v = rt.random_qkv(rng, 2, 200, 200, 2, 1, 16, "float32")
    ids = np.full((2, 200), 7, np.int32)
    np.testing.assert_array_equal(ra.attention(q, k, v, segment_ids=ids),
                                  ra.attention(q, k, v))


def test_packed_documents_equal_separate_attention(rng):
    """Causal attention over packed documents is causal attention over each
    document alone (what packing is for)."""
    lengths = [1, 64, 65, 3, 130]
    n = sum(lengths)
    q, k, v = rt.random_qkv(rng, 1, n, n, 4, 2, 16, "float64")
    cu = np.concatenate([[0], np.cumsum(lengths)])
    out = ra.attention(q, k, v, causal=True,
                       segment_ids=ra.segment_ids(cu, n))
    for a, b in zip(cu[:-1], cu[1:]):
        alone = ra.attention(q[:, a:b], k[:, a:b], v[:, a:b], causal=True)
        rt.assert_close(out[:, a:b], alone, "float64")


def test_sliding_window_equals_attention_over_the_window(rng):
    """Row i of a causal window (w, 0) is attention over keys i-w..i."""
    n, w = 300, 37
    q, k, v = rt.random_qkv(rng, 1, n, n, 2, 2, 8, "float64")
    out = ra.attention(q, k, v, causal=True, window=(w, 0))
    for i in (0, 5, 36, 37, 38, 150, 299):
        a = max(0, i - w)
        alone = ra.attention(q[:, i:i + 1], k[:, a:i + 1], v[:, a:i + 1])
        rt.assert_close(out[:, i:i + 1], alone, "float64")


@pytest.mark.parametrize("simd", ["generic", "avx2"])
def test_masks_on_every_simd_level(simd, tmp_path):
    """The tile kernels of the lower SIMD levels (chosen once per process:
    a subprocess) give the reference too."""
    import os
    import subprocess
    import sys

    code = (
        "import numpy as np, ringattn as ra\n"
        "from ringattn import testing as rt\n"
        "rng = np.random.default_rng(0)\n"
        "for dt in ('float32', 'float64'):\n"
        "    q, k, v = rt.random_qkv(rng, 1, 150, 150, 2, 1, 24, dt)\n"
        "    ids = np.repeat(np.arange(5), 30)[None].astype(np.int32)\n"
        "    kw = dict(causal=True, segment_ids=ids, window=(40, 0), softcap=3.0)\n"
        "    out, lse = ra.attention(q, k, v, return_lse=True, **kw)\n"
        "    rt.assert_close(out, rt.ref_attention(q, k, v, **kw)[0], dt)\n"
        "    do = rng.standard_normal(out.shape).astype(dt)\n"
        "    g = ra.attention_backward(do, q, k, v, out, lse, **kw)\n"
        "    r = rt.ref_attention_backward(do, q, k, v, out=out, **kw)\n"
        "    for a, b in zip(g, r): rt.assert_close(a, b, dt)\n"
        "print(ra.cpu_info()['simd'])\n")
    env = dict(os.environ, RINGATTN_CPU_SIMD=simd)
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() in (simd, "generic")
