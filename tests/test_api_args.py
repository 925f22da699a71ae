"""Arguments taken as NumPy takes them, and errors that name the argument:
ra.empty / ra.zeros / ra.to_device / Buffer.astype take a dtype the way
np.dtype() does ("float" is float64, NumPy dtypes and scalar types,
ml_dtypes' bfloat16) and an int shape; a CUDA device index past int is a
ValueError naming device; ringattn.jax.attention names `scale`."""

import numpy as np
import pytest

import ringattn as ra

ml_dtypes = pytest.importorskip("ml_dtypes")

DTYPES = [
    ("float", "float64"), ("double", "float64"), ("f4", "float32"),
    ("half", "float16"), ("i8", "int64"), ("bfloat16", "bfloat16"),
    (np.float32, "float32"), (np.dtype("float64"), "float64"),
    (np.dtype(np.int32), "int32"), (np.uint16, "uint16"), (float, "float64"),
    (int, "int64"), (ml_dtypes.bfloat16, "bfloat16"), (None, "float32"),
]


@pytest.mark.parametrize("make", [ra.empty, ra.zeros])
@pytest.mark.parametrize("dtype, name", DTYPES, ids=[str(d) for d, _ in DTYPES])
def test_dtypes_as_numpy_takes_them(make, dtype, name):
    buf = make((2, 3), dtype=dtype)
    assert (buf.dtype, buf.shape) == (name, (2, 3))
    if name != "bfloat16":
        assert buf.numpy().dtype == np.dtype(name)


@pytest.mark.parametrize("dtype", [bool, "complex64", "nope", np.complex128, 3])
def test_other_dtypes_are_type_errors_naming_dtype(dtype):
    with pytest.raises(TypeError, match=r"^dtype: expected one of float32"):
        ra.zeros((2,), dtype=dtype)


@pytest.mark.parametrize("shape, want", [(5, (5,)), (np.int64(4), (4,)), (0, (0,)),
                                         ((np.int32(2), 3), (2, 3))])
def test_int_shapes_as_numpy_takes_them(shape, want):
    assert ra.empty(shape).shape == want
    assert ra.zeros(shape, "float64").numpy().shape == want


@pytest.mark.parametrize("shape, error", [(-1, ValueError), (True, TypeError),
                                          (2.0, TypeError), ((2, "3"), TypeError)])
def test_bad_shapes_name_shape(shape, error):
    with pytest.raises(error, match="^shape: "):
        ra.empty(shape)


def test_astype_and_to_device_take_numpy_dtypes():
    x = np.arange(6, dtype=np.float64).reshape(2, 3) / 3
    buf = ra.to_device(x, "cpu", dtype=np.float32)
    assert buf.dtype == "float32"
    np.testing.assert_array_equal(buf.numpy(), x.astype(np.float32))
    assert buf.astype(np.dtype("float16")).dtype == "float16"
    assert buf.astype("float").dtype == "float64"
    assert buf.astype(ml_dtypes.bfloat16).dtype == "bfloat16"
    with pytest.raises(TypeError, match="^dtype: "):
        buf.astype(np.int32)                    # astype converts floats only


@pytest.mark.parametrize("device", ["cuda:99999999999", ("cuda", 2**31), ("cuda", 2**70)])
def test_huge_cuda_index_is_a_value_error(device):
    with pytest.raises(ValueError, match="^device: "):
        ra.to_device(np.zeros(3), device)
    with pytest.raises(ValueError, match="^device: "):
        ra.zeros((3,), device=device)


@pytest.mark.parametrize("scale, error", [("a", TypeError), (1j, TypeError),
                                          (b"1", TypeError), (float("inf"), ValueError),
                                          (float("nan"), ValueError)])
def test_jax_scale_errors_name_scale(jax_module, scale, error):
    jnp = jax_module.numpy
    import ringattn.jax as rj

    x = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(error, match="^scale: "):
        rj.attention(x, x, x, scale=scale)
    with pytest.raises(error, match="^scale: "):
        rj.ring_attention(x, x, x, axis_name="sp", scale=scale)
    with pytest.raises(TypeError, match="^scale: "):     # a traced scale
        jax_module.jit(lambda s: rj.attention(x, x, x, scale=s))(1.0)
