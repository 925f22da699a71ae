"""The examples stay true: each script and the notebook's code run, check
their result against single-rank attention, and fail loudly (non-zero exit)
when the result is wrong."""

import json
import os
import re
import subprocess
import sys

import pytest

import ringattn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ringattn.__file__)))  # where ringattn is imported from
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples")
NOTEBOOK = os.path.join(EXAMPLES, "ring_on_threads.ipynb")
SCRIPTS = ["ring_threads.py", "dilated_ring.py", "ulysses_threads.py"]

# run an example with ra.unshard returning results 1% off: a wrong answer
BREAK_UNSHARD = """
import runpy, sys
import ringattn as ra
right = ra.unshard
ra.unshard = lambda *a, **k: right(*a, **k) * 1.01
runpy.run_path(sys.argv[1], run_name="__main__")
"""


def _run(args):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    # cwd: where ringattn is imported from (`-c` puts the cwd on sys.path)
    return subprocess.run([sys.executable, *args], capture_output=True,
                          text=True, env=env, timeout=240, cwd=ROOT)


def _relative_errors(text):
    return [float(x) for x in
            re.findall(r"/ max \|single(?: rank)?\| =\s*([0-9.e+-]+)", text)]


def _notebook_code():
    nb = json.load(open(NOTEBOOK))
    return "\n".join("".join(c["source"]) for c in nb["cells"]
                     if c["cell_type"] == "code")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", SCRIPTS)
def test_example_script_agrees_with_single_rank(script):
    proc = _run([os.path.join(EXAMPLES, script)])
    errors = _relative_errors(proc.stdout)
    ok = (proc.returncode == 0 and "PASS" in proc.stdout and errors
          and max(errors) < 1e-4)
    assert ok, proc.stdout + proc.stderr[-2000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", SCRIPTS)
def test_example_script_fails_loudly_on_a_wrong_answer(script):
    proc = _run(["-c", BREAK_UNSHARD, os.path.join(EXAMPLES, script)])
    ok = (proc.returncode != 0 and "FAIL" in proc.stderr
          and "PASS" not in proc.stdout)
    assert ok, proc.stdout + proc.stderr[-2000:]


@pytest.mark.timeout(300)
def test_notebook_code_runs_and_agrees():
    proc = _run(["-c", _notebook_code()])
    errors = _relative_errors(proc.stdout)
    ok = proc.returncode == 0 and len(errors) == 2 and max(errors) < 1e-4
    assert ok, proc.stdout + proc.stderr[-2000:]


@pytest.mark.timeout(300)
def test_notebook_fails_loudly_on_a_wrong_answer(tmp_path):
    code = tmp_path / "notebook.py"
    code.write_text(_notebook_code())
    proc = _run(["-c", BREAK_UNSHARD, str(code)])
    assert proc.returncode != 0 and "AssertionError" in proc.stderr, \
        proc.stderr[-2000:]


def test_notebook_cells_have_ids():
    """nbformat 4.5: every cell has a unique id (no warning on load)."""
    nb = json.load(open(NOTEBOOK))
    ids = [c.get("id") for c in nb["cells"]]
    assert (nb["nbformat"], nb["nbformat_minor"]) >= (4, 5) and all(ids) \
        and len(set(ids)) == len(ids), ids
