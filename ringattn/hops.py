"""Which hops a ring call takes: what each rank's queries can see of every
other rank's keys, and the transfers that bring them (DESIGN §4, masks §2).

Visibility.  A rank's shard is one or two pieces of global positions
``start + stride * i`` (``RingPlan.local_pieces``).  Causal masking and a
window bound the distance ``pos_k - pos_q`` to ``[lo, hi]``
(``distance_bounds``); documents add, per piece, the range [min, max] of
its segment ids (exchanged in the agreement), and two pieces whose ranges
do not meet share no document.  ``meet`` turns that into exact row ranges:
which query rows of a piece see any key of another, and which keys are
seen (both contiguous).  Rows and keys outside them are never sent nor
computed; ids only rule out whole pieces.

The hop plan.  Every rank computes the same plan from the agreed data, so
nobody waits for a message that never comes.  Blocks move ``right`` hops
to the next rank (r -> r+1) and ``left`` hops to the previous one
(r -> r-1): a rank at distance d = (r - s) mod p from the owner s of a
block gets it on the right trip when d <= right, else on the left trip
(p - d <= left); right + left is the smallest that covers every rank that
needs a block of another (ties keep the plain ring: right).  Without masks
that is the full lap (right = p - 1); a window over the contiguous layout
needs only the neighbours it reaches, so per rank the plan moves O(window)
tokens, not O(n).

On its trip, block s is cut at hop d to ``rows(trip, s, d)``: the hull of
the key rows of s that the ranks it still has to reach can see (nested:
each hop sends a part of what arrived), and it goes no further than the
last rank that needs it (``reach``).  In the backward pass the dk/dv rows
that no later rank needs go straight home to the owner (``home_rows``)
instead of finishing a lap.
"""

import functools

import numpy as np

from .agreement import RingPlan, shard_lengths
from .layout import shard_progressions

__all__ = ["distance_bounds", "meet", "HopPlan", "layout_hops"]


def distance_bounds(n, causal, window):
    """[lo, hi] of pos_k - pos_q that the rules leave visible, clamped to
    +-(n - 1) (every distance in a sequence of n tokens), so the plan's
    integer arithmetic stays inside int64.  window: None or (left, right),
    each an int >= 0 or None (unbounded)."""
    big = max(n - 1, 0)
    lo, hi = -big, big
    if causal:
        hi = min(hi, 0)
    if window is not None:
        left, right = window
        if left is not None:
            lo = max(lo, -int(left))
        if right is not None:
            hi = min(hi, int(right))
    return lo, hi


