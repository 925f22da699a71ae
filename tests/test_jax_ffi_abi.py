"""ringattn's XLA FFI handlers are written against its own definitions of
XLA's FFI C ABI (csrc/xla/xla_ffi.h), so building ringattn never needs
jaxlib.  When jaxlib's headers are installed, tests/c/xla_ffi_abi.c checks
at compile time that every struct, field and constant we use has jaxlib's
layout and value."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_our_ffi_structs_match_jaxlibs_header(tmp_path):
    jax = pytest.importorskip("jax")
    include = jax.ffi.include_dir()
    if not os.path.exists(os.path.join(include, "xla", "ffi", "api", "c_api.h")):
        pytest.skip("this jaxlib ships no XLA FFI headers")
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    proc = subprocess.run(
        [cc, "-std=c11", "-fsyntax-only", "-Wall", "-Werror",
         "-I", include, "-I", os.path.join(ROOT, "csrc", "xla"),
         os.path.join(ROOT, "tests", "c", "xla_ffi_abi.c")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr

