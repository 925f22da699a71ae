"""``ringattn bench --gpu``.  Without a GPU: the masked rows' mask cases
(the same problem for ringattn and for SDPA's explicit mask), their visible
fraction, and the formatting of the masked table, the accuracy rows and the
summary.  With one (``gpu`` marker; the emulated GPU of a
``RINGATTN_CUDA=emulate`` build included): the whole bench in its quick
configuration runs, every table has its rows and the accuracy passes, with
PyTorch or, where it is missing (always on the emulated GPU), ringattn alone
with the SDPA columns skipped and said so.  The full-size GPU runs are in
tools/gpu_check.sh's bench stage; ``bench --gpu`` without a GPU is
tests/test_cli.py's."""
import os
import subprocess
import sys

import numpy as np
import pytest

import ringattn as ra
from ringattn import testing as rt
from ringattn.bench import model
from ringattn.bench.gpu import (MASK_CASES, format_accuracy_row, format_masked_row,
                                format_model_rows, format_speed_row, mask_keywords, mask_spec,
                                masked_summary, model_prediction)
from ringattn.bench.masks import dense_mask, visible_fraction


@pytest.mark.parametrize("S", [1, 7, 64, 100])
@pytest.mark.parametrize("name", MASK_CASES)
def test_sdpa_mask_is_the_mask_ringattn_applies(name, S):
    # the boolean matrix SDPA is given is the reference's visibility of
    # ringattn's keywords (causal), and its visible fraction is the one the
    # TFLOP/s count
    ids, window, softcap = mask_spec(name, S)
    kw = mask_keywords(ids, window, softcap, 2, lambda x: x)
    dense = dense_mask(S, ids, window)
    ref = rt.ref_visible(S, S, causal=True, segment_ids=kw.get("segment_ids"),
                         window=kw.get("window"))
    assert ref.shape[0] in (1, 2) and all(np.array_equal(r[0], dense) for r in ref)
    assert visible_fraction(S, True, ids, window) == pytest.approx(dense.mean())
    assert (softcap is not None) == (name == "all") == ("softcap" in kw)


def test_masked_keywords_give_the_masked_problem_on_the_cpu():
    # ringattn with the keywords equals the reference given the dense mask
    # as a bias (what torch math and SDPA compute with it)
    S, H, D = 96, 2, 16
    rng = np.random.default_rng(3)
    q, k, v = rt.random_qkv(rng, 1, S, S, H, 1, D, "float64", scale=3.0)
    ids, window, softcap = mask_spec("all", S)
    kw = mask_keywords(ids, window, softcap, 1, lambda x: x)
    out = ra.attention(q, k, v, causal=True, **kw)
    with np.errstate(divide="ignore"):
        bias = np.log(dense_mask(S, ids, window).astype(np.float64))[None]
    ref, _ = rt.ref_attention(q, k, v, bias=bias, softcap=softcap)
    rt.assert_close(out, ref, "float64")


def test_mask_spec_shapes_and_bad_name():
    ids, window, softcap = mask_spec("all", 16384)
    assert window == (4096, 0) and softcap == 30.0
    assert ids.dtype == np.int32 and ids.shape == (16384,)
    assert np.bincount(ids).tolist() == [2048] * 8
    assert mask_spec("causal", 10) == (None, None, None)
    with pytest.raises(ValueError, match="name: expected one of"):
        mask_spec("sliding", 10)


def row(case, fwd, bwd, sfwd=None, sbwd=None, S=1024, visible=0.5):
    r = {"case": case, "S": S, "visible": visible}
    for key, t in (("fwd_ra", fwd), ("bwd_ra", bwd), ("fwd_sdpa", sfwd), ("bwd_sdpa", sbwd)):
        r[key + "_ms"] = t
        r[key + "_tf"] = None if t is None else 100.0 / t
    return r


