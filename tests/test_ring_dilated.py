"""Dilated (LongNet) attention over the ring: correctness and traffic.

Correctness: every rank takes its shard of the same random q, k, v, dout;
``ring_dilated_attention`` and its backward are gathered with ``ra.unshard``
and compared with ``ref_dilated_attention(_backward)`` on the whole
sequence (tolerance ``ringattn.testing.tolerance(dtype)``: max |a - ref| <=
atol + rtol * max |ref|, rtol 1e-10 for float64, 2e-5 for float32).

Traffic (DESIGN §4, "Dilated ring"): a branch whose segments lie inside one
shard sends nothing; a branch whose segments span shards sends only the
selected rows (1/r of them) and only the kv heads that read them.  With
contiguous shards of L = n/p tokens and segments aligned to shards, branch
(w, r) with w > L makes every rank send to the w/L - 1 other ranks of its
segment, for each offset o < r, the L/r rows at offset o of every kv head
some query head h = o (mod r) reads:

    bytes(w, r) = (w/L - 1) * sum_o |{h // (H/H_kv) : h = o mod r}|
                  * (L/r) * 2 * B * D * itemsize

while the dense ring sends (p - 1) * 2 * B * L * H_kv * D * itemsize.
"""

import numpy as np
import pytest

import ringattn as ra
from ringattn.testing import (close_failures, random_problem, random_qkv,
                              ref_dilated_attention,
                              ref_dilated_attention_backward)

LAYOUTS = ("contiguous", "zigzag", "striped")
LAUNCH_TIMEOUT = 60
# the correctness tests run on thread ranks with host arrays, and (marked
# gpu, where a CUDA device is there: CI's emulated GPU) with CUDA arrays
WHERE = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not ra.cuda_available(), reason="no CUDA device")])]


# ---- per-rank bodies (module level, so they pickle for backend="host") ----

def dilated_fwd_bwd(comm, q, k, v, dout, segs, rates, layout, causal,
                    num_threads=None):
    """This rank's (out, lse, dq, dk, dv) for its shard of the full arrays
    (on the rank's CUDA device when it has one, brought back to the host)."""
    r, p, dev = comm.rank, comm.size, getattr(comm, "device", None)
    qs, ks, vs, ds = (ra.shard(x, r, p, layout) for x in (q, k, v, dout))
    if dev is not None:
        qs, ks, vs, ds = (ra.to_device(x, dev) for x in (qs, ks, vs, ds))
    out, lse = ra.ring_dilated_attention(qs, ks, vs, comm, segs, rates,
                                         causal=causal, layout=layout,
                                         return_lse=True,
                                         num_threads=num_threads)
    grads = ra.ring_dilated_attention_backward(ds, qs, ks, vs, out, lse, comm,
                                               segs, rates, causal=causal,
                                               layout=layout,
                                               num_threads=num_threads)
    res = (out, lse) + tuple(grads)
    if dev is not None:
        assert all(x.device == dev for x in res)
        res = tuple(ra.to_device(x, "cpu").numpy() for x in res)
    return res


def run_ring(q, k, v, dout, segs, rates, p, layout, causal,
             backend="threads", where="cpu"):
    """where="cuda": thread ranks on the CUDA devices (two when there are,
    ranks alternating), arrays on them."""
    # host ranks are processes on this machine: one kernel thread each
    num_threads = 1 if backend == "host" else None
    devices = None
    if where == "cuda":
        ndev = min(2, ra.cuda_info()["devices"])
        devices = [r % ndev for r in range(p)]
    results = ra.launch(dilated_fwd_bwd, p,
                        args=(q, k, v, dout, segs, rates, layout, causal,
                              num_threads),
                        backend=backend, timeout=LAUNCH_TIMEOUT,
                        devices=devices)
    return [ra.unshard([res[i] for res in results], layout,
                       axis=2 if i == 1 else 1) for i in range(5)]


def reference(q, k, v, dout, segs, rates, causal):
    out, lse = ref_dilated_attention(q, k, v, segs, rates, causal=causal)
    grads = ref_dilated_attention_backward(dout, q, k, v, segs, rates,
                                           causal=causal)
    return (out, lse) + tuple(grads)


def problem(rng, n, H, H_kv, D=8, B=1, dtype="float64"):
    return random_problem(rng, B, n, H, H_kv, D, dtype)


# ---- correctness -----------------------------------------------------------

