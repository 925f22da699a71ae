"""ra.Buffer and DLPack exchange with NumPy and JAX (DESIGN.md section 5)."""

import ctypes
import gc

import numpy as np
import pytest

import ringattn as ra
from ringattn import testing as rt

_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]


def capsule_name(capsule):
    return _capsule_name(capsule).decode()


def address(array):
    return array.__array_interface__["data"][0]


# ------------------------------------------------------------ Buffer basics

def test_empty_describes_itself():
    buf = ra.empty((2, 3, 4), dtype="float32")
    assert (isinstance(buf, ra.Buffer), buf.shape, buf.strides, buf.dtype, buf.device,
            buf.nbytes) == (True, (2, 3, 4), (12, 4, 1), "float32", ("cpu", 0), 96)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_zeros_are_zero(dtype):
    buf = ra.zeros((3, 5), dtype=dtype)
    arr = buf.numpy()
    assert arr.dtype == rt.np_dtype(dtype) and np.all(arr.astype(np.float64) == 0)


def test_dlpack_device_is_cpu():
    assert ra.empty((1,)).__dlpack_device__() == (1, 0)


# ------------------------------------------------------------ capsules

def test_legacy_capsule_without_max_version():
    assert capsule_name(ra.empty((4,)).__dlpack__()) == "dltensor"


def test_versioned_capsule_with_max_version():
    assert capsule_name(ra.empty((4,)).__dlpack__(max_version=(1, 0))) == \
        "dltensor_versioned"


def test_old_max_version_gives_legacy_capsule():
    assert capsule_name(ra.empty((4,)).__dlpack__(max_version=(0, 8))) == "dltensor"


def test_unconsumed_capsules_are_freed():
    gc.collect()
    baseline = ra.memory_stats()["cpu"]["current"]
    buf = ra.empty((1000,))
    caps = [buf.__dlpack__(), buf.__dlpack__(max_version=(1, 0)),
            buf.__dlpack__(max_version=(1, 0), copy=True)]
    del buf, caps
    gc.collect()
    assert ra.memory_stats()["cpu"]["current"] == baseline


def test_unsupported_dl_device_is_buffer_error():
    with pytest.raises(BufferError):
        ra.empty((4,)).__dlpack__(max_version=(1, 0), dl_device=(2, 0))


def test_cpu_dl_device_is_accepted():
    cap = ra.empty((4,)).__dlpack__(max_version=(1, 0), dl_device=(1, 0))
    assert capsule_name(cap) == "dltensor_versioned"


# ------------------------------------------------------------ NumPy round trips

def test_from_numpy_is_zero_copy(rng):
    arr = rng.standard_normal((3, 4)).astype(np.float32)
    buf = ra.from_dlpack(arr)
    back = np.from_dlpack(buf)
    arr[1, 2] = 42.0
    assert (address(back) == address(arr) and back[1, 2] == 42.0
            and buf.numpy()[1, 2] == 42.0)


def test_writes_through_numpy_view_reach_the_buffer():
    buf = ra.zeros((2, 2), dtype="float64")
    view = np.from_dlpack(buf)
    view[0, 1] = 7.0
    assert buf.numpy()[0, 1] == 7.0


def test_strides_are_in_elements(rng):
    arr = rng.standard_normal((4, 6)).astype(np.float32)[:, ::2]
    buf = ra.from_dlpack(arr)
    assert (buf.shape, buf.strides) == ((4, 3), (6, 2)) and \
        np.array_equal(np.from_dlpack(buf), arr)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "uint8"])
def test_round_trip_keeps_dtype_and_values(rng, dtype):
    arr = (10 * rng.standard_normal((5, 3))).astype(dtype)
    back = np.from_dlpack(ra.from_dlpack(arr))
    assert back.dtype == arr.dtype and np.array_equal(back, arr)


def test_source_kept_alive_after_delete():
    arr = np.arange(1000, dtype=np.float64)
    buf = ra.from_dlpack(arr)
    del arr
    gc.collect()
    _ = [np.ones(1000) for _ in range(10)]  # reuse freed memory if it were freed
    assert np.array_equal(buf.numpy(), np.arange(1000.0))


def test_buffer_kept_alive_by_numpy_consumer():
    buf = ra.empty((500,), dtype="float64")
    view = np.from_dlpack(buf)
    view[:] = np.arange(500)
    del buf
    gc.collect()
    _ = [ra.zeros((500,), dtype="float64") for _ in range(10)]
    assert np.array_equal(view, np.arange(500.0))


def test_read_only_numpy_stays_read_only(rng):
    arr = rng.standard_normal(4)
    arr.flags.writeable = False
    buf = ra.from_dlpack(arr)
    assert buf.readonly and not np.from_dlpack(buf).flags.writeable


