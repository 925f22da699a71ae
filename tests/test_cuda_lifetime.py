"""Device arrays from other libraries: their stream-ordered lifetime
(DESIGN 7, docs/api.md "Streams and lifetimes on the GPU").

ringattn queues its work on its own stream and returns; the arrays it
borrowed through DLPack must stay alive until that work has completed, or
the producer's caching allocator hands their memory to its next
allocation, which it writes on its own stream while ringattn's kernel still
reads (or writes) the old array: a silently wrong answer (a wrong dq on a
real H100, when a ring step's kv ids were uploaded afresh every step).

Every test makes fresh arrays of a foreign framework, calls ringattn, drops
them, allocates new arrays of the same sizes with other contents (which
get the freed memory if ringattn let go too early) and only then reads the
result, against the float64 reference of ``ringattn.testing`` (max |got -
ref| <= 1e-4 * max(1, max |ref|), float32).  The frameworks:

* ``foreign-*`` (the emulated GPU): tests/foreign_arrays.py, a stand-in
  for PyTorch with its own stream (blocking, like PyTorch's default stream
  is ordered with the legacy default stream, or non-blocking, like a side
  stream) and its own allocator that reuses freed memory at once.  The
  tests run with the emulator's lazy streams (``_C.emu_lazy(True)``): work
  starts only when the host observes it, so ringattn's kernels run after
  the framework rewrote whatever memory it got back: an early release
  fails every time, not by luck;
* ``torch``: PyTorch CUDA tensors, wherever PyTorch sees a GPU (the
  failure's own setting; there it is a race, which the stress test repeats
  200 steps).

Also here: the outputs ringattn hands to a consumer (reused by ringattn
only behind the consumer's stream), arrays written in place and dropped at
once, the nccl backend's transfers (world size 1 in this process, Ulysses
on two ranks), no host synchronisation per call (the emulated runtime
counts them), and every borrowed array given back: after a synchronize,
and at exit.  (Ulysses reads its borrowed arrays with device copies into
its all-to-all buffers, which the stand-in NCCL starts at once, whatever
the lazy mode: an early release there is a race, not a certain failure;
test_device_copies_read_their_source_before_it_is_freed covers those
copies every time.)
"""
import ctypes
import gc
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

ra = pytest.importorskip("ringattn")
testing = pytest.importorskip("ringattn.testing")

pytestmark = pytest.mark.gpu

from gpu_arrays import CUDA, EMULATED, HAVE_TORCH, torch  # noqa: E402

if not CUDA:
    pytest.skip(f"no CUDA device: {ra.cuda_info()['reason']}", allow_module_level=True)

import foreign_arrays  # noqa: E402

TOL = 1e-4
HERE = os.path.dirname(os.path.abspath(__file__))


# ---- the frameworks ---------------------------------------------------------

class Foreign:
    """tests/foreign_arrays.py on the emulated GPU."""

    def __init__(self, blocking, device=0):
        self.fw = foreign_arrays.Framework(device, blocking)
        self.blocking, self.device = blocking, device

    def array(self, host, dtype="float32"):
        return self.fw.array(host, dtype)

    def ids(self, host):
        return self.fw.array(host)

    def full(self, shape, value, dtype="float32"):
        return self.fw.full(shape, value, dtype)

    def narrow(self, x, axis, start, stop):
        return x.narrow(axis, start, stop)

    def to_host(self, x):
        """float64 NumPy copy of `x`.  What ringattn wrote in place into a
        framework array: the default stream and blocking streams are
        ordered after it once ringattn let go; a non-blocking stream must
        wait for ringattn itself (here: a synchronize)."""
        if isinstance(x, ra.Buffer):
            return ra.to_device(x, "cpu").numpy().astype(np.float64)
        if not self.blocking:
            ra._C.cuda_synchronize(self.device)
        return self.fw.to_host(x).astype(np.float64)

    def take(self, x):
        """A ringattn result handed to this framework (DLPack, its stream)."""
        return self.fw.from_dlpack(x)

    def copy(self, x):
        return self.fw.copy(x)


