"""GPU tests of ringattn's CUDA kernels through the public API (the
DLPack/stream/allocator side is tests/test_cuda_interop.py).

Every test carries the ``gpu`` marker and skips unless
``ringattn.cuda_available()`` is true.  The device arrays are ringattn's own
(``ra.to_device``, backend "ra", always there) and, where importable, PyTorch
(with CUDA) and CuPy ones (tests/gpu_arrays.py).  On the emulated GPU
(``RINGATTN_CUDA=emulate``) only "ra" exists, and the large grids run a
representative subset (each grid says which; every kernel variant stays in
it: tensor-core and generic, forward and backward, each dtype, every head
dim, masks, accumulate, strides, GQA, S_q != S_k, empty rows); the rest is
skipped there as "real GPUs only".  Results are compared with the float64
references of ``ringattn.testing`` computed on host copies of the very
inputs the kernel saw (so bf16/fp16 rounding of the inputs is not counted
as error).

Tolerance: max |got - ref| <= tol * max(1, max |ref|), with tol 2e-2 for
bfloat16, 5e-3 for float16, 1e-4 for float32 and 1e-9 for float64.

``ringattn._C.attn_fwd(q, k, v, out=, lse=, accumulate=True, causal=,
q_pos_offset=, k_pos_offset=)`` continues a float32 running state (out, lse)
in place (what the ring does every step).

Masks (documents, windows, soft-capping) take the mask cases of
tests/test_masks.py (the CPU kernels' tests) onto the device: against the
float64 reference, against the CPU kernels on the same inputs, tensor-core
against generic kernels, long packed sequences, ring steps (keys in chunks
with position offsets, accumulated), and ids of any integer dtype, strided,
on the device.  Same tolerance as above (the CPU kernels: twice it, as each
implementation is within it of the reference).
"""
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

ra = pytest.importorskip("ringattn")
testing = pytest.importorskip("ringattn.testing")

pytestmark = pytest.mark.gpu

from gpu_arrays import (CUDA, EMULATED, astype, backends_for, emu_subset,  # noqa: E402
                        full, ids_to_device, narrow, to_device, to_host, zeros)

if not CUDA:
    pytest.skip(f"no CUDA device: {ra.cuda_info()['reason']}", allow_module_level=True)

TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4, "float64": 1e-9}


# ---- device array helpers ----------------------------------------------------

def close(got, ref, dtype):
    got, ref = to_host(got), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isneginf(got), np.isneginf(ref)), "-inf pattern differs"
    assert not np.isnan(got).any(), "NaN in result"
    err = np.abs(got[fin] - ref[fin]).max(initial=0.0)
    bound = TOL[dtype] * max(1.0, np.abs(ref[fin]).max(initial=0.0))
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


def make_qkv(rng, B, Sq, Sk, H, Hkv, D, dtype, backend, q_scale=1.0):
    q = to_device(rng.standard_normal((B, Sq, H, D)) * q_scale, dtype, backend)
    k = to_device(rng.standard_normal((B, Sk, Hkv, D)), dtype, backend)
    v = to_device(rng.standard_normal((B, Sk, Hkv, D)), dtype, backend)
    return q, k, v


SHAPES = [  # B, S_q, S_k, H, H_kv
    (1, 1, 1, 1, 1),
    (2, 7, 7, 2, 2),
    (1, 113, 113, 4, 2),
    (2, 65, 200, 3, 1),
    (1, 200, 65, 2, 2),
    (1, 257, 257, 2, 1),
]
DIMS = [8, 59, 64, 96, 128, 256]
DTYPES = ["bfloat16", "float16", "float32", "float64"]


def grid():
    for dtype in DTYPES:
        for backend in backends_for(dtype):
            yield dtype, backend


def kernel_grid(shapes):
    """(dtype, backend, D, shape, causal) over every dtype, D, shape and
    causal flag.  The emulated GPU runs each (dtype, D), causal and not, at
    one shape: the shapes in turn, so that every dtype sees each shape."""
    for dtype, backend in grid():
        a = DTYPES.index(dtype)
        for i, D in enumerate(DIMS):
            for j, shape in enumerate(shapes):
                for causal in (False, True):
                    picked = j == (i + a) % len(shapes)
                    yield pytest.param(dtype, backend, D, shape, causal,
                                       id=f"{dtype}-{backend}-D{D}-{'x'.join(map(str, shape))}"
                                          f"-{'causal' if causal else 'full'}",
                                       marks=() if picked else emu_subset())


# ---- forward -------------------------------------------------------------

@pytest.mark.parametrize("dtype,backend,D,shape,causal", list(kernel_grid(SHAPES)))
def test_forward_matches_reference(dtype, backend, D, shape, causal):
    B, Sq, Sk, H, Hkv = shape
    rng = np.random.default_rng(zlib.crc32(repr((dtype, D, shape, causal)).encode()))
    q, k, v = make_qkv(rng, B, Sq, Sk, H, Hkv, D, dtype, backend)
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
    assert type(out) is type(q)
    ref_out, ref_lse = testing.ref_attention(to_host(q), to_host(k), to_host(v), causal=causal)
    close(out, ref_out, dtype)
    close(lse, ref_lse, "float64" if dtype == "float64" else "float32")


