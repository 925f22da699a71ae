"""GPU tests of the two tensor-core kernel families of the forward: "sm90a"
(wgmma, bulk tensor copies and warp specialisation, cuda/hopper/; compute
capability 9.0 with a build for sm_90a, and the emulated GPU, an sm_90
device) and "sm80" (mma.sync, cuda/attn_fwd_tc.cu; every other GPU, and
wherever ``RINGATTN_CUDA_KERNELS=sm80`` asks for it, read at every call).

Each test runs the forward in both families where the device has both (one
family elsewhere) against the float64 reference of ``ringattn.testing``,
with tests/test_cuda.py's tolerance: float16/bfloat16 at head_dim 64 and
128, causal and not, GQA, S_q != S_k, several key tiles of either kernel,
empty rows, the ring's accumulate with position offsets, the masks
(documents, windows, soft-capping), and the layouts each family takes or
leaves (``_C.cuda_fwd_kernel_counts()`` says which kernel ran).  With the
rest of the GPU suite (which runs the default family: sm90a on the emulated
GPU) this keeps both families covered in CI.
"""
import zlib

import numpy as np
import pytest

ra = pytest.importorskip("ringattn")
testing = pytest.importorskip("ringattn.testing")

pytestmark = pytest.mark.gpu

from gpu_arrays import (CUDA, EMULATED, backends_for, full, ids_to_device, narrow,  # noqa: E402
                        to_device, to_host, zeros)

if not CUDA:
    pytest.skip(f"no CUDA device: {ra.cuda_info()['reason']}", allow_module_level=True)

from test_cuda import close  # noqa: E402  (test_cuda.py's tolerance, as the docstring says)

DEFAULT = ra.cuda_info()["forward_kernels"]
# the families this device runs: both where the default is the Hopper one
FAMILIES = ["sm90a", "sm80"] if DEFAULT == "sm90a" else ["sm80"]


def counts():
    return ra._C.cuda_fwd_kernel_counts()


def ran(before):
    """The kernel of the one forward call since `before` (counts)."""
    after = counts()
    diff = {k: after[k] - before[k] for k in after}
    assert sum(diff.values()) == 1, diff
    return max(diff, key=diff.get)


@pytest.fixture(params=FAMILIES)
def family(request, monkeypatch):
    """The forward family a test runs: the device's default (no variable)
    or the mma.sync one forced."""
    if request.param == DEFAULT:
        monkeypatch.delenv("RINGATTN_CUDA_KERNELS", raising=False)
    else:
        monkeypatch.setenv("RINGATTN_CUDA_KERNELS", request.param)
    return request.param


def make_qkv(rng, B, Sq, Sk, H, Hkv, D, dtype, q_scale=1.0):
    backend = backends_for(dtype)[0]
    q = to_device(rng.standard_normal((B, Sq, H, D)) * q_scale, dtype, backend)
    k = to_device(rng.standard_normal((B, Sk, Hkv, D)), dtype, backend)
    v = to_device(rng.standard_normal((B, Sk, Hkv, D)), dtype, backend)
    return q, k, v


# ---- which family runs ------------------------------------------------------

def test_cuda_info_names_the_family_and_the_variable_switches_it(monkeypatch):
    monkeypatch.delenv("RINGATTN_CUDA_KERNELS", raising=False)
    info = ra.cuda_info()
    assert info["forward_kernels"] in ("sm90a", "sm80")
    assert info["backward_kernels"] == info["forward_kernels"]
    if EMULATED:   # an sm_90 device, and the build has the Hopper kernels
        assert info["forward_kernels"] == "sm90a"
    monkeypatch.setenv("RINGATTN_CUDA_KERNELS", "sm80")
    assert ra.cuda_info()["forward_kernels"] == "sm80"
    assert ra.cuda_info()["backward_kernels"] == "sm80"
    monkeypatch.setenv("RINGATTN_CUDA_KERNELS", "auto")
    assert ra.cuda_info()["forward_kernels"] == DEFAULT


def test_the_forward_runs_the_family_named(family):
    rng = np.random.default_rng(1)
    q, k, v = make_qkv(rng, 1, 70, 90, 2, 1, 64, "bfloat16")
    before = counts()
    ra.attention(q, k, v)
    assert ran(before) == family


