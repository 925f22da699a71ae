"""GPU tests of the Hopper (sm_90a) attention backward (cuda/hopper/
attn_bwd_wg.cu: wgmma, bulk tensor copies, warp specialisation), which the
dispatcher runs for float16/bfloat16 at head_dim 64 and 128, with or
without masks (documents, windows, soft-capping) and dilated attention's
branches (tests/test_cuda_branches.py), where the device's family is
"sm90a" (compute capability 9.0 with a build for sm_90a, and the emulated
GPU, an sm_90 device): deterministic=False all of it, deterministic=True
its dk/dv pass (the kernel without its dq product) and the wgmma dq pass
(cuda/hopper/attn_bwd_wg_dq.cu).

Each test checks which backward kernel ran (``_C.cuda_bwd_kernel_counts()``)
and compares it with the float64 reference of ``ringattn.testing`` at
tests/test_cuda.py's tolerance, and with the mma.sync family
(``RINGATTN_CUDA_KERNELS=sm80``) on the same inputs: odd sizes (S not a
multiple of the 64-row query tiles or 128-key blocks, S_q != S_k both
ways), GQA, causal and not, the ring's accumulate with position offsets,
rows that see no key, huge scores, a NaN input, the masks (every mask case
of tests/test_masks.py, long documents whose query tiles are skipped or
need no id test, blocks no query sees, the ring's masked steps), and
deterministic=True (the same bits on every run).
"""
import zlib

import numpy as np
import pytest

ra = pytest.importorskip("ringattn")
testing = pytest.importorskip("ringattn.testing")

pytestmark = pytest.mark.gpu

from gpu_arrays import (CUDA, EMULATED, backends_for, narrow, to_device, to_host,  # noqa: E402
                        zeros)

if not CUDA:
    pytest.skip(f"no CUDA device: {ra.cuda_info()['reason']}", allow_module_level=True)

if ra.cuda_info()["backward_kernels"] != "sm90a":
    pytest.skip("the device does not run the sm90a family", allow_module_level=True)

from test_cuda import TOL, close  # noqa: E402  (test_cuda.py's tolerance)


def counts():
    return ra._C.cuda_bwd_kernel_counts()


def ran(before):
    """The kernel of the one backward call since `before` (counts)."""
    after = counts()
    diff = {k: after[k] - before[k] for k in after}
    assert sum(diff.values()) == 1, diff
    return max(diff, key=diff.get)


def make(rng, B, Sq, Sk, H, Hkv, D, dtype, q_scale=1.0):
    backend = backends_for(dtype)[0]
    q = to_device(rng.standard_normal((B, Sq, H, D)) * q_scale, dtype, backend)
    k = to_device(rng.standard_normal((B, Sk, Hkv, D)), dtype, backend)
    v = to_device(rng.standard_normal((B, Sk, Hkv, D)), dtype, backend)
    dout = to_device(rng.standard_normal((B, Sq, H, D)), dtype, backend)
    return q, k, v, dout


def both(monkeypatch, *args, **kw):
    """The backward on the Hopper kernel, then on the mma.sync family."""
    monkeypatch.delenv("RINGATTN_CUDA_KERNELS", raising=False)
    before = counts()
    wg = ra.attention_backward(*args, **kw)
    assert ran(before) == "sm90a"
    if kw.get("deterministic"):
        # the same bits on every run
        before = counts()
        again = ra.attention_backward(*args, **kw)
        assert ran(before) == "sm90a"
        for a, b in zip(wg, again):
            assert to_host(a).tobytes() == to_host(b).tobytes()
    monkeypatch.setenv("RINGATTN_CUDA_KERNELS", "sm80")
    before = counts()
    mma = ra.attention_backward(*args, **kw)
    assert ran(before) == "sm80"
    monkeypatch.delenv("RINGATTN_CUDA_KERNELS")
    return wg, mma


def test_cuda_info_names_the_backward_family(monkeypatch):
    monkeypatch.delenv("RINGATTN_CUDA_KERNELS", raising=False)
    assert ra.cuda_info()["backward_kernels"] == "sm90a"
    monkeypatch.setenv("RINGATTN_CUDA_KERNELS", "sm80")
    assert ra.cuda_info()["backward_kernels"] == "sm80"