def meet(q_start, q_len, k_start, k_len, stride, lo, hi):
    """Which query rows see which keys, for pieces of one stride.

    Query row i of a piece sits at q_start + stride * i (i < q_len), key j
    at k_start + stride * j; key j is visible to row i iff lo <= pos_k -
    pos_q <= hi.  Arguments broadcast (NumPy int64).  Returns (ok, i0, i1,
    j0, j1): ok where some row sees some key; then rows [i0, i1) are those
    that see a key and keys [j0, j1) those that some row sees (exact: the
    difference j - i runs over a range).
    """
    q_start, q_len, k_start, k_len = (np.asarray(x, np.int64) for x in
                                      (q_start, q_len, k_start, k_len))
    c = k_start - q_start
    # m = j - i must satisfy lo <= c + stride * m <= hi
    m_lo = np.maximum(1 - q_len, -((c - lo) // stride))
    m_hi = np.minimum(k_len - 1, (hi - c) // stride)
    ok = (q_len > 0) & (k_len > 0) & (m_lo <= m_hi)
    i0 = np.maximum(0, -m_hi)
    i1 = np.minimum(q_len - 1, k_len - 1 - m_lo) + 1
    j0 = np.maximum(0, m_lo)
    j1 = np.minimum(k_len - 1, q_len - 1 + m_hi) + 1
    return ok, i0, i1, j0, j1


def _piece_table(plan, id_ranges):
    """(p, P) arrays of every rank's pieces: local offset, start, length
    (0 pads), and the id range of each piece (or None)."""
    p = plan.world_size
    pieces = [plan.local_pieces(r) for r in range(p)]
    width = max(1, max(len(x) for x in pieces))
    off, start, length = (np.zeros((p, width), np.int64) for _ in range(3))
    ids = None
    if id_ranges is not None:
        # empty pieces get an empty range (lo > hi): they meet nothing
        ids = np.zeros((2, p, width), np.int64)
        ids[0], ids[1] = 1, 0
    for r, rank_pieces in enumerate(pieces):
        for i, (o, s, _, n) in enumerate(rank_pieces):
            off[r, i], start[r, i], length[r, i] = o, s, n
            if ids is not None:
                ids[:, r, i] = id_ranges[r][i]
    return off, start, length, ids


class HopPlan:
    """The hops, cuts and kernel calls of one ring call (see the module
    docstring).  Built by every rank from the same agreed data.

    plan: the agreement's RingPlan; causal, window: the call's rules;
    id_ranges: None, or per rank a list of (min, max) segment ids per piece.
    """

    TRIPS = ("right", "left")

    def __init__(self, plan, causal, window, id_ranges=None):
        p, r = plan.world_size, plan.rank
        self.world_size, self.rank = p, r
        self.lengths = list(plan.lengths)
        stride = p if plan.layout == "striped" else 1
        lo, hi = distance_bounds(plan.n, causal, window)
        off, start, length, ids = _piece_table(plan, id_ranges)
        # pair (query rank x, piece a; key rank s, piece b): axes (x, a, s, b)
        ok, i0, i1, j0, j1 = meet(start[:, :, None, None],
                                  length[:, :, None, None],
                                  start[None, None], length[None, None],
                                  stride, lo, hi)
        if ids is not None:
            ok &= (ids[0][:, :, None, None] <= ids[1][None, None]) & \
                  (ids[0][None, None] <= ids[1][:, :, None, None])
        self.need = ok.any(axis=(1, 3))                       # (p, p)
        # rows of block s that rank x sees: hull over meeting piece pairs
        k_off = off[None, None]
        big = np.iinfo(np.int64).max
        self._seen_lo = np.where(ok, k_off + j0, big).min(axis=(1, 3))
        self._seen_hi = np.where(ok, k_off + j1, -1).max(axis=(1, 3))
        # this rank's kernel calls against each block: (q piece, k piece)
        self._calls = (ok[r], i0[r], i1[r], j0[r], j1[r], off, start, stride)
        self.right, self.left = self._choose_trips()
        # rows are cut to what later ranks see under a window only (without
        # one, hops carry whole blocks)
        self._cut = {trip: self._cuts(trip, window is not None)
                     for trip in self.TRIPS}
        full = all(np.array_equal(c[s, 1:self.reach(trip, s) + 1],
                                  np.tile([0, self.lengths[s]],
                                          (self.reach(trip, s), 1)))
                   for trip, c in self._cut.items() for s in range(p))
        self.lap = self.left == 0 and self.right == p - 1 and full

    # ---- the plan ----------------------------------------------------------

    def _choose_trips(self):
        """(right, left) hops: the fewest in all that reach every rank
        needing another rank's block; ties keep more hops to the right."""
        p = self.world_size
        x, s = np.nonzero(self.need)
        dist = sorted(set(((x - s) % p).tolist()) - {0})
        best = (p - 1, 0) if dist else (0, 0)
        for right in [0] + dist:
            beyond = [d for d in dist if d > right]
            left = p - beyond[0] if beyond else 0
            if (right + left, -right) < (sum(best), -best[0]):
                best = (right, left)
        return best

    def hops(self, trip):
        return self.right if trip == "right" else self.left

    def holder(self, trip, s, d):
        """The rank that holds block s after d hops of `trip`."""
        return (s + d if trip == "right" else s - d) % self.world_size

    def _cuts(self, trip, cut):
        """Per block s and hop d (0..hops+1): the rows [lo, hi) it carries
        on that hop (d = 0: the whole block; empty past its reach; the
        whole block within its reach unless `cut`)."""
        p, hops, cut_rows = self.world_size, self.hops(trip), cut
        cut = np.zeros((p, hops + 2, 2), np.int64)
        cut[:, 0, 1] = self.lengths
        for s in range(p):
            lo, hi = np.iinfo(np.int64).max, -1
            for d in range(hops, 0, -1):
                x = self.holder(trip, s, d)
                if self.need[x, s]:
                    lo = min(lo, int(self._seen_lo[x, s]))
                    hi = max(hi, int(self._seen_hi[x, s]))
                if hi > lo:
                    cut[s, d] = (lo, hi) if cut_rows else (0, self.lengths[s])
        return cut

    def max_rows(self):
        """The most rows any block carries on any hop (0: no hops)."""
        sizes = [int((c[:, 1:, 1] - c[:, 1:, 0]).max(initial=0))
                 for c in self._cut.values()]
        return max(sizes)

    def rows(self, trip, s, d):
        """(lo, hi): rows of block s that travel on hop d of `trip`
        (lo == hi: the block does not make that hop)."""
        lo, hi = self._cut[trip][s % self.world_size, d]
        return int(lo), int(hi)

    def reach(self, trip, s):
        """Hops block s makes on `trip`."""
        c = self._cut[trip][s % self.world_size, 1:self.hops(trip) + 1]
        return int(np.count_nonzero(c[:, 1] > c[:, 0]))

    def grad_rows(self, trip, s, d):
        """(lo, hi): rows of block s whose dk/dv travel on hop d of `trip`:
        those of its k/v, or with ``lap`` the whole block on every hop
        (dk/dv then finish the lap home, as in the plain ring, and need no
        buffer of their own there)."""
        if self.lap:
            return (0, self.lengths[s % self.world_size]) \
                if 1 <= d <= self.hops(trip) else (0, 0)
        return self.rows(trip, s, d)

    def home_rows(self, trip, s, d):
        """Rows of block s whose dk/dv are final after hop d of `trip` (no
        later hop carries them): at most two runs [(lo, hi)], sent home to
        s by the rank that holds the block then."""
        lo, hi = self.grad_rows(trip, s, d)
        nlo, nhi = self.grad_rows(trip, s, d + 1)
        if hi <= lo:
            return []
        if nhi <= nlo:
            return [(lo, hi)]
        return [(a, b) for a, b in ((lo, nlo), (nhi, hi)) if b > a]

    def steps(self):
        """Ring steps this call takes: the local one and every hop."""
        return 1 + self.right + self.left

    # ---- this rank's side ------------------------------------------------

    def block_at(self, trip, d):
        """Owner of the block this rank holds after d hops of `trip`."""
        return self.holder(trip, self.rank, -d)

    def needs(self, s):
        return bool(self.need[self.rank, s % self.world_size])

    def calls(self, s, row0=0):
        """This rank's kernel calls against block s, whose rows from `row0`
        on it holds: [((q_off, q_len), (k_off, k_len), positions)], k_off
        relative to row0, positions the kernels' keywords."""
        ok, i0, i1, j0, j1, off, start, stride = self._calls
        out = []
        r = self.rank
        for a, b in zip(*np.nonzero(ok[:, s])):
            qi0, qi1 = int(i0[a, s, b]), int(i1[a, s, b])
            kj0, kj1 = int(j0[a, s, b]), int(j1[a, s, b])
            positions = dict(
                q_pos_offset=int(start[r, a]) + stride * qi0,
                q_pos_stride=stride,
                k_pos_offset=int(start[s, b]) + stride * kj0,
                k_pos_stride=stride)
            out.append(((int(off[r, a]) + qi0, qi1 - qi0),
                        (int(off[s, b]) + kj0 - row0, kj1 - kj0), positions))
        return out


@functools.lru_cache(maxsize=64)
def layout_hops(n, p, rank, layout, causal, window):
    """The HopPlan of rank `rank` for n tokens over p ranks in `layout`
    without segment ids (cached: it depends on nothing else)."""
    plan = RingPlan(rank, p, n, shard_lengths(n, p, layout), layout,
                    [shard_progressions(n, p, layout, i) for i in range(p)])
    return HopPlan(plan, causal, window)
