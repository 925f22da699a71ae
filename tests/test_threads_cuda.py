"""Thread ranks on CUDA devices: ``ThreadsGroup(size, devices=[...])``.

Every test carries the ``gpu`` marker (on the emulated GPU the checker is
on: a report fails the test).  The ranks are threads of this process
(``ra.launch(..., backend="threads", devices=...)``), each on its CUDA
device: 2 and 4 ranks on one device (device copies) and on two devices
(peer copies; the emulated GPU has two).  Arrays are ringattn's own
``ra.to_device`` buffers.

* the ring (forward and backward, contiguous and zigzag, causal and not)
  Ulysses (u = 2, hybrid with p = 4) and the dilated ring (branches inside
  a shard and across shards; contiguous, zigzag and striped) against the
  float64 reference;
* the communicator itself: sendrecv, alltoall (in place too) and split on
  device memory; host memory refused by name; bad devices refused before
  any work;
* failures: a rank that raises mid-ring gives the others a CommError naming
  it, and a rank that stalls gives a CommError at the deadline;
* examples/ring_threads_gpu.py at a small size prints PASS (and FAIL when
  its answer is made 1 % wrong).

Tolerance: max |got - ref| <= 1e-4 * max(1, max |ref|) in float32 (the GPU
kernels' accuracy, as in test_cuda.py and test_nccl.py).
"""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import ringattn as ra
from ringattn.launch import LaunchError
from ringattn.testing import (np_dtype, random_qkv, ref_attention,
                              ref_attention_backward, ref_dilated_attention,
                              ref_dilated_attention_backward)

from gpu_arrays import emu_subset

pytestmark = pytest.mark.gpu

if not ra.cuda_available():
    pytest.skip(f"no CUDA device: {ra.cuda_info()['reason']}",
                allow_module_level=True)

NDEV = ra.cuda_info()["devices"]
TOL = 1e-4
TIMEOUT = 120
# (ranks, devices used): one device shared, and two (ranks alternate)
GRID = [(2, 1), (4, 1), (2, 2), (4, 2)]


def devices_for(p, ndev):
    if ndev > NDEV:
        pytest.skip(f"needs {ndev} CUDA devices, {NDEV} here")
    return [r % ndev for r in range(p)]


def host(x):
    """A device array on the host as NumPy (bfloat16 widened to float32)."""
    x = ra.to_device(x, "cpu").numpy()
    return x.astype(np.float32) if x.dtype == np_dtype("bfloat16") else x


def assert_close(name, got, ref):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != {ref.shape}"
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(got[~fin], ref[~fin],
                                  err_msg=f"{name}: non-finite entries")
    err = np.abs(got[fin] - ref[fin]).max(initial=0.0)
    bound = TOL * max(1.0, np.abs(ref[fin]).max(initial=0.0))
    assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e}"


def problem(seed, n, H=4, H_kv=2, D=32):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 1, n, n, H, H_kv, D, "float32")
    dout = rng.standard_normal(q.shape).astype(np.float32)
    return q, k, v, dout


def reference(q, k, v, dout, causal):
    pos = np.arange(q.shape[1])
    out, lse = ref_attention(q, k, v, causal=causal, q_pos=pos, k_pos=pos)
    grads = ref_attention_backward(dout, q, k, v, causal=causal, q_pos=pos,
                                   k_pos=pos)
    return (out, lse) + tuple(grads)


def gather(per_rank, layout, u=1):
    return [ra.unshard([res[i] for res in per_rank], layout,
                       axis=2 if i == 1 else 1, ulysses=u) for i in range(5)]


# ---- rank bodies --------------------------------------------------------------

def ring_rank(comm, q, k, v, dout, cases, u=1):
    """(out, lse, dq, dk, dv) on the host for each (layout, causal)."""
    r, p, dev = comm.rank, comm.size, comm.device
    results = {}
    for layout, causal in cases:
        qs, ks, vs, ds = (ra.to_device(ra.shard(x, r, p, layout, ulysses=u),
                                       dev) for x in (q, k, v, dout))
        assert qs.device == dev
        out, lse = ra.ring_attention(qs, ks, vs, comm, causal=causal,
                                     layout=layout, return_lse=True,
                                     ulysses=u)
        grads = ra.ring_attention_backward(ds, qs, ks, vs, out, lse, comm,
                                           causal=causal, layout=layout,
                                           ulysses=u)
        results[layout, causal] = tuple(host(x) for x in (out, lse) + grads)
    comm.barrier()
    return results


