"""The ring with masks (documents, windows, soft-capping) against the float64
reference, the hops it takes, the bytes it moves and what it refuses.

Every rank passes the segment ids of its own shard; the reference sees the
whole sequence with global positions (q_pos = k_pos = arange(n)).  Grids run
on the ``threads`` backend; a subset runs on ``host`` (real processes).
Tolerance: ``ringattn.testing.tolerance(dtype)`` of the stored result.

Bytes: a window over the contiguous layout moves only the rows a
neighbour's window reaches: per rank, the k/v of `left` rows (plus the ids)
forward; backward those again and their dk/dv there and home -- O(window),
whatever n is.
"""

import struct

import numpy as np
import pytest

import ringattn as ra
from ringattn import agreement
from ringattn.agreement import RingPlan, shard_lengths
from ringattn.hops import HopPlan, meet
from ringattn.layout import shard_progressions
from ringattn.testing import (close_failures, random_problem, ref_attention,
                              ref_attention_backward, ref_segment_ids,
                              ref_visible)

LAYOUTS = ("contiguous", "zigzag", "striped")
LAUNCH_TIMEOUT = 120


# ---- per-rank bodies (module level, so they pickle for backend="host") ----

def masked_fwd_bwd(comm, q, k, v, dout, ids, layout, causal, mask):
    """This rank's (out, lse, dq, dk, dv) and the two profiles."""
    r, p = comm.rank, comm.size
    qs, ks, vs, ds = (ra.shard(x, r, p, layout) for x in (q, k, v, dout))
    kw = dict(mask, causal=causal, layout=layout, num_threads=1)
    if ids is not None:
        kw["segment_ids"] = ra.shard(ids, r, p, layout, axis=1)
    fwd, bwd = {}, {}
    out, lse = ra.ring_attention(qs, ks, vs, comm, return_lse=True,
                                 profile=fwd, **kw)
    grads = ra.ring_attention_backward(ds, qs, ks, vs, out, lse, comm,
                                       profile=bwd, **kw)
    return (out, lse) + tuple(grads) + (fwd, bwd)


def run_masked(q, k, v, dout, ids, p, layout, causal, mask,
               backend="threads"):
    """Gathered (out, lse, dq, dk, dv) and per-rank profiles (fwd, bwd)."""
    results = ra.launch(masked_fwd_bwd, p,
                        args=(q, k, v, dout, ids, layout, causal, mask),
                        backend=backend, timeout=LAUNCH_TIMEOUT)
    gathered = [ra.unshard([res[i] for res in results], layout,
                           axis=2 if i == 1 else 1) for i in range(5)]
    return gathered, [res[5] for res in results], [res[6] for res in results]


def reference(q, k, v, dout, ids, causal, mask, out=None):
    pos = np.arange(q.shape[1])
    kw = dict(causal=causal, q_pos=pos, k_pos=pos, segment_ids=ids, **mask)
    ref_out, ref_lse = ref_attention(q, k, v, **kw)
    grads = ref_attention_backward(dout, q, k, v, out=out, **kw)
    return (ref_out, ref_lse) + tuple(grads)


