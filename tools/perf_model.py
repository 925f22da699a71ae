#!/usr/bin/env python3
"""perf_model.py -- the tables of docs/results.md "Performance model":
the calibration of ringattn/bench/model.py against the measured H100 table,
and the kernel designs it compares, with their predicted times at the
goal's sizes next to the measured SDPA flash and cuDNN times.

    python tools/perf_model.py              # every table, markdown
    python tools/perf_model.py --fit        # the calibration grid search

A design's per-warp-tile instruction mix is counted here from its tile
shapes (mix_fwd, mix_bwd); the same counting applied to today's kernels
gives the SASS counts of kernel_counts.json (the "check" table), so the
designs are priced by the model exactly as the measured kernels are.
Needs no GPU and no CUDA tool; runs on the source tree.
"""
import argparse
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "ra_model", os.path.join(ROOT, "ringattn", "bench", "model.py"))
m = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(m)

# The H100 table (shared/gpu/H100-2026-11-26.md): TFLOP/s, B * S = 16384,
# H * D = 2048: (dtype, D, S, causal): (ra fwd, flash fwd, cudnn fwd, ra bwd,
# flash bwd, cudnn bwd)
MEASURED = {
    ("bf16", 128, 4096, False): (240, 362, 663, 150, 300, 548),
    ("bf16", 128, 4096, True): (218, 311, 577, 145, 272, 465),
    ("bf16", 128, 16384, False): (249, 367, 674, 153, 313, 524),
    ("bf16", 128, 16384, True): (247, 322, 629, 155, 314, 543),
    ("bf16", 64, 4096, False): (218, 310, 479, 143, 276, 451),
    ("bf16", 64, 16384, True): (238, 299, 468, 145, 281, 430),
    ("fp16", 128, 16384, True): (240, 325, 609, 154, 311, 524),
}
# Nsight Compute, bf16, B 1, H 16, S 8192, D 128: kernel, causal, ms
PROFILED = (("fwd_tc", False, 2.24), ("dkdv_tc", False, 5.74), ("dq_tc", True, 1.75))


def shape(D, S):
    return 16384 // S, 2048 // D  # B, H


def measured_s(key, col):
    dt, D, S, causal = key
    B, H = shape(D, S)
    pas = "fwd" if col < 3 else "bwd"
    return m.attention_flops(pas, B, H, S, D, causal) / (MEASURED[key][col] * 1e12)


# ---------------------------------------------------------------- calibration

# the counts of the kernels that were measured (ringattn 5395c6a), frozen
# here so that the calibration stays reproducible after the kernels change
# (ringattn/bench/kernel_counts.json then holds the new kernels' counts)
BASELINE_COUNTS = os.path.join(ROOT, "tools", "h100_baseline_counts.json")


def calibration_rows(counts=None):
    """[(what, predicted s, measured s)] over the table and the profile."""
    counts = m.load_counts(BASELINE_COUNTS) if counts is None else counts
    rows = []
    for key in MEASURED:
        dt, D, S, causal = key
        B, H = shape(D, S)
        for pas, col in (("fwd", 0), ("bwd", 3)):
            p = m.predict(pas, dt, D, S, causal, B, H, counts=counts)
            rows.append((f"{pas} {dt} D{D} S{S} {'causal' if causal else 'full'}",
                         p["total"], measured_s(key, col)))
    for name, causal, ms in PROFILED:
        rec = counts[f"{name}<bf16,128,->"]
        blocks = (m.dkdv_blocks(1, 16, 1, 8192, causal, 64, rec["tile_rows"])
                  if name == "dkdv_tc" else m.fwd_blocks(1, 16, 8192, causal))
        rows.append((f"{name} S8192 {'causal' if causal else 'full'} (profile)",
                     m.kernel_seconds(rec, blocks)[0], ms * 1e-3))
    return rows


def fit():
    best = []
    for k in (1.25, 1.5, 1.75, 2.0, 2.5):
        for l2 in (3.5e12, 4.0e12, 4.5e12, 5.0e12, 5.5e12):
            for ov in (1000, 3000, 6000):
                m.K, m.L2_BYTES_PER_S, m.BLOCK_OVERHEAD = k, l2, ov
                errs = [p / t - 1 for _, p, t in calibration_rows()]
                best.append((max(abs(e) for e in errs), k, l2, ov))
    best.sort()
    print("max |error|, K, L2 bytes/s, block overhead (cycles)")
    for b in best[:8]:
        print(f"{b[0]:.3f} {b[1]} {b[2]:.2g} {b[3]}")


# ---------------------------------------------------------------- designs