def test_copy_true_gives_independent_memory():
    buf = ra.zeros((8,), dtype="float32")
    copied = np.from_dlpack(buf, copy=True)
    copied[:] = 1.0
    assert address(copied) != buf.data_ptr and np.all(buf.numpy() == 0)


def test_copy_false_shares_memory():
    buf = ra.zeros((8,), dtype="float32")
    assert address(np.from_dlpack(buf, copy=False)) == buf.data_ptr


def test_from_dlpack_of_a_buffer_shares_memory():
    buf = ra.zeros((3,), dtype="float32")
    assert ra.from_dlpack(buf).data_ptr == buf.data_ptr


def test_bfloat16_numpy_in_and_out(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    arr = rng.standard_normal((4, 5)).astype(ml_dtypes.bfloat16)
    buf = ra.from_dlpack(arr)
    back = buf.numpy()
    assert (buf.dtype == "bfloat16" and back.dtype == arr.dtype
            and np.array_equal(back.view(np.uint16), arr.view(np.uint16))
            and address(back) == address(arr))


def test_consuming_twice_gives_two_valid_views():
    buf = ra.zeros((4,), dtype="float64")
    a, b = np.from_dlpack(buf), np.from_dlpack(buf)
    a[0] = 3.0
    assert b[0] == 3.0


# ------------------------------------------------------------ JAX

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_arrays_through_attention(rng, jax_module, dtype):
    jnp = jax_module.numpy
    q, k, v = rt.random_qkv(rng, 1, 17, 17, 4, 2, 16, dtype)
    out, lse = ra.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True,
                            return_lse=True)
    ref_out, ref_lse = rt.ref_attention(q, k, v, causal=True)
    assert isinstance(out, jax_module.Array) and isinstance(lse, jax_module.Array)
    rt.assert_close(out, ref_out, dtype, name="out")


def test_jax_backward_returns_jax(rng, jax_module):
    jnp = jax_module.numpy
    q, k, v = rt.random_qkv(rng, 1, 9, 9, 2, 1, 8, "float64")
    dout = rng.standard_normal(q.shape)
    jq, jk, jv, jd = (jnp.asarray(x) for x in (q, k, v, dout))
    out, lse = ra.attention(jq, jk, jv, return_lse=True)
    grads = ra.attention_backward(jd, jq, jk, jv, out, lse)
    ref = rt.ref_attention_backward(dout, q, k, v)
    assert all(isinstance(g, jax_module.Array) and g.dtype == jnp.float64 for g in grads)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        rt.assert_close(got, want, "float64", name=name)


def test_jax_round_trip_through_buffer(rng, jax_module):
    jnp = jax_module.numpy
    x = jnp.asarray(rng.standard_normal((3, 4)).astype(np.float32))
    buf = ra.from_dlpack(x)
    back = jnp.from_dlpack(buf)
    assert buf.shape == (3, 4) and np.array_equal(np.asarray(back), np.asarray(x))


# ------------------------------------------------------------ ra.to_device

@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_to_device_cpu_copies(dtype):
    x = np.random.default_rng(5).standard_normal((3, 8, 5)).astype(dtype)
    buf = ra.to_device(x[:, ::3], "cpu")
    assert isinstance(buf, ra.Buffer) and buf.owns_memory and buf.is_contiguous
    assert (buf.device, buf.dtype, buf.shape) == (("cpu", 0), dtype, (3, 3, 5))
    got = buf.numpy()
    np.testing.assert_array_equal(got, x[:, ::3])
    x[:] = 0                                   # a copy, not a view
    assert got.any()


def test_to_device_converts_dtype_and_keeps_integers():
    x = np.linspace(-2, 2, 12).reshape(3, 4)
    np.testing.assert_array_equal(ra.to_device(x, "cpu", dtype="float16").numpy(),
                                  x.astype(np.float16))
    ids = np.arange(10, dtype=np.int64).reshape(2, 5)
    back = ra.to_device(ids, ("cpu", 0)).numpy()
    assert back.dtype == np.int64
    np.testing.assert_array_equal(back, ids)
    from ringattn.interop import to_numpy

    assert to_numpy(ra.to_device(ids, "cpu")).dtype == np.int64


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda:-1", "cpu:-1", ("cuda", -2),
                                    ("cuda", True), ("cuda", "a"), ("cuda", 1.7),
                                    ("cuda", "1"), 3, None])
def test_to_device_names_a_bad_device(device):
    with pytest.raises(ValueError, match=r"device: expected 'cpu', 'cuda'"):
        ra.to_device(np.ones(3), device)


