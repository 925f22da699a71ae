"""What the ranks of a ring agree on before the first step, and its wire format.

Every rank describes its call in one fixed-size record: the operation,
sizes, dtype, device, causal flag, scale, layout, Ulysses degree, seq_len,
the masks
(window, softcap, whether segment ids are given), the dilated branches,
its own shard length and the range of its segment ids.  One allgather (under the call's
timeout) brings every rank's record, and every rank checks the same list,
so all of them raise together when anything differs.

Nothing received is unpickled or evaluated.  A record is little-endian
integers of fixed widths, parsed with ``struct``; names (operation, dtype,
device, layout) travel as small enum codes and the scale as the bits of its
float64, compared bit for bit (the softcap too).  A record of another size, magic or version,
or with an unknown code, is refused with ``CommError`` naming the rank that
sent it.

Record (little-endian, ``RECORD_SIZE`` bytes)::

    magic "RAP1" | version u16 | op u8 | dtype u8 | device u8 | causal u8 |
    layout u8 | has u8 (bit 0: scale given, bit 1: seq_len given) |
    branches u8 | batch, heads, heads_kv, head_dim, length, seq_len,
    ulysses i64 | scale bits u64 |
    masks u8 (bit 0: window, bit 1: softcap, bit 2: segment ids) |
    window left, right i64 (-1: that side unbounded) | softcap bits u64 |
    ID_CHUNKS x (min, max) segment id i64 ((1, 0): no token) |
    MAX_BRANCHES x (segment length, dilation rate) i64
    (unused fields zero)

Segment id ranges are per chunk of the shard: the whole shard, or for the
zigzag layout its two chunks (the first ceil(length / 2) rows, then the
rest).  The ring skips the steps whose ranges cannot meet.
"""

import struct

from . import _C, layout as _layout

__all__ = ["RingPlan", "describe", "agree", "encode", "decode",
           "RECORD_SIZE"]

MAGIC = b"RAP1"
VERSION = 3
MAX_BRANCHES = _C.MAX_BRANCHES

OPS = ("fwd", "bwd", "dilated_fwd", "dilated_bwd")
DTYPES = ("float32", "float64", "float16", "bfloat16")
DEVICES = ("cpu", "cuda")
LAYOUTS = _layout.LAYOUTS

_HEAD = struct.Struct("<4sHBBBBBBB7qQ")
ID_CHUNKS = 2
_MASKS = struct.Struct(f"<BqqQ{2 * ID_CHUNKS}q")
_BRANCH = struct.Struct("<qq")
RECORD_SIZE = _HEAD.size + _MASKS.size + MAX_BRANCHES * _BRANCH.size

_HAS_SCALE, _HAS_SEQ_LEN = 1, 2
_WINDOW, _SOFTCAP, _IDS = 1, 2, 4
_INT32 = (-2**31, 2**31 - 1)
EMPTY_RANGE = (1, 0)          # the id range of a chunk without tokens

# longest sequence a ring takes (a bound far above any memory, so that a
# peer's record can never make a rank compute with unbounded numbers)
MAX_SEQ_LEN = 2**62

# fields compared across ranks, in the order they are reported
FIELDS = ("op", "batch", "heads", "heads_kv", "head_dim", "dtype", "device",
          "causal", "scale", "layout", "ulysses", "seq_len", "window",
          "softcap",
          "segment_ids", "segment_lengths", "dilation_rates")


class RingPlan:
    """What every rank agreed on before the first ring step.

    Built by ``agree`` from one allgather: sizes, dtype, flags and every
    rank's shard length; any mismatch raises ValueError on every rank (all
    ranks compare the same gathered list, so none is left waiting).
    id_ranges: None, or per rank the (min, max) segment id of each of its
    pieces (``local_pieces``).
    """

    def __init__(self, rank, world_size, n, lengths, layout, progressions,
                 id_ranges=None):
        self.rank = rank
        self.world_size = world_size
        self.n = n
        self.lengths = lengths
        self.layout = layout
        self.progressions = progressions  # per rank: [(start, stride, len)]
        self.id_ranges = id_ranges

    def local_pieces(self, rank):
        """[(local_offset, start, stride, length)] of `rank`'s shard."""
        pieces, off = [], 0
        for start, stride, length in self.progressions[rank]:
            pieces.append((off, start, stride, length))
            off += length
        return pieces