CASES = [("contiguous", False), ("zigzag", True)]


@pytest.mark.parametrize("p,ndev", GRID)
def test_ring_on_devices_matches_reference(p, ndev):
    devices = devices_for(p, ndev)
    q, k, v, dout = problem(p, 37 + 4 * p)
    res = ra.launch(ring_rank, p, args=(q, k, v, dout, CASES),
                    backend="threads", devices=devices, timeout=TIMEOUT)
    for layout, causal in CASES:
        got = gather([x[layout, causal] for x in res], layout)
        for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got,
                              reference(q, k, v, dout, causal)):
            assert_close(f"{name} [{layout}, causal={causal}]", g, e)


@pytest.mark.parametrize("p,ndev", [(2, 1), (4, 2)])
def test_ulysses_on_devices_matches_reference(p, ndev):
    """u = 2: pure Ulysses on 2 ranks, hybrid (2 groups of 2) on 4."""
    devices = devices_for(p, ndev)
    q, k, v, dout = problem(10 + p, 29 + 4 * p)
    cases = [("zigzag", True)]
    res = ra.launch(ring_rank, p, args=(q, k, v, dout, cases, 2),
                    backend="threads", devices=devices, timeout=TIMEOUT)
    got = gather([x["zigzag", True] for x in res], "zigzag", u=2)
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got,
                          reference(q, k, v, dout, True)):
        assert_close(f"{name} [ulysses=2]", g, e)


def dilated_rank(comm, q, k, v, dout, segs, rates, cases):
    """(out, lse, dq, dk, dv) of the dilated ring on the host, per case."""
    r, p, dev = comm.rank, comm.size, comm.device
    results = {}
    for layout, causal in cases:
        qs, ks, vs, ds = (ra.to_device(ra.shard(x, r, p, layout), dev)
                          for x in (q, k, v, dout))
        out, lse = ra.ring_dilated_attention(qs, ks, vs, comm, segs, rates,
                                             causal=causal, layout=layout,
                                             return_lse=True)
        grads = ra.ring_dilated_attention_backward(ds, qs, ks, vs, out, lse,
                                                   comm, segs, rates,
                                                   causal=causal,
                                                   layout=layout)
        assert out.device == dev and all(g.device == dev for g in grads)
        results[layout, causal] = tuple(host(x) for x in (out, lse) + grads)
    comm.barrier()
    return results


DILATED_CASES = [("contiguous", False), ("zigzag", True), ("striped", True)]


@pytest.mark.parametrize("p,ndev", GRID)
def test_dilated_ring_on_devices_matches_reference(p, ndev):
    """Branches inside a shard and across shards (rows exchanged, their
    gradients sent back), on device memory: against the float64
    reference."""
    devices = devices_for(p, ndev)
    segs, rates = [8, 32], [1, 2]
    q, k, v, dout = problem(30 + p, 41 + 4 * p)
    res = ra.launch(dilated_rank, p,
                    args=(q, k, v, dout, segs, rates, DILATED_CASES),
                    backend="threads", devices=devices, timeout=TIMEOUT)
    for layout, causal in DILATED_CASES:
        got = gather([x[layout, causal] for x in res], layout)
        out, lse = ref_dilated_attention(q, k, v, segs, rates, causal=causal)
        grads = ref_dilated_attention_backward(dout, q, k, v, segs, rates,
                                               causal=causal)
        for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got,
                              (out, lse) + tuple(grads)):
            assert_close(f"{name} [dilated, {layout}, causal={causal}]", g, e)


# ---- p = 2, 4, 8 on one GPU, masks, Ulysses: against one rank ------------------
# (the GPU kit's threadring stage; the emulated GPU runs the p = 2 and p = 4
# points, a real GPU all of them at a larger n in bfloat16)

MASKS = {"none": {}, "window+softcap": dict(window=(40, 0), softcap=5.0),
         "docs": dict(docs=True)}
ONE_GPU_GRID = [
    pytest.param(p, u, mask, marks=[] if p < 8 else emu_subset("p = 8"))
    for p in (2, 4, 8) for u in (1, 2) for mask in MASKS
    if not (u == 2 and mask != "none")]


def mask_kwargs(mask, n):
    kw = {key: val for key, val in MASKS[mask].items() if key != "docs"}
    if MASKS[mask].get("docs"):
        cuts = np.sort(np.random.default_rng(5).choice(np.arange(1, n), 4,
                                                       replace=False))
        kw["segment_ids"] = ra.segment_ids([0, *map(int, cuts), n], n)
    return kw


