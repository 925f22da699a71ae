"""What a communicator says when it fails: an abort reason in any language
(cut on a UTF-8 character boundary to fit the message), or a peer's ABORT
frame carrying bytes that are not UTF-8 at all, is a ra.CommError naming
rank and peer -- on the waiting call and on every later one -- never a
UnicodeDecodeError; and a peer that claims a rank outside the world is
named as such during the handshake."""

import hashlib
import hmac
import os
import socket
import struct
import threading

import numpy as np
import pytest

from ringattn import _C
from ringattn.launch import free_port

CommError = _C.CommError

# 1-, 2-, 3- and 4-byte characters, shifted so that the message's cut
# falls inside each kind of character somewhere
REASONS = ["x" * pad + "é€😀ü" * 120 for pad in range(4)]


def _join_host(port, size=2, timeout=20):
    comms, errors = [None] * size, [None] * size

    def join(rank):
        try:
            comms[rank] = _C.host_comm(rank, size, master_port=port, token="t",
                                       timeout=timeout)
        except BaseException as e:      # collected for the assertions
            errors[rank] = e

    threads = [threading.Thread(target=join, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    assert errors == [None] * size, errors
    return comms


def _pair(backend):
    if backend == "threads":
        group = _C.ThreadsGroup(2, timeout=20)
        return [group.comm(0), group.comm(1)]
    return _join_host(free_port())


def _wait_for_failure(comm, trigger):
    """Start a receive from rank 1 on `comm` (rank 0), run trigger(); the
    CommError the receive ended with."""
    caught = []

    def waiter():
        try:
            comm.sendrecv(None, None, np.zeros(4), 1, timeout=20)
        except BaseException as e:      # the assertions look at it
            caught.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    trigger()
    t.join(30)
    assert caught, "the receive did not fail"
    return caught[0]


def _check(err, reason=None):
    assert isinstance(err, CommError), repr(err)
    text = str(err)
    assert "rank 0" in text and "peer rank 1 failed" in text, text
    if reason is not None:
        assert "\ufffd" not in text, "a character was cut in two: " + text
        shown = text[text.index("aborted: ") + len("aborted: "):]
        assert len(shown) > 40 and reason.startswith(shown), text
    return text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["threads", "host"])
@pytest.mark.parametrize("reason", REASONS, ids=[f"pad{i}" for i in range(4)])
def test_non_ascii_abort_reason_is_a_comm_error(backend, reason):
    c0, c1 = _pair(backend)
    try:
        _check(_wait_for_failure(c0, lambda: c1.abort(reason)), reason)
        for _ in range(2):              # every later call: the same kind
            with pytest.raises(CommError, match="failed state"):
                c0.barrier()
    finally:
        c0.close()
        c1.close()


def _socket_to(port):
    """A duplicate of this process's TCP socket connected to `port`."""
    for name in os.listdir("/proc/self/fd"):
        try:
            s = socket.fromfd(int(name), socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            if s.getpeername()[1] == port:
                return s
        except OSError:
            pass
        s.close()
    raise AssertionError(f"no socket connected to port {port}")


@pytest.mark.timeout(60)
def test_a_peer_abort_frame_that_is_not_utf8_is_a_comm_error():
    """Rank 1's connection carries an ABORT frame whose reason has 0xff and
    a cut 3-byte character: rank 0 raises CommError (with replacement
    characters), now and later."""
    port = free_port()
    c0, c1 = _join_host(port)
    try:
        link = _socket_to(port)         # rank 1 connected to rank 0's port
        reason = b"bad \xff bytes \xe2\x82"
        # comm_host_internal.h: magic "RAF2" | kind | step | nbytes | back
        frame = struct.pack("<IIqQQ", 0x52414632, 9, -1, len(reason),
                            2**64 - 1) + reason

        def send_abort():
            link.sendall(frame)
            link.close()

        text = _check(_wait_for_failure(c0, send_abort))
        assert "bad \ufffd bytes" in text, text
        with pytest.raises(CommError, match="failed state"):
            c0.barrier()
    finally:
        c0.close()
        c1.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("claim, expect", [
    ((5, 2), "peer claims rank 5, out of range for world size 2"),
    ((1, 6), "peer claims world size 6, expected 2"),
])
def test_a_peer_claiming_another_world_is_named(claim, expect):
    """A peer that knows the token but claims rank 5 of 2 (or another world
    size): rank 0's join fails saying which."""
    port = free_port()
    result = {}

    def rank0():
        try:
            _C.host_comm(0, 2, master_port=port, token="t", timeout=10).close()
            result["error"] = None
        except BaseException as e:      # what rank 0 saw
            result["error"] = e

    t = threading.Thread(target=rank0)
    t.start()
    for _ in range(200):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            break
        except OSError:
            threading.Event().wait(0.02)
    hello = b""
    while len(hello) < 20:
        hello += s.recv(20 - len(hello))
    nonce_c = os.urandom(16)
    rank, size = claim
    msg = b"c" + hello[4:] + nonce_c + struct.pack("<II", rank, size)
    mac = hmac.new(b"t", msg, hashlib.sha256).digest()
    s.sendall(struct.pack("<II", rank, size) + nonce_c + mac)
    t.join(20)
    s.close()
    err = result["error"]
    assert isinstance(err, CommError) and expect in str(err), repr(err)