class Torch:
    """PyTorch CUDA tensors on the current (default) stream."""

    blocking = True

    def __init__(self, device=0):
        self.device = device

    def array(self, host, dtype="float32"):
        x = torch.from_numpy(np.ascontiguousarray(host)).to(f"cuda:{self.device}")
        return x.to(getattr(torch, dtype))

    def ids(self, host):
        return torch.from_numpy(np.ascontiguousarray(host)).to(f"cuda:{self.device}")

    def full(self, shape, value, dtype="float32"):
        return torch.full(shape, value, dtype=getattr(torch, dtype),
                          device=f"cuda:{self.device}")

    def narrow(self, x, axis, start, stop):
        return x.narrow(axis, start, stop - start)

    def to_host(self, x):
        if isinstance(x, ra.Buffer):
            return ra.to_device(x, "cpu").numpy().astype(np.float64)
        return x.detach().to(torch.float64).cpu().numpy()

    def take(self, x):
        return torch.from_dlpack(x)

    def copy(self, x):
        return x.clone()


def _frameworks():
    out = []
    if EMULATED:
        out += [pytest.param(("foreign", True), id="foreign-blocking"),
                pytest.param(("foreign", False), id="foreign-nonblocking")]
    if HAVE_TORCH:
        out.append(pytest.param(("torch", True), id="torch"))
    return out or [pytest.param(None, marks=pytest.mark.skip(
        reason="needs the emulated GPU's stand-in or PyTorch with a GPU"))]


@pytest.fixture(params=_frameworks())
def fw(request):
    kind, blocking = request.param
    if kind == "torch":
        yield Torch()
        return
    was = ra._C.emu_lazy(True)
    try:
        yield Foreign(blocking)
    finally:
        ra._C.emu_lazy(was)
        ra._C.cuda_synchronize(0)


def overwrite(fw, like, seed=99):
    """New framework arrays shaped like the NumPy arrays `like` (integer
    ones: ids), other contents: they get the memory of the arrays just
    dropped if it was freed.  Keep them until the end of the test."""
    rng = np.random.default_rng(seed)
    return [fw.ids(rng.integers(50, 60, x.shape).astype(x.dtype)) if x.dtype.kind in "iu"
            else fw.array(rng.standard_normal(x.shape) * 100.0) for x in like]


def close(got, ref):
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isneginf(got), np.isneginf(ref)), "-inf pattern differs"
    err = np.abs(got[fin] - ref[fin]).max(initial=0.0)
    bound = TOL * max(1.0, np.abs(ref[fin]).max(initial=0.0))
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


def qkv(rng, B=1, Sq=40, Sk=40, H=2, Hkv=1, D=32):
    return (rng.standard_normal((B, Sq, H, D)), rng.standard_normal((B, Sk, Hkv, D)),
            rng.standard_normal((B, Sk, Hkv, D)))


def rounded(x):
    return x.astype(np.float32).astype(np.float64)


# ---- every entry point: borrowed arrays outlive the work on them -------------

def test_attention_reads_its_inputs_before_they_are_freed(fw):
    rng = np.random.default_rng(1)
    host = [rounded(x) for x in qkv(rng)]
    q, k, v = (fw.array(x) for x in host)
    out, lse = ra.attention(q, k, v, causal=True, return_lse=True)
    del q, k, v
    keep = overwrite(fw, host)
    ref_out, ref_lse = testing.ref_attention(*host, causal=True)
    close(fw.to_host(out), ref_out)
    close(fw.to_host(lse), ref_lse)
    del keep


def test_backward_reads_its_inputs_before_they_are_freed(fw):
    rng = np.random.default_rng(2)
    host = [rounded(x) for x in qkv(rng)]
    ref_out, ref_lse = testing.ref_attention(*host, causal=True)
    dout_h = rounded(rng.standard_normal(ref_out.shape))
    arrays = [fw.array(x) for x in (dout_h, *host, rounded(ref_out), ref_lse)]
    grads = ra.attention_backward(*arrays, causal=True)
    del arrays
    keep = overwrite(fw, (dout_h, *host, ref_out, ref_lse))
    refs = testing.ref_attention_backward(dout_h, *host, causal=True, out=rounded(ref_out))
    for got, ref in zip(grads, refs):
        close(fw.to_host(got), ref)
    del keep


