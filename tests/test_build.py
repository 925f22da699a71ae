"""The build: importing never needs a GPU, and a CUDA toolkit at build time
means the CUDA part is in (checked where the build environment says so)."""

import os

import pytest

import ringattn as ra


def test_import_reports_cuda_state_without_raising():
    info = ra.cuda_info()
    assert set(info) == {"built", "available", "reason", "devices"} and (
        info["available"] or info["reason"]), info


@pytest.mark.skipif(os.environ.get("RINGATTN_EXPECT_CUDA_BUILD") != "1",
                    reason="set RINGATTN_EXPECT_CUDA_BUILD=1 where the build "
                           "had a CUDA toolkit")
def test_cuda_part_was_built():
    assert ra.cuda_info()["built"], ra.cuda_info()


def test_cpu_dispatch_picked_a_simd_level():
    assert ra.cpu_info()["simd"] in ("avx512", "avx2", "generic")
