"""PyTorch autograd for ringattn (``import ringattn.torch``; imports torch
lazily).

``torch.autograd.Function`` wrappers: the forward saves (q, k, v, out, lse)
and the backward calls the ringattn backward kernels.  Tensors cross
zero-copy through DLPack, on the CPU or a CUDA device.

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


class _Attention(torch.autograd.Function):
    """Generic wrapper: `forward_fn(q, k, v) -> (out, lse)`,
    `backward_fn(dout, q, k, v, out, lse) -> (dq, dk, dv)`."""

    @staticmethod
    def forward(ctx, q, k, v, forward_fn, backward_fn):
        out, lse = forward_fn(q.detach(), k.detach(), v.detach())
        ctx.backward_fn = backward_fn
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backward_fn(dout.contiguous(), q.detach(), k.detach(),
                                     v.detach(), out, lse)
        return dq, dk, dv, None, None


def _apply(q, k, v, fwd, bwd, return_lse):
    return_lse = flag(return_lse, "return_lse")
    out, lse = _Attention.apply(q, k, v, fwd, bwd)
    return (out, lse) if return_lse else out


def attention(q, k, v, *, causal=False, scale=None, return_lse=False):
    """Differentiable ``ringattn.attention`` for torch tensors."""
    return _apply(
        q, k, v,
        lambda q, k, v: _attention_fwd(q, k, v, causal=causal,
                                             scale=scale, return_lse=True),
        lambda do, q, k, v, o, l: _attention_bwd(
            do, q, k, v, o, l, causal=causal, scale=scale),
        return_lse)


def dilated_attention(q, k, v, segment_lengths, dilation_rates, *,
                      causal=False, scale=None, return_lse=False):
    """Differentiable ``ringattn.dilated_attention`` for torch tensors."""
    segs, rates = _dilated.check_config(segment_lengths, dilation_rates)
    return _apply(
        q, k, v,
        lambda q, k, v: _dilated.dilated_attention(
            q, k, v, segs, rates, causal=causal, scale=scale, return_lse=True),
        lambda do, q, k, v, o, l: _dilated.dilated_attention_backward(
            do, q, k, v, o, l, segs, rates, causal=causal, scale=scale),
        return_lse)


def ring_attention(q, k, v, comm, *, causal=False, scale=None,
                   layout="contiguous", seq_len=None, return_lse=False):
    """Differentiable ``ringattn.ring_attention`` on this rank's shard."""
    kw = dict(causal=causal, scale=scale, layout=layout, seq_len=seq_len)
    return _apply(
        q, k, v,
        lambda q, k, v: _ring.ring_attention(q, k, v, comm, return_lse=True,
                                             **kw),
        lambda do, q, k, v, o, l: _ring.ring_attention_backward(
            do, q, k, v, o, l, comm, **kw),
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
        lambda do, q, k, v, o, l: _ring_dilated.ring_dilated_attention_backward(
            do, q, k, v, o, l, comm, segs, rates, **kw),
        return_lse)
