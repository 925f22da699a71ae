"""Ulysses and hybrid sequence parallelism (``ulysses=u``) against the
float64 reference, forward and backward.

Every rank takes its shard ``ra.shard(x, rank, p, layout, ulysses=u)`` of
the same random q, k, v, dout (and segment ids), runs ``ring_attention``
and ``ring_attention_backward`` with ``ulysses=u``; the shards are gathered
with ``ra.unshard(..., ulysses=u)`` and compared with ``ref_attention
(_backward)`` over the whole sequence with global positions.  The grids
run on the ``threads`` backend; a subset on ``host`` (real processes).

Tolerance: ``ringattn.testing.tolerance(dtype)`` of the stored result,
max |actual - ref| <= atol + rtol * max |ref| (float64: rtol 1e-10;
float32: rtol 2e-5; bfloat16: a few half-ulps).
"""

import numpy as np
import pytest

import ringattn as ra
from ringattn.testing import (close_failures, random_problem, ref_attention,
                              ref_attention_backward, ref_segment_ids)

LAYOUTS = ("contiguous", "zigzag", "striped")
LAUNCH_TIMEOUT = 120
# every (p, u) with 1 < u | p (u = 1 is the plain ring of test_ring.py)
FACTORISATIONS = [(2, 2), (3, 3), (4, 2), (4, 4)]


# ---- per-rank bodies (module level, so they pickle for backend="host") ----

def ulysses_fwd_bwd(comm, q, k, v, dout, ids, layout, causal, u, mask):
    """This rank's (out, lse, dq, dk, dv, forward profile, progress)."""
    r, p = comm.rank, comm.size
    qs, ks, vs, ds = (ra.shard(x, r, p, layout, ulysses=u)
                      for x in (q, k, v, dout))
    kw = dict(mask, causal=causal, layout=layout, ulysses=u)
    if ids is not None:
        kw["segment_ids"] = ra.shard(ids, r, p, layout, ulysses=u)
    prof, calls = {}, []
    out, lse = ra.ring_attention(
        qs, ks, vs, comm, return_lse=True, profile=prof,
        progress=lambda step, steps: calls.append((step, steps)), **kw)
    grads = ra.ring_attention_backward(ds, qs, ks, vs, out, lse, comm, **kw)
    return (out, lse) + tuple(grads) + (prof, calls)


def run(q, k, v, dout, p, u, layout, causal, ids=None, mask=None,
        backend="threads"):
    """Gathered (out, lse, dq, dk, dv), and every rank's (profile,
    progress calls)."""
    results = ra.launch(ulysses_fwd_bwd, p,
                        args=(q, k, v, dout, ids, layout, causal, u,
                              mask or {}),
                        backend=backend, timeout=LAUNCH_TIMEOUT)
    got = [ra.unshard([res[i] for res in results], layout,
                      axis=2 if i == 1 else 1, ulysses=u) for i in range(5)]
    return got, [(res[5], res[6]) for res in results]


def reference(q, k, v, dout, causal, ids=None, mask=None, out=None):
    pos = np.arange(q.shape[1])
    kw = dict(causal=causal, q_pos=pos, k_pos=pos, segment_ids=ids,
              **(mask or {}))
    ref_out, ref_lse = ref_attention(q, k, v, **kw)
    return (ref_out, ref_lse) + tuple(
        ref_attention_backward(dout, q, k, v, out=out, **kw))


def check(got, expected, dtype):
    bad = close_failures(got, expected, dtype)
    assert not bad, "\n".join(bad)


# ---- the grid (threads) -------------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 37])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("p,u", FACTORISATIONS)
def test_ulysses_matches_reference_float64(rng, p, u, layout, causal, n):
    """Every factorisation, layout, causal or not, odd n and n < p; H = 12
    over 2 kv heads (replicated 3 times when u = 3, twice when u = 4)."""
    q, k, v, dout = random_problem(rng, 2, n, 12, 2, 8, "float64")
    got, _ = run(q, k, v, dout, p, u, layout, causal)
    check(got, reference(q, k, v, dout, causal), "float64")


GQA_HEADS = {"mqa": (4, 1), "gqa8:2": (8, 2), "mqa8": (8, 1), "lcm6:3": (6, 3),
             "mha": (4, 4)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p,u,H,H_kv", [
    pytest.param(p, u, H, H_kv, id=f"{name}-{p}-{u}")
    for (p, u) in [(4, 2), (4, 4), (2, 2)] for name, (H, H_kv) in GQA_HEADS.items()
    if H % u == 0])   # H not divisible by u: a ValueError, tested below
