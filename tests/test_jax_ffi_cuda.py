"""ringattn's CUDA XLA FFI handlers (csrc/xla) without JAX: hand-made call
frames (the structures of tests/ffi_fake_frame.py) around ``ra.to_device``
buffers, on any CUDA device ringattn has -- the emulated GPU of a
``RINGATTN_CUDA=emulate`` build included, where no CUDA jaxlib can run
(tests/test_jax_ffi_gpu.py then skips).

XLA's stream is replaced by ringattn's own CUDA stream (its handle, as
ringattn hands it to a DLPack producer it imports), so the downloads that
follow are ordered after the handlers' kernels.  Attributes are XLA's
(causal as a bool scalar, scale float64, window_left / window_right
int64, softcap float64, segment_ids bool with two int32 id operands).
Checked: the forward (16-bit on the tensor cores, float32 and float64 on
the generic kernels, GQA, masks), the backward preprocess and backward,
the running state of a ring block (``ringattn_attn_fwd_acc``) and the LSE
merge, against the float64 references of ``ringattn.testing`` with
tests/test_cuda.py's tolerance (max |got - ref| <= tol * max(1, max |ref|),
tol 2e-2 bfloat16, 5e-3 float16, 1e-4 float32, 1e-9 float64), and a bad
call's error message.
"""

import ctypes as C

import numpy as np
import pytest

import ringattn as ra
from ringattn import testing

from gpu_arrays import CUDA

pytestmark = pytest.mark.gpu

if not CUDA:
    pytest.skip(f"no CUDA device: {ra.cuda_info()['reason']}", allow_module_level=True)
if "CUDA" not in ra._C.ffi_targets():
    pytest.skip("ringattn was built without the CUDA FFI handlers", allow_module_level=True)

import ffi_fake_frame as ff  # noqa: E402
from dlpack_producer import HandMadeProducer  # noqa: E402

TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4, "float64": 1e-9}
FFI_DTYPE = {"float16": 10, "float32": 11, "float64": 12, "bfloat16": 16, "int32": 4}
PRED, S64, F64 = 1, 5, 12


class Bytespan(C.Structure):
    _fields_ = [("ptr", C.c_char_p), ("len", C.c_size_t)]


class Scalar(C.Structure):
    _fields_ = [("dtype", C.c_int), ("value", C.c_void_p)]


def ringattn_stream():
    """ringattn's CUDA stream on device 0, as an int: the stream it passes
    to a DLPack producer's __dlpack__ when it imports one."""
    seen = {}
    anchor = ra.to_device(np.zeros(4, np.float32), "cuda:0")

    class Producer(HandMadeProducer):
        def __dlpack__(self, stream=None, **kw):
            seen["stream"] = stream
            return super().__dlpack__(stream=stream, **kw)

    p = Producer((4,), device=(2, 0))
    p.managed.dl_tensor.data = anchor.data_ptr
    ra.from_dlpack(p)
    assert isinstance(seen.get("stream"), int) and seen["stream"] > 2, seen
    return seen["stream"]


class DeviceXla:
    """An FFI API table whose stream_get gives ringattn's stream and whose
    error_create records the message; call() runs a CUDA handler on ringattn
    device Buffers with XLA-typed attributes."""

    def __init__(self):
        self.stream = ringattn_stream()
        self.errors = []
        self._keep = []

        def create(args):
            self.errors.append(args.contents.message.decode())
            return 0x1000 + 16 * len(self.errors)

        def stream_get(args):
            args.contents.stream = self.stream
            return None

        self.api = ff.Api()
        self.api.struct_size = C.sizeof(ff.Api)
        self.api.error_create = ff.ErrorCreate(create)
        self.api.stream_get = ff.StreamGet(stream_get)
        self._keep += [self.api.error_create, self.api.stream_get]

    def _list(self, bufs, kind):
        items = []
        for b in bufs:
            assert b.device == ("cuda", 0) and b.is_contiguous
            dims = (C.c_int64 * max(b.ndim, 1))(*b.shape)
            fb = ff.Buffer(C.sizeof(ff.Buffer), None, FFI_DTYPE[b.dtype], b.data_ptr,
                           b.ndim, dims)
            items.append(fb)
            self._keep += [dims, fb]
        types = (C.c_int * max(len(items), 1))(*([kind] * len(items)))
        ptrs = (C.c_void_p * max(len(items), 1))(*[C.addressof(x) for x in items])
        self._keep += [types, ptrs]
        return ff.List(C.sizeof(ff.List), None, len(items), types, ptrs)

    def _attrs(self, attrs):
        names, types, values = [], [], []
        for name in sorted(attrs):                     # XLA sorts them by name
            value = attrs[name]
            if isinstance(value, bool):
                dtype, cval = PRED, C.c_uint8(value)
            elif isinstance(value, int):
                dtype, cval = S64, C.c_int64(value)
            else:
                dtype, cval = F64, C.c_double(value)
            raw = name.encode()
            span = Bytespan(raw, len(raw))
            scalar = Scalar(dtype, C.cast(C.pointer(cval), C.c_void_p))
            self._keep += [raw, span, scalar, cval]
            names.append(C.pointer(span))
            types.append(3)                            # RA_FFI_ATTR_SCALAR
            values.append(C.addressof(scalar))
        n = len(names)
        name_arr = (C.POINTER(Bytespan) * max(n, 1))(*names)
        type_arr = (C.c_int * max(n, 1))(*types)
        value_arr = (C.c_void_p * max(n, 1))(*values)
        self._keep += [name_arr, type_arr, value_arr]
        return ff.Attrs(C.sizeof(ff.Attrs), None, n, type_arr,
                        C.cast(name_arr, C.POINTER(C.c_void_p)), value_arr)

    def call(self, target, args, rets, **attrs):
        """Run `target`'s CUDA handler; raise with XLA's error message."""
        frame = ff.Frame()
        frame.struct_size = C.sizeof(ff.Frame)
        frame.api = C.pointer(self.api)
        frame.stage = ff.EXECUTE
        frame.args = self._list(args, ff.ARG_BUFFER)
        frame.rets = self._list(rets, ff.RET_BUFFER)
        frame.attrs = self._attrs(attrs)
        err = ff.handler(target, "CUDA")(C.byref(frame))
        if err is not None:
            raise RuntimeError(self.errors[-1] if self.errors else f"error {err:#x}")


