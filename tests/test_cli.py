"""The command line: ``python -m ringattn demo | info | bench``.

Each command runs in a fresh interpreter (the way a user types it) with the
repository on PYTHONPATH, small sizes, and a timeout.
"""

import os
import subprocess
import sys

import pytest

import ringattn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(ringattn.__file__)))


def run_cli(*args, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [REPO] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
    return subprocess.run([sys.executable, "-m", "ringattn", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)


def describe(proc):
    return (f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout}"
            f"\n--- stderr ---\n{proc.stderr}")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", ["threads", "host"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_demo_passes(ranks, backend):
    """demo -n 512 on 2 and 3 ranks exits 0 and prints PASS."""
    proc = run_cli("demo", "-n", "512", "-p", str(ranks), "--backend",
                   backend, "--quiet")
    passed = proc.returncode == 0 and "PASS" in proc.stdout \
        and "FAIL" not in proc.stdout
    assert passed, describe(proc)


@pytest.mark.timeout(150)
def test_demo_gqa_layout_dtype_options():
    """Options reach the ring: GQA, striped, float64, not causal."""
    proc = run_cli("demo", "-n", "301", "-p", "3", "--backend", "threads",
                   "--layout", "striped", "--heads", "4", "--kv-heads", "2",
                   "--head-dim", "16", "--dtype", "float64", "--no-causal",
                   "--quiet")
    assert proc.returncode == 0 and "PASS" in proc.stdout, describe(proc)


@pytest.mark.timeout(60)
def test_info_reports_version_and_devices():
    proc = run_cli("info")
    ok = (proc.returncode == 0 and f"ringattn {ringattn.__version__}"
          in proc.stdout and "cpu:" in proc.stdout and "cuda:" in proc.stdout)
    assert ok, describe(proc)


@pytest.mark.timeout(120)
def test_bench_cpu_quick_prints_a_table():
    """bench --cpu --quick: a Markdown table with one row per case."""
    proc = run_cli("bench", "--cpu", "--quick", "--threads", "1",
                   "--repeat", "1")
    rows = [line for line in proc.stdout.splitlines()
            if line.startswith("|") and line.count("|") >= 4]
    assert proc.returncode == 0 and len(rows) >= 3, describe(proc)


@pytest.mark.timeout(60)
def test_no_command_prints_help():
    proc = run_cli()
    assert proc.returncode == 2 and "demo" in proc.stdout, describe(proc)
