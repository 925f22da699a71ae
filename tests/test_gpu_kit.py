"""tools/gpu_check.sh keeps its promises without a GPU to run it: the
sanitizer's kernel filter names every ringattn kernel (by its mangled and
its demangled name) and the canary that proves the filter matches, the ptx
stage (the PTX conformance program) comes first after the build and needs
no installed package, the threadring stage runs the thread-rank tests and
is documented, the script parses, the ``--repeat N`` option its tests
stage uses (tests/conftest.py) runs a test N times, and, with stand-ins
for python, nvcc and compute-sanitizer, ``all`` runs the correctness
stages concurrently and the timing stages alone after them, carries every
verdict to the summary and reports a stage past the budget as timed out."""

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")
CANARY = os.path.join(ROOT, "tools", "sanitizer_canary.cu")
KERNEL_SOURCES = sorted(glob.glob(os.path.join(ROOT, "cuda", "**", "*.cu"), recursive=True) +
                        glob.glob(os.path.join(ROOT, "cuda", "**", "*.cuh"), recursive=True))

pytestmark = pytest.mark.skipif(not os.path.exists(SCRIPT),
                                reason="no tools/ in this tree")


def _script_var(name):
    text = open(SCRIPT).read()
    found = re.search(rf"^{name}='([^']*)'$", text, re.M)
    assert found, f"{name} not found in gpu_check.sh"
    return found.group(1)


def _kernel_filter():
    """The regex of the script's --kernel-name regex=..., built as it does."""
    files, names = _script_var("KERNEL_FILES"), _script_var("KERNEL_NAMES")
    return re.compile(rf"(_GLOBAL__N__[0-9a-f]+_[0-9]+_({files})_cu_|({names})_kernel)")


def _global_kernels(path):
    text = open(path).read()
    return set(re.findall(r"__global__\s+(?:static\s+)?void\s+"
                          r"(?:__launch_bounds__\([^()]*(?:\([^()]*\))?[^()]*\)\s+)?"
                          r"(\w+)\s*\(", text))


def test_filter_names_every_kernel_file_and_kernel():
    files = re.compile(rf"({_script_var('KERNEL_FILES')})")
    names = re.compile(rf"({_script_var('KERNEL_NAMES')})_kernel")
    sources = [p for p in KERNEL_SOURCES if p.endswith(".cu")] + [CANARY]
    stems = [os.path.basename(p)[:-3] for p in sources]
    kernels = set().union(*(_global_kernels(p) for p in KERNEL_SOURCES + [CANARY]))
    assert kernels, "no __global__ kernel found"
    missing = ([s for s in stems if not files.fullmatch(s)] +
               sorted(k for k in kernels if not names.fullmatch(k)))
    assert not missing, f"not in gpu_check.sh's kernel filter: {missing}"


@pytest.mark.parametrize("name", [
    "_ZN44_GLOBAL__N__a425848a_11_attn_bwd_cu_17ebf39712delta_kernelIfEEv18ra_attn_bwd_params",
    "_ZN40_GLOBAL__N__85efb046_8_merge_cu_a47a8c5712merge_kernelIdEEv15ra_merge_params",
    "(anonymous namespace)::fwd_tc_kernel<__nv_bfloat16, 128>(ra_attn_fwd_params, long)",
    "(anonymous namespace)::sanitizer_canary_kernel(float*, int)",
])
def test_filter_matches_mangled_and_demangled_names(name):
    assert _kernel_filter().search(name)


@pytest.mark.parametrize("name", [
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
    "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEEEEvi",
])
def test_filter_leaves_other_kernels_out(name):
    assert not _kernel_filter().search(name)


def test_ptx_stage_runs_first_after_the_build_without_the_package():
    text = open(SCRIPT).read()
    stages = _script_var_dq("ALL_STAGES").split()
    assert stages[:2] == ["build", "ptx"], stages
    assert re.search(r"^stage_ptx\(\)", text, re.M)
    assert '[ "$stage" != ptx ]' in text   # runs even when the build failed
    assert "ptx_conformance.expected" in text and "-arch=sm_90a" in text
    readme = open(os.path.join(ROOT, "tools", "README.md")).read()
    assert "tools/gpu_check.sh all" in readme
    phases = readme.split("| phase |")[1].split("\n\n")[0]
    assert "| 3 | ~3.5 | `ptx`, `selftest`" in phases, phases


def _script_var_dq(name):
    found = re.search(rf'^{name}="([^"]*)"$', open(SCRIPT).read(), re.M)
    assert found, f"{name} not found in gpu_check.sh"
    return found.group(1)


