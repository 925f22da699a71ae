"""Communicator collectives over groups of ranks: ``Comm.split`` and
``Comm.alltoall`` on the threads and host backends (the nccl ones are in
test_nccl.py): results, ordering, the contexts that keep a split's messages
apart from its parent's, argument checks before any communication, named
errors, deadlines and failures (a dead rank, a stuck peer, abort, close).
"""

import os
import re
import signal
import time

import numpy as np
import pytest

import ringattn as ra
from ringattn.launch import LaunchError, launch

CommError = ra.CommError
BACKENDS = ("threads", "host")


# ---- rank bodies (module level: they pickle for backend="host") -----------

def split_layout(comm):
    """(color, key) splits: rank % 2 by descending rank; None for rank 0;
    a split of the split."""
    r = comm.rank
    parity = comm.split(r % 2, key=-r)
    none = comm.split(None if r == 0 else 0)
    nested = parity.split(0, key=parity.rank) if parity.size > 1 else parity
    names = [int(x[0]) for x in parity.allgather(bytes([r]))]
    return (parity.rank, parity.size, names, parity.backend,
            none is None, None if none is None else (none.rank, none.size),
            nested.allgather(bytes([r])))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_split_groups_and_orders_ranks(backend):
    """Ranks of one color form a communicator ranked by (key, rank);
    color None joins none; splits of splits work."""
    results = launch(split_layout, 4, backend=backend, timeout=40)
    for r, (rank, size, names, name, alone, other, nested) in \
            enumerate(results):
        members = sorted((x for x in range(4) if x % 2 == r % 2),
                         key=lambda x: -x)
        assert (size, rank, names) == (2, members.index(r), members)
        assert name == backend
        assert alone == (r == 0) and other == (None if r == 0 else
                                               (r - 1, 3))
        assert nested == [bytes([x]) for x in members]


