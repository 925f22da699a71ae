"""Launchers: ``ra.init()`` reads torchrun, Open MPI, MPICH/PMI and Slurm
environments and refuses to guess a rendezvous an MPI launcher did not set;
``ringattn launch`` runs one job over several "nodes" (here: two launches on
this machine); and a real ``mpirun`` where Open MPI is installed."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import ringattn as ra
from ringattn.comm import LAUNCHER_ENV, _rank_and_size, launcher_env
from ringattn.launch import free_port

ALL_VARS = {v for row in LAUNCHER_ENV for v in row[1:] if v} | {
    "SLURM_NNODES", "MASTER_ADDR", "MASTER_PORT", "RINGATTN_MASTER_PORT",
    "RINGATTN_TOKEN"}


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variable from the surrounding environment."""
    for var in ALL_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


LAUNCHES = {
    "torchrun": {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                 "LOCAL_WORLD_SIZE": "2"},
    "Open MPI": {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                 "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                 "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
    "MPICH/PMI": {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0",
                  "MPI_LOCALNRANKS": "2"},
    "Slurm": {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
              "SLURM_NNODES": "2"},
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHES))
def test_rank_and_size_come_from_each_launcher(clean_env, launcher):
    for var, value in LAUNCHES[launcher].items():
        clean_env.setenv(var, value)
    env = launcher_env()
    got = (env["launcher"], env["rank"], env["size"], env["local_rank"],
           _rank_and_size(None, None))
    assert got == (launcher, 2, 4, 0, (2, 4))


def test_rank_and_world_size_win_over_mpi(clean_env):
    for var, value in {**LAUNCHES["Open MPI"], "RANK": "1",
                       "WORLD_SIZE": "3"}.items():
        clean_env.setenv(var, value)
    assert _rank_and_size(None, None) == (1, 3)


def test_no_launcher_means_one_rank(clean_env):
    assert launcher_env() is None and _rank_and_size(None, None) == (0, 1)


@pytest.mark.parametrize("launcher", ["Open MPI", "MPICH/PMI", "Slurm"])
def test_mpi_launch_without_a_rendezvous_names_the_variables(clean_env,
                                                             launcher):
    """Never N single-rank jobs, never a wait for peers that cannot come."""
    for var, value in LAUNCHES[launcher].items():
        clean_env.setenv(var, value)
    with pytest.raises(ValueError) as info:
        ra.init(backend="host", timeout=5)
    msg = str(info.value)
    assert (launcher in msg and "rank 2 of 4" in msg and "MASTER_PORT" in msg
            and "RINGATTN_MASTER_PORT" in msg and "MASTER_ADDR" in msg), msg


def test_mpi_on_one_node_needs_only_a_port(clean_env):
    env = dict(LAUNCHES["Open MPI"], OMPI_COMM_WORLD_LOCAL_SIZE="4")
    for var, value in env.items():
        clean_env.setenv(var, value)
    with pytest.raises(ValueError, match="set MASTER_PORT") as info:
        _rank_and_size(None, None, (None, None))
    assert "MASTER_ADDR" not in str(info.value)
    clean_env.setenv("MASTER_PORT", "29500")
    assert _rank_and_size(None, None, (None, None)) == (2, 4)


def test_mpi_rendezvous_from_arguments_is_enough(clean_env):
    for var, value in LAUNCHES["Slurm"].items():
        clean_env.setenv(var, value)
    assert _rank_and_size(None, None, ("10.0.0.1", 29500)) == (2, 4)


def test_bad_launcher_variable_is_named(clean_env):
    clean_env.setenv("PMI_RANK", "one")
    clean_env.setenv("PMI_SIZE", "2")
    with pytest.raises(ValueError, match="PMI_RANK must be an integer"):
        _rank_and_size(None, None)


# ---- real processes ---------------------------------------------------------

