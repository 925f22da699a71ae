#!/usr/bin/env python3
"""sass_report.py -- what ringattn's CUDA kernels compile to, read from their
SASS without a GPU: per kernel instantiation the registers, spills, shared
and local memory, and the instruction mix of the inner loop (one key or
query tile of the tensor-core kernels).

Usage:
    python tools/sass_report.py                     # the installed ringattn's CUDA build
    python tools/sass_report.py --so PATH.so        # any built extension (the fatbin inside)
    python tools/sass_report.py FILE.cubin FILE.o   # cubins or nvcc objects
    python tools/sass_report.py --compile [--files attn_fwd_tc,attn_fwd_wg]
                                                    # nvcc -cubin cuda/*.cu itself (ptxas -v too)
  options: --arch sm_90a (default, as the default build; sm_80 for the Ampere
  SASS, where the Hopper kernels are stubs), --kernels REGEX (on the
  short names, e.g. 'fwd_tc'), --all (the generic SIMT kernels too: by default
  every kernel but SIMT_FAMILIES), --json (one JSON object on stdout), --out
  FILE, --counts FILE (the compact form ringattn/bench/model.py reads: after a
  kernel change, `--so ... --counts ringattn/bench/kernel_counts.json`).

Tools: cuobjdump and the nvdisasm its -sass runs (the CUDA toolkit's, or
the wheels': `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`;
RINGATTN_CUOBJDUMP and RINGATTN_NVDISASM name them), and nvcc for
--compile.  Nothing runs on a GPU.

What each column is:
- regs: registers per thread (cuobjdump -res-usage REG).
- spill st/ld: spill bytes per thread.  With --compile, ptxas -v's "bytes
  spill stores / loads"; from a binary, the sum of the widths of the STL /
  LDL instructions in the kernel (the same numbers for the kernels here;
  a binary carries no ptxas log).  stack: the stack frame (STACK),
  local: local arrays (LOCAL); either > 0 means local memory.
- smem: static shared memory (SHARED) + the dynamic amount the launcher
  asks for (the formulas of DYNAMIC_SMEM below, copied from the launchers;
  "?" for a kernel not listed there).
- the loop columns: instructions of one iteration of the inner loop on the
  path a full tile takes (see below): HMMA (mma.sync), HGMMA (wgmma; the
  JSON also gives HGMMA_EQ, their m16n8k16 equivalents, and HGMMA_SMEM, the
  shared-memory bytes they read, per warp), LDSM (ldmatrix),
  LDS/STS, LDG/STG, LDGSTS (cp.async), LDL/STL (local memory), MUFU (ex2,
  rcp, tanh, ...), FFMA vs FMUL + FADD, FMNMX/FSEL/FSETP, F2FP (the 16-bit
  packs), IMAD, the integer ALU (IADD3, LOP3, ISETP, LEA, SHF, ...), BAR,
  SHFL, and the total.  `cycles`: the single-warp schedule of that path
  (see below).

How the inner loop is found (and the limits of it).  The kernel's SASS
(cuobjdump -sass) is cut into basic blocks at branch targets and after
branches/exits (`BRA` with its target address; `@P BRA` and `BRA P, ...`
also fall through; `EXIT`/`RET` end a block; `CALL` falls through).  The
blocks reachable from the entry get dominators; every edge u -> h where h
dominates u is a back edge and its natural loop is h plus every block that
reaches u without passing h (loops sharing a header are merged).  The inner
loop is the loop holding the most HMMA (or HGMMA), the smallest such loop
when an outer loop holds the same ones.  One iteration of it is then split
into
  - "always": the blocks that dominate every latch (run on every iteration),
  - conditional regions (connected groups of the other blocks), each marked
    "hot" when it holds cp.async (LDGSTS), tensor/ldmatrix work or a global
    reduction (the next tile's prefetch, skipped only on the last tile; the
    fused backward's dQ atomics, skipped only for rows past the sequence)
    and "cold" otherwise
    (the mask tests of tiles that are not fully visible, sequence tails,
    and the like).  Inside a hot region only its path from entry to exit
    through the most hot instructions (ties: the most instructions) is
    counted; a branch that bypasses them (the last tile's plain loads
    beside the cp.async of every other tile) is cold.
per_tile = always + the hot regions' paths: the path of a full tile in the
middle of a sequence; `cold` is the sum of the rest (an upper bound on what
a masked tile adds: exclusive paths are all counted).  Limits: the split
is structural, not a profile (a cold region taken on every tile would be
missed, a hot one skipped would be counted, and of two alternatives that
are both hot only the hotter); a loop the compiler unrolled
by n shows n tiles per iteration, and a loop nested inside the tile loop (a
k-step loop left rolled, e.g. by `#pragma unroll 1`) is counted once, not
per trip: the HMMA count per tile shows both; indirect branches (BRX/JMX)
are not followed (none in these kernels); and the counts are static, per
warp (predicated-off instructions count, as they take an issue slot).
The graph is the one `nvdisasm -bbcfg` draws, built here from cuobjdump's
branch targets so that one tool (one pip wheel) suffices.

The single-warp schedule (`cycles`).  Every Volta+ instruction carries the
compiler's schedule in its control bits: a stall count (cycles before the
next instruction may issue), a yield bit, the scoreboard it sets when its
result lands (variable-latency instructions: LDSM, LDS, MUFU, SHFL, LDG,
...) or when its sources are read, and the scoreboards it waits on.  The
path is replayed in address order as one warp alone would issue it: each
instruction issues at max(previous issue + its stall, the release of the
scoreboards it waits on), a scoreboard being released LATENCY[op] cycles
after the instruction that set it issued.  Fixed-latency work (HMMA, FFMA,
...) is already in the stall counts.  LATENCY holds assumed H100 values
(microbenchmark figures, not measured here); DEPBAR (the cp.async wait) and
BAR cost their stall only, as in a steady state whose prefetch has landed
and whose warps arrive together.  ringattn/bench/model.py turns `cycles`
and the mix into time.
"""
import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---------------------------------------------------------------- the kernels

