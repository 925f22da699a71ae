"""Float64 NumPy reference for every ringattn computation, and test helpers.

Everything here is plain NumPy evaluated in float64, written for clarity
rather than speed; it is the ground truth the C and CUDA kernels, the ring
and the dilated paths are checked against (DESIGN.md section 9).

Conventions (DESIGN.md section 2):

* ``q``: (B, S_q, H, D); ``k``, ``v``: (B, S_k, H_kv, D); ``H % H_kv == 0``.
  Query head ``h`` reads kv head ``h // (H // H_kv)``.
* ``out``: (B, S_q, H, D) float64; ``lse``: (B, H, S_q) float64, the natural
  log of the sum of exp of the scaled (and biased) scores.
* ``scale`` defaults to ``1 / sqrt(D)``.
* causal: key j is visible to query i iff ``k_pos[j] <= q_pos[i]``; by
  default positions align bottom-right: ``q_pos = arange(S_q) + S_k - S_q``,
  ``k_pos = arange(S_k)``.
* masks (``ref_visible``): documents (segment ids), a window (left, right)
  around the query's position, and soft-capping of the scaled scores; a key
  is visible iff every rule allows it.
* a query row that sees no key gets ``out = 0`` and ``lse = -inf``.
* NaN (in q or k, or an infinity that makes a score NaN, or NaN in v) reaches
  exactly the rows that see it: their out and lse are NaN, and in the
  backward dq of those rows and dk, dv of the keys they see.  A row or key
  that does not see it keeps its finite value (``_touching_matmul``).  A
  score of -inf weighs 0, as a hidden key does.

Inputs may be any float dtype (float16, float32, float64, ml_dtypes
bfloat16) or any array kind ``to_numpy`` understands; they are converted to
float64 exactly before any arithmetic.  This module imports nothing from
ringattn, so it can check ringattn without trusting it.
"""

import math

import numpy as np

__all__ = [
    "to_numpy", "np_dtype", "random_qkv", "tolerance", "max_error",
    "assert_close", "ref_attention", "ref_attention_backward", "ref_merge",
    "ref_visible", "ref_segment_ids",
    "dilated_bias", "ref_dilated_attention", "ref_dilated_attention_backward",
    "ref_dilated_attention_by_branches",
]


# --------------------------------------------------------------------------
# dtypes and conversion
# --------------------------------------------------------------------------

def np_dtype(dtype):
    """The NumPy dtype for a name or dtype-like; "bfloat16" means ml_dtypes'.

    Accepts "float16", "float32", "float64", "bfloat16", NumPy dtypes and
    scalar types.  Raises TypeError when bfloat16 is asked for and ml_dtypes
    is not installed.
    """
    if isinstance(dtype, str) and dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as exc:  # pragma: no cover - ml_dtypes is a test dependency
            raise TypeError("dtype 'bfloat16' needs the ml_dtypes package") from exc
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def dtype_name(dtype):
    """Short name of a dtype-like: "float32", "bfloat16", ..."""
    return np_dtype(dtype).name


def _module_of(x):
    return type(x).__module__.split(".")[0]


def to_numpy(x):
    """Any array (NumPy, ml_dtypes bfloat16, JAX, PyTorch, CuPy, ringattn
    Buffer, DLPack producer, nested lists, scalars) -> float64 NumPy array.

    Values are converted exactly (every float16/bfloat16/float32 value is a
    float64 value).  Device arrays are copied to the host.  Always returns a
    new array, so the caller may modify it.
    """
    if isinstance(x, np.ndarray):
        return np.array(x, dtype=np.float64)
    module = _module_of(x)
    if module == "torch":
        return x.detach().cpu().double().numpy().copy()
    if module == "cupy":
        return np.array(x.get(), dtype=np.float64)
    if module in ("jax", "jaxlib"):
        return np.array(np.asarray(x), dtype=np.float64)
    if hasattr(x, "numpy") and callable(x.numpy):
        # ringattn.Buffer (host memory) and array types with the same idiom
        return np.array(x.numpy(), dtype=np.float64)
    if hasattr(x, "__dlpack__"):
        return np.array(np.from_dlpack(x), dtype=np.float64)
    return np.array(x, dtype=np.float64)


