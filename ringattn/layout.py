"""Sequence sharding for the ring (DESIGN.md section 4).

A sequence of n tokens is split over p ranks.  ``shard_indices`` gives the
global positions each rank holds, ascending within each chunk:

* ``"contiguous"``: ``numpy.array_split(arange(n), p)[r]``.
* ``"zigzag"``: ``arange(n)`` split into 2p chunks with ``array_split``;
  rank r holds chunk r followed by chunk 2p-1-r (balances causal work).
* ``"striped"``: ``arange(r, n, p)``.

Any n >= 0 and p >= 1 works; with n < p some shards are empty.

Ulysses / hybrid (``ulysses=u``, u divides p): the ranks form r = p / u
groups of u consecutive ranks.  Group g holds the shard of rank g in the
layout over r ranks, and its u members split that shard (in shard order)
with ``array_split``: rank g * u + j holds part j.  u = 1 gives the shards
above, u = p contiguous parts of the whole sequence (the layout then no
longer matters).

``shard`` / ``unshard`` act on NumPy arrays only; the public ``ringattn``
wrappers convert other array kinds (JAX, CuPy, PyTorch, Buffers) around
them.  ``shard_runs`` and ``shard_progressions`` describe a shard compactly
for the ring loop, whose kernels take affine positions.
"""

import operator

import numpy as np

from . import checks

__all__ = [
    "LAYOUTS", "shard_indices", "shard_positions", "shard_runs",
    "shard_progressions", "shard", "unshard", "check_ulysses",
]

LAYOUTS = ("contiguous", "zigzag", "striped")


