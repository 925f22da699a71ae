"""Local dilated (LongNet) attention against the float64 reference.

``ra.dilated_attention`` / ``ra.dilated_attention_backward`` are compared
with ``ref_dilated_attention(_backward)`` (dense attention with the additive
bias log c_h(i, j), DESIGN §2) on random configurations: 1-4 branches,
rates 1..8, segment lengths from 1 to beyond n, odd n, GQA/MQA, causal or
not.  Rows that no branch selects must come out as (0, -inf).

Tolerance: ``ringattn.testing.tolerance(dtype)``, max |actual - ref| <=
atol + rtol * max |ref| (float64 rtol 1e-10, float32 rtol 2e-5, bfloat16
rtol 1.6e-2).
"""

import numpy as np
import pytest

import ringattn as ra
from ringattn.testing import (assert_close, dilated_bias, np_dtype,
                              random_qkv, ref_attention,
                              ref_attention_backward,
                              ref_dilated_attention,
                              ref_dilated_attention_backward)

LAUNCH_TIMEOUT = 60


NAMES = ("out", "lse", "dq", "dk", "dv")


def mismatches(actual, expected, dtype, names=NAMES):
    bad = []
    for name, a, e in zip(names, actual, expected):
        try:
            assert_close(a, e, dtype, name)
        except AssertionError as err:
            bad.append(str(err))
    return bad


def run_dilated(q, k, v, dout, segs, rates, causal, ref_out=False):
    """(out, lse, dq, dk, dv) of the local kernels, and the reference's.

    ref_out=True gives the backward reference the kernel's own out (as the
    kernels take delta from it), which isolates backward from the forward's
    rounding in 16-bit storage.
    """
    out, lse = ra.dilated_attention(q, k, v, segs, rates, causal=causal,
                                    return_lse=True)
    grads = ra.dilated_attention_backward(dout, q, k, v, out, lse, segs,
                                          rates, causal=causal)
    r_out, r_lse = ref_dilated_attention(q, k, v, segs, rates, causal=causal)
    if ref_out:
        bias = dilated_bias(q.shape[1], segs, rates, q.shape[2])
        r_grads = ref_attention_backward(dout, q, k, v, causal=causal,
                                         bias=bias, out=out)
    else:
        r_grads = ref_dilated_attention_backward(dout, q, k, v, segs, rates,
                                                 causal=causal)
    return (out, lse) + tuple(grads), (r_out, r_lse) + tuple(r_grads)


def problem(rng, n, H, H_kv, D=8, B=1, dtype="float64"):
    q, k, v = random_qkv(rng, B, n, n, H, H_kv, D, dtype)
    dout = rng.standard_normal(q.shape).astype(np_dtype(dtype))
    return q, k, v, dout


def random_config(seed):
    """A seeded random problem: n, heads, branches, causal, dtype."""
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.choice([1, 2, 7, 23, 37, 64, 113]))
    H_kv, group = int(rng.choice([1, 2, 4])), int(rng.choice([1, 2, 4]))
    H = min(H_kv * group, 8)
    m = int(rng.integers(1, 5))
    segs = [int(x) for x in rng.integers(1, n + 20, size=m)]
    rates = [int(x) for x in rng.integers(1, 9, size=m)]
    causal = bool(rng.integers(0, 2))
    dtype = ["float64", "float32"][seed % 2]
    return rng, n, H, H_kv, segs, rates, causal, dtype


@pytest.mark.parametrize("seed", range(40))
def test_random_configurations(seed):
    """Random (n, H, H_kv, branches, causal, dtype) against the reference."""
    rng, n, H, H_kv, segs, rates, causal, dtype = random_config(seed)
    q, k, v, dout = problem(rng, n, H, H_kv, B=2, dtype=dtype)
    got, expected = run_dilated(q, k, v, dout, segs, rates, causal)
    bad = mismatches(got, expected, dtype)
    assert not bad, (f"n={n} H={H} H_kv={H_kv} segs={segs} rates={rates} "
                     f"causal={causal}\n" + "\n".join(bad))


