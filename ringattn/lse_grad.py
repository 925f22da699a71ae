"""The gradient that flows back through ``lse``, shared by ``ringattn.jax``
and ``ringattn.torch``.

lse_i = log sum_j exp(s_ij), s the scaled (and masked) scores, so
d lse_i / d s_ij = P_ij, the attention weights.  A cotangent g on lse adds
g_i * P_ij to the score gradient, which gives

    dq_i += scale * g_i * sum_j P_ij k_j    = scale * g_i * A(q, k, k)_i
    dk_j += scale * sum_i P_ij g_i q_i      = scale * [P^T (g q)]_j
    dv   += 0

A(q, k, k) is the attention itself with the keys as values, and P^T dout
is the ``dv`` every attention backward returns (GQA groups summed) for
dout = g * q.  Both are ringattn's own kernels -- local, dilated or the ring --
so masks, dilation, layouts and the ring come along unchanged.
"""

__all__ = ["lse_cotangent_grads", "default_scale"]


def default_scale(q, scale):
    """The scale the kernels use: `scale`, or 1/sqrt(D) when None."""
    return float(scale) if scale is not None else q.shape[-1] ** -0.5


def _cast(x, like):
    """`x` in `like`'s dtype (NumPy arrays and torch tensors)."""
    return x.astype(like.dtype) if hasattr(x, "astype") else x.to(like.dtype)


def lse_cotangent_grads(dlse, q, k, v, out, lse, forward, backward, scale):
    """(dq, dk) contributions of the cotangent `dlse` of ``lse``.

    dlse, lse: (B, H, S_q); q, out: (B, S_q, H, D); k, v: (B, S_k, H_kv, D);
    all NumPy arrays or all torch tensors.  forward(q, k, v) -> (out, lse)
    and backward(dout, q, k, v, out, lse) -> (dq, dk, dv) are the attention
    being differentiated; scale is its resolved scale.  Costs one forward
    and one backward of that attention.
    """
    g = dlse.swapaxes(1, 2)[..., None]                # (B, S_q, H, 1)
    keys_as_values = forward(q, k, k)[0]              # sum_j P_ij k_j
    dq = _cast(scale * g * keys_as_values, q)
    dk = backward(_cast(g * q, q), q, k, v, out, lse)[2]   # P^T (g q)
    return dq, _cast(scale * dk, k)
