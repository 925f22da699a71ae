"""JAX stays optional: building ringattn never reads a jaxlib header, and
importing ringattn (even asking for its FFI handlers) never imports JAX."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_importing_ringattn_does_not_import_jax():
    code = ("import sys, ringattn as ra\n"
            "targets = ra._C.ffi_targets()\n"
            "assert 'ringattn_attn_fwd' in targets['cpu'], targets\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('jax', 'jaxlib'))\n"
            "assert not loaded, loaded\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr


def test_c_sources_never_include_jaxlib_headers():
    """The handlers use ringattn's own definitions of XLA's FFI ABI."""
    offenders = []
    for folder, _, files in os.walk(os.path.join(ROOT, "csrc")):
        for name in files:
            with open(os.path.join(folder, name), errors="replace") as f:
                if any(line.lstrip().startswith("#include") and "xla/ffi/api" in line
                       for line in f):
                    offenders.append(name)
    assert offenders == []


def test_build_requirements_do_not_name_jax():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    build = text.split("[build-system]", 1)[1].split("\n[", 1)[0]
    assert "jax" not in build
