"""The emulated GPU's Hopper (sm_90a) instructions (csrc/emu: sync_sm90.cpp,
ptx_wgmma.cpp, ptx_tma.cpp, tensor_map.cpp), through the kernels' own
wrappers (cuda/hopper/ptx_sm90.cuh, cuda/hopper/tensor_map.h), independent
of any attention kernel.  Built from the source tree with the host C++
compiler (tests/emu_build.py), no GPU.

* tests/emu/test_hopper.cpp: wgmma.mma_async m64nNk16 (f16, bf16; A from
  registers or a descriptor, B from a descriptor; K- and M/N-major; no
  swizzle, 32B, 64B, 128B; scale-d 0 and 1; several k-steps; N 8..256),
  every lane's accumulator registers against products computed from the
  PTX ISA's tables by independent code; stmatrix, elect.sync, setmaxnreg,
  named barriers.
* tests/emu/test_tma.cpp: cp.async.bulk.tensor 1-D..5-D loads through
  tensor maps made by cuTensorMapEncodeTiled (reached through
  cudaGetDriverEntryPoint, as the real build does), boxes partly and
  wholly out of bounds, element strides, every swizzle, against a direct
  strided copy; bulk tensor stores; the plain bulk copy; mbarrier phases
  over many reuses, arrive counts, expect_tx before and after the copy.

Each deliberately wrong use below must be flagged with the report named
here (the emulator's checker, or its deadlock detection).
"""

import pytest

from emu_build import CC, CXX, ROOT, Builder, run

if CXX is None or CC is None:
    pytest.skip("needs a C and a C++ compiler", allow_module_level=True)

SCHEDULES = ["forward", "reverse", "random"]

BROKEN_WGMMA = {
    "acc_before_wait": "read of wgmma accumulator register",
    "acc_before_wait_unchecked": "NaN poison",
    "desc_outside": "outside the block's",
    "setmaxnreg_nonuniform": "setmaxnreg is not warpgroup-uniform",
    "wgmma_source_overwrite": "which a pending wgmma.mma_async",
    "no_proxy_fence": "no fence.proxy.async",
    "no_wgmma_fence": "no wgmma.fence",
    "a_frag_write": "write of a wgmma A-fragment register",
    "named_bar_deadlock": "wait at named barrier 3 (96 of 128 threads arrived)",
    "wrong_desc": "a wrong SBO, LBO or swizzle gives a wrong product",
}
BROKEN_TMA = {
    "wrong_phase": "for the phase of parity 1",
    "tma_early_read": "before thread",
    "tma_early_read_unchecked": "poison",
    "expect_tx_never": "expect_tx bytes that never arrive",
    "mbar_uninit": "which no mbarrier.init initialised",
    "store_source_overwrite": "which a pending cp.async.bulk.tensor store",
    "store_no_proxy_fence": "no fence.proxy.async",
    "tma_unwaited_warp": "did not wait for it",
}
UNCHECKED = {"acc_before_wait_unchecked", "tma_early_read_unchecked"}


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
    return Builder(tmp_path_factory.mktemp("emu_hopper"), "checked")


@pytest.fixture(scope="module")
def hopper(builder):
    return builder.program("test_hopper", [ROOT / "tests" / "emu" / "test_hopper.cpp"],
                           [ROOT / "csrc" / "core" / "status.c"])


@pytest.fixture(scope="module")
def tma(builder):
    return builder.program("test_tma", [ROOT / "tests" / "emu" / "test_tma.cpp"],
                           [ROOT / "csrc" / "core" / "status.c"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_wgmma_stmatrix_elect_setmaxnreg_named_barriers(hopper, schedule):
    rc, out = run(hopper, env={"RINGATTN_EMU_SCHEDULE": schedule})
    assert rc == 0 and out.strip().endswith("ok"), out[-4000:]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_bulk_tensor_copies_and_mbarrier_phases(tma, schedule):
    rc, out = run(tma, env={"RINGATTN_EMU_SCHEDULE": schedule})
    assert rc == 0 and out.strip().endswith("ok"), out[-4000:]


def _flagged(exe, case, want):
    env = {"RINGATTN_EMU_QUIET": "1"}
    if case in UNCHECKED:
        env["RINGATTN_EMU_CHECK"] = "0"
    rc, out = run(exe, case, env=env)
    assert rc == 0, out[-4000:]
    assert "flagged:" in out and want in out, out[-4000:]


@pytest.mark.parametrize("case", sorted(BROKEN_WGMMA))
def test_broken_wgmma_use_is_flagged(hopper, case):
    _flagged(hopper, case, BROKEN_WGMMA[case])


@pytest.mark.parametrize("case", sorted(BROKEN_TMA))
def test_broken_bulk_copy_or_mbarrier_use_is_flagged(tma, case):
    _flagged(tma, case, BROKEN_TMA[case])


@pytest.mark.slow
def test_hopper_models_under_address_sanitizer(tmp_path_factory):
    """The emulator's Hopper code (and the kernels) built with ASan + UBSan:
    the working cases and the deadlock canaries run clean.  The kernels are
    not instrumented in this build, so the checker is off (it would miss
    their generic writes)."""
    builder = Builder(tmp_path_factory.mktemp("emu_hopper_asan"), "asan")
    env = {"RINGATTN_EMU_CHECK": "0", "RINGATTN_EMU_QUIET": "1",
           "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}
    for name, cases in (("test_hopper", ["named_bar_deadlock"]),
                        ("test_tma", ["wrong_phase", "expect_tx_never"])):
        exe = builder.program(name, [ROOT / "tests" / "emu" / f"{name}.cpp"],
                              [ROOT / "csrc" / "core" / "status.c"])
        rc, out = run(exe, env=env)
        assert rc == 0 and out.strip().endswith("ok"), out[-4000:]
        for case in cases:
            rc, out = run(exe, case, env=env)
            assert rc == 0 and "flagged: deadlock" in out, out[-4000:]