RING_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    import ringattn as ra
    comm = ra.init(timeout=60)
    send = np.full(3, float(comm.rank))
    recv = np.empty(3)
    comm.sendrecv(send, (comm.rank + 1) % comm.size, recv,
                  (comm.rank - 1) % comm.size)
    with open(os.path.join(sys.argv[1], f"rank{comm.rank}.txt"), "w") as f:
        f.write(f"{comm.size} {recv[0]:.0f}")
    comm.barrier()
    comm.close()
""")


def _ring_files(folder, size):
    return sorted((folder / f"rank{r}.txt").read_text() for r in range(size))


def _expected(size):
    return sorted(f"{size} {(r - 1) % size}" for r in range(size))


def _port_pair():
    """A port P with P + 1 free too (ringattn's rendezvous is P + 1)."""
    for _ in range(20):
        p = free_port()
        if p < 65535 and p + 1 == _try_bind(p + 1):
            return p
    pytest.skip("no free pair of adjacent ports")


def _try_bind(p):
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", p))
        except OSError:
            return None
    return p


@pytest.mark.timeout(120)
def test_launch_over_two_nodes(tmp_path, clean_env):
    """Two `ringattn launch` on this machine, one per node: 4 ranks."""
    script = tmp_path / "job.py"
    script.write_text(RING_SCRIPT)
    port = _port_pair()
    env = dict(os.environ, RINGATTN_TOKEN="shared-secret-of-this-test")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "ringattn", "launch", "--nnodes", "2",
         "--node-rank", str(node), "-n", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(port), "--timeout", "90", str(script),
         str(tmp_path)], env=env, cwd=tmp_path) for node in (0, 1)]
    codes = [p.wait(timeout=110) for p in procs]
    assert codes == [0, 0] and _ring_files(tmp_path, 4) == _expected(4)


@pytest.mark.parametrize("args, flag", [
    (["--nnodes", "2", "--master-port", "29500"], "--master-addr"),
    (["--nnodes", "2", "--master-addr", "10.0.0.1"], "--master-port"),
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank"),
    (["--master-port", "70000"], "--master-port"),
    (["--nnodes", "0"], "--nnodes"),
])
def test_launch_node_flags_are_checked(tmp_path, args, flag):
    proc = subprocess.run(
        [sys.executable, "-m", "ringattn", "launch", "-n", "1", *args,
         "job.py"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    ok = (proc.returncode == 2 and len(lines) == 1 and flag in lines[0]
          and "Traceback" not in proc.stderr)
    assert ok, proc.stderr


MPIRUN = shutil.which("mpirun")
needs_mpirun = pytest.mark.skipif(
    MPIRUN is None, reason="mpirun not installed (Debian: openmpi-bin)")


def _mpirun(nprocs, script, *args, extra_env=()):
    cmd = [MPIRUN, "-n", str(nprocs), "--oversubscribe"]
    env = dict(os.environ)
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for var in extra_env:
        cmd += ["-x", var]
    for var in ALL_VARS:
        if var not in extra_env:
            env.pop(var, None)
    env.update(extra_env)
    return subprocess.run(cmd + [sys.executable, str(script), *args],
                          env=env, capture_output=True, text=True, timeout=100)


@needs_mpirun
@pytest.mark.timeout(120)
def test_real_mpirun_ring(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(RING_SCRIPT)
    proc = _mpirun(3, script, str(tmp_path),
                   extra_env={"MASTER_PORT": str(_port_pair())})
    ok = proc.returncode == 0 and _ring_files(tmp_path, 3) == _expected(3)
    assert ok, proc.stdout + proc.stderr


@needs_mpirun
@pytest.mark.timeout(120)
def test_real_mpirun_without_a_port_says_what_to_set(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(RING_SCRIPT)
    proc = _mpirun(2, script, str(tmp_path))
    out = proc.stdout + proc.stderr
    ok = (proc.returncode != 0 and "Open MPI started this process" in out
          and "set MASTER_PORT" in out
          and not (tmp_path / "rank0.txt").exists())
    assert ok, out
