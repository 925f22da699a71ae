"""LongNet dilated attention on one rank (DESIGN §2, "Dilated attention").

Branch i (segment length w_i, dilation rate r_i) cuts positions into
segments [s*w_i, (s+1)*w_i) from position 0 (the last may be short); for
query head h the offset is o = h mod r_i, and a position p of segment s is
selected iff (p - s*w_i) mod r_i == o.  A selected query attends to the
selected keys of its segment (and, if causal, only to keys at or before it).
Branch results merge by the LSE rule: equivalently dense attention with the
additive bias log c_h(i, j), c counting the branches that select both i and
j.  The CPU kernels select every r-th row of a segment through strided views;
no dense mask is ever built.
"""

import operator

from . import _C
from .checks import flag
from .interop import kind_of, from_buffer, to_buffer
from .lse_cotangent import local_backward


INT64_MAX = 2**63 - 1


def check_config(segment_lengths, dilation_rates):
    """Validate and normalise a configuration: two equal-length lists of
    1 to _C.MAX_BRANCHES positive ints that fit in int64 (as the C core
    takes them; a length or rate past any sequence is fine).  Raises
    ValueError naming the argument otherwise, before any work (or trace)."""
    out = []
    for name, values in (("segment_lengths", segment_lengths),
                         ("dilation_rates", dilation_rates)):
        try:
            items = list(values)
        except TypeError:
            raise ValueError(f"{name}: expected a sequence of positive ints, "
                             f"got {type(values).__name__}") from None
        ints = []
        for i, x in enumerate(items):
            if isinstance(x, bool) or isinstance(x, float):
                raise ValueError(f"{name}: expected positive ints, got {x!r} "
                                 f"at position {i}")
            try:
                x = operator.index(x)
            except TypeError:
                raise ValueError(f"{name}: expected positive ints, got "
                                 f"{type(x).__name__} at position {i}") from None
            if not 1 <= x <= INT64_MAX:
                raise ValueError(f"{name}: expected positive ints up to 2**63 - 1, "
                                 f"got {x} at position {i}")
            ints.append(x)
        out.append(ints)
    segs, rates = out
    if len(segs) != len(rates):
        raise ValueError(f"dilation_rates: expected {len(segs)} values (one per "
                         f"segment length), got {len(rates)}")
    if not 1 <= len(segs) <= _C.MAX_BRANCHES:
        raise ValueError(f"segment_lengths: expected 1 to {_C.MAX_BRANCHES} "
                         f"branches, got {len(segs)}")
    return segs, rates


def dilated_attention(q, k, v, segment_lengths, dilation_rates, *, causal=False,
                      scale=None, return_lse=False):
    """LongNet dilated attention.

    q: (B, n, H, D); k, v: (B, n, H_kv, D); segment_lengths, dilation_rates:
    equal-length lists of positive ints (one entry per branch).  Returns out
    (B, n, H, D) in q's dtype, and lse (B, H, n) with return_lse=True (rows
    that no branch selects: out 0, lse -inf).
    """
    segs, rates = check_config(segment_lengths, dilation_rates)
    causal, return_lse = flag(causal, "causal"), flag(return_lse, "return_lse")
    kind = kind_of(q)
    out, lse = _C.dilated_fwd(to_buffer(q, "q"), to_buffer(k, "k"),
                              to_buffer(v, "v"), segs, rates, causal=causal,
                              scale=scale)
    out = from_buffer(out, kind)
    if return_lse:
        return out, from_buffer(lse, kind)
    return out


def dilated_attention_backward(dout, q, k, v, out, lse, segment_lengths,
                               dilation_rates, *, causal=False, scale=None,
                               dlse=None):
    """Gradients of ``dilated_attention``: (dq, dk, dv) in the inputs' dtype.

    dlse: None, or the cotangent of the (merged) lse (B, H, n) in lse's
    dtype, whose gradient is added (``ringattn.lse_cotangent``)."""
    segs, rates = check_config(segment_lengths, dilation_rates)
    kind = kind_of(q)
    grads = local_backward(_C.dilated_bwd, (dout, q, k, v, out, lse), dlse,
                           kind, segment_lengths=segs, dilation_rates=rates,
                           causal=flag(causal, "causal"), scale=scale)
    return tuple(from_buffer(g, kind) for g in grads)


class DilatedAttention:
    """A dilated attention configuration, callable like the LongNet modules.

        attn = ra.DilatedAttention([2048, 4096], [1, 2], causal=True)
        out = attn(q, k, v)                          # one rank
        out = attn.ring(q_shard, k_shard, v_shard, comm)   # over the ring
    """

    def __init__(self, segment_lengths, dilation_rates, causal=False,
                 scale=None):
        self.segment_lengths, self.dilation_rates = check_config(
            segment_lengths, dilation_rates)
        self.causal = flag(causal, "causal")
        self.scale = scale

    def __repr__(self):
        return (f"DilatedAttention(segment_lengths={self.segment_lengths}, "
                f"dilation_rates={self.dilation_rates}, causal={self.causal})")

    def __call__(self, q, k, v, return_lse=False):
        """``dilated_attention`` with this configuration."""
        return dilated_attention(q, k, v, self.segment_lengths,
                                 self.dilation_rates, causal=self.causal,
                                 scale=self.scale, return_lse=return_lse)

    def backward(self, dout, q, k, v, out, lse, dlse=None):
        """``dilated_attention_backward`` with this configuration."""
        return dilated_attention_backward(
            dout, q, k, v, out, lse, self.segment_lengths, self.dilation_rates,
            causal=self.causal, scale=self.scale, dlse=dlse)

    def ring(self, q, k, v, comm, **kwargs):
        from .ring_dilated import ring_dilated_attention

        return ring_dilated_attention(q, k, v, comm, self.segment_lengths,
                                      self.dilation_rates, causal=self.causal,
                                      scale=self.scale, **kwargs)

    def ring_backward(self, dout, q, k, v, out, lse, comm, **kwargs):
        from .ring_dilated import ring_dilated_attention_backward

        return ring_dilated_attention_backward(
            dout, q, k, v, out, lse, comm, self.segment_lengths,
            self.dilation_rates, causal=self.causal, scale=self.scale, **kwargs)
