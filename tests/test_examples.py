"""The examples stay true: each script and the notebook's code run and
report agreement with single-rank attention."""

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


def _run(code_or_path, is_code=False):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-c", code_or_path] if is_code else [sys.executable, code_or_path]
    # cwd: where ringattn is imported from (`-c` puts the cwd on sys.path)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env,
                         timeout=240, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def _max_errors(text):
    return [float(x) for x in re.findall(r"=\s*([0-9.]+e[-+][0-9]+|[0-9.]+)\s*$", text, re.M)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", ["ring_threads.py", "dilated_ring.py"])
def test_example_script_agrees_with_single_rank(script):
    out = _run(os.path.join(EXAMPLES, script))
    errors = _max_errors(out)
    assert errors and max(errors) < 1e-3, out


@pytest.mark.timeout(300)
def test_notebook_code_runs_and_agrees():
    nb = json.load(open(os.path.join(EXAMPLES, "ring_on_threads.ipynb")))
    code = "\n".join("".join(c["source"]) for c in nb["cells"]
                     if c["cell_type"] == "code")
    out = _run(code, is_code=True)
    errors = [float(x) for x in re.findall(r"max \|ring - single rank\| = ([0-9.e+-]+)", out)]
    assert len(errors) == 2 and max(errors) < 1e-3, out
