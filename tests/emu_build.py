"""Build programs against ringattn's emulated GPU (csrc/emu) for the tests.

The emulator's own tests (tests/test_emu_*.py) compile it from the source
tree with the host C++ compiler, independent of how ringattn was
installed: the emulator's sources plainly, kernel code (cuda/*.cu, the test
programs of tests/emu/) with the thread sanitizer's instrumentation whose
hooks are the emulator's memory checker (as setup.py does for
RINGATTN_CUDA=emulate), or, for the AddressSanitizer variant, everything
with -fsanitize=address,undefined and no instrumentation.

Objects are cached per flavour in one directory per session.
"""

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which(os.environ.get("CXX", "g++"))
CC = shutil.which(os.environ.get("CC", "gcc"))

BASE = ["-std=c++17", "-fno-strict-aliasing", "-Wall", "-Wno-unknown-pragmas",
        "-DRA_WITH_CUDA", "-DRA_CUDA_EMULATED",
        "-I" + str(ROOT / "csrc" / "emu" / "include"),
        "-I" + str(ROOT / "csrc"), "-I" + str(ROOT / "cuda")]
CHECKED = ["-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0"]
FLAVOURS = {
    # the emulator's own checker (as RINGATTN_CUDA=emulate builds it)
    "checked": {"opt": ["-O2", "-g"], "kernel": CHECKED, "link": []},
    # AddressSanitizer + UBSan over the emulator and the kernels
    "asan": {"opt": ["-O1", "-g", "-fno-omit-frame-pointer",
                     "-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
             "kernel": [], "link": ["-fsanitize=address,undefined"]},
}


def emulator_sources():
    return sorted(p for p in (ROOT / "csrc" / "emu").glob("*.cpp"))


class Builder:
    """Compile and link test programs; objects cached under `workdir`."""

    def __init__(self, workdir, flavour="checked"):
        self.dir = Path(workdir) / flavour
        self.dir.mkdir(parents=True, exist_ok=True)
        self.flavour = FLAVOURS[flavour]

    def _obj(self, src, kernel):
        src = Path(src)
        name = str(src.relative_to(ROOT)).replace(os.sep, "__") + ".o"
        obj = self.dir / name
        if obj.exists() and obj.stat().st_mtime >= src.stat().st_mtime:
            return obj
        if src.suffix == ".c":
            cmd = [CC, "-std=gnu11", "-DRA_WITH_CUDA", "-I" + str(ROOT / "csrc")]
            cmd += self.flavour["opt"] + ["-c", str(src), "-o", str(obj)]
        else:
            cmd = [CXX] + BASE + self.flavour["opt"]
            if kernel:
                cmd += self.flavour["kernel"] + ["-x", "c++"]
            cmd += ["-c", str(src), "-o", str(obj)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"compile failed: {' '.join(cmd)}\n{r.stderr}")
        return obj

    def program(self, name, kernel_sources, c_sources=()):
        """Link `name` from kernel sources (instrumented), C sources and the
        emulator; return its path.  Compiles in parallel."""
        jobs = [(s, True) for s in kernel_sources]
        jobs += [(s, False) for s in list(c_sources) + emulator_sources()]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            objs = list(pool.map(lambda j: self._obj(*j), jobs))
        exe = self.dir / name
        cmd = [CXX] + [str(o) for o in objs] + self.flavour["link"] + \
            ["-o", str(exe), "-lpthread", "-ldl"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"link failed: {' '.join(cmd)}\n{r.stderr}")
        return exe


def run(exe, *args, env=None, timeout=600):
    """Run a test program; (returncode, stdout + stderr)."""
    full_env = dict(os.environ)
    full_env.pop("LD_PRELOAD", None)   # the ASan stage's preload is not ours
    full_env.update(env or {})
    r = subprocess.run([str(exe), *args], capture_output=True, text=True,
                       env=full_env, timeout=timeout)
    return r.returncode, r.stdout + r.stderr