@pytest.fixture(scope="module")
def xla():
    return DeviceXla()


def up(x, dtype):
    return ra.to_device(np.asarray(x).astype(testing.np_dtype(dtype)), "cuda:0")


def down(buf):
    return np.array(ra.to_device(buf, "cpu").numpy(), np.float64)


def close(got, ref, dtype, name):
    got, ref = down(got), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert not np.isnan(got).any(), f"{name}: NaN"
    fin = np.isfinite(ref)
    assert np.array_equal(np.isneginf(got), np.isneginf(ref)), f"{name}: -inf pattern differs"
    err = np.abs(got[fin] - ref[fin]).max(initial=0.0)
    bound = TOL[dtype] * max(1.0, np.abs(ref[fin]).max(initial=0.0))
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g} [{dtype}]"


def acc_of(dtype):
    return "float64" if dtype == "float64" else "float32"


CASES = [  # dtype, D, causal, mask
    ("bfloat16", 64, True, None),
    ("float16", 128, False, "window+softcap"),
    ("float32", 59, True, "docs"),
    ("float64", 64, False, None),
    ("bfloat16", 128, True, "docs+window"),
]


@pytest.mark.parametrize("dtype,D,causal,mask", CASES,
                         ids=[f"{d}-D{D}-{'causal' if c else 'full'}-{m or 'nomask'}"
                              for d, D, c, m in CASES])
def test_forward_and_backward_handlers(xla, dtype, D, causal, mask):
    """attn_fwd, attn_bwd_pre and attn_bwd on the device (S = 77, GQA)."""
    B, S, H, Hkv = 2, 77, 4, 2
    rng = np.random.default_rng(D + 2 * causal + len(mask or ""))
    q = up(rng.standard_normal((B, S, H, D)), dtype)
    k, v = (up(rng.standard_normal((B, S, Hkv, D)), dtype) for _ in range(2))
    dout = up(rng.standard_normal((B, S, H, D)), dtype)
    attrs, host, extra = {"causal": causal, "scale": 1.0 / np.sqrt(D)}, {}, []
    if mask and "window" in mask:
        attrs.update(window_left=9, window_right=3)
        host["window"] = (9, 3)
    if mask and "softcap" in mask:
        attrs["softcap"] = 2.5
        host["softcap"] = 2.5
    if mask and "docs" in mask:
        ids = np.sort(rng.integers(0, 4, (B, S)), axis=1).astype(np.int32)
        attrs["segment_ids"] = True
        host["segment_ids"] = ids
        extra = [ra.to_device(ids, "cuda:0")] * 2              # q's ids, k's ids
    acc = acc_of(dtype)
    out = ra.empty((B, S, H, D), dtype, "cuda:0")
    lse = ra.empty((B, H, S), acc, "cuda:0")
    xla.call("ringattn_attn_fwd", [q, k, v] + extra, [out, lse], **attrs)
    delta = ra.empty((B, H, S), acc, "cuda:0")
    xla.call("ringattn_attn_bwd_pre", [dout, out], [delta], num_threads=0)
    grads = [ra.empty(tuple(x.shape), dtype, "cuda:0") for x in (q, k, v)]
    xla.call("ringattn_attn_bwd", [dout, q, k, v, lse, delta] + extra, grads, **attrs)

    qh, kh, vh, dh = (down(x) for x in (q, k, v, dout))
    ref_out, ref_lse = testing.ref_attention(qh, kh, vh, causal=causal, **host)
    refs = testing.ref_attention_backward(dh, qh, kh, vh, causal=causal, out=down(out), **host)
    close(out, ref_out, dtype, "out")
    close(lse, ref_lse, acc, "lse")
    close(delta, np.einsum("bshd,bshd->bhs", dh, down(out)), acc, "delta")
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        close(g, r, dtype, name)


