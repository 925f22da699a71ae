"""Ring attention (forward and backward) against the float64 reference.

Every rank takes its shard of the same random q, k, v, dout, runs
``ring_attention`` and ``ring_attention_backward``; the shards are gathered
with ``ra.unshard`` and compared with ``ref_attention(_backward)`` over the
whole sequence, causal masking by global position (q_pos = k_pos =
arange(n)).  The wide grid runs on the ``threads`` backend (cheap); a
representative subset runs on ``host`` (real processes through spawn).

Tolerance: ``ringattn.testing.tolerance(dtype)`` of the stored result,
max |actual - ref| <= atol + rtol * max |ref| (float64: rtol 1e-10; float32:
rtol 2e-5; float16 / bfloat16: a few half-ulps of the storage type).
"""

import time

import numpy as np
import pytest

import ringattn as ra
from ringattn.testing import (close_failures, random_problem, ref_attention,
                              ref_attention_backward)

LAYOUTS = ("contiguous", "zigzag", "striped")
LAUNCH_TIMEOUT = 60


# ---- per-rank bodies (module level, so they pickle for backend="host") ----

def ring_fwd_bwd(comm, q, k, v, dout, layout, causal, pass_seq_len,
                 num_threads=None):
    """This rank's (out, lse, dq, dk, dv) for its shard of the full arrays."""
    r, p = comm.rank, comm.size
    n = q.shape[1]
    seq_len = n if pass_seq_len else None
    qs, ks, vs, ds = (ra.shard(x, r, p, layout) for x in (q, k, v, dout))
    out, lse = ra.ring_attention(qs, ks, vs, comm, causal=causal,
                                 layout=layout, seq_len=seq_len,
                                 return_lse=True, num_threads=num_threads)
    dq, dk, dv = ra.ring_attention_backward(ds, qs, ks, vs, out, lse, comm,
                                            causal=causal, layout=layout,
                                            seq_len=seq_len,
                                            num_threads=num_threads)
    return out, lse, dq, dk, dv


def run_ring(q, k, v, dout, p, layout, causal, backend="threads",
             pass_seq_len=False):
    """Gathered (out, lse, dq, dk, dv) of a p-rank ring over the full arrays.

    host ranks are processes on this machine: one kernel thread each, so
    p ranks do not oversubscribe the cores.
    """
    num_threads = 1 if backend == "host" else None
    results = ra.launch(ring_fwd_bwd, p,
                        args=(q, k, v, dout, layout, causal, pass_seq_len,
                              num_threads),
                        backend=backend, timeout=LAUNCH_TIMEOUT)
    gathered = []
    for i in range(5):
        axis = 2 if i == 1 else 1          # lse is (B, H, n_r)
        gathered.append(ra.unshard([res[i] for res in results], layout,
                                   axis=axis))
    return gathered


def reference(q, k, v, dout, causal, out=None):
    """float64 (out, lse, dq, dk, dv) with global positions 0..n-1."""
    pos = np.arange(q.shape[1])
    ref_out, ref_lse = ref_attention(q, k, v, causal=causal, q_pos=pos,
                                     k_pos=pos)
    grads = ref_attention_backward(dout, q, k, v, causal=causal, q_pos=pos,
                                   k_pos=pos, out=out)
    return (ref_out, ref_lse) + tuple(grads)


def problem(rng, n, H, H_kv, D=8, B=2, dtype="float64"):
    return random_problem(rng, B, n, H, H_kv, D, dtype)


# ---- the grid (threads backend) --------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1, 3, 37, 113])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_ring_matches_reference_float64(rng, p, layout, causal, n):
    """p ranks, every layout, odd n and n < p (empty shards), GQA 4:2."""
    q, k, v, dout = problem(rng, n, H=4, H_kv=2)
    got = run_ring(q, k, v, dout, p, layout, causal)
    bad = close_failures(got, reference(q, k, v, dout, causal), "float64")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("H_kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("p", [3, 4])
def test_ring_gqa_float32(rng, p, layout, H_kv):
    """H=4 query heads over 4, 2 (GQA) or 1 (MQA) kv heads, causal."""
    q, k, v, dout = problem(rng, 61, H=4, H_kv=H_kv, D=16, dtype="float32")
    got = run_ring(q, k, v, dout, p, layout, causal=True)
    bad = close_failures(got, reference(q, k, v, dout, True), "float32")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ring_half_precision_storage(rng, dtype):
    """16-bit storage, float32 arithmetic: results within a few half-ulps.

    The backward reference takes delta from the ring's own (rounded) out,
    as the kernels do.
    """
    q, k, v, dout = problem(rng, 45, H=4, H_kv=2, D=16, dtype=dtype)
    got = run_ring(q, k, v, dout, 3, "zigzag", causal=True)
    expected = reference(q, k, v, dout, True, out=got[0])
    bad = close_failures(got, expected, dtype)
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [2, 37])
def test_ring_with_seq_len_given(rng, n, layout):
    """seq_len passed explicitly gives the same result as the reference."""
    q, k, v, dout = problem(rng, n, H=4, H_kv=2)
    got = run_ring(q, k, v, dout, 4, layout, causal=True, pass_seq_len=True)
    bad = close_failures(got, reference(q, k, v, dout, True), "float64")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_empty_sequence(rng, layout):
    """n = 0: every shard is empty and every result has 0 tokens."""
    q, k, v, dout = problem(rng, 0, H=4, H_kv=2)
    got = run_ring(q, k, v, dout, 3, layout, causal=True)
    shapes = [tuple(x.shape) for x in got]
    assert shapes == [(2, 0, 4, 8), (2, 4, 0), (2, 0, 4, 8), (2, 0, 2, 8),
                      (2, 0, 2, 8)], shapes


@pytest.mark.timeout(60)
def test_ring_p1_equals_attention(rng):
    """One rank: ring_attention is plain attention (bitwise close)."""
    q, k, v, dout = problem(rng, 29, H=4, H_kv=2, dtype="float32")
    (ring_out,) = ra.launch(
        lambda comm: ra.ring_attention(q, k, v, comm, causal=True), 1,
        backend="threads", timeout=LAUNCH_TIMEOUT)
    local = ra.attention(q, k, v, causal=True)
    err = float(np.max(np.abs(ring_out - local)))
    assert err <= 1e-6 * float(np.max(np.abs(local))), f"max error {err:.3e}"


def strided_ring(comm, big, layout):
    """Ring over views into one array (strided, last dim contiguous) with an
    explicit scale; returns (out, progress calls)."""
    idx = ra.shard_indices(big.shape[1], comm.size, layout)[comm.rank]
    rows = big[:, idx]
    q, k, v = rows[:, :, :4, :8], rows[:, :, 4:6, 8:16], rows[:, :, 4:6, 16:]
    calls = []
    out = ra.ring_attention(q, k, v, comm, causal=True, scale=0.2,
                            layout=layout,
                            progress=lambda step, steps: calls.append(
                                (step, steps)))
    return out, calls


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_strided_inputs_scale_and_progress(rng, layout):
    """Strided views and scale=0.2 give the reference; progress(step, p) is
    called once per ring step."""
    big = rng.standard_normal((2, 37, 6, 24))
    results = ra.launch(strided_ring, 3, args=(big, layout),
                        backend="threads", timeout=LAUNCH_TIMEOUT)
    out = ra.unshard([res[0] for res in results], layout)
    pos = np.arange(37)
    ref, _ = ref_attention(big[:, :, :4, :8], big[:, :, 4:6, 8:16],
                           big[:, :, 4:6, 16:], causal=True, scale=0.2,
                           q_pos=pos, k_pos=pos)
    calls = [res[1] for res in results]
    bad = close_failures([out], [ref], "float64")
    assert not bad and calls == [[(1, 3), (2, 3), (3, 3)]] * 3, \
        "\n".join(bad) + f"\nprogress calls {calls}"


# ---- real processes (host backend) ----------------------------------------

