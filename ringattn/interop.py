"""Array exchange: any array kind in, the caller's kind out, zero-copy.

Inputs are anything NumPy, JAX, CuPy, PyTorch or a ringattn ``Buffer``; they
become ``Buffer`` views through DLPack (NumPy directly, which also covers
ml_dtypes bfloat16).  Results are ``Buffer`` objects turned back into the
kind of the first input: NumPy in gives NumPy out, JAX gives JAX, ...
"""

import operator
import warnings

from . import _C
from .checks import C_INT_MAX

Buffer = _C.Buffer


def kind_of(x):
    """'numpy' | 'jax' | 'torch' | 'cupy' | 'buffer' | 'other'."""
    if isinstance(x, Buffer):
        return "buffer"
    mod = type(x).__module__ or ""
    root = mod.split(".", 1)[0]
    if root == "numpy":
        return "numpy"
    if root in ("jax", "jaxlib"):
        return "jax"
    if root == "torch":
        return "torch"
    if root == "cupy":
        return "cupy"
    return "other"


_warned_about_grad = False


def _detach_with_warning(x):
    """`x` detached; the first time, a warning that gradients stop here."""
    global _warned_about_grad
    if not _warned_about_grad:
        _warned_about_grad = True
        warnings.warn(
            "ringattn got a torch tensor that requires grad: the result has "
            "no grad_fn and no gradient flows back through it; use "
            "ringattn.torch (e.g. ringattn.torch.attention) for autograd. "
            "This warning is shown once.", UserWarning, stacklevel=4)
    return x.detach()


def _is_jax_tracer(x):
    try:
        import jax
    except ImportError:
        return False
    return isinstance(x, jax.core.Tracer)


def to_buffer(x, name="x"):
    """A ``Buffer`` viewing `x`'s memory (no copy).

    Raises TypeError for non-arrays and for JAX tracers (abstract values
    inside ``jax.jit`` / ``grad`` / ``vmap``: ``ringattn.jax`` is the way
    there), BufferError when the producer cannot export.  PyTorch tensors
    that require grad are detached, with a one-time warning pointing to
    ``ringattn.torch``, whose autograd wrappers handle gradients.
    """
    kind = kind_of(x)
    if kind == "torch" and getattr(x, "requires_grad", False):
        x = _detach_with_warning(x)
    elif kind == "jax" and _is_jax_tracer(x):
        raise TypeError(
            f"{name}: got a JAX tracer ({type(x).__name__}), an abstract "
            f"value inside jax.jit, grad or vmap that has no data to read; "
            f"use ringattn.jax (e.g. ringattn.jax.attention), which works "
            f"under jit and grad")
    return _C.from_dlpack(x, name)


def from_buffer(buf, kind):
    """Turn a ``Buffer`` into an array of `kind`, sharing memory."""
    if kind == "numpy":
        return buf.numpy()
    if kind == "jax":
        import jax.numpy as jnp

        return jnp.from_dlpack(buf)
    if kind == "torch":
        import torch

        return torch.from_dlpack(buf)
    if kind == "cupy":
        import cupy

        return cupy.from_dlpack(buf)
    return buf


def like(buf, x):
    """`buf` as the kind of array `x` is."""
    return from_buffer(buf, kind_of(x))


def from_dlpack(x):
    """Any DLPack producer or NumPy array -> ``ringattn.Buffer`` (zero-copy)."""
    return _C.from_dlpack(x, "x")


def to_numpy(x):
    """A NumPy view (host arrays) of any array kind; copies device arrays
    (ringattn Buffers on a CUDA device through ``to_device``)."""
    import numpy as np

    kind = kind_of(x)
    if kind == "numpy":
        return x
    if kind == "cupy":
        return x.get()
    if kind == "torch":
        return x.detach().cpu().numpy()
    if kind == "jax":
        return np.asarray(x)
    buf = to_buffer(x)
    if buf.device[0] not in ("cpu", "cuda_host"):      # host memory as it is
        buf = to_device(buf, "cpu")
    return buf.numpy()


_DEVICE_CODES = {"cpu": 1, "cuda": 2}


def parse_device(device):
    """'cpu' | 'cuda' | 'cuda:N' | ('cuda', N) -> (dlpack_type, index);
    ('cpu', N) and 'cpu:N' are the host (index 0)."""
    expected = "device: expected 'cpu', 'cuda', 'cuda:N' or ('cuda', N)"
    if isinstance(device, tuple) and len(device) == 2:
        kind, index = device
    elif isinstance(device, str):
        kind, colon, idx = device.partition(":")
        if colon and not (idx.isascii() and idx.isdigit()):
            raise ValueError(f"{expected}, got {device!r}")
        index = int(idx) if colon else 0
    else:
        raise ValueError(f"{expected}, got {device!r}")
    if kind not in _DEVICE_CODES or isinstance(index, bool):
        raise ValueError(f"{expected}, got {device!r}")
    try:
        index = operator.index(index)
    except (TypeError, ValueError):
        raise ValueError(f"{expected}, got {device!r}") from None
    if index < 0:
        raise ValueError(f"{expected}, got {device!r}")
    if kind == "cuda" and index > C_INT_MAX:     # no such device
        raise ValueError(f"device: expected the index of a CUDA device that "
                         f"exists, got {device!r}")
    # host memory is one memory, whatever a framework numbers its host
    # devices (JAX: cpu:0, cpu:1, ...)
    return _DEVICE_CODES[kind], 0 if kind == "cpu" else index


def to_device(x, device="cuda", dtype=None):
    """A copy of any array on `device` ('cpu', 'cuda', 'cuda:N'), as a
    contiguous ``Buffer`` owned by ringattn; `dtype` converts float types
    on the way (default: x's dtype).

    Host <-> GPU without a framework: ``ra.to_device(np_array, "cuda")``
    uploads, ``ra.to_device(buf, "cpu").numpy()`` downloads; either is
    finished on return.  A CUDA source is read after the work its producer
    queued (DLPack stream handshake).
    """
    src = to_buffer(x, "x")
    t, i = parse_device(device)
    out = _C.empty(tuple(src.shape), src.dtype if dtype is None else dtype,
                   t, i)
    out.copy_(src)
    return out


def empty(shape, dtype="float32", device="cpu"):
    """Uninitialised ``Buffer`` owned by ringattn (counted in memory_stats).
    shape: an int or a sequence of ints; dtype: a name or anything
    ``np.dtype()`` takes ("float" is float64, as in NumPy)."""
    t, i = parse_device(device)
    return _C.empty(shape, dtype, t, i)


def zeros(shape, dtype="float32", device="cpu"):
    """Zero-filled ``Buffer`` owned by ringattn (counted in memory_stats);
    shape and dtype as ``empty``."""
    t, i = parse_device(device)
    return _C.zeros(shape, dtype, t, i)
