"""Device arrays for the GPU tests, on every array backend this machine has.

Backends:

* ``"ra"``: ringattn's own ``Buffer``s, moved with ``ra.to_device`` (no
  framework).  Always there when ``ra.cuda_available()``: on a real GPU and
  on the emulated GPU of a ``RINGATTN_CUDA=emulate`` build, where it is the
  only backend (PyTorch and CuPy see no emulated device).  Host-side
  bfloat16 is ml_dtypes' (``ringattn.testing.np_dtype``): inputs are rounded
  on the host, then uploaded.
* ``"torch"``: PyTorch CUDA tensors, when ``torch.cuda.is_available()``.
* ``"cupy"``: CuPy arrays, when CuPy reaches a device (no bfloat16).

The helpers take and return any of them, so one test body serves all:
``to_device`` (float64 NumPy -> device array of a dtype), ``to_host`` (any
array -> float64 NumPy), ``narrow`` (a strided view along one axis: ``x[:,
lo:hi]``, ``x[:, ::2]``), ``zeros`` / ``full`` / ``astype`` (running
states), ``ids_to_device`` (integer document ids).

``EMULATED`` is True on the emulated GPU.  ``emu_subset(reason)`` is the
mark of grid points that run on real GPUs only (the emulated GPU runs a
representative subset, see each grid); ``no_emu_reports()`` raises when the
emulated GPU's checker reported something (for code running outside
pytest's own check, e.g. in ranks that ``ra.launch`` starts).
"""

import numpy as np
import pytest

import ringattn as ra
from ringattn import testing


def _cuda_ok():
    try:
        return bool(ra.cuda_available())
    except Exception:  # noqa: BLE001 - any failure means "no GPU here"
        return False


CUDA = _cuda_ok()
EMULATED = CUDA and bool(ra.cuda_info().get("emulated"))

try:
    import torch

    HAVE_TORCH = torch.cuda.is_available()
except ImportError:
    torch = None
    HAVE_TORCH = False
try:
    import cupy

    HAVE_CUPY = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # noqa: BLE001 - ImportError or a CuPy without a driver
    cupy = None
    HAVE_CUPY = False


def emu_subset(why="the emulated GPU runs a representative subset of this grid"):
    """Mark of a grid point that runs on a real GPU only."""
    return pytest.mark.skipif(EMULATED, reason=f"real GPUs only: {why}")


def backends_for(dtype):
    """The backends that can hold `dtype` on this machine, frameworks first."""
    out = []
    if HAVE_TORCH:
        out.append("torch")
    if HAVE_CUPY and dtype != "bfloat16":  # CuPy has no bfloat16
        out.append("cupy")
    if CUDA:
        out.append("ra")
    return out


def backend_of(x):
    if isinstance(x, ra.Buffer):
        return "ra"
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    raise TypeError(f"not a device array: {type(x).__name__}")


def to_device(x, dtype, backend, device=0):
    """float64 (or any float) NumPy -> device array of `dtype` on `backend`."""
    x = np.ascontiguousarray(x)
    if backend == "torch":
        return torch.from_numpy(x).to(f"cuda:{device}").to(getattr(torch, dtype))
    if backend == "cupy":
        with cupy.cuda.Device(device):
            return cupy.asarray(x).astype(dtype)
    assert backend == "ra", backend
    return ra.to_device(x.astype(testing.np_dtype(dtype)), f"cuda:{device}")


def ids_to_device(ids, backend, device=0):
    """Integer NumPy ids -> device array of the same dtype."""
    ids = np.ascontiguousarray(ids)
    if backend == "torch":
        return torch.from_numpy(ids).to(f"cuda:{device}")
    if backend == "cupy":
        with cupy.cuda.Device(device):
            return cupy.asarray(ids)
    assert backend == "ra", backend
    return ra.to_device(ids, f"cuda:{device}")


def to_host(x):
    """Any array (device or host) -> float64 NumPy."""
    if isinstance(x, ra.Buffer):
        if x.device[0] == "cuda":
            x = ra.to_device(x, "cpu")
        return np.array(x.numpy(), dtype=np.float64)
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).cpu().numpy()
    if cupy is not None and isinstance(x, cupy.ndarray):
        return cupy.asnumpy(x.astype("float64"))
    return np.asarray(x, dtype=np.float64)


def narrow(x, axis, start, stop, step=1):
    """The view x[..., start:stop:step, ...] along `axis` (no copy)."""
    if isinstance(x, ra.Buffer):
        length = len(range(start, stop, step))
        return x.narrow(axis, start, length, step)
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop, step)
    return x[tuple(index)]


def zeros(shape, dtype, like):
    """Zeros of `shape` and `dtype` on the backend and device of `like`."""
    backend = backend_of(like)
    if backend == "torch":
        return torch.zeros(shape, dtype=getattr(torch, dtype), device=like.device)
    if backend == "cupy":
        with like.device:
            return cupy.zeros(shape, dtype)
    return ra.zeros(shape, dtype, like.device)


def full(shape, value, dtype, like):
    """`value` everywhere, `shape` and `dtype`, where `like` lives."""
    backend = backend_of(like)
    if backend == "torch":
        return torch.full(shape, value, dtype=getattr(torch, dtype), device=like.device)
    if backend == "cupy":
        with like.device:
            return cupy.full(shape, value, dtype)
    return ra.to_device(np.full(shape, value, testing.np_dtype(dtype)), like.device)


def astype(x, dtype):
    """A converted copy of a device array, on its device."""
    backend = backend_of(x)
    if backend == "torch":
        return x.to(getattr(torch, dtype))
    if backend == "cupy":
        return x.astype(dtype)
    return x.astype(dtype)


def no_emu_reports():
    """Raise if the emulated GPU's checker reported anything in this
    process (a race, an out-of-bounds or uninitialised access, ...)."""
    if EMULATED:
        reports = ra._C.emu_reports()
        if reports:
            ra._C.emu_reports_clear()
            raise AssertionError(f"the emulated GPU's checker reported:\n{reports}")
