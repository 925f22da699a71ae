"""A foreign GPU framework for the tests, on the emulated GPU: its own
stream, its own caching allocator, DLPack both ways -- a stand-in for
PyTorch, which no emulated device reaches.

What it copies from PyTorch is what makes stream-ordered lifetimes matter:

* memory freed (the last array or exported DLPack tensor viewing a block
  is gone) goes back to the allocator's free list at once, and the next
  allocation of that size gets it (``Framework.reused`` counts those);
* new contents are written on the framework's own stream, and an upload of
  host data has finished when ``array`` returns (as ``tensor.to("cuda")``
  from pageable memory), so with the emulator's lazy streams
  (``_C.emu_lazy``) it lands before any work ringattn queued earlier;
* ``__dlpack__(stream=s)`` makes stream `s` wait for the framework's
  stream (the DLPack handshake), and the exported tensor keeps the block
  alive until the consumer calls its deleter;
* ``from_dlpack(x)`` imports an array (a ringattn ``Buffer``) with the
  framework's stream named, and ``copy(a)`` reads an array on that stream
  (asynchronously).

Built from the emulated build's raw runtime hooks (``ringattn._C.emu_rt_*``),
so it exists only on the emulated GPU (``AVAILABLE``).  Import it from a test
module (pytest puts tests/ on sys.path): ``from foreign_arrays import
Framework``.
"""

import ctypes

import numpy as np

from dlpack_producer import _DLDataType, _DLDevice, _DLManagedTensor, _DLTensor

try:
    from ringattn import _C
    from ringattn.testing import np_dtype

    AVAILABLE = hasattr(_C, "emu_rt_malloc") and bool(_C.cuda_available()[0])
except ImportError:
    _C, AVAILABLE = None, False

KDLCUDA = 2
_ALIGN = 512          # the allocator rounds sizes up to this, as PyTorch's


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", _DLTensor)]


_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
# the capsule destructor gets the dying capsule: raw pointers only
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_GetName", _api))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))

# address of an exported managed tensor -> what it keeps alive (its struct,
# shape/strides and the block); its deleter (or an unconsumed capsule's
# destructor) drops the entry
_EXPORTED = {}


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _deleter(address):
    _EXPORTED.pop(address, None)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule):
    name = _capsule_name(capsule)
    if name in (b"dltensor", b"dltensor_versioned"):   # never consumed
        _EXPORTED.pop(_capsule_pointer(capsule, name), None)


_DELETER_ADDRESS = ctypes.cast(_deleter, ctypes.c_void_p).value
_DESTRUCTOR_ADDRESS = ctypes.cast(_capsule_destructor, ctypes.c_void_p).value


def _dl_dtype(dt):
    dt = np.dtype(dt)
    if dt.name == "bfloat16":
        return _DLDataType(4, 16, 1)
    code = {"f": 2, "i": 0, "u": 1}[dt.kind]
    return _DLDataType(code, dt.itemsize * 8, 1)