# several tiles of either kernel (64 rows / keys a tile on the tensor cores);
# smaller on the emulated GPU, where the generic kernel is slow
TC_SHAPE = (1, 150, 170, 4, 2) if EMULATED else (2, 300, 333, 4, 2)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_tensor_core_and_generic_paths_agree(D, causal, monkeypatch):
    backend = backends_for("float16")[0]
    rng = np.random.default_rng(7)
    q, k, v = make_qkv(rng, *TC_SHAPE, D, "float16", backend)
    fast, lse_fast = ra.attention(q, k, v, causal=causal, return_lse=True)
    monkeypatch.setenv("RINGATTN_CUDA_GENERIC", "1")
    slow, lse_slow = ra.attention(q, k, v, causal=causal, return_lse=True)
    close(fast, to_host(slow), "float16")
    close(lse_fast, to_host(lse_slow), "float32")


@pytest.mark.parametrize("dtype,backend", list(grid()))
def test_empty_rows_give_zero_and_neg_inf(dtype, backend):
    # causal with S_q > S_k aligns bottom-right: the first S_q - S_k query
    # rows sit before every key and see nothing
    rng = np.random.default_rng(3)
    q, k, v = make_qkv(rng, 1, 40, 9, 2, 2, 64, dtype, backend)
    out, lse = ra.attention(q, k, v, causal=True, return_lse=True)
    out_h, lse_h = to_host(out), to_host(lse)
    assert not np.isnan(out_h).any()
    assert np.all(out_h[:, :31] == 0.0)
    assert np.all(np.isneginf(lse_h[:, :, :31]))
    assert np.all(np.isfinite(lse_h[:, :, 31:]))


