"""A stand-in for XLA that calls ringattn's FFI handlers directly with
ctypes: call frames and an FFI API table built by hand (the layouts of
csrc/xla/xla_ffi.h), with error_create / stream_get implemented here, so
tests/test_jax_ffi_errors.py can see exactly which error object a handler
returns, and what happens when XLA's API cannot make one.

As a script (for the cases that must end the process):
    python ffi_fake_frame.py no-error-create | null-error
runs a failing call against such an API and exits 0 if it returns.
"""

import ctypes as C
import sys

import numpy as np

from ringattn import _C

F32 = 11
EXECUTE = 3
ARG_BUFFER = RET_BUFFER = 1


class Ext(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("type", C.c_int),
                ("next", C.c_void_p)]


class ApiVersion(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p),
                ("major_version", C.c_int), ("minor_version", C.c_int)]


class ErrorCreateArgs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p),
                ("message", C.c_char_p), ("errc", C.c_int)]


class StreamGetArgs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p),
                ("ctx", C.c_void_p), ("stream", C.c_void_p)]


ErrorCreate = C.CFUNCTYPE(C.c_void_p, C.POINTER(ErrorCreateArgs))
StreamGet = C.CFUNCTYPE(C.c_void_p, C.POINTER(StreamGetArgs))


class Api(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p),
                ("api_version", ApiVersion), ("internal_api", C.c_void_p),
                ("error_create", ErrorCreate),
                ("error_get_message", C.c_void_p),
                ("error_destroy", C.c_void_p),
                ("handler_register", C.c_void_p), ("stream_get", StreamGet)]


class Buffer(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p),
                ("dtype", C.c_int), ("data", C.c_void_p), ("rank", C.c_int64),
                ("dims", C.POINTER(C.c_int64))]


class List(C.Structure):     # XLA_FFI_Args and XLA_FFI_Rets
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p),
                ("size", C.c_int64), ("types", C.POINTER(C.c_int)),
                ("items", C.POINTER(C.c_void_p))]


class Attrs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p),
                ("size", C.c_int64), ("types", C.POINTER(C.c_int)),
                ("names", C.POINTER(C.c_void_p)),
                ("attrs", C.POINTER(C.c_void_p))]


class Frame(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p),
                ("api", C.POINTER(Api)), ("ctx", C.c_void_p),
                ("stage", C.c_int), ("args", List), ("rets", List),
                ("attrs", Attrs), ("future", C.c_void_p)]


Handler = C.CFUNCTYPE(C.c_void_p, C.POINTER(Frame))

C.pythonapi.PyCapsule_GetPointer.restype = C.c_void_p
C.pythonapi.PyCapsule_GetPointer.argtypes = [C.py_object, C.c_char_p]


def handler(name, platform="cpu"):
    cap = _C.ffi_targets()[platform][name]
    return Handler(C.pythonapi.PyCapsule_GetPointer(cap, None))


class FakeXla:
    """An API table whose error_create records (message, code) and returns
    a fresh sentinel address per error; stream_get returns `stream_error`
    (an address, or None for a stream)."""

    def __init__(self, error_create=True, null_errors=False,
                 stream_error=None):
        self.errors = []                 # (sentinel, message, errc)
        self._keep = []

        def create(args):
            a = args.contents
            sentinel = 0x1000 + 16 * len(self.errors)
            self.errors.append((sentinel, a.message.decode(), a.errc))
            return None if null_errors else sentinel

        def stream_get(args):
            if stream_error is not None:
                return stream_error
            args.contents.stream = 0x5000
            return None

        self.api = Api()
        self.api.struct_size = C.sizeof(Api)
        self.api.error_create = ErrorCreate(create) if error_create \
            else ErrorCreate()
        self.api.stream_get = StreamGet(stream_get)
        self._keep += [self.api.error_create, self.api.stream_get]

    def _list(self, arrays, kind):
        bufs = []
        for a in arrays:
            dims = (C.c_int64 * a.ndim)(*a.shape)
            b = Buffer(C.sizeof(Buffer), None, F32, a.ctypes.data, a.ndim,
                       dims)
            bufs.append(b)
            self._keep += [dims, b]
        types = (C.c_int * len(bufs))(*([kind] * len(bufs)))
        items = (C.c_void_p * len(bufs))(*[C.addressof(b) for b in bufs])
        self._keep += [types, items]
        return List(C.sizeof(List), None, len(bufs), types, items)

    def call(self, name, args, rets, platform="cpu"):
        """Run the handler on float32 arrays; the error address or None."""
        frame = Frame()
        frame.struct_size = C.sizeof(Frame)
        frame.api = C.pointer(self.api)
        frame.stage = EXECUTE
        frame.args = self._list(args, ARG_BUFFER)
        frame.rets = self._list(rets, RET_BUFFER)
        frame.attrs = Attrs(C.sizeof(Attrs), None, 0, None, None, None)
        return handler(name, platform)(C.byref(frame))


def qkv_case(rows=(1, 8, 2, 4)):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(rows).astype(np.float32) for _ in range(3))
    out = np.zeros(rows, np.float32)
    lse = np.zeros((rows[0], rows[2], rows[1]), np.float32)
    return [q, k, v], [out, lse]


if __name__ == "__main__":
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # it aborts: no core
    xla = FakeXla(error_create=sys.argv[1] != "no-error-create",
                  null_errors=sys.argv[1] == "null-error")
    args, rets = qkv_case()
    xla.call("ringattn_attn_fwd", args[:2], rets)    # too few operands
    print("the failed call returned", flush=True)
