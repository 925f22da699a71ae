"""The 'nccl' backend: NCCL communicators moving CUDA memory.

Every test carries the ``gpu`` marker and skips unless ringattn has a usable
CUDA device and an NCCL library loads (``ra.nccl_version()``).  On the
emulated GPU (``RINGATTN_CUDA=emulate``) that is its stand-in NCCL
(ranks are processes on this machine, two emulated devices shared).  Arrays
move between host and device with PyTorch (CUDA) or CuPy where one is
importable, else with ringattn's own ``ra.to_device``.

* world size 1 runs in this process: the whole ring path (agreement, the
  double-buffered loop, dk/dv sent to self) on one GPU;
* 2-4 ranks run as processes (``ra.launch(..., backend="nccl")``), one per
  GPU, or several on one GPU where NCCL allows it (NCCL >= 2.30 with
  NCCL_MULTI_RANK_GPU_ENABLE=1);
* masks (windows, softcap, packed documents whose int64 ids are uploaded
  with ``ra.to_device``) at world size 1 and on 3 ranks;
* ``ringattn demo --backend nccl`` (what ``demo`` picks on a GPU machine;
  a shorter sequence on the emulated GPU);
* failures: a peer that never answers becomes CommError naming rank, peer,
  op and step within the timeout; a killed rank ends ``launch`` with
  LaunchError naming it, the other ranks fail with CommError within their
  deadline, and no process is left behind.

Tolerance (results vs the float64 reference on the host):
max |got - ref| <= tol * max(1, max |ref|), tol 1e-4 for float32 and 1e-9
for float64 (the GPU kernels' accuracy, as in test_cuda.py).
"""

import multiprocessing as mp
import os
import pickle
import signal
import time

import numpy as np
import pytest

import ringattn as ra
from ringattn.launch import LaunchError
from ringattn.testing import (np_dtype, random_qkv, ref_attention,
                              ref_attention_backward)

from gpu_arrays import EMULATED, no_emu_reports

pytestmark = pytest.mark.gpu

LAYOUTS = ("contiguous", "zigzag", "striped")
TOL = {"float32": 1e-4, "float64": 1e-9, "bfloat16": 3e-2}
LAUNCH_TIMEOUT = 120


def _array_lib():
    """'torch' or 'cupy' (whichever can reach the GPU), else 'ra'
    (ringattn's own ``ra.to_device``), or None without a CUDA device."""
    try:
        import torch

        if torch.cuda.is_available():
            return "torch"
    except ImportError:
        pass
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return "cupy"
    except Exception:  # noqa: BLE001 - ImportError or a CuPy without driver
        pass
    return "ra" if ra.cuda_available() else None


def _skip_reason():
    if not ra.cuda_available():
        return f"no CUDA device: {ra.cuda_info()['reason']}"
    if ra.nccl_version() is None:
        return "NCCL cannot be loaded (RINGATTN_NCCL_LIBRARY / libnccl.so.2)"
    return None


if _skip_reason() is not None:
    pytest.skip(_skip_reason(), allow_module_level=True)


# ---- host <-> device (module level: spawned ranks use them too) ------------

def to_device(a, device, dtype=None):
    """NumPy -> device array; dtype "bfloat16" rounds on the device (with
    ``ra.to_device``, which also holds CuPy's missing bfloat16: on the host,
    ml_dtypes)."""
    a = np.ascontiguousarray(a)
    if _array_lib() == "ra" or (dtype == "bfloat16" and _array_lib() == "cupy"):
        if dtype is not None:
            a = a.astype(np_dtype(dtype))
        return ra.to_device(a, f"cuda:{device}")
    if _array_lib() == "torch":
        import torch

        x = torch.from_numpy(a).to(f"cuda:{device}")
        return x if dtype is None else x.to(getattr(torch, dtype))
    import cupy

    with cupy.cuda.Device(device):
        return cupy.asarray(a)