def random_qkv(rng, B, S_q, S_k, H, H_kv, D, dtype="float32", scale=1.0):
    """Standard-normal q (B, S_q, H, D), k and v (B, S_k, H_kv, D) in `dtype`.

    `rng` is a ``numpy.random.Generator``; `dtype` a name or dtype
    ("bfloat16" gives ml_dtypes bfloat16 arrays).  `scale` multiplies the
    float64 draws before rounding to `dtype`.  Returns C-contiguous arrays.
    """
    dt = np_dtype(dtype)
    q = (scale * rng.standard_normal((B, S_q, H, D))).astype(dt)
    k = (scale * rng.standard_normal((B, S_k, H_kv, D))).astype(dt)
    v = (scale * rng.standard_normal((B, S_k, H_kv, D))).astype(dt)
    return q, k, v


# --------------------------------------------------------------------------
# tolerances
# --------------------------------------------------------------------------

# (rtol, atol) per dtype of the computed result, for the criterion
#     max |actual - reference| <= atol + rtol * max |reference|
# taken over the whole array.  Rationale:
#   float64: the CPU kernels compute float64 inputs in float64; only
#            summation order differs from the reference (errors ~1e-14).
#   float32: float32 arithmetic over up to ~1e3 keys (forward) or queries
#            (dk/dv); observed errors stay below ~3e-6 relative to the
#            largest value, so 2e-5 leaves headroom and still catches an
#            off-by-one causal mask at S ~ 1e3 (a ~1e-3 change).
#   float16: results are rounded to float16 once (half ulp 2^-11 ~ 4.9e-4
#            relative); backward also sees the float16-rounded `out` in
#            delta = rowsum(dout * out).  2e-3 is ~4 half-ulps.
#   bfloat16: same with half ulp 2^-8 ~ 3.9e-3; 1.6e-2 is ~4 half-ulps.
# Scaling by max|reference| (not elementwise) makes the criterion robust
# near zeros while staying proportional to the data.  Every kernel bug of
# substance (wrong head mapping, mask alignment, scale, missing key block,
# wrong merge weight) gives an error of order max|reference|.
_TOLERANCES = {
    "float64": (1e-10, 1e-12),
    "float32": (2e-5, 1e-6),
    "float16": (2e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-4),
}


def tolerance(dtype):
    """(rtol, atol) for results stored in `dtype` (see the table above)."""
    name = dtype_name(dtype)
    if name not in _TOLERANCES:
        raise ValueError(
            f"dtype: expected one of {sorted(_TOLERANCES)}, got {name!r}")
    return _TOLERANCES[name]


def max_error(actual, reference):
    """(max |actual - reference| over finite entries, its index, max |reference|).

    Both are converted with ``to_numpy``; shapes must match.
    """
    a = to_numpy(actual)
    r = to_numpy(reference)
    finite = np.isfinite(r)
    diff = np.where(finite, np.abs(a - np.where(finite, r, 0.0)), 0.0)
    diff = np.where(np.isnan(diff), np.inf, diff)
    if diff.size == 0:
        return 0.0, (), 0.0
    where = np.unravel_index(int(np.argmax(diff)), diff.shape)
    ref_max = float(np.max(np.abs(np.where(finite, r, 0.0))))
    return float(diff[where]), tuple(int(i) for i in where), ref_max