def masked_rank(comm, q, k, v, dout, mask, u):
    r, p, dev = comm.rank, comm.size, comm.device
    kw = mask_kwargs(mask, q.shape[1])
    if "segment_ids" in kw:
        kw["segment_ids"] = ra.to_device(
            ra.shard(kw["segment_ids"], r, p, "zigzag", ulysses=u), dev)
    qs, ks, vs, ds = (ra.to_device(ra.shard(x, r, p, "zigzag", ulysses=u),
                                   dev) for x in (q, k, v, dout))
    out, lse = ra.ring_attention(qs, ks, vs, comm, causal=True,
                                 layout="zigzag", return_lse=True, ulysses=u,
                                 **kw)
    grads = ra.ring_attention_backward(ds, qs, ks, vs, out, lse, comm,
                                       causal=True, layout="zigzag",
                                       ulysses=u, **kw)
    res = tuple(host(x) for x in (out, lse) + tuple(grads))
    comm.barrier()
    return res


@pytest.mark.parametrize("p,u,mask", ONE_GPU_GRID)
def test_thread_ring_on_one_gpu_matches_one_rank(p, u, mask):
    """p ranks sharing GPU 0 against ra.attention on it alone (same kernels,
    same dtype): float32 on the emulated GPU (n = 96), bfloat16 on a real one
    (n = 8192, H 8, H_kv 2, D 128; tolerance 2e-2 of the largest value)."""
    real = not ra.cuda_info().get("emulated")
    n, D = (8192, 128) if real else (96, 32)
    dtype, tol = ("bfloat16", 2e-2) if real else ("float32", TOL)
    q, k, v, dout = problem(p + 7 * u, n, H=8 if real else 4, D=D)
    if real:
        q, k, v, dout = (x.astype(np_dtype(dtype)) for x in (q, k, v, dout))
    res = ra.launch(masked_rank, p, args=(q, k, v, dout, mask, u),
                    backend="threads", devices=[0] * p, timeout=TIMEOUT)
    got = gather(res, "zigzag", u=u)
    kw = mask_kwargs(mask, n)
    if "segment_ids" in kw:
        kw["segment_ids"] = ra.to_device(kw["segment_ids"], "cuda:0")
    qs, ks, vs, ds = (ra.to_device(x, "cuda:0") for x in (q, k, v, dout))
    out, lse = ra.attention(qs, ks, vs, causal=True, return_lse=True, **kw)
    grads = ra.attention_backward(ds, qs, ks, vs, out, lse, causal=True, **kw)
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got,
                          (out, lse) + tuple(grads)):
        e = host(e).astype(np.float64)
        g = np.asarray(g, np.float64)
        fin = np.isfinite(e)
        np.testing.assert_array_equal(g[~fin], e[~fin],
                                      err_msg=f"{name}: non-finite entries")
        err = np.abs(g[fin] - e[fin]).max(initial=0.0)
        bound = tol * max(1.0, np.abs(e[fin]).max(initial=0.0))
        assert err <= bound, (f"{name} [p={p}, u={u}, {mask}]: {err:.3e} > "
                              f"{bound:.3e}")


# ---- the communicator -----------------------------------------------------------

def exchange_rank(comm):
    """sendrecv around the ring, alltoall in place on one buffer, and the
    same inside a split of the even and odd ranks; host values back."""
    r, p, dev = comm.rank, comm.size, comm.device
    send = ra.to_device(np.full(1000, r, np.float32), dev)
    recv = ra.to_device(np.zeros(1000, np.float32), dev)
    comm.sendrecv(send, (r + 1) % p, recv, (r - 1) % p, step=0)
    ring = host(recv)[[0, -1]].tolist()
    # in place: each send block overlaps two receive blocks (set aside on
    # the device first)
    buf = ra.to_device(1000.0 * r + np.arange(3 * p + 1, dtype=np.float64),
                       dev)
    comm.alltoall([buf.narrow(0, 3 * j, 3) for j in range(p)],
                  [buf.narrow(0, 3 * j + 1, 3) for j in range(p)])
    a2a = host(buf)[1:].tolist()
    sub = comm.split(r % 2)
    xs = [ra.to_device(np.full(2, 10 * r + j, np.float64), dev)
          for j in range(sub.size)]
    ys = [ra.to_device(np.zeros(2, np.float64), dev) for _ in range(sub.size)]
    sub.alltoall(xs, ys)
    split = [host(y)[0] for y in ys]
    sub.close()
    with pytest.raises(ValueError, match="must be CUDA device memory"):
        comm.sendrecv(np.zeros(4, np.float32), (r + 1) % p,
                      np.zeros(4, np.float32), (r - 1) % p)
    return ring, a2a, split


