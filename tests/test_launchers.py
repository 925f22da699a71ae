"""Launchers' environments: ``ra.init()`` reads torchrun, Open MPI,
MPICH/PMI and Slurm variables and refuses to guess a rendezvous an MPI
launcher did not set; ``ringattn launch`` checks its node flags.  Real
processes (several nodes, mpirun) are in test_launch.py."""

import subprocess
import sys

import pytest

import ringattn as ra
from ringattn.comm import LAUNCHER_ENV, _rank_and_size, launcher_env

ALL_VARS = {v for row in LAUNCHER_ENV for v in row[1:] if v} | {
    "SLURM_NTASKS", "SLURM_NNODES", "SLURM_STEP_NUM_NODES", "SLURM_STEP_ID",
    "SLURM_STEPID", "MASTER_ADDR", "MASTER_PORT", "RINGATTN_MASTER_PORT",
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
    "Slurm": {"SLURM_PROCID": "2", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0",
              "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "0",
              "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2"},
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHES))
def test_rank_and_size_come_from_each_launcher(clean_env, launcher):
    for var, value in LAUNCHES[launcher].items():
        clean_env.setenv(var, value)
    env = launcher_env()
    got = (env["launcher"], env["rank"], env["size"], env["local_rank"],
           _rank_and_size(None, None))
    assert got == (launcher, 2, 4, 0, (2, 4))


@pytest.mark.parametrize("step", [None, "batch", "4294967294", "extern"])
def test_slurm_batch_script_is_one_rank(clean_env, step):
    """A batch script of an --ntasks=4 allocation runs one process: the
    allocation's task count is not a world size to wait for."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NNODES": "1",
           "MASTER_PORT": "29613"}
    if step is not None:
        env.update(SLURM_STEP_ID=step, SLURM_STEP_NUM_TASKS="1")
    for var, value in env.items():
        clean_env.setenv(var, value)
    assert launcher_env() is None and _rank_and_size(None, None) == (0, 1)


def test_slurm_step_on_one_node_needs_only_a_port(clean_env):
    env = dict(LAUNCHES["Slurm"], SLURM_STEP_NUM_NODES="1")
    for var, value in env.items():
        clean_env.setenv(var, value)
    assert launcher_env()["local_size"] == 4
    clean_env.setenv("MASTER_PORT", "29500")
    assert _rank_and_size(None, None, (None, None)) == (2, 4)


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


# ---- ringattn launch's node flags -------------------------------------------

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
