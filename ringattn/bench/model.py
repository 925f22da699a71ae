"""The performance model of ringattn's tensor-core kernels on an H100 SXM:
the time a kernel cannot beat, from the instruction mix of its inner loop
(tools/sass_report.py, stored in kernel_counts.json) and the SM's issue and
pipe rates, with the latency that few resident warps leave exposed.
docs/results.md states the model, its calibration against the measured H100
table, and the kernel designs it was used to choose; ``ringattn bench
--gpu`` prints its prediction next to every measured time.

Per SM sub-partition (SMSP: 4 per SM, one warp instruction issued per
cycle each), one warp's share of one loop iteration (a "warp-tile") costs
  issue   every instruction, 1 cycle
  tensor  HMMA.16816 (mma.sync m16n8k16, f32 accumulate): HMMA_CYCLES;
          HGMMA (wgmma) per m16n8k16 equivalent of a warp's share of it
          (HGMMA_EQ): WGMMA_CYCLES
  fma     FFMA, FMUL, FADD, IMAD: 1 cycle (32 FP32 lanes per SMSP)
  alu     integer ALU, FMNMX, FSEL/FSETP, F2FP, MOV: 2 cycles (16 lanes)
  mufu    ex2, rcp, tanh, ...: 8 cycles (16 per SM per cycle)
  smem    bytes through shared memory (LDSM x4 and cp.async 512 B, LDS/STS
          128 B per warp instruction, the wgmma operands a warp's share of
          its HGMMAs reads: HGMMA_SMEM) at 128 B per cycle per SM, shared by
          the 4 SMSPs: bytes / 32 per warp-tile
  l2      bytes cp.async brings in (and twice the bytes red.global.add
          adds: RED_BYTES when a counted mix gives it, else 256 per RED; a
          warp's share of a tile's bulk tensor copies, tile_copy_bytes),
          at L2_BYTES_PER_S over the whole chip.
B = the largest of these is the throughput bound of one warp-tile.  The
latency bound is L, the cycles one warp alone needs for its tile (the
single-warp replay of the control bits in sass_report.py).  With w warps
resident per SMSP (occupancy; a warp-specialised kernel counts the warps
that run the loop, "mma_warps"), a block's tile takes
    ((w B)^K + L^K)^(1/K)      cycles
(a smooth maximum: K = inf would be perfect overlap of the w warps'
latencies with each other's work, K = 1 none); a kernel is its blocks,
each overhead + n_tiles of those, dealt heaviest first to the
blocks-per-SM x 132 slots (a greedy list schedule, as the block scheduler
does), at CLOCK_HZ.
"""
import heapq
import json
import math
import os

# ---------------------------------------------------------------- spec sheet
SMS = 132                    # H100 SXM5
SMSP_PER_SM = 4
REGS_PER_SM = 65536
SMEM_PER_SM = 228 * 1024     # shared memory per SM; 227 KB at most per block
SMEM_RESERVED = 1024         # per block, reserved by sm_90
MAX_THREADS_PER_SM = 2048
MAX_BLOCKS_PER_SM = 32
SMEM_BYTES_PER_CYCLE = 128   # per SM
DRAM_BYTES_PER_S = 3.0e12    # measured device copy on the card (3.35 nominal)
TENSOR_PEAK_FLOPS = 989e12   # dense bf16 wgmma at 1.83 GHz (4096 flop/clk/SM)
PIPE_CYCLES = {"fma": 1.0, "alu": 2.0, "mufu": 8.0}

# ---------------------------------------------------------------- calibrated
# (docs/results.md "Calibration"): the clock is assumed, HMMA_CYCLES fitted
# to SDPA flash (FlashAttention-2, also mma.sync) on the same card, K and
# BLOCK_OVERHEAD to ringattn's own kernels; L2_BYTES_PER_S is an assumption
# none of today's kernels reach
CLOCK_HZ = 1.755e9
HMMA_CYCLES = 9.5            # per HMMA.16816 per SMSP (4 at the wgmma peak rate)
K = 1.75
BLOCK_OVERHEAD = 3000        # cycles per block: prologue loads, epilogue stores
L2_BYTES_PER_S = 4.5e12

