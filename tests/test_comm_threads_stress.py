"""The threads backend under churn: many short two-rank groups whose
exchanges fail (size mismatch, a peer closing or aborting early) while the
other rank is still copying, with the failing rank dropping its request,
closing and freeing its communicator at once and the garbage collector
running in between.  A request or communicator freed while the peer still
uses it crashes the process (or is reported by the sanitizer build)."""

import gc
import threading
import time

import numpy as np
import pytest

from ringattn import _C

CommError = _C.CommError
ROUNDS = 300
BIG_ROUNDS = 30                # rounds that copy 40 MiB each


def two_ranks(fn0, fn1):
    """Run fn0(comm, posted) and fn1(comm, posted) on the two ranks of a
    fresh group, closing and dropping each comm as soon as its rank is
    done; `posted` is an Event rank 1 sets once its exchange is started.
    Returns the exception each rank raised (or None)."""
    group = _C.ThreadsGroup(2, timeout=20)
    posted = threading.Event()
    errors = [None, None]

    def body(rank, fn):
        comm = group.comm(rank)
        try:
            fn(comm, posted)
        except CommError as e:
            e.__traceback__ = None     # its frames would keep comm alive
            errors[rank] = e
        finally:
            posted.set()
            comm.close()
        del comm

    threads = [threading.Thread(target=body, args=(r, f))
               for r, f in enumerate((fn0, fn1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return errors


def posting_first(send_n, recv_n, fill=0.0):
    """Rank 1's side: start the exchange, let rank 0 go, then wait.  Its
    buffers belong to the request alone, so dropping the request frees
    them."""
    def fn(comm, posted):
        req = comm.sendrecv_start(np.full(send_n, fill), 0,
                                  np.zeros(recv_n), 0, step=2)
        posted.set()
        try:
            req.wait()
        finally:
            del req                    # freed at once, even when it failed
    return fn


@pytest.mark.timeout(60)
def test_mismatch_found_after_a_matching_direction():
    # rank 1 is queued first, so rank 0 matches its own send (sizes agree)
    # before it meets rank 1's send into a receive buffer of the wrong size:
    # both requests fail, and rank 1 drops its request and buffers at once,
    # while rank 0's copy of the first direction is due.  The copy is big
    # (40 MiB: a buffer of its own that is unmapped when freed) so that it
    # is still running when rank 1 is quick.
    big = 5 << 20
    start = time.monotonic()
    for i in range(BIG_ROUNDS):
        def rank0(comm, posted):
            posted.wait(10)
            comm.sendrecv(np.ones(big), 1, np.zeros(8), 1, step=2)

        errors = two_ranks(rank0, posting_first(4, big))
        assert all(isinstance(e, CommError) for e in errors), errors
        assert "size mismatch" in str(errors[0])
        assert "size mismatch" in str(errors[1])
        if i % 4 == 0:
            gc.collect()
    assert time.monotonic() - start < 50


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["close", "abort"])
def test_peer_leaving_while_the_other_waits(how):
    start = time.monotonic()
    for i in range(ROUNDS):
        def rank0(comm, posted):
            posted.wait(10)
            if how == "abort":
                comm.abort("gave up")
            # close (two_ranks) frees the comm while rank 1 may still wait

        errors = two_ranks(rank0, posting_first(3, 3))
        assert isinstance(errors[1], CommError), errors
        assert "peer rank 0 failed" in str(errors[1])
        if i % 16 == 0:
            gc.collect()
    assert time.monotonic() - start < 50


@pytest.mark.timeout(60)
def test_matching_exchanges_still_deliver():
    # the same churn with sizes that agree: every round delivers the data
    for i in range(ROUNDS):
        got = np.zeros(5)

        def rank0(comm, posted):
            posted.wait(10)
            comm.sendrecv(np.full(5, float(i)), 1, got, 1, step=2)

        errors = two_ranks(rank0, posting_first(5, 5, fill=-1.0))
        assert errors == [None, None]
        np.testing.assert_array_equal(got, np.full(5, -1.0))
