"""``ringattn bench --masks``: its visible fractions and dense masks against
the reference's visibility, its table builder, and a quick run without
torch that says so."""

import subprocess
import sys

import numpy as np
import pytest

import ringattn as ra
from ringattn.bench import masks as bench_masks
from ringattn import testing as rt


@pytest.mark.parametrize("n,cu,window", [
    (50, None, None), (50, None, (7, 0)), (64, [0, 10, 11, 40], None),
    (64, [0, 10, 11, 40], (5, 0)), (33, [0, 33], (40, 0)), (1, None, (0, 0))])
def test_visible_fraction_and_dense_mask_match_the_reference(n, cu, window):
    ids = None if cu is None else ra.segment_ids(cu, n)
    want = rt.ref_visible(n, n, causal=True, segment_ids=ids,
                          window=window)[0, 0]
    assert bench_masks.visible_fraction(n, segment_ids=ids, window=window) \
        == pytest.approx(want.mean(), abs=1e-12)
    np.testing.assert_array_equal(bench_masks.dense_mask(n, ids, window),
                                  want)


def test_table_builder_takes_new_rows_and_columns():
    rows = [{"case": "causal", "n": 8, "fwd_s": 1.234},
            {"case": "ring", "n": 8, "sent_mib": 2.5, "sdpa_fwd_s": "no torch"}]
    columns = bench_masks.COLUMNS + [("MiB sent", "sent_mib", "{:.1f}")]
    lines = bench_masks.format_table(rows, columns).splitlines()
    assert lines[0].startswith("| case | n |") and "MiB sent" in lines[0]
    assert lines[2].split(" | ")[4] == "1.23" and lines[2].endswith("| - |")
    assert "no torch" in lines[3] and lines[3].endswith("| 2.5 |")


def test_quick_run_without_torch_says_so():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from ringattn.cli import main\n"
            "sys.exit(main(['bench', '--masks', '--quick', '--repeat', '1']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "torch is not installed" in out
    for title in ("packed documents", "sliding window", "no mask"):
        assert title in out
    assert out.count("| 8 documents |") == 1
    assert "| no torch | no torch |" in out
