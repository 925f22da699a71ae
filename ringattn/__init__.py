"""ringattn: torch-free ring attention.

Exact attention over sequences sharded across ranks: K/V blocks travel rank
to rank, partial results merge by log-sum-exp.  The core is C (CPU kernels,
buffers with DLPack, communicators) and CUDA C; this package is the thin
Python layer.  Arrays in: NumPy, JAX, CuPy, PyTorch, or anything with
``__dlpack__``.  Arrays out: the caller's kind, zero-copy.

    import ringattn as ra
    out = ra.attention(q, k, v, causal=True)            # q: (B, S, H, D)
"""

import os as _os
import sys as _sys
from importlib.machinery import EXTENSION_SUFFIXES as _EXT_SUFFIXES


def _has_compiled_core(folder):
    return any(_os.path.exists(_os.path.join(folder, "_C" + suffix))
               for suffix in _EXT_SUFFIXES)


def _hand_over_to_installed_copy():
    """Replace this core-less source tree in ``sys.modules`` by an installed
    ringattn found further along ``sys.path``, or raise ImportError.

    Python started at the root of a clone puts the clone's ``ringattn/`` (no
    compiled ``_C``) ahead of the installed package.  The import system
    returns whatever ``sys.modules["ringattn"]`` holds once this file has run,
    so ``import ringattn``, its submodules and ``python -m ringattn`` all
    resolve to the installed copy.
    """
    import importlib.util

    here = _os.path.realpath(_os.path.dirname(_os.path.abspath(__file__)))
    for entry in _sys.path:
        folder = _os.path.join(entry or _os.getcwd(), __name__)
        init = _os.path.join(folder, "__init__.py")
        if (_os.path.realpath(folder) == here or not _os.path.isfile(init)
                or not _has_compiled_core(folder)):
            continue
        spec = importlib.util.spec_from_file_location(
            __name__, init, submodule_search_locations=[folder])
        module = importlib.util.module_from_spec(spec)
        _sys.modules[__name__] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del _sys.modules[__name__]
            raise
        return
    raise ImportError(
        f"{here} is a ringattn source tree without its compiled core "
        f"(ringattn/_C), and no installed ringattn was found on sys.path. "
        f"Install it (python -m pip install .) or build the core in place "
        f"(python setup.py build_ext --inplace).", name=__name__, path=here)


if not _has_compiled_core(_os.path.dirname(_os.path.abspath(__file__))):
    # After the hand-over the rest of this file binds names to the installed
    # copy's submodules (already in sys.modules); its result is discarded.
    _hand_over_to_installed_copy()

from . import _C  # noqa: E402
from ._C import Buffer, Comm, CommError
from .attention import attention, attention_backward, merge
from .masks import segment_ids
from .comm import ThreadsGroup, init, nccl_unique_id, nccl_version
from .launch import LaunchError, launch
from .dilated import (DilatedAttention, dilated_attention,
                      dilated_attention_backward)
from .ring import ring_attention, ring_attention_backward
from .ring_dilated import (ring_dilated_attention,
                           ring_dilated_attention_backward)
from .interop import empty, from_dlpack, to_device, zeros
from .layout import shard_indices
from .sharding import shard, unshard
from ._version import __version__


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
    """{'built': bool, 'available': bool, 'reason': str, 'devices': int,
    'emulated': bool, 'device_name': str, 'forward_kernels': str | None,
    'backward_kernels': str | None}.

    ``emulated`` is True when ringattn was built with
    ``RINGATTN_CUDA=emulate``: its CUDA part then runs on the CPU on
    ringattn's emulated GPU (``device_name`` says so; '' otherwise), which
    proves logic and ordering, never speed.  ``forward_kernels`` and
    ``backward_kernels`` name the tensor-core kernel family the float16 /
    bfloat16 attention of head_dim 64 and 128 runs on device 0: "sm90a"
    (wgmma and TMA: compute capability 9.0 and a build for sm_90a) or
    "sm80" (mma.sync; ``RINGATTN_CUDA_KERNELS=sm80`` forces it); None
    without a usable GPU.  On "sm90a" the backward with
    deterministic=True runs two wgmma passes (dk/dv, then dq).
    """
    available, reason = _C.cuda_available()
    emulated = bool(_C.cuda_emulated())
    info = {"built": bool(_C.cuda_built()), "available": bool(available),
            "reason": "" if available else reason,
            "devices": _C.cuda_device_count() if available else 0,
            "emulated": emulated,
            "device_name": "ringattn emulated GPU (sm_90, on the CPU)"
            if emulated else ""}
    family = _C.cuda_kernel_family(0) if available else None
    info["forward_kernels"] = family
    info["backward_kernels"] = family
    return info


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
    "segment_ids",
    "shard_indices", "shard", "unshard", "memory_stats",
    "reset_peak_memory_stats", "cuda_available", "cuda_info", "cpu_info",
    "from_dlpack", "empty", "zeros", "to_device", "ring_attention",
    "ring_attention_backward", "dilated_attention",
    "dilated_attention_backward", "DilatedAttention", "ring_dilated_attention",
    "ring_dilated_attention_backward", "init", "launch", "LaunchError", "ThreadsGroup",
    "nccl_unique_id", "nccl_version",
]
