"""tools/gpu_check.sh keeps its promises without a GPU to run it: the
sanitizer's kernel filter names every ringattn kernel (by its mangled and
its demangled name) and the canary that proves the filter matches, the ptx
stage (the PTX conformance program) comes first after the build and needs
no installed package, the threadring stage runs the thread-rank tests and
is documented, the script parses, and the ``--repeat N`` option its tests
stage uses (tests/conftest.py) runs a test N times."""

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
    assert "gpu_check.sh build ptx selftest tests" in readme


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
    assert "| `threadring` |" in readme and "threadring" in readme.split("| call |")[1]
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
