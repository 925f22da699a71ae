"""The float64 reference of the masks (ringattn.testing) checked on its own:
against a per-row loop that writes the rules of DESIGN §2 "Masks" out one
(query, key) pair at a time, and its backward (through the softcap's tanh)
against finite differences.  The kernels are tested against this reference
in test_masks.py."""

import math

import numpy as np
import pytest

from ringattn import testing as rt


def visible_pair(i, j, q_pos, k_pos, causal, q_ids, kv_ids, window):
    if causal and k_pos[j] > q_pos[i]:
        return False
    if window is not None:
        left, right = window
        if left is not None and k_pos[j] < q_pos[i] - left:
            return False
        if right is not None and k_pos[j] > q_pos[i] + right:
            return False
    return q_ids is None or q_ids[i] == kv_ids[j]


def loop_attention(q, k, v, causal=False, q_pos=None, k_pos=None,
                   segment_ids=None, kv_segment_ids=None, window=None,
                   softcap=None):
    """(out, lse) one row, one head, one key at a time."""
    B, S_q, H, D = q.shape
    S_k, H_kv = k.shape[1], k.shape[2]
    q_pos = np.arange(S_q) + S_k - S_q if q_pos is None else q_pos
    k_pos = np.arange(S_k) if k_pos is None else k_pos
    out = np.zeros((B, S_q, H, D))
    lse = np.full((B, H, S_q), -np.inf)
    for b in range(B):
        q_ids = None if segment_ids is None else segment_ids[b]
        kv_ids = None if segment_ids is None else (
            segment_ids[b] if kv_segment_ids is None else kv_segment_ids[b])
        for h in range(H):
            g = h // (H // H_kv)
            for i in range(S_q):
                keys = [j for j in range(S_k) if visible_pair(
                    i, j, q_pos, k_pos, causal, q_ids, kv_ids, window)]
                if not keys:
                    continue
                s = np.array([q[b, i, h] @ k[b, j, g] / math.sqrt(D)
                              for j in keys])
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                m = s.max()
                w = np.exp(s - m)
                out[b, i, h] = (w[:, None] * v[b, keys, g]).sum(0) / w.sum()
                lse[b, h, i] = m + math.log(w.sum())
    return out, lse


CASES = [
    dict(causal=True, window=(2, 0)),
    dict(window=(1, 3)),
    dict(window=(None, 0)),
    dict(window=(0, None), causal=True),
    dict(segment_ids=np.array([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5]])),
    dict(segment_ids=np.array([[2, 0, 2, 1, 0, 2], [0, 1, 2, 3, 4, 5]]),
         causal=True),
    dict(softcap=0.7),
    dict(softcap=0.5, causal=True, window=(3, 1),
         segment_ids=np.array([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 0]])),
]


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_row_loop(rng, case):
    q, k, v = rt.random_qkv(rng, 2, 6, 6, 4, 2, 3, "float64")
    got = rt.ref_attention(q, k, v, **case)
    want = loop_attention(q, k, v, **case)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_reference_matches_row_loop_with_kv_ids_and_positions(rng):
    q, k, v = rt.random_qkv(rng, 1, 5, 8, 2, 1, 3, "float64")
    kw = dict(segment_ids=np.array([[1, 1, 2, 3, 3]]),
              kv_segment_ids=np.array([[1, 2, 2, 3, 3, 3, 1, 9]]),
              window=(4, 1), causal=True, q_pos=np.arange(5) * 2 + 3,
              k_pos=np.arange(8) + 1)
    got = rt.ref_attention(q, k, v, **kw)
    want = loop_attention(q, k, v, **kw)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_reference_backward_matches_finite_differences(rng, case):
    q, k, v = rt.random_qkv(rng, 2, 6, 6, 2, 1, 3, "float64")
    dout = rng.standard_normal(q.shape)

    def loss():
        return float((rt.ref_attention(q, k, v, **case)[0] * dout).sum())

    grads = rt.ref_attention_backward(dout, q, k, v, **case)
    for g, x in zip(grads, (q, k, v)):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            keep = x[idx]
            x[idx] = keep + 1e-6
            up = loss()
            x[idx] = keep - 1e-6
            down = loss()
            x[idx] = keep
            numeric[idx] = (up - down) / 2e-6
        np.testing.assert_allclose(g, numeric, rtol=1e-6, atol=1e-7)


def test_ids_compare_exactly_above_float64_precision():
    ids = np.array([[2**53, 2**53 + 1]], np.int64)
    visible = rt.ref_visible(2, 2, segment_ids=ids)[0, 0]
    assert visible.tolist() == [[True, False], [False, True]]


def test_ref_segment_ids_examples():
    assert rt.ref_segment_ids([0, 2, 5], 7).tolist() == [[0, 0, 1, 1, 1, 2, 2]]
    assert rt.ref_segment_ids([0, 0, 3], 3).tolist() == [[1, 1, 1]]
    assert rt.ref_segment_ids([0], 2).tolist() == [[0, 0]]