def test_threadring_stage_runs_the_thread_rank_tests_and_is_documented():
    text = open(SCRIPT).read()
    assert "threadring" in _script_var_dq("ALL_STAGES").split()
    body = re.search(r"^stage_threadring\(\) \{\n(.*?)^\}", text, re.M | re.S)
    assert body and "tests/test_threads_cuda.py" in body.group(1)
    assert os.path.exists(os.path.join(ROOT, "tests", "test_threads_cuda.py"))
    readme = open(os.path.join(ROOT, "tools", "README.md")).read()
    assert "| `threadring` |" in readme and "`threadring`" in readme.split("| phase |")[1]
    # the ring bench takes the sequence length the kit passes it
    assert '--seq-len "$RINGBENCH_SEQ_LEN"' in text
    from ringattn.cli import build_parser
    args = build_parser()[0].parse_args(["bench", "--ring", "--gpu", "--seq-len", "4096"])
    assert args.seq_len == 4096


def test_script_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


def test_repeat_option_runs_each_test_n_times():
    here = os.path.join(ROOT, "tests", "test_gpu_kit.py")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--repeat", "3", f"{here}::test_script_parses"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 passed" in r.stdout, r.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None and
                    not os.path.exists("/usr/local/cuda/bin/nvcc"),
                    reason="no nvcc (CUDA toolkit) here")
def test_canary_compiles(tmp_path):
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    # nvcc's own tools do not run under a preloaded sanitizer runtime (the
    # suite also runs with ASan preloaded); the canary compiles as it would
    # on the GPU machine
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    subprocess.run([nvcc, "-O1", "-arch=sm_90", CANARY, "-o",
                    str(tmp_path / "canary")], check=True, timeout=300, env=env)


# ---- the one-call run, without a GPU ----------------------------------------
# gpu_check.sh runs here against stand-ins on PATH: a python that fakes
# pytest, pip and `ringattn bench` (and runs the real interpreter, with a
# stand-in ringattn and torch, for everything else), an nvcc whose outputs
# are copies of the stand-in (the selftest, the PTX program, the canary),
# gcc and compute-sanitizer.  Each faked piece of work appends
# "<name> start|end <time>" to a trace file and sleeps FAKE_SLEEP seconds
# (FAKE_HANG: until killed); FAKE_FAIL names the ones that fail.

FAKE = r'''#!/bin/bash
me="$(basename "$0")"
work() {
    echo "$1 start $(date +%s.%N)" >>"$FAKE_TRACE"
    if [[ " $FAKE_HANG " == *" $1 "* ]]; then sleep 1000; fi
    sleep "$FAKE_SLEEP"
    echo "$1 end $(date +%s.%N)" >>"$FAKE_TRACE"
}
fails() { [[ " $FAKE_FAIL " == *" $1 "* ]]; }
output() {  # the value of option $1 in the rest of the arguments
    local want="$1" prev= a; shift
    for a; do [ "$prev" = "$want" ] && echo "$a"; prev="$a"; done
}
case "$me" in
python)
    if [ "$1" = -m ] && [ "$2" = pytest ]; then
        for a; do case "$a" in --junitxml=*) xml="${a#--junitxml=}" ;; esac; done
        name="$(basename "$xml" .xml)"
        work "$name"
        if fails "$name"; then
            echo '<testsuite><testcase name="t"><failure/></testcase></testsuite>' >"$xml"
            echo "FAILED test_fake.py::t"; exit 1
        fi
        echo '<testsuite><testcase name="t"/><testcase name="u"/></testsuite>' >"$xml"
        echo "2 passed"; exit 0
    elif [ "$1" = -m ] && [ "$2" = ringattn ]; then
        name=bench; prefix=bench-gpu
        [[ " $* " == *" --ring "* ]] && { name=ringbench; prefix=bench-gpu-ring; }
        work "$name"
        echo "$prefix: fake $name numbers"
        fails "$name" && exit 1; exit 0
    elif [ "$1" = -m ] && [ "$2" = pip ]; then
        exit 0
    fi
    exec "$FAKE_REAL_PYTHON" "$@" ;;
nvcc)
    [ "$1" = --version ] && { echo "Cuda compilation tools, release 13.0"; exit 0; }
    out="$(output -o "$@")"; cp "$0" "$out" && chmod +x "$out" ;;
gcc)
    out="$(output -o "$@")"; : >"$out" ;;
nvidia-smi)
    echo "Fake GPU, 0.0" ;;
compute-sanitizer)
    tool="$(output --tool "$@")"
    case "${*: -1}" in
        */canary) echo "========= Invalid __global__ write of size 4 bytes"; exit 9 ;;
        */sanitize_case.py) work sanitize_python; echo "sanitize case done" ;;
        quick) work "sanitize_$tool"; echo "========= ERROR SUMMARY: 0 errors"
               fails "sanitize_$tool" && exit 9 ;;
    esac
    exit 0 ;;
selftest)
    work selftest; echo "selftest full: 0 of 5 cases failed" ;;
ptx_conformance)
    work ptx; echo "ptx_conformance: 3 of 3 digests match"; echo "overall 0123abcd" ;;
ncu)
    if [[ " $* " == *" --query-metrics "* ]]; then
        echo "lts__t_sectors_op_red      # of sectors reduced at L2"
        echo "sm__cycles_elapsed         # of cycles elapsed"; exit 0
    elif [[ " $* " == *" --import "* ]]; then
        echo '==PROF== a note that is not CSV'
        echo '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"'
        echo '"0","fwd_wg_kernel<__nv_bfloat16, 64, false>","SOL","Duration","usecond","640.5"'
        echo '"0","fwd_wg_kernel<__nv_bfloat16, 64, false>","LS","Registers Per Thread","register/thread","168"'
        exit 0
    fi
    echo "$*" >"$FAKE_TRACE.ncu"
    work profile; echo "profile case done"
    fails profile && exit 1; exit 0 ;;
esac
exit 0
'''