def test_cuda_buffer_without_a_gpu_says_why():
    if ra.cuda_available():
        pytest.skip("a GPU is available (tests/test_cuda_interop.py covers it)")
    with pytest.raises(RuntimeError, match="no CUDA device is usable"):
        ra.to_device(np.ones(3), "cuda")
    with pytest.raises(RuntimeError, match="no CUDA device is usable"):
        ra.zeros((3,), device="cuda:0")


def test_host_arrays_of_any_cpu_device_index_are_one_memory():
    """JAX numbers its host devices (cpu:0, cpu:1, ...): all are host
    memory to ringattn, for copies and for the ring's own buffers."""
    from dlpack_producer import HandMadeProducer

    x = HandMadeProducer((1, 4, 2, 8), device=(1, 2))   # 64 floats on "cpu:2"
    x.storage[:] = np.arange(64, dtype=np.float32) / 64
    buf = ra.from_dlpack(x)
    assert buf.device == ("cpu", 2)
    np.testing.assert_array_equal(ra.to_device(buf, "cpu").numpy().ravel(), x.storage)
    assert ra.to_device(buf, buf.device).device == ("cpu", 0)
    out = np.zeros((1, 4, 2, 8), np.float32)
    ra.from_dlpack(out).copy_(buf)
    np.testing.assert_array_equal(out.ravel(), x.storage)
    ref = ra.attention(out, out, out, causal=True)
    got = ra.ring_attention(buf, buf, buf, ra.ThreadsGroup(1).comm(0), causal=True)
    np.testing.assert_allclose(np.asarray(ra.to_device(got, "cpu").numpy()), ref,
                               rtol=1e-6, atol=1e-7)


def _halfway_doubles(rng, lo_bits, hi_bits, n):
    """Doubles at, and 2^-40 relatively above and below, the midpoints of
    adjacent 16-bit floats (lo_bits, hi_bits: the bit patterns of the two
    neighbours as float64), with random signs: rounding such a double
    through a nearest-even float32 first would round it twice."""
    mid = (lo_bits + hi_bits) / 2
    x = np.concatenate([mid * (1 + 2.0**-40), mid * (1 - 2.0**-40), mid])
    return x * np.where(rng.random(x.size) < 0.5, -1.0, 1.0)


def test_float64_to_float16_rounds_once():
    rng = np.random.default_rng(11)
    h = rng.integers(0, 0x7bff, 20000).astype(np.uint16).view(np.float16)
    x = _halfway_doubles(rng, h.astype(np.float64),
                         np.nextafter(h, np.float16(np.inf)).astype(np.float64), 20000)
    x = np.concatenate([x, [1e300, -1e300, 65519.99, 65520.0, 5.960464477539063e-08 / 2,
                            1e-300, 0.0, -0.0, np.inf, -np.inf]])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)        # NumPy rounds float64 -> float16 once
    got = ra.to_device(x, "cpu", dtype="float16").numpy()
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    nan = ra.to_device(np.array([np.nan]), "cpu", dtype="float16").numpy()
    assert np.isnan(nan).all()


def _bf16_round_once(x):
    """float64 -> bfloat16 bits, correctly rounded (nearest, ties to even),
    from the two bfloat16 neighbours of each value (exact in float64)."""
    t = np.abs(x).astype(np.float32)
    bits = t.view(np.uint32) >> 16
    lo = bits - (((bits << 16).view(np.float32).astype(np.float64) > np.abs(x)) & (bits > 0))
    lo_v = (lo << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    hi_v = ((lo + 1) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    d_lo, d_hi = np.abs(x) - lo_v, hi_v - np.abs(x)
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (lo & 1 == 1))
    out = np.where(pick_hi, lo + 1, lo).astype(np.uint16)
    return out | np.where(np.signbit(x), 0x8000, 0).astype(np.uint16)


def test_float64_to_bfloat16_rounds_once():
    ml_dtypes = pytest.importorskip("ml_dtypes")   # noqa: F841 - bfloat16 numpy()
    rng = np.random.default_rng(12)
    b = (rng.integers(1, 0x7f7e, 20000).astype(np.uint32) << 16).view(np.float32)
    nb = ((b.view(np.uint32) >> 16) + 1 << 16).astype(np.uint32).view(np.float32)
    x = _halfway_doubles(rng, b.astype(np.float64), nb.astype(np.float64), 20000)
    x = np.concatenate([x, rng.standard_normal(1000) * 1e-3])
    got = ra.to_device(x, "cpu", dtype="bfloat16").numpy().view(np.uint16)
    np.testing.assert_array_equal(got, _bf16_round_once(x))