# ---------------------------------------------------------------- assumed
# wgmma (sm_90a), not calibrated: the card's measured bf16 matmul (800 of
# the 989 TFLOP/s peak) is 4.9 cycles per m16n8k16 product and SMSP, where
# mma.sync's calibrated HMMA_CYCLES is 9.5; the first H100 run of the
# Hopper kernels calibrates it (tools/perf_model.py)
WGMMA_CYCLES = 4.0 / 0.81

COUNTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_counts.json")


def load_counts(path=COUNTS):
    """{kernel label: record} from a sass_report.py --json file (or the
    compact form compact_counts writes)."""
    with open(path) as f:
        data = json.load(f)
    return {r["kernel"]: r for r in data["kernels"]}


def compact_counts(report):
    """What the model keeps of a sass_report.py --json report (the
    checked-in kernel_counts.json): per tensor-core kernel its registers,
    shared memory, block shape and inner-loop mix, cycles and cold count."""
    keep = ("kernel", "name", "dtype", "D", "M", "registers", "static_smem", "dynamic_smem",
            "block_rows", "tile_rows", "warps", "mma_warps", "tile_copy_bytes",
            "spill_store_bytes", "spill_load_bytes")
    out = []
    for r in report["kernels"]:
        if not r.get("loop"):
            continue
        row = {k: r.get(k) for k in keep if k in r}
        lp = r["loop"]
        row["per_tile"] = {k: v for k, v in lp["per_tile"].items() if v}
        row["cycles"] = lp["cycles"]
        row["cold"] = lp["cold"]["total"]
        out.append(row)
    return {"source": report.get("source"), "arch": report.get("arch"), "kernels": out}


# ---------------------------------------------------------------- one tile

def pipe_cycles(mix, copy_bytes=0.0):
    """{pipe: cycles} of one warp-tile on its SMSP (module docstring);
    copy_bytes: what bulk tensor copies bring in per warp-tile (they are
    no instruction of the loop)."""
    g = lambda c: mix.get(c, 0)  # noqa: E731
    smem_bytes = (512 * (g("LDSM") + g("LDGSTS")) + 128 * (g("LDS") + g("STS"))
                  + g("HGMMA_SMEM"))
    return {
        "issue": float(g("total")),
        "tensor": HMMA_CYCLES * g("HMMA") + WGMMA_CYCLES * g("HGMMA_EQ"),
        "fma": PIPE_CYCLES["fma"] * (g("FFMA") + g("FMUL") + g("FADD") + g("IMAD")),
        "alu": PIPE_CYCLES["alu"] * (g("IALU") + g("FMNMX") + g("FSEL") + g("F2FP") + g("MOV")),
        "mufu": PIPE_CYCLES["mufu"] * g("MUFU"),
        "smem": smem_bytes * SMSP_PER_SM / SMEM_BYTES_PER_CYCLE,
        # cp.async reads; a float32 red.global.add reads and writes its sector
        "l2": (512 * g("LDGSTS") + copy_bytes + mix.get("RED_BYTES", 256 * g("RED")))
        * SMS * SMSP_PER_SM * CLOCK_HZ / L2_BYTES_PER_S,
    }


def block_tile_cycles(mix, latency, warps_per_smsp, copy_bytes=0.0):
    """Cycles a block takes per tile with `warps_per_smsp` warps resident on
    each SMSP: the smooth maximum of their summed throughput demand and one
    warp's latency.  -> (cycles, the bound that dominates)."""
    pipes = pipe_cycles(mix, copy_bytes)
    bound = max(pipes, key=pipes.get)
    thr = warps_per_smsp * pipes[bound]
    lat = float(latency if latency is not None else 2.0 * pipes["issue"])
    cyc = (thr ** K + lat ** K) ** (1.0 / K)
    return cyc, (bound if thr >= lat else "latency")


