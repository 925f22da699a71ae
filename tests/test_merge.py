"""ra.merge (the LSE merge of DESIGN.md section 3) against testing.ref_merge.

Tolerances: testing.tolerance of the output dtype for out; lse is computed
in float32 (float64 for float64 inputs) and held to that tolerance.
"""

import numpy as np
import pytest

import ringattn as ra
from ringattn import testing as rt

DTYPES = ["float32", "float64", "float16", "bfloat16"]


def lse_dtype(dtype):
    return "float64" if dtype == "float64" else "float32"


def partials(rng, dtype, B=2, S=37, H=3, D=20, empty_fraction=0.2):
    """Two random partial results; some rows of each have lse = -inf, out = 0."""
    results = []
    for _ in range(2):
        out = rng.standard_normal((B, S, H, D))
        lse = 3.0 * rng.standard_normal((B, H, S))
        empty = rng.random((B, H, S)) < empty_fraction
        lse[empty] = -np.inf
        out[empty.transpose(0, 2, 1)] = 0.0
        results += [out.astype(rt.np_dtype(dtype)),
                    lse.astype(rt.np_dtype(lse_dtype(dtype)))]
    return results


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_matches_reference(rng, dtype):
    args = partials(rng, dtype)
    out, lse = ra.merge(*args)
    ref_out, ref_lse = rt.ref_merge(*args)
    rt.assert_close(out, ref_out, dtype, name="out")
    rt.assert_close(lse, ref_lse, lse_dtype(dtype), name="lse")


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_result_types(rng, dtype):
    args = partials(rng, dtype, B=1, S=4, H=2, D=8)
    out, lse = ra.merge(*args)
    assert (type(out), out.dtype, out.shape, type(lse), lse.dtype, lse.shape) == \
        (np.ndarray, args[0].dtype, args[0].shape, np.ndarray, args[1].dtype, args[1].shape)


def test_merging_two_empty_rows_gives_zero_and_minus_inf():
    out = np.zeros((1, 3, 2, 4), np.float32)
    lse = np.full((1, 2, 3), -np.inf, np.float32)
    m_out, m_lse = ra.merge(out, lse, out, lse)
    assert np.all(m_out == 0) and np.all(np.isneginf(m_lse))


def test_merge_with_one_empty_side_returns_the_other(rng):
    out1, lse1 = partials(rng, "float64", empty_fraction=0.0)[:2]
    out2, lse2 = np.zeros_like(out1), np.full_like(lse1, -np.inf)
    got = ra.merge(out1, lse1, out2, lse2) + ra.merge(out2, lse2, out1, lse1)
    assert all(np.allclose(g, w, rtol=1e-14, atol=0) for g, w in
               zip(got, (out1, lse1, out1, lse1)))


def test_merge_far_apart_lse_does_not_overflow(rng):
    out1, lse1, out2, lse2 = partials(rng, "float32", empty_fraction=0.0)
    lse1[...] = 80.0   # exp(80) overflows float32
    lse2[...] = -80.0
    got_out, got_lse = ra.merge(out1, lse1, out2, lse2)
    ref_out, ref_lse = rt.ref_merge(out1, lse1, out2, lse2)
    rt.assert_close(got_out, ref_out, "float32", name="out")
    rt.assert_close(got_lse, ref_lse, "float32", name="lse")


def _causal_part(q, k, v, start, stop):
    """Causal attention of every query (positions 0..S-1) to keys [start, stop).

    Queries before `start` see nothing (out 0, lse -inf); queries in
    [start, stop) face the block as a square causal problem; later queries
    see the whole block.  Returns (out (B, S, H, D), lse (B, H, S)).
    """
    B, S, H, D = q.shape
    kb, vb = k[:, start:stop], v[:, start:stop]
    out = np.zeros(q.shape, q.dtype)
    lse = np.full((B, H, S), -np.inf, np.float64 if q.dtype == np.float64 else np.float32)
    out[:, start:stop], lse[:, :, start:stop] = ra.attention(
        q[:, start:stop], kb, vb, causal=True, return_lse=True)
    if stop < S:
        out[:, stop:], lse[:, :, stop:] = ra.attention(q[:, stop:], kb, vb,
                                                       return_lse=True)
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_merging_key_halves_is_full_attention(rng, dtype, causal):
    """Two blocks of keys attended separately merge to full attention.

    With causal, queries before the second block see none of it (lse -inf
    rows) and the merge must still be exact.
    """
    q, k, v = rt.random_qkv(rng, 1, 50, 50, 4, 2, 16, dtype)
    split = 21
    if causal:
        first, second = _causal_part(q, k, v, 0, split), _causal_part(q, k, v, split, 50)
    else:
        first = ra.attention(q, k[:, :split], v[:, :split], return_lse=True)
        second = ra.attention(q, k[:, split:], v[:, split:], return_lse=True)
    out, lse = ra.merge(*first, *second)
    ref_out, ref_lse = rt.ref_attention(q, k, v, causal=causal)
    rt.assert_close(out, ref_out, dtype, name="out")
    rt.assert_close(lse, ref_lse, lse_dtype(dtype), name="lse")
