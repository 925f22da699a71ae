"""The cotangent of lse in the backward entry points (their ``dlse=``).

lse_i = log sum_j exp(s_ij), s the scaled, soft-capped and masked scores,
so d lse_i / d s_ij = P_ij, the attention weights, and a cotangent g of lse
adds g_i * P_ij to the gradient of the scores.  The backward kernels form
dS = P * (dP - delta) with delta = rowsum(dout * out); handing them
delta - g instead adds exactly that term, through the softcap's tanh, the
masks and every ring block alike, for the cost of one subtraction.

Dilated attention: a query's lse is the merged lse of its branches,
lse = log sum_b exp(lse_b), which is the log-normaliser of dense attention
with the score bias log c(i, j) (c counts the branches selecting both i and
j).  By the chain rule g reaches branch b's scores as
g * exp(lse_b - lse) * exp(s_ij - lse_b) = g * exp(s_ij - lse), and summed
over the branches that select (i, j), g * c(i, j) * exp(s_ij - lse) =
g * P_ij of the biased attention.  The dilated kernels already compute
every branch with the merged lse and the merged delta, so delta - g is
right for them too.
"""

from . import _C
from .interop import from_buffer, to_buffer

__all__ = ["check_dlse", "fold_into_delta", "local_backward"]


def check_dlse(dlse, q):
    """`dlse` as a Buffer (None stays None), after checking it against the
    q Buffer (B, S_q, H, D): shape (B, H, S_q), lse's dtype (float32, or
    float64 for float64 inputs) and q's device."""
    if dlse is None:
        return None
    buf = to_buffer(dlse, "dlse")
    B, S_q, H, _ = q.shape
    if tuple(buf.shape) != (B, H, S_q):
        raise ValueError(f"dlse: expected shape (B, H, S_q) = {(B, H, S_q)} "
                         f"(lse's, from q), got {tuple(buf.shape)}")
    acc = "float64" if q.dtype == "float64" else "float32"
    if buf.dtype != acc:
        raise TypeError(f"dlse: expected dtype {acc} (lse's, for {q.dtype} "
                        f"inputs), got {buf.dtype}")
    if buf.device != q.device:
        raise ValueError(f"dlse: expected the device of q "
                         f"{_device_name(q.device)}, got "
                         f"{_device_name(buf.device)} (mixed devices)")
    return buf


def _device_name(device):
    kind, index = device
    return f"{kind}:{index}"


def _framework_for(buf, kind):
    """The array kind that computes on `buf`'s device: NumPy on the CPU,
    else the caller's framework (`kind`), else torch or CuPy, whichever
    imports."""
    if buf.device[0] == "cpu":
        return "numpy"
    if kind in ("torch", "cupy", "jax"):
        return kind
    for kind in ("torch", "cupy"):
        try:
            __import__(kind)
        except ImportError:
            continue
        return kind
    raise TypeError(f"dlse: a {buf.device[0]} array needs torch or CuPy to "
                    f"subtract it from delta; pass dlse as a torch, CuPy or "
                    f"JAX array")


def fold_into_delta(delta, dlse, kind):
    """delta - dlse as a Buffer: `delta` (B, H, S_q), fresh from
    ``_C.attn_bwd_preprocess`` and ours to overwrite; `dlse` a Buffer from
    ``check_dlse`` or None (then delta comes back unchanged); `kind` the
    caller's array kind (``interop.kind_of``), used off the CPU."""
    if dlse is None:
        return delta
    kind = _framework_for(delta, kind)
    if kind == "numpy":
        d = delta.numpy()
        d -= dlse.numpy()
        return delta
    result = from_buffer(delta, kind) - from_buffer(dlse, kind)
    return to_buffer(result, "delta")


_NAMES = ("dout", "q", "k", "v", "out", "lse")


def local_backward(kernel, arrays, dlse, kind, **kw):
    """The (dq, dk, dv) Buffers of one local backward: `kernel`
    (``_C.attn_bwd`` or ``_C.dilated_bwd``) on arrays = (dout, q, k, v,
    out, lse) with its keywords `kw`.  With dlse every argument is checked
    first, then the kernel gets delta - dlse."""
    bufs = [to_buffer(x, name) for name, x in zip(_NAMES, arrays)]
    if dlse is None:
        return kernel(*bufs, **kw)
    dout, q, k, v, out, lse = bufs
    kernel(*bufs, check_only=True, **kw)
    dlse = check_dlse(dlse, q)
    delta = fold_into_delta(_C.attn_bwd_preprocess(dout, out), dlse, kind)
    return kernel(dout, q, k, v, None, lse, delta=delta, **kw)
