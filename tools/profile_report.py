"""Nsight Compute's details page (CSV) of tools/profile_case.py as tables
(tools/gpu_check.sh, stage "profile"): per launch, what ncu measured next
to what ringattn's performance model (ringattn/bench/model.py) predicts
for that kernel, and the ratio, which is what calibrates the model's
uncalibrated parts (the wgmma rate, the L2 rate of dq's red.global.add).

    python tools/profile_report.py profile.csv [--seq-len S]

Prints markdown: the launches table, the raw metrics table (metrics given
to ncu with --metrics), and a last line

    profile: N launches (of M expected); measured/predicted fwd_wg a-b, ...;
             L2 TB/s at 100 % fwd_wg c-d, ... (model: 4.5)

(the L2 part where ncu gave lts__t_bytes.sum.per_second: the rate L2
served over its "L2 Cache Throughput" percentage, the rate that would
saturate it, which the model assumes, L2_BYTES_PER_S).

Launches pair with profile_case.cases() in order; a kernel name that is
not the expected one is shown as such (a fallback to another kernel).
Exit status 1 when no launch was found.
"""
import argparse
import csv
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile_case  # noqa: E402

TIME_MS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0,
           "ms": 1.0, "second": 1e3, "s": 1e3}
# ncu's rate units ("Gbyte/second", "Tbyte/s", ...), in TB/s
RATE_UNIT = re.compile(r"^([KMGTP]?)(?:byte|B)/(?:second|s)$")
RATE_TBS = {"": 1e-12, "K": 1e-9, "M": 1e-6, "G": 1e-3, "T": 1.0, "P": 1e3}
# the bytes per second L2 served the launch (gpu_check.sh PROFILE_METRICS):
# with the section's "L2 Cache Throughput" (% of the busiest L2 unit's
# peak), the rate L2 would serve at 100 %, which calibrates the model's
# L2_BYTES_PER_S (an assumption until a run measures it)
L2_RATE = "lts__t_bytes.sum.per_second"
L2_PCT = "L2 Cache Throughput"

# (column, the metric names ncu's sections give it, in order of preference)
COLUMNS = [
    ("regs", ("Registers Per Thread",)),
    ("dyn smem", ("Dynamic Shared Memory Per Block",)),
    ("SM throughput %", ("Compute (SM) Throughput",)),
    ("issue slots busy %", ("Issue Slots Busy",)),
    ("eligible warps / scheduler", ("Eligible Warps Per Scheduler",)),
    ("L2 throughput %", ("L2 Cache Throughput",)),
    ("DRAM throughput %", ("DRAM Throughput",)),
    ("achieved occupancy %", ("Achieved Occupancy",)),
]


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


def read_launches(path):
    """[(id, kernel name, {metric: (unit, value text)})] in launch order."""
    by_id = {}
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]   # ncu's own notes are not CSV
    for row in csv.DictReader(lines):
        if not row.get("ID") or not row.get("Metric Name"):
            continue
        key = int(number(row["ID"]))
        rec = by_id.setdefault(key, (row.get("Kernel Name", ""), {}))
        rec[1][row["Metric Name"]] = (row.get("Metric Unit", ""), row.get("Metric Value", ""))
    return [(k, *by_id[k]) for k in sorted(by_id)]


def short_name(kernel):
    m = re.search(r"([a-z0-9_]+?)_kernel", kernel)
    return m.group(1) if m else kernel


def duration_ms(metrics):
    unit, value = metrics.get("Duration", ("", ""))
    x = number(value)
    return None if x is None or unit not in TIME_MS else x * TIME_MS[unit]


def cell(metrics, names):
    for name in names:
        if name in metrics:
            unit, value = metrics[name]
            unit = "" if unit in ("", "%", "register/thread", "warp") else " " + unit
            return f"{value}{unit}"
    return "—"


def l2_rates(metrics):
    """(TB/s L2 served, TB/s it would serve at 100 % of its throughput) of
    one launch; None where ncu did not give them."""
    unit, value = metrics.get(L2_RATE, ("", ""))
    x, u = number(value), RATE_UNIT.match(unit.strip())
    if x is None or u is None:
        return None, None
    tbs = x * RATE_TBS[u.group(1)]
    pct = number(metrics.get(L2_PCT, ("", ""))[1])
    return tbs, (tbs * 100.0 / pct if pct else None)


