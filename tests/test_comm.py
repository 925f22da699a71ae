"""Communicator tests inside one process: ra.init, the threads backend, the
host backend's handshake, argument checks and failure handling.
Multi-process behaviour is in test_launch.py."""

import pickle
import socket
import threading
import time

import numpy as np
import pytest

import ringattn as ra
from ringattn import _C
from ringattn.comm import _rendezvous_port, init
from ringattn.launch import LaunchError, free_port, launch

CommError = _C.CommError


def ring_exchange(comm, send, recv, step=-1, timeout=None):
    comm.sendrecv(send, (comm.rank + 1) % comm.size, recv,
                  (comm.rank - 1) % comm.size, step=step, timeout=timeout)


def run_threads(fn, size, timeout=20.0):
    """Run fn(comm) on `size` threads; return (results, errors) by rank."""
    group = _C.ThreadsGroup(size, timeout=timeout)
    results, errors = [None] * size, [None] * size

    def body(rank):
        comm = group.comm(rank)
        try:
            results[rank] = fn(comm)
        except BaseException as e:       # collected for the assertions
            errors[rank] = e
        finally:
            comm.close()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    assert not any(t.is_alive() for t in threads)
    return results, errors


# ---- init -----------------------------------------------------------------

@pytest.mark.timeout(30)
def test_init_without_environment_is_a_single_rank(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "RINGATTN_MASTER_PORT", "RINGATTN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with init() as comm:
        assert (comm.rank, comm.size, comm.backend) == (0, 1, "host")
        x = np.arange(7, dtype=np.float32)
        y = np.zeros_like(x)
        comm.sendrecv(x, 0, y, 0)
        np.testing.assert_array_equal(x, y)
        comm.barrier()
        assert comm.allgather(b"abc") == [b"abc"]
    assert comm.closed


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kwargs, needle", [
    (dict(rank=3, world_size=2), "rank must be in [0, 2), got 3"),
    (dict(rank=0, world_size=0), "world_size must be an integer >= 1"),
    (dict(backend="mpi"), "backend must be one of"),
    (dict(rank=1, world_size=2, master_port=None), "master_port is required"),
])
def test_init_rejects_bad_arguments(monkeypatch, kwargs, needle):
    for name in ("MASTER_PORT", "RINGATTN_MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError) as info:
        init(**kwargs)
    assert needle in str(info.value)


@pytest.mark.timeout(30)
def test_rendezvous_port_never_binds_the_launchers_port(monkeypatch):
    monkeypatch.delenv("RINGATTN_MASTER_PORT", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert _rendezvous_port(None) == 29501
    monkeypatch.setenv("RINGATTN_MASTER_PORT", "31000")
    assert _rendezvous_port(None) == 31000
    assert _rendezvous_port(1234) == 1234


# ---- threads backend ------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_threads_ring_odd_sizes_and_dtypes(size):
    def fn(comm):
        prev = (comm.rank - 1) % comm.size
        for step, (n, dtype) in enumerate([(1, np.float32), (7, np.float64),
                                           (113, np.int32), (1023, np.uint8),
                                           (0, np.float16)]):
            send = (np.arange(n) + 1000 * comm.rank).astype(dtype)
            recv = np.empty_like(send)
            ring_exchange(comm, send, recv, step=step)
            want = (np.arange(n) + 1000 * prev).astype(dtype)
            np.testing.assert_array_equal(recv, want)
        comm.barrier()
        return comm.allgather(str(comm.rank).encode())

    results = launch(fn, size, backend="threads", timeout=30)
    assert results == [[str(r).encode() for r in range(size)]] * size


@pytest.mark.timeout(60)
def test_threads_sendrecv_start_overlaps_work():
    def fn(comm):
        send = np.full(1 << 16, comm.rank, np.float64)
        recv = np.empty_like(send)
        req = comm.sendrecv_start(send, (comm.rank + 1) % comm.size, recv,
                                  (comm.rank - 1) % comm.size, step=0)
        busy = float(np.sum(np.sqrt(np.arange(100000.0))))   # the "kernel"
        req.wait()
        assert req.done and req.test()
        return recv[0], busy > 0, comm.stats()

    results = launch(fn, 3, backend="threads", timeout=30)
    for rank, (first, ok, stats) in enumerate(results):
        assert first == (rank - 1) % 3 and ok
        assert stats["bytes_sent"] == stats["bytes_received"] == 8 << 16
        assert stats["messages"] == 1


@pytest.mark.timeout(30)
def test_threads_size_mismatch_names_both_sizes():
    def fn(comm):
        n = 8 if comm.rank == 0 else 4
        send = np.zeros(4, np.float32)
        recv = np.zeros(n, np.float32)
        ring_exchange(comm, send, recv, step=2)

    _, errors = run_threads(fn, 2)
    assert all(isinstance(e, CommError) for e in errors)
    msg = str(errors[0])
    assert "size mismatch" in msg and "16 bytes" in msg and "32 bytes" in msg
    assert msg.startswith("rank 0: sendrecv step 2:")


@pytest.mark.timeout(30)
def test_threads_stuck_peer_times_out():
    def fn(comm):
        if comm.rank == 1:
            time.sleep(1.5)
            return None
        start = time.monotonic()
        with pytest.raises(CommError) as info:
            ring_exchange(comm, np.zeros(3), np.zeros(3), step=5, timeout=0.5)
        return str(info.value), time.monotonic() - start

    results, errors = run_threads(fn, 2)
    assert errors == [None, None]
    msg, took = results[0]
    assert "timed out after 0.5 s waiting for rank 1" in msg
    assert took < 1.4


@pytest.mark.timeout(30)
def test_abort_fails_waiters_and_later_calls_at_once():
    group = _C.ThreadsGroup(2, timeout=60)
    c0, c1 = group.comm(0), group.comm(1)
    caught = []

    def waiter():
        try:
            c0.sendrecv(None, None, np.zeros(4), 1)
        except CommError as e:
            caught.append((str(e), time.monotonic()))

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    start = time.monotonic()
    c1.abort("the user gave up")
    t.join(5)
    assert caught and caught[0][1] - start < 2.0
    assert "peer rank 1 failed" in caught[0][0]
    assert "the user gave up" in caught[0][0]
    before = time.monotonic()
    with pytest.raises(CommError, match="failed state"):
        c1.barrier()
    with pytest.raises(CommError, match="failed state"):
        c0.sendrecv(np.zeros(1), 1, None, None)
    assert time.monotonic() - before < 0.5
    c0.close()
    c1.close()
    c1.close()                            # idempotent
    with pytest.raises(CommError, match="closed"):
        c1.barrier()


@pytest.mark.timeout(30)
def test_group_abort_wakes_every_rank():
    def fn(comm):
        if comm.rank == 2:
            raise ValueError("boom on rank 2")
        ring_exchange(comm, np.zeros(5), np.zeros(5), step=0)

    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(fn, 3, backend="threads", timeout=20)
    assert time.monotonic() - start < 5
    err = info.value
    assert err.rank == 2 and "boom on rank 2" in str(err)
    assert isinstance(err.__cause__, ValueError)
    others = {f["rank"]: f for f in err.failures if f["rank"] != 2}
    assert all(f["exc_type"] == "CommError" for f in others.values())


@pytest.mark.timeout(30)
def test_objects_wrapping_connections_refuse_pickling():
    group = _C.ThreadsGroup(1)
    comm = group.comm(0)
    req = comm.sendrecv_start(np.zeros(2), 0, np.zeros(2), 0)
    req.wait()
    for obj in (comm, req, group):
        with pytest.raises(TypeError):
            pickle.dumps(obj)
    comm.close()


@pytest.mark.timeout(30)
def test_argument_errors_name_the_argument():
    group = _C.ThreadsGroup(2)
    comm = group.comm(0)
    strided = np.zeros((4, 4))[:, ::2]
    with pytest.raises(ValueError, match="send must be contiguous"):
        comm.sendrecv(strided, 1, None, None)
    readonly = np.zeros(4)
    readonly.setflags(write=False)
    with pytest.raises(ValueError, match="recv must be writable"):
        comm.sendrecv(None, None, readonly, 1)
    with pytest.raises(ValueError, match=r"dst must be a rank in \[0, 2\), got 5"):
        comm.sendrecv(np.zeros(1), 5, None, None)
    with pytest.raises(ValueError, match="dst is None but send is given"):
        comm.sendrecv(np.zeros(1), None, None, None)
    with pytest.raises(ValueError, match="send to self"):
        comm.sendrecv(np.zeros(1), 0, np.zeros(1), 1)
    with pytest.raises(ValueError, match="at most"):
        comm.allgather(b"x" * ((1 << 20) + 1))
    with pytest.raises(TypeError):
        comm.sendrecv("not an array", 1, None, None)
    assert not comm.failed                # argument errors do not fail it
    comm.close()


# ---- host backend handshake (ranks as threads of this process) -------------

@pytest.mark.timeout(60)
def test_host_refuses_a_wrong_token_and_keeps_listening():
    port = free_port()
    out = {}

    def rank0():
        try:
            out[0] = _C.host_comm(0, 2, master_port=port, token="right",
                                  timeout=20)
        except BaseException as e:
            out[0] = e

    t0 = threading.Thread(target=rank0)
    t0.start()
    t_start = time.monotonic()
    with pytest.raises(CommError, match="closed the connection during the "
                                        "handshake .*RINGATTN_TOKEN"):
        _C.host_comm(1, 2, master_port=port, token="wrong", timeout=10)
    # a refusal is retried a few times (a flooded listener drops pending
    # handshakes), not until the deadline
    assert time.monotonic() - t_start < 5
    good = _C.host_comm(1, 2, master_port=port, token="right", timeout=20)
    t0.join(30)
    c0 = out[0]
    assert isinstance(c0, ra.Comm if hasattr(ra, "Comm") else _C.Comm)

    def rank0_ring():
        ring_exchange(c0, np.full(9, 0.0), recv0, step=1)

    recv0, recv1 = np.empty(9), np.empty(9)
    t = threading.Thread(target=rank0_ring)
    t.start()
    ring_exchange(good, np.full(9, 1.0), recv1, step=1)
    t.join(10)
    assert recv0[0] == 1.0 and recv1[0] == 0.0
    c0.close()
    good.close()


@pytest.mark.timeout(60)
def test_host_large_buffers_in_both_directions():
    port = free_port()
    n = 16 << 20                           # 128 MiB of float64 each way
    comms = [None, None]

    def join(rank):
        comms[rank] = _C.host_comm(rank, 2, master_port=port, token="t",
                                   timeout=30)

    ts = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(40)
    bufs = [(np.full(n, r, np.float64), np.empty(n)) for r in range(2)]
    reqs = [comms[r].sendrecv_start(bufs[r][0], 1 - r, bufs[r][1], 1 - r)
            for r in range(2)]
    for r in range(2):
        reqs[r].wait()
        assert bufs[r][1][0] == 1 - r and bufs[r][1][-1] == 1 - r
    assert comms[0].stats()["bytes_received"] == 8 * n
    for c in comms:
        c.close()


def _host_pair(timeout):
    port = free_port()
    comms = [None, None]

    def join(rank):
        comms[rank] = _C.host_comm(rank, 2, master_port=port, token="t",
                                   timeout=timeout)

    ts = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout + 10)
    assert comms[0] is not None and comms[1] is not None
    return comms


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [4096, 1 << 17])
def test_host_a_rank_that_closed_first_still_delivers_its_last_frame(n):
    """Rank 0 sends its last frame and closes before rank 1 posts the
    receive; meanwhile rank 1 leaves a split, whose CLOSE notice reaches
    rank 0 while (32 KiB) or before (1 MiB: the frame is still in rank 0's
    kernel queue) rank 0's socket closes.  Rank 1 still receives the whole
    frame: the closing rank waits for its bytes to be taken and drops what
    arrives meanwhile, and a parked frame outlives its sender's reset."""
    c0, c1 = _host_pair(timeout=20)
    subs = [None, None]

    def split(rank):
        subs[rank] = (c0, c1)[rank].split(0, rank)

    ts = [threading.Thread(target=split, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    data = np.arange(n, dtype=np.float64)
    req = c0.sendrecv_start(data, 1, None, None)   # parked at rank 1
    closed_after = []

    def finish():
        req.wait()
        t0 = time.monotonic()
        c0.close()
        closed_after.append(time.monotonic() - t0)

    closer = threading.Thread(target=finish)
    closer.start()
    time.sleep(0.5)
    subs[1].close()                  # a CLOSE notice for rank 0
    time.sleep(0.2)
    out = np.empty(n)
    c1.sendrecv(None, None, out, 0)
    closer.join(30)
    assert not closer.is_alive() and closed_after[0] < 10
    np.testing.assert_array_equal(out, data)
    # rank 0 is gone: a send to it fails, naming it, and close is prompt
    with pytest.raises(CommError, match="peer rank 0 closed the connection"):
        c1.sendrecv(np.ones(2), 0, None, None)
    t0 = time.monotonic()
    c1.close()
    assert time.monotonic() - t0 < 2


@pytest.mark.timeout(60)
def test_host_close_waits_for_a_live_peer_a_bounded_time():
    """A peer that never takes rank 0's last frame holds rank 0's close()
    for the communicator's timeout (here 2 s) at most."""
    c0, c1 = _host_pair(timeout=2)
    # 1 MiB, never received: its tail stays in rank 0's kernel queue (or the
    # send is still in flight, and close() ends it at once)
    c0.sendrecv_start(np.zeros(1 << 17), 1, None, None)
    time.sleep(0.3)
    t0 = time.monotonic()
    c0.close()
    took = time.monotonic() - t0
    assert took < 6, took
    c1.close()


def _join_host_ranks(size, port, timeout=30):
    """Join `size` host ranks as threads; returns (comms, errors)."""
    comms, errors = [None] * size, [None] * size

    def join(rank):
        try:
            comms[rank] = _C.host_comm(rank, size, master_port=port,
                                       token="t", timeout=timeout)
        except BaseException as e:
            errors[rank] = e

    threads = [threading.Thread(target=join, args=(r,)) for r in range(size)]
    return threads, comms, errors


@pytest.mark.timeout(90)
@pytest.mark.parametrize("idle", [4, 80])
def test_idle_connections_do_not_delay_a_join(idle):
    """Connections to the rendezvous that never speak (more than the
    pending slots, too) hold nobody up: the handshakes run concurrently."""
    port = free_port()
    threads, comms, errors = _join_host_ranks(3, port)
    threads[0].start()
    idlers = []
    deadline = time.monotonic() + 10
    while len(idlers) < idle and time.monotonic() < deadline:
        try:
            idlers.append(socket.create_connection(("127.0.0.1", port),
                                                   timeout=5))
        except OSError:
            time.sleep(0.02)          # rank 0 not listening yet
    assert len(idlers) == idle
    start = time.monotonic()
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(60)
    took = time.monotonic() - start
    for s in idlers:
        s.close()
    assert errors == [None] * 3, errors
    for c in comms:
        c.close()
    assert took < 3.0, f"the join took {took:.1f} s"