def test_ulysses_gqa_float32(rng, p, u, H, H_kv):
    """kv heads fewer than u (replicated), H_kv = 1, and H_kv that neither
    divides nor is divided by u (lcm(H_kv, u) heads), causal zigzag."""
    q, k, v, dout = random_problem(rng, 1, 45, H, H_kv, 16, "float32")
    got, _ = run(q, k, v, dout, p, u, "zigzag", True)
    check(got, reference(q, k, v, dout, True), "float32")


def random_documents(rng, B, n):
    """(B, n) int32 document ids: short and long documents, some crossing
    the shards."""
    rows = []
    for _ in range(B):
        lengths = []
        while sum(lengths) < n:
            lengths.append(int(rng.integers(1, max(2, n // 3))))
        cu = np.concatenate([[0], np.cumsum(lengths)])
        cu[-1] = n
        rows.append(ref_segment_ids(cu, n)[0])
    return np.stack(rows).astype(np.int32)


MASKS = [
    ("docs", True, True, {}),
    ("window", False, True, dict(window=(5, 0))),
    ("window-both", False, False, dict(window=(3, 4))),
    ("softcap", False, True, dict(softcap=2.0)),
    ("all", True, True, dict(window=(7, 0), softcap=3.0)),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,docs,causal,mask", MASKS,
                         ids=[m[0] for m in MASKS])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("p,u", [(4, 2), (4, 4)])
def test_ulysses_masks(rng, p, u, layout, name, docs, causal, mask):
    """Segment ids (the group's ids gathered for the ring), windows over the
    global positions, softcap; GQA 4:1."""
    n = 41
    q, k, v, dout = random_problem(rng, 2, n, 4, 1, 8, "float64")
    if "softcap" in mask:
        q = q * 8
    ids = random_documents(rng, 2, n) if docs else None
    got, _ = run(q, k, v, dout, p, u, layout, causal, ids, mask)
    check(got, reference(q, k, v, dout, causal, ids, mask), "float64")


@pytest.mark.timeout(120)
def test_ulysses_bfloat16_storage(rng):
    """16-bit storage: the backward reference takes delta from the
    returned (rounded) out, as the kernels do."""
    q, k, v, dout = random_problem(rng, 1, 33, 4, 1, 16, "bfloat16")
    got, _ = run(q, k, v, dout, 4, 2, "zigzag", True)
    check(got, reference(q, k, v, dout, True, out=got[0]), "bfloat16")


@pytest.mark.timeout(120)
def test_ulysses_empty_sequence(rng):
    """n = 0: every shard and every result is empty."""
    q, k, v, dout = random_problem(rng, 2, 0, 4, 2, 8, "float64")
    got, _ = run(q, k, v, dout, 4, 2, "zigzag", True)
    assert [tuple(x.shape) for x in got] == [
        (2, 0, 4, 8), (2, 4, 0), (2, 0, 4, 8), (2, 0, 2, 8), (2, 0, 2, 8)]


@pytest.mark.timeout(120)
def test_ulysses_profile_and_progress(rng):
    """progress(step, steps) counts the ring's steps over the r groups;
    the profile adds the all-to-all's bytes and time to the ring's."""
    n, p, u = 64, 4, 2
    q, k, v, dout = random_problem(rng, 1, n, 4, 2, 8, "float32")
    _, ranks = run(q, k, v, dout, p, u, "zigzag", False)
    r = p // u
    for prof, calls in ranks:
        assert calls == [(s, r) for s in range(1, r + 1)], calls
        assert prof["steps"] == r and prof["alltoall_bytes"] > 0, prof
        assert prof["bytes_sent"] > prof["alltoall_bytes"], prof
        assert prof["wait_s"] >= prof["alltoall_s"] >= 0, prof
    # q, k, v in (3 tensors) and out + lse back: (u - 1) / u of each shard
    n_r, itemsize = n // p, 4
    qkv = n_r * (4 + 2 + 2) * 8 * itemsize * (u - 1) // u
    back = n_r * 4 * (8 + 1) * itemsize * (u - 1) // u
    assert ranks[0][0]["alltoall_bytes"] == qkv + back, ranks[0][0]


# ---- real processes (host backend) ---------------------------------------

HOST_CASES = [
    # (p, u, layout, causal, n, H, H_kv, dtype)
    (4, 2, "zigzag", True, 101, 4, 1, "float64"),
    (4, 4, "contiguous", False, 3, 4, 2, "float64"),
    (2, 2, "striped", True, 37, 4, 4, "float32"),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("p,u,layout,causal,n,H,H_kv,dtype", HOST_CASES)
def test_ulysses_host_backend(rng, p, u, layout, causal, n, H, H_kv, dtype):
    """Real processes over sockets: the same answers as the reference."""
    q, k, v, dout = random_problem(rng, 2, n, H, H_kv, 8, dtype)
    got, _ = run(q, k, v, dout, p, u, layout, causal, backend="host")
    check(got, reference(q, k, v, dout, causal), dtype)


# ---- bad arguments: before any communication ---------------------------------

def bad_ulysses_call(comm, H, u, op):
    """Call with H heads and ulysses=u; return (error type, message,
    messages this rank's communicator sent)."""
    n_r = len(ra.shard_indices(16, comm.size, "contiguous")[comm.rank])
    q = np.zeros((1, n_r, H, 8), np.float32)
    lse = np.zeros((1, H, n_r), np.float32)
    try:
        if op == "forward":
            ra.ring_attention(q, q, q, comm, ulysses=u)
        else:
            ra.ring_attention_backward(q, q, q, q, q, lse, comm, ulysses=u)
    except Exception as err:
        return type(err).__name__, str(err), comm.stats()["messages"]
    return "no error", "", comm.stats()["messages"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["forward", "backward"])
@pytest.mark.parametrize("H,u,needles", [
    (6, 4, ["H = 6", "ulysses = 4"]),
    (4, 3, ["divisor of world_size = 4", "got 3"]),
    (4, 0, ["ulysses", ">= 1", "got 0"]),
])
def test_bad_ulysses_is_a_value_error_before_communication(H, u, needles,
                                                           op):
    """H not divisible by u, u not dividing p, u < 1: ValueError on every
    rank naming both numbers, and no message sent."""
    results = ra.launch(bad_ulysses_call, 4, args=(H, u, op),
                        backend="threads", timeout=LAUNCH_TIMEOUT)
    for name, text, sent in results:
        assert name == "ValueError" and sent == 0, (name, text, sent)
        assert all(x in text for x in needles), text


def mixed_ulysses(comm):
    """Rank 1 asks for u = 2, the others for the plain ring."""
    n_r = len(ra.shard_indices(16, comm.size, "contiguous")[comm.rank])
    q = np.zeros((1, n_r, 4, 8), np.float32)
    try:
        ra.ring_attention(q, q, q, comm, ulysses=2 if comm.rank == 1 else 1)
    except Exception as err:
        return type(err).__name__, str(err)
    return "no error", ""


@pytest.mark.timeout(60)
def test_ranks_disagreeing_on_ulysses_raise_on_every_rank():
    """The agreement names the field on every rank (ValueError)."""
    results = ra.launch(mixed_ulysses, 4, backend="threads",
                        timeout=LAUNCH_TIMEOUT)
    assert all(name == "ValueError" and "ulysses" in text
               for name, text in results), results


def wrong_shards(comm):
    """ulysses=2, seq_len=17, but rank 0 holds one token too many."""
    n_r = len(ra.shard_indices(17, comm.size, "zigzag")[comm.rank]) + \
        (comm.rank == 0)
    q = np.zeros((1, n_r, 4, 8), np.float32)
    try:
        ra.ring_attention(q, q, q, comm, layout="zigzag", seq_len=17,
                          ulysses=2)
    except Exception as err:
        return type(err).__name__, str(err)
    return "no error", ""


@pytest.mark.timeout(60)
def test_shard_lengths_are_checked_with_ulysses():
    """Lengths that no ulysses=2 sharding gives: ValueError naming them."""
    results = ra.launch(wrong_shards, 4, backend="threads",
                        timeout=LAUNCH_TIMEOUT)
    assert all(name == "ValueError" and "shard lengths" in text and
               "ulysses=2" in text for name, text in results), results


# ---- sharding ---------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [0, 1, 5, 16, 37])
@pytest.mark.parametrize("p,u", [(1, 1), (2, 2), (4, 2), (4, 4), (6, 3),
                                 (6, 2)])
def test_ulysses_shards_are_the_groups_parts(layout, n, p, u):
    """Rank g u + j holds part j (array_split, in shard order) of group g's
    shard over r = p / u ranks; shard/unshard invert each other."""
    r = p // u
    idx = ra.shard_indices(n, p, layout, ulysses=u)
    for g, group in enumerate(ra.shard_indices(n, r, layout)):
        parts = np.array_split(group, u)
        for j in range(u):
            assert idx[g * u + j].tolist() == parts[j].tolist()
    x = np.arange(2 * n * 3).reshape(2, n, 3)
    shards = [ra.shard(x, i, p, layout, ulysses=u) for i in range(p)]
    np.testing.assert_array_equal(ra.unshard(shards, layout, ulysses=u), x)


def test_ulysses_one_is_the_plain_ring_sharding():
    for layout in LAYOUTS:
        plain = ra.shard_indices(23, 4, layout)
        same = ra.shard_indices(23, 4, layout, ulysses=1)
        assert all(a.tolist() == b.tolist() for a, b in zip(plain, same))


@pytest.mark.parametrize("u,needle", [(3, "divisor of world_size = 4"),
                                      (0, ">= 1")])
def test_bad_ulysses_in_sharding(u, needle):
    with pytest.raises(ValueError, match=needle):
        ra.shard_indices(8, 4, "zigzag", ulysses=u)
    with pytest.raises(ValueError, match=needle):
        ra.shard(np.zeros((1, 8)), 0, 4, "zigzag", ulysses=u)


# ---- one rule for ulysses everywhere -------------------------------------------

def _ulysses_everywhere(u):
    """ulysses=u through every public entry point that takes it (the ring
    ones on one rank, where u = 1 is the only valid degree): the exception
    type of each, or "ok"."""
    x = np.zeros((1, 4, 2, 8))
    lse = np.zeros((1, 2, 4))
    group = ra.ThreadsGroup(1)
    comm = group.comm(0)
    calls = {
        "shard_indices": lambda: ra.shard_indices(4, 1, "zigzag", ulysses=u),
        "shard": lambda: ra.shard(x, 0, 1, "zigzag", ulysses=u),
        "unshard": lambda: ra.unshard([x], "zigzag", ulysses=u),
        "ring_attention": lambda: ra.ring_attention(x, x, x, comm,
                                                    ulysses=u),
        "ring_attention_backward": lambda: ra.ring_attention_backward(
            x, x, x, x, x, lse, comm, ulysses=u),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "ok"
        except Exception as err:
            out[name] = type(err).__name__
    comm.close()
    return out


@pytest.mark.parametrize("u,expect", [
    (1.5, "TypeError"), (True, "TypeError"), ("2", "TypeError"),
    (1.0, "TypeError"), (np.float64(1), "TypeError"), (np.bool_(1), "TypeError"),
    (0, "ValueError"), (-1, "ValueError"), (2, "ValueError"),
    (None, "ok"), (1, "ok"), (np.int64(1), "ok"), (np.uint8(1), "ok"),
])
def test_one_rule_for_ulysses_everywhere(u, expect):
    """A non-integer is a TypeError, an integer out of range (or not a
    divisor of the world size, 1 here) a ValueError, NumPy integers are
    integers, and None is 1 -- in every entry point alike."""
    got = _ulysses_everywhere(u)
    assert set(got.values()) == {expect}, got


# ---- the groups are split once per communicator --------------------------------

def repeated_ulysses(comm, calls):
    """ring_attention(ulysses=2) `calls` times on one communicator.  Per
    call: the messages this rank sent on comm's connections (all its
    communicators), on the group and the ring, and the splits kept on
    comm."""
    import gc

    from ringattn.ulysses import groups

    r, p = comm.rank, comm.size
    rng = np.random.default_rng(5)
    q, k, v, _ = random_problem(rng, 1, 12, 4, 2, 8, "float64")
    qs, ks, vs = (ra.shard(x, r, p, "zigzag", ulysses=2) for x in (q, k, v))
    per_call = []
    for _ in range(calls):
        before = comm.stats()["messages"]
        kids_before = {id(x): x.stats()["messages"]
                       for x in _kept_splits(comm, gc)}
        ra.ring_attention(qs, ks, vs, comm, layout="zigzag", ulysses=2)
        kids = _kept_splits(comm, gc)
        on_kids = sum(x.stats()["messages"] - kids_before.get(id(x), 0)
                      for x in kids)
        total = comm.stats()["messages"] - before
        group, ring = groups(comm, 2)
        per_call.append((total, on_kids, len(kids), (id(group), id(ring))))
    return per_call


def _kept_splits(comm, gc):
    """The Comms split from comm that it keeps (its list of children, as
    the garbage collector sees it)."""
    lists = [x for x in gc.get_referents(comm) if isinstance(x, list)]
    return [c for x in lists for c in x if isinstance(c, ra.Comm)]


@pytest.mark.timeout(60)
def test_ulysses_splits_once_per_communicator():
    """The first call splits comm into the group and the ring (each split
    two allgathers, of the records and of the verdicts on the context:
    4 (p - 1) messages); every later call sends only the agreement's
    allgather (2 (p - 1)) and what the group's all-to-alls and the ring
    send, the same number each time, on the same two communicators:
    nothing grows with the calls."""
    p = 4
    results = ra.launch(repeated_ulysses, p, args=(4,), backend="threads",
                        timeout=LAUNCH_TIMEOUT)
    agreement = 2 * (p - 1)
    split = 4 * (p - 1)
    for per_call in results:
        (first, on_kids0, kids0, pair0), *later = per_call
        assert kids0 == 2
        assert first == agreement + 2 * split + on_kids0
        for total, on_kids, kids, pair in later:
            assert (total, on_kids, kids, pair) == \
                (agreement + on_kids0, on_kids0, 2, pair0)