def _fwd_tc_smem(D, M):
    # Q 128 rows, 2 stages of K and V 64 rows; M: 2 x 64 ids, 2 x 8 words
    return (128 + 4 * 64) * D * 2 + (2 * 64 * 4 + 2 * 8 * 4 if M else 0)


def _dkdv_tc_bm(D, M):
    return (32 if M else 64) if D == 64 else 16


def _dkdv_tc_smem(D, M):
    bm = _dkdv_tc_bm(D, M)
    return (2 * 64 + 4 * bm) * D * 2 + 6 * bm * 4 + (2 * bm * 4 + 2 * 4 * 4 if M else 0)


def _dq_tc_smem(D, M):
    return (2 * 64 + 4 * 64) * D * 2 + (2 * 64 * 4 + 2 * 4 * 4 if M else 0)


def _bwd_tc_smem(D, M):
    # K, V (128 keys), 2 stages of Q, dout (64 rows), P, dS, 2 stages of
    # the rows' 16-byte RowStats; M: key ids, document words; BlockState
    return ((2 * 128 + 4 * 64) * D * 2 + 2 * 64 * 128 * 2 + 2 * 64 * 16 +
            (128 * 4 + 2 * 8 * 4 if M else 0) + 128)


def _fwd_wg_smem(D, M):
    # cuda/hopper/fwd_traits.cuh Smem<D>::kLaunchBytes: Q, 2 stages of K and
    # V (128 x D each), 2 x 128 ids, 2 metas, 9 mbarriers, 1 KB to align
    return (1 + 2 * 2) * 128 * D * 2 + 2 * 128 * 4 + 2 * 8 + 9 * 8 + 1024


def _bwd_wg_smem(D, M):
    # cuda/hopper/bwd_traits.cuh Smem<D>::kLaunchBytes: K, V (128 x D), 2
    # stages of Q, dout (64 x D), 2 x 2 dS^T tiles (64 x 64), 2 x 64
    # RowStats, 2 TileMetas, 5 mbarriers, 1 KB to align (the same for
    # dkdv_wg, which leaves the dS^T tiles unused)
    return (2 * 128 * D * 2 + 4 * 64 * D * 2 + 4 * 64 * 64 * 2 + 2 * 64 * 16 + 2 * 16 + 5 * 8
            + 1024)


def _dq_wg_smem(D, M):
    # cuda/hopper/attn_bwd_wg_dq.cu Smem<D>::kLaunchBytes: Q, dout (128 x
    # D), 2 stages of K, V (64 x D), 2 x 64 key ids, 2 TileMetas, 5
    # mbarriers, 1 KB to align
    return 2 * 128 * D * 2 + 4 * 64 * D * 2 + 2 * 64 * 4 + 2 * 8 + 5 * 8 + 1024


# dynamic shared memory per block, as the launchers compute it (fwd_tc/traits.cuh
# smem_bytes, attn_bwd_tc_dkdv.cu dkdv_smem_bytes, attn_bwd_tc_dq.cu
# dq_smem_bytes, attn_bwd_fused.cuh Layout::kBytes, hopper/fwd_traits.cuh
# Smem); keep in step with them
DYNAMIC_SMEM = {"fwd_tc_kernel": _fwd_tc_smem, "dkdv_tc_kernel": _dkdv_tc_smem,
                "dq_tc_kernel": _dq_tc_smem, "bwd_tc_kernel": _bwd_tc_smem,
                "fwd_wg_kernel": _fwd_wg_smem, "bwd_wg_kernel": _bwd_wg_smem,
                "dkdv_wg_kernel": _bwd_wg_smem, "dq_wg_kernel": _dq_wg_smem}
# what one iteration of each tensor-core kernel's inner loop covers: the
# rows the block owns, the rows of the streamed tile, the block's warps and
# (warp-specialised kernels) the warps that run that loop
TILES = {"fwd_tc_kernel": lambda D, M: {"block_rows": 128, "tile_rows": 64, "warps": 8},
         "fwd_wg_kernel": lambda D, M: {"block_rows": 128, "tile_rows": 128, "warps": 12,
                                        "mma_warps": 8,
                                        # K and V of a tile, by bulk tensor copies
                                        # (no instruction of the loop shows them)
                                        "tile_copy_bytes": 2 * 128 * D * 2},
         "dkdv_tc_kernel": lambda D, M: {"block_rows": 64, "tile_rows": _dkdv_tc_bm(D, M),
                                         "warps": 4},
         "dq_tc_kernel": lambda D, M: {"block_rows": 64, "tile_rows": 64, "warps": 4},
         "bwd_tc_kernel": lambda D, M: {"block_rows": 128, "tile_rows": 64, "warps": 8},
         "bwd_wg_kernel": lambda D, M: {"block_rows": 128, "tile_rows": 64, "warps": 12,
                                        "mma_warps": 8,
                                        # Q and dout of a tile, by bulk tensor copies
                                        "tile_copy_bytes": 2 * 64 * D * 2}}