def _np_dtype(t):
    if t.code == 4:
        return np.dtype(np_dtype("bfloat16"))
    return np.dtype({(2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
                     (0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
                     (1, 8): "uint8"}[(t.code, t.bits)])


class _Block:
    """Device memory of the framework's allocator: back on its free list
    when the last holder goes."""

    def __init__(self, framework, nbytes):
        self.framework = framework
        self.ptr, self.size = framework._alloc(nbytes)

    def __del__(self):
        try:
            self.framework._free(self.ptr, self.size)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class _Borrowed:
    """Memory imported through DLPack: the capsule, whose destructor calls
    the producer's deleter when it goes."""

    def __init__(self, capsule):
        self.capsule = capsule


class ForeignArray:
    """An n-d strided view of framework memory (or of an imported array)."""

    def __init__(self, framework, keeper, ptr, shape, strides, dtype):
        self.framework, self.keeper, self.ptr = framework, keeper, ptr
        self.shape, self.strides = tuple(shape), tuple(strides)
        self.dtype = np.dtype(dtype)

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def device(self):
        return ("cuda", self.framework.device)

    def narrow(self, axis, start, stop, step=1):
        """The view x[..., start:stop:step, ...] along `axis`."""
        shape, strides = list(self.shape), list(self.strides)
        shape[axis] = len(range(start, stop, step))
        strides[axis] *= step
        ptr = self.ptr + start * self.strides[axis] * self.dtype.itemsize
        return ForeignArray(self.framework, self.keeper, ptr, shape, strides,
                            self.dtype)

    def __dlpack_device__(self):
        return (KDLCUDA, self.framework.device)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        if stream is not None and stream != -1:
            # the consumer's stream waits for what this framework queued
            _C.emu_rt_stream_wait(stream, self.framework.stream)
        n = self.ndim
        shape = (ctypes.c_int64 * max(n, 1))(*self.shape)
        strides = (ctypes.c_int64 * max(n, 1))(*self.strides)
        versioned = max_version is not None and max_version[0] >= 1
        managed = _DLManagedTensorVersioned() if versioned else _DLManagedTensor()
        t = managed.dl_tensor
        t.data, t.byte_offset = self.ptr, 0
        t.device = _DLDevice(KDLCUDA, self.framework.device)
        t.ndim, t.dtype = n, _dl_dtype(self.dtype)
        t.shape, t.strides = shape, strides
        managed.deleter = _DELETER_ADDRESS
        if versioned:
            managed.version = _DLPackVersion(1, 1)
        address = ctypes.addressof(managed)
        _EXPORTED[address] = (managed, shape, strides, self.keeper)
        name = b"dltensor_versioned" if versioned else b"dltensor"
        return _api.PyCapsule_New(address, name, _DESTRUCTOR_ADDRESS)


class Framework:
    """One device of the foreign framework: its stream (non-blocking unless
    `blocking`) and its caching allocator."""

    def __init__(self, device=0, blocking=False):
        if not AVAILABLE:
            raise RuntimeError("foreign_arrays needs ringattn's emulated GPU build")
        self.device = device
        self.stream = _C.emu_rt_stream_create(device, blocking)
        self._free_lists = {}     # rounded size -> pointers, last freed last
        self.reused = 0           # allocations served from freed memory

    # the allocator: freed memory goes to the next allocation of its size
    def _alloc(self, nbytes):
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        free = self._free_lists.get(size)
        if free:
            self.reused += 1
            return free.pop(), size
        return _C.emu_rt_malloc(self.device, size), size

    def _free(self, ptr, size):
        self._free_lists.setdefault(size, []).append(ptr)

    def _fresh(self, shape, dtype):
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        block = _Block(self, nbytes)
        strides = np.empty(shape, dtype).strides
        strides = tuple(s // dtype.itemsize for s in strides)
        return ForeignArray(self, block, block.ptr, shape, strides, dtype)

    def array(self, host, dtype=None):
        """A new device array with `host`'s contents (`dtype`: a name, or
        host's dtype), written on this framework's stream and finished on
        return."""
        host = np.ascontiguousarray(host, dtype=None if dtype is None else np_dtype(dtype))
        x = self._fresh(host.shape, host.dtype)
        _C.emu_rt_upload(x.ptr, host.tobytes(), self.stream)
        _C.emu_rt_stream_synchronize(self.stream)
        return x

    def full(self, shape, value, dtype):
        return self.array(np.full(shape, value, np_dtype(dtype)))

    def zeros(self, shape, dtype):
        return self.full(shape, 0, dtype)

    def to_host(self, x):
        """A NumPy copy of `x`, read on this framework's stream."""
        itemsize = x.dtype.itemsize
        if 0 in x.shape:
            return np.zeros(x.shape, x.dtype)
        span = 1 + sum((n - 1) * s for n, s in zip(x.shape, x.strides))
        raw = _C.emu_rt_download(x.ptr, span * itemsize, self.stream)
        flat = np.frombuffer(raw, x.dtype)
        view = np.lib.stride_tricks.as_strided(
            flat, x.shape, tuple(s * itemsize for s in x.strides))
        return np.array(view)

    def astype(self, x, dtype):
        return self.array(self.to_host(x), dtype)

    def from_dlpack(self, obj):
        """Import any DLPack producer, naming this framework's stream."""
        capsule = obj.__dlpack__(stream=self.stream, max_version=(1, 1))
        if _api.PyCapsule_IsValid(capsule, b"dltensor_versioned"):
            managed = _DLManagedTensorVersioned.from_address(
                _api.PyCapsule_GetPointer(capsule, b"dltensor_versioned"))
        else:
            managed = _DLManagedTensor.from_address(
                _api.PyCapsule_GetPointer(capsule, b"dltensor"))
        t = managed.dl_tensor
        shape = tuple(t.shape[i] for i in range(t.ndim))
        if t.strides:
            strides = tuple(t.strides[i] for i in range(t.ndim))
        else:
            strides = tuple(int(np.prod(shape[i + 1:])) for i in range(t.ndim))
        return ForeignArray(self, _Borrowed(capsule), t.data + t.byte_offset,
                            shape, strides, _np_dtype(t.dtype))

    def copy(self, x):
        """A new array with `x`'s contents (contiguous `x`), copied on this
        framework's stream: queued, not finished, on return."""
        out = self._fresh(x.shape, x.dtype)
        nbytes = int(np.prod(x.shape, dtype=np.int64)) * x.dtype.itemsize
        _C.emu_rt_copy(out.ptr, x.ptr, nbytes, self.stream)
        return out

    def synchronize(self):
        _C.emu_rt_stream_synchronize(self.stream)
