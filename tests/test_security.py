"""The peer protocol: nothing a peer sends is unpickled or evaluated.

The ring's agreement travels as a fixed-size record (ringattn.agreement);
a malformed one is refused with CommError naming the rank that sent it.
Without RINGATTN_TOKEN the host transport is unauthenticated (one warning
says so) and a process that knows the job key can join: the attacker tests
below play such a process and check that what it sends runs nothing and
that the honest rank fails with a clear error within the call's deadline.
ra.launch and `ringattn launch` always set a fresh random token.
"""

import os
import pickle
import re
import struct
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest

import ringattn as ra
from ringattn import _C, agreement, comm as comm_mod
from ringattn.launch import free_port, main_launch

PKG = os.path.dirname(os.path.abspath(ra.__file__))


def desc(**changes):
    """A valid description of a forward call, with `changes` applied."""
    q = ra.zeros((2, 5, 4, 8), dtype="float32")
    k = ra.zeros((2, 5, 2, 8), dtype="float32")
    d = agreement.describe("dilated_fwd", q, k, True, 0.125, "zigzag", 10,
                           [4, 8], [1, 2])
    d.update(changes)
    return d


# ---- the record format ------------------------------------------------------

@pytest.mark.parametrize("changes", [
    {}, dict(scale=None, seq_len=None), dict(op="bwd", segment_lengths=(),
                                              dilation_rates=()),
    dict(dtype="bfloat16", device="cuda", layout="striped", causal=False),
    dict(segment_lengths=tuple(range(1, 17)), dilation_rates=(3,) * 16),
])
def test_record_round_trips_at_a_fixed_size(changes):
    d = desc(**changes)
    record = agreement.encode(d)
    assert len(record) == agreement.RECORD_SIZE
    assert agreement.decode(record) == d


def test_scale_is_compared_bit_for_bit():
    """0.1 and the next float up are different scales; equal bits agree."""
    a = agreement.decode(agreement.encode(desc(scale=0.1)))["scale"]
    b = agreement.decode(agreement.encode(
        desc(scale=np.nextafter(0.1, 1.0))))["scale"]
    assert struct.pack("<d", a) == struct.pack("<d", 0.1) and a != b


def _patched(offset, fmt, value):
    record = bytearray(agreement.encode(desc()))
    struct.pack_into(fmt, record, offset, value)
    return bytes(record)


class RunsCode:
    """Unpickling this calls exec: what the old pickled agreement allowed."""

    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path('x').touch()",))


