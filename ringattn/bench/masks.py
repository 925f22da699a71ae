"""``ringattn bench --masks``: documents, sliding windows and soft-capping on
the CPU, against the same problem without the mask and against PyTorch SDPA
given the same mask as an explicit boolean matrix.

Tables (one run, float32, causal, B = 1, D = 64, every core):

* packed documents: n = 16k tokens (2k with --quick) cut into 1, 2, 4, 8
  and 16 equal documents, H = 4.  With causal attention a query sees only
  the earlier tokens of its own document, so the visible fraction of the
  n x n score matrix falls as 1/docs and ringattn's time with it (tiles of
  other documents are skipped, not computed and masked).
* sliding window: w = 4096 (512 with --quick) over n = 64k tokens (8k),
  H = 2 (so that the full causal run it is compared with stays near a
  minute on 2 cores): window (w, 0) against plain causal, plus a softcap.
* no mask: the CPU table's configuration (S = 4096, H = 8), so the unmasked
  path can be read against the --cpu table and bench/RESULTS.md.

Each row: the visible fraction (keys seen per query summed, over n^2),
ringattn forward and backward seconds (best of --repeat), and torch SDPA
(``scaled_dot_product_attention`` with ``attn_mask`` a boolean (n, n)
matrix, forward and backward) where torch is installed and the mask fits in
memory (SDPA turns it into a float mask: 5 bytes per pair), for the plain
and the 8-document case and for the window; a pass estimated to take more
than SDPA_BUDGET_S (150 s) is not run, and its cell says why.  Rows are dicts and columns a list of (header,
key, format): a caller appends rows with other keys (ring rows with bytes
sent, say) and columns for them, and ``format_table`` shows "-" where a row
has no value.
"""

import os
import time

import numpy as np

from .timing import best_time

B, D = 1, 64

COLUMNS = [
    ("case", "case", "{}"),
    ("n", "n", "{}"),
    ("H", "H", "{}"),
    ("visible", "visible", "{:.3f}"),
    ("ringattn fwd s", "fwd_s", "{:.2f}"),
    ("ringattn bwd s", "bwd_s", "{:.2f}"),
    ("vs unmasked fwd", "fwd_ratio", "{:.2f}"),
    ("torch SDPA fwd s", "sdpa_fwd_s", "{:.2f}"),
    ("torch SDPA bwd s", "sdpa_bwd_s", "{:.2f}"),
]


