"""A hand-made DLPack producer for tests: arbitrary (also malformed)
metadata in a legacy ``dltensor`` capsule, built with ctypes.

Import it from a test module (pytest puts tests/ on sys.path):
``from dlpack_producer import HandMadeProducer``.
"""

import ctypes

import numpy as np

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice),
                ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class HandMadeProducer:
    """A DLPack producer (legacy capsule, NULL deleter) describing arbitrary metadata.

    Its data pointer is a small real host buffer; the claimed shape may be
    far larger, so a consumer that does not validate would read out of bounds.
    """

    def __init__(self, shape, strides=None, code=2, bits=32, lanes=1, device=(1, 0),
                 ndim=None, null_shape=False, null_data=False, byte_offset=0,
                 data_offset=0):
        self.storage = np.zeros(64, np.float32)
        ndim = len(shape) if ndim is None else ndim
        self.shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self.strides = None if strides is None else (ctypes.c_int64 * max(len(shape), 1))(*strides)
        self.managed = _DLManagedTensor()
        t = self.managed.dl_tensor
        t.data = None if null_data else self.storage.ctypes.data + data_offset
        t.device = _DLDevice(*device)
        t.ndim = ndim
        t.dtype = _DLDataType(code, bits, lanes)
        t.shape = None if null_shape else self.shape
        t.strides = self.strides
        t.byte_offset = byte_offset
        self.device = device

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return _capsule_new(ctypes.addressof(self.managed), b"dltensor", None)

    def __dlpack_device__(self):
        return self.device
