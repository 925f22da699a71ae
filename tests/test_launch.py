"""Multi-process tests: real ranks started with ra.launch (spawn) talking
over the host (TCP) backend, and the `ringattn launch` command.  Rank
functions live at module level so that spawned processes can import them."""

import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import ringattn

from ringattn import _C
from ringattn.launch import LaunchError, free_port, launch, main_launch

CommError = _C.CommError
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ringattn.__file__)))  # where ringattn is imported from


def no_children_left():
    return mp.active_children() == []


def ring_exchange(comm, send, recv, step=-1, timeout=None):
    comm.sendrecv(send, (comm.rank + 1) % comm.size, recv,
                  (comm.rank - 1) % comm.size, step=step, timeout=timeout)


# ---- rank functions (module level: they pickle by reference) ---------------

def ring_everything(comm):
    """Odd sizes and dtypes around the ring, overlap, self-send, barrier,
    allgather; returns what the parent checks."""
    prev = (comm.rank - 1) % comm.size
    for step, (n, dtype) in enumerate([(1, np.float32), (7, np.float64),
                                       (113, np.int16), (4099, np.float32),
                                       (0, np.float64)]):
        send = (np.arange(n) + 100 * comm.rank).astype(dtype)
        recv = np.empty_like(send)
        ring_exchange(comm, send, recv, step=step)
        np.testing.assert_array_equal(recv, (np.arange(n) + 100 * prev)
                                      .astype(dtype))
    send = np.full(1 << 18, comm.rank, np.float32)
    recv = np.empty_like(send)
    req = comm.sendrecv_start(send, (comm.rank + 1) % comm.size, recv, prev,
                              step=10)
    busy = float(np.linalg.norm(np.ones((200, 200)) @ np.ones((200, 200))))
    req.wait()
    assert recv[0] == prev and recv[-1] == prev and busy > 0
    mine = np.arange(5.0) * comm.rank
    back = np.empty(5)
    comm.sendrecv(mine, comm.rank, back, comm.rank)
    np.testing.assert_array_equal(back, mine)
    comm.barrier()
    return comm.allgather(f"rank{comm.rank}".encode()), comm.stats()


def ring_large(comm, n):
    send = np.full(n, comm.rank, np.float64)
    recv = np.empty(n)
    ring_exchange(comm, send, recv, step=0)
    prev = (comm.rank - 1) % comm.size
    return bool(recv[0] == prev and recv[-1] == prev and recv[n // 2] == prev)


def die_mid_ring(comm, how):
    send, recv = np.zeros(64), np.zeros(64)
    ring_exchange(comm, send, recv, step=0)
    if comm.rank == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        for step in range(1, 4):
            ring_exchange(comm, send, recv, step=step)
    except CommError as e:
        raise CommError(f"{e} [after {time.monotonic() - start:.2f} s]")
    return "survived"


def raise_on_rank(comm, bad_rank):
    if comm.rank == bad_rank:
        raise KeyError("missing key on purpose")
    ring_exchange(comm, np.zeros(3), np.zeros(3), step=0)


def mismatched_sizes(comm):
    recv = np.zeros(10 if comm.rank == 0 else 6, np.float32)
    ring_exchange(comm, np.zeros(6, np.float32), recv, step=4)
    comm.barrier()


def stuck_peer(comm):
    if comm.rank == 1:
        time.sleep(2.0)
        return "slept"
    try:
        ring_exchange(comm, np.zeros(4), np.zeros(4), step=7, timeout=0.5)
    except CommError as e:
        return str(e)
    return "no timeout"


def sleep_forever(comm):
    time.sleep(60)


# ---- tests ----------------------------------------------------------------

@pytest.mark.timeout(90)
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_ring_over_processes(nprocs):
    results = launch(ring_everything, nprocs, backend="host", timeout=60)
    names = [f"rank{r}".encode() for r in range(nprocs)]
    for gathered, stats in results:
        assert gathered == names
        if nprocs > 1:
            assert stats["bytes_sent"] > (1 << 20)
    assert no_children_left()


@pytest.mark.timeout(90)
def test_large_buffers_ring_does_not_deadlock():
    # 64 MiB per rank, far beyond any socket buffer, everybody sending first
    assert launch(ring_large, 3, args=(8 << 20,), timeout=60) == [True] * 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_dead_rank_surfaces_as_commerror_naming_it(how, monkeypatch):
    monkeypatch.setenv("RINGATTN_TIMEOUT", "30")
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(die_mid_ring, 3, args=(how,), timeout=40)
    took = time.monotonic() - start
    err = info.value
    assert err.rank == 1
    if how == "exit":
        assert "exited with code 3" in str(err)
    else:
        assert "killed by signal SIGKILL" in str(err)
    others = [f for f in err.failures if f["rank"] != 1]
    assert len(others) == 2
    for f in others:
        assert f["exc_type"] == "CommError"
        assert "rank 1" in f["message"]
    assert took < 20                     # well within the 30 s timeout
    assert no_children_left()


@pytest.mark.timeout(60)
def test_exception_in_a_rank_carries_its_traceback():
    with pytest.raises(LaunchError) as info:
        launch(raise_on_rank, 2, args=(1,), timeout=40)
    err = info.value
    assert err.rank == 1
    assert "KeyError" in str(err) and "missing key on purpose" in str(err)
    assert "Traceback" in str(err) and "raise_on_rank" in str(err)
    assert isinstance(err.__cause__, KeyError)
    assert no_children_left()


@pytest.mark.timeout(60)
def test_size_mismatch_across_processes():
    with pytest.raises(LaunchError) as info:
        launch(mismatched_sizes, 2, timeout=40)
    msgs = [f["message"] for f in info.value.failures]
    assert any("size mismatch" in m and "24 bytes" in m and "40 bytes" in m
               for m in msgs), msgs
    assert no_children_left()


@pytest.mark.timeout(60)
def test_stuck_peer_times_out_across_processes():
    results = launch(stuck_peer, 2, timeout=40)
    assert "timed out after 0.5 s waiting for rank 1" in results[0]
    assert results[0].startswith("rank 0: sendrecv step 7:")


@pytest.mark.timeout(60)
def test_launch_timeout_stops_everything():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="did not finish within"):
        launch(sleep_forever, 2, timeout=4)
    assert time.monotonic() - start < 20
    assert no_children_left()


@pytest.mark.timeout(30)
def test_launch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="nprocs must be an integer >= 1"):
        launch(ring_large, 0)
    with pytest.raises(ValueError, match="backend must be"):
        launch(ring_large, 2, backend="mpi")
    with pytest.raises(ValueError, match="must pickle"):
        launch(lambda comm: None, 2, backend="host")