def test_a_bad_family_is_refused_naming_the_variable(monkeypatch):
    rng = np.random.default_rng(2)
    q, k, v = make_qkv(rng, 1, 9, 9, 1, 1, 64, "float16")
    monkeypatch.setenv("RINGATTN_CUDA_KERNELS", "sm99")
    with pytest.raises(ValueError, match="RINGATTN_CUDA_KERNELS must be auto or sm80, got 'sm99'"):
        ra.attention(q, k, v)


def test_rows_a_tensor_map_cannot_describe_take_the_generic_kernel(family):
    # rows of 68 elements (136 bytes): neither a bulk tensor copy nor
    # cp.async can start every row 16-byte aligned
    dtype = "float16"
    rng = np.random.default_rng(3)
    backend = backends_for(dtype)[0]
    qkv = to_device(rng.standard_normal((1, 40, 3, 68)), dtype, backend)
    q, k, v = (narrow(narrow(qkv, 2, i, i + 1), 3, 0, 64) for i in range(3))
    before = counts()
    out, lse = ra.attention(q, k, v, causal=True, return_lse=True)
    assert ran(before) == "generic"
    ref_out, ref_lse = testing.ref_attention(to_host(q), to_host(k), to_host(v), causal=True)
    close(out, ref_out, dtype)
    close(lse, ref_lse, "float32")


# ---- both families against the reference ------------------------------------

