"""GPU arrays in and out of ringattn: PyTorch, CuPy and JAX CUDA arrays
through DLPack, stream ordering both ways, and the caching allocator.

Every test carries the ``gpu`` marker and skips unless
``ringattn.cuda_available()``; each framework's tests skip when that
framework (with a CUDA device) is missing (always on the emulated GPU of a
``RINGATTN_CUDA=emulate`` build, which no framework sees: there the
ringattn-only tests run, with ``ra.to_device`` arrays: copies both ways,
conversions, strides, integer ids, device names, rounding, memory stats).

The ordering tests hold a stream busy with a sleeping kernel
(``torch.cuda._sleep``, or a CuPy kernel spinning on ``clock64``) so that
work queued behind it runs a long time after the host moved on: a missing
wait then reads data that is not written yet, or memory already reused,
and the result is wrong rather than luckily right.  Results are compared
with the float64 reference of ``ringattn.testing``: max |got - ref| <=
tol * max(1, max |ref|), tol 1e-4 for float32, 2e-2 for bfloat16, 5e-3 for
float16.
"""
import gc

import numpy as np
import pytest

import ringattn as ra
from ringattn import testing

pytestmark = pytest.mark.gpu

if not ra.cuda_available():
    pytest.skip(f"no CUDA device: {ra.cuda_info()['reason']}", allow_module_level=True)

TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}
SLEEP_CYCLES = 100_000_000          # ~0.05 s at the clocks of an H100


def assert_close(got, ref, dtype):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert not np.isnan(got).any(), "NaN in result"
    err = np.abs(got - ref).max(initial=0.0)
    bound = TOL[dtype] * max(1.0, np.abs(ref).max(initial=0.0))
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


def qkv_host(seed, B=1, S=128, H=2, D=64):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, S, H, D)).astype(np.float32) for _ in range(3)]


# ---- PyTorch --------------------------------------------------------------

def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    return torch


def _torch_sleep(torch):
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("this PyTorch has no torch.cuda._sleep")
    return torch.cuda._sleep


def test_torch_round_trip_on_side_stream():
    torch = _torch()
    qh, kh, vh = qkv_host(19)
    q, k, v = (torch.from_numpy(x).cuda().bfloat16() for x in (qh, kh, vh))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())   # q, k, v were made there
    with torch.cuda.stream(side):
        out = ra.attention(q, k, v)
        # consumed on `side` right away: the export must order it after our work
        host = out.float().cpu().numpy()
    assert isinstance(out, torch.Tensor) and out.device.type == "cuda"
    ref, _ = testing.ref_attention(*(x.double().cpu().numpy() for x in (q, k, v)))
    assert_close(host, ref, "bfloat16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_producer_on_a_busy_side_stream(dtype):
    # q is written on a side stream behind a long sleep; ringattn, called
    # with that stream current, must read it only after the write
    torch = _torch()
    sleep = _torch_sleep(torch)
    qh, kh, vh = qkv_host(23)
    tdt = getattr(torch, dtype)
    q_src, k, v = (torch.from_numpy(x).cuda().to(tdt) for x in (qh, kh, vh))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        sleep(SLEEP_CYCLES)
        q = q_src * 1.0                    # written after the sleep
        out = ra.attention(q, k, v, causal=True)
        host = out.float().cpu().numpy()
    ref, _ = testing.ref_attention(*(x.double().cpu().numpy() for x in (q_src, k, v)),
                                   causal=True)
    assert_close(host, ref, dtype)


@pytest.mark.parametrize("on_side_stream", [False, True])
def test_freed_output_is_not_reused_while_a_stream_reads_it(on_side_stream):
    # `out` is exported to `stream`, which reads it only after a long sleep;
    # the tensor is dropped at once, and new outputs of the same size are
    # computed from a third stream that does not wait for `stream`: the
    # caching allocator must not hand out the block before `stream` read it
    # (legacy default stream: the compute stream waits for it; another
    # stream: the block is freed synchronously)
    torch = _torch()
    sleep = _torch_sleep(torch)
    qh, kh, vh = qkv_host(29, S=256, H=4)
    q, k, v = (torch.from_numpy(x).cuda() for x in (qh, kh, vh))
    q_other = torch.flip(q, dims=(1,)).contiguous()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream() if on_side_stream else torch.cuda.default_stream()
    with torch.cuda.stream(stream):
        out = ra.attention(q, k, v)        # exported to `stream`
        sleep(SLEEP_CYCLES)
        seen = out * 1.0                   # reads out after the sleep
    del out
    gc.collect()
    with torch.cuda.stream(torch.cuda.Stream()):
        others = [ra.attention(q_other, k, v) for _ in range(4)]   # same size class
    torch.cuda.synchronize()
    ref, _ = testing.ref_attention(qh, kh, vh)
    assert_close(seen.cpu().numpy(), ref, "float32")
    ref_other, _ = testing.ref_attention(q_other.cpu().numpy(), kh, vh)
    for o in others:
        assert_close(o.cpu().numpy(), ref_other, "float32")


def test_export_with_copy_waits_for_the_copy():
    # __dlpack__(copy=True) queues a copy of a large output on ringattn's
    # stream; the consumer (PyTorch's default stream, reading at once) must
    # wait for that copy, not only for the attention that made the output
    torch = _torch()
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(4, 4096, 16, 64, device="cuda", generator=g) for _ in range(3))
    bufs = [ra.from_dlpack(x) for x in (q, k, v)]
    out = ra.attention(*bufs, causal=True)            # a ringattn Buffer
    assert isinstance(out, ra.interop.Buffer)
    cap = out.__dlpack__(stream=1, copy=True)
    got = torch.utils.dlpack.from_dlpack(cap).cpu()
    want = torch.from_dlpack(out)
    torch.cuda.synchronize()
    assert torch.equal(got, want.cpu())