def test_masked_summary_is_each_case_over_plain_causal():
    rows = [row("causal", 10.0, 20.0, 9.0, 18.0), row("window", 2.5, 6.0),
            row("docs", 1.0, 4.0, 30.0, None)]
    assert masked_summary(rows) == "window 0.25/0.30, docs 0.10/0.20 of causal time (fwd/bwd)"
    assert masked_summary(rows[1:]) == "n/a"      # no causal row to divide by
    assert masked_summary(rows[:1]) == "n/a"


def test_masked_row_shows_dashes_where_sdpa_could_not_run():
    line = format_masked_row(row("docs", 1.0, 4.0, 30.0, None, S=16384, visible=0.0625))
    cells = line.split()
    assert cells[:3] == ["docs", "16384", "0.062"] or cells[:3] == ["docs", "16384", "0.063"]
    assert cells[3:7] == ["1.00", "4.00", "30.00", "-"]
    assert cells[7:] == ["100.0", "25.0", "3.3", "-"]


def test_accuracy_row_names_its_mask():
    errs = [("out", 1e-3, 1e-3, True), ("dq", 5e-2, 1e-3, False)]
    plain = format_accuracy_row({"dtype": "bfloat16", "D": 128, "causal": True,
                                 "errs": errs, "ok": False})
    masked = format_accuracy_row({"dtype": "bfloat16", "D": 128, "causal": True,
                                  "mask": "window+docs+softcap", "errs": errs, "ok": False})
    assert plain.startswith("FAIL bfloat16 D=128") and "dq 5.00e-02/1.00e-03 FAIL" in plain
    assert " window+docs+softcap  out" in masked
    assert masked.replace(" window+docs+softcap", "", 1) == plain


def test_accuracy_row_without_torch_math_shows_a_dash():
    errs = [("out", 1e-3, None, True), ("dq", 5e-2, None, False)]
    line = format_accuracy_row({"dtype": "float16", "D": 64, "causal": False,
                                "errs": errs, "ok": False})
    assert line.startswith("FAIL float16  D=64")
    assert "out 1.00e-03/-, dq 5.00e-02/- FAIL" in line


def test_speed_row_shows_the_model_next_to_the_measured_time():
    # bf16, D 128, S 4096, causal at the bench's shape: the H100 baseline
    # measured 1.26 ms forward (218 TFLOP/s); the model's time of fwd_tc as
    # built (kernel_counts.json: the baseline's kernel 1.30 ms, the 128-row
    # one 0.97 ms)
    pred = model_prediction("fwd", "bfloat16", 128, 4096, True, 4, 16)
    assert set(pred) == {"fwd_tc", "total"} and 0.6e-3 < pred["total"] < 1.6e-3
    r = {"pass": "fwd", "dtype": "bfloat16", "causal": True, "D": 128, "S": 4096, "B": 4,
         "H": 16, "family": "sm80", "ra": 218.0, "flash": 311.0, "cudnn": 577.0, "ms": 1.26,
         "model": pred}
    cells = format_speed_row(r).split()
    assert cells[7:13] == ["sm80", "218.0", "-", "311.0", "577.0", "0.70"]
    assert cells[13] == "1.26" and float(cells[14]) == pytest.approx(pred["total"] * 1e3, abs=0.01)
    assert float(cells[15]) == pytest.approx(1.26 / (pred["total"] * 1e3), abs=0.01)
    # without a prediction (no counts for the kernels) the model cells are dashes
    assert format_speed_row(dict(r, model=None)).split()[14:16] == ["-", "-"]


def test_speed_row_puts_the_two_forward_families_side_by_side():
    # the Hopper forward (fwd_wg: the model prices its SASS counts) in the
    # ringattn column, the mma.sync one of the same run in the sm80 column
    pred = model_prediction("fwd", "bfloat16", 128, 4096, True, 4, 16, "sm90a")
    assert set(pred) == {"fwd_wg", "total"}
    assert pred["total"] < model_prediction("fwd", "bfloat16", 128, 4096, True, 4, 16)["total"]
    r = {"pass": "fwd", "dtype": "bfloat16", "causal": True, "D": 128, "S": 4096, "B": 4,
         "H": 16, "family": "sm90a", "ra": 600.0, "sm80": 218.0, "flash": 311.0,
         "cudnn": 577.0, "ms": 0.46, "model": pred}
    cells = format_speed_row(r).split()
    assert cells[7:12] == ["sm90a", "600.0", "218.0", "311.0", "577.0"]