def assert_close(actual, reference, dtype, name="out", extra_nan=False):
    """Assert `actual` matches the float64 `reference` within ``tolerance(dtype)``.

    The criterion is ``max |a - r| <= atol + rtol * max |r|`` over finite
    reference entries; non-finite reference entries (``-inf`` lse of empty
    rows, NaN where a NaN input reaches) must be matched exactly, and
    `actual` must have no NaN where the reference has none.  extra_nan=True
    lets `actual` be NaN where the reference is finite too (the backward
    kernels' gradients of positions that share a tile with a NaN input
    without seeing it); its finite entries are still checked.  Shapes must
    be equal.  The failure message names `name`, the largest error, where
    it is, both values there and the tolerance.
    """
    a = to_numpy(actual)
    r = to_numpy(reference)
    if a.shape != r.shape:
        raise AssertionError(
            f"{name}: shape {a.shape} != reference shape {r.shape}")
    stray = np.isnan(a) & ~np.isnan(r)
    if extra_nan:
        a = np.where(stray, r, a)
    elif stray.any():
        idx = tuple(int(i) for i in np.argwhere(stray)[0])
        raise AssertionError(
            f"{name}: {int(stray.sum())} NaN values where the reference has "
            f"none, first at {idx}")
    special = ~np.isfinite(r)
    if special.any() and not np.array_equal(a[special], r[special],
                                            equal_nan=True):
        bad = np.argwhere(special & (a != r) & ~(np.isnan(a) & np.isnan(r)))
        idx = tuple(int(i) for i in bad[0])
        raise AssertionError(
            f"{name}: {len(bad)} entries differ where the reference is not "
            f"finite; first at {idx}: got {a[idx]!r}, expected {r[idx]!r}")
    if (~np.isfinite(a) & ~special).any():
        idx = tuple(int(i) for i in np.argwhere(~np.isfinite(a) & ~special)[0])
        raise AssertionError(
            f"{name}: non-finite value {a[idx]!r} at {idx} where the "
            f"reference is {r[idx]!r}")
    rtol, atol = tolerance(dtype)
    err, where, ref_max = max_error(a, r)
    bound = atol + rtol * ref_max
    if not err <= bound:
        raise AssertionError(
            f"{name}: max abs error {err:.3e} at {where} (got {a[where]!r}, "
            f"expected {r[where]!r}) exceeds {bound:.3e} = atol {atol:g} + "
            f"rtol {rtol:g} * max|ref| {ref_max:.3e} [{dtype_name(dtype)}]")


# --------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------


def close_failures(actual, expected, dtype,
                   names=("out", "lse", "dq", "dk", "dv")):
    """``assert_close`` over pairs; the list of failure messages (empty when
    every pair is within tolerance)."""
    bad = []
    for name, a, e in zip(names, actual, expected):
        try:
            assert_close(a, e, dtype, name)
        except AssertionError as err:
            bad.append(str(err))
    return bad


def random_problem(rng, B, n, H, H_kv, D, dtype="float64"):
    """q, k, v (self-attention over n tokens) and dout, as random_qkv makes
    them; dout (B, n, H, D) in the same dtype."""
    q, k, v = random_qkv(rng, B, n, n, H, H_kv, D, dtype)
    dout = rng.standard_normal(q.shape).astype(np_dtype(dtype))
    return q, k, v, dout

def _prepare(q, k, v, scale):
    """float64 copies of q, k, v with kv heads repeated to H, in BHSD."""
    q, k, v = to_numpy(q), to_numpy(k), to_numpy(v)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k, v: expected 4-d (B, S, H, D) arrays, got ndim "
            f"{q.ndim}, {k.ndim}, {v.ndim}")
    B, S_q, H, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(
            f"k, v: expected shape (B={B}, S_k, H_kv, D={D}) each, got "
            f"{k.shape} and {v.shape}")
    H_kv = k.shape[2]
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(f"heads: H={H} is not a multiple of H_kv={H_kv}")
    group = H // H_kv
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    qh = q.transpose(0, 2, 1, 3)                               # (B, H, S_q, D)
    kh = np.repeat(k, group, axis=2).transpose(0, 2, 1, 3)     # (B, H, S_k, D)
    vh = np.repeat(v, group, axis=2).transpose(0, 2, 1, 3)
    return qh, kh, vh, float(scale), group