@pytest.mark.parametrize("ids_dtype", ["int32", "int64"])
def test_document_ids_are_read_before_they_are_freed(fw, ids_dtype):
    # int32 ids are read in place, int64 ones converted by a kernel first
    rng = np.random.default_rng(3)
    host = [rounded(x) for x in qkv(rng, Sq=48, Sk=48)]
    ids = np.sort(rng.integers(0, 4, (1, 48)), axis=1).astype(ids_dtype)
    q, k, v = (fw.array(x) for x in host)
    out = ra.attention(q, k, v, causal=True, segment_ids=fw.ids(ids))
    keep = overwrite(fw, [ids])
    ref, _ = testing.ref_attention(*host, causal=True, segment_ids=ids)
    close(fw.to_host(out), ref)
    del keep


def ring_steps(fw, host, dout_h, q_ids, kv_ids, chunks, qpos0):
    """What a ring step does, chunk by chunk: ``_C.attn_fwd`` and
    ``_C.attn_bwd`` with position offsets, accumulating into float32 state
    and gradients of the framework; each call gets its kv chunk and its ids
    uploaded afresh and dropped after it (test_cuda.py's
    test_masked_ring_steps_accumulate, the failure on the H100)."""
    qh, kh, vh = host
    B, Sq, H, D = qh.shape
    q, dout = fw.array(qh), fw.array(dout_h)
    out = fw.full((B, Sq, H, D), 0.0)
    lse = fw.full((B, H, Sq), -np.inf)

    def step_args(lo, hi):
        k, v = fw.array(kh[:, lo:hi]), fw.array(vh[:, lo:hi])
        return k, v, dict(segment_ids=fw.ids(q_ids), kv_segment_ids=fw.ids(kv_ids[:, lo:hi]),
                          q_pos_offset=qpos0, k_pos_offset=lo)

    for lo, hi in chunks:
        k, v, kw = step_args(lo, hi)
        ra._C.attn_fwd(q, k, v, causal=True, out=out, lse=lse, accumulate=True, **kw)
    grads = [fw.full(x.shape, 0.0) for x in host]
    o = fw.array(fw.to_host(out))
    for lo, hi in chunks:
        k, v, kw = step_args(lo, hi)
        dk, dv = fw.narrow(grads[1], 1, lo, hi), fw.narrow(grads[2], 1, lo, hi)
        ra._C.attn_bwd(dout, q, k, v, o, lse, causal=True, dq=grads[0], dk=dk, dv=dv,
                       accumulate=True, **kw)
    return out, lse, grads


def ring_reference(host, dout_h, q_ids, kv_ids, qpos0):
    qh, kh, _ = host
    pos = dict(q_pos=np.arange(qh.shape[1]) + qpos0, k_pos=np.arange(kh.shape[1]),
               segment_ids=q_ids, kv_segment_ids=kv_ids)
    ref_out, ref_lse = testing.ref_attention(*host, causal=True, **pos)
    grads = testing.ref_attention_backward(dout_h, *host, causal=True,
                                           out=rounded(ref_out), **pos)
    return ref_out, ref_lse, grads


def documents(rng, B, n, count):
    return np.sort(rng.integers(0, count, (B, n)), axis=1).astype(np.int32)


def test_ring_steps_with_ids_uploaded_every_step(fw):
    rng = np.random.default_rng(4)
    host = [rounded(x) for x in qkv(rng, Sq=30, Sk=60)]
    dout_h = rounded(rng.standard_normal(host[0].shape))
    q_ids, kv_ids = documents(rng, 1, 30, 3), documents(rng, 1, 60, 3)
    chunks = ((0, 20), (20, 40), (40, 60))
    out, lse, grads = ring_steps(fw, host, dout_h, q_ids, kv_ids, chunks, qpos0=30)
    ref_out, ref_lse, ref_grads = ring_reference(host, dout_h, q_ids, kv_ids, 30)
    close(fw.to_host(out), ref_out)
    close(fw.to_host(lse), ref_lse)
    for got, ref in zip(grads, ref_grads):
        close(fw.to_host(got), ref)


