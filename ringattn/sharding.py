"""Kind-preserving ``shard`` / ``unshard`` over ``layout``'s index maths.

``ringattn.layout`` works on NumPy arrays; these wrappers accept any array
kind (NumPy, JAX, CuPy, PyTorch, Buffer) and return the same kind, using
the array library's own take/concatenate so device arrays stay on device.
"""

import numpy as np

from . import layout
from .interop import kind_of, to_buffer


def _take(x, idx, axis):
    kind = kind_of(x)
    if kind == "torch":
        import torch

        return x.index_select(axis, torch.as_tensor(idx, device=x.device))
    if kind == "cupy":
        import cupy

        return cupy.take(x, cupy.asarray(idx), axis=axis)
    if kind == "jax":
        import jax.numpy as jnp

        return jnp.take(x, jnp.asarray(idx), axis=axis)
    raise TypeError(kind)


def _concat(parts, axis, kind):
    if kind == "torch":
        import torch

        return torch.cat(parts, dim=axis)
    if kind == "cupy":
        import cupy

        return cupy.concatenate(parts, axis=axis)
    import jax.numpy as jnp

    return jnp.concatenate(parts, axis=axis)


def shard(x, rank, world_size, layout_name, axis=1, ulysses=1):
    """The rows of `x` along `axis` held by `rank` (DESIGN §4 layouts).

    layout_name: 'contiguous' | 'zigzag' | 'striped'; ulysses=u: the shards
    of ``ring_attention(..., ulysses=u)`` (u = 1: the plain ring).  Returns
    a new array of x's kind whose `axis` has
    len(shard_indices(n, world_size, layout, ulysses)[rank]).
    """
    kind = kind_of(x)
    if kind in ("numpy", "buffer", "other"):
        arr = x if kind == "numpy" else to_buffer(x, "x").numpy()
        return layout.shard(arr, rank, world_size, layout_name, axis,
                            ulysses)
    n = x.shape[axis if axis >= 0 else axis + x.ndim]
    idx = layout.shard_positions(n, world_size, layout_name, rank, ulysses)
    return _take(x, idx, axis)


def unshard(shards, layout_name, axis=1, ulysses=1):
    """Reassemble the full array from every rank's shard (inverse of shard,
    with the same ulysses)."""
    shards = list(shards)
    if not shards:
        raise ValueError("shards: expected one shard per rank, got none")
    kind = kind_of(shards[0])
    if kind in ("numpy", "buffer", "other"):
        arrs = [s if kind_of(s) == "numpy" else to_buffer(s, "shards").numpy()
                for s in shards]
        return layout.unshard(arrs, layout_name, axis, ulysses)
    p = len(shards)
    ax = axis if axis >= 0 else axis + shards[0].ndim
    n = sum(int(s.shape[ax]) for s in shards)
    idx = np.concatenate(layout.shard_indices(n, p, layout_name, ulysses))
    inverse = np.empty_like(idx)
    inverse[idx] = np.arange(n, dtype=idx.dtype)
    full = _concat(shards, ax, kind)
    return _take(full, inverse, ax)