def random_documents(rng, B, n):
    """(B, n) int32 sorted document ids per row: documents of length 1 mixed
    with long ones (which cross shard boundaries)."""
    rows = []
    for _ in range(B):
        lengths = []
        while sum(lengths) < n:
            lengths.append(1 if rng.random() < 0.3 else
                           int(rng.integers(2, max(3, n // 2))))
        cu = np.concatenate([[0], np.cumsum(lengths)])
        cu[-1] = n
        rows.append(ref_segment_ids(cu, n)[0])
    return np.stack(rows).astype(np.int32)


def masks(n):
    """(name, documents?, causal, mask keywords) of the grid."""
    return [
        ("docs", True, True, {}),
        ("docs-full", True, False, {}),
        ("w0", False, False, dict(window=(0, 0))),
        ("w1-causal", False, True, dict(window=(1, 0))),
        ("w3-5", False, False, dict(window=(3, 5))),
        ("wide", False, True, dict(window=(n + 5, n + 5))),
        ("right-only", False, False, dict(window=(None, 2))),
        ("left-only", False, False, dict(window=(4, None))),
        ("softcap", False, True, dict(softcap=2.0)),
        ("all", True, True, dict(window=(6, 0), softcap=5.0)),
    ]


MASK_NAMES = [m[0] for m in masks(0)]


def _problem(rng, n, B=2, H=4, H_kv=2, D=8, dtype="float64", big=False):
    q, k, v, dout = random_problem(rng, B, n, H, H_kv, D, dtype)
    if big:                       # large scores: the softcap bites
        q = q * 8
    return q, k, v, dout


# ---- the grid against the reference -----------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", MASK_NAMES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_masked_ring_matches_reference(rng, p, layout, name):
    """Forward and backward, every layout, odd n, GQA 4:2, float64."""
    n = 37
    _, docs, causal, mask = dict((m[0], m) for m in masks(n))[name]
    q, k, v, dout = _problem(rng, n, big="softcap" in mask)
    ids = random_documents(rng, 2, n) if docs else None
    got, _, _ = run_masked(q, k, v, dout, ids, p, layout, causal, mask)
    bad = close_failures(got, reference(q, k, v, dout, ids, causal, mask),
                         "float64")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("H_kv", [4, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_masked_ring_float32_gqa(rng, layout, H_kv):
    """float32, H=4 over 4 or 1 kv heads, documents + window + softcap,
    n smaller than a multiple of p."""
    n, mask = 61, dict(window=(9, 3), softcap=4.0)
    q, k, v, dout = _problem(rng, n, H=4, H_kv=H_kv, D=16, dtype="float32",
                             big=True)
    ids = random_documents(rng, 2, n)
    got, _, _ = run_masked(q, k, v, dout, ids, 3, layout, True, mask)
    bad = close_failures(got, reference(q, k, v, dout, ids, True, mask),
                         "float32")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(120)
def test_unsorted_ids_and_empty_shards(rng):
    """Ids that are not sorted (documents interleaved) and n < p."""
    for n, p in ((23, 3), (3, 4)):
        q, k, v, dout = _problem(rng, n)
        ids = rng.integers(0, 3, size=(2, n)).astype(np.int64)
        got, _, _ = run_masked(q, k, v, dout, ids, p, "zigzag", False, {})
        bad = close_failures(got, reference(q, k, v, dout, ids, False, {}),
                             "float64")
        assert not bad, f"n={n}, p={p}\n" + "\n".join(bad)


HOST_MASKS = [
    # (causal, documents, mask)
    (True, True, dict(window=(5, 0))),
    (False, False, dict(window=(4, 6), softcap=3.0)),
    (True, True, dict(softcap=2.5)),
    (False, True, dict(window=(None, 2))),
]
# every p and layout, the masks in turn
HOST_CASES = [(p, layout) + HOST_MASKS[(p + i) % len(HOST_MASKS)]
              for p in (1, 2, 3, 4) for i, layout in enumerate(LAYOUTS)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("p,layout,causal,docs,mask", HOST_CASES)
def test_masked_ring_host_backend(rng, p, layout, causal, docs, mask):
    """Real processes over sockets: the same answers as the reference."""
    n = 53
    q, k, v, dout = _problem(rng, n, big="softcap" in mask)
    ids = random_documents(rng, 2, n) if docs else None
    got, _, _ = run_masked(q, k, v, dout, ids, p, layout, causal, mask,
                           backend="host")
    bad = close_failures(got, reference(q, k, v, dout, ids, causal, mask),
                         "float64")
    assert not bad, "\n".join(bad)


# ---- the hops: only what a window or the documents leave visible -----------

def bytes_per_rank(n, p, layout, causal, mask, ids=False, B=1, H_kv=2, D=8):
    """(forward profiles, backward profiles) of a float32 ring."""
    rng = np.random.default_rng(0)
    q, k, v, dout = random_problem(rng, B, n, 2, H_kv, D, "float32")
    seg = np.zeros((B, n), np.int32) if ids else None
    _, fwd, bwd = run_masked(q, k, v, dout, seg, p, layout, causal, mask)
    return fwd, bwd


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [256, 1024])
def test_window_ring_moves_only_the_window(n):
    """Contiguous, causal window (w, 0): each rank sends the k/v (and ids) of
    its last w rows to the next rank and nothing else forward; backward
    those again, their dk/dv and the dk/dv home: the same bytes for every n,
    one hop, against every block to every later rank without the window."""
    p, w, B, H_kv, D = 4, 16, 1, 2, 8
    row_kv = 2 * B * H_kv * D * 4                 # k and v, float32
    row_ids = B * 4
    fwd, bwd = bytes_per_rank(n, p, "contiguous", True, dict(window=(w, 0)),
                              ids=True)
    senders = [w * (row_kv + row_ids)] * (p - 1) + [0]
    assert [x["bytes_sent"] for x in fwd] == senders, fwd
    # backward: k/v + ids to the next rank with their dk/dv (float32, as
    # large as k/v here), and the next rank's dk/dv of our block home
    assert [x["bytes_sent"] for x in bwd] == \
        [(w * (2 * row_kv + row_ids) if r < p - 1 else 0) +
         (w * row_kv if r > 0 else 0) for r in range(p)], bwd
    assert all(x["steps"] == 2 and x["steps_skipped"] == p - 2 for x in fwd)
    # without the window rank r passes blocks r, r-1, ..., 0 on, whole
    plain, _ = bytes_per_rank(n, p, "contiguous", True, {}, ids=True)
    shard = n // p
    assert [x["bytes_sent"] for x in plain] == \
        [(r + 1) * shard * (row_kv + row_ids) if r < p - 1 else 0
         for r in range(p)], plain


@pytest.mark.timeout(120)
def test_window_with_a_right_side_travels_both_ways():
    """window (w, w), not causal: one hop each way, O(w) rows each."""
    n, p, w = 512, 4, 8
    row_kv = 2 * 1 * 2 * 8 * 4
    fwd, _ = bytes_per_rank(n, p, "contiguous", False, dict(window=(w, w)))
    sent = [x["bytes_sent"] for x in fwd]
    # ends send one way, inner ranks both ways
    assert sent == [w * row_kv, 2 * w * row_kv, 2 * w * row_kv,
                    w * row_kv], sent
    assert all(x["steps"] == 3 for x in fwd), fwd


@pytest.mark.timeout(120)
def test_window_wider_than_a_shard_reaches_further_neighbours():
    """w > shard length: blocks go on to the ranks the window still reaches,
    cut to the rows those see."""
    n, p, w = 64, 4, 20                     # shards of 16
    row_kv = 2 * 1 * 2 * 8 * 4
    fwd, _ = bytes_per_rank(n, p, "contiguous", True, dict(window=(w, 0)))
    # rank r -> r+1: its 16 rows (all within 20 of rank r+1's rows); r+1
    # passes on the last 4 of them to r+2
    sent = [x["bytes_sent"] for x in fwd]
    assert sent == [16 * row_kv, (16 + 4) * row_kv, (16 + 4) * row_kv,
                    0], sent


@pytest.mark.timeout(120)
def test_documents_inside_shards_need_no_hop():
    """Sorted ids whose documents never cross a shard boundary: every rank
    stays alone (no byte sent, one step), and the result is still exact."""
    n, p = 40, 4
    rng = np.random.default_rng(1)
    q, k, v, dout = _problem(rng, n)
    ids = np.repeat(np.arange(8), 5)[None].repeat(2, 0).astype(np.int32)
    got, fwd, bwd = run_masked(q, k, v, dout, ids, p, "contiguous", True, {})
    bad = close_failures(got, reference(q, k, v, dout, ids, True, {}),
                         "float64")
    assert not bad, "\n".join(bad)
    assert all(x["bytes_sent"] == 0 and x["steps"] == 1 for x in fwd + bwd)


# ---- the plan itself: exact against brute force ---------------------------

def _plan(n, p, layout, rank, ids=None):
    progs = [shard_progressions(n, p, layout, r) for r in range(p)]
    plan = RingPlan(rank, p, n, shard_lengths(n, p, layout), layout, progs)
    if ids is not None:
        pos = ra.shard_indices(n, p, layout)
        plan.id_ranges = []
        for r in range(p):
            ranges, at = [], 0
            for _, _, length in progs[r]:
                rows = ids[:, pos[r][at:at + length]]
                ranges.append((int(rows.min()), int(rows.max())))
                at += length
            plan.id_ranges.append(ranges)
    return plan


@pytest.mark.parametrize("seed", range(40))
def test_hop_plan_matches_brute_force(seed):
    """For random n, p, layout, causal, window and documents: a rank needs
    a block iff some query sees some key of it; the trips bring it; the rows
    carried cover every key seen; the kernel calls cover every visible
    pair exactly once."""
    rng = np.random.default_rng(seed)
    p = int(rng.integers(1, 6))
    n = int(rng.integers(0, 40))
    layout = LAYOUTS[seed % 3]
    causal = bool(rng.integers(2))
    window = None
    if rng.random() < 0.7:
        window = tuple(None if rng.random() < 0.25 else int(rng.integers(0, 12))
                       for _ in range(2))
        window = None if window == (None, None) else window
    ids = random_documents(rng, 1, n) if rng.random() < 0.5 and n else None
    pos = np.arange(n)
    vis = ref_visible(n, n, causal, pos, pos, segment_ids=ids,
                      window=window).any(axis=(0, 1))           # (n, n)
    shards = ra.shard_indices(n, p, layout)
    for rank in range(p):
        plan = _plan(n, p, layout, rank, ids)
        hp = HopPlan(plan, causal, window, plan.id_ranges)
        assert hp.right + hp.left <= max(p - 1, 0)
        for s in range(p):
            seen = vis[np.ix_(shards[rank], shards[s])]
            assert hp.needs(s) >= seen.any() or s == rank, (rank, s)
            if not seen.any():
                continue
            if s != rank:
                d = (rank - s) % p
                trip, hop = ("right", d) if d <= hp.right else ("left", p - d)
                assert hop <= hp.hops(trip), (rank, s, hp.right, hp.left)
                lo, hi = hp.rows(trip, s, hop)
                keys = np.nonzero(seen.any(axis=0))[0]
                assert lo <= keys.min() and keys.max() < hi, (rank, s)
            covered = np.zeros_like(seen, int)
            for (q_off, q_len), (k_off, k_len), kw in hp.calls(s):
                covered[q_off:q_off + q_len, k_off:k_off + k_len] += 1
                qp = kw["q_pos_offset"] + kw["q_pos_stride"] * np.arange(q_len)
                assert np.array_equal(qp, shards[rank][q_off:q_off + q_len])
                kp = kw["k_pos_offset"] + kw["k_pos_stride"] * np.arange(k_len)
                assert np.array_equal(kp, shards[s][k_off:k_off + k_len])
            assert np.all(covered[seen] == 1) and covered.max() <= 1, \
                (rank, s)


def test_meet_is_exact():
    """meet() against enumeration on small progressions."""
    rng = np.random.default_rng(3)
    for _ in range(500):
        stride = int(rng.integers(1, 4))
        qs, ks = (int(x) for x in rng.integers(-5, 20, 2))
        nq, nk = (int(x) for x in rng.integers(0, 7, 2))
        lo, hi = sorted(int(x) for x in rng.integers(-10, 10, 2))
        ok, i0, i1, j0, j1 = meet(qs, nq, ks, nk, stride, lo, hi)
        diff = (ks + stride * np.arange(nk))[None] - \
            (qs + stride * np.arange(nq))[:, None]
        vis = (diff >= lo) & (diff <= hi)
        assert bool(ok) == vis.any()
        if vis.any():
            rows, keys = np.nonzero(vis.any(axis=1))[0], \
                np.nonzero(vis.any(axis=0))[0]
            assert (i0, i1 - 1, j0, j1 - 1) == (rows.min(), rows.max(),
                                                keys.min(), keys.max())


# ---- the agreement record --------------------------------------------------

def _desc(**masks):
    q = ra.zeros((2, 5, 4, 8), dtype="float32")
    return agreement.describe("fwd", q, q, True, None, "zigzag", None,
                              **masks)


@pytest.mark.parametrize("masks", [
    {}, dict(window=(3, None)), dict(window=(None, 0), softcap=30.0),
    dict(id_ranges=[(0, 4), (1, 0)]), dict(window=(2**62, 7),
                                          id_ranges=[(-2**31, 2**31 - 1),
                                                     (5, 5)]),
])
def test_record_with_masks_round_trips(masks):
    d = _desc(**masks)
    assert agreement.decode(agreement.encode(d)) == d


def _patched_masks(fmt_offset, fmt, value, **masks):
    """A record with a field of its mask block (at fmt_offset) replaced."""
    record = bytearray(agreement.encode(_desc(**masks)))
    struct.pack_into(fmt, record, agreement._HEAD.size + fmt_offset, value)
    return bytes(record)


@pytest.mark.parametrize("record", [
    _patched_masks(0, "<B", 8),                                # flags
    _patched_masks(1, "<q", -2, window=(1, 1)),                # side < -1
    _patched_masks(1, "<q", 5),                                # no window
    _patched_masks(17, "<d", float("nan"), softcap=1.0),       # NaN cap
    _patched_masks(17, "<d", -1.0, softcap=1.0),               # cap <= 0
    _patched_masks(33, "<q", 2**40, id_ranges=[(0, 1), (1, 0)]),  # not int32
    _patched_masks(25, "<q", 9, id_ranges=[(0, 1), (1, 0)]),   # min > max
    _patched_masks(25, "<q", 3),                               # no ids
], ids=["flags", "side", "stray side", "nan softcap", "negative softcap",
        "id range", "inverted range", "stray range"])
def test_malformed_mask_records_are_refused(record):
    with pytest.raises(ValueError):
        agreement.decode(record)


# ---- arguments: checked before any communication, agreed on every rank ----

def bad_call(comm, what, op):
    """Call the ring with one bad mask argument on every rank; return the
    error and the bytes this rank's communicator sent before it."""
    n_r, B = 4, 1
    rng = np.random.default_rng(comm.rank)
    q = rng.standard_normal((B, n_r, 2, 8))
    kw = {"ids shape": dict(segment_ids=np.zeros((B, n_r + 1), np.int32)),
          "ids batch": dict(segment_ids=np.zeros((B + 1, n_r), np.int32)),
          "ids dtype": dict(segment_ids=np.zeros((B, n_r), np.float32)),
          "ids 1-d": dict(segment_ids=np.zeros(n_r, np.int32)),
          "ids too big": dict(segment_ids=np.full((B, n_r), 2**40)),
          "negative window": dict(window=(-1, 0)),
          "window shape": dict(window=(1, 2, 3)),
          "window float": dict(window=(1.5, 0)),
          "softcap 0": dict(softcap=0.0),
          "softcap nan": dict(softcap=float("nan")),
          "softcap negative": dict(softcap=-2.0)}[what]
    try:
        if op == "forward":
            ra.ring_attention(q, q, q, comm, **kw)
        else:
            ra.ring_attention_backward(q, q, q, q, q, np.zeros((B, 2, n_r)),
                                       comm, **kw)
    except Exception as err:
        return type(err).__name__, str(err), comm.stats()["bytes_sent"]
    return "no error", "", comm.stats()["bytes_sent"]


BAD = [("ids shape", "ValueError", "segment_ids"),
       ("ids batch", "ValueError", "segment_ids"),
       ("ids dtype", "TypeError", "segment_ids"),
       ("ids 1-d", "ValueError", "segment_ids"),
       ("ids too big", "ValueError", "segment_ids"),
       ("negative window", "ValueError", "window"),
       ("window shape", "TypeError", "window"),
       ("window float", "TypeError", "window"),
       ("softcap 0", "ValueError", "softcap"),
       ("softcap nan", "ValueError", "softcap"),
       ("softcap negative", "ValueError", "softcap")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["forward", "backward"])
@pytest.mark.parametrize("what,error,name", BAD, ids=[b[0] for b in BAD])
def test_bad_masks_raise_before_any_communication(what, error, name, op):
    results = ra.launch(bad_call, 2, args=(what, op), backend="threads",
                        timeout=LAUNCH_TIMEOUT)
    assert all(r[0] == error and name in r[1] and r[2] == 0
               for r in results), results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("window", [(2**63, 0), (10**30, 2**62), (2**61, 3)])
def test_window_past_every_position_is_unbounded_in_the_ring(window):
    """A side at or past 2**61 (even past int64) reaches every position: the
    ring takes it as unbounded, as ra.attention does, and its agreement
    record carries it (it was a struct.error)."""
    rng = np.random.default_rng(5)
    q, k, v, dout = random_problem(rng, 1, 17, 2, 1, 8, "float64")
    got, _, _ = run_masked(q, k, v, dout, None, 3, "zigzag", True,
                           dict(window=window))
    sides = tuple(None if side >= 2**61 else side for side in window)
    assert not close_failures(got, reference(q, k, v, dout, None, True,
                                             dict(window=sides), out=got[0]),
                              "float64")
    local = ra.attention(q, k, v, causal=True, window=window)
    assert not close_failures([local], [ref_attention(
        q, k, v, causal=True, window=sides)[0]], "float64")


def differing_call(comm, what):
    """One mask argument differs on rank 1; return what this rank raised."""
    odd = comm.rank == 1
    n_r = len(ra.shard_indices(8, comm.size, "contiguous")[comm.rank])
    q = np.random.default_rng(comm.rank).standard_normal((1, n_r, 2, 8))
    kw = {"window": dict(window=(2, 0) if odd else (3, 0)),
          "window side": dict(window=(2, None) if odd else (2, 0)),
          "softcap": dict(softcap=5.0 if odd else 5.000001),
          "segment_ids": dict(segment_ids=np.zeros((1, n_r), np.int32))
          if odd else {}}[what]
    try:
        ra.ring_attention(q, q, q, comm, **kw)
    except Exception as err:
        return type(err).__name__, str(err)
    return "no error", ""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what,field", [
    ("window", "window"), ("window side", "window"), ("softcap", "softcap"),
    ("segment_ids", "segment_ids")])
def test_differing_masks_raise_value_error_on_every_rank(what, field):
    results = ra.launch(differing_call, 3, args=(what,), backend="threads",
                        timeout=LAUNCH_TIMEOUT)
    assert all(name == "ValueError" and f"{field}: expected the same value"
               in text for name, text in results), results


@pytest.mark.parametrize("arg,value", [("segment_ids", np.zeros((1, 4))),
                                       ("window", (2, 0)), ("softcap", 3.0)])
def test_ring_dilated_refuses_masks(arg, value):
    """Masks are not a feature of the dilated ring: a TypeError naming the
    argument, before anything runs."""
    q = np.zeros((1, 4, 2, 8))

    def body(comm):
        ra.ring_dilated_attention(q, q, q, comm, [4], [1], **{arg: value})

    with pytest.raises(ra.LaunchError, match=f"TypeError.*{arg}"):
        ra.launch(body, 1, backend="threads", timeout=LAUNCH_TIMEOUT)