TILES["dkdv_wg_kernel"] = TILES["bwd_wg_kernel"]
TILES["dq_wg_kernel"] = lambda D, M: {"block_rows": 128, "tile_rows": 64, "warps": 12,
                                      "mma_warps": 8,
                                      # K and V of a tile, by bulk tensor copies
                                      "tile_copy_bytes": 2 * 64 * D * 2}

# assumed latencies (cycles) of the variable-latency instructions on an
# H100, for the single-warp schedule: shared-memory loads and ldmatrix
# ~30, MUFU ~20, shuffles ~25, global/L2 loads ~600 (DRAM; L2 hits ~270),
# S2R ~25; a read scoreboard (sources consumed) is released after READ_LATENCY
LATENCY = {"LDSM": 30, "LDS": 30, "LDSU": 30, "MUFU": 20, "SHFL": 25, "LDG": 600,
           "LD": 600, "LDL": 200, "S2R": 25, "S2UR": 25, "CS2R": 10, "LDC": 20,
           "ULDC": 20, "ATOMS": 40, "REDG": 600, "RED": 600, "ATOMG": 600, "ATOM": 600,
           "F2F": 12, "I2F": 12, "F2I": 12, "I2FP": 12, "POPC": 12, "FLO": 12, "BREV": 12,
           "R2UR": 10, "VOTE": 10, "DMUL": 20, "DFMA": 20, "DADD": 20, "DSETP": 20}
DEFAULT_LATENCY = 20
READ_LATENCY = 8

# instruction classes of the mix, in the order they are printed; HGMMA_EQ and
# HGMMA_SMEM are not instructions but what a warp's share of its HGMMAs
# amounts to: HGMMA.64xNx16 is N/8 mma.sync m16n8k16 products per warp, and
# reads (A 64 x 16 when from a descriptor, +) B N x 16 16-bit
# elements of shared memory per warpgroup, a quarter of that per warp
CLASSES = ("HMMA", "HGMMA", "LDSM", "LDS", "STS", "LDG", "STG", "LDGSTS", "LDL", "STL",
           "RED", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "F2FP", "IMAD", "IALU",
           "MOV", "UNIFORM", "BAR", "SHFL", "DEPBAR", "BRANCH", "OTHER", "HGMMA_EQ",
           "HGMMA_SMEM")
_CLASS_OF = {
    "HMMA": "HMMA", "HGMMA": "HGMMA", "LDSM": "LDSM", "LDS": "LDS", "LDSU": "LDS",
    "STS": "STS", "LDG": "LDG", "LD": "LDG", "STG": "STG", "ST": "STG", "LDGSTS": "LDGSTS",
    "LDL": "LDL", "STL": "STL", "RED": "RED", "REDG": "RED", "ATOM": "RED", "ATOMG": "RED",
    "ATOMS": "RED", "MUFU": "MUFU", "FFMA": "FFMA", "FFMA2": "FFMA", "FMUL": "FMUL",
    "FMUL2": "FMUL", "FADD": "FADD", "FADD2": "FADD", "FMNMX": "FMNMX", "FSEL": "FSEL",
    "FSETP": "FSEL", "FSET": "FSEL", "F2FP": "F2FP", "IMAD": "IMAD", "IMUL": "IMAD",
    "IADD3": "IALU", "VIADD": "IALU", "LOP3": "IALU", "ISETP": "IALU", "LEA": "IALU",
    "SHF": "IALU", "SEL": "IALU", "PRMT": "IALU", "IABS": "IALU", "VIMNMX": "IALU",
    "VIMNMX3": "IALU", "VIADDMNMX": "IALU", "IMNMX": "IALU", "PLOP3": "IALU",
    "P2R": "IALU", "R2P": "IALU", "LOP": "IALU", "FLO": "IALU", "POPC": "IALU",
    "BREV": "IALU", "MOV": "MOV", "CS2R": "MOV", "S2R": "MOV", "BAR": "BAR",
    "SHFL": "SHFL", "DEPBAR": "DEPBAR", "LDGDEPBAR": "DEPBAR", "BRA": "BRANCH",
    "BSSY": "BRANCH", "BSYNC": "BRANCH", "EXIT": "BRANCH", "WARPSYNC": "BRANCH",
    "BREAK": "BRANCH", "CALL": "BRANCH", "RET": "BRANCH", "NOP": "OTHER"}


def op_class(opcode):
    """The mix class of an opcode such as "HMMA.16816.F32.BF16"."""
    base = opcode.split(".")[0]
    if base in _CLASS_OF:
        return _CLASS_OF[base]
    if base.startswith("U") or base in ("R2UR", "S2UR", "LDC", "ULDC"):
        return "UNIFORM"
    return "OTHER"


# ---------------------------------------------------------------- parsing

class Instr:
    """One SASS instruction: address, guard predicate (or None), opcode
    with modifiers, operand text, branch target address (or None), and the
    control bits (stall, yield, write/read scoreboard, wait mask; None when
    the listing had no encodings)."""
    __slots__ = ("addr", "pred", "opcode", "operands", "target", "ctrl")

    def __init__(self, addr, pred, opcode, operands, target=None, ctrl=None):
        self.addr, self.pred, self.opcode, self.operands = addr, pred, opcode, operands
        self.target, self.ctrl = target, ctrl

    @property
    def base(self):
        return self.opcode.split(".")[0]


