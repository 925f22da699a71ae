"""The emulated GPU's CUDA runtime and device memory, on their own.

csrc/emu/memory.cpp and runtime*.cpp (with config.cpp) are compiled by g++
together with a C++ test program of tests/emu/ (test_memory*.cpp,
test_runtime*.cpp), which stands in for the SIMT layer (a "kernel" is a
host function run on the stream's worker).  Each program runs under
AddressSanitizer + UBSan with the stream work started eagerly and with
RINGATTN_EMU_LAZY=1 (work starts only when the host observes it), and once
under ThreadSanitizer, since every stream has its own worker thread.  A
program prints one line per test case and exits non-zero on a failed check
or a sanitizer report.  Needs only g++: no ringattn build, no GPU.
"""

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EMU = ROOT / "csrc" / "emu"
PROGRAMS_DIR = ROOT / "tests" / "emu"
# the runtime and device memory, without the SIMT layer (the programs stand in)
SOURCES = ["config.cpp", "memory.cpp"] + sorted(
    p.name for p in EMU.glob("runtime*.cpp"))
PROGRAMS = sorted(p.stem for pattern in ("test_memory*.cpp", "test_runtime*.cpp")
                  for p in PROGRAMS_DIR.glob(pattern))
FLAGS = {
    "asan": ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
    "tsan": ["-fsanitize=thread"],
}
# (sanitizer, lazy) runs of every program
MODES = [("asan", 0), ("asan", 1), ("tsan", 0)]

CXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(
    CXX is None or not all((EMU / s).is_file() for s in SOURCES),
    reason="needs g++ and the emulated GPU's sources (csrc/emu)")


def _compile(args, cwd):
    """Run g++; skip when the sanitizer's runtime library is not installed."""
    r = subprocess.run([CXX, *args], cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        if "cannot find -l" in r.stderr or "cannot find lib" in r.stderr:
            pytest.skip(f"g++ lacks a sanitizer runtime: {r.stderr.strip()[-200:]}")
        raise AssertionError(f"g++ {' '.join(args)} failed:\n{r.stderr}")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """built(sanitizer, program) -> path of the linked program (objects of
    the runtime compiled once per sanitizer)."""
    out = tmp_path_factory.mktemp("emu_runtime")
    objects, programs = {}, {}
    common = ["-std=c++17", "-O1", "-g", "-Wall", "-Wextra", "-Wno-unused-function",
              f"-I{EMU / 'include'}", f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'cuda'}"]

    def get(san, program):
        if san not in objects:
            objs = [str(out / f"{san}_{Path(src).stem}.o") for src in SOURCES]
            with ThreadPoolExecutor(max_workers=2) as pool:
                list(pool.map(lambda so: _compile(
                    [*common, *FLAGS[san], "-c", str(EMU / so[0]), "-o", so[1]], out),
                    zip(SOURCES, objs)))
            objects[san] = objs
        key = (san, program)
        if key not in programs:
            exe = out / f"{san}_{program}"
            _compile([*common, *FLAGS[san], str(PROGRAMS_DIR / f"{program}.cpp"),
                      *objects[san], "-lpthread", "-o", str(exe)], out)
            programs[key] = exe
        return programs[key]

    return get


def _environment(lazy):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RINGATTN_EMU_", "ASAN_", "UBSAN_", "TSAN_", "LSAN_"))
           and k != "LD_PRELOAD"}     # the ASan stage of CI preloads its runtime
    env.update({
        "RINGATTN_EMU_DEVICES": "2",
        "RINGATTN_EMU_MEMORY": "256M",
        "RINGATTN_EMU_QUIET": "1",
        "RINGATTN_EMU_LAZY": str(lazy),
        "ASAN_OPTIONS": "halt_on_error=1:detect_leaks=1",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
        "TSAN_OPTIONS": "halt_on_error=1:second_deadlock_stack=1",
    })
    return env


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("san,lazy", MODES, ids=["asan", "asan-lazy", "tsan"])
def test_emu_program(built, san, lazy, program):
    exe = built(san, program)
    r = subprocess.run([str(exe)], env=_environment(lazy), capture_output=True, text=True,
                       timeout=300)
    if san == "tsan" and r.returncode != 0 and "unexpected memory mapping" in r.stderr:
        pytest.skip("ThreadSanitizer cannot run with this kernel's address layout")
    assert r.returncode == 0, f"{program} ({san}, lazy={lazy}):\n{r.stdout}\n{r.stderr[-6000:]}"
    assert " 0 failed check(s)" in r.stdout, r.stdout
    assert "FAIL" not in r.stdout, r.stdout


def _cuda_home():
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "include" / "cuda_runtime.h").is_file():
            return Path(home)
    nvcc = shutil.which("nvcc")
    if nvcc:
        return Path(os.path.realpath(nvcc)).parents[1]
    return Path("/usr/local/cuda") if Path("/usr/local/cuda/include").is_dir() else None


def test_error_names_and_texts_are_the_toolkits(built, tmp_path):
    """Every error code of the emulated runtime has the CUDA toolkit
    runtime's own name and text (the toolkit's libcudart answers without a
    GPU): tests/emu/print_errors.c built against both."""
    home = _cuda_home()
    lib = next((d for d in (home / "lib64", home / "lib") if (d / "libcudart_static.a").is_file()),
               None) if home else None
    if lib is None:
        pytest.skip("needs a CUDA toolkit (libcudart_static) to compare with")
    src = str(PROGRAMS_DIR / "print_errors.c")
    real, emu = tmp_path / "real", tmp_path / "emu"
    _compile(["-x", "c++", src, "-x", "none", f"-I{home / 'include'}", f"-L{lib}",
              "-lcudart_static",
              "-ldl", "-lrt", "-lpthread", "-o", str(real)], tmp_path)
    objs = [str(tmp_path / f"{Path(s).stem}.o") for s in SOURCES]
    for s, o in zip(SOURCES, objs):
        _compile(["-std=c++17", "-O1", f"-I{EMU / 'include'}", f"-I{ROOT / 'csrc'}",
                  "-c", str(EMU / s), "-o", o], tmp_path)
    stub = tmp_path / "simt_stub.cpp"   # the four SIMT entry points the runtime calls
    stub.write_text('#include "emu/emu.h"\n'
                    'extern "C" int ra_emu_grid_validate(const ra_emu_grid *, size_t, '
                    'const char **w) { *w = 0; return 0; }\n'
                    'extern "C" int ra_emu_grid_run(const ra_emu_grid *) { return 0; }\n'
                    'extern "C" int ra_emu_func_set_smem(const void *, int) { return 0; }\n'
                    'extern "C" size_t ra_emu_func_smem_limit(const void *) { return 0; }\n')
    _compile(["-std=c++17", "-x", "c++", src, str(stub), "-x", "none", f"-I{EMU / 'include'}",
              f"-I{ROOT / 'csrc'}", *objs, "-lpthread", "-o", str(emu)], tmp_path)
    got = {}
    for name, exe in (("real", real), ("emu", emu)):
        r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60,
                           env=_environment(0))
        assert r.returncode == 0, r.stderr
        got[name] = r.stdout.splitlines()
    assert len(got["emu"]) >= 28
    assert got["emu"] == got["real"], "\n".join(
        f"emulated: {e}\ntoolkit:  {t}" for e, t in zip(got["emu"], got["real"]) if e != t)
