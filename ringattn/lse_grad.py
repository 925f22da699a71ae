"""The gradient that flows back through ``lse``, shared by ``ringattn.jax``
and ``ringattn.torch``.

lse_i = log sum_j exp(s_ij), s the scaled, soft-capped and masked scores,
so d lse_i / d s_ij = P_ij, the attention weights, and a cotangent g on lse
adds g_i * P_ij to the gradient of the scores -- exactly what the attention
backward adds for a dout whose rows satisfy dout_i . v_j - delta_i = g_i
for every key j.  Such a problem is at hand: values v' all ones, dout'_i =
(g_i, 0, ..., 0) and out' = 0 (so delta = rowsum(dout' * out') = 0).  One
call of the attention's own backward on (dout', q, k, v', out', lse) then
returns the (dq, dk) of the cotangent -- through the softcap's tanh, the
masks, dilation, layouts and the ring alike -- and a dv to drop.
"""

__all__ = ["lse_cotangent_grads"]


def _zeros_like(x):
    """Zeros of x's shape and dtype (a NumPy array or a torch tensor)."""
    if hasattr(x, "new_zeros"):
        return x.new_zeros(x.shape)
    import numpy as np

    return np.zeros(x.shape, x.dtype)


def lse_cotangent_grads(dlse, q, k, v, out, lse, backward):
    """(dq, dk) contributions of the cotangent `dlse` of ``lse``.

    dlse, lse: (B, H, S_q); q, out: (B, S_q, H, D); k, v: (B, S_k, H_kv, D);
    all NumPy arrays or all torch tensors.  backward(dout, q, k, v, out,
    lse) -> (dq, dk, dv) is the backward of the attention being
    differentiated.  Costs one call of it.
    """
    dout = _zeros_like(q)
    dout[..., 0] = dlse.swapaxes(1, 2)                 # (B, S_q, H)
    ones = _zeros_like(v) + 1
    dq, dk, _ = backward(dout, q, k, ones, _zeros_like(out), lse)
    return dq, dk