def test_model_rows_name_every_kernel_and_the_measured_over_model_ratio():
    # the backward the bench times: attention_backward's default, the fused
    # kernel with its dq conversion
    bwd = model_prediction("bwd", "float16", 64, 16384, False, 1, 32)
    assert set(bwd) == {"delta", "bwd_tc", "dq_convert", "total"}
    assert bwd["total"] == pytest.approx(bwd["delta"] + bwd["bwd_tc"] + bwd["dq_convert"])
    det = model.predict("bwd", "float16", 64, 16384, False, 1, 32, deterministic=True)
    assert set(det) == {"delta", "dkdv_tc", "dq_tc", "total"}
    assert det["total"] == pytest.approx(det["delta"] + det["dkdv_tc"] + det["dq_tc"])
    # on the sm90a family: the wgmma kernel, and deterministic its dk/dv
    # pass and the wgmma dq pass
    wg = model_prediction("bwd", "float16", 64, 16384, False, 1, 32, "sm90a")
    assert set(wg) == {"delta", "bwd_wg", "dq_convert", "total"}
    det = model.predict("bwd", "float16", 64, 16384, False, 1, 32, deterministic=True,
                        family="sm90a")
    assert set(det) == {"delta", "dkdv_wg", "dq_wg", "total"}
    assert det["total"] == pytest.approx(det["delta"] + det["dkdv_wg"] + det["dq_wg"])
    rows = [{"pass": "bwd", "dtype": "float16", "causal": False, "D": 64, "S": 16384,
             "ms": 2e3 * bwd["total"], "model": bwd},
            {"pass": "fwd", "dtype": "float16", "causal": False, "D": 64, "S": 16384,
             "ms": None, "model": None}]
    lines = format_model_rows(rows)
    assert len(lines) == 2 and lines[0].startswith("model bwd  float16")
    assert all(k in lines[0] for k in ("delta", "bwd_tc", "dq_convert", "measured"))
    assert lines[1].startswith("measured/model: median 2.00")
    # a backward row's deterministic pass: its own line, out of the median
    rows[0].update(det_ms=5e3 * det["total"], det_model=det)
    lines = format_model_rows(rows)
    assert len(lines) == 3 and lines[1].startswith("model det  float16")
    assert all(k in lines[1] for k in ("dkdv_wg", "dq_wg", "measured"))
    assert lines[2].startswith("measured/model: median 2.00")
    # and its TFLOP/s last on the speed row ("-" on a forward row)
    r = {"pass": "bwd", "dtype": "float16", "causal": False, "D": 64, "S": 16384, "B": 1,
         "H": 32, "family": "sm90a", "ra": 500.0, "sm80": 150.0, "flash": 300.0,
         "cudnn": 450.0, "ms": 1.0, "model": wg, "det": 420.0}
    assert format_speed_row(r).split()[16] == "420.0"
    assert format_speed_row(dict(r, det=None)).split()[16] == "-"


BASELINE_COUNTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "tools", "h100_baseline_counts.json")