_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")
_INSTR = re.compile(r"/\*([0-9a-fA-F]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)"
                    r"\s*(.*?)\s*;(?:\s*/\*\s*(0x[0-9a-fA-F]{16})\s*\*/)?")
_HEXONLY = re.compile(r"^\s*/\*\s*(0x[0-9a-fA-F]{16})\s*\*/\s*$")
_TARGET = re.compile(r"(?:^|[\s,])(0x[0-9a-fA-F]+)\s*$")


def decode_ctrl(hi):
    """Volta+ control bits from the high 64-bit word of an instruction."""
    return {"stall": (hi >> 41) & 0xF, "yield": (hi >> 45) & 1, "wbar": (hi >> 46) & 7,
            "rbar": (hi >> 49) & 7, "wait": (hi >> 52) & 0x3F}


def parse_sass(text):
    """cuobjdump -sass text -> {function name: [Instr]} (in address order).
    Branch targets are hex addresses (cuobjdump's form)."""
    funcs = {}
    cur = None
    pending = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            pending = None
            continue
        if cur is None:
            continue
        m = _INSTR.search(line)
        if m:
            addr = int(m.group(1), 16)
            pred = m.group(2).strip() if m.group(2) else None
            opcode, operands = m.group(3), m.group(4)
            target = None
            if opcode.split(".")[0] in ("BRA", "CALL", "BSSY", "BRX", "JMP", "JMX"):
                t = _TARGET.search(operands)
                if t:
                    target = int(t.group(1), 16)
            pending = Instr(addr, pred, opcode, operands, target)
            cur.append(pending)
            continue
        m = _HEXONLY.match(line)
        if m and pending is not None and pending.ctrl is None:
            pending.ctrl = decode_ctrl(int(m.group(1), 16))
            pending = None
    return funcs


def parse_res_usage(text):
    """cuobjdump -res-usage text -> {function: {"REG":, "STACK":, "SHARED":, "LOCAL":}}."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function\s+(\S+?):\s*$", line)
        if m:
            cur = m.group(1)
            continue
        if cur and "REG:" in line:
            out[cur] = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}
            cur = None
    return out


def parse_ptxas(text):
    """ptxas -v text -> {function: {"regs":, "spill_stores":, "spill_loads":, "stack":}}."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([\w$]+)'?", line)
        if m:
            cur = out.setdefault(m.group(1), {})
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                       spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["regs"] = int(m.group(1))
    return out


# ---------------------------------------------------------------- control flow

def _ends_block(ins):
    return ins.base in ("BRA", "EXIT", "RET", "BRX", "JMP", "JMX")


def _unconditional(ins):
    """A branch/exit with no guard and no predicate operand always leaves."""
    if ins.pred not in (None, "@PT"):
        return False
    if ins.base == "BRA":
        # "BRA P3, 0x..." / "BRA !P0, ..." is conditional on that predicate
        return not re.match(r"\s*!?U?P[0-6]\s*,", ins.operands)
    return True


def basic_blocks(instrs):
    """[(start index, end index exclusive)], {block: [successor blocks]}."""
    if not instrs:
        return [], {}
    index = {ins.addr: i for i, ins in enumerate(instrs)}
    leaders = {0}
    for i, ins in enumerate(instrs):
        if ins.base in ("BRA", "BRX", "JMP") and ins.target in index:
            leaders.add(index[ins.target])
        if _ends_block(ins) and i + 1 < len(instrs):
            leaders.add(i + 1)
    starts = sorted(leaders)
    blocks = [(s, starts[k + 1] if k + 1 < len(starts) else len(instrs))
              for k, s in enumerate(starts)]
    block_of = {s: b for b, (s, _) in enumerate(blocks)}
    succ = {}
    for b, (s, e) in enumerate(blocks):
        last = instrs[e - 1]
        out = []
        if last.base in ("BRA", "JMP") and last.target in index:
            out.append(block_of[index[last.target]])
        if not (_ends_block(last) and _unconditional(last)) and e < len(instrs):
            out.append(block_of[e])
        succ[b] = out
    return blocks, succ


def dominators(n_blocks, succ, entry=0):
    """{block: set of dominators} over the blocks reachable from entry."""
    reach, stack = {entry}, [entry]
    while stack:
        for v in succ.get(stack.pop(), ()):
            if v not in reach:
                reach.add(v)
                stack.append(v)
    pred = {b: [] for b in reach}
    for u in reach:
        for v in succ.get(u, ()):
            pred[v].append(u)
    dom = {b: set(reach) for b in reach}
    dom[entry] = {entry}
    order = sorted(reach)
    changed = True
    while changed:
        changed = False
        for b in order:
            if b == entry:
                continue
            ps = [dom[p] for p in pred[b]]
            new = set.intersection(*ps) if ps else set()
            new = new | {b}
            if new != dom[b]:
                dom[b] = new
                changed = True
    return dom, pred


def natural_loops(blocks, succ):
    """[{"header":, "latches": [...], "body": set}] (loops sharing a header merged)."""
    dom, pred = dominators(len(blocks), succ)
    loops = {}
    for u in dom:
        for h in succ.get(u, ()):
            if h in dom[u]:
                # (a self-loop, u == h, is h alone: the walk stops at h)
                body, stack = {h, u}, ([u] if u != h else [])
                while stack:
                    x = stack.pop()
                    for p in pred.get(x, ()):
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                lp = loops.setdefault(h, {"header": h, "latches": [], "body": set()})
                lp["latches"].append(u)
                lp["body"] |= body
    return list(loops.values()), dom