FAKE_MODULES = {
    "ringattn/__init__.py": (
        "def cuda_available():\n    return True\n"
        "def cuda_info():\n    return {'built': True, 'available': True, 'devices': 1,"
        " 'reason': '', 'forward_kernels': 'fake'}\n"
        "def nccl_version():\n    return '2.30.0'\n"),
    "torch/__init__.py": (
        "__version__ = '0.fake'\n"
        "class cuda:\n    is_available = staticmethod(lambda: True)\n"
        "class version:\n    cuda = '13.0'\n"),
}


def _start_kit(tmp, stages, **env_extra):
    """gpu_check.sh STAGES with the stand-ins, as a Popen; returns
    (process, trace file, out folder)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name in ["python", "nvcc", "gcc", "nvidia-smi", "compute-sanitizer", "ncu"]:
        (bin_dir / name).write_text(FAKE)
        (bin_dir / name).chmod(0o755)
    for rel, text in FAKE_MODULES.items():
        (tmp / "modules" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / "modules" / rel).write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OUT")}
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}", CUDA_HOME=str(tmp),
               PYTHON=str(bin_dir / "python"), PYTHONPATH=str(tmp / "modules"),
               FAKE_REAL_PYTHON=sys.executable, FAKE_TRACE=str(tmp / "trace"),
               FAKE_SLEEP="1.5", FAKE_HANG="", FAKE_FAIL="",
               GPU_CHECK_WORK=str(tmp / "work"), OUT=str(tmp / "out"))
    env.update(env_extra)
    proc = subprocess.Popen(["bash", SCRIPT, *stages], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc, tmp / "trace", tmp / "out"


def _trace(path):
    spans = {}
    for line in path.read_text().splitlines():
        name, what, when = line.split()
        spans.setdefault(name, {})[what] = float(when)
    return spans


def _summary(stdout):
    return dict(re.findall(r"^SUMMARY ([\w-]+): (.*)$", stdout, re.M))


def test_one_call_runs_the_correctness_stages_concurrently(tmp_path):
    """`all`: the correctness stages overlap (and the sanitizer tools within
    sanitize), bench and ringbench run after every one of them has ended
    and one after the other, PASS and FAIL verdicts of background stages
    reach the SUMMARY lines, the output stays in stage order, the archive is
    written.  A stage that runs past the budget (a second run, alongside)
    is killed and reported timed out, and the others still pass."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    proc, trace, out = _start_kit(tmp_path / "a", ["all"], FAKE_FAIL="nccl sanitize_synccheck")
    # the budget less the time kept for the timing stages leaves the
    # background stages ~8 s: threadring never ends
    hung, hung_trace, _ = _start_kit(tmp_path / "b", ["ptx", "threadring"],
                                     FAKE_HANG="threadring", GPU_CHECK_BUDGET="45",
                                     GPU_CHECK_RESERVE="16")
    stdout = proc.communicate(timeout=120)[0]
    hung_stdout = hung.communicate(timeout=120)[0]

    assert proc.returncode == 1, stdout              # nccl and synccheck fail
    summary = _summary(stdout)
    assert list(summary) == ["env", "build", "ptx", "selftest", "tests", "repeat-docs",
                             "repeat-lifetime", "sanitize", "nccl", "threadring", "bench",
                             "ringbench"], stdout
    for stage in ["build", "ptx", "selftest", "tests", "repeat-docs", "repeat-lifetime",
                  "threadring", "bench", "ringbench"]:
        assert summary[stage].startswith("PASS"), (stage, stdout)
    assert summary["nccl"].startswith("FAIL rc=1; 0 passed, 1 failed"), stdout
    assert summary["nccl"].endswith("; NCCL 2.30.0"), stdout
    assert summary["sanitize"].startswith("FAIL canary caught, memcheck clean, racecheck "
                                          "clean, synccheck rc=9"), stdout
    assert summary["sanitize"].endswith("initcheck clean, python memcheck clean"), stdout
    assert "(20 runs of" in summary["repeat-docs"]
    assert "3 of 3 digests match (overall 0123abcd)" in summary["ptx"]
    assert summary["bench"] == "PASS fake bench numbers", stdout
    assert summary["ringbench"] == "PASS fake ringbench numbers", stdout
    # each background stage's output, in stage order
    heads = re.findall(r"^== (\w+)", stdout, re.M)
    assert heads[heads.index("ptx"):heads.index("threadring") + 1] == \
        ["ptx", "selftest", "tests", "tests", "sanitize", "nccl", "threadring"], stdout
    assert re.search(r"^---- last lines of nccl.log ----", stdout, re.M)

    spans = _trace(trace)
    concurrent = ["ptx", "selftest", "tests", "repeat-docs", "repeat-lifetime",
                  "sanitize_memcheck", "sanitize_racecheck", "sanitize_synccheck",
                  "sanitize_initcheck", "sanitize_python", "nccl", "threadring"]
    assert set(spans) == set(concurrent + ["bench", "ringbench"]), spans
    # the stages (and the sanitizer's tools) really overlap: the latest
    # start among them before the earliest end; sequential they would take
    # 4 x 1.5 s each
    for group in (["ptx", "selftest", "tests", "nccl", "threadring"],
                  ["sanitize_memcheck", "sanitize_racecheck", "sanitize_synccheck",
                   "sanitize_initcheck", "sanitize_python"]):
        assert max(spans[s]["start"] for s in group) < min(spans[s]["end"] for s in group), \
            (group, spans)
    first = min(spans[s]["start"] for s in concurrent)
    last = max(spans[s]["end"] for s in concurrent)
    assert last - first < 12, spans       # one after the other: ~18 s of sleeps
    # the timing stages: after all of them, alone, bench then ringbench
    assert spans["bench"]["start"] >= last, spans
    assert spans["ringbench"]["start"] >= spans["bench"]["end"], spans
    archive = out / ("gpu_check-build-ptx-selftest-tests-sanitize-nccl-threadring-bench-"
                     "ringbench.tar.gz")
    assert archive.exists() and f"logs: {archive}" in stdout
    import tarfile
    with tarfile.open(archive) as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
    assert {"summary.txt", "nccl.log", "nccl.out", "sanitize_racecheck.log",
            "tests.xml", "bench.log"} <= names, names

    # the run past its budget
    assert hung.returncode == 1, hung_stdout
    summary = _summary(hung_stdout)
    assert summary["ptx"].startswith("PASS"), hung_stdout
    assert summary["threadring"].startswith("FAIL rc=124; timed out"), hung_stdout
    assert "start" in _trace(hung_trace)["threadring"]
    assert (tmp_path / "b" / "out" / "gpu_check-ptx-threadring.tar.gz").exists()


