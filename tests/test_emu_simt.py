"""The emulated GPU's SIMT layer, PTX operations and checker (csrc/emu).

Built from the source tree with the host C++ compiler (tests/emu_build.py),
independent of how ringattn is installed; no GPU.

* tests/emu/test_simt.cpp: kernels that must work (3-D indices, barriers,
  shuffles of every kind incl. partial masks, votes, atomics across blocks,
  cp.async done right, static __shared__ arrays, launch limits and the
  shared-memory opt-in) in every
  schedule (threads of a block run forward, reverse and in random order
  between sync points); and deliberately broken kernels, each of which must
  be flagged with the report named here: a missing __syncthreads between a
  shared write and another warp's read, in dynamic and in static shared
  memory (a race; with the checker off, a
  wrong result in every schedule), a buffer rewritten before another warp
  read it, a cp.async destination read before its wait, out-of-bounds
  shared and global accesses, a host pointer in a kernel, a shuffle from a
  lane outside the mask, a barrier deadlock, uninitialised shared and
  global reads, a use after free; and the host reading a kernel's output
  without waiting for its stream (stale every time in lazy mode).
* tests/emu/test_ptx.cpp: ldmatrix (.x4, .trans) and mma.sync m16n8k16
  (f16, bf16) through cuda/mma.cuh's own wrappers, every lane's registers
  against fragments built from the PTX ISA's tables by independent code;
  a wrong lane mapping must give a wrong product.
* tools/cuda_selftest.cu on the emulated GPU: every kernel variant against
  the float64 reference (quick grid), with the checker, and again under
  AddressSanitizer + UBSan (kernels and emulator).
"""

import pytest

from emu_build import CC, CXX, ROOT, Builder, run

if CXX is None or CC is None:
    pytest.skip("needs a C and a C++ compiler", allow_module_level=True)

SCHEDULES = ["forward", "reverse", "random"]
BROKEN = {
    "missing_barrier": "race on __shared__",
    "static_missing_barrier": "race on __shared__",
    "war": "race on __shared__",
    "cp_async_early_read": "before the cp.async.wait_group",
    "oob_shared": "__shared__ read of 4 bytes at offset 512",
    "oob_global": "outside every allocation",
    "host_pointer": "host memory",
    "shfl_outside_mask": "not in the mask",
    "deadlock": "deadlock",
    "uninit_shared": "which no thread of the block has written",
    "uninit_global": "memory never written",
    "use_after_free": "freed memory",
}


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
    return Builder(tmp_path_factory.mktemp("emu"), "checked")


@pytest.fixture(scope="module")
def simt(builder):
    return builder.program("test_simt", [ROOT / "tests" / "emu" / "test_simt.cpp"])


@pytest.fixture(scope="module")
def ptx(builder):
    return builder.program("test_ptx", [ROOT / "tests" / "emu" / "test_ptx.cpp"],
                           [ROOT / "csrc" / "core" / "status.c"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_working_kernels_are_right_and_clean(simt, schedule):
    rc, out = run(simt, env={"RINGATTN_EMU_SCHEDULE": schedule})
    assert rc == 0 and out.strip().endswith("ok"), out


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_kernel_is_flagged(simt, case):
    rc, out = run(simt, case, env={"RINGATTN_EMU_QUIET": "1"})
    assert rc == 0, out
    assert "flagged:" in out and BROKEN[case] in out, out


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_missing_barrier_changes_the_result_without_the_checker(simt, schedule):
    rc, out = run(simt, "missing_barrier",
                  env={"RINGATTN_EMU_CHECK": "0", "RINGATTN_EMU_SCHEDULE": schedule})
    assert rc == 0 and "flagged: thread" in out, out


def test_a_host_read_without_waiting_for_the_stream_sees_stale_data(simt):
    """The kernel's output copied on the legacy stream while the kernel sits
    on a non-blocking stream: in lazy mode the copy never sees it; after the
    stream is synchronised it does."""
    rc, out = run(simt, "host_reads_without_wait", env={"RINGATTN_EMU_LAZY": "1"})
    assert rc == 0 and "flagged: 128 of 128" in out, out


def test_ldmatrix_and_mma_match_the_ptx_fragment_tables(ptx):
    rc, out = run(ptx)
    assert rc == 0 and out.strip().endswith("ok"), out


def test_a_wrong_fragment_lane_gives_a_wrong_product(ptx):
    rc, out = run(ptx, "wrong_lane")
    assert rc == 0 and "flagged:" in out, out


def _selftest(builder):
    cuda = sorted((ROOT / "cuda").glob("*.cu"))
    return builder.program("selftest", cuda + [ROOT / "tools" / "cuda_selftest.cu"],
                           [ROOT / "csrc" / "core" / "status.c"])


def test_selftest_quick_grid_on_the_emulated_gpu(builder):
    rc, out = run(_selftest(builder), "quick", timeout=1200)
    assert rc == 0, out[-4000:]
    assert "0 of" in out and "FAIL" not in out, out[-4000:]


@pytest.mark.slow
def test_selftest_quick_grid_under_address_sanitizer(tmp_path_factory):
    builder = Builder(tmp_path_factory.mktemp("emu_asan"), "asan")
    rc, out = run(_selftest(builder), "quick", timeout=1800,
                  env={"ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1",
                       "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"})
    assert rc == 0, out[-4000:]
    assert "0 of" in out and "FAIL" not in out, out[-4000:]
