"""The emulated GPU's stand-in NCCL (csrc/emu/nccl) on its own.

The library's sources are compiled here, with the C test programs of
tests/emu/test_nccl_standin*.c and a fake emulated runtime (streams as
in-order queues with a thread each, registered "device memory"), under
AddressSanitizer + UndefinedBehaviorSanitizer (leaks checked at each rank's
exit) and, for the scenarios with the most threads, ThreadSanitizer.  Each
scenario forks its ranks as real processes:

* one process: version (>= 2.30: ranks may share an emulated device), ids,
  binding, init's argument checks, a rank claimed twice, every call-time
  check of ncclSend/ncclRecv, group errors, the self exchange;
* ring exchanges of 2-4 ranks, 0 B .. 3 MiB, nested groups, blocking and
  non-blocking init, bytes read when the stream reaches the op;
* an all-to-all of 4 ranks with variable sizes in one group;
* a SIGKILLed peer (async error within a second, the op completes), an
  abort while an op waits on a silent peer (done within milliseconds), a
  size mismatch, two ranks on one device without
  NCCL_MULTI_RANK_GPU_ENABLE, and a fake peer sending bad hellos, bad or
  oversized frames and garbage (an error, never a crash);
* comm/nccl_loader.c of an emulated build opening the library.

Needs a C compiler and NCCL's header nccl.h (the declarations only);
skips without them.  No GPU, no ringattn build.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "csrc" / "emu" / "nccl"
TESTS = ROOT / "tests" / "emu"

if not LIB.is_dir():
    pytest.skip("no csrc/emu/nccl next to the tests", allow_module_level=True)


def _nccl_include():
    """The directory holding nccl.h (as setup.py looks for it), or None."""
    dirs = [os.environ.get("NCCL_INCLUDE_DIR")]
    for var in ("NCCL_HOME", "CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            dirs.append(os.path.join(os.environ[var], "include"))
    dirs += ["/usr/local/cuda/include", "/usr/include", "/usr/local/include"]
    for root in sys.path:
        dirs.append(os.path.join(root, "nvidia", "nccl", "include"))
    for d in dirs:
        if d and os.path.isfile(os.path.join(d, "nccl.h")):
            return d
    return None


CC = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
NCCL_INC = _nccl_include()
if CC is None:
    pytest.skip("no C compiler", allow_module_level=True)
if NCCL_INC is None:
    pytest.skip("no nccl.h (the stand-in compiles against NCCL's header)",
                allow_module_level=True)

CFLAGS = ["-std=gnu11", "-g", "-O1", "-Wall", "-Wextra",
          "-Wno-unused-parameter", "-fno-omit-frame-pointer",
          f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'csrc' / 'emu' / 'include'}",
          f"-I{NCCL_INC}", f"-I{TESTS}"]
ASAN = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
TSAN = ["-fsanitize=thread"]
LIB_SOURCES = sorted(str(p) for p in LIB.glob("*.c"))
PROGRAM = [str(TESTS / f"test_nccl_standin{s}.c")
           for s in ("", "_rt", "_api", "_fake")]


def _env():
    """The scenarios' environment: ours, minus what would change them."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "NCCL_COMM_ID",
                        "NCCL_MULTI_RANK_GPU_ENABLE")}
    env["ASAN_OPTIONS"] = "detect_leaks=1:abort_on_error=0"
    env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1"
    env["TSAN_OPTIONS"] = "halt_on_error=1:second_deadlock_stack=1"
    return env


def _compile(args, what):
    proc = subprocess.run([CC, *args], capture_output=True, text=True,
                          env=_env(), timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"compiling {what} failed:\n{proc.stderr[-4000:]}")


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """kind -> path of a test program, compiled on first use."""
    out = tmp_path_factory.mktemp("emu_nccl")
    built = {}

    def get(kind):
        if kind in built:
            return built[kind]
        if kind == "tsan":
            probe = out / "probe.c"
            probe.write_text("int main(void) { return 0; }\n")
            ok = subprocess.run([CC, *TSAN, str(probe), "-o",
                                 str(out / "probe")], capture_output=True)
            if ok.returncode != 0:
                pytest.skip("this compiler cannot link -fsanitize=thread")
        exe = out / f"standin_{kind}"
        if kind == "loader":
            lib, nobind = out / "lib_emu_nccl.so", out / "libnobind.so"
            _compile([*CFLAGS, *ASAN, "-fPIC", "-shared",
                      "-fvisibility=hidden", *LIB_SOURCES, "-o", str(lib),
                      "-lpthread"], "the stand-in library")
            _compile(["-fPIC", "-shared",
                      str(TESTS / "test_nccl_standin_nobind.c"), "-o",
                      str(nobind)], "the library without raEmuNcclBind")
            _compile([*CFLAGS, *ASAN, "-DRA_WITH_CUDA", "-DRA_CUDA_EMULATED",
                      str(TESTS / "test_nccl_standin_loader.c"),
                      str(TESTS / "test_nccl_standin_rt.c"),
                      str(ROOT / "csrc" / "comm" / "nccl_loader.c"), str(lib),
                      f"-Wl,-rpath,{out}", "-o", str(exe), "-ldl",
                      "-lpthread"], "the loader test")
            built[kind] = (exe, lib, nobind)
            return built[kind]
        _compile([*CFLAGS, *(TSAN if kind == "tsan" else ASAN), *LIB_SOURCES,
                  *PROGRAM, "-o", str(exe), "-lpthread"], f"the {kind} build")
        built[kind] = exe
        return exe

    return get


def run(programs, kind, *args):
    exe = programs(kind)
    if isinstance(exe, tuple):
        exe = exe[0]
    proc = subprocess.run([str(exe), *map(str, args)], capture_output=True,
                          text=True, env=_env(), timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and ": ok" in proc.stdout, out[-6000:]
    return out


def test_api_in_one_process(programs):
    run(programs, "asan", "api")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_exchange_of_random_sizes(programs, world):
    run(programs, "asan", "ring", world)


def test_all_to_all_of_four_ranks(programs):
    run(programs, "asan", "alltoall")


def test_killed_peer_fails_the_op_within_a_second(programs):
    run(programs, "asan", "killed")


def test_abort_ends_an_op_waiting_on_a_silent_peer(programs):
    run(programs, "asan", "abort")


def test_size_mismatch_is_an_async_error(programs):
    run(programs, "asan", "mismatch")


def test_ranks_share_a_device_only_when_enabled(programs):
    run(programs, "asan", "dupdev")


@pytest.mark.parametrize("mode", [
    "hello_magic", "hello_secret", "hello_world", "hello_short",
    "frame_magic", "frame_seq", "frame_huge", "frame_truncated", "garbage"])
def test_a_bad_peer_is_an_error_not_a_crash(programs, mode):
    run(programs, "asan", "fake", mode)


def test_loader_binds_the_stand_in(programs):
    exe, lib, nobind = programs("loader")
    run(programs, "loader", lib, nobind)


@pytest.mark.parametrize("scenario", [
    ("api",), ("ring", 4), ("alltoall",), ("killed",), ("abort",),
    ("fake", "frame_huge")])
def test_under_thread_sanitizer(programs, scenario):
    run(programs, "tsan", *scenario)