def test_merge_reads_its_inputs_before_they_are_freed(fw):
    rng = np.random.default_rng(5)
    o1, o2 = (rounded(rng.standard_normal((1, 20, 2, 32))) for _ in range(2))
    l1, l2 = (rounded(rng.standard_normal((1, 2, 20))) for _ in range(2))
    arrays = [fw.array(x) for x in (o1, l1, o2, l2)]
    out, lse = ra.merge(*arrays)
    del arrays
    keep = overwrite(fw, (o1, l1, o2, l2))
    ref_lse = np.logaddexp(l1, l2)
    w1 = np.exp(l1 - ref_lse).transpose(0, 2, 1)[..., None]
    w2 = np.exp(l2 - ref_lse).transpose(0, 2, 1)[..., None]
    close(fw.to_host(out), w1 * o1 + w2 * o2)
    close(fw.to_host(lse), ref_lse)
    del keep


def test_device_copies_read_their_source_before_it_is_freed(fw):
    # to_device on the same device and astype are copies queued on
    # ringattn's stream, like a ring's Ulysses packing (Buffer.copy_)
    rng = np.random.default_rng(6)
    host = rounded(rng.standard_normal((3, 50, 7)))
    x = fw.array(host)
    same = ra.to_device(x, "cuda:0")
    wide = ra.from_dlpack(x).astype("float64")
    del x
    keep = overwrite(fw, [host])
    close(fw.to_host(same), host)
    close(fw.to_host(wide), host)
    del keep


def test_an_array_written_in_place_and_dropped_is_not_reused_under_the_write(fw):
    # out=/lse= and a copy_ target, dropped right after the call: the
    # memory they free must not take new contents before ringattn's writes
    rng = np.random.default_rng(7)
    host = [rounded(x) for x in qkv(rng)]
    q, k, v = (fw.array(x) for x in host)
    ra._C.attn_fwd(q, k, v, causal=True, out=fw.full(host[0].shape, 0.0),
                   lse=fw.full((1, 2, 40), 0.0))
    src = ra.to_device(np.ones((4, 100), np.float32), "cuda:0")
    ra.from_dlpack(fw.full((4, 100), 0.0)).copy_(src)
    fresh = [rounded(rng.standard_normal(s)) for s in (host[0].shape, (1, 2, 40), (4, 100))]
    keep = [fw.array(x) for x in fresh]
    ra._C.cuda_synchronize(0)          # every write ringattn queued is done
    for got, want in zip(keep, fresh):
        np.testing.assert_array_equal(fw.to_host(got), want)


def test_dilated_reads_borrowed_arrays_and_gives_them_back(fw):
    """Dilated attention on another library's arrays (its strided calls of
    the dense kernels and their scratch): the answer of the CPU kernels on
    the same values, and every borrowed array released once the stream
    work is done."""
    ra._C.cuda_release_all()           # what earlier tests left
    rng = np.random.default_rng(8)
    host = [rounded(x) for x in qkv(rng, Hkv=2)]
    q, k, v = (fw.array(x) for x in host)
    out, lse = ra.dilated_attention(q, k, v, [20, 8], [1, 2], causal=True,
                                    return_lse=True)
    want_out, want_lse = ra.dilated_attention(*host, [20, 8], [1, 2],
                                              causal=True, return_lse=True)
    del q, k, v
    got_out = ra.to_device(out, "cpu").numpy()
    got_lse = ra.to_device(lse, "cpu").numpy()
    np.testing.assert_allclose(got_out, want_out, rtol=0, atol=1e-4)
    np.testing.assert_allclose(got_lse, want_lse, rtol=0, atol=1e-4)
    ra._C.cuda_synchronize(0)
    assert ra._C.cuda_pending_releases() == 0


