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


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout,extra", [
    ("contiguous", ["--window", "40"]),
    ("zigzag", ["--window", "16,9", "--docs", "5", "--no-causal"]),
    ("striped", ["--docs", "12"]),
])
def test_demo_with_masks_passes_and_says_what_is_visible(layout, extra):
    """--window and --docs reach both runs: PASS, and a line with the share
    of the scores the masks leave visible."""
    proc = run_cli("demo", "-n", "400", "-p", "3", "--backend", "threads",
                   "--layout", layout, "--heads", "2", "--head-dim", "16",
                   "--quiet", *extra)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("masks:")]
    ok = proc.returncode == 0 and "PASS" in proc.stdout and len(lines) == 1 \
        and "scores visible" in lines[0]
    assert ok, describe(proc)


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


# ---- every flag checked: one line, exit 2, no traceback ----------------------

BAD_FLAGS = [
    (["demo", "--ranks", "0"], "--ranks"),
    (["demo", "--ranks", "-2"], "--ranks"),
    (["demo", "--seq-len", "-5"], "--seq-len"),
    (["demo", "--seq-len", "0"], "--seq-len"),
    (["demo", "--batch", "0"], "--batch"),
    (["demo", "--samples", "0"], "--samples"),
    (["demo", "--heads", "0"], "--heads"),
    (["demo", "--head-dim", "0"], "--head-dim"),
    (["demo", "--head-dim", "100000"], "--head-dim"),
    (["demo", "--heads", "6", "--kv-heads", "4"], "--kv-heads"),
    (["demo", "--kv-heads", "-1"], "--kv-heads"),
    (["demo", "--threads", "-1"], "--threads"),
    (["demo", "--seed", "-3"], "--seed"),
    (["demo", "--seq-len", "abc"], "--seq-len"),
    (["demo", "--layout", "diagonal"], "--layout"),
    (["demo", "--backend", "mpi"], "--backend"),
    (["demo", "--dtype", "int8"], "--dtype"),
    (["demo", "--window", "-1"], "--window"),
    (["demo", "--window", "8,-2"], "--window"),
    (["demo", "--window", "1,2,3"], "--window"),
    (["demo", "--window", "a"], "--window"),
    (["demo", "--window", ","], "--window"),
    (["demo", "--docs", "0"], "--docs"),
    (["demo", "--docs", "x"], "--docs"),
    (["demo", "-n", "16", "--docs", "17"], "--docs"),
    (["bench", "--repeat", "0"], "--repeat"),
    (["bench", "--threads", "-1"], "--threads"),
    (["bench", "--seq-lens", "512,0"], "--seq-lens"),
    (["bench", "--seq-lens", ","], "--seq-lens"),
    (["bench", "--seq-len", "0"], "--seq-len"),
    (["bench", "--plot", "/no/such/folder/x.png"], "--plot"),
    (["bench", "--dilated", "--plot", "x.png"], "--plot"),
    (["launch", "-n", "0", "job.py"], "--nprocs"),
    (["launch", "-n", "2", "--timeout", "-1", "job.py"], "--timeout"),
    (["launch", "-n", "2", "--master-port", "0", "job.py"], "--master-port"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, flag", BAD_FLAGS,
                         ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_exit_2(args, flag):
    proc = run_cli(*args)
    lines = proc.stderr.strip().splitlines()
    ok = (proc.returncode == 2 and len(lines) == 1 and flag in lines[0]
          and "Traceback" not in proc.stderr and not proc.stdout.strip())
    assert ok, describe(proc)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["demo", "bench", "launch"])
def test_help_shows_every_flag_with_help_and_default(command):
    from ringattn.cli import build_parser
    from ringattn.launch import _launch_parser

    parser = (_launch_parser() if command == "launch"
              else build_parser()[1][command])
    proc = run_cli(command, "--help")
    flags = [a for a in parser._actions
             if a.option_strings and a.help not in (None, "==SUPPRESS==")]
    missing = [a.option_strings[-1] for a in flags
               if a.option_strings[-1] not in proc.stdout]
    undocumented = [a.option_strings[-1] for a in flags if not a.help]
    no_default = [a.option_strings[-1] for a in flags
                  if a.default is not None and not a.required
                  and "--help" not in a.option_strings
                  and f"(default: {a.default})" not in " ".join(proc.stdout.split())]
    ok = (proc.returncode == 0 and not missing and not undocumented
          and not no_default)
    assert ok, (missing, undocumented, no_default, describe(proc))


@pytest.mark.timeout(60)
def test_version_flag():
    proc = run_cli("--version")
    assert proc.returncode == 0 and \
        proc.stdout.strip() == f"ringattn {ringattn.__version__}", describe(proc)


@pytest.mark.timeout(150)
def test_demo_progress_is_plain_lines_off_a_terminal():
    """stderr is a pipe here: one line per ring step, no carriage return."""
    proc = run_cli("demo", "-n", "96", "-p", "2", "--backend", "threads",
                   "--heads", "2", "--head-dim", "8")
    steps = [line for line in proc.stderr.splitlines() if "ring step" in line]
    ok = (proc.returncode == 0 and "\r" not in proc.stderr and len(steps) == 4)
    assert ok, describe(proc)


@pytest.mark.timeout(150)
def test_demo_threads_memory_is_labelled_process_wide():
    proc = run_cli("demo", "-n", "96", "-p", "2", "--backend", "threads",
                   "--heads", "2", "--head-dim", "8", "--quiet")
    ok = (proc.returncode == 0 and "all 2 ranks together" in proc.stdout
          and "not measurable with the threads backend" in proc.stdout)
    assert ok, describe(proc)


def test_demo_relative_error_is_what_it_says():
    """max |got - ref| / max |ref|, with no floor of 1 under max |ref|."""
    import numpy as np

    from ringattn.demo import relative_error

    ref = np.array([0.01, -0.02, -np.inf])
    got = np.array([0.011, -0.02, -np.inf])
    zero = np.zeros(3)
    assert (np.isclose(relative_error(got, ref), 0.001 / 0.02)
            and relative_error(zero, zero) == 0.0
            and relative_error(zero + 1e-9, zero) == float("inf")
            and relative_error(np.array([0.01, -0.02, 5.0]), ref)
            == float("inf"))


@pytest.mark.timeout(300)
def test_bench_ring_prints_each_row_once(tmp_path):
    proc = run_cli("bench", "--ring", "--quick", "--repeat", "1",
                   "--seq-len", "1000", timeout=280)
    rows = [line for line in proc.stdout.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    ok = (proc.returncode == 0 and len(rows) == 6 == len(set(rows))
          and "peak MiB/rank" in proc.stdout and "n=1000," in proc.stdout)
    assert ok, describe(proc)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra", [[], ["--ring"]])
def test_bench_gpu_without_a_gpu_fails_saying_why(extra):
    if ringattn.cuda_available():
        pytest.skip("a GPU is available")
    proc = run_cli("bench", "--gpu", *extra)
    out = proc.stdout + proc.stderr
    ok = (proc.returncode != 0 and "no usable GPU" in out
          and "Traceback" not in out)
    assert ok, describe(proc)


@pytest.mark.timeout(300)
def test_bench_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    image = tmp_path / "bench.png"
    proc = run_cli("bench", "--cpu", "--quick", "--threads", "1",
                   "--repeat", "1", "--seq-lens", "64,128", "--plot",
                   str(image), timeout=280)
    ok = (proc.returncode == 0 and image.exists()
          and image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n")
    assert ok, describe(proc)


@pytest.mark.timeout(60)
def test_bench_plot_without_matplotlib_says_so():
    code = ("import sys; sys.modules['matplotlib'] = None; "
            "from ringattn.cli import main; "
            "sys.exit(main(['bench', '--plot', 'x.png']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=50)
    lines = proc.stderr.strip().splitlines()
    ok = (proc.returncode == 2 and len(lines) == 1
          and "pip install matplotlib" in lines[0])
    assert ok, describe(proc)


# ---- the demo's backend choice: nccl where it can run, else host ------------

def _fake_machine(monkeypatch, devices, nccl, emulated=False):
    import ringattn as ra

    info = {"built": True, "available": devices > 0,
            "reason": "" if devices else "no CUDA device", "devices": devices,
            "emulated": emulated, "device_name": ""}
    monkeypatch.setattr(ra, "cuda_info", lambda: dict(info))
    monkeypatch.setattr(ra, "nccl_version", lambda: nccl)


@pytest.mark.parametrize("devices, nccl, ranks, expected", [
    (0, None, 4, (False, "no usable CUDA device", False)),
    (0, (2, 30, 0), 1, (False, "no usable CUDA device", False)),
    (1, None, 1, (False, "NCCL cannot be loaded", False)),
    (1, (2, 28, 3), 1, (True, "", False)),
    (1, (2, 28, 3), 2, (False, "need NCCL >= 2.30", False)),
    (1, (2, 30, 0), 4, (True, "", True)),
    (4, (2, 21, 5), 4, (True, "", False)),
    (2, (2, 30, 1), 3, (True, "", True)),
])
def test_nccl_plan(monkeypatch, devices, nccl, ranks, expected):
    from ringattn.demo import nccl_plan

    _fake_machine(monkeypatch, devices, nccl)
    ok, why, share = nccl_plan(ranks)
    assert (ok, share) == (expected[0], expected[2])
    assert expected[1] in why and (why == "") == ok


@pytest.mark.parametrize("devices, nccl, asked, expected, note", [
    (0, None, "auto", "host", None),
    (1, (2, 30, 0), "auto", "nccl", None),
    (1, (2, 28, 0), "auto", "host", "need NCCL >= 2.30"),
    (1, None, "auto", "host", "NCCL cannot be loaded"),
    (1, (2, 30, 0), "threads", "threads", None),
    (0, None, "nccl", "nccl", None),
])
def test_demo_auto_backend(monkeypatch, devices, nccl, asked, expected, note):
    from ringattn.demo import choose_backend

    _fake_machine(monkeypatch, devices, nccl)
    backend, said = choose_backend(asked, 4)
    assert backend == expected
    assert (said is None) if note is None else (note in said)


@pytest.mark.parametrize("asked, expected", [("auto", "host"), ("nccl", "nccl")])
def test_demo_auto_backend_on_the_emulated_gpu(monkeypatch, asked, expected):
    """The emulated GPU runs the kernels on the CPU: auto takes the CPU
    kernels (and says why); --backend nccl still runs there."""
    from ringattn.demo import choose_backend

    _fake_machine(monkeypatch, 2, (2, 30, 0), emulated=True)
    backend, said = choose_backend(asked, 4)
    assert backend == expected
    assert (said is None) if asked == "nccl" else ("emulated GPU" in said)


@pytest.mark.timeout(60)
def test_demo_nccl_that_cannot_run_is_one_line_exit_2():
    from ringattn.demo import nccl_plan

    ok, why, _ = nccl_plan(4)
    if ok:
        pytest.skip("NCCL can run 4 ranks here (tests/test_nccl.py runs it)")
    proc = run_cli("demo", "--backend", "nccl")
    lines = proc.stderr.strip().splitlines()
    assert (proc.returncode == 2 and len(lines) == 1 and "--backend" in lines[0]
            and why in lines[0] and not proc.stdout.strip()), describe(proc)


def test_demo_auto_falls_back_to_host_when_nccl_fails(monkeypatch, capsys):
    """auto picked nccl and the run failed: the demo says so and runs the
    ranks on the host backend; an explicit --backend nccl would raise."""
    from ringattn import demo
    from ringattn.cli import build_parser

    _fake_machine(monkeypatch, 1, (2, 30, 0))
    real_launch, tried = demo._launch, []

    def launch(cfg, ranks, backend):
        tried.append(backend)
        if backend == "nccl":
            raise RuntimeError("ncclCommInitRank failed: unhandled cuda error\nmore")
        return real_launch(cfg, ranks, backend)

    monkeypatch.setattr(demo, "_launch", launch)
    args = build_parser()[0].parse_args(["demo", "-n", "96", "-p", "2", "--heads", "2",
                                         "--head-dim", "8", "--quiet"])
    assert demo.run(args) == 0
    out = capsys.readouterr().out
    assert tried == ["nccl", "host"]
    assert "auto: the nccl run failed (RuntimeError: ncclCommInitRank failed: " \
           "unhandled cuda error)" in out and "PASS" in out
    args.backend = "nccl"
    with pytest.raises(RuntimeError, match="ncclCommInitRank"):
        demo.run(args)