@pytest.mark.skipif(not os.path.exists(BASELINE_COUNTS), reason="no tools/ in this tree")
def test_model_follows_the_work_and_the_occupancy_the_profile_saw():
    # Nsight Compute: 2 blocks per SM for all three kernels at D 128 (the
    # measured build, whose counts tools/ keeps)
    base = model.load_counts(BASELINE_COUNTS)
    for name in ("fwd_tc", "dkdv_tc", "dq_tc"):
        rec = base[f"{name}<bf16,128,->"]
        smem = rec["dynamic_smem"]
        assert model.occupancy(rec["registers"], smem, 32 * rec["warps"]) == 2
    counts = model.load_counts()
    # the fused backward (8 warps, 162 KB) fits one block per SM
    rec = counts["bwd_tc<bf16,128,->"]
    assert model.occupancy(rec["registers"], rec["dynamic_smem"], 32 * rec["warps"]) == 1
    full = model.predict("fwd", "bf16", 128, 16384, False, 1, 16, counts=counts)["total"]
    causal = model.predict("fwd", "bf16", 128, 16384, True, 1, 16, counts=counts)["total"]
    quarter = model.predict("fwd", "bf16", 128, 8192, False, 1, 16, counts=counts)["total"]
    assert 0.45 < causal / full < 0.6 and 0.22 < quarter / full < 0.3
    # the list schedule: 5 blocks of 1 tile on 2 slots take 3 rounds
    assert model.makespan([1] * 5, 2, 100.0, overhead=0) == 300.0


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_bench_gpu_quick_runs_on_this_gpu():
    """``ringattn bench --gpu --quick`` (one sequence length) runs to its
    summary line with every accuracy row passing; without PyTorch it says
    that the SDPA columns are skipped, on the emulated GPU that its sizes
    are tiny and its times are not a GPU's."""
    info = ra.cuda_info()
    emulated = bool(info.get("emulated"))
    try:
        import torch
        have_torch = torch.cuda.is_available()
    except ImportError:
        have_torch = False
    package = os.path.dirname(os.path.dirname(os.path.abspath(ra.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [package] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    seq = "128" if emulated else "1024"
    proc = subprocess.run([sys.executable, "-m", "ringattn", "bench", "--gpu", "--quick",
                           "--seq-lens", seq], capture_output=True, text=True,
                          timeout=580, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out
    summary = [line for line in proc.stdout.splitlines() if line.startswith("bench-gpu:")]
    assert len(summary) == 1 and "accuracy PASS (10/10)" in summary[0], out
    lines = proc.stdout.splitlines()
    speed = [line for line in lines if line.split()[:1] in (["fwd"], ["bwd"])]
    assert len(speed) == 16, out        # 2 dtypes x D 64, 128 x causal or not x 2 passes
    masked = [line for line in lines if line.split()[:2] in
              (["causal", seq], ["window", seq], ["docs", seq])]
    assert len(masked) == 3, out
    # the kernel family of every row; where it is sm90a, the mma.sync
    # kernels timed beside it
    family = info["forward_kernels"]
    assert info["backward_kernels"] == family
    assert all(line.split()[7] == family for line in speed), out
    assert all((line.split()[9] != "-") == (family == "sm90a") for line in speed), out
    # the model's prediction next to every ringattn time, and per kernel
    assert all(float(line.split()[14]) > 0 for line in speed), out
    per_kernel = [line for line in lines if line.startswith("model ")]
    fwd_kernel = "fwd_wg" if family == "sm90a" else "fwd_tc"
    bwd_kernel = "bwd_wg" if family == "sm90a" else "bwd_tc"
    assert len(per_kernel) == 24 and all(
        (fwd_kernel in line) == (line.split()[1] == "fwd") and
        (bwd_kernel in line) == (line.split()[1] == "bwd") for line in per_kernel), out
    # deterministic=True timed beside every backward row, with its kernels
    det_kernels = ("dkdv_wg", "dq_wg") if family == "sm90a" else ("dkdv_tc", "dq_tc")
    assert all((line.split()[16] != "-") == (line.split()[0] == "bwd") for line in speed), out
    dets = [line for line in per_kernel if line.split()[1] == "det"]
    assert len(dets) == 8 and all(all(k in line for k in det_kernels) and "measured" in line
                                  for line in dets), out
    assert sum(line.startswith("measured/model: median") for line in lines) == 1, out
    if not have_torch:
        assert "no PyTorch: SDPA columns skipped" in summary[0], out
        assert all(line.split()[10:12] == ["-", "-"] for line in speed), out
    if emulated:
        assert "EMULATED GPU" in summary[0], out