MALFORMED = {
    "empty": b"",
    "one byte short": agreement.encode(desc())[:-1],
    "one byte long": agreement.encode(desc()) + b"\0",
    "pickle": pickle.dumps(RunsCode()),
    "pickle padded to size": pickle.dumps(RunsCode()).ljust(
        agreement.RECORD_SIZE, b"."),
    "magic": _patched(0, "<4s", b"RAP0"),
    "version": _patched(4, "<H", agreement.VERSION + 1),
    "op code": _patched(6, "<B", 9),
    "dtype code": _patched(7, "<B", 200),
    "device code": _patched(8, "<B", 7),
    "causal": _patched(9, "<B", 2),
    "layout code": _patched(10, "<B", 3),
    "flags": _patched(11, "<B", 4),
    "branch count": _patched(12, "<B", 17),
    "negative batch": _patched(13, "<q", -1),
    "negative length": _patched(13 + 32, "<q", -5),
    "zero rate": _patched(agreement.RECORD_SIZE - 16 * 16 + 8, "<q", 0),
    "unused branch set": _patched(agreement.RECORD_SIZE - 16, "<q", 5),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_records_are_refused(name):
    with pytest.raises(ValueError):
        agreement.decode(MALFORMED[name])


def test_no_module_unpickles_or_evaluates_peer_data():
    """Only launch.py (its own spawned children, over their private pipes)
    may unpickle; no module evaluates code."""
    banned = re.compile(r"\b(pickle\.loads?|marshal\.loads?|eval|exec)\s*\(")
    hits = []
    for name in sorted(os.listdir(PKG)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(PKG, name)) as f:
            for lineno, line in enumerate(f, 1):
                if banned.search(line) and name != "launch.py":
                    hits.append(f"{name}:{lineno}: {line.strip()}")
    assert not hits, "\n".join(hits)


# ---- the token --------------------------------------------------------------

def test_without_a_token_the_transport_says_it_is_unauthenticated(monkeypatch):
    monkeypatch.delenv("RINGATTN_TOKEN", raising=False)
    monkeypatch.setattr(comm_mod, "_warned_unauthenticated", False)
    port = free_port()
    with pytest.warns(RuntimeWarning, match="unauthenticated") as caught:
        _, _, key = comm_mod._rendezvous("127.0.0.1", port, None, 3, "")
        comm_mod._rendezvous("127.0.0.1", port, None, 3, "")
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert key.startswith("unauthenticated|") and str(port) in key


def test_an_explicit_token_is_used_silently(monkeypatch):
    monkeypatch.setenv("RINGATTN_TOKEN", "s3cret")
    monkeypatch.setattr(comm_mod, "_warned_unauthenticated", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert comm_mod._rendezvous("127.0.0.1", 1234, None, 2, "")[2] == "s3cret"


def rank_token(comm):
    return os.environ.get("RINGATTN_TOKEN", "")


@pytest.mark.timeout(120)
def test_launch_sets_a_fresh_random_token_per_job():
    first = ra.launch(rank_token, 2, backend="host", timeout=60)
    second = ra.launch(rank_token, 2, backend="host", timeout=60)
    for tokens in (first, second):
        assert len(set(tokens)) == 1 and re.fullmatch(r"[0-9a-f]{32}",
                                                      tokens[0]), tokens
    assert first[0] != second[0]


@pytest.mark.timeout(60)
def test_cli_launch_sets_a_random_token(tmp_path, monkeypatch):
    monkeypatch.delenv("RINGATTN_TOKEN", raising=False)
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        path = os.path.join(sys.argv[1], "token" + os.environ["RANK"])
        open(path, "w").write(os.environ.get("RINGATTN_TOKEN", ""))
    """))
    assert main_launch(["-n", "2", str(script), str(tmp_path)]) == 0
    tokens = {(tmp_path / f"token{r}").read_text() for r in range(2)}
    assert len(tokens) == 1 and re.fullmatch(r"[0-9a-f]{32}", tokens.pop())


# ---- the attacker -----------------------------------------------------------

def _honest_rank0(port, result, timeout):
    """Rank 0 of a 2-rank job started without a token: one ring forward."""
    q = np.random.default_rng(0).standard_normal((1, 6, 2, 8))
    start = time.monotonic()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            comm = ra.init("host", 0, 2, master_port=port, timeout=20)
        try:
            ra.ring_attention(q, q, q, comm, timeout=timeout)
            result["error"] = None
        finally:
            comm.close()
    except BaseException as e:        # what the honest rank saw
        result["error"] = e
    result["took"] = time.monotonic() - start


def _attack(monkeypatch, tmp_path, payload):
    """Run an honest rank 0 and a fake rank 1 that knows the job key and
    sends `payload` as its agreement record.  Returns rank 0's result."""
    monkeypatch.delenv("RINGATTN_TOKEN", raising=False)
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID",
                 "LSB_JOBID", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)             # where RunsCode would write 'x'
    port = free_port()
    result = {}
    honest = threading.Thread(target=_honest_rank0, args=(port, result, 5.0))
    honest.start()
    # everything the job key is made of is public: address, port, size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        key = comm_mod._job_key("127.0.0.1", port, 2)
    fake = _C.host_comm(1, 2, master_port=port, token=key, timeout=20)
    try:
        fake.allgather(payload, timeout=10)
    except _C.CommError:
        pass
    honest.join(30)
    fake.close()
    assert not honest.is_alive()
    assert not (tmp_path / "x").exists(), "the peer's payload ran"
    return result


@pytest.mark.timeout(60)
def test_a_fake_rank_with_the_job_key_cannot_run_code(monkeypatch, tmp_path):
    result = _attack(monkeypatch, tmp_path, pickle.dumps(RunsCode()))
    err = result["error"]
    assert isinstance(err, ra.CommError), repr(err)
    assert "rank 1 sent a malformed record" in str(err), str(err)
    assert result["took"] < 10.0


@pytest.mark.timeout(60)
def test_a_fake_rank_claiming_a_huge_shard_is_refused(monkeypatch, tmp_path):
    """A well-formed record with an absurd length: a clear ValueError, no
    allocation of the claimed size."""
    q = ra.zeros((1, 6, 2, 8), dtype="float64")
    record = agreement.encode(agreement.describe(
        "fwd", q, q, False, None, "contiguous", None))
    record = bytearray(record)
    struct.pack_into("<q", record, 13 + 32, 2**61)        # length
    result = _attack(monkeypatch, tmp_path, bytes(record))
    err = result["error"]
    assert isinstance(err, ValueError) and "shard lengths" in str(err), \
        repr(err)
    assert result["took"] < 10.0