# (segment_lengths, dilation_rates): named corners of the configuration
CORNERS = {
    "rate1-one-segment": ([64], [1]),
    "rate1-short-segments": ([8], [1]),
    "segment1": ([1], [1]),
    "rate-above-segment": ([3, 5], [4, 8]),
    "segment-beyond-n": ([200], [2]),
    "longnet": ([4, 8, 16, 32], [1, 2, 4, 8]),
    "same-branch-twice": ([16, 16], [2, 2]),
    "ragged-last-segment": ([10, 27], [3, 2]),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("H,H_kv", [(4, 4), (4, 2), (8, 1)],
                         ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("corner", sorted(CORNERS))
def test_configuration_corners(rng, corner, H, H_kv, causal):
    """Named corners (rate 1, rate > segment, segment > n, ...), n = 53."""
    segs, rates = CORNERS[corner]
    q, k, v, dout = problem(rng, 53, H, H_kv)
    got, expected = run_dilated(q, k, v, dout, segs, rates, causal)
    bad = mismatches(got, expected, "float64")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_rate1_whole_sequence_is_dense_attention(rng, causal):
    """One branch, rate 1, segment >= n: exactly ordinary attention."""
    q, k, v, dout = problem(rng, 41, 4, 2)
    out, lse = ra.dilated_attention(q, k, v, [64], [1], causal=causal,
                                    return_lse=True)
    ref = ref_attention(q, k, v, causal=causal)
    bad = mismatches((out, lse), ref, "float64", names=("out", "lse"))
    assert not bad, "\n".join(bad)


def test_unselected_rows_are_zero_with_minus_inf_lse(rng):
    """H = 1, rate 2: odd offsets are selected by no branch -> (0, -inf)."""
    q, k, v, _ = problem(rng, 9, 1, 1)
    out, lse = ra.dilated_attention(q, k, v, [9], [2], return_lse=True)
    odd = np.arange(1, 9, 2)
    ok = (np.all(np.asarray(out)[:, odd] == 0)
          and np.all(np.isneginf(np.asarray(lse)[:, :, odd])))
    assert ok, f"out rows {np.asarray(out)[0, odd, 0, 0]}, lse " \
               f"{np.asarray(lse)[0, 0, odd]}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bfloat16_storage(rng, causal):
    """bfloat16 storage, float32 arithmetic: within a few bf16 half-ulps."""
    q, k, v, dout = problem(rng, 77, 4, 2, D=16, dtype="bfloat16")
    got, expected = run_dilated(q, k, v, dout, [16, 32, 77], [1, 2, 4],
                                causal, ref_out=True)
    bad = mismatches(got, expected, "bfloat16")
    assert not bad, "\n".join(bad)


# ---- the DilatedAttention object ----------------------------------------

def test_module_matches_functions(rng):
    """DilatedAttention(...)(q, k, v) and .backward equal the functions."""
    segs, rates = [8, 32], [1, 4]
    attn = ra.DilatedAttention(segs, rates, causal=True, scale=0.3)
    q, k, v, dout = problem(rng, 45, 4, 2)
    out, lse = attn(q, k, v, return_lse=True)
    grads = attn.backward(dout, q, k, v, out, lse)
    r_out, r_lse = ref_dilated_attention(q, k, v, segs, rates, causal=True,
                                         scale=0.3)
    r_grads = ref_dilated_attention_backward(dout, q, k, v, segs, rates,
                                             causal=True, scale=0.3)
    bad = mismatches((out, lse) + tuple(grads), (r_out, r_lse) + r_grads,
                     "float64")
    assert not bad, "\n".join(bad)


def test_module_repr_names_configuration():
    text = repr(ra.DilatedAttention((4, 8), (1, 2), causal=True))
    assert text == ("DilatedAttention(segment_lengths=[4, 8], "
                    "dilation_rates=[1, 2], causal=True)"), text


def test_module_accepts_numpy_integers(rng):
    """NumPy integer configuration values are ints too."""
    q, k, v, _ = problem(rng, 20, 2, 2)
    out = ra.DilatedAttention(np.array([8, 16]), [np.int32(1), np.int64(2)])(
        q, k, v)
    ref, _ = ref_dilated_attention(q, k, v, [8, 16], [1, 2])
    bad = mismatches((out,), (ref,), "float64", names=("out",))
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(60)
def test_module_ring_matches_reference(rng):
    """DilatedAttention.ring / .ring_backward over 3 thread ranks."""
    attn = ra.DilatedAttention([8, 32], [1, 4], causal=True)
    q, k, v, dout = problem(rng, 45, 4, 2)
    layout = "zigzag"

    def body(comm):
        shard = lambda x: ra.shard(x, comm.rank, comm.size, layout)
        qs, ks, vs, ds = map(shard, (q, k, v, dout))
        out, lse = attn.ring(qs, ks, vs, comm, layout=layout, return_lse=True)
        return (out, lse) + tuple(attn.ring_backward(ds, qs, ks, vs, out, lse,
                                                     comm, layout=layout))

    results = ra.launch(body, 3, backend="threads", timeout=LAUNCH_TIMEOUT)
    got = [ra.unshard([res[i] for res in results], layout,
                      axis=2 if i == 1 else 1) for i in range(5)]
    r_out, r_lse = ref_dilated_attention(q, k, v, [8, 32], [1, 4], causal=True)
    r_grads = ref_dilated_attention_backward(dout, q, k, v, [8, 32], [1, 4],
                                             causal=True)
    bad = mismatches(got, (r_out, r_lse) + r_grads, "float64")
    assert not bad, "\n".join(bad)


# ---- bad configurations ----------------------------------------------------

BAD_CONFIGS = [
    # (segment_lengths, dilation_rates, argument the message must name)
    ([4, 8], [1], "dilation_rates"),
    ([4], [1, 2], "dilation_rates"),
    ([0], [1], "segment_lengths"),
    ([-4], [1], "segment_lengths"),
    ([4], [0], "dilation_rates"),
    ([4, 8], [1, -2], "dilation_rates"),
    ([2.5], [1], "segment_lengths"),
    ([4.0], [1], "segment_lengths"),
    (["4"], [1], "segment_lengths"),
    ([4], ["2"], "dilation_rates"),
    ([4], [None], "dilation_rates"),
    ([True], [1], "segment_lengths"),
    ([], [], "segment_lengths"),
    (4, [1], "segment_lengths"),
    ([4], 1, "dilation_rates"),
    ([2**63], [1], "segment_lengths"),          # past int64
    ([4], [2**64], "dilation_rates"),
    ([4] * 17, [1] * 17, "segment_lengths"),    # more than MAX_BRANCHES
]
BAD_IDS = [f"{s!r}-{r!r}" for s, r, _ in BAD_CONFIGS]


def _call_local(segs, rates):
    x = np.zeros((1, 4, 2, 8))
    return ra.dilated_attention(x, x, x, segs, rates)


def _call_backward(segs, rates):
    x = np.zeros((1, 4, 2, 8))
    lse = np.zeros((1, 2, 4))
    return ra.dilated_attention_backward(x, x, x, x, x, lse, segs, rates)


def _call_module(segs, rates):
    return ra.DilatedAttention(segs, rates)


def _call_ring(segs, rates):
    x = np.zeros((1, 4, 2, 8))
    return ra.launch(lambda comm: ra.ring_dilated_attention(
        x, x, x, comm, segs, rates), 1, backend="threads",
        timeout=LAUNCH_TIMEOUT)


ENTRY_POINTS = {"dilated_attention": _call_local,
                "dilated_attention_backward": _call_backward,
                "DilatedAttention": _call_module}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("segs,rates,argname", BAD_CONFIGS, ids=BAD_IDS)
def test_bad_configuration_raises_value_error(entry, segs, rates, argname):
    """ValueError whose message names the offending argument."""
    with pytest.raises(ValueError, match=argname):
        ENTRY_POINTS[entry](segs, rates)


@pytest.mark.parametrize("segs,rates,argname", BAD_CONFIGS, ids=BAD_IDS)
def test_bad_configuration_in_jax_before_tracing(jax_module, segs, rates, argname):
    """ringattn.jax.dilated_attention checks as ra does, eagerly and under
    jit (not an OverflowError, nor an XLA error when the program runs)."""
    jax = jax_module
    import ringattn.jax as rj

    x = jax.numpy.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match=argname):
        rj.dilated_attention(x, x, x, segs, rates)
    with pytest.raises(ValueError, match=argname):
        jax.jit(lambda x: rj.dilated_attention(x, x, x, segs, rates))(x)


# ---- huge rates and lengths --------------------------------------------------

# rates and lengths past the sequence (up to int64's end): a rate at or past
# the segment selects one position per segment (offset h mod r), a length
# past the sequence makes one segment; the reference takes them capped at
# 10**6, which selects the same rows of these 37 positions
HUGE = [([4], [2**62]), ([4, 2**62], [2**62, 3]), ([2**63 - 1], [2**63 - 1]),
        ([5, 7, 9], [2**40, 2**62, 2]), ([37], [2**62 + 1])]


def _capped(values):
    return [min(x, 10**6) for x in values]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("segs,rates", HUGE, ids=[f"{s}-{r}" for s, r in HUGE])
def test_huge_rates_and_lengths(rng, segs, rates, causal):
    """No overflow in the kernels' strides (a UBSan report before), and the
    reference's answer, locally and through ringattn.jax."""
    q, k, v, dout = problem(rng, 37, 8, 2)
    got, _ = run_dilated(q, k, v, dout, segs, rates, causal)
    _, ref = run_dilated(q, k, v, dout, _capped(segs), _capped(rates), causal)
    bad = mismatches(got, ref, "float64")
    assert not bad, "\n".join(bad)


def test_huge_rates_and_lengths_through_jax(jax_module, rng):
    jax = jax_module
    import ringattn.jax as rj

    q, k, v, dout = problem(rng, 37, 8, 2)
    for segs, rates in HUGE:
        f = jax.jit(lambda q, k, v: rj.dilated_attention(q, k, v, segs, rates,
                                                         causal=True))
        out, pullback = jax.vjp(f, q, k, v)
        ref = ref_dilated_attention(q, k, v, _capped(segs), _capped(rates), causal=True)
        assert_close(np.asarray(out), ref[0], "float64")
        refs = ref_dilated_attention_backward(dout, q, k, v, _capped(segs),
                                              _capped(rates), causal=True)
        for name, g, r in zip(("dq", "dk", "dv"), pullback(dout), refs):
            assert_close(np.asarray(g), r, "float64", name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("segs,rates,argname",
                         [BAD_CONFIGS[0], BAD_CONFIGS[2], BAD_CONFIGS[6],
                          BAD_CONFIGS[12], BAD_CONFIGS[15], BAD_CONFIGS[17]],
                         ids=[BAD_IDS[i] for i in (0, 2, 6, 12, 15, 17)])
def test_bad_configuration_in_the_ring(segs, rates, argname):
    """The ring checks the configuration too; launch carries the message."""
    with pytest.raises(ra.LaunchError, match=f"ValueError: {argname}"):
        _call_ring(segs, rates)
