"""Build ringattn's C core, and its CUDA kernels when a toolkit is found.

Environment:
  RINGATTN_CUDA=0|1         force the CUDA part off / on (1 fails loudly if
                            no CUDA toolkit is found); default: on when nvcc
                            is found (CUDA_HOME, nvcc on PATH, /usr/local/cuda)
  RINGATTN_CUDA=emulate     build the GPU half against ringattn's emulated GPU
                            (csrc/emu): cuda/'s kernels compiled by the host
                            C++ compiler, run as blocks of threads on the CPU,
                            with an emulated CUDA runtime and a stand-in NCCL;
                            no CUDA toolkit needed (nccl.h is, for the nccl
                            backend)
  RINGATTN_CUDA_ARCHS="80;90a" SM targets (default sm_80 and sm_90a, plus
                            PTX of the newest non-"a" one so later GPUs can
                            JIT it); 90a builds the Hopper (wgmma/TMA)
                            kernels, used on compute capability 9.0
  RINGATTN_BUILD_JOBS=N     parallel compile jobs (default: CPU count)
  NCCL_HOME, NCCL_INCLUDE_DIR  where nccl.h is, when not in the CUDA
                            toolkit, the system or the NVIDIA pip wheel
                            (nvidia-nccl-cu13/-cu12: nvidia/nccl/include);
                            without nccl.h the nccl backend is left out
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def find_cuda_home():
    """Return the CUDA toolkit root or None."""
    for env in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(env)
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda"
    return None


def cuda_wanted():
    """(enabled, cuda_home) following RINGATTN_CUDA; enabled is True,
    False or "emulate"."""
    flag = os.environ.get("RINGATTN_CUDA", "").strip()
    home = find_cuda_home()
    if flag == "0":
        return False, None
    if flag == "emulate":
        return "emulate", home
    if flag == "1" and home is None:
        raise RuntimeError(
            "RINGATTN_CUDA=1 but no CUDA toolkit was found: set CUDA_HOME or put "
            "nvcc on PATH")
    if flag not in ("", "0", "1"):
        raise RuntimeError(f"RINGATTN_CUDA: expected 0, 1 or emulate, got {flag!r}")
    return home is not None, home


def find_nccl_include(cuda_home):
    """The directory holding nccl.h, or None.

    ringattn opens libnccl at run time (dlopen), so the build needs only the
    header's declarations: ncclResult_t, ncclComm_t, ncclUniqueId,
    ncclConfig_t with NCCL_CONFIG_INITIALIZER, and the function prototypes.
    Looked for in NCCL_INCLUDE_DIR, NCCL_HOME/include, the CUDA toolkit,
    /usr/include, /usr/local/include, then the NVIDIA pip wheel
    (site-packages/nvidia/nccl/include, from nvidia-nccl-cu13 or -cu12).
    """
    dirs = []
    if os.environ.get("NCCL_INCLUDE_DIR"):
        dirs.append(os.environ["NCCL_INCLUDE_DIR"])
    if os.environ.get("NCCL_HOME"):
        dirs.append(os.path.join(os.environ["NCCL_HOME"], "include"))
    if cuda_home:
        dirs.append(os.path.join(cuda_home, "include"))
    dirs += ["/usr/include", "/usr/local/include"]
    try:        # the wheel's package nvidia.nccl, as this interpreter sees it
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        dirs += [os.path.join(d, "include")
                 for d in spec.submodule_search_locations or []]
    for d in dirs:
        if os.path.isfile(os.path.join(d, "nccl.h")):
            return d
    return None


# sm_80 (A100, and through its PTX every later GPU) and sm_90a (H100: the
# wgmma/TMA kernels of cuda/hopper/); tools/README.md has the compile times
DEFAULT_CUDA_ARCHS = "80;90a"


def cuda_arch_flags():
    """nvcc's -gencode flags for RINGATTN_CUDA_ARCHS: machine code for each
    architecture, plus PTX of the newest portable one (an "a" architecture's
    PTX runs on that GPU only) so that later GPUs can compile it; and
    -DRA_CUDA_SM90A when sm_90a is among them (cuda/attn_family.cu then
    picks the Hopper kernels on compute capability 9.0)."""
    archs = os.environ.get("RINGATTN_CUDA_ARCHS", DEFAULT_CUDA_ARCHS)
    items = [a.strip().replace("sm_", "").replace(".", "")
             for a in archs.replace(",", ";").split(";") if a.strip()]
    if not items:
        raise RuntimeError("RINGATTN_CUDA_ARCHS is empty")
    flags = []
    for a in items:
        if not a.isdigit() and not (a.endswith("a") and a[:-1].isdigit()):
            raise RuntimeError(f"RINGATTN_CUDA_ARCHS: bad architecture {a!r}")
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    portable = [a for a in items if a.isdigit()]
    if portable:
        newest = max(portable, key=int)
        flags += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
    if "90a" in items:
        flags.append("-DRA_CUDA_SM90A")
    return flags


class BuildExt(build_ext):
    """Compiles C sources in parallel and, when enabled, the CUDA kernels."""

    def build_extensions(self):
        jobs = int(os.environ.get("RINGATTN_BUILD_JOBS", os.cpu_count() or 1))
        self.parallel = max(1, jobs)
        enabled, home = cuda_wanted()
        nccl_inc = find_nccl_include(home) if enabled else None
        # a build directory reused under another configuration (CUDA on/off,
        # other archs or flags, NCCL header or not) must not keep objects or
        # a library made for the old one: rebuild everything when it changed
        config = repr((enabled, home, os.environ.get("RINGATTN_CUDA_ARCHS"),
                       os.environ.get("CFLAGS") if enabled == "emulate" else None,
                       os.environ.get("RINGATTN_NVCC_FLAGS"), nccl_inc))
        marker = os.path.join(self.build_temp, "ringattn-build-config")
        os.makedirs(self.build_temp, exist_ok=True)
        previous = open(marker).read() if os.path.exists(marker) else None
        if previous != config:
            self.force = True
            shutil.rmtree(os.path.join(self.build_temp, "cuda"),
                          ignore_errors=True)
        emulate = enabled == "emulate"
        for ext in self.extensions:
            if ext.name == EMU_NCCL:
                continue
            if emulate:
                self.add_emulated(ext, jobs)
            elif enabled:
                self.add_cuda(ext, home, jobs)
            if enabled:
                if nccl_inc is None:
                    ext.define_macros.append(("RA_NO_NCCL_HEADERS", "1"))
                else:
                    ext.include_dirs.append(nccl_inc)
        print("ringattn: CUDA part " +
              ("EMULATED (csrc/emu)" if emulate else
               f"ON ({home})" if enabled else "OFF"), file=sys.stderr)
        if enabled:
            print("ringattn: nccl backend " +
                  (f"ON (nccl.h in {nccl_inc})" if nccl_inc else
                   "OFF: no nccl.h found (pip install nvidia-nccl-cu13 or "
                   "-cu12, or set NCCL_HOME)"), file=sys.stderr)
        super().build_extensions()
        with open(marker, "w") as f:
            f.write(config)

    def compile_objects(self, items, jobs):
        """Run the (cmd, src, obj) compiles of `items` whose object is older
        than its source or any header, in parallel; return every obj."""
        headers = [os.path.join(ROOT, f)
                   for f in tree_files("cuda", ".cuh", ".h") +
                   tree_files("csrc", ".h")]
        newest_header = max((os.path.getmtime(h) for h in headers), default=0)
        todo = [(cmd, src, obj) for cmd, src, obj in items
                if not os.path.exists(obj) or
                os.path.getmtime(obj) < max(os.path.getmtime(src), newest_header)]

        def compile_one(item):
            cmd = item[0]
            print(" ".join(cmd), file=sys.stderr)
            subprocess.run(cmd, check=True)

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            list(pool.map(compile_one, todo))
        return [obj for _, _, obj in items]

    def add_emulated(self, ext, jobs):
        """The GPU half on ringattn's emulated GPU: the emulator (csrc/emu,
        C++) and cuda/'s kernels compiled by the host C++ compiler, the
        kernels with the thread sanitizer's instrumentation whose hooks are
        the emulator's memory checker (csrc/emu/check.cpp).  A build with
        AddressSanitizer in CFLAGS leaves that instrumentation out (the two
        cannot be combined; ASan checks the kernels' memory instead)."""
        cxx = os.environ.get("CXX", "g++")
        cflags = os.environ.get("CFLAGS", "").split()
        asan = any(f.startswith("-fsanitize=") and "address" in f for f in cflags)
        base = [cxx, "-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden",
                "-fno-strict-aliasing", "-Wall", "-Wno-unknown-pragmas",
                "-DRA_WITH_CUDA", "-DRA_CUDA_EMULATED",
                "-I" + os.path.join(ROOT, "csrc", "emu", "include"),
                "-I" + os.path.join(ROOT, "csrc"),
                "-I" + os.path.join(ROOT, "cuda")] + cflags
        checked = [] if asan else ["-fsanitize=thread",
                                   "--param=tsan-instrument-func-entry-exit=0"]
        objdir = os.path.join(self.build_temp, "cuda")
        os.makedirs(objdir, exist_ok=True)
        items = []
        for rel in tree_files("csrc/emu", ".cpp"):
            if rel.startswith(os.path.join("csrc", "emu", "nccl") + os.sep):
                continue
            obj = os.path.join(objdir, "emu__" + os.path.basename(rel) + ".o")
            src = os.path.join(ROOT, rel)
            items.append((base + ["-c", src, "-o", obj], src, obj))
        for rel in tree_files("cuda", ".cu"):
            src = os.path.join(ROOT, rel)
            name = os.path.relpath(src, os.path.join(ROOT, "cuda"))
            obj = os.path.join(objdir, name.replace(os.sep, "__") + ".o")
            items.append((base + checked + ["-x", "c++", "-c", src, "-o", obj],
                          src, obj))
        objects = self.compile_objects(items, jobs)
        # a rebuilt object relinks the extension (build_ext compares only
        # its sources and depends with the library)
        ext.extra_objects += objects
        ext.depends += objects
        ext.define_macros += [("RA_WITH_CUDA", "1"), ("RA_CUDA_EMULATED", "1")]
        # the emulated CUDA headers come before any toolkit's (nccl.h's
        # #include <cuda_runtime.h> must find them too)
        ext.include_dirs[:0] = [os.path.join(ROOT, "csrc", "emu", "include"),
                                os.path.join(ROOT, "cuda")]
        ext.libraries += ["dl", "pthread", "stdc++"]

    def add_cuda(self, ext, home, jobs):
        nvcc = os.path.join(home, "bin", "nvcc")
        sources = [os.path.join(ROOT, f) for f in tree_files("cuda", ".cu")]
        headers = [os.path.join(ROOT, f)
                   for f in tree_files("cuda", ".cuh", ".h") +
                   tree_files("csrc", ".h")]
        newest_header = max((os.path.getmtime(h) for h in headers), default=0)
        objdir = os.path.join(self.build_temp, "cuda")
        os.makedirs(objdir, exist_ok=True)
        flags = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC",
                 "--expt-relaxed-constexpr", "-DRA_WITH_CUDA",
                 "-I" + os.path.join(ROOT, "csrc"),
                 "-I" + os.path.join(ROOT, "cuda")] + cuda_arch_flags()
        extra = os.environ.get("RINGATTN_NVCC_FLAGS", "").split()
        objects = []
        todo = []
        for src in sources:
            name = os.path.relpath(src, os.path.join(ROOT, "cuda"))
            obj = os.path.join(objdir, name.replace(os.sep, "__") + ".o")
            objects.append(obj)
            if (not os.path.exists(obj) or
                    os.path.getmtime(obj) < max(os.path.getmtime(src),
                                                newest_header)):
                todo.append((src, obj))

        def compile_one(item):
            src, obj = item
            cmd = [nvcc, "-c", src, "-o", obj] + flags + extra
            print(" ".join(cmd), file=sys.stderr)
            subprocess.run(cmd, check=True)

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            list(pool.map(compile_one, todo))
        ext.extra_objects += objects
        ext.depends += objects   # a rebuilt object relinks the extension
        ext.define_macros.append(("RA_WITH_CUDA", "1"))
        ext.include_dirs += [os.path.join(home, "include"),
                             os.path.join(ROOT, "cuda")]
        libdir = os.path.join(home, "lib64")
        if not os.path.exists(libdir):
            libdir = os.path.join(home, "lib")
        ext.library_dirs.append(libdir)
        ext.libraries += ["cudart_static", "dl", "rt", "pthread", "stdc++"]