def interleaved(comm):
    """Parent and split used in turn, in the same order on every rank: the
    contexts keep the messages apart; sendrecv sizes differ per comm."""
    r, p = comm.rank, comm.size
    half = comm.split(r // 2)
    out = []
    for step in range(3):
        a, b = np.full(3, r, np.int64), np.zeros(3, np.int64)
        comm.sendrecv(a, (r + 1) % p, b, (r - 1) % p, step=step)
        c, d = np.full(5, 10 + r, np.int64), np.zeros(5, np.int64)
        half.sendrecv(c, (half.rank + 1) % half.size, d,
                      (half.rank - 1) % half.size, step=step)
        out.append((int(b[0]), int(d[0])))
    half.barrier()
    comm.barrier()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_split_and_parent_interleave(backend):
    results = launch(interleaved, 4, backend=backend, timeout=40)
    for r, out in enumerate(results):
        partner = (r // 2) * 2 + (1 - r % 2)
        assert out == [((r - 1) % 4, 10 + partner)] * 3


def crossed(comm):
    """Rank 0 sends on the split while rank 1 receives on the parent: no
    message matches a receive of another communicator, so both wait; the
    deadline's error says that the peer is in another communicator's
    operation."""
    half = comm.split(0)
    x, y = np.zeros(4), np.zeros(4)
    other = 1 - comm.rank
    try:
        if comm.rank == 0:
            half.sendrecv(x, other, y, other, step=0, timeout=1.5)
        else:
            comm.sendrecv(x, other, y, other, step=0, timeout=1.5)
    except CommError as err:
        return str(err)
    return "no error"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_messages_of_another_communicator_never_match(backend):
    results = launch(crossed, 2, backend=backend, timeout=40)
    assert all(m != "no error" for m in results), results
    assert any("timed out after 1.5 s waiting for rank" in m and
               "of another communicator" in m for m in results), results


def exchange_all(comm, split):
    """alltoall of blocks whose size depends on (sender, receiver), zero
    included, several dtypes; on the world or on halves."""
    c = comm.split(comm.rank // 2) if split else comm
    r, p = c.rank, c.size
    got = []
    for dtype in (np.float32, np.float64, np.int32, np.uint8):
        sends = [np.arange((r + 2 * i) % 4, dtype=dtype) + 10 * r
                 for i in range(p)]
        recvs = [np.zeros((j + 2 * r) % 4, dtype) for j in range(p)]
        c.alltoall(sends, recvs)
        got.append([x.tolist() for x in recvs])
    # None: no block that way (zero bytes on both sides)
    recvs = [np.zeros(2) if j != r else None for j in range(p)]
    c.alltoall([np.full(2, float(r)) if i != r else None for i in range(p)],
               recvs)
    got.append([None if x is None else x.tolist() for x in recvs])
    return r, p, got, c.stats()["bytes_sent"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("p,split", [(1, False), (2, False), (3, False),
                                     (4, False), (4, True)])
def test_alltoall_moves_every_block(backend, p, split):
    results = launch(exchange_all, p, args=(split,), backend=backend,
                     timeout=60)
    for r, size, got, sent in results:
        for per_dtype in got[:4]:
            assert per_dtype == [
                (np.arange((j + 2 * r) % 4) + 10 * j).tolist()
                for j in range(size)]
        assert got[4] == [None if j == r else [float(j)] * 2
                          for j in range(size)]
        assert size == 1 or sent > 0


def mismatched_blocks(comm):
    """Rank 0 sends 3 floats to rank 1, which expects 5.  The receiver
    fails in the all-to-all; the sender's bytes may all be gone by then, so
    it fails there or, at the latest, at its next call (a barrier): the
    communicator refuses work after a peer's error."""
    other = 1 - comm.rank
    sends = [np.zeros(3 if comm.rank == 0 and i == 1 else 5)
             for i in range(2)]
    recvs = [np.zeros(5), np.zeros(5)]
    try:
        comm.alltoall(sends, recvs, timeout=10)
        comm.barrier(timeout=10)
    except CommError as err:
        return str(err)
    return f"no error (peer {other})"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_alltoall_size_mismatch_fails_both_ranks(backend):
    results = launch(mismatched_blocks, 2, backend=backend, timeout=40)
    assert not any(m.startswith("no error") for m in results), results
    assert "alltoall" in results[1], results
    assert any("size mismatch" in m and "24 bytes" in m and "40 bytes" in m
               for m in results), results


def mismatched_blocks_strict(comm):
    """Rank 0 sends 3 floats to rank 1, which expects 5 (all the others
    agree), and comes late, so that rank 1's block is there already: the
    all-to-all itself raises on both ranks (the sender sees the size its
    peer expects in the peer's own frame), not only on the receiver."""
    p = comm.size
    sends = [np.zeros(3 if comm.rank == 0 and i == 1 else 5)
             for i in range(p)]
    recvs = [np.zeros(5) for _ in range(p)]
    if comm.rank == 0:
        time.sleep(0.3)
    try:
        comm.alltoall(sends, recvs, timeout=10)
    except CommError as err:
        return str(err)
    return "no error"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("p", [2, 3])
def test_alltoall_size_mismatch_fails_both_ranks_in_the_call(backend, p):
    results = launch(mismatched_blocks_strict, p, backend=backend,
                     timeout=40)
    for r in (0, 1):
        assert results[r].startswith(f"rank {r}: alltoall"), results
        assert "size mismatch" in results[r] and "24 bytes" in results[r] \
            and "40 bytes" in results[r], results


def in_place(comm, mode):
    """alltoall where sends and receives share memory, as MPI_IN_PLACE
    users write it: what rank j sent is what it held at the call."""
    p, r = comm.size, comm.rank
    if mode == "same list":
        xs = [np.full(3, 10.0 * r + j) for j in range(p)]
        comm.alltoall(xs, xs)
        return [x.tolist() for x in xs]
    if mode == "one buffer, shifted":
        # send block j overlaps receive blocks j - 1 and j
        buf = 1000.0 * r + np.arange(3 * p + 1, dtype=np.float64)
        comm.alltoall([buf[3 * j:3 * j + 3] for j in range(p)],
                      [buf[3 * j + 1:3 * j + 4] for j in range(p)])
        return [buf[3 * j + 1:3 * j + 4].tolist() for j in range(p)]
    if mode == "one send array":
        # every block sends the array that is also receive block 0
        x = np.full(2, 1.0 + r)
        recvs = [x] + [np.zeros(2) for _ in range(p - 1)]
        comm.alltoall([x] * p, recvs)
        return [y.tolist() for y in recvs]
    raise AssertionError(mode)


def in_place_expected(mode, p, r):
    if mode == "same list":
        return [[10.0 * j + r] * 3 for j in range(p)]
    if mode == "one buffer, shifted":
        return [(1000.0 * j + np.arange(3 * r, 3 * r + 3)).tolist()
                for j in range(p)]
    return [[1.0 + j] * 2 for j in range(p)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("mode", ["same list", "one buffer, shifted",
                                  "one send array"])
def test_alltoall_in_place(backend, p, mode):
    for r, got in enumerate(launch(in_place, p, args=(mode,),
                                   backend=backend, timeout=40)):
        assert got == in_place_expected(mode, p, r), (r, got)


def aliased_receives(comm):
    """The same array as every receive block: a ValueError naming two of
    them, before any message."""
    x = np.zeros(4)
    try:
        comm.alltoall([np.ones(4)] * comm.size, [x] * comm.size)
    except Exception as err:
        return type(err).__name__, str(err), comm.stats()["messages"]
    return "no error", "", comm.stats()["messages"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_alltoall_refuses_overlapping_receive_blocks(backend):
    for r, (name, text, sent) in enumerate(
            launch(aliased_receives, 3, backend=backend, timeout=40)):
        assert (name, sent) == ("ValueError", 0), (name, text, sent)
        assert text == (f"rank {r}: alltoall: recvs[0] and recvs[1] overlap "
                        f"(each block is written by its own rank)"), text


def numpy_integer_arguments(comm):
    """NumPy integers are integers for split and sendrecv; a bool, a float
    or a string is a TypeError, an integer out of range a ValueError."""
    other = np.int64(1 - comm.rank)
    half = comm.split(np.int64(0), key=np.int32(-comm.rank))
    got = np.zeros(2)
    half.sendrecv(np.full(2, float(comm.rank)), np.int64(1 - half.rank), got,
                  np.uint8(1 - half.rank), step=np.int64(3))
    errors = []
    for call in (lambda: comm.split(np.float64(0)),
                 lambda: comm.split(0, key=1.5),
                 lambda: comm.split(np.int64(-2)),
                 lambda: comm.sendrecv(got, True, got, other),
                 lambda: comm.sendrecv(got, other, got, other, step=True),
                 lambda: comm.sendrecv(got, other, got, other, step=1.0),
                 lambda: comm.sendrecv(got, np.int64(2), got, other)):
        try:
            call()
            errors.append("no error")
        except Exception as err:
            errors.append(f"{type(err).__name__}: {err}")
    return half.rank, got.tolist(), errors, comm.stats()["messages"]


@pytest.mark.timeout(60)
def test_numpy_integers_and_the_integer_rule_in_comm_arguments():
    results = launch(numpy_integer_arguments, 2, backend="threads",
                     timeout=40)
    # the split's two allgathers (records, verdicts on the context), the
    # sendrecv
    split_messages = 2 * 2 * (2 - 1) + 1
    for r, (rank, got, errors, sent) in enumerate(results):
        assert rank == 1 - r and got == [float(1 - r)] * 2
        assert errors == [
            "TypeError: color must be an int or None, got numpy.float64",
            "TypeError: key must be an int or None, got float",
            "ValueError: color must be in [0, 2147483647] or None, got -2",
            "TypeError: dst must be a rank (int) or None, got bool",
            "TypeError: step must be an int, got bool",
            "TypeError: step must be an int, got float",
            "ValueError: dst must be a rank in [0, 2), got 2",
        ], errors
        assert sent == split_messages


# ---- failures: a dead rank, a stuck peer, abort, close ----------------------

def die_in_alltoall(comm, on_split):
    """Rank 1 dies just before the all-to-all (of the world, or of its
    group of two); the others report how it ended and how long it took."""
    c = comm.split(comm.rank // 2) if on_split else comm
    c.barrier()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        c.alltoall([np.zeros(1 << 16)] * c.size,
                   [np.zeros(1 << 16) for _ in range(c.size)])
    except CommError as err:
        raise CommError(f"{err} [after {time.monotonic() - start:.2f} s]")
    return "survived"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("on_split", [False, True], ids=["world", "group"])
def test_dead_rank_in_alltoall_is_a_commerror_naming_it(on_split,
                                                        monkeypatch):
    """Within the deadline (30 s), well before it: CommError naming the
    operation on the ranks that exchange with it, and the dead rank 1, or
    a partner that failed first because of it: a rank that fails while
    half-way through a frame to a peer closes that connection without the
    ABORT frame (the stream cannot carry one there), and that peer then
    names it ("peer rank R closed the connection")."""
    monkeypatch.setenv("RINGATTN_TIMEOUT", "30")
    with pytest.raises(LaunchError) as info:
        launch(die_in_alltoall, 4, args=(on_split,), timeout=60)
    failures = {f["rank"]: f for f in info.value.failures}
    assert "SIGKILL" in str(info.value)
    partners = [0] if on_split else [0, 2, 3]
    named = {}
    for r in partners:
        f = failures[r]
        assert f["exc_type"] == "CommError", f
        assert "alltoall" in f["message"], f
        named[r] = [int(x) for x in re.findall(r"\brank (\d+)", f["message"]) if int(x) != r]
        took = float(f["message"].rsplit("[after ", 1)[1].split(" s]")[0])
        assert took < 20, f
    # every partner's error leads back to rank 1
    direct = {r for r, who in named.items() if 1 in who}
    assert direct, failures
    for r, who in named.items():
        assert r in direct or any(w in direct for w in who), (r, failures)


def stuck_in_alltoall(comm):
    if comm.rank == 1:
        time.sleep(2.0)
        return "slept"
    start = time.monotonic()
    try:
        comm.alltoall([np.zeros(4)] * 2, [np.zeros(4), np.zeros(4)],
                      timeout=0.5)
    except CommError as err:
        return str(err), time.monotonic() - start
    return "no timeout", 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_stuck_peer_in_alltoall_times_out(backend):
    message, took = launch(stuck_in_alltoall, 2, backend=backend,
                           timeout=40)[0]
    assert message.startswith("rank 0: alltoall step 1: timed out after "
                              "0.5 s waiting for rank 1"), message
    assert took < 1.5


def abort_split(comm):
    """Rank 0 aborts its split; every communicator on the transport fails,
    on every rank."""
    half = comm.split(0)
    comm.barrier()
    if comm.rank == 0:
        half.abort("giving up")
    try:
        for step in range(50):
            comm.sendrecv(np.zeros(2), 1 - comm.rank, np.zeros(2),
                          1 - comm.rank, step=step, timeout=10)
            time.sleep(0.02)
    except CommError as err:
        return str(err), comm.failed, half.failed
    return "no error", comm.failed, half.failed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_of_a_split_fails_the_transport_everywhere(backend):
    results = launch(abort_split, 2, backend=backend, timeout=40)
    for message, parent_failed, split_failed in results:
        assert "giving up" in message, results
        assert parent_failed and split_failed


def close_order(comm):
    """Closing a split leaves the parent usable; closing the parent closes
    its splits (they refuse work, naming the operation)."""
    a = comm.split(0)
    b = comm.split(0)
    a.close()
    comm.barrier()
    b.barrier()
    comm.close()
    try:
        b.barrier()
    except CommError as err:
        return a.closed, b.closed, str(err)
    return a.closed, b.closed, "no error"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_close_of_split_and_parent(backend):
    for a_closed, b_closed, message in launch(close_order, 2,
                                              backend=backend, timeout=40):
        assert a_closed and b_closed
        assert "barrier" in message and "closed" in message, message


# ---- arguments: checked before any communication ---------------------------

def bad_arguments(comm):
    """Every bad argument raises before a message is sent."""
    errors = []
    calls = [
        lambda: comm.split(-1),
        lambda: comm.split(True),
        lambda: comm.split("a"),
        lambda: comm.split(0, key=2 ** 40),
        lambda: comm.alltoall([np.zeros(1)], [np.zeros(1)]),
        lambda: comm.alltoall(5, [np.zeros(1)] * 2),
        lambda: comm.alltoall([np.zeros(1)] * 2,
                              [np.zeros(1), np.zeros(4)[::2]]),
        lambda: comm.alltoall([np.zeros(1)] * 2,
                              [np.zeros(3 if j == comm.rank else 1)
                               for j in range(2)]),
        lambda: comm.alltoall([np.zeros(1)] * 2, [np.zeros(1), "x"]),
        lambda: comm.alltoall([np.zeros(1)] * 2, [np.zeros(1)] * 2,
                              timeout=-1),
    ]
    ro = np.zeros(1)
    ro.flags.writeable = False
    calls.append(lambda: comm.alltoall([np.zeros(1)] * 2, [ro, ro]))
    for call in calls:
        try:
            call()
            errors.append("no error")
        except Exception as err:
            errors.append(f"{type(err).__name__}: {err}")
    return errors, comm.stats()["messages"]


@pytest.mark.timeout(60)
def test_bad_arguments_raise_before_communication():
    errors, sent = launch(bad_arguments, 2, backend="threads",
                          timeout=40)[0]
    assert sent == 0, errors
    expected = [
        "ValueError: color must be in [0",
        "TypeError: color must be an int or None",
        "TypeError: color must be an int or None",
        "ValueError: key must be in",
        "ValueError: sends must have one entry per rank (2), got 1",
        "TypeError: sends must be a list or tuple of 2 arrays",
        "ValueError: recvs[1] must be contiguous",
        "ValueError: sends[0] (to this rank) has 8 bytes but recvs[0] holds "
        "24 bytes",
        "TypeError: recvs[1]",
        "ValueError: timeout must be a positive number",
        "ValueError: recvs[0] must be writable",
    ]
    for want, got in zip(expected, errors):
        assert got.startswith(want), (want, got)