def test_serial_knob_runs_one_stage_after_another(tmp_path):
    proc, trace, _ = _start_kit(tmp_path, ["ptx", "nccl", "threadring"],
                                GPU_CHECK_SERIAL="1", FAKE_SLEEP="0.5")
    stdout = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, stdout
    assert list(_summary(stdout)) == ["env", "build", "ptx", "nccl", "threadring"], stdout
    spans = _trace(trace)
    assert spans["ptx"]["end"] <= spans["nccl"]["start"], spans
    assert spans["nccl"]["end"] <= spans["threadring"]["start"], spans


def test_profile_stage_runs_ncu_on_the_wgmma_kernels_and_tabulates(tmp_path):
    """`profile` (not in `all`): ncu with the clocks left alone, filtered to
    the wgmma kernels, asking only for the raw metrics this ncu lists, then
    the report's table and summary line."""
    assert "profile" not in _script_var_dq("ALL_STAGES").split()
    proc, trace, _ = _start_kit(tmp_path, ["profile"], FAKE_SLEEP="0.2")
    stdout = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, stdout
    summary = _summary(stdout)
    assert summary["profile"].startswith(
        "PASS 1 launches (of 20 expected); measured/predicted none"), stdout
    assert "| 0: fwd D 64 | fwd_wg | 0.640 | — | — | 168 |" in stdout, stdout
    args = open(str(trace) + ".ncu").read().split()
    assert args[args.index("--clock-control") + 1] == "none"
    assert args[args.index("--kernel-name") + 1] == "regex:(fwd_wg|bwd_wg|dkdv_wg|dq_wg)_kernel"
    assert args[args.index("--metrics") + 1] == "lts__t_sectors_op_red.sum"   # the known one
    assert args[-1].endswith("tools/profile_case.py")
    # a failing profiler fails the stage
    (tmp_path / "again").mkdir()
    proc, _, _ = _start_kit(tmp_path / "again", ["profile"], FAKE_SLEEP="0.2",
                            FAKE_FAIL="profile")
    stdout = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0 and _summary(stdout)["profile"].startswith("FAIL ncu rc=1"), stdout


