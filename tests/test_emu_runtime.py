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