def _positions(S_q, S_k, q_pos, k_pos):
    """Query and key positions: given, or aligned bottom-right."""
    qp = (np.arange(S_q) + S_k - S_q) if q_pos is None else np.asarray(q_pos)
    kp = np.arange(S_k) if k_pos is None else np.asarray(k_pos)
    if qp.shape != (S_q,) or kp.shape != (S_k,):
        raise ValueError(
            f"q_pos, k_pos: expected shapes ({S_q},), ({S_k},), got "
            f"{qp.shape}, {kp.shape}")
    return qp.astype(np.int64), kp.astype(np.int64)


def _ids(x):
    """Document ids as an integer array: exactly, not through float64
    (which merges ids above 2**53)."""
    ids = np.asarray(x)
    if ids.dtype.kind not in "iu":
        ids = np.asarray(to_numpy(x))
    return ids


def ref_visible(S_q, S_k, causal=False, q_pos=None, k_pos=None,
                segment_ids=None, kv_segment_ids=None, window=None):
    """(B or 1, 1, S_q, S_k) bool: key j visible to query i under every rule
    (DESIGN §2 "Masks"): causal ``k_pos <= q_pos``; window (left, right)
    ``q_pos - left <= k_pos <= q_pos + right`` (None: that side unbounded);
    documents ``segment_ids[b, i] == kv_segment_ids[b, j]`` (kv ids default
    to segment_ids, which then needs S_q == S_k)."""
    visible = np.ones((1, 1, S_q, S_k), bool)
    if causal or window is not None:
        qp, kp = _positions(S_q, S_k, q_pos, k_pos)
        dist = kp[None, :] - qp[:, None]             # k_pos - q_pos
        if causal:
            visible &= (dist <= 0)[None, None]
        if window is not None:
            left, right = window
            if left is not None:
                visible &= (dist >= -int(left))[None, None]
            if right is not None:
                visible &= (dist <= int(right))[None, None]
    if segment_ids is None and kv_segment_ids is not None:
        raise ValueError("kv_segment_ids: given without segment_ids")
    if segment_ids is not None:
        q_ids = _ids(segment_ids)
        kv_ids = q_ids if kv_segment_ids is None else _ids(kv_segment_ids)
        if q_ids.ndim != 2 or q_ids.shape[1] != S_q or kv_ids.ndim != 2 or \
                kv_ids.shape[1] != S_k or kv_ids.shape[0] != q_ids.shape[0]:
            raise ValueError(
                f"segment_ids, kv_segment_ids: expected shapes (B, {S_q}) and "
                f"(B, {S_k}), got {q_ids.shape} and {kv_ids.shape}")
        visible = visible & (q_ids[:, None, :, None] == kv_ids[:, None, None, :])
    return visible


def _score_bias(B, H, S_q, S_k, causal, q_pos, k_pos, bias, masks=None):
    """(B or 1, H or 1, S_q, S_k) float64 additive bias: 0 / -inf mask + `bias`.
    masks: dict of ``ref_visible``'s segment_ids, kv_segment_ids, window."""
    visible = ref_visible(S_q, S_k, causal, q_pos, k_pos, **(masks or {}))
    total = np.where(visible, 0.0, -np.inf)
    if bias is not None:
        b = np.asarray(bias, dtype=np.float64)
        if b.ndim == 3:
            b = b[None]
        total = total + np.broadcast_to(b, (b.shape[0], H, S_q, S_k))
    return total


def _scores(qh, kh, scale, softcap):
    """Scaled scores (B, H, S_q, S_k), soft-capped when softcap is set:
    s -> softcap * tanh(s / softcap).  Also returns d capped / d s (None
    without a cap)."""
    with np.errstate(invalid="ignore", over="ignore"):   # inf * 0: NaN
        scores = scale * np.matmul(qh, kh.swapaxes(-1, -2))
    if softcap is None:
        return scores, None
    t = np.tanh(scores / softcap)
    return softcap * t, 1.0 - t * t