def format_table(rows, columns=COLUMNS):
    """Markdown table of `rows` (dicts); a missing or None value shows "-",
    a string shows as it is."""
    lines = ["| " + " | ".join(c[0] for c in columns) + " |",
             "|" + "|".join(":---" if i == 0 else "---:"
                            for i in range(len(columns))) + "|"]
    for row in rows:
        cells = []
        for _, key, fmt in columns:
            value = row.get(key)
            cells.append("-" if value is None else
                         value if isinstance(value, str) else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def visible_fraction(n, causal=True, segment_ids=None, window=None):
    """Fraction of the n x n (query, key) pairs some query sees, for sorted
    ids (packed documents) and a window, in O(n) memory."""
    i = np.arange(n)
    lo = np.zeros(n, np.int64)
    hi = np.full(n, n - 1, np.int64)
    if causal:
        hi = np.minimum(hi, i)
    if window is not None:
        left, right = window
        if left is not None:
            lo = np.maximum(lo, i - left)
        if right is not None:
            hi = np.minimum(hi, i + right)
    if segment_ids is not None:
        ids = np.asarray(segment_ids).reshape(-1)
        first = np.searchsorted(ids, ids, side="left")
        last = np.searchsorted(ids, ids, side="right") - 1
        lo, hi = np.maximum(lo, first), np.minimum(hi, last)
    return float(np.clip(hi - lo + 1, 0, None).sum()) / n ** 2


def _ringattn_times(q, k, v, dout, repeat, masks):
    import ringattn as ra

    out, lse = ra.attention(q, k, v, causal=True, return_lse=True, **masks)
    fwd = best_time(lambda: ra.attention(q, k, v, causal=True, **masks), repeat)
    bwd = best_time(lambda: ra.attention_backward(dout, q, k, v, out, lse,
                                              causal=True, **masks), repeat)
    return fwd, bwd


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _free_bytes():
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def dense_mask(n, segment_ids=None, window=None):
    """The (n, n) boolean matrix of the causal mask with documents and a
    window, True where the key is visible, built in row blocks."""
    mask = np.zeros((n, n), bool)
    ids = None if segment_ids is None else np.asarray(segment_ids).reshape(-1)
    j = np.arange(n)
    for a in range(0, n, 1024):
        i = np.arange(a, min(n, a + 1024))[:, None]
        rows = j[None, :] <= i
        if window is not None:
            rows &= j[None, :] >= i - window[0]
        if ids is not None:
            rows &= ids[None, :] == ids[i]
        mask[a:a + len(i)] = rows
    return mask


# SDPA turns the boolean mask into a float one: 5 bytes per (query, key)
SDPA_MASK_BYTES = 5
SDPA_BUDGET_S = 150.0


class SdpaTimer:
    """torch SDPA with an explicit boolean mask, where the mask fits in the
    free memory and the pass is estimated (from the throughput of the calls
    so far: it computes every pair, masked or not) to stay within
    SDPA_BUDGET_S seconds.  A pass not run shows why in its cell."""

    def __init__(self):
        self.torch = _torch()
        self.pairs_per_s = None        # (query, key) pairs x heads per second

    def reason(self):
        return None if self.torch is not None else \
            "torch is not installed (pip install torch adds the SDPA columns)"

    def times(self, q, k, v, dout, repeat, segment_ids=None, window=None):
        """(fwd, bwd): seconds, or a short reason it was not run."""
        torch = self.torch
        n, H = q.shape[1], q.shape[2]
        if torch is None:
            return "no torch", "no torch"
        if n * n * SDPA_MASK_BYTES * 1.2 > _free_bytes():
            return "mask > memory", "mask > memory"
        work = float(H) * n * n
        if self.pairs_per_s and work / self.pairs_per_s > SDPA_BUDGET_S:
            return "over budget", "over budget"
        torch.set_num_threads(os.cpu_count() or 1)
        mask = torch.from_numpy(dense_mask(n, segment_ids, window))
        # (B, S, H, D) -> (B, H, S, D) views
        tq, tk, tv, tdo = (torch.from_numpy(x).transpose(1, 2)
                           for x in (q, k, v, dout))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        with torch.no_grad():
            fwd = best_time(lambda: sdpa(tq, tk, tv, attn_mask=mask), repeat)
        self.pairs_per_s = max(self.pairs_per_s or 0.0, work / fwd)
        if fwd * 3 > SDPA_BUDGET_S:
            return fwd, "over budget"
        leaves = [x.detach().requires_grad_() for x in (tq, tk, tv)]

        def backward():
            out = sdpa(*leaves, attn_mask=mask)
            t0 = time.perf_counter()
            out.backward(tdo)
            return time.perf_counter() - t0

        return fwd, min(backward() for _ in range(repeat))


def _inputs(n, H, seed):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, n, H, D), dtype=np.float32)
                 for _ in range(4))


def _row(case, n, H, visible, times, sdpa=(None, None), base_fwd=None):
    return {"case": case, "n": n, "H": H, "visible": visible,
            "fwd_s": times[0], "bwd_s": times[1],
            "fwd_ratio": None if base_fwd is None else times[0] / base_fwd,
            "sdpa_fwd_s": sdpa[0], "sdpa_bwd_s": sdpa[1]}


def _print_row(row, header):
    text = format_table([row])
    print(text if header else text.splitlines()[-1], flush=True)


