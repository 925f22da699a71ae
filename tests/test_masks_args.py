"""The mask arguments: bad input raises the named error before any work
(through ra.attention, ra.attention_backward and the C entry points with
check_only=True); ra.segment_ids; integer Buffers carrying ids."""

import numpy as np
import pytest

import ringattn as ra
from ringattn import _C
from ringattn import testing as rt

B, S_Q, S_K, H, H_KV, D = 2, 7, 9, 4, 2, 8


@pytest.fixture
def qkv(rng):
    return rt.random_qkv(rng, B, S_Q, S_K, H, H_KV, D, "float32")


def good_ids():
    return {"segment_ids": np.zeros((B, S_Q), np.int32),
            "kv_segment_ids": np.zeros((B, S_K), np.int32)}


BAD = [
    # (keywords, exception, words the message must hold)
    ({"segment_ids": np.zeros((B, S_Q), np.float32),
      "kv_segment_ids": np.zeros((B, S_K), np.int32)},
     TypeError, ["segment_ids", "integer", "float32"]),
    ({"segment_ids": np.zeros((B, S_Q), np.int32),
      "kv_segment_ids": np.zeros((B, S_K), bool)},
     TypeError, ["kv_segment_ids", "integer", "bool"]),
    ({"segment_ids": np.zeros((B, S_Q + 1), np.int32),
      "kv_segment_ids": np.zeros((B, S_K), np.int32)},
     ValueError, ["segment_ids", f"({B}, {S_Q})", f"({B}, {S_Q + 1})"]),
    ({"segment_ids": np.zeros((B, S_Q), np.int32),
      "kv_segment_ids": np.zeros((B + 1, S_K), np.int32)},
     ValueError, ["kv_segment_ids", f"({B}, {S_K})"]),
    ({"segment_ids": np.zeros((S_Q,), np.int32),
      "kv_segment_ids": np.zeros((B, S_K), np.int32)},
     ValueError, ["segment_ids", f"({S_Q},)"]),
    ({"kv_segment_ids": np.zeros((B, S_K), np.int32)},
     ValueError, ["kv_segment_ids", "without segment_ids"]),
    ({"segment_ids": np.zeros((B, S_Q), np.int32)},      # S_q != S_k
     ValueError, ["kv_segment_ids", f"S_q {S_Q}", f"S_k {S_K}"]),
    ({"segment_ids": np.full((B, S_Q), 2**31, np.int64),
      "kv_segment_ids": np.zeros((B, S_K), np.int32)},
     ValueError, ["segment_ids", "int32", str(2**31)]),
    ({"segment_ids": np.zeros((B, S_Q), np.int32),
      "kv_segment_ids": np.full((B, S_K), 2**64 - 1, np.uint64)},
     ValueError, ["kv_segment_ids", "int32", "uint64"]),
    ({"segment_ids": "abc"}, TypeError, ["segment_ids", "str"]),
    ({"window": (-1, 0)}, ValueError, ["window", "left", "-1"]),
    ({"window": (0, -3)}, ValueError, ["window", "right", "-3"]),
    ({"window": (1.5, 0)}, TypeError, ["window", "float"]),
    ({"window": (True, 0)}, TypeError, ["window", "bool"]),
    ({"window": 4}, TypeError, ["window", "(left, right)"]),
    ({"window": (1, 2, 3)}, TypeError, ["window", "(left, right)"]),
    ({"window": "ab"}, TypeError, ["window", "(left, right)"]),
    ({"softcap": 0.0}, ValueError, ["softcap", "[1e-30, 1e+30]", "0.0"]),
    # outside the range the float32 kernels hold (a cap that rounds to
    # infinity or 0 in float32 gave NaN or no cap)
    ({"softcap": 1e39}, ValueError, ["softcap", "[1e-30, 1e+30]", "1e+39"]),
    ({"softcap": 2e30}, ValueError, ["softcap", "2e+30"]),
    ({"softcap": 1e-46}, ValueError, ["softcap", "1e-46"]),
    ({"softcap": -2.0}, ValueError, ["softcap", "-2.0"]),
    ({"softcap": float("nan")}, ValueError, ["softcap", "nan"]),
    ({"softcap": float("inf")}, ValueError, ["softcap", "inf"]),
    ({"softcap": "3"}, TypeError, ["softcap", "str"]),
    ({"softcap": True}, TypeError, ["softcap", "bool"]),
]
BAD_IDS = [pytest.param(kw, exc, words, id=f"{i}-{next(iter(kw))}")
           for i, (kw, exc, words) in enumerate(BAD)]


