"""The blocks a ring call moves: packed buffers, cut to the rows a hop
carries, and the transfers that move them.

A block is m parts of (B, L, H_kv, D) -- k and v, or dk and dv -- packed
as one contiguous (m, B, L, H_kv, D) buffer, so one message moves it; the
segment ids of its rows, (B, L) int32, travel beside it as a second small
message.  A block that arrives with rows [lo, hi) of its owner's shard and
goes on with rows [lo2, hi2) inside them is copied into a packed buffer of
its own first (a transfer reads contiguous memory); every buffer is
allocated once per call, at the size of the largest shard.
"""

from . import _C

__all__ = ["Block", "Packed", "exchange", "copy_rows"]


class Block:
    """k/v (B, L, H_kv, D) of rows [rows[0], rows[1]) of one rank's shard,
    their ids (B, L) or None, and the packed buffer (data, ids) they view
    when they came from a transfer (None for the rank's own inputs)."""

    def __init__(self, k, v, ids, rows, packed=None):
        self.k, self.v, self.ids = k, v, ids
        self.rows = tuple(rows)
        self.packed = packed


def exchange(comm, send, dst, recv, src, step, timeout):
    """Start one sendrecv; either side may be None (nothing to move that
    way).  Returns the request, or None when both are None."""
    if send is None and recv is None:
        return None
    return comm.sendrecv_start(send, dst if send is not None else None,
                               recv, src if recv is not None else None,
                               step=step, timeout=timeout)


def copy_rows(dst, src, axis):
    """dst.copy_(src), for a strided int32 view on a CUDA device too (whose
    copy of non-float elements needs contiguous runs): row by row of axis
    0 there."""
    if dst.dtype == "int32" and dst.device[0] == "cuda" and \
            not (dst.is_contiguous and src.is_contiguous):
        for b in range(dst.shape[0]):
            dst.narrow(0, b, 1).copy_(src.narrow(0, b, 1))
        return
    dst.copy_(src)


class Packed:
    """Flat buffers ("slots") that hold packed blocks (m, B, L, H_kv, D) of
    at most max_len rows, with their ids (B, L) when the call has segment
    ids.  A slot is allocated when first used.
    """

    def __init__(self, m, B, Hkv, D, max_len, dtype, device, with_ids=False):
        self.m, self.B, self.Hkv, self.D = m, B, Hkv, D
        self.max_len, self.dtype, self.device = max_len, dtype, device
        self.with_ids = with_ids
        self._flat, self._ids = [], []

    def reserve(self, count):
        """Allocate slots 0..count-1 at max_len rows now."""
        for i in range(count):
            self.view(i, self.max_len)

    def view(self, i, length):
        """Slot i as a block of `length` rows: (data, ids or None).  A slot
        is allocated when first used and grows when a longer block needs
        it (up to max_len rows)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"a block of {length} rows, expected at most "
                             f"{self.max_len}")
        per_row = self.m * self.B * self.Hkv * self.D
        while len(self._flat) <= i:
            self._flat.append(None)
            self._ids.append(None)
        flat = self._flat[i]
        if flat is None or flat.shape[0] < max(1, per_row * length):
            flat = _C.empty((max(1, per_row * length),), self.dtype,
                            *self.device)
            self._flat[i] = flat
            if self.with_ids:
                self._ids[i] = _C.empty((max(1, self.B * length),), "int32",
                                        *self.device)
        data = flat.narrow(0, 0, per_row * length).reshape(
            (self.m, self.B, length, self.Hkv, self.D))
        ids = None
        if self.with_ids:
            ids = self._ids[i].narrow(0, 0, self.B * length).reshape(
                (self.B, length))
        return data, ids

    @staticmethod
    def part(data, j):
        """Part j (B, L, H_kv, D) of a packed block (m, B, L, H_kv, D)."""
        _, B, L, Hkv, D = data.shape
        return data.narrow(0, j, 1).reshape((B, L, Hkv, D))

    def block(self, i, length, rows):
        """Slot i as a Block of `length` rows, rows `rows` of the shard."""
        data, ids = self.view(i, length)
        return Block(self.part(data, 0), self.part(data, 1), ids, rows,
                     packed=(data, ids))

    def outgoing(self, i, block, lo, hi):
        """What goes on the wire for rows [lo, hi) of `block`: the block's
        own packed buffer when it is exactly that, else a copy packed into
        slot i.  Returns (data, ids)."""
        if block.packed is not None and (lo, hi) == tuple(block.rows):
            return block.packed
        start = lo - block.rows[0]
        data, ids = self.view(i, hi - lo)
        for j, x in enumerate((block.k, block.v)):
            self.part(data, j).copy_(x.narrow(1, start, hi - lo))
        if ids is not None:
            copy_rows(ids, block.ids.narrow(1, start, hi - lo), 1)
        return data, ids

    def gather(self, i, data, runs, base):
        """Rows `runs` ([(lo, hi)], of the shard; `data` holds rows from
        `base` on) packed one after another into slot i: the data only."""
        total = sum(hi - lo for lo, hi in runs)
        if len(runs) == 1 and runs[0] == (base, base + data.shape[2]):
            return data
        out, _ = self.view(i, total)
        at = 0
        for lo, hi in runs:
            out.narrow(2, at, hi - lo).copy_(data.narrow(2, lo - base, hi - lo))
            at += hi - lo
        return out

    @staticmethod
    def scatter(dst, packed, runs):
        """The inverse of gather: rows of `packed`, one run after another,
        into rows `runs` of dst (m, B, n, H_kv, D)."""
        at = 0
        for lo, hi in runs:
            dst.narrow(2, lo, hi - lo).copy_(packed.narrow(2, at, hi - lo))
            at += hi - lo
