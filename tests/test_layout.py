"""Sequence sharding (ringattn.layout, DESIGN.md section 4)."""

import numpy as np
import pytest

from ringattn import layout as L

LAYOUTS = ["contiguous", "zigzag", "striped"]
SIZES = [(0, 1), (0, 3), (1, 1), (1, 4), (3, 4), (7, 2), (7, 4), (16, 4), (113, 3),
         (1023, 4), (5, 8)]


def test_contiguous_is_array_split():
    got = L.shard_indices(10, 3, "contiguous")
    want = np.array_split(np.arange(10), 3)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_zigzag_example():
    got = L.shard_indices(10, 2, "zigzag")
    # chunks of arange(10) in 4: [0,1,2] [3,4,5] [6,7] [8,9]
    assert [g.tolist() for g in got] == [[0, 1, 2, 8, 9], [3, 4, 5, 6, 7]]


def test_striped_example():
    got = L.shard_indices(10, 3, "striped")
    assert [g.tolist() for g in got] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,p", SIZES)
def test_indices_are_a_partition_with_int64_chunks(layout, n, p):
    idx = L.shard_indices(n, p, layout)
    assert (len(idx) == p and all(i.dtype == np.int64 for i in idx)
            and np.array_equal(np.sort(np.concatenate(idx)), np.arange(n)))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,p", SIZES)
def test_runs_and_progressions_describe_the_indices(layout, n, p):
    for r, idx in enumerate(L.shard_indices(n, p, layout)):
        from_runs = [s + i for s, length in L.shard_runs(n, p, layout, r)
                     for i in range(length)]
        assert from_runs == idx.tolist()
        assert np.array_equal(L.shard_positions(n, p, layout, r), idx)


@pytest.mark.parametrize("n,p", [(16, 4), (113, 3), (9, 2)])
def test_run_counts(n, p):
    counts = {layout: [len(L.shard_runs(n, p, layout, r)) for r in range(p)]
              for layout in LAYOUTS}
    assert (counts["contiguous"] == [1] * p
            and counts["zigzag"] == [2] * (p - 1) + [1]      # rank p-1's chunks touch
            and [len(L.shard_progressions(n, p, "striped", r)) for r in range(p)] == [1] * p)


def test_zigzag_balances_causal_work():
    n, p = 1024, 4
    work = [int((idx + 1).sum()) for idx in L.shard_indices(n, p, "zigzag")]
    assert max(work) - min(work) <= n


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,p", SIZES)
@pytest.mark.parametrize("axis", [1, 0, -1])
def test_unshard_inverts_shard(rng, layout, n, p, axis):
    shape = [2, 3, 5]
    shape[axis] = n
    x = rng.standard_normal(shape).astype(np.float32)
    shards = [L.shard(x, r, p, layout, axis=axis) for r in range(p)]
    assert np.array_equal(L.unshard(shards, layout, axis=axis), x)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_takes_the_indexed_rows(rng, layout):
    x = rng.standard_normal((2, 11, 3, 4))
    idx = L.shard_indices(11, 3, layout)[1]
    got = L.shard(x, 1, 3, layout)
    assert got.flags.c_contiguous and np.array_equal(got, x[:, idx])


def test_shard_keeps_dtype_and_copies(rng):
    x = rng.standard_normal((1, 8, 2)).astype(np.float16)
    s = L.shard(x, 0, 2, "contiguous")
    s[...] = 0
    assert s.dtype == np.float16 and np.all(x[:, :4] != 0)


def test_shard_handles_bfloat16(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = rng.standard_normal((1, 9, 2)).astype(ml_dtypes.bfloat16)
    shards = [L.shard(x, r, 2, "zigzag") for r in range(2)]
    back = L.unshard(shards, "zigzag")
    assert back.dtype == x.dtype and np.array_equal(back.view(np.uint16), x.view(np.uint16))


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("args,error,match", [
    ((10, 2, "diagonal"), ValueError, "layout: expected one of"),
    ((10, 2, None), ValueError, "layout"),
    ((10, 0, "contiguous"), ValueError,
     "world_size: expected an integer >= 1, got 0"),
    ((-1, 2, "zigzag"), ValueError, "n: expected an integer >= 0, got -1"),
    # not an integer: TypeError (NumPy integers are integers)
    ((10.0, 2, "striped"), TypeError, "n: expected an integer"),
    ((10, 2.5, "striped"), TypeError, "world_size: expected an integer"),
    ((10, True, "striped"), TypeError, "world_size: expected an integer"),
    ((10, "2", "striped"), TypeError, "world_size: expected an integer"),
])
def test_shard_indices_rejects_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        L.shard_indices(*args)


def test_shard_indices_takes_numpy_integers():
    assert [x.tolist() for x in L.shard_indices(np.int64(5), np.uint8(2),
                                                "contiguous")] == \
        [[0, 1, 2], [3, 4]]


@pytest.mark.parametrize("rank,error", [(-1, ValueError), (4, ValueError),
                                        (1.0, TypeError)])
def test_shard_rejects_bad_rank(rank, error):
    with pytest.raises(error, match="rank"):
        L.shard(np.zeros((1, 8)), rank, 4, "contiguous")


def test_shard_rejects_bad_axis():
    with pytest.raises(ValueError, match="axis: expected an axis in"):
        L.shard(np.zeros((1, 8)), 0, 2, "contiguous", axis=2)


def test_shard_rejects_non_arrays():
    with pytest.raises(TypeError, match="x: expected a numpy.ndarray"):
        L.shard([[1, 2, 3]], 0, 2, "contiguous")


def test_unshard_rejects_wrong_lengths():
    shards = [np.zeros((1, 3)), np.zeros((1, 5))]  # contiguous n=8 needs 4 and 4
    with pytest.raises(ValueError, match=r"shards\[0\]: expected 4 rows"):
        L.unshard(shards, "contiguous")


def test_unshard_rejects_no_shards():
    with pytest.raises(ValueError, match="shards: expected at least one"):
        L.unshard([], "striped")


# ---------------------------------------------------------------- properties

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(n=st.integers(0, 300), p=st.integers(1, 12),
                  layout=st.sampled_from(LAYOUTS))
def test_shard_unshard_round_trip_property(n, p, layout):
    x = np.arange(n * 2).reshape(2, n)
    shards = [L.shard(x, r, p, layout) for r in range(p)]
    progressions = [L.shard_progressions(n, p, layout, r) for r in range(p)]
    sizes = [sum(length for _, _, length in prog) for prog in progressions]
    assert (np.array_equal(L.unshard(shards, layout), x)
            and sizes == [s.shape[1] for s in shards]
            and max(sizes) - min(sizes) <= (2 if layout == "zigzag" else 1))