def occupancy(registers, smem_bytes, threads):
    """Blocks per SM, limited by registers (allocated per warp in units of
    256), shared memory (+ the 1 KB sm_90 reserves per block) and threads.
    A warp-specialised kernel launched for one block per SM (its warps
    then share out the register file with setmaxnreg) reports the
    launch-bound count, registers * threads <= 65536."""
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_regs = REGS_PER_SM // (regs_per_warp * (threads // 32))
    by_smem = SMEM_PER_SM // (smem_bytes + SMEM_RESERVED)
    by_threads = MAX_THREADS_PER_SM // threads
    return max(0, min(by_regs, by_smem, by_threads, MAX_BLOCKS_PER_SM))


def makespan(block_tiles, slots, cycles_per_tile, overhead=None):
    """Cycles until the last block ends when blocks (their tile counts, in
    launch order) go to the first free of `slots` block slots."""
    overhead = BLOCK_OVERHEAD if overhead is None else overhead
    free = [0.0] * min(slots, max(1, len(block_tiles)))
    heapq.heapify(free)
    end = 0.0
    for n in block_tiles:
        start = heapq.heappop(free)
        done = start + overhead + n * cycles_per_tile
        end = max(end, done)
        heapq.heappush(free, done)
    return end


# ---------------------------------------------------------------- the kernels

