"""What the ranks of a ring agree on before the first step, and its wire format.

Every rank describes its call in one fixed-size record: the operation,
sizes, dtype, device, causal flag, scale, layout, seq_len, the dilated
branches and its own shard length.  One allgather (under the call's
timeout) brings every rank's record, and every rank checks the same list,
so all of them raise together when anything differs.

Nothing received is unpickled or evaluated.  A record is little-endian
integers of fixed widths, parsed with ``struct``; names (operation, dtype,
device, layout) travel as small enum codes and the scale as the bits of its
float64, compared bit for bit.  A record of another size, magic or version,
or with an unknown code, is refused with ``CommError`` naming the rank that
sent it.

Record (little-endian, ``RECORD_SIZE`` bytes)::

    magic "RAP1" | version u16 | op u8 | dtype u8 | device u8 | causal u8 |
    layout u8 | has u8 (bit 0: scale given, bit 1: seq_len given) |
    branches u8 | batch, heads, heads_kv, head_dim, length, seq_len i64 |
    scale bits u64 | MAX_BRANCHES x (segment length, dilation rate) i64
    (unused pairs zero)
"""

import struct

from . import _C, layout as _layout

__all__ = ["RingPlan", "describe", "agree", "encode", "decode",
           "RECORD_SIZE"]

MAGIC = b"RAP1"
VERSION = 1
MAX_BRANCHES = _C.MAX_BRANCHES

OPS = ("fwd", "bwd", "dilated_fwd", "dilated_bwd")
DTYPES = ("float32", "float64", "float16", "bfloat16")
DEVICES = ("cpu", "cuda")
LAYOUTS = _layout.LAYOUTS

_HEAD = struct.Struct("<4sHBBBBBBB6qQ")
_BRANCH = struct.Struct("<qq")
RECORD_SIZE = _HEAD.size + MAX_BRANCHES * _BRANCH.size

_HAS_SCALE, _HAS_SEQ_LEN = 1, 2

# longest sequence a ring takes (a bound far above any memory, so that a
# peer's record can never make a rank compute with unbounded numbers)
MAX_SEQ_LEN = 2**62

# fields compared across ranks, in the order they are reported
FIELDS = ("op", "batch", "heads", "heads_kv", "head_dim", "dtype", "device",
          "causal", "scale", "layout", "seq_len", "segment_lengths",
          "dilation_rates")


class RingPlan:
    """What every rank agreed on before the first ring step.

    Built by ``agree`` from one allgather: sizes, dtype, flags and every
    rank's shard length; any mismatch raises ValueError on every rank (all
    ranks compare the same gathered list, so none is left waiting).
    """

    def __init__(self, rank, world_size, n, lengths, layout, progressions):
        self.rank = rank
        self.world_size = world_size
        self.n = n
        self.lengths = lengths
        self.layout = layout
        self.progressions = progressions  # per rank: [(start, stride, len)]

    def local_pieces(self, rank):
        """[(local_offset, start, stride, length)] of `rank`'s shard."""
        pieces, off = [], 0
        for start, stride, length in self.progressions[rank]:
            pieces.append((off, start, stride, length))
            off += length
        return pieces


def describe(op, q, k, causal, scale, layout, seq_len, segment_lengths=(),
             dilation_rates=()):
    """This rank's description of a call (arguments already checked:
    q, k Buffers, scale None or a finite real, seq_len None or an int)."""
    B, n_r, H, D = q.shape
    return {
        "op": op, "batch": B, "heads": H, "heads_kv": k.shape[2],
        "head_dim": D, "dtype": q.dtype, "device": q.device[0],
        "causal": bool(causal),
        "scale": None if scale is None else float(scale),
        "layout": layout, "seq_len": seq_len,
        "segment_lengths": tuple(segment_lengths),
        "dilation_rates": tuple(dilation_rates), "length": n_r,
    }