HOST_CASES = [
    # (p, layout, causal, n, H, H_kv, dtype)
    (2, "zigzag", True, 113, 4, 2, "float64"),
    (3, "striped", True, 37, 4, 1, "float64"),
    (4, "contiguous", False, 3, 4, 4, "float64"),
    (4, "zigzag", True, 101, 4, 2, "float32"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("p,layout,causal,n,H,H_kv,dtype", HOST_CASES)
def test_ring_host_backend(rng, p, layout, causal, n, H, H_kv, dtype):
    """Real processes over sockets: same answers as the reference."""
    q, k, v, dout = problem(rng, n, H=H, H_kv=H_kv, D=16, dtype=dtype)
    got = run_ring(q, k, v, dout, p, layout, causal, backend="host")
    bad = close_failures(got, reference(q, k, v, dout, causal), dtype)
    assert not bad, "\n".join(bad)


# ---- arguments that differ across ranks ------------------------------------

def mismatched_call(comm, kind, op):
    """Call the ring with one argument differing on rank 1 (or all ranks'
    shard lengths not matching seq_len); return what rank raised."""
    r, p = comm.rank, comm.size
    n, H, H_kv, D = 12, 4, 2, 8
    odd = r == 1
    layout = "zigzag" if (kind == "layout" and odd) else "contiguous"
    causal = kind == "causal" and odd
    head_dim = 16 if (kind == "head_dim" and odd) else D
    heads_kv = 1 if (kind == "heads_kv" and odd) else H_kv
    dtype = np.float64 if (kind == "dtype" and odd) else np.float32
    seq_len = n - 1 if kind == "seq_len" else None
    n_r = len(ra.shard_indices(n, p, layout)[r])
    if kind == "lengths" and odd:
        n_r += 1                       # shards no layout produces
    rng = np.random.default_rng(r)
    q = rng.standard_normal((1, n_r, H, head_dim)).astype(dtype)
    k = rng.standard_normal((1, n_r, heads_kv, head_dim)).astype(dtype)
    try:
        if op == "forward":
            ra.ring_attention(q, k, k, comm, causal=causal, layout=layout,
                              seq_len=seq_len)
        else:
            lse = np.zeros((1, H, n_r), np.float64 if dtype == np.float64
                           else np.float32)
            ra.ring_attention_backward(q, q, k, k, q, lse, comm,
                                       causal=causal, layout=layout,
                                       seq_len=seq_len)
    except Exception as err:
        return type(err).__name__, str(err)
    return "no error", ""


MISMATCHES = [
    ("causal", "causal"),
    ("head_dim", "head_dim"),
    ("heads_kv", "heads_kv"),
    ("layout", "layout"),
    ("dtype", "dtype"),
    ("seq_len", "shard lengths"),
    ("lengths", "shard lengths"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["forward", "backward"])
@pytest.mark.parametrize("kind,field", MISMATCHES)
def test_mismatch_raises_value_error_on_every_rank(kind, field, op):
    """Every rank raises ValueError naming the disagreeing field."""
    results = ra.launch(mismatched_call, 4, args=(kind, op),
                        backend="threads", timeout=LAUNCH_TIMEOUT)
    ok = all(name == "ValueError" and field in text for name, text in results)
    assert ok, f"expected ValueError naming {field!r} on every rank, got " \
               f"{results}"


def mismatched_uncaught(comm, kind):
    """Like mismatched_call but lets the error escape to launch."""
    name, text = mismatched_call(comm, kind, "forward")
    if name == "ValueError":
        raise ValueError(text)
    return name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["threads", "host"])
def test_mismatch_surfaces_through_launch(backend):
    """launch raises LaunchError carrying the ranks' ValueError text."""
    with pytest.raises(ra.LaunchError) as info:
        ra.launch(mismatched_uncaught, 3, args=("causal",), backend=backend,
                  timeout=LAUNCH_TIMEOUT)
    text = str(info.value)
    expected = "causal: expected the same value"
    assert "ValueError" in text and expected in text, text


@pytest.mark.timeout(60)
def test_seq_len_mismatch_on_one_rank():
    """p = 1 with a seq_len that is not the shard's length: ValueError."""
    q = np.zeros((1, 5, 2, 8), np.float32)

    def body(comm):
        ra.ring_attention(q, q, q, comm, seq_len=6)

    with pytest.raises(ra.LaunchError, match="shard lengths"):
        ra.launch(body, 1, backend="threads", timeout=LAUNCH_TIMEOUT)


# ---- the call's timeout covers every wait, the agreement included ----------

SLOW_PEER_S = 4.0


def call_ring_op(comm, op, timeout=None):
    """One call of a ring entry point on a small problem."""
    rng = np.random.default_rng(comm.rank)
    q = rng.standard_normal((1, 4, 2, 8))
    if op == "forward":
        return ra.ring_attention(q, q, q, comm, timeout=timeout)
    if op == "dilated_forward":
        return ra.ring_dilated_attention(q, q, q, comm, [4], [2],
                                         timeout=timeout)
    lse = np.zeros((1, 2, 4))
    if op == "backward":
        return ra.ring_attention_backward(q, q, q, q, q, lse, comm,
                                          timeout=timeout)
    return ra.ring_dilated_attention_backward(q, q, q, q, q, lse, comm, [4],
                                              [2], timeout=timeout)


def impatient_and_slow(comm, op):
    """Rank 0 calls with timeout=1 s; rank 1 arrives SLOW_PEER_S late.
    Returns (error type, message, seconds) of rank 0's call."""
    if comm.rank == 1:
        time.sleep(SLOW_PEER_S)
        try:
            call_ring_op(comm, op)
        except Exception:
            pass
        return None
    start = time.monotonic()
    try:
        call_ring_op(comm, op, timeout=1.0)
    except Exception as err:
        return type(err).__name__, str(err), time.monotonic() - start
    return "no error", "", time.monotonic() - start


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend,op", [
    ("threads", "forward"), ("threads", "backward"),
    ("threads", "dilated_forward"), ("threads", "dilated_backward"),
    ("host", "forward")])
def test_call_timeout_bounds_the_agreement(backend, op):
    """A peer that is late by 4 s: the caller's timeout=1.0 raises CommError
    after about 1 s, not after the peer arrives."""
    results = ra.launch(impatient_and_slow, 2, args=(op,), backend=backend,
                        timeout=LAUNCH_TIMEOUT)
    name, text, took = results[0]
    assert name == "CommError" and "timed out" in text and took < 2.5, \
        (name, text, took)