def red_bytes(opcode):
    """L2 bytes of one warp's global reduction (RED/REDG/ATOMG): read and
    written, 32 lanes x 4 bytes x the vector width (.F32x2, .F32x4)."""
    width = 4 if "x4" in opcode else 2 if "x2" in opcode else 1
    return 2 * 32 * 4 * width


def mix_of(instrs):
    """{class: count} plus "total", "mufu" ({EX2: n, ...}) and RED_BYTES
    (the L2 bytes of the global reductions, red_bytes)."""
    mix = {c: 0 for c in CLASSES}
    mufu = {}
    rb = 0
    for ins in instrs:
        cls = op_class(ins.opcode)
        mix[cls] += 1
        if ins.base == "HGMMA":
            shape = re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)", ins.opcode)
            if shape:
                n = int(shape.group(2))
                mix["HGMMA_EQ"] += n // 8
                # "D, gdesc[UR], C": A and B from descriptors; "D, Ra, gdesc[UR], C": A
                # from registers
                ops = [o.strip() for o in ins.operands.split(",")]
                a_smem = 64 * 16 * 2 if len(ops) > 1 and ops[1].startswith("gdesc") else 0
                mix["HGMMA_SMEM"] += (a_smem + n * 16 * 2) // 4
        if ins.base == "MUFU":
            kind = ins.opcode.split(".")[1] if "." in ins.opcode else "?"
            mufu[kind] = mufu.get(kind, 0) + 1
        if cls == "RED" and ins.base != "ATOMS":
            rb += red_bytes(ins.opcode)
    mix["total"] = len(instrs)
    mix["mufu"] = mufu
    mix["RED_BYTES"] = rb
    return mix


def add_mix(a, b):
    out = {c: a[c] + b[c] for c in CLASSES + ("total", "RED_BYTES")}
    out["mufu"] = dict(a["mufu"])
    for k, v in b["mufu"].items():
        out["mufu"][k] = out["mufu"].get(k, 0) + v
    return out


def warp_cycles(instrs, latency=None):
    """Cycles one warp alone takes to issue `instrs` in order (the control
    bits' stalls plus scoreboard waits), or None without control bits."""
    latency = LATENCY if latency is None else latency
    if not instrs or any(ins.ctrl is None for ins in instrs):
        return None
    t, release = 0, [0] * 8
    for ins in instrs:
        c = ins.ctrl
        issue = t
        for sb in range(6):
            if c["wait"] >> sb & 1:
                issue = max(issue, release[sb])
        if c["wbar"] < 6:
            release[c["wbar"]] = issue + latency.get(ins.base, DEFAULT_LATENCY)
        if c["rbar"] < 6:
            release[c["rbar"]] = issue + READ_LATENCY
        t = issue + max(1, c["stall"])
    # what the path left in flight lands before the next iteration uses it
    return max([t] + release[:6])


# the instructions that make a conditional region of the loop hot
HOT = ("LDGSTS", "HMMA", "HGMMA", "LDSM", "RED", "REDG")


def inner_loop(instrs):
    """The inner loop of a tensor-core kernel (module docstring), or None."""
    blocks, succ = basic_blocks(instrs)
    loops, dom = natural_loops(blocks, succ)

    def count(body, names):
        return sum(1 for b in body for ins in instrs[blocks[b][0]:blocks[b][1]]
                   if ins.base in names)

    best = None
    for lp in loops:
        key = (count(lp["body"], ("HMMA", "HGMMA")),
               -sum(blocks[b][1] - blocks[b][0] for b in lp["body"]))
        if key[0] > 0 and (best is None or key > best[0]):
            best = (key, lp)
    if best is None:
        return None
    lp = best[1]
    body = lp["body"]
    always = {b for b in body if all(b in dom[latch] for latch in lp["latches"])}
    cond = body - always
    # connected regions of the conditional blocks (edges either way)
    adj = {b: set() for b in cond}
    for u in cond:
        for v in succ.get(u, ()):
            if v in cond:
                adj[u].add(v)
                adj[v].add(u)
    regions, seen = [], set()
    for b in sorted(cond):
        if b in seen:
            continue
        comp, stack = set(), [b]
        while stack:
            x = stack.pop()
            if x in comp:
                continue
            comp.add(x)
            stack.extend(adj[x] - comp)
        seen |= comp
        regions.append(sorted(comp))

    def ins_of(bs):
        return [ins for b in sorted(bs) for ins in instrs[blocks[b][0]:blocks[b][1]]]

    def n_hot(b):
        return sum(1 for i in instrs[blocks[b][0]:blocks[b][1]] if i.base in HOT)

    def size(b):
        return blocks[b][1] - blocks[b][0]

    def hottest_path(comp):
        """The blocks of the region's path with the most hot instructions
        (ties: the most instructions), entry to exit; None when the region
        is not acyclic."""
        members = set(comp)
        inner = {b: [v for v in succ.get(b, ()) if v in members] for b in comp}
        indeg = {b: 0 for b in comp}
        for b in comp:
            for v in inner[b]:
                indeg[v] += 1
        order, ready = [], [b for b in comp if indeg[b] == 0]
        while ready:
            b = ready.pop()
            order.append(b)
            for v in inner[b]:
                indeg[v] -= 1
                if indeg[v] == 0:
                    ready.append(v)
        if len(order) != len(comp):
            return None
        best, nxt = {}, {}
        for b in reversed(order):
            tail = max(((best[v], v) for v in inner[b]), default=((0, 0), None))
            best[b] = (n_hot(b) + tail[0][0], size(b) + tail[0][1])
            nxt[b] = tail[1]
        entries = [b for b in comp if any(u not in members for u in pred.get(b, ()))] or comp
        b = max(entries, key=lambda e: best[e])
        path = []
        while b is not None:
            path.append(b)
            b = nxt[b]
        return set(path)

    pred = {}
    for u in body:
        for v in succ.get(u, ()):
            pred.setdefault(v, []).append(u)
    out_regions = []
    hot_blocks = set(always)
    cold = mix_of([])
    for comp in regions:
        members = set(comp)
        hot = any(n_hot(b) for b in comp)
        # a hot region's path: from its entry to its exit through the most
        # hot work; the rest (a branch that bypasses it, such as a tail
        # tile's plain loads) is cold.  A region with a loop of its own
        # counts whole.
        path_blocks = (hottest_path(comp) or members) if hot else set()
        alt = members - path_blocks
        hot_blocks |= path_blocks
        cold = add_mix(cold, mix_of(ins_of(alt)))
        out_regions.append({"start": hex(instrs[blocks[comp[0]][0]].addr),
                            "instructions": len(ins_of(comp)), "hot": hot,
                            "cold_alternative": len(ins_of(alt)) if hot else 0})
    path = ins_of(hot_blocks)
    return {"header": hex(instrs[blocks[lp["header"]][0]].addr),
            "latches": [hex(instrs[blocks[b][1] - 1].addr) for b in lp["latches"]],
            "instructions": len(ins_of(body)),
            "per_tile": mix_of(path), "always": mix_of(ins_of(always)), "cold": cold,
            "regions": out_regions, "cycles": warp_cycles(path)}