def test_profile_case_and_report_pair_launches_with_cases(tmp_path):
    """profile_case's launches in order (20: one per wgmma kernel of each
    case) and the report pairing a details page with them, with the model's
    prediction beside each unmasked one and a kernel other than the
    expected one named as such."""
    tools = os.path.join(ROOT, "tools")
    listed = subprocess.run([sys.executable, os.path.join(tools, "profile_case.py"), "--list"],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(listed) == 16 and listed[2] == (
        "case 2 bwd D=64 causal=0 det=1 mask=none kernels=dkdv_wg,dq_wg"), listed
    sys.path.insert(0, tools)
    try:
        import profile_case
        import profile_report
    finally:
        sys.path.remove(tools)
    kernels = [k for c in profile_case.cases() for k in c[5]]
    assert len(kernels) == 20
    rows = ['"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"']
    for i, k in enumerate(kernels):
        k = "dq_tc" if i == 3 else k                 # a fallback, reported as such
        name = f"(anonymous namespace)::{k}_kernel<__nv_bfloat16, 64, false>(Args)"
        rows.append(f'"{i}","{name}","SOL","Duration","msecond","{1 + i / 10:.1f}"')
        rows.append(f'"{i}","{name}","CWA","Issue Slots Busy","%","{40 + i}"')
    # what L2 served, and at what share of its throughput: the rate that
    # would saturate it (0: 3.6 / 0.8, 4: 2.4 / 0.6; 1 has no percentage)
    for i, rate, unit, pct in ((0, "3.6", "Tbyte/second", "80"), (4, "2,400", "Gbyte/s", "60"),
                               (1, "5", "Tbyte/second", None), (2, "7", "furlong/s", "50")):
        name = f"(anonymous namespace)::{kernels[i]}_kernel<__nv_bfloat16, 64, false>(Args)"
        rows.append(f'"{i}","{name}","RAW","lts__t_bytes.sum.per_second","{unit}","{rate}"')
        if pct:
            rows.append(f'"{i}","{name}","SOL","L2 Cache Throughput","%","{pct}"')
    path = tmp_path / "details.csv"
    path.write_text("==PROF== not CSV\n" + "\n".join(rows) + "\n")
    text = profile_report.report(profile_report.read_launches(str(path)), 8192)
    from ringattn.bench import model
    pred = model.predict("fwd", "bfloat16", 64, 8192, False, 1, 16, family="sm90a")
    want = pred["fwd_wg"] * 1e3
    assert f"| 0: fwd D 64 | fwd_wg | 1.000 | {want:.3f} | {1 / want:.2f} | — | — | — | 40 |" \
        in text, text
    assert "| 2: bwd D 64 det | dq_tc (expected dq_wg) | 1.300 | — | — |" in text, text
    assert "| 15: bwd D 128 causal docs | bwd_wg | 2.900 | — | — |" in text, text
    assert "| 80 | — | — | 3.60 | 4.50 |" in text, text          # L2 %, DRAM, occupancy, rates
    assert "| 60 | — | — | 2.40 | 4.00 |" in text, text
    assert "| — | — | — | 5.00 | — |" in text, text
    assert "| 15: bwd D 128 causal docs | bwd_wg | 2.900 | — | — | — | — | — | 59 | — " \
           "| — | — | — | — | — |" in text, text
    last = text.splitlines()[-1]
    assert last.startswith("profile: 20 launches (of 20 expected); measured/predicted bwd_wg "), last
    assert "dq_wg" in last and "fwd_wg" in last
    assert last.endswith(f"; L2 TB/s at 100 % fwd_wg 4.00-4.50 "
                         f"(model: {model.L2_BYTES_PER_S / 1e12:g})"), last