def document_rows(n, H, repeat, sdpa):
    """Causal attention over n tokens packed as 1..16 equal documents; SDPA
    for 1 and 8 documents."""
    import ringattn as ra

    q, k, v, dout = _inputs(n, H, 1)
    rows, base = [], None
    for docs in (1, 2, 4, 8, 16):
        cu = np.linspace(0, n, docs + 1).astype(np.int64)
        ids = ra.segment_ids(cu, n)
        masks = {} if docs == 1 else {"segment_ids": ids}
        times = _ringattn_times(q, k, v, dout, repeat, masks)
        base = times[0] if base is None else base
        sd = sdpa.times(q, k, v, dout, repeat, segment_ids=ids) \
            if docs in (1, 8) else (None, None)
        rows.append(_row("causal" if docs == 1 else f"{docs} documents", n,
                         H, visible_fraction(n, segment_ids=ids), times, sd,
                         base))
        _print_row(rows[-1], header=docs == 1)
    return rows


def window_rows(n, w, H, repeat, sdpa):
    """Plain causal, a causal window (w, 0) (SDPA given its mask), and the
    window with a softcap."""
    q, k, v, dout = _inputs(n, H, 2)
    rows, base = [], None
    cases = [("causal", {}), (f"window ({w}, 0)", {"window": (w, 0)}),
             (f"window ({w}, 0), softcap 30",
              {"window": (w, 0), "softcap": 30.0})]
    for i, (case, masks) in enumerate(cases):
        times = _ringattn_times(q, k, v, dout, repeat, masks)
        base = times[0] if base is None else base
        window = masks.get("window")
        sd = sdpa.times(q, k, v, dout, repeat, window=window) if i == 1 \
            else (None, None)
        rows.append(_row(case, n, H, visible_fraction(n, window=window),
                         times, sd, base))
        _print_row(rows[-1], header=i == 0)
    return rows


def unmasked_rows(S, H, repeat):
    """The CPU table's configuration, causal and not (compare with --cpu)."""
    import ringattn as ra

    q, k, v, dout = _inputs(S, H, 3)
    rows = []
    for causal in (False, True):
        out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
        fwd = best_time(lambda: ra.attention(q, k, v, causal=causal), repeat)
        bwd = best_time(lambda: ra.attention_backward(dout, q, k, v, out, lse,
                                                  causal=causal), repeat)
        rows.append({"case": "no mask, causal" if causal else "no mask",
                     "n": S, "H": H,
                     "visible": visible_fraction(S, causal=causal),
                     "fwd_s": fwd, "bwd_s": bwd})
    return rows


def run(args):
    """``ringattn bench --masks``; returns the exit status."""
    import ringattn as ra

    quick = args.quick
    repeat = max(1, args.repeat)
    sdpa = SdpaTimer()
    info = ra.cpu_info()
    print(f"masks on the CPU: float32, causal, B={B}, D={D}, "
          f"{info['threads']} threads ({info['simd']}); best of {repeat}; "
          f"torch SDPA with an explicit boolean mask"
          + (f" ({sdpa.torch.__version__})" if sdpa.torch else
             f": not run, {sdpa.reason()}"), flush=True)

    n_docs = 2048 if quick else 16384
    print(f"\npacked documents: {n_docs} tokens in equal documents\n",
          flush=True)
    document_rows(n_docs, 4, repeat, sdpa)

    n_win, w = (8192, 512) if quick else (65536, 4096)
    print(f"\nsliding window: {n_win} tokens, window ({w}, 0)\n", flush=True)
    window_rows(n_win, w, 2, repeat, sdpa)

    S = 512 if quick else 4096
    print("\nno mask: the --cpu table's configuration\n", flush=True)
    print(format_table(unmasked_rows(S, 8, repeat), COLUMNS[:6]), flush=True)
    print()
    from .masks_ring import run as run_ring

    return run_ring(args)