# ---- the nccl backend: transfers read and write borrowed arrays ----------

NCCL = ra.nccl_version() is not None
needs_nccl = pytest.mark.skipif(not NCCL, reason="NCCL cannot be loaded")


@pytest.fixture
def comm1():
    comm = ra.init(backend="nccl", rank=0, world_size=1, device=0)
    yield comm
    comm.close()


@needs_nccl
def test_nccl_transfers_of_borrowed_arrays(fw, comm1):
    # sendrecv and alltoall to self: device copies on the communicator's
    # stream, whose sources are freed right after and whose destinations
    # are read by the framework
    data = rounded(np.random.default_rng(13).standard_normal(300))
    recv, recvs = fw.full((300,), 0.0), [fw.full((300,), 0.0)]
    comm1.sendrecv(fw.array(data), 0, recv, 0)
    comm1.alltoall([fw.array(2 * data)], recvs)
    keep = overwrite(fw, [data, data])
    close(fw.to_host(recv), data)
    close(fw.to_host(recvs[0]), 2 * data)
    del keep


@needs_nccl
def test_ring_on_nccl_reads_borrowed_arrays_before_they_are_freed(fw, comm1):
    # (document ids would be read on the host, which waits for the device)
    rng = np.random.default_rng(14)
    host = [rounded(x) for x in qkv(rng, Sq=30, Sk=30)]
    dout_h = rounded(rng.standard_normal(host[0].shape))
    q, k, v, dout = (fw.array(x) for x in (*host, dout_h))
    out, lse = ra.ring_attention(q, k, v, comm1, causal=True, layout="zigzag",
                                 return_lse=True)
    grads = ra.ring_attention_backward(dout, q, k, v, out, lse, comm1, causal=True,
                                       layout="zigzag")
    del q, k, v, dout
    keep = overwrite(fw, (*host, dout_h))
    ref_out, ref_lse = testing.ref_attention(*host, causal=True)
    refs = testing.ref_attention_backward(dout_h, *host, causal=True, out=rounded(ref_out))
    close(fw.to_host(out), ref_out)
    for got, ref in zip(grads, refs):
        close(fw.to_host(got), ref)
    del keep


def ulysses_rank(comm, kind, host, dout_h):
    """One rank of a Ulysses ring (u = 2): its shards as fresh framework
    arrays, dropped after the calls and their memory handed out again."""
    dev = comm.device[1]
    if kind == "torch":
        fw = Torch(dev)
    else:
        ra._C.emu_lazy(True)
        fw = Foreign(blocking=False, device=dev)
    r, p = comm.rank, comm.size
    shards = [ra.shard(x, r, p, "zigzag", ulysses=2) for x in (*host, dout_h)]
    q, k, v, dout = (fw.array(x) for x in shards)
    out, lse = ra.ring_attention(q, k, v, comm, causal=True, layout="zigzag",
                                 return_lse=True, ulysses=2)
    grads = ra.ring_attention_backward(dout, q, k, v, out, lse, comm, causal=True,
                                       layout="zigzag", ulysses=2)
    del q, k, v, dout
    keep = overwrite(fw, shards)
    res = [fw.to_host(x) for x in (out, lse, *grads)]
    comm.barrier()
    del keep
    return res


@needs_nccl
@pytest.mark.parametrize("kind", ["foreign"] if EMULATED else ["torch"] if HAVE_TORCH else [])
def test_ulysses_all_to_all_reads_borrowed_arrays_before_they_are_freed(kind, monkeypatch):
    if ra.cuda_info()["devices"] < 2:
        version = ra.nccl_version()
        if version < (2, 30, 0):
            pytest.skip("2 ranks need 2 GPUs or NCCL >= 2.30")
        monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    rng = np.random.default_rng(15)
    host = [rounded(x) for x in qkv(rng, Sq=26, Sk=26, H=4, Hkv=2)]
    dout_h = rounded(rng.standard_normal(host[0].shape))
    results = ra.launch(ulysses_rank, 2, args=(kind, host, dout_h), backend="nccl",
                        timeout=300)
    got = [ra.unshard([res[i] for res in results], "zigzag", axis=2 if i == 1 else 1,
                      ulysses=2) for i in range(5)]
    ref_out, ref_lse = testing.ref_attention(*host, causal=True)
    refs = testing.ref_attention_backward(dout_h, *host, causal=True, out=rounded(ref_out))
    for g, ref in zip(got, (ref_out, ref_lse, *refs)):
        close(g, ref)