def raises_named(exc, words):
    """pytest.raises(exc) whose message must name every one of `words`."""
    import contextlib

    @contextlib.contextmanager
    def check():
        with pytest.raises(exc) as info:
            yield
        for w in words:
            assert w in str(info.value), f"{w!r} not in {str(info.value)!r}"
    return check()


@pytest.mark.parametrize("kw,exc,words", BAD_IDS)
def test_attention_refuses(qkv, kw, exc, words):
    q, k, v = qkv
    with raises_named(exc, words):
        ra.attention(q, k, v, **kw)


@pytest.mark.parametrize("kw,exc,words", BAD_IDS)
def test_attention_backward_refuses(qkv, kw, exc, words):
    q, k, v = qkv
    out, lse = ra.attention(q, k, v, return_lse=True)
    with raises_named(exc, words):
        ra.attention_backward(out, q, k, v, out, lse, **kw)


@pytest.mark.parametrize("kw,exc,words", BAD_IDS)
def test_check_only_covers_the_masks(qkv, kw, exc, words):
    q, k, v = qkv
    out, lse = ra.attention(q, k, v, return_lse=True)
    with raises_named(exc, words):
        _C.attn_fwd(q, k, v, check_only=True, **kw)
    with raises_named(exc, words):
        _C.attn_bwd(out, q, k, v, out, lse, check_only=True, **kw)


def test_check_only_passes_good_masks(qkv):
    q, k, v = qkv
    out, lse = ra.attention(q, k, v, return_lse=True)
    kw = dict(good_ids(), window=(3, None), softcap=5)
    assert _C.attn_fwd(q, k, v, check_only=True, **kw) is None
    assert _C.attn_bwd(out, q, k, v, out, lse, check_only=True, **kw) is None


def test_a_bad_mask_leaves_the_running_state_alone(qkv):
    """Refused before any work: an accumulate call with a bad window does
    not touch out/lse."""
    q, k, v = qkv
    out = np.full((B, S_Q, H, D), 3.0, np.float32)
    lse = np.full((B, H, S_Q), 1.5, np.float32)
    with pytest.raises(ValueError):
        _C.attn_fwd(q, k, v, out=out, lse=lse, accumulate=True,
                    window=(2, -1))
    assert (out == 3.0).all() and (lse == 1.5).all()


def test_dilated_branches_take_no_masks(qkv):
    q, k, v = qkv
    out, lse = ra.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="branches"):
        _C.attn_bwd(out, q, k, v, out, lse, branches=([4], [1]),
                    window=(1, 1))


def test_masks_take_any_array_kind(qkv):
    """Ids from a Buffer, a read-only array and a list-built array."""
    q, k, v = qkv
    ids = good_ids()
    want = ra.attention(q, k, v, **ids)
    ro = ids["segment_ids"].copy()
    ro.flags.writeable = False
    got = ra.attention(q, k, v, segment_ids=ra.from_dlpack(ro),
                       kv_segment_ids=np.array([[0] * S_K] * B))
    np.testing.assert_array_equal(got, want)


# ---- ra.segment_ids ------------------------------------------------------