@pytest.mark.parametrize("p,ndev", [(2, 2), (4, 1)])
def test_sendrecv_alltoall_split_move_device_memory(p, ndev):
    res = ra.launch(exchange_rank, p, backend="threads",
                    devices=devices_for(p, ndev), timeout=TIMEOUT)
    for r, (ring, a2a, split) in enumerate(res):
        assert ring == [(r - 1) % p] * 2
        assert a2a == [1000.0 * j + 3 * r + i for j in range(p)
                       for i in range(3)]
        members = [m for m in range(p) if m % 2 == r % 2]
        me = members.index(r)
        assert split == [10.0 * m + me for m in members]


def test_group_devices_are_checked_before_any_work():
    g = ra.ThreadsGroup(2, devices=["cuda:0", ("cuda", NDEV - 1)])
    assert g.devices == (("cuda", 0), ("cuda", NDEV - 1))
    assert ra.ThreadsGroup(2).devices is None
    with pytest.raises(ValueError, match=r"one CUDA device per rank: "
                                         r"expected 3 entries, got 2"):
        ra.ThreadsGroup(3, devices=[0, 0])
    with pytest.raises(ValueError, match=r"devices\[1\] must be a CUDA "
                                         r"device in \[0, \d+\), got 99"):
        ra.ThreadsGroup(2, devices=[0, 99])
    with pytest.raises(ValueError, match=r"devices\[0\] must be a CUDA "
                                         r"device \(an int"):
        ra.ThreadsGroup(1, devices=["cpu"])
    with pytest.raises(ValueError, match="takes each rank's device from"):
        ra.init(backend="threads", group=g, rank=0, device="cuda:0")


# ---- failures -------------------------------------------------------------------

def raise_mid_ring(comm, q, k, v, dout):
    """Rank 1 raises before its second ring; the others must fail with a
    CommError naming it, long before their deadline."""
    for it in range(3):
        if it == 1 and comm.rank == 1:
            time.sleep(0.2)
            raise RuntimeError("rank 1 gives up")
        start = time.monotonic()
        try:
            ring_rank(comm, q, k, v, dout, [("zigzag", True)])
        except ra.CommError as e:
            raise ra.CommError(f"{e} [after {time.monotonic() - start:.2f} s]")
    return "finished"


def test_rank_that_raises_mid_ring_fails_the_others_by_name():
    q, k, v, dout = problem(3, 40)
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        ra.launch(raise_mid_ring, 3, args=(q, k, v, dout), backend="threads",
                  devices=devices_for(3, min(2, NDEV)), timeout=TIMEOUT)
    assert time.monotonic() - start < 60
    err = info.value
    assert err.rank == 1
    others = [f for f in err.failures if f["rank"] != 1]
    assert others, err.failures
    for f in others:
        assert f["exc_type"] == "CommError", f
        assert "rank 1" in f["message"], f["message"]