# (B, S_q, S_k, H, H_kv): several 128-key blocks and 64-row query tiles,
# none a multiple; GQA and MQA; S_q != S_k both ways (bottom-right causal:
# rows that see no key)
SHAPES = [(1, 300, 333, 4, 2), (2, 65, 200, 3, 1), (1, 200, 65, 2, 2), (1, 77, 77, 2, 1)]
GRID = [(dt, D, s, c) for dt in ("bfloat16", "float16") for D in (64, 128)
        for s in range(len(SHAPES)) for c in (False, True)
        if not EMULATED or (s + c + D // 64 + (dt == "float16")) % 2 == 0]


@pytest.mark.parametrize("dtype,D,shape,causal", GRID)
def test_backward_matches_reference_and_mma_sync(monkeypatch, dtype, D, shape, causal):
    B, Sq, Sk, H, Hkv = SHAPES[shape]
    rng = np.random.default_rng(zlib.crc32(repr(("wgb", dtype, D, shape, causal)).encode()))
    q, k, v, dout = make(rng, B, Sq, Sk, H, Hkv, D, dtype)
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
    wg, mma = both(monkeypatch, dout, q, k, v, out, lse, causal=causal)
    refs = testing.ref_attention_backward(to_host(dout), to_host(q), to_host(k), to_host(v),
                                          causal=causal, out=to_host(out))
    for got, other, ref in zip(wg, mma, refs):
        close(got, ref, dtype)
        close(got, to_host(other).astype(np.float64), dtype)


@pytest.mark.parametrize("det", [False, True], ids=["fused", "deterministic"])
@pytest.mark.parametrize("D", [64, 128])
def test_ring_steps_accumulate_with_offsets(D, det):
    # the ring's calls: keys in chunks at their positions, gradients added
    # into float32 dq, dk, dv (dq straight from the atomics, or from the
    # wgmma dq pass); rows 0..49 of the first chunk's call see no key of
    # it (causal, keys in their future)
    dtype, B, Sq, Sk, H, Hkv = "float16", 1, 100, 333, 4, 2
    rng = np.random.default_rng(D + 41)
    q, k, v, dout = make(rng, B, Sq, Sk, H, Hkv, D, dtype)
    qpos0 = Sk - Sq
    qpos = np.arange(Sq) + qpos0
    out, lse = ra._C.attn_fwd(q, k, v, causal=True, q_pos_offset=qpos0)
    grads = [zeros(tuple(x.shape), "float32", like=q) for x in (q, k, v)]
    for lo, hi in ((0, 130), (130, 150), (150, 333)):
        before = counts()
        ra._C.attn_bwd(dout, q, narrow(k, 1, lo, hi), narrow(v, 1, lo, hi), out, lse,
                       causal=True, dq=grads[0], dk=narrow(grads[1], 1, lo, hi),
                       dv=narrow(grads[2], 1, lo, hi), accumulate=True,
                       q_pos_offset=qpos0, k_pos_offset=lo, deterministic=det)
        assert ran(before) == "sm90a"
    refs = testing.ref_attention_backward(to_host(dout), to_host(q), to_host(k), to_host(v),
                                          causal=True, q_pos=qpos, k_pos=np.arange(Sk),
                                          out=to_host(out))
    for got, ref in zip(grads, refs):
        close(got, ref, dtype)


def test_rows_that_see_no_key_contribute_nothing(monkeypatch):
    # keys at positions 40.. : causal queries 0..39 see none (lse -inf, out
    # 0); their dq is 0 and they add nothing to dk, dv
    dtype, D = "bfloat16", 64
    rng = np.random.default_rng(43)
    q, k, v, dout = make(rng, 1, 150, 140, 2, 1, D, dtype)
    out, lse = ra._C.attn_fwd(q, k, v, causal=True, q_pos_offset=0, k_pos_offset=40)
    assert np.all(to_host(lse)[:, :, :40] == -np.inf)
    f32 = [zeros(tuple(x.shape), "float32", like=q) for x in (q, k, v)]
    before = counts()
    ra._C.attn_bwd(dout, q, k, v, out, lse, causal=True, dq=f32[0], dk=f32[1], dv=f32[2],
                   q_pos_offset=0, k_pos_offset=40)
    assert ran(before) == "sm90a"
    refs = testing.ref_attention_backward(to_host(dout), to_host(q), to_host(k), to_host(v),
                                          causal=True, q_pos=np.arange(150),
                                          k_pos=np.arange(140) + 40, out=to_host(out))
    assert np.all(to_host(f32[0])[:, :40] == 0)
    for got, ref in zip(f32, refs):
        close(got, ref, dtype)


@pytest.mark.parametrize("D", [64, 128])
def test_huge_scores(D):
    # q * 1e9 in bfloat16: the exponent rule's band gives the dominant key
    # P = 1 (tests/test_cuda.py test_tensor_core_backward_is_right_at_1e9)
    rng = np.random.default_rng(D + 47)
    q, k, v, dout = make(rng, 1, 130, 150, 2, 2, D, "bfloat16", q_scale=1e9)
    out, lse = ra.attention(q, k, v, return_lse=True)
    before = counts()
    dq, dk, dv = ra.attention_backward(dout, q, k, v, out, lse)
    assert ran(before) == "sm90a"
    qh, kh, vh = to_host(q), to_host(k), to_host(v)
    rdq, rdk, rdv = testing.ref_attention_backward(to_host(dout), qh, kh, vh)
    for g in (dq, dk, dv):
        assert np.isfinite(to_host(g)).all(), "non-finite gradient"
    close(dv, rdv, "bfloat16")
    close(dq, rdq, "bfloat16")
    err = np.abs(to_host(dk) - rdk).max()   # dk carries q's magnitude
    assert err <= TOL["bfloat16"] * np.abs(qh).max(), err


def test_a_nan_reaches_what_the_mma_sync_kernel_reaches(monkeypatch):
    # a NaN in one query row: both families make the same gradients NaN
    dtype, D = "float16", 64
    rng = np.random.default_rng(53)
    B, Sq, Sk, H, Hkv = 1, 70, 150, 2, 1
    qh = rng.standard_normal((B, Sq, H, D))
    qh[0, 33, 1, 5] = np.nan
    q = to_device(qh, dtype, backends_for(dtype)[0])
    _, k, v, dout = make(rng, B, Sq, Sk, H, Hkv, D, dtype)
    out, lse = ra.attention(q, k, v, causal=True, return_lse=True)
    wg, mma = both(monkeypatch, dout, q, k, v, out, lse, causal=True)
    for a, b in zip(wg, mma):
        a, b = to_host(a), to_host(b)
        assert np.isnan(a).any()
        assert np.array_equal(np.isnan(a), np.isnan(b))
        fin = ~np.isnan(a)
        assert np.abs(a[fin].astype(np.float64) - b[fin]).max() <= \
            TOL[dtype] * max(1.0, np.abs(b[fin]).max())


# ---- deterministic=True: the dk/dv pass and the dq pass on wgmma -----------

@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_backward_repeats_its_bits(monkeypatch, D, causal):
    # against float64 and the split mma.sync pair; two runs, the same bits
    dtype = "bfloat16" if causal else "float16"
    B, Sq, Sk, H, Hkv = SHAPES[0]
    rng = np.random.default_rng(D + 53 + causal)
    q, k, v, dout = make(rng, B, Sq, Sk, H, Hkv, D, dtype)
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
    wg, mma = both(monkeypatch, dout, q, k, v, out, lse, causal=causal, deterministic=True)
    refs = testing.ref_attention_backward(to_host(dout), to_host(q), to_host(k), to_host(v),
                                          causal=causal, out=to_host(out))
    for got, other, ref in zip(wg, mma, refs):
        close(got, ref, dtype)
        close(got, to_host(other).astype(np.float64), dtype)


# ---- masks: documents, windows, soft-capping ------------------------------

from test_cuda import MASK_CASES, mask_case, on_device  # noqa: E402

# (B, S_q, S_k, H, H_kv): GQA, S_q != S_k both ways, several 128-key blocks
MASK_SHAPES = [(2, 150, 203, 4, 2), (1, 203, 150, 2, 1)]
MASK_GRID = [(dt, D, case, c) for dt in ("bfloat16", "float16") for D in (64, 128)
             for case in MASK_CASES for c in (False, True)
             if not EMULATED
             or (MASK_CASES.index(case) + 3 * c + D // 64 + 2 * (dt == "float16")) % 4 == 0]


def masked_inputs(rng, dtype, D, shape, host):
    B, Sq, Sk, H, Hkv = shape
    q, k, v, dout = make(rng, B, Sq, Sk, H, Hkv, D, dtype,
                         q_scale=3.0 if "softcap" in host else 1.0)
    return q, k, v, dout, on_device(host, backends_for(dtype)[0])


def check_masked(monkeypatch, dtype, D, shape, host, causal, rng, deterministic=False):
    """The masked backward on the Hopper kernel and on the mma.sync one,
    each against the float64 reference and the two against each other;
    returns the Hopper kernel's gradients."""
    q, k, v, dout, masks = masked_inputs(rng, dtype, D, shape, host)
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True, **masks)
    wg, mma = both(monkeypatch, dout, q, k, v, out, lse, causal=causal,
                   deterministic=deterministic, **masks)
    refs = testing.ref_attention_backward(to_host(dout), to_host(q), to_host(k), to_host(v),
                                          causal=causal, out=to_host(out), **host)
    for got, other, ref in zip(wg, mma, refs):
        close(got, ref, dtype)
        close(got, to_host(other).astype(np.float64), dtype)
    return wg


@pytest.mark.parametrize("dtype,D,case,causal", MASK_GRID)
def test_masked_backward_matches_reference_and_mma_sync(monkeypatch, dtype, D, case, causal):
    rng = np.random.default_rng(zlib.crc32(repr(("wgbm", dtype, D, case, causal)).encode()))
    shape = MASK_SHAPES[MASK_CASES.index(case) % 2]
    host = mask_case(case, rng, *shape[:3])
    check_masked(monkeypatch, dtype, D, shape, host, causal, rng)


# deterministic=True on every mask case (the dk/dv pass's masked
# instantiation), each D, a dtype and causality per case
DET_MASK_GRID = [(("bfloat16", "float16")[(i + D // 64) % 2], D, case, (i + D // 64) % 3 != 0)
                 for i, case in enumerate(MASK_CASES) for D in (64, 128)
                 if not EMULATED or (i + D // 64) % 2 == 0]


@pytest.mark.parametrize("dtype,D,case,causal", DET_MASK_GRID)
def test_masked_deterministic_backward(monkeypatch, dtype, D, case, causal):
    rng = np.random.default_rng(zlib.crc32(repr(("wgbd", dtype, D, case, causal)).encode()))
    shape = MASK_SHAPES[MASK_CASES.index(case) % 2]
    host = mask_case(case, rng, *shape[:3])
    check_masked(monkeypatch, dtype, D, shape, host, causal, rng, deterministic=True)


def doc_ids(lengths):
    return np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)[None, :]


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_long_documents_skip_tiles_and_the_id_test(monkeypatch, D, causal):
    # documents longer than a 64-row query tile and a 128-key block: blocks
    # of one id (tiles of that id need no id test), tiles of no id of a
    # block (skipped), and short documents between them
    lengths = [150, 3, 200, 1, 70, 9]
    ids = doc_ids(lengths)
    rng = np.random.default_rng(D + 61 + causal)
    check_masked(monkeypatch, "float16", D, (1, ids.shape[1], ids.shape[1], 2, 1),
                 {"segment_ids": ids}, causal, rng)


def test_documents_and_window_and_softcap_at_once(monkeypatch):
    lengths = [97, 130, 5, 101]
    ids = doc_ids(lengths)
    rng = np.random.default_rng(67)
    check_masked(monkeypatch, "bfloat16", 128, (1, ids.shape[1], ids.shape[1], 4, 2),
                 {"segment_ids": ids, "window": (70, 11), "softcap": 6.0}, True, rng)


@pytest.mark.parametrize("host,unseen", [
    ({"window": (0, 0)}, slice(0, 256)),
    ({"segment_ids": np.zeros((1, 70), np.int32),
      "kv_segment_ids": (np.arange(333) >= 100).astype(np.int32)[None, :]}, slice(128, 333))],
    ids=["window", "docs"])
@pytest.mark.parametrize("det", [False, True], ids=["fused", "deterministic"])
def test_blocks_no_query_sees_end_at_once(monkeypatch, host, unseen, det):
    # 70 queries, 333 keys: under the window (0, 0) the queries sit at
    # positions 263.. (bottom-right) and see only their own key, so the
    # blocks of keys 0..255 see no query; with the documents keys 100.. are
    # another document, so the blocks of keys 128.. see none.  Those blocks
    # load nothing and their dk, dv are 0.
    rng = np.random.default_rng(71)
    wg = check_masked(monkeypatch, "float16", 64, (1, 70, 333, 2, 2), host, False, rng,
                      deterministic=det)
    for g in wg[1:]:
        g = to_host(g)
        assert np.all(g[:, unseen] == 0) and np.abs(g).max() > 0


@pytest.mark.parametrize("det", [False, True], ids=["fused", "deterministic"])
@pytest.mark.parametrize("D", [64, 128])
def test_masked_ring_steps_accumulate_with_offsets(D, det):
    # the ring's calls with documents and a window: keys in chunks at their
    # positions (their ids the chunk's), gradients added into float32
    dtype, B, Sq, Sk, H, Hkv = "bfloat16", 1, 100, 333, 4, 2
    rng = np.random.default_rng(D + 73)
    q, k, v, dout = make(rng, B, Sq, Sk, H, Hkv, D, dtype)
    backend = backends_for(dtype)[0]
    kv_ids = doc_ids([120, 90, 123])
    q_ids = kv_ids[:, Sk - Sq:]
    qpos0 = Sk - Sq
    window = (150, 0)
    dev = on_device({"segment_ids": q_ids, "kv_segment_ids": kv_ids}, backend)
    out, lse = ra._C.attn_fwd(q, k, v, causal=True, q_pos_offset=qpos0, window=window,
                              segment_ids=dev["segment_ids"],
                              kv_segment_ids=dev["kv_segment_ids"])
    grads = [zeros(tuple(x.shape), "float32", like=q) for x in (q, k, v)]
    for lo, hi in ((0, 130), (130, 150), (150, 333)):
        kv_chunk = on_device({"kv_segment_ids": kv_ids[:, lo:hi]}, backend)["kv_segment_ids"]
        before = counts()
        ra._C.attn_bwd(dout, q, narrow(k, 1, lo, hi), narrow(v, 1, lo, hi), out, lse,
                       causal=True, dq=grads[0], dk=narrow(grads[1], 1, lo, hi),
                       dv=narrow(grads[2], 1, lo, hi), accumulate=True,
                       q_pos_offset=qpos0, k_pos_offset=lo, window=window,
                       segment_ids=dev["segment_ids"], kv_segment_ids=kv_chunk,
                       deterministic=det)
        assert ran(before) == "sm90a"
    refs = testing.ref_attention_backward(to_host(dout), to_host(q), to_host(k), to_host(v),
                                          causal=True, q_pos=np.arange(Sq) + qpos0,
                                          k_pos=np.arange(Sk), out=to_host(out),
                                          segment_ids=q_ids, kv_segment_ids=kv_ids,
                                          window=window)
    for got, ref in zip(grads, refs):
        close(got, ref, dtype)


def test_softcap_with_large_scores(monkeypatch):
    # q * 30 under softcap 5: most scores sit on the cap, where 1 - u^2 is
    # small and rounds; the Hopper kernel's dS uses the forward's very tanh
    rng = np.random.default_rng(79)
    shape = (1, 130, 150, 2, 2)
    q, k, v, dout = make(rng, *shape, 128, "bfloat16", q_scale=30.0)
    out, lse = ra.attention(q, k, v, causal=True, return_lse=True, softcap=5.0)
    wg, mma = both(monkeypatch, dout, q, k, v, out, lse, causal=True, softcap=5.0)
    refs = testing.ref_attention_backward(to_host(dout), to_host(q), to_host(k), to_host(v),
                                          causal=True, out=to_host(out), softcap=5.0)
    for got, other, ref in zip(wg, mma, refs):
        assert np.isfinite(to_host(got)).all()
        close(got, to_host(other).astype(np.float64), "bfloat16")
    close(wg[2], refs[2], "bfloat16")
