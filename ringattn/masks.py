"""Masks (DESIGN §2 "Masks"): document ids from cumulative lengths, and the
mask keywords as the C kernels take them.

A key is visible to a query iff every rule given allows it:

* documents: ``segment_ids[b, i] == kv_segment_ids[b, j]`` (integer ids,
  (B, S_q) and (B, S_k); ``kv_segment_ids`` defaults to ``segment_ids``);
* window ``(left, right)``: ``pos_q - left <= pos_k <= pos_q + right``
  (``None`` on a side: unbounded), positions as for causal;
* and ``softcap=c`` turns each scaled score s into ``c * tanh(s / c)``.

The checks of these arguments live in the C core (``_C.attn_fwd`` and
``_C.attn_bwd``, ``check_only=True`` for checks alone), one place for the
local and the ring entry points.
"""

import operator

import numpy as np

from .checks import int_or_none
from .interop import kind_of, to_buffer, to_numpy

__all__ = ["segment_ids", "mask_kwargs"]


def _seq_len(value):
    if value is None:
        raise TypeError("seq_len: expected an int >= 0, got None")
    return int_or_none(value, "seq_len", 0)


def _cumulative_lengths(cu_seqlens):
    """cu_seqlens as a 1-d int64 NumPy array, checked."""
    if isinstance(cu_seqlens, (list, tuple)):
        if any(isinstance(x, (bool, np.bool_)) or not _is_int(x)
               for x in cu_seqlens):
            raise TypeError(f"cu_seqlens: expected integers, got "
                            f"{_short(cu_seqlens)}")
        cu = np.asarray(cu_seqlens, dtype=np.int64) if cu_seqlens else \
            np.zeros(0, np.int64)
    else:
        try:
            cu = np.asarray(to_numpy(cu_seqlens))
        except (TypeError, BufferError, AttributeError):
            raise TypeError(f"cu_seqlens: expected a 1-d sequence or array of "
                            f"integers, got {type(cu_seqlens).__name__}") \
                from None
        if cu.dtype == np.bool_ or not np.issubdtype(cu.dtype, np.integer):
            raise TypeError(f"cu_seqlens: expected integers, got dtype "
                            f"{cu.dtype}")
        if cu.dtype == np.uint64 and cu.size and cu.max() > np.iinfo(np.int64).max:
            raise ValueError(f"cu_seqlens: expected lengths that fit in int64, "
                             f"got {int(cu.max())}")
        cu = cu.astype(np.int64)
    if cu.ndim != 1:
        raise ValueError(f"cu_seqlens: expected 1 dimension [0, l_0, l_0 + "
                         f"l_1, ...], got shape {cu.shape}")
    if cu.size == 0 or cu[0] != 0:
        raise ValueError(f"cu_seqlens: expected a first entry 0, got "
                         f"{_short(cu.tolist())}")
    steps = np.diff(cu)
    if (steps < 0).any():
        at = int(np.argmax(steps < 0)) + 1
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets, got "
                         f"{int(cu[at])} after {int(cu[at - 1])} at position "
                         f"{at}")
    if cu.size - 1 > np.iinfo(np.int32).max:
        raise ValueError(f"cu_seqlens: expected at most {2**31 - 1} documents, "
                         f"got {cu.size - 1}")
    return cu


def _is_int(x):
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def _short(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def segment_ids(cu_seqlens, seq_len):
    """(1, seq_len) int32 document ids from flash-attn style cumulative lengths.

    cu_seqlens: ``[0, l_0, l_0 + l_1, ...]`` (1-d integers, starting at 0,
    non-decreasing, last entry <= seq_len): token t belongs to document i
    where ``cu_seqlens[i] <= t < cu_seqlens[i + 1]``, and gets id i.  Tokens
    past the last offset (padding) get id ``len(cu_seqlens) - 1``, a
    document of their own.  Empty documents take an id no token carries.

    Returns the kind of array cu_seqlens is (NumPy for lists and NumPy; a
    PyTorch tensor on cu_seqlens' device for a tensor; JAX, CuPy alike),
    ready for ``segment_ids=`` of ``attention`` (for B > 1, stack rows).
    """
    n = _seq_len(seq_len)
    cu = _cumulative_lengths(cu_seqlens)
    if cu[-1] > n:
        raise ValueError(f"cu_seqlens: expected a last offset <= seq_len = "
                         f"{n}, got {int(cu[-1])}")
    ids = (np.searchsorted(cu, np.arange(n), side="right") - 1)
    return _like(ids.astype(np.int32)[None], cu_seqlens)


def _like(ids, template):
    """NumPy `ids` as the array kind (and device) of `template`."""
    kind = kind_of(template)
    if kind == "torch":
        import torch

        return torch.from_numpy(ids).to(template.device)
    if kind == "jax":
        import jax

        return jax.device_put(ids, next(iter(template.devices())))
    if kind == "cupy":
        import cupy

        with template.device:
            return cupy.asarray(ids)
    return ids


def mask_kwargs(segment_ids=None, kv_segment_ids=None, window=None,
                softcap=None):
    """The mask keywords for ``_C.attn_fwd`` / ``_C.attn_bwd``: ids as
    Buffers (zero-copy; None stays None), window and softcap as given (the
    C core checks them all)."""
    return {
        "segment_ids": None if segment_ids is None else
        to_buffer(segment_ids, "segment_ids"),
        "kv_segment_ids": None if kv_segment_ids is None else
        to_buffer(kv_segment_ids, "kv_segment_ids"),
        "window": window, "softcap": softcap,
    }
