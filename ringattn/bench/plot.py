"""``ringattn bench --plot FILE``: the --cpu and --ring tables as a picture.

Panels (those whose table was run):

* CPU kernels, one panel per thread count: GFLOP/s against S of ringattn's
  forward and backward (solid) next to a dense NumPy attention (dashed) and
  the NumPy float32 matmul rate of the same run (dotted);
* the ring: wall time against p, with the single-rank time of the same work
  (dashed);
* the ring: each rank's peak ringattn memory against p (the largest rank).

matplotlib is imported here only (the CLI checks it is installed).
"""

COLORS = {("fwd", False): "tab:blue", ("bwd", False): "tab:orange",
          ("fwd", True): "tab:green", ("bwd", True): "tab:red"}


def _cpu_panel(ax, table):
    rows = table["rows"]
    for (pas, causal), color in COLORS.items():
        sel = [r for r in rows if r["pass"] == pas and r["causal"] == causal]
        if not sel:
            continue
        S = [r["S"] for r in sel]
        label = f"{pas}{' causal' if causal else ''}"
        ax.plot(S, [r["gflops"] for r in sel], "o-", color=color,
                label=f"ringattn {label}")
        # same FLOP convention for the dense baseline: its time, our count
        ax.plot(S, [r["gflops"] / r["speedup"] for r in sel], "x--",
                color=color, alpha=0.7, label=f"NumPy {label}")
    ax.axhline(table["rate"], color="gray", linestyle=":",
               label="NumPy matmul")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["S"] for r in rows}), minor=False)
    ax.get_xaxis().set_major_formatter("{x:.0f}")
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(f"CPU kernels, {table['threads']} thread(s)")


def _ring_panels(ax_time, ax_mem, rows):
    for causal, color in ((False, "tab:blue"), (True, "tab:green")):
        sel = [r for r in rows if r["causal"] == causal]
        if not sel:
            continue
        p = [r["p"] for r in sel]
        name = "causal" if causal else "full"
        ax_time.plot(p, [r["ring_s"] for r in sel], "o-", color=color,
                     label=f"ring, {name}")
        ax_time.axhline(sel[0]["single_s"], color=color, linestyle="--",
                        alpha=0.7, label=f"single rank, {name}")
        ax_mem.plot(p, [r["peak_mib"] for r in sel], "o-", color=color,
                    label=name)
    for ax in (ax_time, ax_mem):
        ax.set_xlabel("ranks p")
        ax.set_xticks(sorted({r["p"] for r in rows}))
    ax_time.set_ylabel("seconds")
    ax_time.set_title("ring attention forward")
    ax_mem.set_ylabel("MiB")
    ax_mem.set_title("peak ringattn memory per rank")


def draw(path, cpu_tables, ring_rows):
    """Write the figure to `path` (format from its extension)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(cpu_tables) + (2 if ring_rows else 0)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.6),
                             squeeze=False)
    axes = list(axes[0])
    for table in cpu_tables:
        _cpu_panel(axes.pop(0), table)
    if ring_rows:
        _ring_panels(axes[0], axes[1], ring_rows)
    for ax in fig.axes:
        # room above the data for the legend, and every axis from zero
        ax.set_ylim(0, 1.5 * ax.get_ylim()[1])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