SEGS, RATES = [5, 16, 64], [1, 2, 4]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("where", WHERE)
def test_ring_dilated_matches_reference(rng, where, p, layout, causal):
    """n = 41 (odd), GQA 4:2, segments 5/16/64 at rates 1/2/4."""
    q, k, v, dout = problem(rng, 41, 4, 2)
    got = run_ring(q, k, v, dout, SEGS, RATES, p, layout, causal, where=where)
    bad = close_failures(got, reference(q, k, v, dout, SEGS, RATES, causal),
                     "float64")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("where", WHERE)
def test_ring_dilated_huge_rates_and_lengths(rng, where, layout):
    """Rates and lengths up to int64's end (past the 23 positions: the
    reference takes them capped at 10**6, which selects the same rows): no
    step of a one-row selection leaves the positions' int64 bound."""
    q, k, v, dout = problem(rng, 23, 8, 2)
    segs, rates = [4, 2**62, 2**63 - 1], [2**62, 3, 2**63 - 1]
    got = run_ring(q, k, v, dout, segs, rates, 3, layout, True, where=where)
    capped = [[min(x, 10**6) for x in xs] for xs in (segs, rates)]
    bad = close_failures(got, reference(q, k, v, dout, *capped, True), "float64")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("H,H_kv", [(8, 8), (8, 2), (4, 1)],
                         ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("where", WHERE)
def test_ring_dilated_heads(rng, where, layout, H, H_kv):
    """Head groupings over 3 ranks, causal, n = 53, rates up to 8."""
    segs, rates = [7, 24, 53], [1, 3, 8]
    q, k, v, dout = problem(rng, 53, H, H_kv)
    got = run_ring(q, k, v, dout, segs, rates, 3, layout, True, where=where)
    bad = close_failures(got, reference(q, k, v, dout, segs, rates, True),
                     "float64")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [1, 3, 6])
@pytest.mark.parametrize("where", WHERE)
def test_ring_dilated_short_sequences(rng, where, n, layout):
    """n <= p + 2 with p = 4: empty and one-token shards."""
    segs, rates = [2, 5], [1, 2]
    q, k, v, dout = problem(rng, n, 4, 2)
    got = run_ring(q, k, v, dout, segs, rates, 4, layout, True, where=where)
    bad = close_failures(got, reference(q, k, v, dout, segs, rates, True),
                     "float64")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("where", WHERE)
def test_ring_dilated_longnet_float32(rng, where, layout):
    """The LongNet-like configuration of the traffic tests, float32."""
    segs, rates = [32, 64, 128, 256], [1, 2, 4, 8]
    q, k, v, dout = problem(rng, 256, 8, 8, D=16, dtype="float32")
    got = run_ring(q, k, v, dout, segs, rates, 4, layout, True, where=where)
    bad = close_failures(got, reference(q, k, v, dout, segs, rates, True),
                     "float32")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("p,layout,causal",
                         [(2, "zigzag", True), (3, "striped", False)])
def test_ring_dilated_host_backend(rng, p, layout, causal):
    """Real processes over sockets."""
    q, k, v, dout = problem(rng, 41, 4, 2)
    got = run_ring(q, k, v, dout, SEGS, RATES, p, layout, causal,
                   backend="host")
    bad = close_failures(got, reference(q, k, v, dout, SEGS, RATES, causal),
                     "float64")
    assert not bad, "\n".join(bad)


# ---- traffic ---------------------------------------------------------------

N, P, D, B = 256, 4, 16, 1
LONGNET = ([32, 64, 128, 256], [1, 2, 4, 8])
ITEMSIZE = 4                                   # float32


def bytes_sent(comm, segs, rates, H, H_kv, layout, causal, dense=False):
    """Bytes this rank sends in one forward (profile['bytes_sent'])."""
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, B, N, N, H, H_kv, D, "float32")
    qs, ks, vs = (ra.shard(x, comm.rank, comm.size, layout) for x in (q, k, v))
    profile = {}
    if dense:
        ra.ring_attention(qs, ks, vs, comm, causal=causal, layout=layout,
                          profile=profile)
    else:
        ra.ring_dilated_attention(qs, ks, vs, comm, segs, rates,
                                  causal=causal, layout=layout,
                                  profile=profile)
    return profile["bytes_sent"]