@pytest.mark.parametrize("cu,n", [
    ([0], 0), ([0], 5), ([0, 5], 5), ([0, 1, 2, 3], 3), ([0, 3, 3, 5], 7),
    ([0, 0, 4], 4), (np.array([0, 2, 9], np.uint8), 12),
    (np.array([0, 100, 1000], np.int64), 1000), ((0, 4), 6)])
def test_segment_ids_match_the_reference(cu, n):
    ids = ra.segment_ids(cu, n)
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int32
    assert ids.shape == (1, n)
    np.testing.assert_array_equal(ids, rt.ref_segment_ids(cu, n))


def test_segment_ids_random(rng):
    for _ in range(20):
        n = int(rng.integers(0, 300))
        cuts = np.sort(rng.integers(0, n + 1, int(rng.integers(0, 12))))
        cu = np.concatenate([[0], cuts])
        np.testing.assert_array_equal(ra.segment_ids(cu, n),
                                      rt.ref_segment_ids(cu, n))


@pytest.mark.parametrize("cu,n,exc,words", [
    ([], 4, ValueError, ["cu_seqlens", "first entry 0"]),
    ([1, 3], 4, ValueError, ["cu_seqlens", "first entry 0", "[1, 3]"]),
    ([0, 3, 2], 4, ValueError, ["non-decreasing", "2 after 3", "position 2"]),
    ([0, 5], 4, ValueError, ["seq_len = 4", "5"]),
    ([[0, 1]], 4, TypeError, ["cu_seqlens", "integers"]),
    (np.array([[0, 1]]), 4, ValueError, ["cu_seqlens", "1 dimension", "(1, 2)"]),
    ([0, 1.5], 4, TypeError, ["cu_seqlens", "integers"]),
    (np.array([0.0, 2.0]), 4, TypeError, ["cu_seqlens", "float64"]),
    (np.array([True, False]), 4, TypeError, ["cu_seqlens", "bool"]),
    ("0,2", 4, TypeError, ["cu_seqlens"]),
    ([0, 2], -1, ValueError, ["seq_len", "-1"]),
    ([0, 2], 2.0, TypeError, ["seq_len", "float"]),
    ([0, 2], True, TypeError, ["seq_len"]),
])
def test_segment_ids_refuses(cu, n, exc, words):
    with raises_named(exc, words):
        ra.segment_ids(cu, n)


def test_segment_ids_from_torch_stay_torch():
    torch = pytest.importorskip("torch")
    ids = ra.segment_ids(torch.tensor([0, 2, 5]), 6)
    assert isinstance(ids, torch.Tensor) and ids.dtype == torch.int32
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2]]


# ---- integer Buffers -------------------------------------------------------

@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64",
                                   "uint8", "uint16", "uint32", "uint64"])
def test_integer_buffers(dtype):
    z = ra.zeros((2, 3), dtype)
    assert z.dtype == dtype and (z.numpy() == 0).all()
    assert z.numpy().dtype == np.dtype(dtype)
    src = np.arange(12, dtype=dtype).reshape(3, 4)[:, ::2].T   # strided
    z.copy_(src)
    np.testing.assert_array_equal(z.numpy(), src)
    np.testing.assert_array_equal(np.from_dlpack(z), src)
    e = ra.empty((4,), dtype)
    assert e.shape == (4,) and e.dtype == dtype
    back = ra.from_dlpack(np.arange(5, dtype=dtype))
    assert back.dtype == dtype
    np.testing.assert_array_equal(back.numpy(), np.arange(5, dtype=dtype))


def test_integer_copies_need_one_dtype():
    z = ra.zeros((3,), "int32")
    with pytest.raises(TypeError, match="int32 from int64"):
        z.copy_(np.arange(3))
    with pytest.raises(TypeError, match="int32 from float32"):
        z.copy_(np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="float32 from int32"):
        ra.zeros((3,), "float32").copy_(np.zeros(3, np.int32))


def test_unknown_dtype_name():
    with pytest.raises(TypeError, match="int32"):
        ra.zeros((3,), "int128")