# (B, S_q, S_k, H, H_kv): several 128-row query blocks and 128-key tiles of
# the Hopper kernel, several 64-wide ones of the mma.sync kernel; GQA, MQA,
# S_q != S_k both ways (bottom-right causal: rows that see no key)
SHAPES = [(1, 300, 333, 4, 2), (2, 65, 200, 3, 1), (1, 200, 65, 2, 2)]
GRID = [(dt, D, s, c) for dt in ("bfloat16", "float16") for D in (64, 128)
        for s in range(len(SHAPES)) for c in (False, True)
        if not EMULATED or (s + c + D // 64 + (dt == "float16")) % 2 == 0]


@pytest.mark.parametrize("dtype,D,shape,causal", GRID)
def test_forward_matches_reference(family, dtype, D, shape, causal):
    B, Sq, Sk, H, Hkv = SHAPES[shape]
    rng = np.random.default_rng(zlib.crc32(repr((dtype, D, shape, causal)).encode()))
    q, k, v = make_qkv(rng, B, Sq, Sk, H, Hkv, D, dtype)
    before = counts()
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
    assert ran(before) == family
    ref_out, ref_lse = testing.ref_attention(to_host(q), to_host(k), to_host(v), causal=causal)
    close(out, ref_out, dtype)
    close(lse, ref_lse, "float32")


@pytest.mark.parametrize("D", [64, 128])
def test_huge_scores(family, D):
    # q * 1e9 in bfloat16: one key dominates each row by a margin of 1e9
    rng = np.random.default_rng(D + 5)
    q, k, v = make_qkv(rng, 1, 130, 150, 2, 2, D, "bfloat16", q_scale=1e9)
    out, lse = ra.attention(q, k, v, return_lse=True)
    ref_out, ref_lse = testing.ref_attention(to_host(q), to_host(k), to_host(v))
    close(out, ref_out, "bfloat16")
    assert np.abs(to_host(lse) - ref_lse).max() <= 1e-6 * np.abs(ref_lse).max()


@pytest.mark.parametrize("D", [64, 128])
def test_ring_steps_accumulate_with_offsets(family, D):
    # keys in three chunks, each at its positions, continued into a float32
    # running state (out, lse) by the LSE rule, as a ring step does
    dtype, B, Sq, Sk, H, Hkv = "bfloat16", 1, 150, 400, 4, 2
    rng = np.random.default_rng(D + 11)
    q, k, v = make_qkv(rng, B, Sq, Sk, H, Hkv, D, dtype)
    out = zeros((B, Sq, H, D), "float32", like=q)
    lse = full((B, H, Sq), -np.inf, "float32", like=q)
    qpos0 = 250   # queries at 250..399: causal rows see 251..400 keys
    for lo, hi in ((0, 130), (130, 290), (290, 400)):
        ra._C.attn_fwd(q, narrow(k, 1, lo, hi), narrow(v, 1, lo, hi), causal=True, out=out,
                       lse=lse, accumulate=True, q_pos_offset=qpos0, k_pos_offset=lo)
    ref_out, ref_lse = testing.ref_attention(to_host(q), to_host(k), to_host(v), causal=True,
                                             q_pos=np.arange(Sq) + qpos0, k_pos=np.arange(Sk))
    close(out, ref_out, dtype)
    close(lse, ref_lse, "float32")


def test_an_empty_call_leaves_the_running_state_alone(family):
    # keys all in the causal future of every query: nothing to add
    dtype, D = "float16", 128
    rng = np.random.default_rng(13)
    q, k, v = make_qkv(rng, 1, 70, 90, 2, 1, D, dtype)
    out = full((1, 70, 2, D), 0.5, "float32", like=q)
    lse = full((1, 2, 70), 1.25, "float32", like=q)
    ra._C.attn_fwd(q, k, v, causal=True, out=out, lse=lse, accumulate=True,
                   q_pos_offset=0, k_pos_offset=1000)
    assert np.all(to_host(out) == 0.5) and np.all(to_host(lse) == 1.25)


MASKS = {
    "docs": lambda rng, B, Sq, Sk: {
        "segment_ids": np.sort(rng.integers(0, 5, (B, Sq)), axis=1),
        "kv_segment_ids": np.sort(rng.integers(0, 5, (B, Sk)), axis=1)},
    "docs-unsorted": lambda rng, B, Sq, Sk: {
        "segment_ids": rng.integers(0, 3, (B, Sq)), "kv_segment_ids": rng.integers(0, 3, (B, Sk))},
    "one-doc": lambda rng, B, Sq, Sk: {   # every tile's ids are the block's one id
        "segment_ids": np.full((B, Sq), 7), "kv_segment_ids": np.full((B, Sk), 7)},
    "window": lambda rng, B, Sq, Sk: {"window": (37, 5)},
    "window-left": lambda rng, B, Sq, Sk: {"window": (None, 0)},
    "softcap": lambda rng, B, Sq, Sk: {"softcap": 3.0},
    "all": lambda rng, B, Sq, Sk: {
        "segment_ids": np.sort(rng.integers(0, 3, (B, Sq)), axis=1),
        "kv_segment_ids": np.sort(rng.integers(0, 3, (B, Sk)), axis=1),
        "window": (90, 7), "softcap": 5.0},
}


@pytest.mark.parametrize("case", list(MASKS))
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_masked_forward_matches_reference(family, case, D, causal):
    if EMULATED and (len(case) + D // 64 + causal) % 2:
        pytest.skip("real GPUs only: the emulated GPU runs every case at one (D, causal) pair")
    dtype = "bfloat16" if D == 128 else "float16"
    B, Sq, Sk, H, Hkv = 2, 200, 290, 2, 1
    rng = np.random.default_rng(zlib.crc32(repr((case, D, causal)).encode()))
    q, k, v = make_qkv(rng, B, Sq, Sk, H, Hkv, D, dtype, q_scale=2.0)
    masks = MASKS[case](rng, B, Sq, Sk)
    dev = {key: (ids_to_device(val.astype(np.int32), backends_for(dtype)[0])
                 if key.endswith("segment_ids") else val) for key, val in masks.items()}
    before = counts()
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True, **dev)
    assert ran(before) == family
    ref_out, ref_lse = testing.ref_attention(to_host(q), to_host(k), to_host(v), causal=causal,
                                             **masks)
    close(out, ref_out, dtype)
    close(lse, ref_lse, "float32")


def test_the_families_agree(monkeypatch):
    if len(FAMILIES) < 2:
        pytest.skip(f"this device runs the {DEFAULT} family only")
    rng = np.random.default_rng(17)
    q, k, v = make_qkv(rng, 1, 257, 300, 4, 1, 128, "float16")
    monkeypatch.delenv("RINGATTN_CUDA_KERNELS", raising=False)
    a, la = ra.attention(q, k, v, causal=True, return_lse=True)
    monkeypatch.setenv("RINGATTN_CUDA_KERNELS", "sm80")
    b, lb = ra.attention(q, k, v, causal=True, return_lse=True)
    close(a, to_host(b), "float16")
    close(la, to_host(lb), "float32")