@pytest.mark.parametrize("dtype,backend", list(grid()))
def test_non_contiguous_strides(dtype, backend):
    # q, k, v as views of a packed (B, S, 3, H, D) array (held as
    # (B, S, 3 * H, D): the same memory, views along one axis)
    rng = np.random.default_rng(11)
    qkv = to_device(rng.standard_normal((2, 77, 3 * 4, 64)), dtype, backend)
    q, k, v = (narrow(qkv, 2, 4 * i, 4 * i + 4) for i in range(3))
    assert tuple(q.shape) == (2, 77, 4, 64)
    out, lse = ra.attention(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = testing.ref_attention(to_host(q), to_host(k), to_host(v), causal=True)
    close(out, ref_out, dtype)
    close(lse, ref_lse, "float64" if dtype == "float64" else "float32")


# ---- backward ------------------------------------------------------------

@pytest.mark.parametrize("dtype,backend,D,shape,causal", list(kernel_grid(SHAPES[1:5])))
def test_backward_matches_reference(dtype, backend, D, shape, causal):
    B, Sq, Sk, H, Hkv = shape
    rng = np.random.default_rng(zlib.crc32(repr(("bwd", dtype, D, shape, causal)).encode()))
    q, k, v = make_qkv(rng, B, Sq, Sk, H, Hkv, D, dtype, backend)
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
    dout = to_device(rng.standard_normal((B, Sq, H, D)), dtype, backend)
    dq, dk, dv = ra.attention_backward(dout, q, k, v, out, lse, causal=causal)
    refs = testing.ref_attention_backward(to_host(dout), to_host(q), to_host(k), to_host(v),
                                          causal=causal, out=to_host(out))
    for got, ref in zip((dq, dk, dv), refs):
        close(got, ref, dtype)


# several tiles of queries and keys; smaller on the emulated GPU
DET_SHAPE = (1, 100, 100, 4, 1) if EMULATED else (2, 150, 150, 4, 1)


@pytest.mark.parametrize("dtype,backend", list(grid()))
def test_backward_is_deterministic(dtype, backend):
    # deterministic=True: the split kernels, the same bits on every run
    rng = np.random.default_rng(5)
    B, S, _, H, Hkv = DET_SHAPE
    q, k, v = make_qkv(rng, B, S, S, H, Hkv, 64, dtype, backend)
    out, lse = ra.attention(q, k, v, causal=True, return_lse=True)
    dout = to_device(rng.standard_normal((B, S, H, 64)), dtype, backend)
    first, again = ([to_host(x) for x in ra.attention_backward(dout, q, k, v, out, lse,
                                                               causal=True, deterministic=True)]
                    for _ in range(2))
    for a, b in zip(first, again):
        assert np.array_equal(a, b)


# ---- the fused backward (deterministic=False, the default) ------------------
# One block per 128 keys adds its part of every query row's dq into float32
# memory by atomics: queries that see many key blocks (S_k >> 128) and GQA
# (each block walks the group's query heads) make several blocks add into
# one row, concurrently (the emulated GPU runs blocks on parallel workers).
# Against the float64 reference (tolerance TOL, as every backward here) and
# the deterministic kernels.
FUSED_SHAPE = (1, 70, 700, 4, 1) if EMULATED else (2, 333, 2100, 8, 2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_backward_adds_dq_over_many_key_blocks(dtype, D, causal):
    backend = backends_for(dtype)[0]
    B, Sq, Sk, H, Hkv = FUSED_SHAPE
    rng = np.random.default_rng(zlib.crc32(repr(("fused", dtype, D, causal)).encode()))
    q, k, v = make_qkv(rng, B, Sq, Sk, H, Hkv, D, dtype, backend)
    dout = to_device(rng.standard_normal((B, Sq, H, D)), dtype, backend)
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
    fused = ra.attention_backward(dout, q, k, v, out, lse, causal=causal)
    split = ra.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    refs = testing.ref_attention_backward(to_host(dout), to_host(q), to_host(k), to_host(v),
                                          causal=causal, out=to_host(out))
    for got, det, ref in zip(fused, split, refs):
        close(got, ref, dtype)
        close(det, ref, dtype)


@pytest.mark.parametrize("D", [64, 128])
def test_fused_backward_accumulates_ring_steps(D):
    # the ring's calls: keys in chunks at their positions, gradients added
    # into float32 dq, dk, dv (dq straight from the atomics, no scratch);
    # and a float32 dq without accumulate (through the scratch)
    backend = backends_for("bfloat16")[0]
    B, Sq, Sk, H, Hkv = 1, 70, 400, 4, 2
    rng = np.random.default_rng(D + 31)
    q, k, v = make_qkv(rng, B, Sq, Sk, H, Hkv, D, "bfloat16", backend)
    dout = to_device(rng.standard_normal((B, Sq, H, D)), "bfloat16", backend)
    qpos0 = Sk - Sq  # causal, queries at the end
    out, lse = ra.attention(q, k, v, causal=True, return_lse=True)
    grads = [zeros(tuple(x.shape), "float32", like=q) for x in (q, k, v)]
    for lo, hi in ((0, 150), (150, 170), (170, 400)):
        ra._C.attn_bwd(dout, q, narrow(k, 1, lo, hi), narrow(v, 1, lo, hi), out, lse,
                       causal=True, dq=grads[0], dk=narrow(grads[1], 1, lo, hi),
                       dv=narrow(grads[2], 1, lo, hi), accumulate=True,
                       q_pos_offset=qpos0, k_pos_offset=lo)
    refs = testing.ref_attention_backward(to_host(dout), to_host(q), to_host(k), to_host(v),
                                          causal=True, out=to_host(out))
    for got, ref in zip(grads, refs):
        close(got, ref, "bfloat16")
    f32 = [zeros(tuple(x.shape), "float32", like=q) for x in (q, k, v)]
    ra._C.attn_bwd(dout, q, k, v, out, lse, causal=True, dq=f32[0], dk=f32[1], dv=f32[2])
    for got, ref in zip(f32, refs):
        close(got, ref, "bfloat16")


# ---- merge and running state ----------------------------------------------

@pytest.mark.parametrize("dtype,backend", list(grid()))
def test_merge_of_two_key_halves_is_full_attention(dtype, backend):
    rng = np.random.default_rng(13)
    q, k, v = make_qkv(rng, 2, 33, 90, 2, 2, 59, dtype, backend)
    o1, l1 = ra.attention(q, narrow(k, 1, 0, 40), narrow(v, 1, 0, 40), return_lse=True)
    o2, l2 = ra.attention(q, narrow(k, 1, 40, 90), narrow(v, 1, 40, 90), return_lse=True)
    out, lse = ra.merge(o1, l1, o2, l2)
    ref_out, ref_lse = testing.ref_attention(to_host(q), to_host(k), to_host(v))
    close(out, ref_out, dtype)
    close(lse, ref_lse, "float64" if dtype == "float64" else "float32")


@pytest.mark.parametrize("backend", backends_for("float32"))
def test_merge_of_empty_rows_is_empty(backend):
    o = to_device(np.zeros((1, 3, 2, 8)), "float32", backend)
    l = to_device(np.full((1, 2, 3), -np.inf), "float32", backend)
    out, lse = ra.merge(o, l, o, l)
    assert np.all(to_host(out) == 0.0) and np.all(np.isneginf(to_host(lse)))


@pytest.mark.parametrize("dtype,backend", [g for g in grid() if g[0] != "float64"])
@pytest.mark.parametrize("D", [59, 64, 128])
def test_accumulate_continues_running_state(dtype, backend, D):
    rng = np.random.default_rng(17)
    q, k, v = make_qkv(rng, 1, 70, 150, 2, 1, D, dtype, backend)
    out = zeros((1, 70, 2, D), "float32", like=q)
    lse = full((1, 2, 70), -np.inf, "float32", like=q)
    # three "ring steps" over key chunks, positions continuing, causal with
    # queries at the end of the sequence
    for lo, hi in ((0, 50), (50, 100), (100, 150)):
        ra._C.attn_fwd(q, narrow(k, 1, lo, hi), narrow(v, 1, lo, hi), causal=True, out=out,
                       lse=lse, accumulate=True, q_pos_offset=80,
                       k_pos_offset=lo)
    ref_out, ref_lse = testing.ref_attention(to_host(q), to_host(k), to_host(v), causal=True)
    close(out, ref_out, dtype)
    close(lse, ref_lse, "float32")


# ---- huge but finite scores ----------------------------------------------

# q scaled so that the softmax is one-hot: float32 1e9 and float64 1e18
# (the backward's P = exp(s - lse) must stay <= 1 whatever the rounding),
# float16/bfloat16 as large as their tensor-core path resolves
HUGE = {"float32": 1e9, "float64": 1e18, "float16": 300.0, "bfloat16": 1e4}


@pytest.mark.parametrize("dtype,backend", list(grid()))
@pytest.mark.parametrize("D", [59, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_with_huge_scores_is_finite_and_correct(dtype, backend, D, causal):
    rng = np.random.default_rng(zlib.crc32(repr(("huge", dtype, D, causal)).encode()))
    q = to_device(rng.standard_normal((1, 70, 2, D)) * HUGE[dtype], dtype, backend)
    k = to_device(rng.standard_normal((1, 90, 1, D)), dtype, backend)
    v = to_device(rng.standard_normal((1, 90, 1, D)), dtype, backend)
    dout = to_device(rng.standard_normal((1, 70, 2, D)), dtype, backend)
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = ra.attention_backward(dout, q, k, v, out, lse, causal=causal)
    ref_out, ref_lse = testing.ref_attention(to_host(q), to_host(k), to_host(v), causal=causal)
    rdq, rdk, rdv = testing.ref_attention_backward(to_host(dout), to_host(q), to_host(k),
                                                   to_host(v), causal=causal)
    for g in (dq, dk, dv):
        assert np.isfinite(to_host(g)).all(), "non-finite gradient"
    close(out, ref_out, dtype)
    close(dv, rdv, dtype)
    close(dq, rdq, dtype)
    # dk = scale * sum_i dS_ij q_i carries q's magnitude: its error is
    # measured against max |q| (dS is a rounding-level difference here)
    err = np.abs(to_host(dk) - rdk).max()
    assert err <= TOL[dtype] * np.abs(to_host(q)).max(), err


@pytest.mark.parametrize("backend", backends_for("bfloat16"))
@pytest.mark.parametrize("D", [64, 128])
def test_tensor_core_backward_is_right_at_1e9(backend, D):
    # bfloat16 holds q * 1e9; the tensor-core kernels' recomputed score and
    # stored lse then differ by many units: the clamp keeps exp2 from
    # overflowing, and the band (16 ulps of a huge |lse|) gives the
    # dominant key P = 1, so the gradients are right, not only finite
    rng = np.random.default_rng(D)
    q = to_device(rng.standard_normal((1, 130, 2, D)) * 1e9, "bfloat16", backend)
    k, v = (to_device(rng.standard_normal((1, 150, 2, D)), "bfloat16", backend) for _ in range(2))
    dout = to_device(rng.standard_normal((1, 130, 2, D)), "bfloat16", backend)
    out, lse = ra.attention(q, k, v, return_lse=True)
    dq, dk, dv = ra.attention_backward(dout, q, k, v, out, lse)
    qh, kh, vh = to_host(q), to_host(k), to_host(v)
    ref_out, _ = testing.ref_attention(qh, kh, vh)
    rdq, rdk, rdv = testing.ref_attention_backward(to_host(dout), qh, kh, vh)
    close(out, ref_out, "bfloat16")
    for g in (dq, dk, dv):
        assert np.isfinite(to_host(g)).all(), "non-finite gradient"
    close(dv, rdv, "bfloat16")
    close(dq, rdq, "bfloat16")
    err = np.abs(to_host(dk) - rdk).max()   # dk carries q's magnitude
    assert err <= TOL["bfloat16"] * np.abs(qh).max(), err


# ---- masks: documents, windows, soft-capping -------------------------------

# the CPU tests' mask cases (documents sorted, unsorted and mostly of length
# 1, windows (0,0), (1,0), (0,1), asymmetric, wider than n, one-sided,
# softcap, all at once), here on the device
from test_masks import CASES as MASK_CASES  # noqa: E402
from test_masks import mask_case  # noqa: E402

MASK_SHAPES = [(2, 97, 150, 4, 2), (1, 150, 97, 2, 1)]   # B, S_q, S_k, H, H_kv


def mask_backend(dtype):
    """One backend per dtype for the mask grid (PyTorch where it can)."""
    return backends_for(dtype)[0]


def on_device(masks, backend):
    """mask_case's keyword arguments with the segment ids on the device."""
    out = dict(masks)
    for key in ("segment_ids", "kv_segment_ids"):
        if key in out:
            out[key] = ids_to_device(out[key], backend)
    return out


def masked_problem(dtype, backend, D, case, shape, seed):
    """q, k, v, dout on the device and the mask keywords (host and device)
    of one mask case; q is scaled by 3 where a softcap bites."""
    B, Sq, Sk, H, Hkv = shape
    rng = np.random.default_rng(zlib.crc32(repr(seed).encode()))
    host = mask_case(case, rng, B, Sq, Sk)
    q, k, v = make_qkv(rng, B, Sq, Sk, H, Hkv, D, dtype, backend,
                       q_scale=3.0 if case in ("softcap", "all") else 1.0)
    dout = to_device(rng.standard_normal((B, Sq, H, D)), dtype, backend)
    return q, k, v, dout, host, on_device(host, backend)


# the tensor-core kernels (16-bit at D 64, 128) and the generic ones (float32,
# float64 at an odd D and at 128); the selftest covers every lane width
MASK_DTYPE_DIMS = [("bfloat16", 64), ("bfloat16", 128), ("float16", 64), ("float16", 128),
                   ("float32", 59), ("float32", 128), ("float64", 59), ("float64", 128)]


def masked_grid():
    """(dtype, D, case, causal); on the emulated GPU every case twice, causal
    and not, on two of the (dtype, D) in turn (each of those runs three
    cases)."""
    for j, (dtype, D) in enumerate(MASK_DTYPE_DIMS):
        for c, case in enumerate(MASK_CASES):
            for causal in (False, True):
                picked = j == (c + 4 * causal) % len(MASK_DTYPE_DIMS)
                yield pytest.param(dtype, D, case, causal,
                                   id=f"{dtype}-D{D}-{case}-{'causal' if causal else 'full'}",
                                   marks=() if picked else emu_subset())


@pytest.mark.parametrize("dtype,D,case,causal", list(masked_grid()))
def test_masked_attention_matches_reference(dtype, D, case, causal):
    backend = mask_backend(dtype)
    shape = MASK_SHAPES[MASK_CASES.index(case) % 2]
    q, k, v, dout, host, masks = masked_problem(dtype, backend, D, case, shape,
                                                ("mask", dtype, D, case, causal))
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True, **masks)
    dq, dk, dv = ra.attention_backward(dout, q, k, v, out, lse, causal=causal, **masks)
    qh, kh, vh = to_host(q), to_host(k), to_host(v)
    ref_out, ref_lse = testing.ref_attention(qh, kh, vh, causal=causal, **host)
    refs = testing.ref_attention_backward(to_host(dout), qh, kh, vh, causal=causal,
                                          out=to_host(out), **host)
    close(out, ref_out, dtype)
    close(lse, ref_lse, "float64" if dtype == "float64" else "float32")
    for got, ref in zip((dq, dk, dv), refs):
        close(got, ref, dtype)


def host_array(x, dtype):
    """A device array as a NumPy array of its own dtype (ml_dtypes bfloat16)."""
    return to_host(x).astype(testing.np_dtype(dtype))


@pytest.mark.parametrize("dtype,case", [
    pytest.param(dtype, case, marks=() if c % len(DTYPES) == a else emu_subset(
        "the emulated GPU runs each mask case once, the dtypes in turn"))
    for a, dtype in enumerate(DTYPES) for c, case in enumerate(MASK_CASES)])
def test_masked_attention_matches_the_cpu_kernels(dtype, case):
    # the same inputs through the CPU kernels: two implementations, each
    # within the tolerance of the float64 reference, so within twice it
    # of each other
    backend = mask_backend(dtype)
    q, k, v, dout, host, masks = masked_problem(dtype, backend, 64, case,
                                                MASK_SHAPES[0], ("cpu", dtype, case))
    out, lse = ra.attention(q, k, v, causal=True, return_lse=True, **masks)
    grads = ra.attention_backward(dout, q, k, v, out, lse, causal=True, **masks)
    qc, kc, vc, doc, oc = (host_array(x, dtype) for x in (q, k, v, dout, out))
    cpu_out, cpu_lse = ra.attention(qc, kc, vc, causal=True, return_lse=True, **host)
    cpu_grads = ra.attention_backward(doc, qc, kc, vc, oc, to_host(lse).astype(
        np.float64 if dtype == "float64" else np.float32), causal=True, **host)
    pairs = [(out, cpu_out, dtype), (lse, cpu_lse, "float64" if dtype == "float64" else "float32")]
    pairs += [(g, c, dtype) for g, c in zip(grads, cpu_grads)]
    for got, want, dt in pairs:
        got, want = to_host(got), to_host(want)
        assert np.array_equal(np.isneginf(got), np.isneginf(want)), "-inf pattern differs"
        fin = np.isfinite(want)
        err = np.abs(got[fin] - want[fin]).max(initial=0.0)
        assert err <= 2 * TOL[dt] * max(1.0, np.abs(want[fin]).max(initial=0.0)), err


TC_CASES = ["docs", "docs-few-unsorted", "window-asym", "all"]


@pytest.mark.parametrize("D,case", [
    pytest.param(D, case, marks=() if (i + c) % 2 == 0 else emu_subset(
        "the emulated GPU runs each case at one D, both D in turn"))
    for i, D in enumerate([64, 128]) for c, case in enumerate(TC_CASES)])
def test_masked_tensor_core_and_generic_paths_agree(D, case, monkeypatch):
    backend = backends_for("float16")[0]
    q, k, v, dout, _, masks = masked_problem("float16", backend, D, case, TC_SHAPE,
                                             ("tc", D, case))
    fast = ra.attention(q, k, v, causal=True, return_lse=True, **masks)
    fast += ra.attention_backward(dout, q, k, v, fast[0], fast[1], causal=True, **masks)
    monkeypatch.setenv("RINGATTN_CUDA_GENERIC", "1")
    slow = ra.attention(q, k, v, causal=True, return_lse=True, **masks)
    slow += ra.attention_backward(dout, q, k, v, fast[0], fast[1], causal=True, **masks)
    for i, (a, b) in enumerate(zip(fast, slow)):
        close(a, to_host(b), "float32" if i == 1 else "float16")


LONG = [(70, 9000), (9000, 70)]


@pytest.mark.parametrize("dtype,D,lengths", [
    pytest.param(dtype, D, lengths, id=f"{dtype}-D{D}-{'long-kv' if lengths[0] < lengths[1] else 'long-q'}",
                 marks=() if (a + i + l) % 2 == 0 else emu_subset(
                     "the emulated GPU runs each dtype and each D at both lengths"))
    for a, dtype in enumerate(["bfloat16", "float32"]) for i, D in enumerate([59, 64])
    for l, lengths in enumerate(LONG)])
def test_masked_long_sequences_of_packed_documents(dtype, D, lengths):
    # thousands of keys (or queries) in documents of up to 300 tokens: the
    # kernels skip the tiles of other documents over several chunks of tiles
    Sq, Sk = lengths
    backend = mask_backend(dtype)
    rng = np.random.default_rng(zlib.crc32(repr(("long", dtype, D, lengths)).encode()))
    n = max(Sq, Sk)
    ids = np.cumsum(rng.random(n) < 1 / 150).astype(np.int32)[None]   # sorted documents
    host = {"segment_ids": ids[:, n - Sq:], "kv_segment_ids": ids[:, n - Sk:]}
    q, k, v = make_qkv(rng, 1, Sq, Sk, 2, 1, D, dtype, backend)
    dout = to_device(rng.standard_normal((1, Sq, 2, D)), dtype, backend)
    masks = on_device(host, backend)
    causal = Sq < Sk
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True, **masks)
    grads = ra.attention_backward(dout, q, k, v, out, lse, causal=causal, **masks)
    qh, kh, vh = to_host(q), to_host(k), to_host(v)
    ref_out, ref_lse = testing.ref_attention(qh, kh, vh, causal=causal, **host)
    refs = testing.ref_attention_backward(to_host(dout), qh, kh, vh, causal=causal,
                                          out=to_host(out), **host)
    close(out, ref_out, dtype)
    close(lse, ref_lse, "float32")
    for got, ref in zip(grads, refs):
        close(got, ref, dtype)


RING_DTYPES, RING_DIMS = ["bfloat16", "float16", "float32"], [59, 64, 128]
RING_CASES = ["docs", "window-asym", "window-left-none", "all"]


@pytest.mark.parametrize("dtype,D,case", [
    pytest.param(dtype, D, case, marks=() if c == (a + i) % len(RING_CASES) else emu_subset(
        "the emulated GPU runs each (dtype, D) once, the cases in turn"))
    for a, dtype in enumerate(RING_DTYPES) for i, D in enumerate(RING_DIMS)
    for c, case in enumerate(RING_CASES)])
def test_masked_ring_steps_accumulate(dtype, D, case):
    # keys in three chunks, each call with its kv ids and positions, into a
    # float32 running state and float32 grads (what a ring step does)
    B, Sq, Sk, H, Hkv = 1, 70, 150, 2, 1
    backend = mask_backend(dtype)
    rng = np.random.default_rng(zlib.crc32(repr(("ring", dtype, D, case)).encode()))
    host = mask_case(case, rng, B, Sq, Sk)
    q, k, v = make_qkv(rng, B, Sq, Sk, H, Hkv, D, dtype, backend,
                       q_scale=3.0 if case == "all" else 1.0)
    dout = to_device(rng.standard_normal((B, Sq, H, D)), dtype, backend)
    q_ids = host.get("segment_ids")
    kv_ids = host.get("kv_segment_ids", q_ids)
    rest = {key: host[key] for key in ("window", "softcap") if key in host}
    chunks = ((0, 50), (50, 100), (100, 150))

    def piece(lo, hi):
        if q_ids is None:
            return dict(rest)
        return on_device(dict(rest, segment_ids=q_ids, kv_segment_ids=kv_ids[:, lo:hi]), backend)

    qpos0 = 80  # queries at positions 80..149, causal
    out = zeros((B, Sq, H, D), "float32", like=q)
    lse = full((B, H, Sq), -np.inf, "float32", like=q)
    for lo, hi in chunks:
        ra._C.attn_fwd(q, narrow(k, 1, lo, hi), narrow(v, 1, lo, hi), causal=True, out=out,
                       lse=lse, accumulate=True, q_pos_offset=qpos0, k_pos_offset=lo,
                       **piece(lo, hi))
    o = astype(out, dtype)
    grads = [zeros(tuple(x.shape), "float32", like=q) for x in (q, k, v)]
    for lo, hi in chunks:
        ra._C.attn_bwd(dout, q, narrow(k, 1, lo, hi), narrow(v, 1, lo, hi), o, lse,
                       causal=True, dq=grads[0], dk=narrow(grads[1], 1, lo, hi),
                       dv=narrow(grads[2], 1, lo, hi), accumulate=True,
                       q_pos_offset=qpos0, k_pos_offset=lo, **piece(lo, hi))
    qh, kh, vh = to_host(q), to_host(k), to_host(v)
    positions = dict(q_pos=np.arange(Sq) + qpos0, k_pos=np.arange(Sk))
    ref_out, ref_lse = testing.ref_attention(qh, kh, vh, causal=True, **positions, **host)
    refs = testing.ref_attention_backward(to_host(dout), qh, kh, vh, causal=True,
                                          out=to_host(o), **positions, **host)
    close(out, ref_out, dtype)
    close(lse, ref_lse, "float32")
    for got, ref in zip(grads, refs):
        close(got, ref, dtype)


@pytest.mark.parametrize("ids_dtype", ["int64", "int16", "uint8"])
def test_masked_ids_of_any_integer_dtype_and_strides_on_the_device(ids_dtype):
    # ids on the device in another integer dtype, and a strided view, are
    # converted (or read in place) and give what contiguous int32 ids give
    backend = mask_backend("float32")
    rng = np.random.default_rng(zlib.crc32(repr(("ids", ids_dtype)).encode()))
    B, S, H, D = 2, 90, 2, 64
    q, k, v = make_qkv(rng, B, S, S, H, 1, D, "float32", backend)
    ids = np.sort(rng.integers(0, 5, (B, S)), axis=1)
    wide = np.repeat(ids, 2, axis=1)            # every other column is ids
    host = {"segment_ids": ids.astype(np.int32)}
    want = ra.attention(q, k, v, causal=True, **on_device(host, backend))
    got = ra.attention(q, k, v, causal=True,
                       **on_device({"segment_ids": ids.astype(ids_dtype)}, backend))
    strided = on_device({"segment_ids": wide.astype(ids_dtype)}, backend)["segment_ids"]
    got_strided = ra.attention(q, k, v, causal=True, segment_ids=narrow(strided, 1, 0, 2 * S, 2))
    ref, _ = testing.ref_attention(to_host(q), to_host(k), to_host(v), causal=True, **host)
    for x in (want, got, got_strided):
        close(x, ref, "float32")
    assert np.array_equal(to_host(got), to_host(want))


def test_masked_ids_on_the_host_with_device_arrays_are_refused():
    backend = mask_backend("float32")
    rng = np.random.default_rng(5)
    q, k, v = make_qkv(rng, 1, 20, 20, 2, 1, 64, "float32", backend)
    ids = np.zeros((1, 20), np.int32)
    with pytest.raises(ValueError, match="segment_ids.*device"):
        ra.attention(q, k, v, segment_ids=ids)
    with pytest.raises(ValueError, match="kv_segment_ids.*device"):
        ra.attention(q, k, v, segment_ids=on_device({"segment_ids": ids}, backend)["segment_ids"],
                     kv_segment_ids=ids)
    with pytest.raises(ValueError, match="window"):
        ra.attention(q, k, v, window=(-1, 0))
    with pytest.raises(ValueError, match="softcap"):
        ra.attention(q, k, v, softcap=0.0)


def test_dilated_branches_run_on_the_device():
    """The private branch rows of the dilated ring run on the CUDA backward
    as on the CPU (tests/test_cuda_branches.py: the branch rule itself)."""
    from ringattn import _C

    backend = mask_backend("float32")
    rng = np.random.default_rng(6)
    q, k, v = make_qkv(rng, 1, 16, 16, 2, 2, 64, "float32", backend)
    out, lse = ra.attention(q, k, v, return_lse=True)
    kw = dict(branches=((8,), (2,)), branch_head=1, branch_head_stride=2)
    got = _C.attn_bwd(out, q, k, v, out, lse, **kw)
    host = [to_host(x).astype(np.float32) for x in (out, q, k, v, out, lse)]
    want = _C.attn_bwd(*host, **kw)
    for g, w in zip(got, want):
        close(g, to_host(w), "float32")


@pytest.mark.parametrize("S_q, S_k", [(0, 9), (9, 0), (0, 0)])
def test_empty_sequences_on_the_device(S_q, S_k):
    """Zero-length q or k (a device pointer that may be NULL): forward and
    backward return the right shapes, dk/dv zero, no error."""
    backend = mask_backend("float32")
    rng = np.random.default_rng(7)
    q, k, v = make_qkv(rng, 2, S_q, S_k, 2, 1, 64, "float32", backend)
    out, lse = ra.attention(q, k, v, return_lse=True)
    assert tuple(out.shape) == (2, S_q, 2, 64) and tuple(lse.shape) == (2, 2, S_q)
    dq, dk, dv = ra.attention_backward(out, q, k, v, out, lse)
    assert tuple(dq.shape) == (2, S_q, 2, 64) and tuple(dk.shape) == (2, S_k, 1, 64)
    assert not to_host(dk).any() and not to_host(dv).any()
    if S_k == 0 and S_q:
        assert np.isneginf(to_host(lse)).all() and not to_host(out).any()


def test_softcap_outside_the_float_range_is_refused_on_the_device():
    backend = mask_backend("float16")
    rng = np.random.default_rng(8)
    q, k, v = make_qkv(rng, 1, 20, 20, 2, 1, 64, "float16", backend)
    for cap in (1e39, 1e-46):
        with pytest.raises(ValueError, match="softcap"):
            ra.attention(q, k, v, softcap=cap)
    for cap in (1e30, 1e-30):           # the ends of the range: right answers
        out = ra.attention(q, k, v, softcap=cap)
        ref, _ = testing.ref_attention(to_host(q), to_host(k), to_host(v), softcap=cap)
        close(out, ref, "float16")


# ---- the emulated GPU's checker fails a test --------------------------------

_CHECKED = """
import numpy as np
import pytest

import ringattn as ra
from dlpack_producer import HandMadeProducer

pytestmark = pytest.mark.gpu


def test_reads_past_its_buffer_and_passes():
    small = ra.to_device(np.ones((1, 8, 1, 8), np.float32), "cuda:0")
    view = HandMadeProducer((1, 512, 1, 8), device=(2, 0))  # claims 64x the rows
    view.managed.dl_tensor.data = small.data_ptr
    q = ra.from_dlpack(view)
    with pytest.raises(RuntimeError):               # the kernel faults ...
        ra.to_device(ra.attention(q, q, q), "cpu")
    # ... and the test "passes": only tests/conftest.py's check fails it
"""


@pytest.mark.skipif(not EMULATED, reason="the emulated GPU's checker")
def test_a_checker_report_fails_a_passing_test(tmp_path):
    """tests/conftest.py fails a gpu test whose kernel the checker flagged,
    even when the test's own assertions pass (here: an out-of-bounds read
    through a hand-made view, in a separate pytest: the fault is sticky)."""
    (tmp_path / "test_checked.py").write_text(_CHECKED)
    here = os.path.dirname(os.path.abspath(__file__))
    package = os.path.dirname(os.path.dirname(os.path.abspath(ra.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, package]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
         "--rootdir", str(tmp_path), str(tmp_path / "test_checked.py")],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "1 failed" in out, out
    assert "emulated GPU's checker reported" in out and "attn_fwd" in out, out


# ---- NaN and infinities (DESIGN 2), with ringattn's own device arrays ------
# The cases of tests/test_nan.py on the device: a NaN score makes the rows
# that see it NaN (forward exactly; the backward may NaN more of a tile),
# rows that see nothing stay (0, -inf).  SIMT kernels (float32/float64,
# D 8) and tensor-core kernels (16-bit, D 64 and 128), plain and masked,
# one call and as ring steps (accumulate), and the device merge.

import test_nan  # noqa: E402


def close_nan(got, ref, dtype, extra_nan=False):
    """`close` where both are finite; every NaN of ref in got (and, unless
    extra_nan, no other)."""
    got, ref = to_host(got), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.isnan(got[np.isnan(ref)]).all(), "a NaN of the reference is missing"
    if not extra_nan:
        assert not np.isnan(got[~np.isnan(ref)]).any(), "NaN where the reference has none"
    keep = ~np.isnan(ref) & ~np.isnan(got)
    close(got[keep], ref[keep], dtype)


def _nan_problem(case, dtype, D):
    rng = np.random.default_rng(zlib.crc32(repr((case, dtype, D)).encode()))
    q, k, v = testing.random_qkv(rng, 2, test_nan.N_Q, test_nan.N_K, 4, 2, D, "float64")
    q, k, v = test_nan._spoil(case, q, k, v)
    dt = testing.np_dtype(dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        host = [x.astype(dt) for x in (q, k, v, rng.standard_normal(q.shape))]
    return host, [ra.to_device(x, "cuda") for x in host]


def _device_masks(mask):
    kw = test_nan.MASKS[mask]
    return {key: ra.to_device(np.ascontiguousarray(x, np.int32), "cuda")
            if key.endswith("ids") else x for key, x in kw.items()}, kw


NAN_KERNELS = [("float32", 8), ("float64", 8), ("float16", 64), ("bfloat16", 64),
               ("bfloat16", 128)]


@pytest.mark.parametrize("dtype, D", NAN_KERNELS)
@pytest.mark.parametrize("mask", ["full", "causal", "masked"])
@pytest.mark.parametrize("case", ["q_nan", "k_nan", "inf_times_zero", "plus_inf"])
def test_nan_reaches_the_rows_that_see_it_on_the_device(case, mask, dtype, D):
    (q, k, v, do), (qd, kd, vd, dod) = _nan_problem(case, dtype, D)
    dkw, kw = _device_masks(mask)
    out, lse = ra.attention(qd, kd, vd, return_lse=True, **dkw)
    grads = ra.attention_backward(dod, qd, kd, vd, out, lse, **dkw)
    out_h = ra.to_device(out, "cpu").numpy()
    ref_out, ref_lse = testing.ref_attention(q, k, v, **kw)
    capped_inf = case == "plus_inf" and kw.get("softcap")
    assert np.isnan(ref_out).any() != bool(capped_inf)
    close_nan(out_h, ref_out, dtype)
    close_nan(ra.to_device(lse, "cpu").numpy(), ref_lse, dtype)
    refs = testing.ref_attention_backward(do, q, k, v, out=out_h, **kw)
    for g, r in zip(grads, refs):
        close_nan(ra.to_device(g, "cpu").numpy(), r, dtype, extra_nan=True)


@pytest.mark.parametrize("dtype, D", NAN_KERNELS)
def test_nan_survives_ring_steps_on_the_device(dtype, D):
    """Three accumulate steps over key chunks: a NaN of the first chunk
    stays NaN when later chunks merge into the running state, and a chunk
    that adds nothing to a row leaves its NaN (and its emptiness) alone."""
    (q, k, v, _), (qd, kd, vd, _) = _nan_problem("k_nan", dtype, D)
    B, Sq, H, _ = q.shape
    acc = "float64" if dtype == "float64" else "float32"
    out = ra.zeros((B, Sq, H, D), acc, "cuda")
    lse = ra.to_device(np.full((B, H, Sq), -np.inf, acc), "cuda")
    for lo, hi in ((0, 50), (50, 100), (100, test_nan.N_K)):
        ra._C.attn_fwd(qd, kd.narrow(1, lo, hi - lo), vd.narrow(1, lo, hi - lo),
                       causal=True, out=out, lse=lse, accumulate=True,
                       q_pos_offset=test_nan.N_K - Sq, k_pos_offset=lo)
    ref_out, ref_lse = testing.ref_attention(q, k, v, causal=True)
    close_nan(ra.to_device(out, "cpu").numpy(), ref_out, dtype)
    close_nan(ra.to_device(lse, "cpu").numpy(), ref_lse, dtype)


def test_device_merge_keeps_nan():
    rng = np.random.default_rng(21)
    o1, o2 = rng.standard_normal((2, 1, 3, 1, 4)).astype(np.float32)
    l1 = np.array([[[np.nan, np.nan, 0.5]]], np.float32)
    l2 = np.array([[[-np.inf, 0.3, np.nan]]], np.float32)
    out, lse = ra.merge(*(ra.to_device(x, "cuda") for x in (o1, l1, o2, l2)))
    ref_out, ref_lse = testing.ref_merge(o1, l1, o2, l2)
    close_nan(ra.to_device(out, "cpu").numpy(), ref_out, "float32")
    close_nan(ra.to_device(lse, "cpu").numpy(), ref_lse, "float32")


# ---- Buffer.copy_ between overlapping device views ------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32"])
def test_overlapping_device_copy_is_copyto(dtype):
    """As on the host (tests/test_buffer_copy.py): as if through a
    temporary, never a kernel that reads what it has written."""
    dt = testing.np_dtype(dtype)
    base = (np.arange(6 * 5 * 8) % 97).reshape(6, 5, 8).astype(dt)
    dev = ra.to_device(base, "cuda")
    dev.narrow(0, 1, 5).copy_(dev.narrow(0, 0, 5))      # y[1:] = y[:-1]
    want = base.copy()
    np.copyto(want[1:], want[:-1])
    np.testing.assert_array_equal(ra.to_device(dev, "cpu").numpy(), want)
    if dtype != "int32":                                # raw copies need contiguity
        dev = ra.to_device(base, "cuda")
        dev.narrow(2, 1, 7).copy_(dev.narrow(2, 0, 7))  # strided rows, shifted
        want = base.copy()
        np.copyto(want[:, :, 1:], want[:, :, :-1])
        np.testing.assert_array_equal(ra.to_device(dev, "cpu").numpy(), want)