@pytest.mark.parametrize("backend", ["torch", "ra"])
def test_memory_stats_count_cuda_bytes(backend):
    qh, kh, vh = qkv_host(37, S=64)
    if backend == "torch":
        torch = _torch()
        q, k, v = (torch.from_numpy(x).cuda() for x in (qh, kh, vh))
    else:
        q, k, v = (ra.to_device(x, "cuda") for x in (qh, kh, vh))
    before = ra.memory_stats()["cuda"]["current"]
    out, lse = ra.attention(q, k, v, return_lse=True)
    during = ra.memory_stats()["cuda"]["current"]
    assert during - before >= 64 * 2 * 64 * 4 + 2 * 64 * 4  # out + lse held by us
    del out, lse
    gc.collect()
    assert ra.memory_stats()["cuda"]["current"] == before


# ---- CuPy -------------------------------------------------------------------

def _cupy():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("CuPy sees no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError as e:
        pytest.skip(f"CuPy cannot reach a device: {e}")
    return cupy


_SPIN_SRC = r"""
extern "C" __global__ void ra_test_spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


def test_cupy_round_trip_on_side_stream():
    cupy = _cupy()
    qh, kh, vh = qkv_host(41)
    q, k, v = (cupy.asarray(x).astype("float16") for x in (qh, kh, vh))
    cupy.cuda.Device().synchronize()        # made on the null stream
    with cupy.cuda.Stream(non_blocking=True):
        out = ra.attention(q, k, v)
        host = cupy.asnumpy(out.astype("float64"))
    assert isinstance(out, cupy.ndarray)
    ref, _ = testing.ref_attention(*(cupy.asnumpy(x.astype("float64")) for x in (q, k, v)))
    assert_close(host, ref, "float16")


def test_cupy_producer_on_a_busy_side_stream():
    cupy = _cupy()
    spin = cupy.RawKernel(_SPIN_SRC, "ra_test_spin")
    qh, kh, vh = qkv_host(43)
    q_src, k, v = (cupy.asarray(x) for x in (qh, kh, vh))
    cupy.cuda.Device().synchronize()
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        spin((1,), (1,), (np.int64(SLEEP_CYCLES),))
        q = q_src * 1.0                    # written after the spin
        out = ra.attention(q, k, v, causal=True)
        host = cupy.asnumpy(out)
    ref, _ = testing.ref_attention(qh, kh, vh, causal=True)
    assert_close(host, ref, "float32")


# ---- JAX --------------------------------------------------------------------

def _jax_gpu():
    jax = pytest.importorskip("jax")
    try:
        return jax, jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")


def test_jax_gpu_round_trip():
    jax, dev = _jax_gpu()
    arrs = [jax.device_put(x, dev) for x in qkv_host(47, S=50)]
    out = ra.attention(*arrs, causal=True)
    assert isinstance(out, jax.Array)
    ref, _ = testing.ref_attention(*[np.asarray(a, dtype=np.float64) for a in arrs], causal=True)
    assert_close(np.asarray(out), ref, "float32")


def test_jax_producer_still_running():
    # q comes out of a jitted chain of large matrix products that is still
    # running when ringattn imports it: the import must wait for XLA's stream
    jax, dev = _jax_gpu()
    import jax.numpy as jnp

    qh, kh, vh = qkv_host(53, S=512, H=4)
    mix = np.linalg.qr(np.random.default_rng(1).standard_normal((64, 64)))[0].astype(np.float32)
    n = 8192
    big = jax.device_put(np.eye(n, dtype=np.float32), dev)

    @jax.jit
    def produce(x, m, big):
        for _ in range(20):                # keeps the GPU busy, changes nothing
            big = big @ big
        return (x @ m) * (jnp.sum(big) / n)

    k, v, x, m = (jax.device_put(a, dev) for a in (kh, vh, qh, mix))
    q = produce(x, m, big)
    out = ra.attention(q, k, v, causal=True)
    # the reference from q's final values (read after the computation ended)
    ref, _ = testing.ref_attention(np.asarray(q, np.float64), kh, vh, causal=True)
    assert_close(np.asarray(out), ref, "float32")


# ---- ringattn alone: ra.to_device, Buffer.copy_ across host and GPU --------

def _bf16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return ml_dtypes.bfloat16


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_to_device_round_trip_is_exact(dtype):
    np_dtype = _bf16() if dtype == "bfloat16" else np.dtype(dtype)
    x = np.random.default_rng(3).standard_normal((3, 7, 5)).astype(np_dtype)
    dev = ra.to_device(x, "cuda")
    assert dev.device == ("cuda", 0) and dev.dtype == dtype and dev.is_contiguous
    back = ra.to_device(dev, "cpu")
    assert back.device == ("cpu", 0)
    np.testing.assert_array_equal(back.numpy().astype(np.float64), x.astype(np.float64))
    with pytest.raises(Exception, match="CUDA device"):
        dev.numpy()


def test_to_device_converts_and_follows_strides_both_ways():
    x = np.random.default_rng(4).standard_normal((4, 9, 6))
    up = ra.to_device(x[:, ::2, 1:], "cuda:0", dtype="float32")   # strided f64 -> f32
    np.testing.assert_array_equal(ra.to_device(up, "cpu").numpy(),
                                  x[:, ::2, 1:].astype(np.float32))
    down = np.zeros((4, 10, 6), np.float64)                       # f32 -> strided f64
    ra.from_dlpack(down).narrow(1, 1, 5, 2).copy_(
        ra.to_device(x[:, ::2].astype(np.float32), "cuda"))
    np.testing.assert_array_equal(down[:, 1::2], x[:, ::2].astype(np.float32))
    assert not down[:, ::2].any()
    dst = ra.zeros((4, 10, 6), "float16", "cuda")                 # strided device dst
    dst.narrow(1, 0, 5, 2).copy_(x[:, ::2])
    got = ra.to_device(dst, "cpu").numpy()
    np.testing.assert_array_equal(got[:, ::2], x[:, ::2].astype(np.float16))
    assert not got[:, 1::2].any()


def test_to_device_integer_ids_and_empty_arrays():
    ids = np.arange(35, dtype=np.int64).reshape(5, 7) % 4
    back = ra.to_device(ra.to_device(ids, "cuda"), "cpu").numpy()
    assert back.dtype == np.int64
    np.testing.assert_array_equal(back, ids)
    with pytest.raises(NotImplementedError, match="contiguous"):
        ra.to_device(ids[:, ::2], "cuda")
    empty = ra.to_device(np.zeros((0, 3), np.float32), "cuda")
    assert empty.shape == (0, 3)
    assert ra.to_device(empty, "cpu").numpy().shape == (0, 3)


def test_uploaded_inputs_give_the_reference_answer():
    """Upload with ra.to_device, run the kernels, download: no framework."""
    q, k, v = qkv_host(9, S=77, D=64)
    qd, kd, vd = (ra.to_device(a, "cuda") for a in (q, k, v))
    out, lse = ra.attention(qd, kd, vd, causal=True, return_lse=True)
    assert out.device == ("cuda", 0)
    ref_out, _ = testing.ref_attention(q, k, v, causal=True)
    assert_close(ra.to_device(out, "cpu").numpy(), ref_out, "float32")
    ra.attention(qd, kd, vd)                      # more work queued on the stream
    del qd, kd, vd, out, lse
    gc.collect()


def test_bad_device_is_named_before_any_work():
    x = np.ones(3, np.float32)
    count = ra.cuda_info()["devices"]
    with pytest.raises(ValueError, match=f"0..{count - 1}"):
        ra.to_device(x, f"cuda:{count}")
    if count >= 2:
        with pytest.raises(ValueError, match="different devices"):
            ra.empty((3,), "float32", "cuda:1").copy_(ra.to_device(x, "cuda:0"))


def test_device_float64_to_float16_rounds_once():
    """The CUDA copy kernel's float64 -> float16 conversion rounds once
    (through a float32 rounded to odd), as NumPy's does."""
    rng = np.random.default_rng(13)
    h = rng.integers(0, 0x7bff, 50000).astype(np.uint16).view(np.float16)
    mid = (h.astype(np.float64) + np.nextafter(h, np.float16(np.inf)).astype(np.float64)) / 2
    x = np.concatenate([mid * (1 + 2.0**-40), mid * (1 - 2.0**-40), mid, [1e300, 0.0, -0.0]])
    dev64 = ra.to_device(x, "cuda")
    dev16 = ra.empty(x.shape, "float16", "cuda").copy_(dev64)     # the device kernel
    got = ra.to_device(dev16, "cpu").numpy()
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
