"""tools/sass_report.py: its SASS parsing and control-flow logic on listings
checked in here (no CUDA tool needed), and the rule it keeps on the
installed build: no tensor-core kernel touches local memory (no spill, no
stack frame, no local array).  The rule needs a real CUDA build of ringattn
(the README's test command makes one where nvcc is found) and cuobjdump
and the nvdisasm its -sass runs (the toolkit's, or the
`nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` wheels the test extra
installs); it is skipped without them.  A kernel listed in KNOWN_SPILLS
is a strict expected failure (bwd_wg at head_dim 128 unmasked today;
dkdv_tc at head_dim 128, which spilled with 255 registers, streams
16-row query tiles since), so the day it stops spilling it fails as XPASS
and must leave the list."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PATH = os.path.join(ROOT, "tools", "sass_report.py")
if not os.path.exists(_PATH):
    pytest.skip("no tools/ in this tree", allow_module_level=True)
_spec = importlib.util.spec_from_file_location("sass_report", _PATH)
sr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sr)


# ---------------------------------------------------------------- parsing

# cuobjdump -sass of fwd_tc<bf16,128,-> for sm_90 (CUDA 13.0), cut to a few lines
REAL_EXCERPT = """
\tcode for sm_90
\t.target\tsm_90

\t\tFunction : _ZN47_GLOBAL__N__6d1ccad3_14_attn_fwd_tc_cu_7be9e56713fwd_tc_kernelI13__nv_bfloat16Li128ELb0EEEv18ra_attn_fwd_paramsl
\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                              /* 0x00000a00ff017b82 */
                                                                                                       /* 0x000fe20000000800 */
        /*0060*/              @!P0 BRA 0x170 ;                                                         /* 0x0000000000408947 */
                                                                                                       /* 0x004fea0003800000 */
        /*5160*/                   LDSM.16.M88.4 R28, [R115+0x3000] ;                                  /* 0x000030007300783b */
                                                                                                       /* 0x000e680000000200 */
        /*51f0*/                   HMMA.16816.F32.BF16 R116, R108.reuse, R28, RZ ;                     /* 0x0000001c6c74723c */
                                                                                                       /* 0x002fec00000418ff */