def id_chunks(length, layout):
    """The chunks of a shard of `length` rows whose segment id ranges the
    record carries: [(local_offset, rows)], ID_CHUNKS of them.  Zigzag:
    chunk r then chunk 2p-1-r, the first as long as the second or one
    longer (array_split), so ceil(length / 2) rows; else the whole shard."""
    first = (length + 1) // 2 if layout == "zigzag" else length
    return [(0, first), (first, length - first)]


def describe(op, q, k, causal, scale, layout, seq_len, segment_lengths=(),
             dilation_rates=(), window=None, softcap=None, id_ranges=None,
             ulysses=1):
    """This rank's description of a call (arguments already checked:
    q, k Buffers, scale None or a finite real, seq_len None or an int,
    window None or (left, right) of ints >= 0 or None, softcap None or a
    float > 0, ulysses an int >= 1).  id_ranges: None (no segment ids),
    else the (min, max) segment id of each of ``id_chunks`` (EMPTY_RANGE
    for an empty one)."""
    B, n_r, H, D = q.shape
    return {
        "op": op, "batch": B, "heads": H, "heads_kv": k.shape[2],
        "head_dim": D, "dtype": q.dtype, "device": q.device[0],
        "causal": bool(causal),
        "scale": None if scale is None else float(scale),
        "layout": layout, "seq_len": seq_len, "ulysses": int(ulysses),
        "window": None if window is None else tuple(window),
        "softcap": None if softcap is None else float(softcap),
        "segment_ids": id_ranges is not None,
        "segment_lengths": tuple(segment_lengths),
        "dilation_rates": tuple(dilation_rates), "length": n_r,
        "id_ranges": None if id_ranges is None else
        tuple(tuple(int(x) for x in r) for r in id_ranges),
    }


def _bits(x):
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def _float(bits):
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def encode(desc):
    """The record of a description (bytes of RECORD_SIZE)."""
    segs, rates = desc["segment_lengths"], desc["dilation_rates"]
    has = ((_HAS_SCALE if desc["scale"] is not None else 0) |
           (_HAS_SEQ_LEN if desc["seq_len"] is not None else 0))
    scale_bits = 0 if desc["scale"] is None else _bits(desc["scale"])
    head = _HEAD.pack(
        MAGIC, VERSION, OPS.index(desc["op"]), DTYPES.index(desc["dtype"]),
        DEVICES.index(desc["device"]), int(desc["causal"]),
        LAYOUTS.index(desc["layout"]), has, len(segs), desc["batch"],
        desc["heads"], desc["heads_kv"], desc["head_dim"], desc["length"],
        0 if desc["seq_len"] is None else desc["seq_len"], desc["ulysses"],
        scale_bits)
    window, softcap, ranges = desc["window"], desc["softcap"], \
        desc["id_ranges"]
    masks = ((_WINDOW if window is not None else 0) |
             (_SOFTCAP if softcap is not None else 0) |
             (_IDS if ranges is not None else 0))
    sides = [0, 0] if window is None else \
        [-1 if side is None else side for side in window]
    bounds = [0] * (2 * ID_CHUNKS) if ranges is None else \
        [x for lo_hi in ranges for x in lo_hi]
    mask_block = _MASKS.pack(masks, *sides,
                             0 if softcap is None else _bits(softcap),
                             *bounds)
    pairs = list(zip(segs, rates)) + [(0, 0)] * (MAX_BRANCHES - len(segs))
    return head + mask_block + b"".join(_BRANCH.pack(s, r) for s, r in pairs)


