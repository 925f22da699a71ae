"""Build ringattn's C core, and its CUDA kernels when a toolkit is found.

Environment:
  RINGATTN_CUDA=0|1         force the CUDA part off / on (1 fails loudly if
                            no CUDA toolkit is found); default: on when nvcc
                            is found (CUDA_HOME, nvcc on PATH, /usr/local/cuda)
  RINGATTN_CUDA_ARCHS="80;90"  SM targets (default sm_80 and sm_90, plus PTX
                            for the newest so later GPUs can JIT it)
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
    """(enabled, cuda_home) following RINGATTN_CUDA."""
    flag = os.environ.get("RINGATTN_CUDA", "").strip()
    home = find_cuda_home()
    if flag == "0":
        return False, None
    if flag == "1" and home is None:
        raise RuntimeError(
            "RINGATTN_CUDA=1 but no CUDA toolkit was found: set CUDA_HOME or put "
            "nvcc on PATH")
    if flag not in ("", "0", "1"):
        raise RuntimeError(f"RINGATTN_CUDA: expected 0 or 1, got {flag!r}")
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


def cuda_arch_flags():
    archs = os.environ.get("RINGATTN_CUDA_ARCHS", "80;90")
    items = [a.strip().replace("sm_", "").replace(".", "")
             for a in archs.replace(",", ";").split(";") if a.strip()]
    if not items:
        raise RuntimeError("RINGATTN_CUDA_ARCHS is empty")
    flags = []
    for a in items:
        if not a.isdigit() and not a.rstrip("a").isdigit():
            raise RuntimeError(f"RINGATTN_CUDA_ARCHS: bad architecture {a!r}")
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    newest = items[-1]
    flags += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
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
                       os.environ.get("RINGATTN_NVCC_FLAGS"), nccl_inc))
        marker = os.path.join(self.build_temp, "ringattn-build-config")
        os.makedirs(self.build_temp, exist_ok=True)
        previous = open(marker).read() if os.path.exists(marker) else None
        if previous != config:
            self.force = True
            shutil.rmtree(os.path.join(self.build_temp, "cuda"),
                          ignore_errors=True)
        for ext in self.extensions:
            if enabled:
                self.add_cuda(ext, home, jobs)
                if nccl_inc is None:
                    ext.define_macros.append(("RA_NO_NCCL_HEADERS", "1"))
                else:
                    ext.include_dirs.append(nccl_inc)
        print(f"ringattn: CUDA part {'ON (' + home + ')' if enabled else 'OFF'}",
              file=sys.stderr)
        if enabled:
            print("ringattn: nccl backend " +
                  (f"ON (nccl.h in {nccl_inc})" if nccl_inc else
                   "OFF: no nccl.h found (pip install nvidia-nccl-cu13 or "
                   "-cu12, or set NCCL_HOME)"), file=sys.stderr)
        super().build_extensions()
        with open(marker, "w") as f:
            f.write(config)

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


ext = Extension(
    "ringattn._C",
    sources=tree_files("csrc", ".c"),
    include_dirs=["csrc", numpy_include()],
    extra_compile_args=["-O3", "-std=gnu11", "-fopenmp", "-fno-math-errno",
                        "-fno-trapping-math", "-fvisibility=hidden", "-Wall",
                        "-Wno-unknown-pragmas"],
    extra_link_args=["-fopenmp"],
    libraries=["dl", "pthread"],
    depends=tree_files("csrc", ".h"),
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