# ---------------------------------------------------------------- names

_TYPES = {"13__nv_bfloat16": "bf16", "6__half": "fp16", "f": "f32", "d": "f64",
          "N2ra3DynIfEE": "dyn"}


def short_name(mangled):
    """(kernel name, {"dtype":, "D":, "M":, "args": [...]}) from a mangled
    kernel name such as ..13fwd_tc_kernelI13__nv_bfloat16Li128ELb0EEEv..."""
    name = rest = None
    for m in re.finditer(r"_kernel", mangled):
        end = m.end()
        # the source name is preceded by its length: "13fwd_tc_kernel"
        for n in range(len("_kernel") + 1, end):
            start = end - n
            if mangled[:start].endswith(str(n)) and not mangled[start].isdigit():
                name, rest = mangled[start:end], mangled[end:]
                break
        if name:
            break
    if name is None:
        return mangled, {}
    args = []
    pos = 1 if rest.startswith("I") else len(rest)
    while pos < len(rest) and rest[pos] != "E":
        for tok, val in _TYPES.items():
            if rest.startswith(tok, pos):
                args.append(val)
                pos += len(tok)
                break
        else:
            t = re.match(r"L([ibjl])(\d+)E", rest[pos:])
            if not t:
                break
            args.append(bool(int(t.group(2))) if t.group(1) == "b" else int(t.group(2)))
            pos += t.end()
    info = {"args": args}
    if (len(args) == 3 and args[0] in ("bf16", "fp16") and isinstance(args[1], int)
            and isinstance(args[2], bool)):
        info.update(dtype=args[0], D=args[1], M=bool(args[2]))
    elif len(args) == 2 and args[0] in ("bf16", "fp16") and isinstance(args[1], int):
        info.update(dtype=args[0], D=args[1], M=False)   # a kernel without a mask argument
    return name, info


def label(name, info):
    if "D" in info:
        return f"{name.replace('_kernel', '')}<{info['dtype']},{info['D']},{'M' if info['M'] else '-'}>"
    return f"{name.replace('_kernel', '')}<{','.join(str(a) for a in info.get('args', []))}>"


# ---------------------------------------------------------------- tools

def find_tool(name):
    """Path of a CUDA binary tool: $RINGATTN_<NAME>, PATH, $CUDA_HOME/bin,
    /usr/local/cuda/bin, or an nvidia-* pip wheel on sys.path; None if none."""
    env = os.environ.get("RINGATTN_" + name.upper())
    if env:
        return env if os.path.exists(env) else None
    found = shutil.which(name)
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", name)):
            return os.path.join(home, "bin", name)
    for base in sys.path:
        for cand in glob.glob(os.path.join(base or ".", "nvidia", "*", "bin", name)):
            if os.access(cand, os.X_OK):
                return cand
    return None


def installed_extension():
    """(path of ringattn's compiled core, cuda_info()) of the importable ringattn."""
    import ringattn
    import ringattn._C as core

    return core.__file__, ringattn.cuda_info()


def _tool_env():
    """The environment of cuobjdump: its -sass runs nvdisasm, which it looks
    for on PATH or NVDISASM_PATH (the pip wheels put it in a folder of their
    own, not on PATH): the folder of the nvdisasm find_tool finds."""
    env = dict(os.environ)
    nvdisasm = find_tool("nvdisasm")
    if nvdisasm is not None and "NVDISASM_PATH" not in env:
        env["NVDISASM_PATH"] = os.path.dirname(nvdisasm)
    return env


