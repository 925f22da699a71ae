"""Packaging: one version everywhere, the license, the declared Python
floor, and an sdist that holds every file the build, the tests, the
examples and the docs read."""

import ast
import glob
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib

import pytest

import ringattn

SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPROJECT = os.path.join(SOURCE_ROOT, "pyproject.toml")

needs_source = pytest.mark.skipif(
    not os.path.exists(PYPROJECT), reason="not run from a source tree")


def _pyproject():
    with open(PYPROJECT, "rb") as f:
        return tomllib.load(f)


def test_version_is_the_same_everywhere():
    proc = subprocess.run([sys.executable, "-m", "ringattn", "--version"],
                          capture_output=True, text=True, timeout=60)
    versions = {ringattn.__version__, importlib.metadata.version("ringattn"),
                proc.stdout.split()[-1]}
    assert len(versions) == 1, versions


def test_license_is_declared_and_shipped():
    meta = importlib.metadata.metadata("ringattn")
    files = [str(f) for f in importlib.metadata.files("ringattn") or []]
    assert meta["License-Expression"] == "MIT" and any(
        f.endswith("LICENSE") for f in files), (dict(meta), files)


@needs_source
def test_python_sources_parse_at_the_declared_floor():
    """requires-python is what CI builds and tests; no newer syntax."""
    spec = _pyproject()["project"]["requires-python"]
    assert spec.startswith(">=3."), spec
    floor = tuple(int(x) for x in spec[2:].split("."))[:2]
    assert sys.version_info[:2] >= floor
    too_new = []
    for path in sorted(glob.glob(os.path.join(SOURCE_ROOT, "ringattn", "*.py"))):
        try:
            ast.parse(open(path).read(), path, feature_version=floor)
        except SyntaxError as e:
            too_new.append(f"{path}: {e}")
    assert not too_new, too_new


# ---- the sdist --------------------------------------------------------------

# folders shipped whole, and what the build compiles or includes from them
SHIPPED_FOLDERS = ("ringattn", "csrc", "cuda", "tests", "examples", "tools",
                   "docs")
JUNK = ("__pycache__", ".pyc", ".so", ".o")


def _expected_files():
    """Files an sdist must hold, walked from the source tree: the package,
    every C/CUDA source and header setup.py compiles or includes (csrc/ and
    cuda/, recursively), the metadata files pyproject.toml names, and what
    the tests, examples and docs read."""
    project = _pyproject()["project"]
    expected = {"setup.py", "pyproject.toml", "MANIFEST.in",
                project["readme"], "bench/RESULTS.md",
                *project.get("license-files", [])}
    for folder in SHIPPED_FOLDERS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(SOURCE_ROOT,
                                                                 folder)):
            dirnames[:] = [d for d in dirnames if d not in JUNK]
            for name in filenames:
                if not name.endswith(JUNK):
                    path = os.path.join(dirpath, name)
                    expected.add(os.path.relpath(path, SOURCE_ROOT))
    return expected


def _unmet_build_requirements():
    """build-system requirements (and 'build' itself) this Python lacks."""
    if importlib.util.find_spec("build") is None:
        return ["build"]
    from packaging.requirements import Requirement

    unmet = []
    for text in _pyproject()["build-system"]["requires"]:
        req = Requirement(text)
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            unmet.append(text)
    return unmet


@pytest.fixture(scope="module")
def sdist_members(tmp_path_factory):
    unmet = _unmet_build_requirements()
    if unmet:
        pytest.skip(f"building without isolation needs {', '.join(unmet)}")
    tree = tmp_path_factory.mktemp("tree") / "ringattn-src"
    shutil.copytree(SOURCE_ROOT, tree, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", *[f"*{j}" for j in JUNK]))
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation",
         "--outdir", str(out), str(tree)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (archive,) = glob.glob(str(out / "*.tar.gz"))
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    top = names[0].split("/")[0]
    return {n[len(top) + 1:] for n in names if n.startswith(top + "/")}


@needs_source
@pytest.mark.timeout(300)
def test_sdist_holds_every_file_the_build_and_tests_read(sdist_members):
    missing = sorted(_expected_files() - sdist_members)
    assert not missing, missing


@needs_source
@pytest.mark.timeout(300)
def test_sdist_holds_no_build_products(sdist_members):
    junk = sorted(n for n in sdist_members
                  if any(part in JUNK or part.endswith(JUNK)
                         for part in n.split("/")))
    assert not junk, junk