def to_host(x):
    if isinstance(x, ra.Buffer):
        x = ra.to_device(x, "cpu").numpy()
        return x.astype(np.float32) if x.dtype == np_dtype("bfloat16") else x
    if _array_lib() == "torch":
        import torch

        x = x.detach()
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.cpu().numpy()
    import cupy

    return cupy.asnumpy(x)


def synchronize(device):
    if _array_lib() == "ra":
        ra._C.cuda_synchronize(device)
    elif _array_lib() == "torch":
        import torch

        torch.cuda.synchronize(device)
    else:
        import cupy

        with cupy.cuda.Device(device):
            cupy.cuda.runtime.deviceSynchronize()


def assert_gpu_close(name, got, ref, dtype):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != {ref.shape}"
    assert not np.isnan(got).any(), f"{name}: NaN in the result"
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(got[~fin], ref[~fin],
                                  err_msg=f"{name}: non-finite entries")
    err = np.abs(got[fin] - ref[fin]).max(initial=0.0)
    bound = TOL[dtype] * max(1.0, np.abs(ref[fin]).max(initial=0.0))
    assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e} [{dtype}]"


def reference(q, k, v, dout, causal):
    pos = np.arange(q.shape[1])
    out, lse = ref_attention(q, k, v, causal=causal, q_pos=pos, k_pos=pos)
    grads = ref_attention_backward(dout, q, k, v, causal=causal, q_pos=pos,
                                   k_pos=pos)
    return (out, lse) + tuple(grads)


def problem(seed, n, dtype):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 2, n, n, 4, 2, 32, dtype)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    return q, k, v, dout


# ---- rank bodies ------------------------------------------------------------

def ring_rank(comm, q, k, v, dout, layout, causal, timeout=None):
    """This rank's (out, lse, dq, dk, dv) as NumPy, computed on its GPU."""
    r, p = comm.rank, comm.size
    dev = comm.device[1]
    qs, ks, vs, ds = (to_device(ra.shard(x, r, p, layout), dev)
                      for x in (q, k, v, dout))
    out, lse = ra.ring_attention(qs, ks, vs, comm, causal=causal,
                                 layout=layout, return_lse=True,
                                 timeout=timeout)
    dq, dk, dv = ra.ring_attention_backward(ds, qs, ks, vs, out, lse, comm,
                                            causal=causal, layout=layout,
                                            timeout=timeout)
    res = tuple(to_host(x) for x in (out, lse, dq, dk, dv))
    comm.barrier()          # raises if the communicator failed meanwhile
    no_emu_reports()        # a rank's process: pytest's check cannot see it
    return res


MASKS = (dict(window=(17, 0)), dict(window=(9, 5), softcap=3.0),
         dict(docs=True), dict(docs=True, window=(30, 30)))