def _probabilities(qh, kh, scale, bias, softcap=None):
    """Softmax probabilities P (B, H, S_q, S_k), lse (B, H, S_q) and `touch`
    (B or 1, H or 1, S_q, S_k) bool: the pairs whose score takes part (key
    visible and score not -inf; a NaN score takes part).

    Rows whose every score is -inf get P = 0 and lse = -inf.  A NaN score
    (or +inf, whose weight is inf / inf) makes the row's P and lse NaN
    where it takes part; P is exactly 0 elsewhere.
    """
    with np.errstate(invalid="ignore"):
        raw = _scores(qh, kh, scale, softcap)[0]
        scores = np.where(np.isneginf(bias), -np.inf, raw + bias)
    touch = ~np.isneginf(scores)
    row_max = scores.max(axis=-1, keepdims=True) if scores.shape[-1] else \
        np.full(scores.shape[:-1] + (1,), -np.inf)
    empty = np.isneginf(row_max)
    shift = np.where(empty, 0.0, row_max)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        weights = np.where(touch, np.exp(scores - shift), 0.0)
        denom = weights.sum(axis=-1, keepdims=True)
        lse = np.where(empty, -np.inf, shift + np.log(np.where(empty, 1.0, denom)))
        probs = np.where(touch, weights / np.where(empty, 1.0, denom), 0.0)
    return probs, lse[..., 0], touch


