"""Shared pytest configuration for ringattn's tests.

Markers: ``gpu`` (needs a CUDA device; skipped cleanly without one) and
``slow`` (large cases; still run by the default test command).
Fixtures: ``rng`` (a NumPy Generator seeded from the test's node id, so every
test draws its own reproducible data).  ``--repeat N`` runs every selected
test N times in a row (ids end in ``-run1`` ... ``-runN``): the GPU kit
repeats the tests of races that way (tools/gpu_check.sh).

On the emulated GPU (a ``RINGATTN_CUDA=emulate`` build) every ``gpu`` test
is also failed by what the emulator's checker reported while it ran (a race,
an out-of-bounds or uninitialised access, a barrier misuse, ...), even when
the test's own assertions passed: after the call and after the teardown,
the hooks below take ``ringattn._C.emu_reports()`` (what was reported since
the last look) and fail on anything there.
"""

import functools
import zlib

import numpy as np
import pytest


def pytest_addoption(parser):
    parser.addoption("--repeat", type=int, default=1, metavar="N",
                     help="run every selected test N times in a row")


def pytest_generate_tests(metafunc):
    """--repeat N: one more parameter, the run, outermost."""
    n = metafunc.config.getoption("repeat", 1)
    if n > 1:
        metafunc.fixturenames.append("_repeat_run")
        metafunc.parametrize("_repeat_run", range(1, n + 1),
                             ids=[f"run{i}" for i in range(1, n + 1)], scope="function")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "slow: large cases (run by default)")
    config.addinivalue_line("markers", "emulated: checks of the emulated GPU build")


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests when ringattn has no usable CUDA device."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    try:
        import ringattn
        available = ringattn.cuda_available()
        reason = ringattn.cuda_info().get("reason", "CUDA not available")
    except Exception as exc:  # ringattn not built: GPU tests cannot run
        available, reason = False, f"ringattn unavailable: {exc}"
    if available:
        return
    skip = pytest.mark.skip(reason=f"no CUDA device: {reason}")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@functools.lru_cache(maxsize=None)
def _emulated_gpu():
    """ringattn._C when it runs on the emulated GPU, else None."""
    try:
        import ringattn
        from ringattn import _C

        return _C if ringattn.cuda_info().get("emulated") else None
    except Exception:  # ringattn not built (or broken): nothing to check
        return None


def _take_emu_reports(item):
    """The checker's reports since the last look (setup included), cleared;
    '' off the emulated GPU and for tests without the gpu marker."""
    core = _emulated_gpu() if item.get_closest_marker("gpu") else None
    if core is None:
        return ""
    reports = core.emu_reports()
    core.emu_reports_clear()
    return reports


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Fail a `gpu` test on the emulated GPU when its checker reported."""
    try:
        result = yield
    except BaseException as exc:
        reports = _take_emu_reports(item)
        if reports:
            exc.add_note(f"the emulated GPU's checker reported:\n{reports}")
        raise
    reports = _take_emu_reports(item)
    if reports:
        pytest.fail("the test passed, but the emulated GPU's checker "
                    f"reported:\n{reports}", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """... and its fixtures' teardown (closing a communicator, ...)."""
    result = yield
    reports = _take_emu_reports(item)
    if reports:
        pytest.fail("the emulated GPU's checker reported in teardown:\n"
                    f"{reports}", pytrace=False)
    return result


@pytest.fixture
def rng(request):
    """NumPy Generator seeded by a hash of the test's node id."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def require_jax():
    """Import jax (CPU) or skip the calling test."""
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    return jax


@pytest.fixture
def jax_module():
    """The jax module with float64 enabled, or a skip."""
    return require_jax()