def documents(n, seed):
    """(1, n) int64 segment ids: 5 packed documents of random lengths."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, n), size=4, replace=False))
    return ra.segment_ids([0, *map(int, cuts), n], n).astype(np.int64)


def masked_kwargs(mask, n):
    kw = {key: val for key, val in mask.items() if key != "docs"}
    if mask.get("docs"):
        kw["segment_ids"] = np.repeat(documents(n, 8), 2, axis=0)
    return kw


def masked_ring_rank(comm, q, k, v, dout, layout, causal, mask):
    """ring_rank with masks; this rank's int64 segment ids are uploaded
    with ra.to_device (the ring reads them back, and uploads int32 ids)."""
    r, p = comm.rank, comm.size
    dev = comm.device
    kw = masked_kwargs(mask, q.shape[1])
    if "segment_ids" in kw:
        kw["segment_ids"] = ra.to_device(
            ra.shard(kw["segment_ids"], r, p, layout), dev)
    qs, ks, vs, ds = (ra.to_device(ra.shard(x, r, p, layout), dev)
                      for x in (q, k, v, dout))
    out, lse = ra.ring_attention(qs, ks, vs, comm, causal=causal,
                                 layout=layout, return_lse=True, **kw)
    grads = ra.ring_attention_backward(ds, qs, ks, vs, out, lse, comm,
                                       causal=causal, layout=layout, **kw)
    res = tuple(ra.to_device(x, "cpu").numpy()
                for x in (out, lse) + tuple(grads))
    comm.barrier()
    no_emu_reports()
    return res


def every_masked_ring_rank(comm, q, k, v, dout):
    return {(layout, causal, i): masked_ring_rank(comm, q, k, v, dout, layout,
                                                  causal, mask)
            for layout in LAYOUTS for causal in (False, True)
            for i, mask in enumerate(MASKS)}


def masked_reference(q, k, v, dout, causal, mask):
    n = q.shape[1]
    pos = np.arange(n)
    kw = masked_kwargs(mask, n)
    if "segment_ids" in kw:
        kw["kv_segment_ids"] = kw["segment_ids"]
    out, lse = ref_attention(q, k, v, causal=causal, q_pos=pos, k_pos=pos, **kw)
    grads = ref_attention_backward(dout, q, k, v, causal=causal, q_pos=pos,
                                   k_pos=pos, **kw)
    return (out, lse) + tuple(grads)


def every_ring_rank(comm, q, k, v, dout):
    """ring_rank for every layout and causal flag, in one launch (starting
    ranks and NCCL costs seconds; the cases share them)."""
    return {(layout, causal): ring_rank(comm, q, k, v, dout, layout, causal)
            for layout in LAYOUTS for causal in (False, True)}


def gather(per_rank, layout):
    """(out, lse, dq, dk, dv) of the whole sequence from per-rank shards."""
    gathered = []
    for i in range(5):
        axis = 2 if i == 1 else 1               # lse is (B, H, n_r)
        gathered.append(ra.unshard([res[i] for res in per_rank], layout,
                                   axis=axis))
    return gathered


def stall_peer(comm):
    """After one good exchange rank 1 stops answering: rank 0's next
    transfer becomes CommError (at start, wait, or the next call)."""
    dev = comm.device[1]
    send = to_device(np.ones(1 << 16, np.float32), dev)
    recv = to_device(np.zeros(1 << 16, np.float32), dev)
    peer = 1 - comm.rank
    comm.sendrecv(send, peer, recv, peer, step=0)   # connects the pair
    synchronize(dev)
    if comm.rank != 0:
        time.sleep(10)
        return None
    start = time.monotonic()
    try:
        req = comm.sendrecv_start(send, 1, recv, 1, step=7, timeout=3)
        req.wait()                      # orders the GPU; returns at once
        synchronize(dev)                # held until the watchdog aborts
        comm.barrier()
    except ra.CommError as e:
        return str(e), time.monotonic() - start, comm.failed
    return "no error", time.monotonic() - start, comm.failed


def die_in_ring(comm, q, k, v, dout, timeout):
    """Rank 1 is killed before the second ring; the others must raise
    CommError within `timeout` (well inside launch's grace period)."""
    for it in range(4):
        if it == 1 and comm.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            # the first ring also connects the ranks: no short deadline there
            ring_rank(comm, q, k, v, dout, "zigzag", True,
                      timeout=timeout if it >= 1 else None)
        except ra.CommError as e:
            raise ra.CommError(f"{e} [after {time.monotonic() - start:.2f} s]")
    return "finished"


def explicit_id_rank(host, uid):
    """An NCCL communicator from an explicit unique id (no host connection
    inside): ring exchange, then barrier/allgather staged through NCCL."""
    count = ra.cuda_info()["devices"]
    comm = ra.init(backend="nccl", rank=host.rank, world_size=host.size,
                   unique_id=uid, device=host.rank % count)
    try:
        dev = comm.device[1]
        p, r = comm.size, comm.rank
        send = to_device(np.full(1000, r, np.float64), dev)
        recv = to_device(np.zeros(1000), dev)
        comm.sendrecv(send, (r + 1) % p, recv, (r - 1) % p, step=0)
        got = to_host(recv)
        comm.barrier()
        gathered = comm.allgather(f"rank{r}".encode())
        no_emu_reports()
        return float(got[0]), float(got[-1]), gathered, comm.stats()
    finally:
        comm.close()


def _multi_rank_ok(p, monkeypatch):
    """Can p ranks run here?  Sets NCCL_MULTI_RANK_GPU_ENABLE when sharing."""
    if ra.cuda_info()["devices"] >= p:
        return True
    version = ra.nccl_version()
    if version is None or version < (2, 30, 0):
        return False
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    return True


# ---- world size 1: in this process ------------------------------------------

@pytest.fixture
def comm1():
    comm = ra.init(backend="nccl", rank=0, world_size=1, device=0)
    yield comm
    comm.close()


def test_version_and_unique_id():
    version = ra.nccl_version()
    assert isinstance(version, tuple) and version >= (2, 14, 0)
    a, b = ra.nccl_unique_id(), ra.nccl_unique_id()
    assert isinstance(a, bytes) and len(a) == 128 and a != b


@pytest.mark.skipif(not EMULATED, reason="the emulated GPU's stand-in NCCL")
def test_emulated_gpu_loads_its_stand_in_nccl():
    """On the emulated GPU the library after RINGATTN_NCCL_LIBRARY is the
    stand-in built next to ringattn._C (a real NCCL would want a GPU)."""
    path = ra.comm._pip_nccl_library()
    assert path is not None and os.path.basename(path).startswith("_emu_nccl"), path
    assert os.path.dirname(path) == os.path.dirname(os.path.abspath(ra._C.__file__))


def test_world_size_1_comm_basics(comm1):
    assert (comm1.backend, comm1.rank, comm1.size) == ("nccl", 0, 1)
    assert comm1.device == ("cuda", 0)
    with pytest.raises(TypeError, match="pickle"):
        pickle.dumps(comm1)
    x = to_device(np.arange(4099, dtype=np.float32), 0)
    y = to_device(np.zeros(4099, np.float32), 0)
    req = comm1.sendrecv_start(x, 0, y, 0, step=0)
    req.wait()
    np.testing.assert_array_equal(to_host(y), np.arange(4099,
                                                       dtype=np.float32))
    assert req.done
    comm1.barrier()
    assert comm1.allgather(b"me") == [b"me"]
    assert comm1.stats()["messages"] == 1


def test_host_memory_is_refused(comm1):
    with pytest.raises(ValueError, match="CUDA device"):
        comm1.sendrecv(np.zeros(4), 0, np.zeros(4), 0)


def test_auto_picks_nccl_for_a_cuda_device():
    with ra.init(rank=0, world_size=1, device="cuda:0") as comm:
        assert comm.backend == "nccl"
    with ra.init(rank=0, world_size=1) as comm:
        assert comm.backend == "host"


def test_abort_then_every_call_raises(comm1):
    x = to_device(np.ones(8, np.float32), 0)
    comm1.abort("stop here")
    assert comm1.failed
    with pytest.raises(ra.CommError, match="stop here"):
        comm1.sendrecv(x, 0, x, 0)
    with pytest.raises(ra.CommError):
        comm1.barrier()
    comm1.close()
    with pytest.raises(ra.CommError, match="closed"):
        comm1.sendrecv(x, 0, x, 0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_world_size_1_ring_matches_reference(comm1, layout, causal, dtype):
    q, k, v, dout = problem(1, 100, dtype)
    got = ring_rank(comm1, q, k, v, dout, layout, causal)
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got,
                          reference(q, k, v, dout, causal)):
        assert_gpu_close(name, g, e, dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_world_size_1_ring_bfloat16_on_tensor_cores(comm1, causal):
    # D = 64: the tensor-core kernels, continuing a float32 running state
    rng = np.random.default_rng(11)
    q, k, v, dout = (rng.standard_normal((2, 150, 4, 64)) for _ in range(4))
    dev = comm1.device[1]
    qs, ks, vs, ds = (to_device(x, dev, "bfloat16") for x in (q, k, v, dout))
    # the reference sees the rounded inputs
    q, k, v, dout = (to_host(x).astype(np.float64) for x in (qs, ks, vs, ds))
    out, lse = ra.ring_attention(qs, ks, vs, comm1, causal=causal,
                                 layout="zigzag", return_lse=True)
    grads = ra.ring_attention_backward(ds, qs, ks, vs, out, lse, comm1,
                                       causal=causal, layout="zigzag")
    got = [to_host(x) for x in (out, lse) + tuple(grads)]
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got,
                          reference(q, k, v, dout, causal)):
        assert_gpu_close(name, g, e, "bfloat16")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", range(len(MASKS)))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_world_size_1_ring_with_masks(comm1, layout, mask, causal):
    q, k, v, dout = problem(12, 113, "float32")
    got = masked_ring_rank(comm1, q, k, v, dout, layout, causal, MASKS[mask])
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got,
                          masked_reference(q, k, v, dout, causal, MASKS[mask])):
        assert_gpu_close(f"{name} {MASKS[mask]}", g, e, "float32")


