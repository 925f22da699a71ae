"""Buffer.copy_ between views of one memory: np.copyto's answer (as if the
source went through a temporary) whatever the overlap, dtype or strides."""

import numpy as np
import pytest

import ringattn as ra

ml_dtypes = pytest.importorskip("ml_dtypes")

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int32,
          np.int64, np.uint8]

# (dst, src) views of one 3-d base array, as index expressions
OVERLAPS = {
    "shift_down": (np.s_[1:], np.s_[:-1]),
    "shift_up": (np.s_[:-1], np.s_[1:]),
    "same_view": (np.s_[:], np.s_[:]),
    "reversed": (np.s_[::-1], np.s_[:]),
    "inner_shift": (np.s_[:, :, 1:], np.s_[:, :, :-1]),
    "inner_reversed": (np.s_[:, :, ::-1], np.s_[:, :, :]),
    "strided": (np.s_[1::2], np.s_[:-1:2]),
    "transposed": ("T", np.s_[:]),
}


def _views(base, how):
    dst_ix, src_ix = OVERLAPS[how]
    src = base[src_ix]
    if isinstance(dst_ix, str):     # square trailing dims, swapped
        dst = base.transpose(0, 2, 1)
    else:
        dst = base[dst_ix]
    return dst, src


def _base(rng, dtype):
    shape = (6, 5, 5)
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(0, 100, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("how", list(OVERLAPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_overlapping_copy_is_copyto(rng, dtype, how):
    base = _base(rng, dtype)
    want = base.copy()
    np.copyto(*_views(want, how))
    dst, src = _views(base, how)
    ra.from_dlpack(dst).copy_(src)
    np.testing.assert_array_equal(base, want)


@pytest.mark.parametrize("how", ["shift_down", "shift_up", "transposed"])
def test_overlapping_copy_across_dtypes(rng, how):
    """float64 source, float32 destination over the same bytes."""
    raw = rng.standard_normal(2 * 6 * 5 * 5)
    want_raw = raw.copy()
    views = []
    for r in (raw, want_raw):
        f32 = r.view(np.float32)[: 6 * 5 * 5 * 2].reshape(12, 5, 5)
        f64 = r[: 6 * 5 * 5].reshape(6, 5, 5)
        dst = f32[2:8] if how != "transposed" else f32[1:7].transpose(0, 2, 1)
        src = f64 if how != "shift_up" else f64[::-1]
        views.append((dst, src))
    np.copyto(*views[1])
    ra.from_dlpack(views[0][0]).copy_(views[0][1])
    np.testing.assert_array_equal(raw.view(np.uint64), want_raw.view(np.uint64))


def test_interleaved_views_of_one_array(rng):
    """Views whose extents overlap but whose elements interleave."""
    base = rng.standard_normal((4, 8)).astype(np.float32)
    want = base.copy()
    want[:, ::2] = want[:, 1::2]
    ra.from_dlpack(base[:, ::2]).copy_(base[:, 1::2])
    np.testing.assert_array_equal(base, want)