def _run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, env=_tool_env())
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[:500]}")
    return r.stdout + r.stderr


def compile_cubins(files, arch, outdir, nvcc=None):
    """nvcc -cubin cuda/<file>.cu for `arch` with the build's flags into
    outdir -> ([cubin paths], ptxas -v text)."""
    nvcc = nvcc or find_tool("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc not found (CUDA_HOME, PATH, /usr/local/cuda)")
    cubins, logs = [], []
    for f in files:
        src = f if os.path.exists(f) else os.path.join(ROOT, "cuda", f + ".cu")
        if not os.path.exists(src):   # a stem anywhere under cuda/ (hopper/attn_fwd_wg)
            found = glob.glob(os.path.join(ROOT, "cuda", "**", os.path.basename(f) + ".cu"),
                              recursive=True)
            src = found[0] if found else src
        out = os.path.join(outdir, os.path.basename(src)[:-3] + f".{arch}.cubin")
        cmd = [nvcc, "-cubin", f"-arch={arch}", "-O3", "-std=c++17", "--expt-relaxed-constexpr",
               "-DRA_WITH_CUDA", "-I" + os.path.join(ROOT, "csrc"),
               "-I" + os.path.join(ROOT, "cuda"), "-Xptxas", "-v", src, "-o", out]
        if arch == "sm_90a":
            cmd.insert(1, "-DRA_CUDA_SM90A")   # as setup.py builds it
        logs.append(_run(cmd))
        cubins.append(out)
    return cubins, "\n".join(logs)


# ---------------------------------------------------------------- the report

def analyze(sass_text, res_text, arch, ptxas_text="", include_simt=False, kernels=None):
    """The report's records, one per kernel instantiation (see module doc)."""
    funcs = parse_sass(sass_text)
    res = parse_res_usage(res_text)
    ptx = parse_ptxas(ptxas_text) if ptxas_text else {}
    rows = []
    for mangled, instrs in funcs.items():
        name, info = short_name(mangled)
        if not name.endswith("_kernel"):
            continue
        tc = any(i.base in ("HMMA", "HGMMA") for i in instrs)
        if name in SIMT_FAMILIES and not include_simt:
            continue
        lab = label(name, info)
        if kernels and not re.search(kernels, lab):
            continue
        r = res.get(mangled, {})
        stl = [i for i in instrs if i.base == "STL"]
        ldl = [i for i in instrs if i.base == "LDL"]

        def width(i):
            w = re.search(r"\.(8|16|32|64|128)\b", i.opcode)
            return int(w.group(1)) // 8 if w else 4

        row = {"kernel": lab, "name": name, "mangled": mangled, "arch": arch,
               "tensor_core": tc, **{k: info[k] for k in ("dtype", "D", "M") if k in info},
               "registers": r.get("REG"), "stack_bytes": r.get("STACK"),
               "local_bytes": r.get("LOCAL"), "static_smem": r.get("SHARED"),
               "stl": len(stl), "ldl": len(ldl)}
        if mangled in ptx and "spill_stores" in ptx[mangled]:
            row.update(spill_store_bytes=ptx[mangled]["spill_stores"],
                       spill_load_bytes=ptx[mangled]["spill_loads"], spill_source="ptxas")
            if row["registers"] is None:
                row["registers"] = ptx[mangled].get("regs")
        else:
            row.update(spill_store_bytes=sum(width(i) for i in stl),
                       spill_load_bytes=sum(width(i) for i in ldl), spill_source="sass")
        dyn = DYNAMIC_SMEM.get(name)
        row["dynamic_smem"] = dyn(info["D"], info["M"]) if dyn and "D" in info else None
        tiles = TILES.get(name)
        if tiles and "D" in info:
            row.update(tiles(info["D"], info["M"]))
        row["instructions"] = len(instrs)
        row["loop"] = inner_loop(instrs) if tc else None
        rows.append(row)
    rows.sort(key=lambda r: r["kernel"])
    return rows


def uses_local_memory(row):
    """True when the kernel touches local memory (spills or local arrays)."""
    return bool(row["stl"] or row["ldl"] or row.get("spill_store_bytes") or
                row.get("spill_load_bytes") or row.get("local_bytes") or row.get("stack_bytes"))


# the generic (SIMT) kernel families: left out of the report unless --all;
# every other kernel is reported and held to "no local memory" by
# tests/test_sass_report.py, so a new family is checked until it is named here
SIMT_FAMILIES = ("fwd_simt_kernel", "dkdv_simt_kernel", "dq_simt_kernel", "delta_kernel",
                 "merge_kernel", "fill_state_kernel", "copy_kernel", "dq_convert_kernel",
                 "dilated_ids_kernel")


def cubins_of(path, arch, workdir, cuobjdump):
    """The `arch` cubins inside `path` (a cubin is itself; objects and
    shared libraries are unpacked with cuobjdump -xelf)."""
    if path.endswith(".cubin"):
        return [path]
    sub = tempfile.mkdtemp(dir=workdir)
    subprocess.run([cuobjdump, "-xelf", "all", os.path.abspath(path)], cwd=sub,
                   capture_output=True, text=True, check=True)
    found = sorted(glob.glob(os.path.join(sub, f"*.{arch}.cubin")))
    if not found:
        raise RuntimeError(f"{path}: no {arch} code in it (built for other architectures?)")
    return found