def test_rank_that_stalls_gives_a_timeout_naming_it():
    """Rank 1 stops answering; rank 0's transfer with a 2 s deadline raises
    CommError naming rank 1 and the step, within a few seconds."""
    group = ra.ThreadsGroup(2, devices=devices_for(2, min(2, NDEV)),
                            timeout=30)
    outcome = {}
    release = threading.Event()

    def rank0():
        comm = group.comm(0)
        send = ra.to_device(np.ones(4096, np.float32), comm.device)
        recv = ra.to_device(np.zeros(4096, np.float32), comm.device)
        comm.sendrecv(send, 1, recv, 1, step=0)
        start = time.monotonic()
        try:
            comm.sendrecv(send, 1, recv, 1, step=1, timeout=2)
            outcome["error"] = None
        except ra.CommError as e:
            outcome["error"] = str(e)
        outcome["elapsed"] = time.monotonic() - start
        release.set()
        comm.close()

    def rank1():
        comm = group.comm(1)
        send = ra.to_device(np.ones(4096, np.float32), comm.device)
        recv = ra.to_device(np.zeros(4096, np.float32), comm.device)
        comm.sendrecv(send, 0, recv, 0, step=0)
        release.wait(30)                    # stalls: never posts step 1
        comm.close()

    threads = [threading.Thread(target=f) for f in (rank0, rank1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcome["error"] is not None
    assert "timed out after 2.0 s waiting for rank 1" in outcome["error"]
    assert "step 1" in outcome["error"]
    assert outcome["elapsed"] < 10


# ---- examples/ring_threads_gpu.py at a small size ---------------------------------

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "examples", "ring_threads_gpu.py")
SMALL = ["--seq-len", "160", "--check", "32", "--heads", "2", "--kv-heads",
         "1", "--head-dim", "32"]
# the same with ra.unshard 1 % off: a wrong answer must print FAIL
BREAK_UNSHARD = """
import runpy, sys
import ringattn as ra
right = ra.unshard
ra.unshard = lambda *a, **k: right(*a, **k) * 1.01
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _run_example(*args):
    root = os.path.dirname(os.path.dirname(os.path.abspath(ra.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, *args], capture_output=True,
                          text=True, env=env, timeout=240, cwd=root)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_example_on_thread_ranks_passes_at_a_small_size(dtype):
    res = _run_example(EXAMPLE, *SMALL, "--dtype", dtype)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "PASS" in res.stdout and "4 thread ranks" in res.stdout, res.stdout
    assert "emu" not in res.stderr.lower(), res.stderr     # no checker report


def test_example_on_thread_ranks_fails_loudly_on_a_wrong_answer():
    res = _run_example("-c", BREAK_UNSHARD, EXAMPLE, *SMALL, "--dtype",
                       "float32")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "FAIL" in res.stdout and "PASS" not in res.stdout, res.stdout


# ---- ringattn bench --ring --gpu: its thread rows -----------------------------------

def test_ring_bench_thread_rows_run_without_nccl(monkeypatch, capsys):
    """bench --ring --gpu at a tiny size (H 2, D 32, n 64) with NCCL made
    unavailable: the NCCL rows say why they are skipped, the thread rows
    (p = 2, 4, 8) run, and the summary counts them."""
    import argparse

    from ringattn.bench import gpu_ring

    monkeypatch.setattr(gpu_ring, "H", 2)
    monkeypatch.setattr(gpu_ring, "D", 32)
    monkeypatch.setattr(ra, "nccl_version", lambda: None)

    def once(fn, repeat, warmup=1, sync=None):     # one timed call each
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        return time.perf_counter() - t0

    monkeypatch.setattr(gpu_ring, "median_time", once)
    status = gpu_ring.run(argparse.Namespace(quick=True, seq_len=64))
    out = capsys.readouterr().out
    assert status == 0, out
    rows = [line for line in out.splitlines() if line.startswith("| threads |")]
    assert len(rows) == 3 * 4, out               # p = 2, 4, 8; causal x pass
    assert out.count("| nccl |") == 4 and "NCCL cannot be loaded" in out
    assert "0 NCCL ring runs, 3 thread ring runs, n=64" in out


# ---- GPUs without peer access: copies staged through pinned host memory -------------

EMULATED = bool(ra.cuda_info().get("emulated"))


def test_staged_pairs_are_the_pairs_across_gpus_without_peer_access():
    g = ra.ThreadsGroup(3, devices=[0, min(1, NDEV - 1), 0])
    if not os.environ.get("RINGATTN_EMU_PEER") == "0":
        pytest.skip("the GPUs here may be peers: RINGATTN_EMU_PEER=0 runs this")
    assert g.staged == ([(0, 1), (1, 0), (1, 2), (2, 1)] if NDEV > 1 else [])
    assert ra.ThreadsGroup(2, devices=[0, 0]).staged == []


@pytest.mark.skipif(not EMULATED or NDEV < 2,
                    reason="the emulated GPU's RINGATTN_EMU_PEER=0 (2 devices)")
@pytest.mark.skipif(os.environ.get("RINGATTN_EMU_PEER") == "0",
                    reason="this is the run it starts")
def test_ring_ulysses_and_alltoall_through_pinned_host_memory():
    """The two-device tests (the ring, the dilated ring, Ulysses, the
    communicator) again in a fresh process whose emulated GPUs
    refuse peer access (copies go device -> pinned host -> device), with
    lazy streams (work runs only when the host looks: a missing event wait
    reads stale bytes)."""
    here = os.path.abspath(__file__)
    env = dict(os.environ, RINGATTN_EMU_PEER="0", RINGATTN_EMU_LAZY="1")
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-m", "gpu", here, "-k", "staged_pairs or (ring_on_devices and -2]) "
         "or ulysses_on_devices or (sendrecv_alltoall and 2-2)"],
        capture_output=True, text=True, env=env, timeout=300,
        cwd=os.path.dirname(here))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "8 passed" in res.stdout, res.stdout[-2000:]
