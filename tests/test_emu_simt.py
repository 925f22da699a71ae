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
* tests/emu/test_convert.cpp: float16 and bfloat16 conversions in a kernel,
  bit for bit NumPy's and ml_dtypes' on 250k values.
* tools/cuda_selftest.cu on the emulated GPU: every kernel variant against
  the float64 reference, the quick and the full grid with the checker (the
  full grid in shards of a few minutes each), and the quick grid again
  under AddressSanitizer + UBSan (kernels and emulator).
"""

import re
from concurrent.futures import ThreadPoolExecutor

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
    cuda = sorted((ROOT / "cuda").rglob("*.cu"))
    return builder.program("selftest", cuda + [ROOT / "tools" / "cuda_selftest.cu"],
                           [ROOT / "csrc" / "core" / "status.c"])


# The full grid in shards (`selftest full I/N`: every N-th case from case
# I - 1): the whole grid (775 cases: both backward paths, both forward
# families of the emulated sm_90 device) takes about 21 minutes on 2 cores
# with the checker, more than the suite's 600 s timeout allows one test; a
# test takes a twelfth of it, as two shards of 24 run side by side (I and
# I + 12: together the cases I - 1, I - 1 + 12, ...).  One emulated launch
# keeps about 1.7 of 2 cores busy (its blocks on RINGATTN_EMU_WORKERS
# threads, small grids leave one idle), two processes nearly 2: the twelve
# tests took 39 to 172 s, 20 min in all, where twelve shards run one after
# the other took 24 min.  (The costs spread unevenly: under a load of 4
# jobs per core the shards of 8 took 233 to 851 s.)
FULL_SHARDS = 24
FULL_TESTS = FULL_SHARDS // 2


def _plan(exe, *args):
    """(cases the run would take, cases in the grid) from a dry run."""
    rc, out = run(exe, "plan", *args, timeout=60)
    m = re.search(r"^selftest plan \w+ \d+/\d+: (\d+) of (\d+) cases$", out, re.M)
    assert rc == 0 and m, out
    return int(m[1]), int(m[2])


def test_selftest_full_grid_shards_run_every_case_once(builder):
    """Shard I of N takes the grid's cases I - 1, I - 1 + N, ...: their
    counts sum to the full grid's, and each is what that rule gives (a dry
    run walks the same grid as the real one)."""
    exe = _selftest(builder)
    ran, total = _plan(exe, "full")
    assert ran == total > 600
    counts = [_plan(exe, "full", f"{i}/{FULL_SHARDS}") for i in range(1, FULL_SHARDS + 1)]
    assert all(t == total for _, t in counts)
    assert [n for n, _ in counts] == [len(range(i, total, FULL_SHARDS))
                                      for i in range(FULL_SHARDS)]
    assert sum(n for n, _ in counts) == total


def test_selftest_quick_grid_on_the_emulated_gpu(builder):
    rc, out = run(_selftest(builder), "quick", timeout=1200)
    assert rc == 0, out[-4000:]
    assert "0 of" in out and "FAIL" not in out, out[-4000:]


# 900 s per test: room for a machine several times slower than the 2-core
# one, or as loaded as it was when a shard of 8 took 851 s.
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("part", range(1, FULL_TESTS + 1))
def test_selftest_full_grid_on_the_emulated_gpu(builder, part):
    """The whole grid (4 dtypes, D 8..256, causal, GQA/MQA, S_q != S_k both
    ways, strides, masks, huge scores, merge, copy), two shards per test
    run side by side: every case of each passes, and each ran the cases the
    rule gives it."""
    exe = _selftest(builder)
    shards = (part, part + FULL_TESTS)
    plans = {i: _plan(exe, "full", f"{i}/{FULL_SHARDS}") for i in shards}
    with ThreadPoolExecutor(max_workers=2) as pool:
        outs = dict(zip(shards, pool.map(
            lambda i: run(exe, "full", f"{i}/{FULL_SHARDS}", timeout=850), shards)))
    for i in shards:
        rc, out = outs[i]
        assert rc == 0, out[-4000:]
        m = re.search(rf"^selftest full {i}/{FULL_SHARDS}: (\d+) of (\d+) cases failed "
                      rf"\(grid cases {i - 1}, .* of (\d+)\)$", out, re.M)
        assert m and "FAIL" not in out, out[-4000:]
        assert (int(m[1]), int(m[2]), int(m[3])) == (0, *plans[i]), m[0]


@pytest.mark.slow
def test_selftest_quick_grid_under_address_sanitizer(tmp_path_factory):
    # this flavour's kernels are not instrumented, so the emulator's checker
    # cannot see their plain shared-memory stores (a later ldmatrix of them
    # would read as unwritten): ASan and UBSan are the checkers here, the
    # checked flavour runs the same grid with the emulator's checker
    builder = Builder(tmp_path_factory.mktemp("emu_asan"), "asan")
    rc, out = run(_selftest(builder), "quick", timeout=1800,
                  env={"ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1",
                       "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
                       "RINGATTN_EMU_CHECK": "0"})
    assert rc == 0, out[-4000:]
    assert "0 of" in out and "FAIL" not in out, out[-4000:]


def test_float16_and_bfloat16_conversions_round_as_the_device(builder, tmp_path):
    """__float2half_rn / __float2bfloat16_rn in a kernel, and back to float,
    on random bit patterns (every exponent: subnormals, overflow to inf,
    ties) and the special values: bit for bit NumPy's float16 and
    ml_dtypes' bfloat16 (round to nearest even), NaN as a NaN."""
    np = pytest.importorskip("numpy")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    exe = builder.program("test_convert", [ROOT / "tests" / "emu" / "test_convert.cpp"])
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 200000, dtype=np.uint64).astype(np.uint32)
    # values near float16's edges and halfway points, and the specials
    near = np.concatenate([np.float32([65504, 65519.99, 65520, 65536, 6.1035156e-05,
                                       5.9604645e-08, 2.9802322e-08, 2.9802326e-08,
                                       1.0009765625, 1.00048828125, 0.0, -0.0,
                                       np.inf, -np.inf, np.nan]),
                           (rng.integers(-2**15, 2**15, 50000) / 2**rng.integers(0, 26, 50000)
                            ).astype(np.float32)])
    x = np.concatenate([bits.view(np.float32), near])
    (tmp_path / "in").write_bytes(x.tobytes())
    rc, out = run(exe, str(tmp_path / "in"), str(tmp_path / "out"))
    assert rc == 0, out
    got = np.frombuffer((tmp_path / "out").read_bytes(),
                        dtype=[("h", "<u2"), ("b", "<u2"), ("hf", "<f4"), ("bf", "<f4")])
    nan = np.isnan(x)
    with np.errstate(over="ignore", invalid="ignore"):
        want_h = x.astype(np.float16)
        want_b = x.astype(ml_dtypes.bfloat16)
    assert np.array_equal(got["h"][~nan], want_h.view(np.uint16)[~nan])
    assert np.array_equal(got["b"][~nan], want_b.view(np.uint16)[~nan])
    assert (got["h"][nan] == 0x7FFF).all() and (got["b"][nan] == 0x7FFF).all()
    assert np.array_equal(got["hf"][~nan], want_h.astype(np.float32)[~nan])
    assert np.array_equal(got["bf"][~nan], want_b.astype(np.float32)[~nan])
    assert np.isnan(got["hf"][nan]).all() and np.isnan(got["bf"][nan]).all()
