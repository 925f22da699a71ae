"""PyTorch autograd for ringattn (``import ringattn.torch``; imports torch
lazily).

``torch.autograd.Function`` wrappers: the forward saves (q, k, v, out, lse)
and the backward calls the ringattn backward kernels.  Tensors cross
zero-copy through DLPack, on the CPU or a CUDA device.

With ``return_lse=True`` the lse is differentiable too: its cotangent goes
to the same backward call as ``dlse=`` (``ringattn.lse_cotangent``).
Masks (segment ids, window, softcap) pass through as ``ringattn.attention``
and ``ringattn.ring_attention`` take them; ids get no gradient.  Second
derivatives are not implemented: a double backward raises RuntimeError (as
PyTorch's flash attention does) rather than returning zeros.

Shapes as ``ringattn.attention``: q (B, S_q, H, D); k, v (B, S_k, H_kv, D).
"""

import torch

from .checks import flag
from .attention import attention as _attention_fwd
from .attention import attention_backward as _attention_bwd
from . import dilated as _dilated
from . import ring as _ring
from . import ring_dilated as _ring_dilated

__all__ = ["attention", "dilated_attention", "ring_attention",
           "ring_dilated_attention"]


class _NoSecondDerivative(torch.autograd.Function):
    """Passes first-order gradients through; differentiating them raises.
    `anchor` is a tensor that requires grad, so the outputs join the graph."""

    @staticmethod
    def forward(ctx, anchor, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            "ringattn.torch: the derivative of ringattn's attention backward "
            "(a second derivative, double backward) is not implemented; "
            "differentiate ringattn attention once, or use "
            "torch.nn.functional.scaled_dot_product_attention's math backend "
            "for higher derivatives")


class _Attention(torch.autograd.Function):
    """Generic wrapper: `forward_fn(q, k, v) -> (out, lse)`,
    `backward_fn(dout, q, k, v, out, lse, dlse) -> (dq, dk, dv)`."""

    @staticmethod
    def forward(ctx, q, k, v, forward_fn, backward_fn):
        out, lse = forward_fn(q.detach(), k.detach(), v.detach())
        ctx.forward_fn, ctx.backward_fn = forward_fn, backward_fn
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)      # an unused output's grad: None
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        saved = ctx.saved_tensors
        detach = lambda x: None if x is None else x.detach()
        with torch.no_grad():
            grads = _gradients(ctx, detach(dout), detach(dlse),
                               *(x.detach() for x in saved))
        if not torch.is_grad_enabled():
            return grads + (None, None)
        # create_graph=True: a second derivative through these gradients
        # must raise, not silently be zero
        anchors = [x for x in saved[:3] + (dout, dlse)
                   if x is not None and x.requires_grad]
        return _NoSecondDerivative.apply(anchors[0] if anchors else None,
                                         *grads) + (None, None)


def _gradients(ctx, dout, dlse, q, k, v, out, lse):
    """(dq, dk, dv) from the cotangents of out and lse (None when unused):
    one backward call, dlse folded into its delta."""
    if dout is None and dlse is None:
        return tuple(torch.zeros_like(x) for x in (q, k, v))
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    if dlse is not None:
        dlse = dlse.contiguous()     # e.g. an expanded (stride 0) gradient
    return tuple(ctx.backward_fn(dout, q, k, v, out, lse, dlse))


def _apply(q, k, v, fwd, bwd, return_lse):
    return_lse = flag(return_lse, "return_lse")
    out, lse = _Attention.apply(q, k, v, fwd, bwd)
    return (out, lse) if return_lse else out


def attention(q, k, v, *, causal=False, scale=None, return_lse=False,
              segment_ids=None, kv_segment_ids=None, window=None,
              softcap=None):
    """Differentiable ``ringattn.attention`` for torch tensors (masks as
    there)."""
    kw = dict(causal=causal, scale=scale, segment_ids=segment_ids,
              kv_segment_ids=kv_segment_ids, window=window, softcap=softcap)
    return _apply(
        q, k, v,
        lambda q, k, v: _attention_fwd(q, k, v, return_lse=True, **kw),
        lambda do, q, k, v, o, l, dlse: _attention_bwd(do, q, k, v, o, l,
                                                       dlse=dlse, **kw),
        return_lse)


def dilated_attention(q, k, v, segment_lengths, dilation_rates, *,
                      causal=False, scale=None, return_lse=False):
    """Differentiable ``ringattn.dilated_attention`` for torch tensors."""
    segs, rates = _dilated.check_config(segment_lengths, dilation_rates)
    return _apply(
        q, k, v,
        lambda q, k, v: _dilated.dilated_attention(
            q, k, v, segs, rates, causal=causal, scale=scale, return_lse=True),
        lambda do, q, k, v, o, l, dlse: _dilated.dilated_attention_backward(
            do, q, k, v, o, l, segs, rates, causal=causal, scale=scale,
            dlse=dlse),
        return_lse)


def ring_attention(q, k, v, comm, *, causal=False, scale=None,
                   layout="contiguous", seq_len=None, return_lse=False,
                   segment_ids=None, window=None, softcap=None, ulysses=1):
    """Differentiable ``ringattn.ring_attention`` on this rank's shard
    (segment_ids: this shard's ids; masks as there).  ulysses=u: Ulysses
    inside groups of u ranks, the ring across them (shards from
    ``ra.shard(..., ulysses=u)``); the backward moves dout, q, k, v to the
    heads' layout again (the forward keeps no second copy of them)."""
    kw = dict(causal=causal, scale=scale, layout=layout, seq_len=seq_len,
              segment_ids=segment_ids, window=window, softcap=softcap,
              ulysses=ulysses)
    return _apply(
        q, k, v,
        lambda q, k, v: _ring.ring_attention(q, k, v, comm, return_lse=True,
                                             **kw),
        lambda do, q, k, v, o, l, dlse: _ring.ring_attention_backward(
            do, q, k, v, o, l, comm, dlse=dlse, **kw),
        return_lse)


def ring_dilated_attention(q, k, v, comm, segment_lengths, dilation_rates, *,
                           causal=False, scale=None, layout="contiguous",
                           seq_len=None, return_lse=False):
    """Differentiable ``ringattn.ring_dilated_attention`` on this rank's
    shard."""
    segs, rates = _dilated.check_config(segment_lengths, dilation_rates)
    kw = dict(causal=causal, scale=scale, layout=layout, seq_len=seq_len)
    return _apply(
        q, k, v,
        lambda q, k, v: _ring_dilated.ring_dilated_attention(
            q, k, v, comm, segs, rates, return_lse=True, **kw),
        lambda do, q, k, v, o, l, dlse:
            _ring_dilated.ring_dilated_attention_backward(
                do, q, k, v, o, l, comm, segs, rates, dlse=dlse, **kw),
        return_lse)