def report(paths, arch, ptxas_text="", include_simt=False, kernels=None, cuobjdump=None):
    """Run cuobjdump on each path (cubin, object or shared library) and
    analyze its `arch` code: only the cubins holding a selected kernel are
    disassembled (the generic kernels' SASS is most of a build's)."""
    cuobjdump = cuobjdump or find_tool("cuobjdump")
    if cuobjdump is None:
        raise RuntimeError("cuobjdump not found: install the CUDA toolkit's or "
                           "`pip install nvidia-cuda-cuobjdump` (and nvidia-cuda-nvdisasm)")

    def wanted(mangled):
        name, info = short_name(mangled)
        if not name.endswith("_kernel") or (name in SIMT_FAMILIES and not include_simt):
            return False
        return not kernels or re.search(kernels, label(name, info))

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            for cubin in cubins_of(path, arch, tmp, cuobjdump):
                res = _run([cuobjdump, "-res-usage", cubin])
                if not any(wanted(f) for f in parse_res_usage(res)):
                    continue
                sass = _run([cuobjdump, "-sass", cubin])
                rows += analyze(sass, res, arch, ptxas_text, include_simt, kernels)
    rows.sort(key=lambda r: r["kernel"])
    return rows


COLUMNS = ("HMMA", "HGMMA", "LDSM", "LDS", "STS", "LDG", "STG", "LDGSTS", "LDL", "STL",
           "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "F2FP", "IMAD", "IALU", "BAR",
           "SHFL")


def format_table(rows):
    head = (f"{'kernel':24} {'regs':>4} {'spill st/ld':>11} {'stack':>5} {'local':>5} "
            f"{'smem':>12} | " + " ".join(f"{c[:5]:>5}" for c in COLUMNS) +
            f" {'total':>5} {'cold':>5} {'cycles':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        dyn = "?" if r["dynamic_smem"] is None else str(r["dynamic_smem"])
        smem = f"{r['static_smem']}+{dyn}"
        left = (f"{r['kernel']:24} {r['registers'] or 0:4d} "
                f"{r['spill_store_bytes']:>5}/{r['spill_load_bytes']:<5} "
                f"{r['stack_bytes'] or 0:5d} {r['local_bytes'] or 0:5d} {smem:>12} | ")
        lp = r["loop"]
        if lp is None:
            lines.append(left + "(no tensor-core loop)")
            continue
        m = lp["per_tile"]
        cyc = "-" if lp["cycles"] is None else str(lp["cycles"])
        lines.append(left + " ".join(f"{m[c]:5d}" for c in COLUMNS) +
                     f" {m['total']:5d} {lp['cold']['total']:5d} {cyc:>6}")
    lines.append("per_tile: one inner-loop iteration on a full tile's path, per warp; cold: "
                 "the conditional code left out of it (masks, tails); cycles: one warp's "
                 "schedule of per_tile (control bits + assumed latencies)")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="*", help="cubin, object or shared-library files")
    ap.add_argument("--so", help="a built ringattn extension (its fatbin)")
    ap.add_argument("--compile", action="store_true", help="nvcc -cubin cuda/*.cu for --arch")
    ap.add_argument("--files",
                    default="attn_fwd_tc,attn_bwd_tc_dkdv,attn_bwd_tc_dq,attn_bwd_fused,attn_fwd_wg,"
                            "attn_bwd_wg,attn_bwd_wg_dq",
                    help="with --compile: comma-separated cuda/ file stems (any folder "
                         "under cuda/), or 'all'")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--kernels", help="regex on the kernel labels, e.g. 'fwd_tc<bf16,128'")
    ap.add_argument("--all", action="store_true", help="the SIMT kernels too")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="write the output there instead of stdout")
    ap.add_argument("--counts", metavar="FILE",
                    help="also write the performance model's compact counts there "
                         "(ringattn/bench/kernel_counts.json)")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"sm_\d+a?", args.arch):
        ap.error(f"--arch: expected sm_NN, got {args.arch!r}")
    ptxas_text, source = "", None
    with tempfile.TemporaryDirectory() as tmp:
        if args.compile:
            files = ([os.path.basename(p)[:-3] for p in sorted(glob.glob(os.path.join(
                ROOT, "cuda", "**", "*.cu"), recursive=True))]
                     if args.files == "all" else args.files.split(","))
            paths, ptxas_text = compile_cubins(files, args.arch, tmp)
            source = f"nvcc -cubin -arch={args.arch} cuda/{{{','.join(files)}}}.cu"
        elif args.inputs or args.so:
            paths = args.inputs + ([args.so] if args.so else [])
            source = ", ".join(paths)
        else:
            so, info = installed_extension()
            if not info.get("built") or info.get("emulated"):
                ap.error("the installed ringattn has no real CUDA build "
                         f"({'emulated' if info.get('emulated') else 'CUDA not built'}); "
                         "give --so, files, or --compile")
            paths, source = [so], so
        rows = report(paths, args.arch, ptxas_text, args.all, args.kernels)
    full = {"source": source, "arch": args.arch, "kernels": rows}
    if args.counts:
        import importlib.util
        spec = importlib.util.spec_from_file_location(
            "ra_model", os.path.join(ROOT, "ringattn", "bench", "model.py"))
        model = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(model)
        with open(args.counts, "w") as f:
            json.dump(model.compact_counts(full), f, indent=1)
            f.write("\n")
    if args.json:
        text = json.dumps(full, indent=1)
    else:
        text = f"SASS report: {source} ({args.arch})\n" + format_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