def selected_row_bytes(segs, rates, H, H_kv):
    """Bytes per rank of the rows a contiguous, aligned ring must share
    (the formula in this module's docstring)."""
    L, group, total = N // P, H // H_kv, 0
    for w, r in zip(segs, rates):
        assert w % L == 0 or L % w == 0, "configuration must be aligned"
        if w <= L:
            continue
        heads_per_offset = sum(len({h // group for h in range(o, H, r)})
                               for o in range(r))
        total += (w // L - 1) * heads_per_offset * (L // r) * 2 * B * D \
            * ITEMSIZE
    return total


def dense_ring_bytes(H_kv):
    return (P - 1) * 2 * B * (N // P) * H_kv * D * ITEMSIZE


@pytest.mark.timeout(60)
@pytest.mark.parametrize("H,H_kv", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_longnet_sends_only_selected_rows(H, H_kv):
    """Each rank sends no more than the selected rows of spanning branches."""
    sent = ra.launch(bytes_sent, P,
                     args=(*LONGNET, H, H_kv, "contiguous", False),
                     backend="threads", timeout=LAUNCH_TIMEOUT)
    bound = selected_row_bytes(*LONGNET, H, H_kv)
    assert bound > 0 and max(sent) <= bound, \
        f"bytes sent per rank {sent}, selected rows {bound}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_longnet_traffic_well_below_dense_ring(causal):
    """Total over ranks at least 4x less than the dense ring sends.

    Expected for H = H_kv = 8: branches 32 and 64 stay local, 128 (rate 4)
    and 256 (rate 8) send 16 + 24 KiB per rank against the dense ring's
    3 * 32 KiB * 2 = 192 KiB per rank (4.8x); causal halves both (the
    dense ring sends a block only to the ranks after it).
    """
    dilated = ra.launch(bytes_sent, P,
                        args=(*LONGNET, 8, 8, "contiguous", causal),
                        backend="threads", timeout=LAUNCH_TIMEOUT)
    dense = ra.launch(bytes_sent, P,
                      args=(*LONGNET, 8, 8, "contiguous", causal, True),
                      backend="threads", timeout=LAUNCH_TIMEOUT)
    assert sum(dense) == P * dense_ring_bytes(8) // (2 if causal else 1) and \
        4 * sum(dilated) <= sum(dense), \
        f"dilated {dilated} vs dense {dense} bytes per rank"


@pytest.mark.timeout(60)
def test_causal_last_rank_sends_nothing():
    """Contiguous + causal: the last shard's keys are in everyone's future."""
    sent = ra.launch(bytes_sent, P,
                     args=(*LONGNET, 8, 8, "contiguous", True),
                     backend="threads", timeout=LAUNCH_TIMEOUT)
    assert sent[-1] == 0 and sent[0] > 0, f"bytes sent per rank {sent}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("segs,rates", [([16, 64], [1, 2]), ([64], [1]),
                                        ([8, 32, 64], [2, 4, 8])])
def test_branches_inside_one_shard_send_nothing(segs, rates, causal):
    """Segments <= n/p, contiguous, aligned: no bytes on the wire."""
    sent = ra.launch(bytes_sent, P,
                     args=(segs, rates, 8, 2, "contiguous", causal),
                     backend="threads", timeout=LAUNCH_TIMEOUT)
    assert sent == [0] * P, f"bytes sent per rank {sent}"


def transport_bytes(comm, segs, rates):
    """comm.stats() bytes this rank put on the wire during one forward."""
    before = comm.stats()["bytes_sent"]
    bytes_sent(comm, segs, rates, 8, 2, "contiguous", False)
    return comm.stats()["bytes_sent"] - before


@pytest.mark.timeout(120)
def test_local_branches_only_agree_on_the_wire():
    """Real processes: a local-only configuration puts only the agreement
    (one small allgather of the plan, well under 4 KiB) on the sockets."""
    sent = ra.launch(transport_bytes, P, args=([16, 64], [1, 2]),
                     backend="host", timeout=LAUNCH_TIMEOUT)
    assert max(sent) < 4096, f"transport bytes per rank {sent}"


def _rounds(comm, segs, rates):
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, B, N, N, 8, 8, D, "float32")
    qs, ks, vs = (ra.shard(x, comm.rank, comm.size, "contiguous")
                  for x in (q, k, v))
    profile = {}
    ra.ring_dilated_attention(qs, ks, vs, comm, segs, rates, profile=profile)
    return profile["rounds"], profile["bytes_sent"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("segs,rates,expected", [
    (LONGNET[0], LONGNET[1], (P - 1, True)),    # a segment spans every rank
    ([32, 64], [1, 2], (0, False)),             # every segment inside a shard
], ids=["spanning", "local"])
def test_profile_counts_rounds(segs, rates, expected):
    got = ra.launch(_rounds, P, args=(segs, rates), backend="threads",
                    timeout=LAUNCH_TIMEOUT)
    assert [(r, b > 0) for r, b in got] == [expected] * P, got