def model_module():
    """ringattn/bench/model.py, or None where ringattn is not importable
    (the model ships with the package)."""
    try:
        from ringattn.bench import model
    except ImportError:
        return None
    return model


def spans(values):
    """'kernel lowest-highest, ...' of {kernel: [number, ...]}."""
    return ", ".join(f"{k} {min(v):.2f}-{max(v):.2f}" for k, v in sorted(values.items()))


def predicted_ms(case, kernel, S):
    pas, D, causal, det, mask, _ = case
    model = model_module()
    if mask != "none" or model is None:
        return None
    pred = model.predict(pas, "bfloat16", D, S, causal, profile_case.B, profile_case.H,
                         deterministic=det, family="sm90a")
    return None if pred is None or kernel not in pred else pred[kernel] * 1e3


def expected(cases):
    return [(n, c, k) for n, c in enumerate(cases) for k in c[5]]


def report(launches, S):
    cases = profile_case.cases()
    want = expected(cases)
    head = ["case", "kernel", "measured ms", "predicted ms", "measured / predicted"]
    head += [c for c, _ in COLUMNS] + ["L2 TB/s", "L2 TB/s at 100 %"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios, l2 = {}, {}
    raw_names = sorted({m for _, _, ms in launches for m in ms if "__" in m})
    raw = ["| case | kernel | " + " | ".join(raw_names) + " |",
           "|" + "---|" * (2 + len(raw_names))]
    for i, (_, kernel, metrics) in enumerate(launches):
        name = short_name(kernel)
        if i < len(want):
            n, case, exp = want[i]
            pas, D, causal, det, mask, _ = case
            label = (f"{n}: {pas} D {D}{' causal' if causal else ''}"
                     f"{' det' if det else ''}{'' if mask == 'none' else ' ' + mask}")
        else:
            case, exp, label = None, None, f"extra {i}"
        shown = name if name == exp else f"{name} (expected {exp})"
        ms = duration_ms(metrics)
        pred = predicted_ms(case, name, S) if case is not None and name == exp else None
        ratio = ms / pred if ms is not None and pred else None
        if ratio is not None:
            ratios.setdefault(name, []).append(ratio)
        row = [label, shown, "—" if ms is None else f"{ms:.3f}",
               "—" if pred is None else f"{pred:.3f}",
               "—" if ratio is None else f"{ratio:.2f}"]
        row += [cell(metrics, names) for _, names in COLUMNS]
        tbs, full = l2_rates(metrics)
        row += ["—" if tbs is None else f"{tbs:.2f}", "—" if full is None else f"{full:.2f}"]
        if full is not None:
            l2.setdefault(name, []).append(full)
        out.append("| " + " | ".join(row) + " |")
        if raw_names:
            raw.append(f"| {label} | {shown} | "
                       + " | ".join(metrics.get(m, ("", "—"))[1] for m in raw_names) + " |")
    summary = (f"profile: {len(launches)} launches (of {len(want)} expected); "
               f"measured/predicted {spans(ratios) if ratios else 'none'}")
    if l2:
        model = model_module()
        assumed = f" (model: {model.L2_BYTES_PER_S / 1e12:g})" if model else ""
        summary += f"; L2 TB/s at 100 % {spans(l2)}{assumed}"
    text = (f"B {profile_case.B}, H {profile_case.H}, S {S}, bfloat16 "
            "(tools/profile_case.py); predicted: ringattn/bench/model.py\n\n"
            + "\n".join(out) + "\n")
    if raw_names:
        text += "\n" + "\n".join(raw) + "\n"
    return text + "\n" + summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--seq-len", type=int, default=profile_case.S)
    a = ap.parse_args(argv)
    launches = read_launches(a.csv)
    print(report(launches, a.seq_len))
    return 0 if launches else 1


if __name__ == "__main__":
    sys.exit(main())