@pytest.mark.parametrize("dtype,D", [("bfloat16", 64), ("float32", 64)])
def test_ring_block_handler_continues_the_running_state(xla, dtype, D):
    """attn_fwd into a float32 state over the first keys, then attn_fwd_acc
    (out and lse aliased) over the rest: full attention over all keys."""
    B, Sq, Sk, H, Hkv = 1, 70, 130, 2, 1
    rng = np.random.default_rng(3)
    q = up(rng.standard_normal((B, Sq, H, D)), dtype)
    k, v = (up(rng.standard_normal((B, Sk, Hkv, D)), dtype) for _ in range(2))
    first = [ra.to_device(ra.to_device(x, "cpu").numpy()[:, :60], "cuda:0") for x in (k, v)]
    rest = [ra.to_device(ra.to_device(x, "cpu").numpy()[:, 60:], "cuda:0") for x in (k, v)]
    out = ra.empty((B, Sq, H, D), "float32", "cuda:0")
    lse = ra.empty((B, H, Sq), "float32", "cuda:0")
    xla.call("ringattn_attn_fwd", [q] + first, [out, lse])
    xla.call("ringattn_attn_fwd_acc", [q] + rest + [out, lse], [out, lse])
    ref_out, ref_lse = testing.ref_attention(down(q), down(k), down(v))
    close(out, ref_out, dtype, "out")
    close(lse, ref_lse, "float32", "lse")


def test_merge_handler(xla):
    rng = np.random.default_rng(5)
    o1, o2 = (rng.standard_normal((2, 9, 3, 8)).astype(np.float32) for _ in "ab")
    l1, l2 = (rng.standard_normal((2, 3, 9)).astype(np.float32) for _ in "ab")
    l1[0, 0, :3] = l2[0, 0, :3] = -np.inf
    out = ra.empty((2, 9, 3, 8), "float32", "cuda:0")
    lse = ra.empty((2, 3, 9), "float32", "cuda:0")
    xla.call("ringattn_merge", [ra.to_device(x, "cuda:0") for x in (o1, l1, o2, l2)],
             [out, lse])
    for got, want in zip((out, lse), ra.merge(o1, l1, o2, l2)):
        np.testing.assert_allclose(down(got), want, rtol=1e-6, atol=1e-6)


def test_a_bad_call_is_an_xla_error(xla):
    q = up(np.zeros((1, 5, 2, 64)), "float32")
    out = ra.empty((1, 5, 2, 64), "float32", "cuda:0")
    lse = ra.empty((1, 2, 5), "float32", "cuda:0")
    with pytest.raises(RuntimeError, match="window"):
        xla.call("ringattn_attn_fwd", [q, q, q], [out, lse], window_left=3)


def test_ids_check_handler_passes_good_ids_and_names_bad_ones(xla):
    """ringattn_ids_check on the device (the run-time half of the int32
    range check of wide segment ids): a clean report passes the ids through;
    values outside int32 here, or on another device of the ring, are an
    error naming the argument, and nothing is passed on."""
    ids = np.arange(14, dtype=np.int32).reshape(2, 7)
    dev_ids = ra.to_device(ids, "cuda:0")
    out = ra.empty((2, 7), "int32", "cuda:0")
    clean = ra.to_device(np.zeros(4, np.int32), "cuda:0")
    xla.call("ringattn_ids_check", [dev_ids, clean], [out], which=0)
    np.testing.assert_array_equal(ra.to_device(out, "cpu").numpy(), ids)
    here = ra.to_device(np.int32([3, 2, 1, 5]), "cuda:0")
    with pytest.raises(RuntimeError, match=r"segment_ids: .*got 2 outside it "
                                           r"\(the first at \[1, 5\]\)"):
        xla.call("ringattn_ids_check", [dev_ids, here], [out], which=0)
    elsewhere = ra.to_device(np.int32([1, 0, 0, 0]), "cuda:0")
    with pytest.raises(RuntimeError, match="kv_segment_ids: .*on another device"):
        xla.call("ringattn_ids_check", [dev_ids, elsewhere], [out], which=1)