def _code(table, index, field):
    if index >= len(table):
        raise ValueError(f"unknown {field} code {index}")
    return table[index]


def _decode_masks(record):
    """window, softcap, id ranges of a record; ValueError if malformed."""
    masks, left, right, softcap_bits, *bounds = \
        _MASKS.unpack_from(record, _HEAD.size)
    if masks & ~(_WINDOW | _SOFTCAP | _IDS):
        raise ValueError(f"mask flags {masks} out of range")
    window = softcap = ranges = None
    if masks & _WINDOW:
        if left < -1 or right < -1:
            raise ValueError(f"window sides {left}, {right} out of range")
        window = tuple(None if side == -1 else side for side in (left, right))
    elif left or right:
        raise ValueError("window sides set without a window")
    if masks & _SOFTCAP:
        softcap = _float(softcap_bits)
        if not 1e-30 <= softcap <= 1e30:      # the kernels' range
            raise ValueError(f"softcap {softcap!r} out of range")
    elif softcap_bits:
        raise ValueError("softcap bits set without a softcap")
    if masks & _IDS:
        ranges = tuple(zip(bounds[0::2], bounds[1::2]))
        if any((lo, hi) != EMPTY_RANGE and
               not _INT32[0] <= lo <= hi <= _INT32[1] for lo, hi in ranges):
            raise ValueError(f"segment id ranges {ranges}: expected int32 "
                             f"min <= max, or {EMPTY_RANGE} for no token")
    elif any(bounds):
        raise ValueError("segment id ranges set without segment ids")
    return window, softcap, ranges


