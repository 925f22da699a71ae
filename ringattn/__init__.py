"""ringattn: torch-free ring attention.

Exact attention over sequences sharded across ranks: K/V blocks travel rank
to rank, partial results merge by log-sum-exp.  The core is C (CPU kernels,
buffers with DLPack, communicators) and CUDA C; this package is the thin
Python layer.  Arrays in: NumPy, JAX, CuPy, PyTorch, or anything with
``__dlpack__``.  Arrays out: the caller's kind, zero-copy.

    import ringattn as ra
    out = ra.attention(q, k, v, causal=True)            # q: (B, S, H, D)
"""

from . import _C
from ._C import Buffer, Comm, CommError
from .attention import attention, attention_backward, merge
from .comm import ThreadsGroup, init, nccl_unique_id, nccl_version
from .launch import LaunchError, launch
from .dilated import (DilatedAttention, dilated_attention,
                      dilated_attention_backward)
from .ring import ring_attention, ring_attention_backward
from .ring_dilated import (ring_dilated_attention,
                           ring_dilated_attention_backward)
from .interop import empty, from_dlpack, zeros
from .layout import shard_indices
from .sharding import shard, unshard

__version__ = "0.1.0"


def memory_stats():
    """Bytes ringattn allocated, per device kind.

    Returns {"cpu": {"current", "peak", "allocations"}, "cuda": {...}}: every
    buffer ringattn owns and every kernel scratch block is counted; memory
    borrowed from other arrays is not.
    """
    return _C.memory_stats()


def reset_peak_memory_stats():
    """Set every peak in ``memory_stats()`` to the current value."""
    _C.reset_peak_memory_stats()


def cuda_info():
    """{'built': bool, 'available': bool, 'reason': str, 'devices': int}."""
    available, reason = _C.cuda_available()
    return {"built": bool(_C.cuda_built()), "available": bool(available),
            "reason": "" if available else reason,
            "devices": _C.cuda_device_count() if available else 0}


def cuda_available():
    """True when CUDA kernels are built in and a GPU is usable.

    Never raises: without a GPU, driver or CUDA build it is False, and
    ``cuda_info()['reason']`` says why.
    """
    return bool(_C.cuda_available()[0])


def cpu_info():
    """{'simd': 'avx512' | 'avx2' | 'generic', 'threads': int}."""
    return {"simd": _C.cpu_simd_level(), "threads": _C.cpu_num_threads()}


__all__ = [
    "Buffer", "Comm", "CommError", "attention", "attention_backward", "merge",
    "shard_indices", "shard", "unshard", "memory_stats",
    "reset_peak_memory_stats", "cuda_available", "cuda_info", "cpu_info",
    "from_dlpack", "empty", "zeros", "ring_attention",
    "ring_attention_backward", "dilated_attention",
    "dilated_attention_backward", "DilatedAttention", "ring_dilated_attention",
    "ring_dilated_attention_backward", "init", "launch", "LaunchError", "ThreadsGroup",
    "nccl_unique_id", "nccl_version",
]