def tree_files(folder, *suffixes):
    """Every file under `folder` (recursively) ending in one of `suffixes`,
    as sorted paths relative to the project root: the C core is whatever
    csrc/ holds, so a MANIFEST.in line such as `graft csrc` carries it."""
    found = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
        dirnames.sort()
        found += [os.path.relpath(os.path.join(dirpath, f), ROOT)
                  for f in filenames if f.endswith(suffixes)]
    return sorted(found)


def numpy_include():
    import numpy

    return numpy.get_include()


EMU_NCCL = "ringattn._emu_nccl"


def emu_nccl_extension(nccl_inc):
    """The stand-in NCCL of the emulated GPU (csrc/emu/nccl): a shared
    library that csrc/comm/nccl_loader.c opens with dlopen, as it opens a
    real libnccl."""
    sources = [f for f in tree_files("csrc/emu/nccl", ".c", ".cpp")]
    inc = [os.path.join(ROOT, "csrc", "emu", "include"),
           os.path.join(ROOT, "csrc"), nccl_inc]
    return Extension(
        EMU_NCCL, sources=sources, include_dirs=inc,
        define_macros=[("RA_CUDA_EMULATED", "1")],
        extra_compile_args=["-O2", "-fvisibility=hidden", "-Wall"],
        libraries=["pthread"])


ext = Extension(
    "ringattn._C",
    # csrc/emu/nccl is the emulated GPU's stand-in NCCL, a library of its own
    sources=[f for f in tree_files("csrc", ".c")
             if not f.startswith(os.path.join("csrc", "emu") + os.sep)],
    include_dirs=["csrc", numpy_include()],
    extra_compile_args=["-O3", "-std=gnu11", "-fopenmp", "-fno-math-errno",
                        "-fno-trapping-math", "-fvisibility=hidden", "-Wall",
                        "-Wno-unknown-pragmas"],
    extra_link_args=["-fopenmp"],
    libraries=["dl", "pthread"],
    depends=tree_files("csrc", ".h"),
)


def extensions():
    """The C core, and with RINGATTN_CUDA=emulate the stand-in NCCL (when
    nccl.h is found: without it the nccl backend is left out anyway)."""
    exts = [ext]
    if os.environ.get("RINGATTN_CUDA", "").strip() == "emulate":
        nccl_inc = find_nccl_include(find_cuda_home())
        if nccl_inc is not None:
            exts.append(emu_nccl_extension(nccl_inc))
    return exts


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
