"""Local (single-rank) attention: forward, backward and the LSE merge.

Layout is BSHD: q (B, S_q, H, D); k, v (B, S_k, H_kv, D) with H % H_kv == 0
(query head h reads kv head h // (H // H_kv)).  out (B, S_q, H, D) has q's
dtype; lse (B, H, S_q) is float32 (float64 for float64 inputs), the natural
log of the softmax denominator of the scaled (and soft-capped) scores.
Causal and window positions align bottom-right when S_q != S_k.  Rows that
see no key give out 0, lse -inf.  Inputs may be any array kind; results
come back as the kind of q.
"""

from . import _C
from .checks import flag
from .interop import kind_of, from_buffer, to_buffer
from .lse_cotangent import local_backward
from .masks import mask_kwargs


def attention(q, k, v, *, causal=False, scale=None, return_lse=False,
              segment_ids=None, kv_segment_ids=None, window=None,
              softcap=None):
    """Exact softmax attention.

    q: (B, S_q, H, D); k, v: (B, S_k, H_kv, D); float32, float64, float16 or
    bfloat16 (all three the same).  scale defaults to 1/sqrt(D).
    Masks (a key is visible iff every rule given allows it):
    segment_ids (B, S_q) and kv_segment_ids (B, S_k): integer document ids,
    key j visible to query i iff their ids are equal (kv_segment_ids
    defaults to segment_ids, which then needs S_q == S_k);
    window=(left, right): ints >= 0 or None (unbounded side), key j visible
    iff pos_q - left <= pos_k <= pos_q + right (positions as for causal);
    softcap=c > 0: the scaled score s becomes c * tanh(s / c).
    Returns out (B, S_q, H, D), or (out, lse) with return_lse=True.
    """
    causal, return_lse = flag(causal, "causal"), flag(return_lse, "return_lse")
    kind = kind_of(q)
    out, lse = _C.attn_fwd(to_buffer(q, "q"), to_buffer(k, "k"),
                           to_buffer(v, "v"), causal=causal, scale=scale,
                           **mask_kwargs(segment_ids, kv_segment_ids, window,
                                         softcap))
    out = from_buffer(out, kind)
    if return_lse:
        return out, from_buffer(lse, kind)
    return out


def attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None,
                       deterministic=False, segment_ids=None,
                       kv_segment_ids=None, window=None, softcap=None,
                       dlse=None):
    """Gradients of ``attention``: returns (dq, dk, dv) in the inputs' dtype.

    dout, out: (B, S_q, H, D); lse: (B, H, S_q) as returned by
    ``attention(..., return_lse=True)`` with the same masks, which are
    passed here again.  dlse: None, or the cotangent of lse (B, H, S_q) in
    lse's dtype, whose gradient is added (``ringattn.lse_cotangent``).
    Arithmetic is float32 (float64 for float64 inputs) with delta =
    rowsum(dout * out) (minus dlse) computed first; with a softcap the
    gradient goes through the tanh.
    """
    kind = kind_of(q)
    grads = local_backward(
        _C.attn_bwd, (dout, q, k, v, out, lse), dlse, kind,
        causal=flag(causal, "causal"), scale=scale,
        deterministic=flag(deterministic, "deterministic"),
        **mask_kwargs(segment_ids, kv_segment_ids, window, softcap))
    return tuple(from_buffer(g, kind) for g in grads)


def merge(out1, lse1, out2, lse2):
    """Combine two partial attention results over disjoint key sets.

    lse = logaddexp(lse1, lse2); out = exp(lse1-lse)*out1 + exp(lse2-lse)*out2
    with empty rows (lse -inf) handled, so two empty rows give (0, -inf).
    outs: (B, S, H, D); lses: (B, H, S).  Returns (out, lse).
    """
    kind = kind_of(out1)
    out, lse = _C.merge(to_buffer(out1, "out1"), to_buffer(lse1, "lse1"),
                        to_buffer(out2, "out2"), to_buffer(lse2, "lse2"))
    return from_buffer(out, kind), from_buffer(lse, kind)