# ---- ringattn launch -n N script.py ----------------------------------------

SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    import ringattn as ra
    from ringattn.comm import init, launcher_env
    comm = init()
    send = np.full(3, float(comm.rank))
    recv = np.empty(3)
    comm.sendrecv(send, (comm.rank + 1) % comm.size, recv,
                  (comm.rank - 1) % comm.size)
    local = launcher_env()["local_rank"]
    with open(os.path.join(sys.argv[1], f"rank{comm.rank}.txt"), "w") as f:
        f.write(f"{comm.size} {local} {recv[0]:.0f}")
    if len(sys.argv) > 2 and comm.rank == int(sys.argv[2]):
        sys.exit(5)
    comm.barrier()
    comm.close()
""")


def run_cli(args):
    """`python -m ringattn launch ...` if the CLI exists, else main_launch."""
    if os.path.exists(os.path.join(ROOT, "ringattn", "__main__.py")):
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        # run where ringattn is imported from, so `-m` finds the same one
        proc = subprocess.run([sys.executable, "-m", "ringattn", "launch"] +
                              args, env=env, timeout=60, cwd=ROOT)
        return proc.returncode
    return main_launch(args)


@pytest.mark.timeout(90)
def test_cli_launch_runs_a_script_on_n_ranks(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    rc = run_cli(["-n", "2", str(script), str(tmp_path)])
    assert rc == 0
    assert ring_files(tmp_path, 2) == ring_expected(2, 2)


@pytest.mark.timeout(90)
def test_cli_launch_returns_the_failing_exit_code(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    rc = run_cli(["-n", "2", str(script), str(tmp_path), "1"])
    assert rc == 5
    assert time.monotonic() - start < 40


def ring_files(folder, size):
    return sorted((folder / f"rank{r}.txt").read_text() for r in range(size))


def ring_expected(size, per_node):
    """What SCRIPT writes: size, local rank, the previous rank's value."""
    return sorted(f"{size} {r % per_node} {(r - 1) % size}"
                  for r in range(size))


def adjacent_free_ports():
    """A free port P with P + 1 free too (ringattn's rendezvous is P + 1)."""
    for _ in range(20):
        port = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    pytest.skip("no two adjacent free ports")


LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
               "MASTER_ADDR", "MASTER_PORT", "RINGATTN_MASTER_PORT",
               "RINGATTN_TOKEN")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@pytest.mark.timeout(120)
def test_cli_launch_over_two_nodes(tmp_path):
    """Two `ringattn launch`, one per node, on this machine: 4 ranks with
    global rank = node_rank * nprocs + local rank."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port = adjacent_free_ports()
    env = clean_env(RINGATTN_TOKEN="a secret both nodes share")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "ringattn", "launch", "--nnodes", "2",
         "--node-rank", str(node), "-n", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(port), "--timeout", "90", str(script),
         str(tmp_path)], env=env, cwd=ROOT) for node in (0, 1)]
    codes = [p.wait(timeout=110) for p in procs]
    assert codes == [0, 0] and ring_files(tmp_path, 4) == ring_expected(4, 2)


MPIRUN = shutil.which("mpirun")
needs_mpirun = pytest.mark.skipif(
    MPIRUN is None, reason="mpirun not installed (Debian: openmpi-bin)")


def mpirun(nprocs, script, *args, env=None):
    cmd = [MPIRUN, "-n", str(nprocs), "--oversubscribe"]
    env = clean_env(**(env or {}))
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd += [x for var in ("MASTER_PORT", "PYTHONPATH") if var in env
            for x in ("-x", var)]
    return subprocess.run(cmd + [sys.executable, str(script), *args],
                          env=env, capture_output=True, text=True,
                          timeout=100, cwd=ROOT)


@needs_mpirun
@pytest.mark.timeout(120)
def test_real_mpirun_ring(tmp_path):
    """Open MPI's ranks and local ranks reach ra.init(); MASTER_PORT is the
    one variable a one-machine mpirun needs."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    proc = mpirun(3, script, str(tmp_path),
                  env={"MASTER_PORT": str(adjacent_free_ports())})
    ok = proc.returncode == 0 and ring_files(tmp_path, 3) == ring_expected(3, 3)
    assert ok, proc.stdout + proc.stderr


@needs_mpirun
@pytest.mark.timeout(120)
def test_real_mpirun_without_a_port_says_what_to_set(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    proc = mpirun(2, script, str(tmp_path))
    out = proc.stdout + proc.stderr
    ok = (proc.returncode != 0 and "Open MPI started this process" in out
          and "set MASTER_PORT" in out
          and not (tmp_path / "rank0.txt").exists())
    assert ok, out
