"""Python started at the root of a clone: the clone's ``ringattn/`` (no
compiled core) must not shadow the installed package, and without an
installed package the ImportError says what to do.  Each case runs in a
fresh interpreter from a copy of the source tree's Python files."""

import glob
import os
import shutil
import subprocess
import sys

import pytest

import ringattn

SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "ringattn")
INSTALLED = os.path.dirname(os.path.abspath(ringattn.__file__))

pytestmark = pytest.mark.skipif(
    os.path.realpath(SOURCE) == os.path.realpath(INSTALLED),
    reason="ringattn is imported from this source tree (in-place build)")


@pytest.fixture
def clone_root(tmp_path):
    """A folder holding a core-less copy of ringattn/, like a fresh clone."""
    pkg = tmp_path / "ringattn"
    pkg.mkdir()
    for path in glob.glob(os.path.join(SOURCE, "*.py")):
        shutil.copy(path, pkg)
    return tmp_path


def python(cwd, *args, env=None, timeout=120):
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc


def describe(proc):
    return (f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout}"
            f"\n--- stderr ---\n{proc.stderr}")


def test_import_at_the_root_uses_the_installed_package(clone_root):
    proc = python(clone_root, "-c",
                  "import ringattn, ringattn.layout as l; from ringattn import _C; "
                  "print(ringattn.__file__); print(l.__file__); "
                  "print(ringattn.attention.__module__)")
    lines = proc.stdout.split()
    ok = (proc.returncode == 0 and len(lines) == 3
          and all(x.startswith(INSTALLED) for x in lines[:2]))
    assert ok, describe(proc)


def test_python_m_ringattn_at_the_root_runs_the_installed_cli(clone_root):
    proc = python(clone_root, "-m", "ringattn", "info")
    ok = proc.returncode == 0 and f"ringattn {ringattn.__version__}" in proc.stdout
    assert ok, describe(proc)


@pytest.mark.timeout(150)
def test_demo_with_spawned_ranks_at_the_root(clone_root):
    """Spawned ranks inherit sys.path (the clone first) and hand over too."""
    proc = python(clone_root, "-m", "ringattn", "demo", "-n", "64", "-p", "2",
                  "--backend", "host", "--heads", "2", "--head-dim", "8",
                  "--quiet", timeout=140)
    assert proc.returncode == 0 and "PASS" in proc.stdout, describe(proc)


def test_without_an_installed_copy_the_error_says_what_to_do(clone_root):
    # -S: no site-packages, so the only ringattn is the core-less copy
    env = dict(os.environ, PYTHONPATH=str(clone_root))
    proc = python(clone_root, "-S", "-c", "import ringattn", env=env)
    err = proc.stderr
    ok = (proc.returncode != 0 and "ImportError" in err
          and "without its compiled core" in err and "pip install" in err
          and "build_ext --inplace" in err and "circular import" not in err)
    assert ok, describe(proc)


def test_an_in_place_build_is_used_where_it_is(clone_root):
    """A compiled core next to the sources (build_ext --inplace) wins."""
    for core in glob.glob(os.path.join(INSTALLED, "_C*")):
        shutil.copy(core, clone_root / "ringattn")
    proc = python(clone_root, "-c", "import ringattn; print(ringattn.__file__)")
    ok = (proc.returncode == 0 and proc.stdout.strip()
          == str(clone_root / "ringattn" / "__init__.py"))
    assert ok, describe(proc)