def _as_int(value, name, minimum):
    """`value` as a Python int >= minimum (NumPy integers too): TypeError
    naming `name` for a non-integer (a bool, a float, a string), ValueError
    for one below the minimum -- the rule of ``ringattn.checks``."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an integer, got {value!r}")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name}: expected an integer, got {type(value).__name__} "
            f"{value!r}") from None
    if as_int < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {as_int}")
    return as_int


def check_layout(layout):
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(
            f"layout: expected one of {', '.join(map(repr, LAYOUTS))}, got "
            f"{layout!r}")
    return layout


def _check_rank(rank, world_size):
    rank = _as_int(rank, "rank", 0)
    if rank >= world_size:
        raise ValueError(
            f"rank: expected 0 <= rank < world_size = {world_size}, got {rank}")
    return rank


def check_ulysses(ulysses, world_size):
    """`ulysses` as an int u >= 1 (None: 1) that divides world_size:
    TypeError for a non-integer, else ValueError."""
    u = checks.ulysses_degree(ulysses)
    if world_size % u:
        raise ValueError(
            f"ulysses: expected a divisor of world_size = {world_size} "
            f"(groups of u consecutive ranks), got {u}")
    return u


def _chunk_bounds(n, chunks):
    """Start offsets (chunks + 1,) of ``array_split(arange(n), chunks)``."""
    base, extra = divmod(n, chunks)
    sizes = np.full(chunks, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def _merged(pieces):
    """Pieces without empty ones, adjacent stride-1 pieces joined."""
    merged = []
    for start, stride, length in pieces:
        if length == 0:
            continue
        if merged:
            m_start, m_stride, m_len = merged[-1]
            if m_stride == stride == 1 and m_start + m_len == start:
                merged[-1] = (m_start, 1, m_len + length)
                continue
        merged.append((start, stride, length))
    return merged


def _cut(pieces, lo, hi):
    """Rows [lo, hi) (offsets into the concatenated pieces) as pieces."""
    out, off = [], 0
    for start, stride, length in pieces:
        a, b = max(lo, off), min(hi, off + length)
        if b > a:
            out.append((start + stride * (a - off), stride, b - a))
        off += length
    return out


def shard_progressions(n, world_size, layout, rank, ulysses=1):
    """A shard as arithmetic progressions of global positions.

    Returns a list of ``(start, stride, length)``: the shard's positions are
    the concatenation of ``start + stride * arange(length)`` over the list, in
    order.  Entries with length 0 are dropped and adjacent entries that
    continue each other are merged, so an empty shard is ``[]``, a contiguous
    shard one entry with stride 1, a zigzag shard one or two entries with
    stride 1, and a striped shard one entry with stride ``world_size``.
    ulysses=u: part ``rank % u`` of group ``rank // u``'s shard over
    world_size / u groups (module docstring).
    """
    n = _as_int(n, "n", 0)
    p = _as_int(world_size, "world_size", 1)
    layout = check_layout(layout)
    r = _check_rank(rank, p)
    u = check_ulysses(ulysses, p)
    if u > 1:
        g, j = divmod(r, u)
        group = shard_progressions(n, p // u, layout, g)
        bounds = _chunk_bounds(sum(length for _, _, length in group), u)
        return _merged(_cut(group, int(bounds[j]), int(bounds[j + 1])))
    if layout == "contiguous":
        b = _chunk_bounds(n, p)
        pieces = [(int(b[r]), 1, int(b[r + 1] - b[r]))]
    elif layout == "zigzag":
        b = _chunk_bounds(n, 2 * p)
        far = 2 * p - 1 - r
        pieces = [(int(b[r]), 1, int(b[r + 1] - b[r])),
                  (int(b[far]), 1, int(b[far + 1] - b[far]))]
    else:
        pieces = [(r, p, len(range(r, n, p)))]
    return _merged(pieces)


def shard_runs(n, world_size, layout, rank, ulysses=1):
    """A shard as maximal runs of consecutive positions: list of (start, length).

    contiguous: at most one run; zigzag: at most two (one when the two chunks
    touch, i.e. rank p-1); striped: one run of length 1 per position (unless
    world_size is 1).  An empty shard gives [].
    """
    runs = []
    for start, stride, length in shard_progressions(n, world_size, layout,
                                                    rank, ulysses):
        if stride == 1:
            runs.append((start, length))
        else:
            runs.extend((start + stride * i, 1) for i in range(length))
    return runs


def shard_positions(n, world_size, layout, rank, ulysses=1):
    """Global positions (int64, shape (len,)) held by `rank`, in shard order."""
    parts = [start + stride * np.arange(length, dtype=np.int64)
             for start, stride, length
             in shard_progressions(n, world_size, layout, rank, ulysses)]
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(parts).astype(np.int64, copy=False)


def shard_indices(n, world_size, layout, ulysses=1):
    """Global positions per rank: list of `world_size` int64 arrays.

    Together they are a permutation of ``arange(n)``; see the module
    docstring for each layout and for ``ulysses`` (u = 1: the plain ring).
    """
    p = _as_int(world_size, "world_size", 1)
    return [shard_positions(n, p, layout, r, ulysses) for r in range(p)]


def _check_array(x, name):
    if not isinstance(x, np.ndarray):
        raise TypeError(
            f"{name}: expected a numpy.ndarray (ringattn.shard/unshard convert "
            f"other array kinds), got {type(x).__name__}")


def _check_axis(axis, ndim, name="axis"):
    if isinstance(axis, (bool, np.bool_)):
        raise ValueError(f"{name}: expected an integer, got {axis!r}")
    try:
        axis = operator.index(axis)
    except TypeError:
        raise ValueError(f"{name}: expected an integer, got {axis!r}") from None
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"{name}: expected an axis in [{-ndim}, {ndim}) for a {ndim}-d "
            f"array, got {axis}")
    return axis % ndim


def shard(x, rank, world_size, layout, axis=1, ulysses=1):
    """The rows of `x` along `axis` that `rank` holds, as a new C-contiguous array.

    x: NumPy array of any dtype whose `axis` has the full sequence length n
    (axis 1 for BSHD q/k/v).  Returns an array of x's dtype with
    ``len(shard_indices(n, world_size, layout, ulysses)[rank])`` rows along
    `axis`.
    """
    _check_array(x, "x")
    axis = _check_axis(axis, x.ndim)
    positions = shard_positions(x.shape[axis], world_size, layout, rank,
                                ulysses)
    return np.ascontiguousarray(np.take(x, positions, axis=axis))


def unshard(shards, layout, axis=1, ulysses=1):
    """Reassemble the full array from every rank's shard (inverse of ``shard``).

    shards: sequence of NumPy arrays, one per rank in rank order, equal in
    dtype and in every dimension but `axis`.  n is the sum of their lengths
    along `axis`; each length must be what ``shard_indices(n, len(shards),
    layout, ulysses)`` gives that rank, else ValueError.  Returns a new C-contiguous
    array with n rows along `axis`.
    """
    layout = check_layout(layout)
    shards = list(shards)
    if not shards:
        raise ValueError("shards: expected at least one shard, got 0")
    for i, s in enumerate(shards):
        _check_array(s, f"shards[{i}]")
    ndim = shards[0].ndim
    axis = _check_axis(axis, ndim)
    for i, s in enumerate(shards):
        if s.ndim != ndim:
            raise ValueError(
                f"shards[{i}]: expected {ndim} dimensions, got {s.ndim}")
    lengths = [s.shape[axis] for s in shards]
    n = sum(lengths)
    u = check_ulysses(ulysses, len(shards))
    indices = shard_indices(n, len(shards), layout, u)
    for r, (length, idx) in enumerate(zip(lengths, indices)):
        if length != len(idx):
            groups = f", ulysses={u}" if u > 1 else ""
            raise ValueError(
                f"shards[{r}]: expected {len(idx)} rows along axis {axis} "
                f"({layout} layout, n={n}, world_size={len(shards)}"
                f"{groups}), got {length}")
    stacked = np.concatenate(shards, axis=axis)
    order = np.argsort(np.concatenate(indices), kind="stable")
    return np.ascontiguousarray(np.take(stacked, order, axis=axis))