# ---- outputs handed to a consumer -----------------------------------------

def test_an_output_read_by_the_consumer_is_not_reused_under_the_read(fw):
    # the consumer imports out on its stream, queues a read of it and drops
    # it; ringattn's next output of that size (its allocator's same block)
    # must be written only after that read
    rng = np.random.default_rng(9)
    first = [fw.array(rounded(x)) for x in qkv(rng)]
    second = [fw.array(rounded(x)) for x in qkv(rng)]
    out = fw.take(ra.attention(*first))
    seen = fw.copy(out)
    syncs = ra._C.emu_host_syncs() if EMULATED else 0
    del out
    ra.attention(*second)
    if EMULATED and fw.blocking:
        # ordered behind the consumer's stream without waiting for it
        assert ra._C.emu_host_syncs() == syncs
    ref, _ = testing.ref_attention(*(fw.to_host(x) for x in first))
    close(fw.to_host(seen), ref)


def test_a_borrowed_array_handed_on_is_kept_for_its_next_consumer(fw):
    # a Buffer viewing the framework's array, exported to a second
    # consumer that reads it on its own stream: the producer gets the
    # memory back only behind that read too
    host = rounded(np.random.default_rng(16).standard_normal((5, 60)))
    other = Foreign(fw.blocking) if isinstance(fw, Foreign) else Torch()
    view = other.take(ra.from_dlpack(fw.array(host)))
    seen = other.copy(view)
    del view
    ra._C.cuda_synchronize(0)       # ringattn's own work on it is done
    keep = overwrite(fw, [host])
    close(other.to_host(seen), host)
    del keep


# ---- no host synchronisation per call -----------------------------------

@pytest.mark.skipif(not EMULATED, reason="the emulated runtime counts host waits")
def test_ring_steps_with_borrowed_arrays_never_wait_on_the_host():
    ra._C.cuda_release_all()           # what earlier tests left
    was = ra._C.emu_lazy(True)
    try:
        fw = Foreign(blocking=False)
        rng = np.random.default_rng(10)
        host = [rounded(x) for x in qkv(rng, Sq=24, Sk=24)]
        q, k, v, dout = (fw.array(x) for x in (*host, host[0]))
        out, lse = fw.full(host[0].shape, 0.0), fw.full((1, 2, 24), -np.inf)
        grads = [fw.full(x.shape, 0.0) for x in host]
        ids = fw.ids(documents(rng, 1, 24, 2))
        kw = dict(causal=True, accumulate=True, q_pos_offset=24, k_pos_offset=0,
                  segment_ids=ids, kv_segment_ids=ids)
        for _ in range(3):
            before = ra._C.emu_host_syncs()
            ra._C.attn_fwd(q, k, v, out=out, lse=lse, **kw)
            ra._C.attn_bwd(dout, q, k, v, q, lse, dq=grads[0], dk=grads[1], dv=grads[2], **kw)
            assert ra._C.emu_host_syncs() == before
            assert ra._C.cuda_pending_releases() > 0     # kept, not waited for
    finally:
        ra._C.emu_lazy(was)
    ra._C.cuda_synchronize(0)
    assert ra._C.cuda_pending_releases() == 0


# ---- the stress test ---------------------------------------------------------