def mix_fwd(D, rows_per_warp, warps, kv, q_in_regs=False, fold_scale=False, fast_exp=False,
            int_per_ldsm=4.6, lazy_rescale=0.0, bars=2):
    """Instruction mix of one warp-tile of a forward design: a warp owns
    rows_per_warp query rows, the block's `warps` warps share one K/V tile
    of `kv` keys.  lazy_rescale: the share of tiles whose O rescale is
    skipped (the running max did not grow past a threshold)."""
    r, N = rows_per_warp, kv
    e = r * N // 32                       # score elements per thread
    ldsm = 2 * (N // 16) * (D // 16) + (0 if q_in_regs else (r // 16) * (D // 16))
    mix = {
        "HMMA": r * N * D // 1024,
        "LDSM": ldsm,
        "LDGSTS": 2 * N * D * 2 // (512 * warps),
        "MUFU": e + r // 8,
        "FFMA": e if fold_scale else 0,
        "FMUL": (0 if fold_scale else e) + (0 if fast_exp else 2 * e)
        + round((1 - lazy_rescale) * r * D / 32) + r // 8,
        "FADD": (0 if fold_scale else e) + e + r // 8,
        "FMNMX": e + r // 4,
        "FSEL": 0 if fast_exp else e,
        "F2FP": e // 2,
        "SHFL": r // 4,
        "BAR": bars,
        "LDS": 3,
    }
    ints = int_per_ldsm * ldsm + 30
    mix["IMAD"], mix["IALU"] = round(0.43 * ints), round(0.57 * ints)
    mix["total"] = round(sum(mix.values()) * 1.06)  # MOV, branches, uniform ops
    return mix


def mix_bwd(D, keys, warps, rows, p_in_regs, int_per_ldsm=1.5, red_width=1, fast_exp=True):
    """One warp's share of one iteration of a fused backward: a block owns
    `keys` keys (dK, dV accumulators in registers), an iteration streams
    `rows` queries: S^T = K Q^T, dP^T = V dO^T, P, dS, dV += P^T dO,
    dK += dS^T Q, then dS through shared memory, dQ = dS K accumulated
    into float32 with red.global.add (red_width floats per instruction).
    p_in_regs: each warp owns 16 whole keys (P^T, dS^T stay in registers
    as the A operands of dV, dK), else P^T and dS^T go through shared
    memory and every product is tiled over all warps."""
    Nk, Mq, W = keys, rows, warps
    macs = Nk * Mq * D                                  # one product
    hmma = 5 * macs // 2048 // W
    # ldmatrix.x4 per product and warp, A and B from shared memory; a
    # product C (m x n, k deep) on a wm x wn warp grid loads (m/wm/16 +
    # n/wn/16) * k/16 fragments
    def frags(m_, n_, k_, wm, wn):
        return (m_ // wm // 16 + n_ // wn // 16) * (k_ // 16)
    if p_in_regs:   # warps split the keys 16 each (W * 16 == Nk)
        ldsm = (2 * frags(Nk, Mq, D, W, 1)              # S^T, dP^T: K/V A, Q/dO B
                + 2 * (Mq // 16) * (D // 16)            # dV, dK: only B (dO, Q)
                + frags(Mq, D, Nk, 2, W // 2))          # dQ: dS A, K B
        sts = Mq * 16 * 2 // 128                        # dS^T, 16-bit
    else:
        ldsm = (2 * frags(Mq, Nk, D, 2, W // 2)         # S, dP
                + 2 * frags(Nk, D, Mq, W // 2, 2)       # dV, dK: P^T, dS^T from smem
                + frags(Mq, D, Nk, 2, W // 2))          # dQ
        sts = 2 * Mq * Nk * 2 // (128 * W)              # P and dS, 16-bit
    e = Nk * Mq // (32 * W)                             # score elements per thread
    mix = {"HMMA": hmma, "LDSM": ldsm, "STS": sts,
           "LDGSTS": 2 * Mq * D * 2 // (512 * W), "LDS": e // 2,
           "RED": Mq * D // (32 * W * red_width), "RED_BYTES": 2 * 4 * Mq * D // W,
           "MUFU": e, "FFMA": 2 * e, "FMUL": e + (0 if fast_exp else 2 * e),
           "FADD": e, "FSEL": 0 if fast_exp else e, "F2FP": e, "BAR": 3}
    ints = int_per_ldsm * ldsm + 40
    mix["IMAD"], mix["IALU"] = round(0.45 * ints), round(0.55 * ints)
    mix["total"] = round((sum(mix.values()) - mix["RED_BYTES"]) * 1.06)
    return mix


def registers_fwd(D, r, kv, q_in_regs, extra=80):
    """Estimated registers per thread: O (r x D) and S (r x kv) in float32,
    Q fragments if kept, + the rest: 80 in today's kernels (176 at r = 16,
    D = 128: O 64 + S 32 + 80), 56 with addresses kept as one base plus
    immediates (FlashAttention-2's 32-row warps fit 255 with O 128 + S 64)."""
    return r * D // 32 + r * kv // 32 + (r * D // 64 if q_in_regs else 0) + extra


def registers_bwd(D, keys, warps, rows, p_in_regs, extra=56):
    """dK + dV (keys x D each) in float32 over the block's threads, plus
    the larger of S and dP (keys x rows; dead once P and dS are packed or
    stored) and the dQ tile (rows x D, live after them), + the rest (56, as
    the redesigned forward; today's dkdv_tc spends 95 and spills)."""
    t = 32 * warps
    return (2 * keys * D + max(2 * keys * rows, rows * D)) // t + extra


# wgmma (sm_90a): not calibrated here.  Its rate is taken from the card's
# measured bf16 matmul (800 of the 989 TFLOP/s peak: 4.9 cycles per
# 16x8x16 product and SMSP), against mma.sync's calibrated HMMA_CYCLES; the
# operands come from shared memory without ldmatrix (a quarter of the
# bytes per warp: one warpgroup reads a tile once), one instruction issues
# 16 products
WGMMA_CYCLES = m.WGMMA_CYCLES


def as_wgmma(mix):
    """A mma.sync mix turned into the wgmma estimate (see WGMMA_CYCLES)."""
    out = dict(mix)
    h = mix["HMMA"]
    out["HMMA"] = h * WGMMA_CYCLES / m.HMMA_CYCLES     # tensor-pipe time, in HMMA units
    out["LDSM"] = mix["LDSM"] / 4
    out["total"] = round(mix["total"] - h - mix["LDSM"] + h / 16)
    return out


class Design:
    def __init__(self, name, pas, mix, warps, block_rows, tile_rows, regs, smem, lam,
                 kernels=None, note=""):
        self.name, self.pas, self.mix, self.warps = name, pas, mix, warps
        self.block_rows, self.tile_rows, self.regs, self.smem = block_rows, tile_rows, regs, smem
        self.lam, self.note = lam, note

    def record(self):
        return {"warps": self.warps, "registers": min(255, self.regs), "dynamic_smem": self.smem,
                "static_smem": 1024, "per_tile": self.mix,
                "cycles": round(self.lam * self.mix["total"]),
                "block_rows": self.block_rows, "tile_rows": self.tile_rows}


# latency per issued instruction of one warp alone (sass_report `cycles` /
# per-tile total): today's fwd_tc 2.06 (D 128) / 1.83 (D 64), dq_tc 2.38;
# a compiled prototype of 32-row warps (docs/results.md) 2.3 (D 64) to 2.7
# (D 128): the designs take 2.0 for 16-row warps, 2.7 for 32-row ones
LAM_FWD16, LAM_FWD32, LAM_BWD = 2.0, 2.7, 2.4


def fwd_designs(D):
    """The forward candidates at head_dim D (bf16 and fp16 alike)."""
    kv128 = 128 if D == 64 else 64
    out = []

    def add(name, r, W, kv, stages=2, **kw):
        mix = mix_fwd(D, r, W, kv, **kw)
        smem = (r * W + stages * 2 * kv) * D * 2
        regs = registers_fwd(D, r, kv, kw.get("q_in_regs", False),
                             80 if kw.get("int_per_ldsm", 4.6) > 4 else 56)
        note = "spills (regs > 255)" if regs > 255 else "tight (regs > 232)" if regs > 232 else ""
        lam = LAM_FWD16 if r == 16 else LAM_FWD32
        out.append(Design(name, "fwd", mix, W, r * W, kv, regs, smem, lam, note=note))
    add("today: 64 rows, 4 warps x 16, kv 64", 16, 4, 64)
    add("A  today + exp2/FFMA + ex2.approx", 16, 4, 64, fold_scale=True, fast_exp=True)
    add("B  A + precomputed smem offsets", 16, 4, 64, fold_scale=True, fast_exp=True,
        int_per_ldsm=1.5)
    add("C  128 rows, 8 warps x 16, kv 64", 16, 8, 64, fold_scale=True, fast_exp=True,
        int_per_ldsm=1.5)
    add(f"D  128 rows, 4 warps x 32, kv {kv128}", 32, 4, kv128, fold_scale=True, fast_exp=True,
        int_per_ldsm=1.5)
    add(f"E  D + lazy O rescale", 32, 4, kv128, fold_scale=True, fast_exp=True,
        int_per_ldsm=1.5, lazy_rescale=0.9)
    kv_fit = kv128 // 2   # what the compiled prototype fits in 255 registers
    add(f"E' E with kv {kv_fit}", 32, 4, kv_fit, fold_scale=True, fast_exp=True,
        int_per_ldsm=1.5, lazy_rescale=0.9)
    add("C' C + lazy O rescale", 16, 8, 64, fold_scale=True, fast_exp=True, int_per_ldsm=1.5,
        lazy_rescale=0.9)
    if D == 64:
        add("F  D + Q in registers", 32, 4, kv128, fold_scale=True, fast_exp=True,
            int_per_ldsm=1.5, lazy_rescale=0.9, q_in_regs=True)
    w = Design("W  sm_90a wgmma, 2 consumer warpgroups x 64 rows, kv 128 (estimate)", "fwd",
               as_wgmma(mix_fwd(D, 16, 8, 128, fold_scale=True, fast_exp=True,
                                int_per_ldsm=1.5, lazy_rescale=0.9)),
               8, 128, 128, 16 * D // 32 + 16 * 128 // 32 + 56, (128 + 2 * 2 * 128) * D * 2,
               LAM_FWD16, note="not calibrated")
    out.append(w)
    # FlashAttention-2 as SDPA runs it (128 x 64 for D 128, 128 x 128 for D 64,
    # 4 warps, Q re-read from smem, --use_fast_math), the check of the model
    fa2 = mix_fwd(D, 32, 4, kv128, fold_scale=True, fast_exp=True, int_per_ldsm=2.0)
    out.append(Design("FA2 (SDPA flash), counted", "fwd", fa2, 4, 128, kv128,
                      registers_fwd(D, 32, kv128, False, 56), (128 + 2 * kv128) * D * 2,
                      LAM_FWD16, note="the model's check"))
    return out


def bwd_designs(D):
    out = []

    def add(name, keys, W, rows, p_in_regs, **kw):
        mix = mix_bwd(D, keys, W, rows, p_in_regs, **kw)
        smem = (2 * keys + 2 * 2 * rows) * D * 2 + (2 * keys * rows * 2 if not p_in_regs
                                                      else keys * rows * 2) + 6 * rows * 4
        regs = registers_bwd(D, keys, W, rows, p_in_regs)
        note = "spills (regs > 255)" if regs > 255 else "tight (regs > 232)" if regs > 232 else ""
        out.append(Design(name, "bwd", mix, W, keys, rows, regs, smem, LAM_BWD, note=note))
    if D == 64:
        add("G  fused, 64 keys, 4 warps x 16 keys, 64 rows, P in regs", 64, 4, 64, True)
        add("H  G + red.global.add.v4.f32", 64, 4, 64, True, red_width=4)
        add("I  fused, 128 keys, 8 warps x 16 keys, 64 rows, P in regs, v4", 128, 8, 64, True,
            red_width=4)
        add("J  fused, 128 keys, 8 warps, 64 rows, P/dS via smem, v4", 128, 8, 64, False,
            red_width=4)
    else:
        add("G  fused, 64 keys, 4 warps x 16 keys, 32 rows, P in regs", 64, 4, 32, True)
        add("H  fused, 64 keys, 8 warps, 64 rows, P/dS via smem", 64, 8, 64, False)
        add("I  H + red.global.add.v4.f32", 64, 8, 64, False, red_width=4)
        add("J  fused, 128 keys, 8 warps, 64 rows, P/dS via smem, v4", 128, 8, 64, False,
            red_width=4)
    j = mix_bwd(D, 128, 8, 64, False, red_width=4)
    out.append(Design("W  sm_90a wgmma, 128 keys, 8 warps, 64 rows (estimate)", "bwd",
                      as_wgmma(j), 8, 128, 64, registers_bwd(D, 128, 8, 64, False),
                      (2 * 128 + 2 * 2 * 64) * D * 2 + 2 * 128 * 64 * 2, LAM_BWD,
                      note="not calibrated"))
    add("FA2 (SDPA flash), counted", 128, 8, 64, False, int_per_ldsm=2.0)
    return out


def predict_design(dsg, dtype, D, S, causal):
    """Seconds of one design's pass at the bench shape (B * S = 16384,
    H * D = 2048)."""
    B, H = shape(D, S)
    rec = dsg.record()
    if dsg.pas == "fwd":
        return m.kernel_seconds(rec, m.fwd_blocks(B, H, S, causal, dsg.block_rows,
                                                  dsg.tile_rows))[0]
    blocks = m.dkdv_blocks(B, H, 1, S, causal, dsg.block_rows, dsg.tile_rows)
    # delta and the dq float32 -> dtype conversion: memory-bound passes
    extra = (2.0 * B * S * H * D * 2 + B * S * H * D * (4 + 4 + 2)) / m.DRAM_BYTES_PER_S + 8e-6
    return m.kernel_seconds(rec, blocks)[0] + extra


# ---------------------------------------------------------------- tables

def table_calibration():
    rows = calibration_rows()
    out = ["| row | predicted ms | measured ms | error |", "|---|---:|---:|---:|"]
    for what, p, t in rows:
        out.append(f"| {what} | {p * 1e3:.2f} | {t * 1e3:.2f} | {100 * (p / t - 1):+.0f} % |")
    errs = [abs(p / t - 1) for _, p, t in rows]
    out.append(f"\nmax |error| {100 * max(errs):.0f} %, rms "
               f"{100 * (sum(e * e for e in errs) / len(errs)) ** 0.5:.0f} % over {len(rows)} rows")
    return "\n".join(out)


def table_check():
    """The counting of mix_fwd on today's forward against its SASS."""
    counts = m.load_counts(BASELINE_COUNTS)
    out = ["| kernel | source | HMMA | LDSM | LDGSTS | MUFU | FFMA | FMUL | FADD | FMNMX | total |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for D in (128, 64):
        sass = counts[f"fwd_tc<bf16,{D},->"]["per_tile"]
        mine = mix_fwd(D, 16, 4, 64)
        for src, mx in (("SASS", sass), ("counted", mine)):
            out.append(f"| fwd_tc D{D} | {src} | " + " | ".join(
                str(mx.get(c, 0)) for c in ("HMMA", "LDSM", "LDGSTS", "MUFU", "FFMA", "FMUL",
                                            "FADD", "FMNMX", "total")) + " |")
    return "\n".join(out)


GOAL = [("bf16", 128, 4096, False), ("bf16", 128, 4096, True), ("bf16", 128, 16384, False),
        ("bf16", 128, 16384, True), ("bf16", 64, 4096, False), ("bf16", 64, 16384, True),
        ("fp16", 128, 16384, True)]


def compiled_bwd_rows(D, keys):
    """The backward as built (ringattn/bench/kernel_counts.json): the fused
    kernel (deterministic=False) and the deterministic split pair, priced
    from their SASS counts as the baseline is."""
    counts = m.load_counts()
    rows = []
    for det, name in ((False, "bwd_tc, fused (SASS)"),
                      (True, "deterministic: dkdv_tc + dq_tc (SASS)")):
        cells = []
        for k in keys:
            B, H = shape(D, k[2])
            p = m.predict("bwd", k[0], D, k[2], k[3], B, H, counts=counts, deterministic=det)
            if p is None:
                return rows
            t = p["total"]
            cells.append(f"{t * 1e3:.2f} / {measured_s(k, 4) / t:.2f} / "
                         f"{measured_s(k, 5) / t:.2f}")
        rec = counts[f"{'dkdv_tc' if det else 'bwd_tc'}<bf16,{D},->"]
        smem = rec["dynamic_smem"] + max(0, rec["static_smem"] - m.SMEM_RESERVED)
        per_sm = m.occupancy(rec["registers"], smem, 32 * rec["warps"])
        w = per_sm * rec["warps"] / m.SMSP_PER_SM
        _, bound = m.block_tile_cycles(rec["per_tile"], rec["cycles"], w)
        rows.append(f"| {name} | {rec['registers']} | {rec['dynamic_smem'] // 1024} | {per_sm} | "
                    f"{bound} | " + " | ".join(cells) + " |")
    return rows


def built_bwd_wg_row(D, keys):
    """The built Hopper backward (cuda/hopper/attn_bwd_wg.cu) priced from its
    SASS counts, as fwd_wg is: predicted, not calibrated.  Then the
    deterministic backward on the same family: the kernel's dk/dv pass
    (dkdv_wg) and the wgmma dq pass (dq_wg)."""
    counts = m.load_counts()
    rows = []
    for det, kernel, name in (
            (False, "bwd_wg", "bwd_wg (cuda/hopper/, SASS counts; not calibrated)"),
            (True, "dkdv_wg", "deterministic on sm90a: dkdv_wg + dq_wg (SASS; not calibrated)")):
        rec = counts.get(f"{kernel}<bf16,{D},->")
        if rec is None:
            continue
        cells = []
        for k in keys:
            B, H = shape(D, k[2])
            t = m.predict("bwd", k[0], D, k[2], k[3], B, H, counts=counts, family="sm90a",
                          deterministic=det)["total"]
            cells.append(f"{t * 1e3:.2f} / {measured_s(k, 4) / t:.2f} / "
                         f"{measured_s(k, 5) / t:.2f}")
        rows.append(wg_row(name, rec, cells))
    return rows


def wg_bound(rec):
    """(blocks per SM, the bound of its tile) of a built warp-specialised
    (sm_90a) kernel's record."""
    per_sm = m.occupancy(rec["registers"], rec["dynamic_smem"], 32 * rec["warps"])
    _, bound = m.block_tile_cycles(rec["per_tile"], rec["cycles"], per_sm * rec["mma_warps"] / 4,
                                   rec["tile_copy_bytes"] / rec["mma_warps"])
    return per_sm, bound


def wg_row(name, rec, cells):
    """A table row of a built warp-specialised (sm_90a) kernel: its
    registers, shared memory, blocks per SM and bound, then the cells."""
    per_sm, bound = wg_bound(rec)
    return (f"| {name} | {rec['registers']} | {rec['dynamic_smem'] // 1024} | {per_sm} | "
            f"{bound} | " + " | ".join(cells) + " |")


def table_designs(pas):
    out = []
    for D in (128, 64):
        designs = fwd_designs(D) if pas == "fwd" else bwd_designs(D)
        keys = [k for k in GOAL if k[1] == D]
        head = ("| design | regs | smem KB | blocks/SM | bound | " +
                " | ".join(f"{'c' if k[3] else 'n'} {k[2] // 1024}k {k[0]}" for k in keys) + " |")
        out += [f"\n{pas}, D = {D}: predicted ms / ratio to the measured SDPA flash "
                "(> 1: faster than flash) / to cuDNN", "", head,
                "|---|---:|---:|---:|---|" + "---:|" * len(keys)]
        if pas == "bwd":   # today's split kernels, from their SASS counts
            base = m.load_counts(BASELINE_COUNTS)
            cells = []
            for k in keys:
                B, H = shape(D, k[2])
                t = m.predict("bwd", k[0], D, k[2], k[3], B, H, counts=base)["total"]
                cells.append(f"{t * 1e3:.2f} / {measured_s(k, 4) / t:.2f} / "
                             f"{measured_s(k, 5) / t:.2f}")
            rec = base[f"dkdv_tc<bf16,{D},->"]
            out.append(f"| today: dkdv_tc + dq_tc (SASS) | {rec['registers']} | "
                       f"{rec['dynamic_smem'] // 1024} | 2 | smem, latency | "
                       + " | ".join(cells) + " |")
            out += compiled_bwd_rows(D, keys)
            out += built_bwd_wg_row(D, keys)
        if pas == "fwd":   # the built Hopper kernel, from its SASS counts
            counts = m.load_counts()
            rec = counts.get(f"fwd_wg<bf16,{D},->")
            if rec is not None:
                cells = []
                for k in keys:
                    B, H = shape(D, k[2])
                    t = m.predict("fwd", k[0], D, k[2], k[3], B, H, counts=counts,
                                  family="sm90a")["total"]
                    cells.append(f"{t * 1e3:.2f} / {measured_s(k, 1) / t:.2f} / "
                                 f"{measured_s(k, 2) / t:.2f}")
                out.append(wg_row("fwd_wg (cuda/hopper/, SASS counts; not calibrated)", rec,
                                  cells))
        for dsg in designs:
            rec = dsg.record()
            per_sm = m.occupancy(rec["registers"], rec["dynamic_smem"], 32 * dsg.warps)
            w = per_sm * dsg.warps / 4
            _, bound = m.block_tile_cycles(dsg.mix, rec["cycles"], w)
            cells = []
            for k in keys:
                t = predict_design(dsg, *k)
                col = 1 if pas == "fwd" else 4
                fl, cu = measured_s(k, col), measured_s(k, col + 1)
                cells.append(f"{t * 1e3:.2f} / {fl / t:.2f} / {cu / t:.2f}")
            note = f" ({dsg.note})" if dsg.note else ""
            out.append(f"| {dsg.name}{note} | {dsg.regs} | {dsg.smem // 1024} | {per_sm} | "
                       f"{bound} | " + " | ".join(cells) + " |")
    return "\n".join(out)


# ---------------------------------------------------------------- the L2 rate

# L2 rates the table below tries (bytes/s): the model's assumption first
L2_RATES = (4.5e12, 6.0e12, 7.5e12)


def table_l2_sensitivity():
    """The built Hopper kernels' predicted ratio to cuDNN (lowest-highest
    over the goal's columns of each D) and their bound, with the model's
    one assumed rate, L2_BYTES_PER_S, set to each of L2_RATES: what a
    measured L2 rate (tools/gpu_check.sh profile) changes."""
    counts = m.load_counts()
    runs = (("fwd_wg", "fwd", False, ("fwd_wg",)),
            ("bwd_wg", "bwd", False, ("bwd_wg",)),
            ("dkdv_wg + dq_wg", "bwd", True, ("dkdv_wg", "dq_wg")))
    Ds = (128, 64)
    head = ("| L2 TB/s | " + " | ".join(f"{name} D {D}" for name, *_ in runs for D in Ds) + " |")
    out = [head, "|---:|" + "---|" * (len(runs) * len(Ds))]
    saved = m.L2_BYTES_PER_S
    try:
        for rate in L2_RATES:
            m.L2_BYTES_PER_S = rate
            cells = []
            for _, pas, det, kernels in runs:
                col = 2 if pas == "fwd" else 5
                for D in Ds:
                    ratios = []
                    for k in (k for k in GOAL if k[1] == D):
                        B, H = shape(D, k[2])
                        t = m.predict(pas, k[0], D, k[2], k[3], B, H, counts=counts,
                                      family="sm90a", deterministic=det)["total"]
                        ratios.append(measured_s(k, col) / t)
                    bounds = [wg_bound(counts[f"{kern}<bf16,{D},->"])[1] for kern in kernels]
                    cells.append(f"{min(ratios):.2f}-{max(ratios):.2f} ({', '.join(bounds)})")
            mark = " (assumed)" if rate == saved else ""
            out.append(f"| {rate / 1e12:g}{mark} | " + " | ".join(cells) + " |")
    finally:
        m.L2_BYTES_PER_S = saved
    return "\n".join(out)


# ---------------------------------------------------------------- the built forward

# kernel_counts.json: the SASS counts of the kernels as built now (rewritten
# by `sass_report.py --so ... --counts` after a kernel change)
BUILT_COUNTS = m.COUNTS
# the masks of the baseline run (bf16, D 128, H 16, S 16384, B 1, causal):
# measured forward ms (shared/gpu/H100-2026-11-26.md), causal from the table
MASKS_SHAPE = ("bf16", 128, 16384)
MEASURED_MASKS = {"window": 2.36e-3, "docs": 1.00e-3}


def masked_fwd_blocks(B, H, S, rows, cols, window=None, docs=1):
    """Tile counts of the masked forward's blocks, causal, heaviest first:
    a sliding window of `window` keys to the left (the kernel starts at the
    first row's lowest key), or `docs` equal packed documents (the tiles
    from the document's start; rows per block divide the length)."""
    per = []
    n = S // docs
    for qb in reversed(range(-(-S // rows))):
        q0 = qb * rows
        kend = min(S, q0 + rows)
        lo = max(0, q0 - window) if window is not None else (q0 // n) * n
        per.append(-(-(kend - lo) // cols))
    return per * (B * H)


def _fwd_rec(counts, D, masked=False, dtype="bf16"):
    return counts.get(f"fwd_tc<{dtype},{D},{'M' if masked else '-'}>")


def table_forward_sass():
    """The forward's per-tile mix (one warp, one key tile, sm_90, bf16),
    as measured (baseline) and as built."""
    cols = ("HMMA", "LDSM", "LDGSTS", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX")
    out = ["| kernel | build | regs | warps | " + " | ".join(cols) +
           " | IMAD + int ALU | (int - 30) / LDSM | total | one warp, cycles |",
           "|---|---|---:|---:|" + "---:|" * (len(cols) + 4)]
    for D in (128, 64):
        for masked in (False, True):
            for name, path in (("baseline", BASELINE_COUNTS), ("built", BUILT_COUNTS)):
                rec = _fwd_rec(m.load_counts(path), D, masked)
                if rec is None:
                    continue
                mix = rec["per_tile"]
                ints = mix.get("IMAD", 0) + mix.get("IALU", 0)
                out.append(f"| fwd_tc D{D}{' M' if masked else ''} | {name} | "
                           f"{rec['registers']} | {rec['warps']} | " +
                           " | ".join(str(mix.get(c, 0)) for c in cols) +
                           f" | {ints} | {(ints - 30) / mix['LDSM']:.1f} | {mix['total']} | "
                           f"{rec['cycles']} |")
    return "\n".join(out)


def table_forward_built():
    """Predicted forward times at the goal's rows: the baseline's counts
    and the built kernels' counts, against the measured SDPA flash."""
    base, built = m.load_counts(BASELINE_COUNTS), m.load_counts(BUILT_COUNTS)
    out = ["| row | baseline predicted ms | built predicted ms | built: blocks/SM, bound | "
           "SDPA flash measured ms | flash / built |",
           "|---|---:|---:|---|---:|---:|"]
    for k in GOAL:
        dt, D, S, causal = k
        B, H = shape(D, S)
        t0 = m.predict("fwd", dt, D, S, causal, B, H, counts=base)["total"]
        rec = _fwd_rec(built, D, dtype=dt)
        t1, det = m.kernel_seconds(rec, m.fwd_blocks(B, H, S, causal, rec["block_rows"],
                                                     rec["tile_rows"]))
        fl = measured_s(k, 1)
        out.append(f"| {dt} D{D} S{S} {'causal' if causal else 'full'} | {t0 * 1e3:.2f} | "
                   f"{t1 * 1e3:.2f} | {det['blocks_per_sm']}, {det['bound']} | "
                   f"{fl * 1e3:.2f} | {fl / t1:.2f} |")
    return "\n".join(out)


def table_forward_masks():
    """Window (S/4 to the left) and 8 packed documents against plain
    causal, forward, at the masks' measured shape: the masked kernel's
    (M) counts on the visited tiles, the plain one's on causal."""
    dt, D, S = MASKS_SHAPE
    B, H = 16384 // S, 2048 // D
    causal_meas = measured_s((dt, D, S, True), 0)
    out = ["| case | baseline measured ms (/ causal) | baseline predicted ms (/ causal) | "
           "built predicted ms (/ causal) |", "|---|---:|---:|---:|"]
    cells = {}
    for name, path in (("baseline", BASELINE_COUNTS), ("built", BUILT_COUNTS)):
        counts = m.load_counts(path)
        plain, masked = _fwd_rec(counts, D), _fwd_rec(counts, D, True)
        r, c = masked["block_rows"], masked["tile_rows"]
        t = {"causal": m.kernel_seconds(plain, m.fwd_blocks(B, H, S, True, plain["block_rows"],
                                                            plain["tile_rows"]))[0],
             "window": m.kernel_seconds(masked, masked_fwd_blocks(B, H, S, r, c,
                                                                  window=S // 4))[0],
             "docs": m.kernel_seconds(masked, masked_fwd_blocks(B, H, S, r, c, docs=8))[0]}
        cells[name] = t
    for case in ("causal", "window", "docs"):
        meas = causal_meas if case == "causal" else MEASURED_MASKS[case]
        row = [f"{meas * 1e3:.2f} ({meas / causal_meas:.2f})"]
        for name in ("baseline", "built"):
            t = cells[name]
            row.append(f"{t[case] * 1e3:.2f} ({t[case] / t['causal']:.2f})")
        out.append(f"| {case} | " + " | ".join(row) + " |")
    return "\n".join(out)


def masked_bwd_blocks(B, H, S, keys, rows, window=None, docs=1):
    """Tile counts of the masked backward's blocks (one per `keys` keys,
    query tiles of `rows`), causal: a sliding window of `window` keys to
    the left (the block's queries end at its last key plus the window), or
    `docs` equal packed documents (the queries up to the document's end;
    keys per block divide the length)."""
    per = []
    n = S // docs
    for kb in range(-(-S // keys)):
        k0 = kb * keys
        end = min(S, k0 + keys + window) if window is not None else (k0 // n + 1) * n
        per.append(-(-(end - k0) // rows))
    return per * (B * H)


def table_backward_masks():
    """Window (S/4 to the left) and 8 packed documents against plain
    causal, backward, at the forward masks' shape: each fused kernel's
    masked (M) counts on the visited tiles, its plain ones on causal
    (PREDICTED; the delta and dq conversion passes, the same in every
    case, left out)."""
    dt, D, S = MASKS_SHAPE
    B, H = 16384 // S, 2048 // D
    counts = m.load_counts(BUILT_COUNTS)
    out = ["| kernel | causal ms | window ms (/ causal) | docs ms (/ causal) |",
           "|---|---:|---:|---:|"]
    for name in ("bwd_tc", "bwd_wg"):
        plain = counts.get(m._label(name, dt, D))
        masked = counts.get(m._label(name, dt, D, True))
        if plain is None or masked is None:
            continue
        k, r = masked["block_rows"], masked["tile_rows"]
        causal = m.kernel_seconds(plain, m.dkdv_blocks(B, H, 1, S, True, plain["block_rows"],
                                                       plain["tile_rows"]))[0]
        window = m.kernel_seconds(masked, masked_bwd_blocks(B, H, S, k, r, window=S // 4))[0]
        docs = m.kernel_seconds(masked, masked_bwd_blocks(B, H, S, k, r, docs=8))[0]
        out.append(f"| {name} | {causal * 1e3:.2f} | {window * 1e3:.2f} ({window / causal:.2f}) "
                   f"| {docs * 1e3:.2f} ({docs / causal:.2f}) |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true")
    args = ap.parse_args(argv)
    if args.fit:
        fit()
        return 0
    print("## calibration\n")
    print(table_calibration())
    print("\n## counting check\n")
    print(table_check())
    print("\n## forward designs")
    print(table_designs("fwd"))
    print("\n## backward designs")
    print(table_designs("bwd"))
    print("\n## the built forward: per-tile mix\n")
    print(table_forward_sass())
    print("\n## the built forward: predicted times\n")
    print(table_forward_built())
    print("\n## the built forward: masks against causal\n")
    print(table_forward_masks())
    print("\n## the built backward: masks against causal\n")
    print(table_backward_masks())
    print("\n## the L2 rate\n")
    print(table_l2_sensitivity())
    return 0


if __name__ == "__main__":
    sys.exit(main())