def _touching_matmul(a, b, touch):
    """a @ b over the last two axes, summing a[..., i, j] * b[..., j, :]
    only where touch[..., i, j] (a is 0 elsewhere): a NaN or infinity in
    row j of b reaches the rows i that touch j, not the others (a plain
    matmul would make 0 * NaN = NaN of them)."""
    if np.isfinite(b).all():
        return np.matmul(a, b)
    touch = np.broadcast_to(touch, a.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        terms = a[..., :, :, None] * b[..., None, :, :]
        return np.where(touch[..., None], terms, 0.0).sum(axis=-2)


def ref_attention(q, k, v, causal=False, scale=None, q_pos=None, k_pos=None,
                  bias=None, segment_ids=None, kv_segment_ids=None,
                  window=None, softcap=None):
    """Exact softmax attention in float64.

    q: (B, S_q, H, D); k, v: (B, S_k, H_kv, D); any float dtype.
    q_pos (S_q,), k_pos (S_k,): integer positions for the causal mask and
    the window (default bottom-right aligned).
    bias: optional float64 additive score bias, shape (H or 1, S_q, S_k) or
    (B or 1, H or 1, S_q, S_k); entries may be -inf (key hidden).
    segment_ids (B, S_q), kv_segment_ids (B, S_k), window (left, right):
    the masks of ``ref_visible``.  softcap: the scaled score s becomes
    ``softcap * tanh(s / softcap)`` before the bias and the softmax.
    Returns (out (B, S_q, H, D) float64, lse (B, H, S_q) float64).
    """
    qh, kh, vh, scale, _ = _prepare(q, k, v, scale)
    B, H, S_q, _ = qh.shape
    S_k = kh.shape[2]
    masks = dict(segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                 window=window)
    total_bias = _score_bias(B, H, S_q, S_k, causal, q_pos, k_pos, bias, masks)
    probs, lse, touch = _probabilities(qh, kh, scale, total_bias, softcap)
    with np.errstate(invalid="ignore", over="ignore"):      # NaN rows
        out = _touching_matmul(probs, vh, touch).transpose(0, 2, 1, 3)  # (B, S_q, H, D)
    return np.ascontiguousarray(out), lse


def ref_attention_backward(dout, q, k, v, causal=False, scale=None, q_pos=None,
                           k_pos=None, bias=None, out=None, dlse=None,
                           segment_ids=None, kv_segment_ids=None, window=None,
                           softcap=None):
    """Analytic gradients of ``ref_attention``'s out with respect to q, k, v.

    dout: (B, S_q, H, D); other arguments as ``ref_attention``.  The forward
    pass is recomputed in float64.  With P = softmax(scale * q k^T + bias),
    dP = dout v^T and delta = rowsum(dout * out) (= rowsum(P * dP) for the
    exact out): dS = P * (dP - delta), dq = scale * dS k,
    dk = scale * dS^T q, dv = P^T dout; dk and dv are summed over the query
    heads of each GQA group.

    out: optional (B, S_q, H, D) forward output to take delta from, as the
    kernels do (they receive `out`, e.g. rounded to bfloat16).  None uses
    the exact float64 out, giving the true gradient.  Passing the kernel's
    own out isolates the backward kernel from the forward's rounding, which
    for bfloat16 moves dq by up to ~1e-2 of max|dq| at S ~ 1e3.
    dlse: optional (B, H, S_q) cotangent of lse (d lse_i / d s_ij = P_ij):
    dS gains P * dlse.  Masks and softcap as ``ref_attention``; with a
    softcap dS is taken through the tanh: dS *= 1 - tanh(s / softcap)^2.
    Returns float64 (dq (B, S_q, H, D), dk, dv (B, S_k, H_kv, D)).
    """
    qh, kh, vh, scale, group = _prepare(q, k, v, scale)
    B, H, S_q, D = qh.shape
    S_k = kh.shape[2]
    H_kv = H // group
    do = to_numpy(dout)
    if do.shape != (B, S_q, H, D):
        raise ValueError(
            f"dout: expected shape {(B, S_q, H, D)}, got {do.shape}")
    doh = do.transpose(0, 2, 1, 3)
    masks = dict(segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                 window=window)
    total_bias = _score_bias(B, H, S_q, S_k, causal, q_pos, k_pos, bias, masks)
    probs, _, touch = _probabilities(qh, kh, scale, total_bias, softcap)
    # NaN and infinities of the inputs go where the module docstring says
    with np.errstate(invalid="ignore", over="ignore"):
        return _backward_from(probs, touch, doh, qh, kh, vh, scale, softcap,
                              out, dlse, group)


def _backward_from(probs, touch, doh, qh, kh, vh, scale, softcap, out, dlse,
                   group):
    """ref_attention_backward's arithmetic from the probabilities on."""
    B, H, S_q, D = qh.shape
    S_k, H_kv = kh.shape[2], H // group
    # (B, H, S_q, S_k); a non-finite v reaches only the pairs in touch
    dprobs = np.where(touch, np.matmul(doh, vh.swapaxes(-1, -2)), 0.0)
    if out is None:
        delta = (probs * dprobs).sum(axis=-1, keepdims=True)
    else:
        out_h = to_numpy(out)
        if out_h.shape != (B, S_q, H, D):
            raise ValueError(
                f"out: expected shape {(B, S_q, H, D)}, got {out_h.shape}")
        delta = (doh * out_h.transpose(0, 2, 1, 3)).sum(axis=-1)[..., None]
    if dlse is not None:
        delta = delta - to_numpy(dlse).astype(np.float64)[..., None]
    dscores = np.where(touch, probs * (dprobs - delta), 0.0)
    if softcap is not None:
        dscores = np.where(touch, dscores * _scores(qh, kh, scale, softcap)[1], 0.0)
    touch_t = np.broadcast_to(touch, dscores.shape).swapaxes(-1, -2)
    dq = scale * _touching_matmul(dscores, kh, touch)          # (B, H, S_q, D)
    dk = scale * _touching_matmul(dscores.swapaxes(-1, -2), qh, touch_t)  # (B, H, S_k, D)
    dv = _touching_matmul(probs.swapaxes(-1, -2), doh, touch_t)
    dk = dk.reshape(B, H_kv, group, S_k, D).sum(axis=2)
    dv = dv.reshape(B, H_kv, group, S_k, D).sum(axis=2)
    return (np.ascontiguousarray(dq.transpose(0, 2, 1, 3)),
            np.ascontiguousarray(dk.transpose(0, 2, 1, 3)),
            np.ascontiguousarray(dv.transpose(0, 2, 1, 3)))


def ref_merge(out1, lse1, out2, lse2):
    """LSE merge of two partial attentions over disjoint key sets (DESIGN 3).

    out1, out2: (B, S, H, D); lse1, lse2: (B, H, S); any float dtype.
    lse = logaddexp(lse1, lse2); out = exp(lse1 - lse) out1 + exp(lse2 - lse)
    out2, where a part with lse = -inf has weight 0 and two empty rows give
    (0, -inf).  Returns float64 (out (B, S, H, D), lse (B, H, S)).
    """
    o1, o2 = to_numpy(out1), to_numpy(out2)
    l1, l2 = to_numpy(lse1), to_numpy(lse2)
    if o1.shape != o2.shape or o1.ndim != 4:
        raise ValueError(
            f"out1, out2: expected equal (B, S, H, D) shapes, got "
            f"{o1.shape}, {o2.shape}")
    B, S, H, _ = o1.shape
    if l1.shape != (B, H, S) or l2.shape != (B, H, S):
        raise ValueError(
            f"lse1, lse2: expected shape {(B, H, S)}, got {l1.shape}, {l2.shape}")
    with np.errstate(invalid="ignore"):     # a NaN part: a NaN row
        lse = np.logaddexp(l1, l2)
    empty = np.isneginf(lse)
    safe = np.where(empty, 0.0, lse)
    with np.errstate(invalid="ignore", over="ignore"):
        w1 = np.where(empty | np.isneginf(l1), 0.0, np.exp(l1 - safe))
        w2 = np.where(empty | np.isneginf(l2), 0.0, np.exp(l2 - safe))
    w1 = w1.transpose(0, 2, 1)[..., None]                      # (B, S, H, 1)
    w2 = w2.transpose(0, 2, 1)[..., None]
    return w1 * o1 + w2 * o2, lse


# --------------------------------------------------------------------------
# dilated attention (LongNet), DESIGN 2
# --------------------------------------------------------------------------

def _check_dilation(segment_lengths, dilation_rates):
    w = [int(x) for x in segment_lengths]
    r = [int(x) for x in dilation_rates]
    if len(w) != len(r) or not w:
        raise ValueError(
            f"segment_lengths, dilation_rates: expected equal non-zero "
            f"lengths, got {len(w)} and {len(r)}")
    if min(w) < 1 or min(r) < 1:
        raise ValueError(
            f"segment_lengths, dilation_rates: expected values >= 1, got "
            f"{w} and {r}")
    return w, r


def _branch_selection(n, w, r, h):
    """(segment id (n,), selected mask (n,)) of one branch for query head h."""
    pos = np.arange(n)
    segment = pos // w
    selected = ((pos - segment * w) % r) == (h % r)
    return segment, selected


def dilated_bias(n, segment_lengths, dilation_rates, heads):
    """Log-multiplicity score bias of dilated attention, (heads, n, n) float64.

    Branch i (segment length w, rate r) cuts positions 0..n-1 into segments
    [s*w, (s+1)*w) (the last may be short) and, for head h, selects position
    p of segment s iff (p - s*w) mod r == h mod r.  c_h(i, j) counts the
    branches selecting both i and j in one segment; the bias is log c_h(i, j),
    -inf where c_h(i, j) == 0.  Causality is not part of the bias.
    """
    w_list, r_list = _check_dilation(segment_lengths, dilation_rates)
    counts = np.zeros((heads, n, n))
    for w, r in zip(w_list, r_list):
        for h in range(heads):
            segment, selected = _branch_selection(n, w, r, h)
            together = (segment[:, None] == segment[None, :]) & \
                selected[:, None] & selected[None, :]
            counts[h] += together
    with np.errstate(divide="ignore"):
        return np.log(counts)


def ref_dilated_attention(q, k, v, segment_lengths, dilation_rates,
                          causal=False, scale=None):
    """LongNet dilated attention in float64, via ``dilated_bias``.

    q: (B, n, H, D); k, v: (B, n, H_kv, D) (S_q == S_k == n).  Causal means
    key j visible to query i iff j <= i.  Returns (out (B, n, H, D),
    lse (B, H, n)) float64; lse is the log of the summed branch
    denominators, so rows no branch selects get out 0 and lse -inf.
    """
    q_np = to_numpy(q)
    _check_square(q_np, k)
    n, H = q_np.shape[1], q_np.shape[2]
    bias = dilated_bias(n, segment_lengths, dilation_rates, H)
    return ref_attention(q_np, k, v, causal=causal, scale=scale, bias=bias)


def ref_dilated_attention_backward(dout, q, k, v, segment_lengths,
                                   dilation_rates, causal=False, scale=None):
    """Gradients of ``ref_dilated_attention``: float64 (dq, dk, dv)."""
    q_np = to_numpy(q)
    _check_square(q_np, k)
    n, H = q_np.shape[1], q_np.shape[2]
    bias = dilated_bias(n, segment_lengths, dilation_rates, H)
    return ref_attention_backward(dout, q_np, k, v, causal=causal, scale=scale,
                                  bias=bias)


def _check_square(q, k):
    s_q, s_k = np.shape(q)[1], np.shape(k)[1]
    if s_q != s_k:
        raise ValueError(
            f"k: dilated attention needs S_k == S_q = {s_q}, got {s_k}")


def ref_dilated_attention_by_branches(q, k, v, segment_lengths, dilation_rates,
                                      causal=False, scale=None):
    """Dilated attention built the LongNet way, independent of the bias form.

    For every branch, head and segment the selected rows of q, k, v are
    gathered explicitly, attended with an ordinary softmax (causal by global
    position), and the per-branch results (out, lse) are combined with
    ``ref_merge``.  Used to test ``ref_dilated_attention``.  Shapes and
    return value as ``ref_dilated_attention``.
    """
    q, k, v = to_numpy(q), to_numpy(k), to_numpy(v)
    _check_square(q, k)
    B, n, H, D = q.shape
    group = H // k.shape[2]
    w_list, r_list = _check_dilation(segment_lengths, dilation_rates)
    total_out = np.zeros((B, n, H, D))
    total_lse = np.full((B, H, n), -np.inf)
    for w, r in zip(w_list, r_list):
        branch_out = np.zeros((B, n, H, D))
        branch_lse = np.full((B, H, n), -np.inf)
        for h in range(H):
            segment, selected = _branch_selection(n, w, r, h)
            for s in range(-(-n // w)):
                rows = np.flatnonzero(selected & (segment == s))
                if rows.size == 0:
                    continue
                kv_head = h // group
                out, lse = ref_attention(
                    q[:, rows, h:h + 1], k[:, rows, kv_head:kv_head + 1],
                    v[:, rows, kv_head:kv_head + 1], causal=causal,
                    scale=scale, q_pos=rows, k_pos=rows)
                branch_out[:, rows, h] = out[:, :, 0]
                branch_lse[:, h, rows] = lse[:, 0]
        total_out, total_lse = ref_merge(total_out, total_lse, branch_out,
                                         branch_lse)
    return total_out, total_lse


def ref_segment_ids(cu_seqlens, seq_len):
    """(1, seq_len) int32 document ids from flash-attn style cumulative
    lengths [0, l_0, l_0 + l_1, ...]: token t gets id i where
    cu_seqlens[i] <= t < cu_seqlens[i + 1]; tokens past the last document
    get id len(cu_seqlens) - 1 (padding: a document of its own)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    ids = np.searchsorted(cu, np.arange(seq_len), side="right") - 1
    return ids.astype(np.int32)[None]
