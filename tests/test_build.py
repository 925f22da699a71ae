"""The build: importing never needs a GPU, and a CUDA toolkit at build time
means the CUDA part is in (checked where the build environment says so)."""

import os

import pytest

import ringattn as ra


def test_import_reports_cuda_state_without_raising():
    info = ra.cuda_info()
    assert set(info) == {"built", "available", "reason", "devices", "emulated",
                         "device_name", "forward_kernels", "backward_kernels"} and (
        info["available"] or info["reason"]), info
    # the kernel families name what runs on device 0: none without a GPU
    families = (info["forward_kernels"], info["backward_kernels"])
    if info["available"]:
        assert families[0] in ("sm90a", "sm80") and families[1] == families[0], info
    else:
        assert families == (None, None), info


@pytest.mark.emulated
@pytest.mark.skipif(os.environ.get("RINGATTN_EXPECT_EMULATED") != "1",
                    reason="set RINGATTN_EXPECT_EMULATED=1 where ringattn was built "
                           "with RINGATTN_CUDA=emulate")
def test_the_emulated_gpu_was_built_and_is_usable():
    info = ra.cuda_info()
    assert info["built"] and info["available"] and info["emulated"], info
    assert info["devices"] >= 2 and "emulated" in info["device_name"], info


@pytest.mark.skipif(os.environ.get("RINGATTN_EXPECT_CUDA_BUILD") != "1",
                    reason="set RINGATTN_EXPECT_CUDA_BUILD=1 where the build "
                           "had a CUDA toolkit")
def test_cuda_part_was_built():
    assert ra.cuda_info()["built"], ra.cuda_info()


def test_cpu_dispatch_picked_a_simd_level():
    assert ra.cpu_info()["simd"] in ("avx512", "avx2", "generic")
