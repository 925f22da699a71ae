"""Shared pytest configuration for ringattn's tests.

Markers: ``gpu`` (needs a CUDA device; skipped cleanly without one) and
``slow`` (large cases; still run by the default test command).
Fixtures: ``rng`` (a NumPy Generator seeded from the test's node id, so every
test draws its own reproducible data).
"""

import zlib

import numpy as np
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "slow: large cases (run by default)")


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