def _ceil(a, b):
    return -(-a // b)


def fwd_blocks(B, H, S, causal, rows=64, cols=64):
    """Tile counts of the forward's blocks (S_q = S_k = S), heaviest first
    as launched: one block per (b, h, `rows` query rows)."""
    nq = _ceil(S, rows)
    per = [(min(S, (qb + 1) * rows) + cols - 1) // cols if causal else _ceil(S, cols)
           for qb in reversed(range(nq))]
    return per * (B * H)


def dkdv_blocks(B, H_kv, group, S, causal, keys=64, rows=32):
    """Tile counts (query tiles of `rows`, times the group's heads) of the
    dk/dv pass's blocks, one per (b, hk, `keys` keys)."""
    nk = _ceil(S, keys)
    per = [group * _ceil(S - (kb * keys if causal else 0), rows) for kb in range(nk)]
    return per * (B * H_kv)


def kernel_seconds(rec, blocks, dram_bytes=0.0):
    """Predicted seconds of one launch of the kernel `rec` (a counts
    record) over `blocks` (tile counts per block) -> (seconds, detail)."""
    threads = 32 * rec["warps"]
    smem = (rec["dynamic_smem"] or 0) + max(0, (rec["static_smem"] or 0) - SMEM_RESERVED)
    per_sm = occupancy(rec["registers"], smem, threads)
    loop_warps = rec.get("mma_warps") or rec["warps"]
    w = per_sm * loop_warps / SMSP_PER_SM
    copy = (rec.get("tile_copy_bytes") or 0) / loop_warps
    cyc, bound = block_tile_cycles(rec["per_tile"], rec["cycles"], w, copy)
    t = makespan(blocks, per_sm * SMS, cyc) / CLOCK_HZ
    t = max(t, dram_bytes / DRAM_BYTES_PER_S)
    return t, {"blocks_per_sm": per_sm, "warps_per_smsp": w, "tile_cycles": cyc, "bound": bound}


def _label(name, dtype, D, masked=False):
    t = {"bfloat16": "bf16", "float16": "fp16", "bf16": "bf16", "fp16": "fp16"}[dtype]
    return f"{name}<{t},{D},{'M' if masked else '-'}>"


def predict(pas, dtype, D, S, causal, B, H, H_kv=None, counts=None, masked=False,
            deterministic=False, family="sm80"):
    """Predicted seconds of ringattn's `pas` ("fwd" or "bwd") at (B, S, H,
    D), S_q = S_k, by kernel, plus "total": for "fwd" {"fwd_tc": s} (family
    "sm80", mma.sync) or {"fwd_wg": s} (family "sm90a", wgmma); for "bwd"
    the path ``attention_backward`` takes, {"delta": s, "bwd_tc": s,
    "dq_convert": s} (the fused mma.sync kernel, deterministic=False, the
    default; with family "sm90a" {"delta", "bwd_wg", "dq_convert"}, the
    wgmma one, masked or not) or {"delta": s, "dkdv_tc": s, "dq_tc": s}
    (deterministic=True, or counts without the fused kernel; with family
    "sm90a" {"delta", "dkdv_wg", "dq_wg"}: the wgmma kernel's dk/dv pass,
    then the wgmma dq pass).  None when a kernel is not in `counts`."""
    counts = load_counts() if counts is None else counts
    H_kv = H if H_kv is None else H_kv
    out = {}
    if pas == "fwd":
        name = "fwd_wg" if family == "sm90a" else "fwd_tc"
        rec = counts.get(_label(name, dtype, D, masked))
        if rec is None:
            return None
        out[name] = kernel_seconds(rec, fwd_blocks(B, H, S, causal, rec["block_rows"],
                                                   rec["tile_rows"]))[0]
        out["total"] = sum(out.values())
        return out
    # delta = rowsum(dout * out): reads two (B, S, H, D) 16-bit arrays
    delta = 2.0 * B * S * H * D * 2 / DRAM_BYTES_PER_S + 4e-6
    fused = "bwd_wg" if family == "sm90a" else "bwd_tc"
    rf = None if deterministic else counts.get(_label(fused, dtype, D, masked))
    if rf is None and fused == "bwd_wg" and not deterministic:
        return None
    if rf is not None:
        # one block per (b, kv head, 128 keys) walking the group's query
        # tiles; dq: a float32 scratch zeroed (writes 4 bytes per element),
        # then converted (reads 4, writes 2)
        out["delta"] = delta
        out[fused] = kernel_seconds(rf, dkdv_blocks(B, H_kv, H // H_kv, S, causal,
                                                    rf["block_rows"], rf["tile_rows"]))[0]
        out["dq_convert"] = B * S * H * D * (4 + 4 + 2) / DRAM_BYTES_PER_S + 8e-6
        out["total"] = sum(out.values())
        return out
    dkdv, dq = ("dkdv_wg", "dq_wg") if family == "sm90a" else ("dkdv_tc", "dq_tc")
    rk = counts.get(_label(dkdv, dtype, D, masked))
    rq = counts.get(_label(dq, dtype, D, masked))
    if rk is None or rq is None:
        return None
    out["delta"] = delta
    out[dkdv] = kernel_seconds(rk, dkdv_blocks(B, H_kv, H // H_kv, S, causal,
                                               rk["block_rows"], rk["tile_rows"]))[0]
    out[dq] = kernel_seconds(rq, fwd_blocks(B, H, S, causal, rq["block_rows"],
                                            rq["tile_rows"]))[0]
    out["total"] = sum(out.values())
    return out


def attention_flops(pas, B, H, S, D, causal):
    """flash-attention 2's count: forward 4 B H S^2 D, halved when causal;
    backward 2.5 times that."""
    f = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
    return f * (2.5 if pas == "bwd" else 1.0)


def format_prediction(pred, measured_s=None):
    """ "model 2.31 ms (delta 0.01 + bwd_tc 2.20 + dq_convert 0.10), measured/model 1.04" """
    if pred is None:
        return "model n/a"
    parts = [f"{k} {v * 1e3:.2f}" for k, v in pred.items() if k != "total"]
    text = f"model {pred['total'] * 1e3:.2f} ms"
    if len(parts) > 1:
        text += " (" + " + ".join(parts) + ")"
    if measured_s:
        text += f", measured/model {measured_s / pred['total']:.2f}"
    return text
