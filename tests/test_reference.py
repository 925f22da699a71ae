"""The float64 reference (ringattn.testing) is itself right.

Checked against independent constructions: central finite differences for
the backward, an explicit per-row loop for masking and positions, per-head
attention for GQA, the LongNet branch-by-branch construction for dilated
attention, and full attention for the LSE merge.  Tolerances here are
float64 ones (1e-12 relative unless stated), since nothing is rounded.
"""

import math
import warnings

import numpy as np
import pytest

from ringattn import testing as rt

EXACT = 1e-12  # relative tolerance between two float64 constructions


def close(a, b, rtol=EXACT):
    """max |a - b| <= rtol * max(1, max |b|), with identical non-finite entries."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    finite = np.isfinite(b)
    if not np.array_equal(a[~finite], b[~finite]):
        return False
    err = np.max(np.abs(a[finite] - b[finite]), initial=0.0)
    return err <= rtol * max(1.0, np.max(np.abs(b[finite]), initial=0.0))


def naive_attention(q, k, v, scale, visible):
    """Per-row loop: visible(i, j) -> bool.  Returns (out, lse) float64."""
    B, S_q, H, D = q.shape
    S_k, H_kv = k.shape[1], k.shape[2]
    out = np.zeros((B, S_q, H, D))
    lse = np.full((B, H, S_q), -np.inf)
    for b in range(B):
        for h in range(H):
            kh = h // (H // H_kv)
            for i in range(S_q):
                keys = [j for j in range(S_k) if visible(i, j)]
                if not keys:
                    continue
                s = np.array([scale * float(q[b, i, h] @ k[b, j, kh]) for j in keys])
                m = s.max()
                w = np.exp(s - m)
                lse[b, h, i] = m + math.log(w.sum())
                out[b, i, h] = (w[:, None] * v[b, keys, kh]).sum(0) / w.sum()
    return out, lse


def finite_difference(f, x, eps=1e-6):
    """Central-difference gradient of scalar f at x (float64 array)."""
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        keep = flat[i]
        flat[i] = keep + eps
        up = f()
        flat[i] = keep - eps
        down = f()
        flat[i] = keep
        gflat[i] = (up - down) / (2 * eps)
    return grad


# ---------------------------------------------------------------- forward

@pytest.mark.parametrize("S_q,S_k,causal", [
    (5, 5, False), (5, 5, True), (3, 6, True), (6, 3, True), (4, 7, False)])
def test_forward_matches_row_loop(rng, S_q, S_k, causal):
    q, k, v = rt.random_qkv(rng, 2, S_q, S_k, 4, 2, 3, "float64")
    scale = 0.7
    shift = S_k - S_q
    out, lse = rt.ref_attention(q, k, v, causal=causal, scale=scale)
    want = naive_attention(q, k, v, scale,
                           lambda i, j: not causal or j <= i + shift)
    assert close(out, want[0]) and close(lse, want[1])


def test_causal_custom_positions_match_explicit_mask(rng):
    q, k, v = rt.random_qkv(rng, 1, 6, 9, 2, 2, 4, "float64")
    q_pos = np.array([0, 3, 3, 7, 10, 20])
    k_pos = np.arange(9) * 2 + 1
    out, lse = rt.ref_attention(q, k, v, causal=True, q_pos=q_pos, k_pos=k_pos)
    want = naive_attention(q, k, v, 1 / math.sqrt(4),
                           lambda i, j: k_pos[j] <= q_pos[i])
    assert close(out, want[0]) and close(lse, want[1])


def test_causal_equals_minus_inf_bias(rng):
    q, k, v = rt.random_qkv(rng, 2, 7, 11, 3, 1, 5, "float64")
    mask = np.where(np.arange(11)[None, :] <= np.arange(7)[:, None] + 4, 0.0, -np.inf)
    got = rt.ref_attention(q, k, v, causal=True)
    want = rt.ref_attention(q, k, v, bias=mask[None])
    assert close(got[0], want[0]) and close(got[1], want[1])


def test_gqa_matches_per_head_attention(rng):
    q, k, v = rt.random_qkv(rng, 2, 5, 6, 8, 2, 3, "float64")
    out, lse = rt.ref_attention(q, k, v, causal=True)
    per_head = [rt.ref_attention(q[:, :, h:h + 1], k[:, :, h // 4:h // 4 + 1],
                                 v[:, :, h // 4:h // 4 + 1], causal=True)
                for h in range(8)]
    assert close(out, np.concatenate([o for o, _ in per_head], axis=2)) and \
        close(lse, np.concatenate([l for _, l in per_head], axis=1))


def test_empty_causal_rows_are_zero_and_minus_inf_without_warnings(rng):
    q, k, v = rt.random_qkv(rng, 1, 7, 3, 2, 1, 4, "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = rt.ref_attention(q, k, v, causal=True)
        dq, dk, dv = rt.ref_attention_backward(np.ones_like(q), q, k, v, causal=True)
    empty_rows = slice(0, 4)  # q_pos = arange(7) - 4: rows 0..3 see no key
    assert (np.all(out[:, empty_rows] == 0) and np.all(np.isneginf(lse[:, :, empty_rows]))
            and np.all(np.isfinite(lse[:, :, 4:])) and np.all(dq[:, empty_rows] == 0)
            and not any(np.isnan(a).any() for a in (out, lse, dq, dk, dv)))


def test_zero_keys_give_empty_rows(rng):
    q, k, v = rt.random_qkv(rng, 1, 3, 0, 2, 2, 4, "float64")
    out, lse = rt.ref_attention(q, k, v)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


def test_default_scale_is_inverse_sqrt_head_dim(rng):
    q, k, v = rt.random_qkv(rng, 1, 4, 4, 1, 1, 9, "float64")
    got = rt.ref_attention(q, k, v)[0]
    assert close(got, rt.ref_attention(q, k, v, scale=1 / 3)[0])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_low_precision_inputs_are_read_exactly(rng, dtype):
    q, k, v = rt.random_qkv(rng, 1, 4, 5, 2, 1, 3, dtype)
    got = rt.ref_attention(q, k, v)
    want = rt.ref_attention(q.astype(np.float64), k.astype(np.float64),
                            v.astype(np.float64))
    assert close(got[0], want[0], 0) and close(got[1], want[1], 0)


# ---------------------------------------------------------------- backward

@pytest.mark.parametrize("S_q,S_k,H,H_kv,causal", [
    (3, 3, 2, 2, False), (3, 4, 2, 1, True), (4, 2, 4, 2, True), (1, 5, 3, 1, False)])
def test_backward_matches_finite_differences(rng, S_q, S_k, H, H_kv, causal):
    q, k, v = rt.random_qkv(rng, 2, S_q, S_k, H, H_kv, 3, "float64")
    dout = rng.standard_normal(q.shape)

    def loss():
        return float((rt.ref_attention(q, k, v, causal=causal, scale=0.8)[0] * dout).sum())

    grads = rt.ref_attention_backward(dout, q, k, v, causal=causal, scale=0.8)
    numeric = [finite_difference(loss, x) for x in (q, k, v)]
    assert all(close(g, n, 1e-7) for g, n in zip(grads, numeric))


def test_backward_with_bias_matches_finite_differences(rng):
    q, k, v = rt.random_qkv(rng, 1, 4, 4, 2, 1, 3, "float64")
    bias = rt.dilated_bias(4, [2, 4], [1, 2], 2)
    dout = rng.standard_normal(q.shape)

    def loss():
        return float((rt.ref_attention(q, k, v, causal=True, bias=bias)[0] * dout).sum())

    grads = rt.ref_attention_backward(dout, q, k, v, causal=True, bias=bias)
    numeric = [finite_difference(loss, x) for x in (q, k, v)]
    assert all(close(g, n, 1e-7) for g, n in zip(grads, numeric))


def test_gqa_backward_sums_over_query_heads(rng):
    q, k, v = rt.random_qkv(rng, 1, 5, 5, 4, 1, 3, "float64")
    dout = rng.standard_normal(q.shape)
    _, dk, dv = rt.ref_attention_backward(dout, q, k, v, causal=True)
    rep = rt.ref_attention_backward(dout, q, np.repeat(k, 4, 2), np.repeat(v, 4, 2),
                                    causal=True)
    assert close(dk[:, :, 0], rep[1].sum(2)) and close(dv[:, :, 0], rep[2].sum(2))


# ---------------------------------------------------------------- dilated

def test_dilated_bias_small_example():
    bias = rt.dilated_bias(5, [2], [2], 2)
    # w=2, r=2: segments {0,1}, {2,3}, {4}; head 0 selects 0, 2, 4; head 1 selects 1, 3
    counts = np.zeros((2, 5, 5))
    for h, picks in ((0, [0, 2, 4]), (1, [1, 3])):
        for p in picks:
            counts[h, p, p] = 1
    with np.errstate(divide="ignore"):
        assert np.array_equal(bias, np.log(counts))


def test_dilated_bias_counts_overlapping_branches():
    bias = rt.dilated_bias(4, [4, 2], [1, 1], 1)
    # branch 1 links all of 0..3; branch 2 links {0,1} and {2,3} again
    expected = np.log(np.array([[2, 2, 1, 1], [2, 2, 1, 1],
                                [1, 1, 2, 2], [1, 1, 2, 2]], dtype=float))
    assert np.array_equal(bias[0], expected)


@pytest.mark.parametrize("n,w,r,H,H_kv,causal", [
    (16, [4, 8, 16], [1, 2, 4], 4, 4, False),
    (16, [4, 8, 16], [1, 2, 4], 4, 2, True),
    (13, [5, 13], [1, 3], 3, 1, True),      # short last segment
    (10, [3, 7], [2, 5], 6, 3, False),      # rate does not divide segment
    (7, [2], [3], 4, 4, True),              # rate > segment: some heads select nothing
    (1, [4], [2], 2, 1, True),
])
def test_dilated_bias_matches_branch_construction(rng, n, w, r, H, H_kv, causal):
    q, k, v = rt.random_qkv(rng, 2, n, n, H, H_kv, 4, "float64")
    got = rt.ref_dilated_attention(q, k, v, w, r, causal=causal)
    want = rt.ref_dilated_attention_by_branches(q, k, v, w, r, causal=causal)
    assert close(got[0], want[0]) and close(got[1], want[1])


def test_dilated_unselected_rows_are_empty(rng):
    q, k, v = rt.random_qkv(rng, 1, 7, 7, 4, 4, 4, "float64")
    out, lse = rt.ref_dilated_attention(q, k, v, [2], [3], causal=False)
    # head 2: offset 2 never occurs inside segments of length 2
    assert np.all(out[:, :, 2] == 0) and np.all(np.isneginf(lse[:, 2]))


def test_dilated_backward_matches_finite_differences(rng):
    q, k, v = rt.random_qkv(rng, 1, 6, 6, 2, 1, 2, "float64")
    dout = rng.standard_normal(q.shape)

    def loss():
        return float((rt.ref_dilated_attention(q, k, v, [2, 6], [1, 2],
                                               causal=True)[0] * dout).sum())

    grads = rt.ref_dilated_attention_backward(dout, q, k, v, [2, 6], [1, 2], causal=True)
    numeric = [finite_difference(loss, x) for x in (q, k, v)]
    assert all(close(g, n, 1e-7) for g, n in zip(grads, numeric))


# ---------------------------------------------------------------- merge

def test_merge_of_key_halves_is_full_attention(rng):
    q, k, v = rt.random_qkv(rng, 2, 6, 10, 4, 2, 3, "float64")
    first = rt.ref_attention(q, k[:, :4], v[:, :4])
    second = rt.ref_attention(q, k[:, 4:], v[:, 4:])
    got = rt.ref_merge(*first, *second)
    want = rt.ref_attention(q, k, v)
    assert close(got[0], want[0]) and close(got[1], want[1])


def test_merge_is_associative(rng):
    q, k, v = rt.random_qkv(rng, 1, 5, 9, 2, 2, 3, "float64")
    parts = [rt.ref_attention(q, k[:, s], v[:, s]) for s in
             (slice(0, 2), slice(2, 7), slice(7, 9))]
    left = rt.ref_merge(*rt.ref_merge(*parts[0], *parts[1]), *parts[2])
    right = rt.ref_merge(*parts[0], *rt.ref_merge(*parts[1], *parts[2]))
    assert close(left[0], right[0]) and close(left[1], right[1])


def test_merge_with_empty_rows(rng):
    out = rng.standard_normal((1, 3, 2, 4))
    lse = rng.standard_normal((1, 2, 3))
    empty_out, empty_lse = np.zeros_like(out), np.full_like(lse, -np.inf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one = rt.ref_merge(out, lse, empty_out, empty_lse)
        both = rt.ref_merge(empty_out, empty_lse, empty_out, empty_lse)
    assert (close(one[0], out) and close(one[1], lse)
            and np.all(both[0] == 0) and np.all(np.isneginf(both[1])))


# ---------------------------------------------------------------- helpers

@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_tolerance_accepts_rounding_and_rejects_a_mask_bug(rng, dtype):
    """A float32 computation rounded to `dtype` passes; an off-by-one mask fails."""
    q, k, v = rt.random_qkv(rng, 1, 64, 64, 2, 1, 16, dtype)
    ref, _ = rt.ref_attention(q, k, v, causal=True)
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    s = np.einsum("bqhd,bkd->bhqk", q32, k32[:, :, 0]) / np.float32(4)
    s = np.where(np.tril(np.ones((64, 64), bool)), s, np.float32(-np.inf))
    p = np.exp(s - s.max(-1, keepdims=True))
    emulated = np.einsum("bhqk,bkd->bqhd", p / p.sum(-1, keepdims=True), v32[:, :, 0])
    if dtype == "float64":
        emulated = ref  # float64 kernels compute in float64
    rt.assert_close(np.asarray(emulated).astype(rt.np_dtype(dtype)), ref, dtype)
    shifted, _ = rt.ref_attention(q, k, v, causal=True,
                                  q_pos=np.arange(64) + 1, k_pos=np.arange(64))
    with pytest.raises(AssertionError, match="max abs error"):
        rt.assert_close(shifted.astype(rt.np_dtype(dtype)), ref, dtype)


def test_assert_close_reports_nan_and_infinite_mismatch():
    ref = np.array([[0.0, -np.inf]])
    with pytest.raises(AssertionError, match="NaN"):
        rt.assert_close(np.array([[np.nan, -np.inf]]), ref, "float32", name="lse")
    with pytest.raises(AssertionError, match="lse: 1 entries differ"):
        rt.assert_close(np.array([[0.0, 1.0]]), ref, "float32", name="lse")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bfloat16"])
def test_to_numpy_is_exact_float64(rng, dtype):
    x = rng.standard_normal((3, 4)).astype(rt.np_dtype(dtype))
    got = rt.to_numpy(x)
    assert got.dtype == np.float64 and np.array_equal(got, x.astype(np.float64))


def test_to_numpy_reads_jax_arrays():
    jnp = pytest.importorskip("jax.numpy")
    x = jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)
    assert np.array_equal(rt.to_numpy(x), np.arange(6.0).reshape(2, 3))