def encode(desc):
    """The record of a description (bytes of RECORD_SIZE)."""
    segs, rates = desc["segment_lengths"], desc["dilation_rates"]
    has = ((_HAS_SCALE if desc["scale"] is not None else 0) |
           (_HAS_SEQ_LEN if desc["seq_len"] is not None else 0))
    scale_bits = 0 if desc["scale"] is None else \
        struct.unpack("<Q", struct.pack("<d", desc["scale"]))[0]
    head = _HEAD.pack(
        MAGIC, VERSION, OPS.index(desc["op"]), DTYPES.index(desc["dtype"]),
        DEVICES.index(desc["device"]), int(desc["causal"]),
        LAYOUTS.index(desc["layout"]), has, len(segs), desc["batch"],
        desc["heads"], desc["heads_kv"], desc["head_dim"], desc["length"],
        0 if desc["seq_len"] is None else desc["seq_len"], scale_bits)
    pairs = list(zip(segs, rates)) + [(0, 0)] * (MAX_BRANCHES - len(segs))
    return head + b"".join(_BRANCH.pack(s, r) for s, r in pairs)


def _code(table, index, field):
    if index >= len(table):
        raise ValueError(f"unknown {field} code {index}")
    return table[index]


def decode(record):
    """The description in a record; ValueError saying what is malformed."""
    if len(record) != RECORD_SIZE:
        raise ValueError(f"{len(record)} bytes where a record has "
                         f"{RECORD_SIZE}")
    (magic, version, op, dtype, device, causal, layout, has, branches, batch,
     heads, heads_kv, head_dim, length, seq_len, scale_bits) = \
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
    pairs = [_BRANCH.unpack_from(record, _HEAD.size + i * _BRANCH.size)
             for i in range(MAX_BRANCHES)]
    used, unused = pairs[:branches], pairs[branches:]
    if any(s < 1 or r < 1 for s, r in used) or any(s or r for s, r in unused):
        raise ValueError("bad dilated branches")
    scale = None
    if has & _HAS_SCALE:
        scale = struct.unpack("<d", struct.pack("<Q", scale_bits))[0]
    return {
        "op": _code(OPS, op, "operation"), "batch": batch, "heads": heads,
        "heads_kv": heads_kv, "head_dim": head_dim,
        "dtype": _code(DTYPES, dtype, "dtype"),
        "device": _code(DEVICES, device, "device"), "causal": bool(causal),
        "scale": scale,
        "layout": _code(LAYOUTS, layout, "layout"),
        "seq_len": seq_len if has & _HAS_SEQ_LEN else None,
        "segment_lengths": tuple(s for s, _ in pairs[:branches]),
        "dilation_rates": tuple(r for _, r in pairs[:branches]),
        "length": length,
    }


def _same(field, values):
    if field == "scale":             # bit for bit: 0.1 == 0.1, never NaN
        values = [v if v is None else struct.pack("<d", v) for v in values]
    return all(v == values[0] for v in values)


def shard_lengths(n, world_size, layout):
    """Shard lengths of every rank, without building index arrays."""
    return [sum(length for _, _, length in
                _layout.shard_progressions(n, world_size, layout, r))
            for r in range(world_size)]


def agree(comm, desc, timeout=None):
    """Allgather `desc` and check every rank asked for the same thing.

    timeout: the call's deadline in seconds for the allgather (None: the
    communicator's).  Returns a RingPlan.  Raises ValueError (on every
    rank) naming the field and the ranks that disagree, or when the shard
    lengths do not match ``shard_indices(n, p, layout)``; CommError when a
    peer's record is malformed.
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
    expected = shard_lengths(n, p, layout)
    if lengths != expected:
        raise ValueError(
            f"shard lengths: expected {expected} for seq_len={n}, "
            f"world_size={p}, layout={layout!r}, got {lengths} "
            f"(rank {r} holds {lengths[r]} tokens)")
    progs = [_layout.shard_progressions(n, p, layout, i) for i in range(p)]
    return RingPlan(r, p, n, lengths, layout, progs)