def test_two_hundred_ring_steps_with_fresh_arrays_match_one_call(fw):
    # every step its own kv chunk and ids, uploaded and dropped: the
    # framework's allocator recycles them from step to step
    rng = np.random.default_rng(11)
    steps, Sq = 200, 8
    host = [rounded(x) for x in qkv(rng, Sq=Sq, Sk=2 * steps, H=1, D=16)]
    dout_h = rounded(rng.standard_normal(host[0].shape))
    q_ids, kv_ids = documents(rng, 1, Sq, 1), documents(rng, 1, 2 * steps, 1)
    kv_ids[:, ::7] = 1                                  # some keys masked out
    chunks = [(2 * i, 2 * i + 2) for i in range(steps)]
    # queries at the last Sq positions: one call's bottom-right alignment
    out, lse, grads = ring_steps(fw, host, dout_h, q_ids, kv_ids, chunks,
                                 qpos0=2 * steps - Sq)
    q, k, v = (fw.array(x) for x in host)
    ids = dict(segment_ids=fw.ids(q_ids), kv_segment_ids=fw.ids(kv_ids))
    one_out, one_lse = ra.attention(q, k, v, causal=True, return_lse=True, **ids)
    one = ra.attention_backward(fw.array(dout_h), q, k, v, fw.array(fw.to_host(one_out)),
                                one_lse, causal=True, **ids)
    close(fw.to_host(out), fw.to_host(one_out))
    close(fw.to_host(lse), fw.to_host(one_lse))
    for got, ref in zip(grads, one):
        close(fw.to_host(got), fw.to_host(ref))


# ---- every borrowed array is given back -----------------------------------

def test_a_tensor_without_deleter_is_not_read_after_it_is_let_go():
    # a producer without a deleter may reuse its DLPack struct as soon as
    # ringattn let go of it: the release must not read it again later
    from dlpack_producer import HandMadeProducer

    anchor = ra.to_device(np.zeros(4, np.float32), "cuda:0")
    p = HandMadeProducer((4,), device=(2, 0))
    p.managed.dl_tensor.data = anchor.data_ptr
    calls = []
    record = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda mt: calls.append(mt))
    was = ra._C.emu_lazy(True) if EMULATED else None
    try:
        ra.to_device(ra.from_dlpack(p), "cuda:0")     # queued work reads it
        p.managed.deleter = ctypes.cast(record, ctypes.c_void_p).value
        ra._C.cuda_synchronize(0)
    finally:
        if was is not None:
            ra._C.emu_lazy(was)
    assert calls == []


@pytest.mark.skipif(not EMULATED, reason="the stand-in framework's deleters")
def test_every_borrowed_array_is_given_back():
    ra._C.cuda_release_all()           # what earlier tests left
    was = ra._C.emu_lazy(True)
    try:
        fw = Foreign(blocking=False)
        rng = np.random.default_rng(12)
        arrays = [fw.array(x) for x in qkv(rng)]
        ra.attention(*arrays)
        del arrays
        assert foreign_arrays._EXPORTED        # still held: the kernel may not have run
        done = threading.Event()

        def other_thread():                    # releases polled from any thread
            ra.attention(*(fw.array(x) for x in qkv(rng)))
            done.set()

        t = threading.Thread(target=other_thread)
        t.start()
        t.join(60)
        assert done.is_set()
    finally:
        ra._C.emu_lazy(was)
    ra._C.cuda_synchronize(0)
    gc.collect()
    assert ra._C.cuda_pending_releases() == 0
    assert not foreign_arrays._EXPORTED


@pytest.mark.skipif(not EMULATED, reason="the stand-in framework's deleters")
def test_arrays_still_held_at_exit_are_given_back():
    # the last atexit function to run is the one registered first, before
    # ringattn was imported: by then ringattn's own exit hook has run
    script = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('left', len(sys.modules['foreign_arrays']._EXPORTED)))\n"
        "import numpy as np, ringattn as ra, foreign_arrays as fa\n"
        "ra._C.emu_lazy(True)\n"
        "fw = fa.Framework(0, False)\n"
        "q = fw.array(np.ones((1, 16, 1, 32)), 'float32')\n"
        "out = ra.attention(q, q, q)\n"
        "del q\n"
        "print('held', len(fa._EXPORTED), ra._C.cuda_pending_releases())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, env=env, cwd=HERE)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["held", "3", "3", "left", "0"], (r.stdout, r.stderr)