# ---- several ranks: processes ----------------------------------------------

@pytest.mark.parametrize("p", [2, 3, 4])
def test_ring_matches_reference(p, monkeypatch):
    """Forward and backward vs float64 for every layout, causal and not."""
    if not _multi_rank_ok(p, monkeypatch):
        pytest.skip(f"{p} ranks need {p} GPUs or NCCL >= 2.30 (multi-rank "
                    f"per GPU)")
    q, k, v, dout = problem(p, 131, "float32")
    results = ra.launch(every_ring_rank, p, args=(q, k, v, dout),
                        backend="nccl", timeout=LAUNCH_TIMEOUT)
    for layout in LAYOUTS:
        for causal in (False, True):
            got = gather([res[(layout, causal)] for res in results], layout)
            for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got,
                                  reference(q, k, v, dout, causal)):
                assert_gpu_close(f"{name} [{layout}, causal={causal}]", g, e,
                                 "float32")


@pytest.mark.parametrize("p", [3])
def test_ring_with_masks_matches_reference(p, monkeypatch):
    """Windows, softcap and packed documents (ids travel with k/v, the hop
    plan skips ranks that cannot see a block) on the NCCL ring."""
    if not _multi_rank_ok(p, monkeypatch):
        pytest.skip(f"{p} ranks need {p} GPUs or NCCL >= 2.30")
    q, k, v, dout = problem(p + 20, 127, "float32")
    results = ra.launch(every_masked_ring_rank, p, args=(q, k, v, dout),
                        backend="nccl", timeout=LAUNCH_TIMEOUT)
    for layout in LAYOUTS:
        for causal in (False, True):
            for i, mask in enumerate(MASKS):
                got = gather([res[(layout, causal, i)] for res in results],
                             layout)
                ref = masked_reference(q, k, v, dout, causal, mask)
                for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got,
                                      ref):
                    assert_gpu_close(f"{name} [{layout}, causal={causal}, "
                                     f"{mask}]", g, e, "float32")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks, extra", [
    (1, ["--dtype", "bfloat16", "--head-dim", "128", "--docs", "3"]),
    (4, ["--window", "300", "--layout", "contiguous"]),
])
def test_demo_on_nccl(ranks, extra, monkeypatch):
    """``ringattn demo --backend nccl`` (what ``auto`` picks on a GPU
    machine) passes its own check against a single-GPU run."""
    import subprocess
    import sys

    from ringattn.demo import nccl_plan

    ok, why, _ = nccl_plan(ranks)
    if not ok:
        pytest.skip(why)
    # the emulated GPU runs the kernels on this machine's CPU: a shorter
    # sequence with fewer heads (the window still spans ranks)
    size = ["-n", "600", "--heads", "2"] if EMULATED else ["-n", "3000"]
    proc = subprocess.run(
        [sys.executable, "-m", "ringattn", "demo", *size, "-p",
         str(ranks), "--backend", "nccl", "--quiet", *extra],
        capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "PASS" in proc.stdout, out
    assert "nccl backend" in proc.stdout and "cuda:0" in proc.stdout, out


def test_explicit_unique_id_and_staged_collectives(monkeypatch):
    if not _multi_rank_ok(2, monkeypatch):
        pytest.skip("2 ranks need 2 GPUs or NCCL >= 2.30")
    uid = ra.nccl_unique_id()      # this process hosts NCCL's root
    res = ra.launch(explicit_id_rank, 2, args=(uid,), backend="host",
                    timeout=LAUNCH_TIMEOUT)
    for r, (first, last, gathered, stats) in enumerate(res):
        assert first == last == (r - 1) % 2
        assert gathered == [b"rank0", b"rank1"]
        assert stats["bytes_sent"] >= 8000


def test_silent_peer_becomes_comm_error(monkeypatch):
    if not _multi_rank_ok(2, monkeypatch):
        pytest.skip("2 ranks need 2 GPUs or NCCL >= 2.30")
    monkeypatch.setenv("RINGATTN_TIMEOUT", "20")
    res = ra.launch(stall_peer, 2, backend="nccl", timeout=LAUNCH_TIMEOUT)
    message, waited, failed = res[0]
    assert failed
    for part in ("rank 0", "rank 1", "sendrecv", "step 7", "timed out"):
        assert part in message, message
    assert waited < 15, f"the watchdog took {waited:.1f} s for a 3 s timeout"


def test_killed_rank_ends_launch(monkeypatch):
    if not _multi_rank_ok(3, monkeypatch):
        pytest.skip("3 ranks need 3 GPUs or NCCL >= 2.30")
    monkeypatch.setenv("RINGATTN_TIMEOUT", "20")
    q, k, v, dout = problem(5, 96, "float32")
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        ra.launch(die_in_ring, 3, args=(q, k, v, dout, 2.0), backend="nccl",
                  timeout=LAUNCH_TIMEOUT)
    assert info.value.rank == 1
    assert "SIGKILL" in str(info.value)
    others = [f for f in info.value.failures if f["rank"] != 1]
    assert len(others) == 2, info.value.failures
    for f in others:
        assert f["exc_type"] == "CommError", f
        waited = float(f["message"].rsplit("[after ", 1)[1].split(" s]")[0])
        assert waited < 2.0 + 1.0, f"rank {f['rank']} took {waited:.1f} s"
    assert time.monotonic() - start < 60
    assert mp.active_children() == []


# ---- sub-communicators, all-to-all and Ulysses on NCCL ----------------------
# (ringattn's own device arrays, ra.to_device: no framework needed)

def _host(x):
    return ra.to_device(x, "cpu").numpy()


def test_world_size_1_split_and_alltoall(comm1):
    """A split of one rank is a new NCCL communicator; the all-to-all's
    block to self is a device copy."""
    sub = comm1.split(0)
    assert (sub.backend, sub.rank, sub.size) == ("nccl", 0, 1)
    assert comm1.split(None) is None
    x = ra.to_device(np.arange(99, dtype=np.float32), comm1.device)
    y = ra.to_device(np.zeros(99, np.float32), comm1.device)
    sub.alltoall([x], [y])
    np.testing.assert_array_equal(_host(y), np.arange(99))
    comm1.close()
    assert sub.closed


def split_alltoall_rank(comm):
    """Halves of the world (fresh NCCL communicators from unique ids shared
    over the world), blocks of (sender, receiver)-dependent size, zero
    included, on the device."""
    half = comm.split(comm.rank // 2, key=-comm.rank)
    r, p, dev = half.rank, half.size, comm.device
    sends = [ra.to_device(np.arange((r + 2 * i) % 3, dtype=np.float64) +
                          10 * comm.rank, dev) for i in range(p)]
    recvs = [ra.to_device(np.zeros((j + 2 * r) % 3), dev) for j in range(p)]
    half.alltoall(sends, recvs)
    got = [_host(x).tolist() for x in recvs]
    world = [ra.to_device(np.full(2, float(comm.rank)), dev)
             for _ in range(comm.size)]
    back = [ra.to_device(np.zeros(2), dev) for _ in range(comm.size)]
    comm.alltoall(world, back)
    half.barrier()
    return (half.rank, half.size, got, [_host(x)[0] for x in back],
            half.allgather(bytes([comm.rank])))


@pytest.mark.parametrize("p", [2, 4])
def test_split_and_alltoall_across_ranks(p, monkeypatch):
    if not _multi_rank_ok(p, monkeypatch):
        pytest.skip(f"{p} ranks need {p} GPUs or NCCL >= 2.30")
    results = ra.launch(split_alltoall_rank, p, backend="nccl",
                        timeout=LAUNCH_TIMEOUT)
    for world_rank, (r, size, got, back, names) in enumerate(results):
        members = sorted(range(world_rank // 2 * 2,
                               min(p, world_rank // 2 * 2 + 2)),
                         key=lambda x: -x)
        assert (size, r) == (len(members), members.index(world_rank))
        assert names == [bytes([m]) for m in members]
        assert got == [(np.arange((j + 2 * r) % 3) + 10 * members[j]).tolist()
                       for j in range(size)]
        assert back == [float(i) for i in range(p)]


def in_place_rank(comm):
    """Device all-to-alls in place, as on the host backends: the same arrays
    both ways, and views of one buffer shifted by an element (each send
    block overlaps two receive blocks; they are set aside on the device
    first); overlapping receive blocks are a ValueError before anything
    moves; a NumPy integer is a color."""
    r, p, dev = comm.rank, comm.size, comm.device
    xs = [ra.to_device(np.full(3, 10.0 * r + j), dev) for j in range(p)]
    comm.alltoall(xs, xs)
    buf = ra.to_device(1000.0 * r + np.arange(3 * p + 1, dtype=np.float64),
                       dev)
    comm.alltoall([buf.narrow(0, 3 * j, 3) for j in range(p)],
                  [buf.narrow(0, 3 * j + 1, 3) for j in range(p)])
    shifted = _host(buf)
    x = ra.to_device(np.zeros(4), dev)
    try:
        comm.alltoall([ra.to_device(np.ones(4), dev)] * p, [x] * p)
        refused = "no error"
    except ValueError as err:
        refused = str(err)
    half = comm.split(np.int64(0), key=np.int32(comm.rank))
    return ([_host(y).tolist() for y in xs],
            [shifted[3 * j + 1:3 * j + 4].tolist() for j in range(p)],
            refused, (half.rank, half.size))


def _check_in_place(results):
    p = len(results)
    for r, (same, shifted, refused, split) in enumerate(results):
        assert same == [[10.0 * j + r] * 3 for j in range(p)]
        assert shifted == [(1000.0 * j + np.arange(3 * r, 3 * r + 3)).tolist()
                           for j in range(p)]
        if p > 1:
            assert refused == (f"rank {r}: alltoall: recvs[0] and recvs[1] "
                               f"overlap (each block is written by its own "
                               f"rank)"), refused
        assert split == (r, p)


def test_world_size_1_alltoall_in_place(comm1):
    _check_in_place([in_place_rank(comm1)])


@pytest.mark.parametrize("p", [2, 3])
def test_alltoall_in_place_across_ranks(p, monkeypatch):
    if not _multi_rank_ok(p, monkeypatch):
        pytest.skip(f"{p} ranks need {p} GPUs or NCCL >= 2.30")
    _check_in_place(ra.launch(in_place_rank, p, backend="nccl",
                              timeout=LAUNCH_TIMEOUT))


def split_racing_close_rank(comm, rounds):
    """Rank 0 splits a split while another of its threads closes it (the
    others just split): the split raises CommError or returns a closed
    communicator, never crashes (the Python side of the race is the
    backends' common code)."""
    import threading

    outcomes = []
    for i in range(rounds):
        kid = comm.split(0)
        if comm.rank == 0:
            box = {}

            def split():
                try:
                    box["kid"] = kid.split(0, timeout=20)
                except ra.CommError as err:
                    box["error"] = str(err)

            t = threading.Thread(target=split)
            t.start()
            time.sleep(0.002 * (i % 3))
            kid.close()
            t.join(30)
            assert not t.is_alive()
            outcomes.append("error" if "error" in box else
                            "closed" if box["kid"].closed else "open")
        else:
            try:
                kid.split(0, timeout=20)
            except ra.CommError:
                pass
            kid.close()
        comm.barrier(timeout=20)
    return outcomes


def test_split_racing_close_on_nccl(monkeypatch):
    if not _multi_rank_ok(2, monkeypatch):
        pytest.skip("2 ranks need 2 GPUs or NCCL >= 2.30")
    outcomes = ra.launch(split_racing_close_rank, 2, args=(6,),
                         backend="nccl", timeout=LAUNCH_TIMEOUT)[0]
    assert "open" not in outcomes, outcomes


def ulysses_rank(comm, q, k, v, dout, layout, causal, u):
    r, p, dev = comm.rank, comm.size, comm.device
    qs, ks, vs, ds = (ra.to_device(ra.shard(x, r, p, layout, ulysses=u), dev)
                      for x in (q, k, v, dout))
    out, lse = ra.ring_attention(qs, ks, vs, comm, causal=causal,
                                 layout=layout, return_lse=True, ulysses=u)
    grads = ra.ring_attention_backward(ds, qs, ks, vs, out, lse, comm,
                                       causal=causal, layout=layout,
                                       ulysses=u)
    res = tuple(_host(x) for x in (out, lse) + tuple(grads))
    comm.barrier()
    return res


def every_ulysses_rank(comm, q, k, v, dout, factorisations):
    return {(u, layout, causal): ulysses_rank(comm, q, k, v, dout, layout,
                                              causal, u)
            for u in factorisations for layout in LAYOUTS
            for causal in (False, True)}


@pytest.mark.parametrize("p,us", [(2, (2,)), (4, (2, 4))])
def test_ulysses_matches_reference(p, us, monkeypatch):
    """Hybrid and pure Ulysses on NCCL, every layout, causal and not, H_kv = 2
    (replicated for u = 4), odd n: forward and backward vs float64."""
    if not _multi_rank_ok(p, monkeypatch):
        pytest.skip(f"{p} ranks need {p} GPUs or NCCL >= 2.30")
    q, k, v, dout = problem(p + 40, 101, "float32")
    results = ra.launch(every_ulysses_rank, p, args=(q, k, v, dout, us),
                        backend="nccl", timeout=LAUNCH_TIMEOUT)
    for u in us:
        for layout in LAYOUTS:
            for causal in (False, True):
                per_rank = [res[(u, layout, causal)] for res in results]
                got = [ra.unshard([x[i] for x in per_rank], layout,
                                  axis=2 if i == 1 else 1, ulysses=u)
                       for i in range(5)]
                for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got,
                                      reference(q, k, v, dout, causal)):
                    assert_gpu_close(f"{name} [u={u}, {layout}, causal="
                                     f"{causal}]", g, e, "float32")


def die_in_ulysses(comm, q, k, v, dout):
    """Rank 1 is killed before the second call; the others raise CommError
    within the communicator's timeout (RINGATTN_TIMEOUT)."""
    for it in range(3):
        if it == 1 and comm.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            ulysses_rank(comm, q, k, v, dout, "zigzag", True, 2)
        except ra.CommError as e:
            raise ra.CommError(f"{e} [after {time.monotonic() - start:.2f} s]")
    return "finished"


def test_killed_rank_in_ulysses_ends_launch(monkeypatch):
    if not _multi_rank_ok(2, monkeypatch):
        pytest.skip("2 ranks need 2 GPUs or NCCL >= 2.30")
    monkeypatch.setenv("RINGATTN_TIMEOUT", "5")
    q, k, v, dout = problem(6, 64, "float32")
    with pytest.raises(LaunchError) as info:
        ra.launch(die_in_ulysses, 2, args=(q, k, v, dout),
                  backend="nccl", timeout=LAUNCH_TIMEOUT)
    assert info.value.rank == 1 and "SIGKILL" in str(info.value)
    (other,) = [f for f in info.value.failures if f["rank"] != 1]
    assert other["exc_type"] == "CommError", other
    waited = float(other["message"].rsplit("[after ", 1)[1].split(" s]")[0])
    assert waited < 5.0 + 5.0, other
    assert mp.active_children() == []
