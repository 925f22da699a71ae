"""GPU tests of the tensor-core forward's own paths (cuda/attn_fwd_tc.cu,
cuda/fwd_tc/), on inputs built to reach them:

* pivots that move along the keys: a row keeps its running max as the
  exponent's pivot until a key tile's max exceeds it by more than 8 in
  log2 units (then O and l are rescaled); scores that grow by less than
  that per tile leave P up to 2^8, scores that grow by more move the pivot
  every tile, rows whose scores fall keep the first tile's;
* pivots too large to fold into the exponent's FFMA (|max * scale * log2 e|
  >= 1024): those rows subtract their pivot from the raw scores first,
  beside rows of the same warp that fold;
* outputs whose rows do not allow 16-byte stores (a view with rows of
  D + 2 elements) take the fragments' 4-byte stores and leave the bytes
  beside the view alone.

The blocks own 128 query rows (8 warps of 16), so S_q = 150 gives a full
and a partial block, and S_k = 330 five whole key tiles and a partial one.
Against the float64 reference on the very inputs the kernel saw, with
test_cuda.py's tolerance.
"""
import zlib

import numpy as np
import pytest

ra = pytest.importorskip("ringattn")
testing = pytest.importorskip("ringattn.testing")

pytestmark = pytest.mark.gpu

from test_cuda import close  # noqa: E402  (skips this module without a device)
from gpu_arrays import to_device, to_host  # noqa: E402

TC = [("bfloat16", 64), ("float16", 64), ("bfloat16", 128), ("float16", 128)]
B, SQ, SK, H, HKV = 1, 150, 330, 2, 1
LOG2E = np.log2(np.e)


def growing_scores(dtype, D, growth, shift, seed):
    """q, k, v whose scores move by `growth` log2 units per 64-key tile
    (up for half the rows, down for the others) and, for half the rows,
    sit `shift` log2 units above zero throughout (a softmax-invariant
    offset that only moves the pivot)."""
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(D)
    q = rng.standard_normal((B, SQ, H, D))
    k = rng.standard_normal((B, SK, HKV, D))
    v = rng.standard_normal((B, SK, HKV, D))
    q[..., 0] = rng.choice([-1.0, 1.0], size=(B, SQ, H))
    k[..., 0] = (np.arange(SK) // 64)[None, :, None] * growth / (scale * LOG2E)
    q[..., 1] = rng.integers(0, 2, size=(B, SQ, H)) * shift / (scale * LOG2E)
    k[..., 1] = 1.0
    return (to_device(x, dtype, "ra") for x in (q, k, v))


# (growth, shift): shift 1500 log2 units is past the fold's 1024 and still
# resolved by float32 accumulation of these inputs (a score's rounding
# stays below 2^-10)
PIVOTS = [(0.0, 0.0), (7.5, 0.0), (8.5, 0.0), (60.0, 0.0), (0.0, 1500.0), (8.5, 1500.0)]


@pytest.mark.parametrize("dtype,D", TC)
@pytest.mark.parametrize("growth,shift", PIVOTS)
@pytest.mark.parametrize("causal", [False, True])
def test_pivots_that_move_or_do_not_fold(dtype, D, growth, shift, causal):
    seed = zlib.crc32(repr(("pivots", dtype, D, growth, shift, causal)).encode())
    q, k, v = growing_scores(dtype, D, growth, shift, seed)
    out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
    ref_out, ref_lse = testing.ref_attention(to_host(q), to_host(k), to_host(v), causal=causal)
    if shift:
        assert np.abs(ref_lse).max() > 1024 / LOG2E  # some rows are past the fold
    close(out, ref_out, dtype)
    close(lse, ref_lse, "float32")


@pytest.mark.parametrize("dtype,D", TC)
def test_output_rows_without_16_byte_alignment(dtype, D):
    rng = np.random.default_rng(zlib.crc32(repr(("view", dtype, D)).encode()))
    q, k, v = (to_device(rng.standard_normal(s), dtype, "ra")
               for s in ((B, SQ, H, D), (B, SK, HKV, D), (B, SK, HKV, D)))
    pad = np.full((B, SQ, H, D + 2), 7.0)
    buf = to_device(pad, dtype, "ra")
    out = buf.narrow(3, 2, D)          # rows of D + 2 elements: 4-byte aligned only
    ra._C.attn_fwd(q, k, v, causal=True, out=out)
    ref_out, _ = testing.ref_attention(to_host(q), to_host(k), to_host(v), causal=True)
    close(out, ref_out, dtype)
    assert np.all(to_host(buf)[..., :2] == 7.0)  # the bytes beside the view