"""


def test_parses_a_real_cuobjdump_listing():
    funcs = sr.parse_sass(REAL_EXCERPT)
    [(name, instrs)] = funcs.items()
    assert sr.label(*sr.short_name(name)) == "fwd_tc<bf16,128,->"
    assert [i.addr for i in instrs] == [0x0, 0x60, 0x5160, 0x51f0]
    bra = instrs[1]
    assert (bra.pred, bra.base, bra.target) == ("@!P0", "BRA", 0x170)
    ldsm, hmma = instrs[2], instrs[3]
    assert ldsm.opcode == "LDSM.16.M88.4" and sr.op_class(ldsm.opcode) == "LDSM"
    # the ldmatrix sets scoreboard 1; the mma waits on it (mask 0b10)
    assert (ldsm.ctrl["stall"], ldsm.ctrl["wbar"]) == (4, 1)
    assert (hmma.ctrl["wait"], hmma.ctrl["wbar"], hmma.ctrl["stall"]) == (0b10, 7, 6)
    assert sr.op_class(hmma.opcode) == "HMMA"


def ctrl_word(stall=1, wbar=7, rbar=7, wait=0):
    return (stall << 41) | (1 << 45) | (wbar << 46) | (rbar << 49) | (wait << 52)


def listing(name, body):
    """A cuobjdump-style listing of (address, text, control kwargs) rows."""
    lines = [f"\t\tFunction : {name}"]
    for addr, text, ctrl in body:
        lines.append(f"        /*{addr:04x}*/ {text} ;  /* 0x0000000000000000 */")
        lines.append(f"                               /* 0x{ctrl_word(**ctrl):016x} */")
    return "\n".join(lines)


KERNEL = "_ZN12_GLOBAL__N_112dq_tc_kernelI6__halfLi64ELb1EEEv18ra_attn_bwd_paramsl"
# prologue; a loop (0x40 .. 0x110) whose every iteration runs LDSM + 2 HMMA
# and a conditional cp.async prefetch (hot), and whose masked tiles alone run
# a select (cold); an outer loop around it (0x30 .. 0x130) with no HMMA of
# its own; exit
LOOP = [
    (0x00, "S2R R0, SR_TID.X", {}),
    (0x10, "ISETP.GE.AND P0, PT, R0, 0x1, PT", {}),
    (0x20, "@P0 EXIT", {}),
    (0x30, "IADD3 R9, R9, 0x1, RZ", {}),                     # outer header
    (0x40, "LDSM.16.M88.4 R4, [R2]", {"wbar": 0, "stall": 2}),  # inner header
    (0x50, "HMMA.16816.F32 R8, R4, R6, R8", {"wait": 0b1, "stall": 6}),
    (0x60, "HMMA.16816.F32 R12, R4, R6, R12", {"stall": 6}),
    (0x70, "@P1 BRA 0x90", {}),
    (0x80, "LDGSTS.E.BYPASS.128 [R3], desc[UR4][R10.64]", {}),  # prefetch
    (0x90, "@P2 BRA 0xb0", {}),
    (0xa0, "FSEL R8, R8, -INF, P3", {}),                     # mask
    (0xb0, "MUFU.EX2 R8, R8", {"wbar": 1}),
    (0xc0, "FFMA R8, R8, R9, R1", {"wait": 0b10}),
    (0xd0, "BAR.SYNC.DEFER_BLOCKING 0x0", {}),
    (0x100, "ISETP.NE.AND P0, PT, R1, RZ, PT", {}),
    (0x110, "@P0 BRA 0x40", {}),                             # inner latch
    (0x120, "ISETP.NE.AND P4, PT, R9, R7, PT", {}),
    (0x130, "BRA P4, 0x30", {}),                             # outer latch (predicate operand)
    (0x140, "EXIT", {}),
]


def test_inner_loop_is_the_innermost_one_holding_the_mma():
    [(name, instrs)] = sr.parse_sass(listing(KERNEL, LOOP)).items()
    assert sr.label(*sr.short_name(name)) == "dq_tc<fp16,64,M>"
    lp = sr.inner_loop(instrs)
    assert lp["header"] == "0x40" and lp["latches"] == ["0x110"]
    per = lp["per_tile"]
    # always: LDSM, 2 HMMA, 2 conditional BRA, MUFU, FFMA, BAR, ISETP, the
    # latch BRA; hot: LDGSTS; cold: FSEL
    assert (per["HMMA"], per["LDSM"], per["LDGSTS"], per["MUFU"], per["FFMA"]) == (2, 1, 1, 1, 1)
    assert per["FSEL"] == 0 and lp["cold"]["FSEL"] == 1 and lp["cold"]["total"] == 1
    assert per["total"] == 11 and per["mufu"] == {"EX2": 1}
    assert sorted(r["hot"] for r in lp["regions"]) == [False, True]


# a loop whose prefetch (taken on every tile but the last) has two
# alternatives, cp.async for a whole tile, plain loads and stores for the
# sequence's last, partial one, and after them a cp.async of its own (the
# tile's segment ids) that both lead to
LOOP_ALT = [
    (0x00, "S2R R0, SR_TID.X", {}),
    (0x10, "LDSM.16.M88.4 R4, [R2]", {}),                      # header
    (0x20, "HMMA.16816.F32 R8, R4, R6, R8", {}),
    (0x30, "@P1 BRA 0xd0", {}),                                # no next tile
    (0x40, "@P2 BRA 0x70", {}),                                # the last tile?
    (0x50, "LDGSTS.E.BYPASS.128 [R3], desc[UR4][R10.64]", {}),  # whole tile
    (0x60, "BRA 0x90", {}),
    (0x70, "LDG.E.128 R12, desc[UR4][R10.64]", {}),            # partial tile
    (0x80, "STS.128 [R3], R12", {}),
    (0x90, "@P3 BRA 0xc0", {}),                                # join: ids?
    (0xa0, "LDGSTS.E [R5], desc[UR4][R14.64]", {}),            # the ids
    (0xb0, "NOP", {}),
    (0xc0, "LDGDEPBAR", {}),                                   # commit
    (0xd0, "ISETP.NE.AND P0, PT, R1, RZ, PT", {}),
    (0xe0, "@P0 BRA 0x10", {}),                                # latch
    (0xf0, "EXIT", {}),
]


def test_a_branch_that_bypasses_the_hot_work_is_cold():
    [(_, instrs)] = sr.parse_sass(listing(KERNEL, LOOP_ALT)).items()
    lp = sr.inner_loop(instrs)
    per, cold = lp["per_tile"], lp["cold"]
    assert (per["LDGSTS"], per["DEPBAR"], per["LDG"], per["STS"]) == (2, 1, 0, 0)
    assert (cold["LDG"], cold["STS"], cold["total"]) == (1, 1, 2)
    # always: LDSM, HMMA, BRA, ISETP, latch; the prefetch: BRA, LDGSTS,
    # BRA, BRA, LDGSTS, NOP, LDGDEPBAR
    assert per["total"] == 12
    [region] = lp["regions"]
    assert region["hot"] and region["cold_alternative"] == 2


WG_KERNEL = ("_ZN47_GLOBAL__N__50d00784_14_attn_fwd_wg_cu_cda555f113fwd_wg_kernelI13__nv_"
             "bfloat16Li128ELb0EEEvN2ra2wg7FwdArgsE")
# a warp-specialised consumer loop (0x20 .. 0xa0) after the first tile's
# product (0x10): an mbarrier wait whose retry is out of line (a self-loop
# at 0xc0 that jumps back into the loop, as ptxas lays them out), S by an
# HGMMA from two descriptors, O by one with A from registers
WG_LOOP = [
    (0x00, "S2R R0, SR_TID.X", {}),
    (0x10, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT", {}),  # tile 0
    (0x20, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR10], R20", {}),   # loop header
    (0x30, "@!P0 BRA 0xc0", {}),
    (0x40, "WARPGROUP.ARRIVE", {}),
    (0x50, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], R24", {}),
    (0x60, "HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR12].tnspB, R88", {}),
    (0x70, "WARPGROUP.DEPBAR.LE gsb0, 0x1", {}),
    (0x80, "MUFU.EX2 R8, R8", {}),
    (0x90, "ISETP.NE.AND P1, PT, R1, RZ, PT", {}),
    (0xa0, "@P1 BRA 0x20", {}),                                     # loop latch
    (0xb0, "EXIT", {}),
    (0xc0, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR10], R20", {}),   # the retry
    (0xd0, "@!P0 BRA 0xc0", {}),
    (0xe0, "BRA 0x40", {}),
]


def test_out_of_line_waits_leave_the_consumer_loop_found():
    # a spin wait's retry block is a loop of its own (header = latch): its
    # body is that block alone (not every block that reaches it, which
    # would hold more HGMMA than the consumer loop), so the consumer loop
    # stays the inner loop
    [(name, instrs)] = sr.parse_sass(listing(WG_KERNEL, WG_LOOP)).items()
    assert sr.label(*sr.short_name(name)) == "fwd_wg<bf16,128,->"
    lp = sr.inner_loop(instrs)
    assert lp["header"] == "0x20" and lp["latches"] == ["0xa0"]
    per = lp["per_tile"]
    assert (per["HGMMA"], per["MUFU"]) == (2, 1)
    # HGMMA 64x128x16 = 16 m16n8k16 products per warp, 64x64x16 = 8; a
    # warp's share of the shared-memory operands: (A 2 KB + B 4 KB) / 4
    # from descriptors, B 2 KB / 4 with A in registers
    assert per["HGMMA_EQ"] == 16 + 8
    assert per["HGMMA_SMEM"] == (2048 + 4096) // 4 + 2048 // 4


def test_single_warp_schedule_waits_on_scoreboards():
    [(_, instrs)] = sr.parse_sass(listing(KERNEL, LOOP)).items()
    lat = dict(sr.LATENCY, LDSM=30, MUFU=20)
    ldsm, hmma = instrs[4], instrs[5]
    # the mma waits the ldmatrix's 30 cycles, then its own stall
    assert sr.warp_cycles([ldsm, hmma], lat) == 30 + 6
    # without waits: the sum of the stalls (at least 1 each)
    assert sr.warp_cycles(instrs[0:3], lat) == 3
    assert sr.warp_cycles([], lat) is None


def test_unconditional_branch_and_exit_end_the_fallthrough():
    body = [(0x00, "BRA 0x20", {}), (0x10, "HMMA.16816.F32 R0, R0, R0, R0", {}),
            (0x20, "EXIT", {})]
    [(_, instrs)] = sr.parse_sass(listing(KERNEL, body)).items()
    blocks, succ = sr.basic_blocks(instrs)
    assert blocks == [(0, 1), (1, 2), (2, 3)]
    assert succ == {0: [2], 1: [2], 2: []}
    assert sr.inner_loop(instrs) is None  # no loop at all


def test_names_resource_usage_and_ptxas_lines():
    assert sr.short_name("_ZN1a14dkdv_tc_kernelI13__nv_bfloat16Li128ELb0EEEvv")[1] == {
        "args": ["bf16", 128, False], "dtype": "bf16", "D": 128, "M": False}
    assert sr.short_name("cuda_sm20_div_s64")[0] == "cuda_sm20_div_s64"
    res = sr.parse_res_usage(
        " Function _Zfoo:\n  REG:255 STACK:32 SHARED:1024 LOCAL:0 CONSTANT[0]:888 TEXTURE:0\n")
    assert res == {"_Zfoo": {"REG": 255, "STACK": 32, "SHARED": 1024, "LOCAL": 0}}
    ptx = sr.parse_ptxas(
        "ptxas info    : Compiling entry function '_Zfoo' for 'sm_90'\n"
        "ptxas info    : Function properties for _Zfoo\n"
        "    32 bytes stack frame, 32 bytes spill stores, 16 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 32 bytes cumulative stack size\n")
    assert ptx == {"_Zfoo": {"stack": 32, "spill_stores": 32, "spill_loads": 16, "regs": 255}}


def test_dynamic_shared_memory_matches_the_launches():
    # Nsight Compute on the H100 (bf16, D 128): 98 KB per block for dq_tc,
    # the 1 KB sm_90 reserves per block included; the forward (128-row
    # blocks, cuda/fwd_tc/traits.cuh): Q 32 KB and two stages of K and V
    # 64 KB, the masks' ids and words 576 bytes more
    assert sr.DYNAMIC_SMEM["fwd_tc_kernel"](128, False) == 98304
    assert sr.DYNAMIC_SMEM["fwd_tc_kernel"](128, True) == 98304 + 576
    assert sr.DYNAMIC_SMEM["fwd_tc_kernel"](64, False) == 49152
    assert sr.DYNAMIC_SMEM["dq_tc_kernel"](128, False) + 1024 == 99328
    # not yet profiled: dkdv_tc with 16-row query tiles at D 128 (K, V of
    # 64 keys, 2 stages of 16-row Q and dout, 6 x 16 row statistics), and
    # the fused kernel (attn_bwd_fused.cuh Layout: 166,016 and 100,480
    # bytes, with masks 166,592 and 101,056)
    assert sr.DYNAMIC_SMEM["dkdv_tc_kernel"](128, False) == (2 * 64 + 4 * 16) * 128 * 2 + 6 * 16 * 4
    assert [sr.DYNAMIC_SMEM["bwd_tc_kernel"](D, M) for D in (128, 64) for M in (False, True)] \
        == [166016, 166592, 100480, 101056]


# ---------------------------------------------------------------- the rule

# the default build's architectures (setup.py DEFAULT_CUDA_ARCHS)
ARCHS = ("sm_80", "sm_90a")
TC_KERNELS = [f"{fam}<{t},{d},{m}>" for fam in ("bwd_tc", "dkdv_tc", "dq_tc", "fwd_tc")
              for t in ("bf16", "fp16") for d in (128, 64) for m in ("-", "M")]
# the wgmma/TMA kernels (cuda/hopper/): real code on sm_90a only; the other
# architectures' cubins hold stubs of them (a trap, no tensor-core loop)
WG_KERNELS = [f"{fam}<{t},{d},{m}>" for fam in ("fwd_wg", "bwd_wg", "dkdv_wg", "dq_wg")
              for t in ("bf16", "fp16") for d in (128, 64) for m in ("-", "M")]


def kernels_of(arch):
    return TC_KERNELS + (WG_KERNELS if arch == "sm_90a" else [])


# (arch, kernel) pairs that touch local memory today, strict expected
# failures (CUDA 13.0): the Hopper backward at head_dim 128, whose
# consumers hold dK and dV (128 registers) beside S^T, dP^T and dQ within
# setmaxnreg's 240, unmasked: 48 bytes of spill loads, 4 local loads per
# 64-row tile.  Its masked instantiation and the deterministic dk/dv pass
# (dkdv_wg) spilled too until the P/dS step was split and the masked one
# written as one walk (for_frag).
# dkdv_tc at head_dim 128 was one until it streamed 16-row query tiles
# (255 registers and 32 bytes of spill stores on sm_90 before, 8.4 million
# local-memory requests in the H100 profile)
KNOWN_SPILLS = {("sm_90a", f"bwd_wg<{t},128,->") for t in ("bf16", "fp16")}


@pytest.fixture(scope="module")
def build_reports():
    import ringattn as ra

    info = ra.cuda_info()
    if not info.get("built") or info.get("emulated"):
        pytest.skip("needs a real CUDA build of ringattn "
                    f"({'emulated' if info.get('emulated') else 'CUDA part not built'})")
    cuobjdump = sr.find_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("no cuobjdump (pip install nvidia-cuda-cuobjdump)")
    if sr.find_tool("nvdisasm") is None:
        pytest.skip("no nvdisasm, which cuobjdump -sass runs (pip install nvidia-cuda-nvdisasm)")
    so = sr.installed_extension()[0]
    reports = {}
    for arch in ARCHS:
        try:
            reports[arch] = {r["kernel"]: r for r in sr.report([so], arch, cuobjdump=cuobjdump)}
        except RuntimeError as exc:  # an arch the build left out
            reports[arch] = exc
    return reports


def _arch_report(build_reports, arch):
    rep = build_reports[arch]
    if isinstance(rep, Exception):
        pytest.skip(f"{arch}: {rep}")
    return rep


@pytest.mark.parametrize("arch", ARCHS)
def test_the_build_has_exactly_the_listed_non_generic_kernels(build_reports, arch):
    # a new kernel family is held to the rule below: list it in TC_KERNELS
    # or WG_KERNELS (or, for a generic kernel, in sass_report.SIMT_FAMILIES)
    rep = _arch_report(build_reports, arch)
    stubs = {k for k in WG_KERNELS if arch != "sm_90a" and k in rep and
             not rep[k]["tensor_core"] and rep[k]["instructions"] < 64}
    assert sorted(set(rep) - stubs) == sorted(kernels_of(arch))


@pytest.mark.parametrize("arch,kernel", [
    pytest.param(a, k, marks=[pytest.mark.xfail(
        (a, k) in KNOWN_SPILLS, strict=True,
        reason="spills today; remove it from KNOWN_SPILLS once it does not")])
    for a in ARCHS for k in kernels_of(a)])
def test_tensor_core_kernels_use_no_local_memory(build_reports, arch, kernel):
    row = _arch_report(build_reports, arch)[kernel]
    assert row["tensor_core"] and row["loop"] is not None
    used = {k: row[k] for k in ("stl", "ldl", "spill_store_bytes", "spill_load_bytes",
                                "stack_bytes", "local_bytes")}
    assert not sr.uses_local_memory(row), f"{kernel} on {arch}: {used}"