def decode(record):
    """The description in a record; ValueError saying what is malformed."""
    if len(record) != RECORD_SIZE:
        raise ValueError(f"{len(record)} bytes where a record has "
                         f"{RECORD_SIZE}")
    (magic, version, op, dtype, device, causal, layout, has, branches, batch,
     heads, heads_kv, head_dim, length, seq_len, ulysses, scale_bits) = \
        _HEAD.unpack_from(record)
    if magic != MAGIC:
        raise ValueError(f"magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ValueError(f"version {version}, expected {VERSION}")
    if causal > 1 or has & ~(_HAS_SCALE | _HAS_SEQ_LEN) or \
            branches > MAX_BRANCHES:
        raise ValueError(f"flags causal={causal} has={has} "
                         f"branches={branches} out of range")
    if min(batch, heads, heads_kv, head_dim, length, seq_len) < 0:
        raise ValueError("a negative size")
    if ulysses < 1:
        raise ValueError(f"ulysses {ulysses} out of range")
    window, softcap, id_ranges = _decode_masks(record)
    base = _HEAD.size + _MASKS.size
    pairs = [_BRANCH.unpack_from(record, base + i * _BRANCH.size)
             for i in range(MAX_BRANCHES)]
    used, unused = pairs[:branches], pairs[branches:]
    if any(s < 1 or r < 1 for s, r in used) or any(s or r for s, r in unused):
        raise ValueError("bad dilated branches")
    scale = None
    if has & _HAS_SCALE:
        scale = _float(scale_bits)
    return {
        "op": _code(OPS, op, "operation"), "batch": batch, "heads": heads,
        "heads_kv": heads_kv, "head_dim": head_dim,
        "dtype": _code(DTYPES, dtype, "dtype"),
        "device": _code(DEVICES, device, "device"), "causal": bool(causal),
        "scale": scale,
        "layout": _code(LAYOUTS, layout, "layout"),
        "seq_len": seq_len if has & _HAS_SEQ_LEN else None,
        "ulysses": ulysses, "window": window, "softcap": softcap,
        "segment_ids": id_ranges is not None,
        "segment_lengths": tuple(s for s, _ in pairs[:branches]),
        "dilation_rates": tuple(r for _, r in pairs[:branches]),
        "length": length, "id_ranges": id_ranges,
    }


def _same(field, values):
    if field in ("scale", "softcap"):   # bit for bit: 0.1 == 0.1, never NaN
        values = [v if v is None else struct.pack("<d", v) for v in values]
    return all(v == values[0] for v in values)


def shard_lengths(n, world_size, layout, ulysses=1):
    """Shard lengths of every rank, without building index arrays."""
    return [sum(length for _, _, length in
                _layout.shard_progressions(n, world_size, layout, r,
                                           ulysses))
            for r in range(world_size)]


def agree(comm, desc, timeout=None):
    """Allgather `desc` and check every rank asked for the same thing.

    timeout: the call's deadline in seconds for the allgather (None: the
    communicator's).  Returns a RingPlan.  Raises ValueError (on every
    rank) naming the field and the ranks that disagree, or when the shard
    lengths do not match ``shard_indices(n, p, layout, ulysses)``;
    CommError when a peer's record is malformed.  With ulysses > 1 the
    plan only checks the call (the ring runs over the groups, whose plan
    comes from their own agreement): it carries no segment id ranges.
    """
    p, r = comm.size, comm.rank
    mine = encode(desc)
    records = [mine] if p == 1 else comm.allgather(mine, timeout=timeout)
    descs = []
    for i, record in enumerate(records):
        try:
            descs.append(decode(record))
        except ValueError as why:
            raise _C.CommError(
                f"rank {r}: ring agreement: rank {i} sent a malformed record "
                f"({why}); is every rank running the same ringattn "
                f"version?") from None
    for field in FIELDS:
        values = [d[field] for d in descs]
        if not _same(field, values):
            detail = ", ".join(f"rank {i}: {v!r}" for i, v in enumerate(values))
            raise ValueError(
                f"{field}: expected the same value on every rank, got {detail}")
    layout, seq_len = desc["layout"], desc["seq_len"]
    lengths = [d["length"] for d in descs]
    n = sum(lengths) if seq_len is None else seq_len
    if n > MAX_SEQ_LEN:
        raise ValueError(f"shard lengths: expected at most {MAX_SEQ_LEN} "
                         f"tokens in all, got {lengths}")
    u = desc["ulysses"]
    expected = shard_lengths(n, p, layout, u)
    if lengths != expected:
        groups = f", ulysses={u}" if u > 1 else ""
        raise ValueError(
            f"shard lengths: expected {expected} for seq_len={n}, "
            f"world_size={p}, layout={layout!r}{groups}, got {lengths} "
            f"(rank {r} holds {lengths[r]} tokens)")
    progs = [_layout.shard_progressions(n, p, layout, i, u) for i in range(p)]
    plan = RingPlan(r, p, n, lengths, layout, progs)
    if desc["id_ranges"] is not None and u == 1:
        plan.id_ranges = [_piece_id_ranges(plan, i, d["id_ranges"])
                          for i, d in enumerate(descs)]
    return plan


def _piece_id_ranges(plan, rank, chunk_ranges):
    """(min, max) segment id of each of `rank`'s pieces: the union of the
    ranges of the chunks (``id_chunks``) it covers."""
    chunks = id_chunks(plan.lengths[rank], plan.layout)
    if any(rows and (lo, hi) == EMPTY_RANGE
           for (_, rows), (lo, hi) in zip(chunks, chunk_ranges)):
        raise _C.CommError(
            f"rank {plan.rank}: ring agreement: rank {rank} sent no segment "
            f"id range for a chunk that has tokens")
    out = []
    for off, _, _, length in plan.local_pieces(rank):
        lo, hi = EMPTY_RANGE
        for (c_off, c_len), (c_lo, c_hi) in zip(chunks, chunk_ranges):
            if c_len and c_lo <= c_hi and c_off < off + length and \
                    off < c_off + c_len:
                lo, hi = (c_lo, c_hi) if lo > hi else \
                    (min(lo, c_lo), max(hi, c_hi))
        out.append((lo, hi))
    return out
