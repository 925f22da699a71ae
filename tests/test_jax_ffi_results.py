"""Every ringattn XLA FFI handler checks its results' shapes (and the
positions of a ring block: inside +-2^60, so no position arithmetic of a
kernel overflows int64) before any work: each result must have exactly the call's leading (vmap) dims -- no
broadcast 1s, since the kernels write one value per leading index -- and
exactly the shape the operands give it.  A wrong result shape is an XLA
error naming the result, never a write past its buffer (a crash) or a
silently wrong answer (gradients of a vmapped batch overwriting each
other in a shared dk).

The targets are called directly with ``jax.ffi.ffi_call`` in a subprocess
(tests/ffi_call_worker.py), so a crash fails these tests instead of
killing pytest.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "ffi_call_worker.py")

N = 4                                  # the vmap (leading) dim
ROWS = [1, 8, 2, 4]                    # (B, S, H, D) of q, k, v, out, ...
BHS = [1, 2, 8]                        # (B, H, S) of lse, delta
F32 = "float32"
DILATED = {"segment_lengths": [4], "dilation_rates": [1]}


def _rows(lead=(N,), dtype=F32):
    return [list(lead) + ROWS, dtype]


def _bhs(lead=(N,), dtype=F32, core=BHS):
    return [list(lead) + core, dtype]


def _case(name, target, args, results, expect, aliases=None, attrs=None):
    return dict(name=name, target=target, args=args, results=results,
                expect=expect, aliases=aliases or {}, attrs=attrs or {})


QKV = [_rows()] * 3
BWD_IN = [_rows()] * 4 + [_bhs()] * 2          # dout, q, k, v, lse, delta

CASES = [
    # forward: lse without the leading dims, or with a 1 in their place
    _case("fwd-lse-no-lead", "ringattn_attn_fwd", QKV,
          [_rows(), _bhs(lead=())], "ringattn_attn_fwd: lse:"),
    _case("fwd-lse-lead-1", "ringattn_attn_fwd", QKV,
          [_rows(), _bhs(lead=(1,))], "ringattn_attn_fwd: lse:"),
    _case("fwd-out-lead-1", "ringattn_attn_fwd", QKV,
          [_rows(lead=(1,)), _bhs()], "ringattn_attn_fwd: out:"),
    _case("fwd-lse-trailing", "ringattn_attn_fwd", QKV,
          [_rows(), _bhs(core=[1, 2, 7])], "ringattn_attn_fwd: lse:"),
    # the ring's block forward: a running state shared by the batch
    _case("fwd-acc-lse-lead-1", "ringattn_attn_fwd_acc",
          QKV + [_rows(), _bhs(lead=(1,))], [_rows(), _bhs(lead=(1,))],
          "ringattn_attn_fwd_acc: lse:", aliases={3: 0, 4: 1}),
    _case("dilated-fwd-lse-lead-1", "ringattn_dilated_fwd", QKV,
          [_rows(), _bhs(lead=(1,))], "ringattn_dilated_fwd: lse:",
          attrs=DILATED),
    _case("merge-lse-no-lead", "ringattn_merge",
          [_rows(), _bhs(), _rows(), _bhs()], [_rows(), _bhs(lead=())],
          "ringattn_merge: lse:"),
    _case("merge-lse-lead-1", "ringattn_merge",
          [_rows(), _bhs(), _rows(), _bhs()], [_rows(), _bhs(lead=(1,))],
          "ringattn_merge: lse:"),
    _case("merge-out-trailing", "ringattn_merge",
          [_rows(), _bhs(), _rows(), _bhs()],
          [[[N, 1, 8, 2, 5], F32], _bhs()], "ringattn_merge: out:"),
    _case("bwd-pre-delta-lead-1", "ringattn_attn_bwd_pre", [_rows()] * 2,
          [_bhs(lead=(1,))], "ringattn_attn_bwd_pre: delta:"),
    # backward: one dk / dv for the whole batch would be overwritten by
    # every leading index in turn
    _case("bwd-dk-lead-1", "ringattn_attn_bwd", BWD_IN,
          [_rows(), _rows(lead=(1,)), _rows(lead=(1,))],
          "ringattn_attn_bwd: dk:"),
    _case("bwd-dq-lead-1", "ringattn_attn_bwd", BWD_IN,
          [_rows(lead=(1,)), _rows(), _rows()], "ringattn_attn_bwd: dq:"),
    _case("bwd-acc-dv-lead-1", "ringattn_attn_bwd_acc",
          BWD_IN + [_rows(), _rows(), _rows(lead=(1,))],
          [_rows(), _rows(), _rows(lead=(1,))], "ringattn_attn_bwd_acc: dv:",
          aliases={6: 0, 7: 1, 8: 2}),
    _case("dilated-bwd-dk-lead-1", "ringattn_dilated_bwd", BWD_IN,
          [_rows(), _rows(lead=(1,)), _rows()], "ringattn_dilated_bwd: dk:",
          attrs=DILATED),
    # wrong dtypes and wrong core dims, with and without vmap dims
    _case("fwd-lse-dtype", "ringattn_attn_fwd", QKV,
          [_rows(), _bhs(dtype="float64")], "ringattn_attn_fwd: lse:"),
    _case("fwd-out-int", "ringattn_attn_fwd", QKV,
          [_rows(dtype="int32"), _bhs()], "ringattn_attn_fwd: out:"),
    _case("fwd-unbatched-lse-batch", "ringattn_attn_fwd",
          [_rows(lead=())] * 3, [_rows(lead=()), [[2, 2, 8], F32]],
          "ringattn_attn_fwd: lse:"),
    _case("fwd-unbatched-out-heads", "ringattn_attn_fwd",
          [_rows(lead=())] * 3, [[[1, 8, 3, 4], F32], _bhs(lead=())],
          "ringattn_attn_fwd: out:"),
    _case("fwd-acc-out-trailing", "ringattn_attn_fwd_acc",
          QKV + [[[N, 1, 8, 2, 5], F32], _bhs()],
          [[[N, 1, 8, 2, 5], F32], _bhs()], "ringattn_attn_fwd_acc:",
          aliases={3: 0, 4: 1}),
    _case("merge-lse-dtype", "ringattn_merge",
          [_rows(), _bhs(), _rows(), _bhs()], [_rows(), _bhs(dtype="float64")],
          "ringattn_merge: lse:"),
    _case("bwd-pre-delta-dtype", "ringattn_attn_bwd_pre", [_rows()] * 2,
          [_bhs(dtype="float64")], "ringattn_attn_bwd_pre: delta:"),
    _case("bwd-pre-delta-seq", "ringattn_attn_bwd_pre", [_rows()] * 2,
          [_bhs(core=[1, 2, 9])], "ringattn_attn_bwd_pre: delta:"),
    _case("bwd-dv-dtype", "ringattn_attn_bwd", BWD_IN,
          [_rows(), _rows(), _rows(dtype="float64")], "ringattn_attn_bwd: dv:"),
    _case("bwd-dk-seq", "ringattn_attn_bwd", BWD_IN,
          [_rows(), [[N, 1, 9, 2, 4], F32], _rows()],
          "ringattn_attn_bwd: dk:"),
    _case("dilated-bwd-dv-trailing", "ringattn_dilated_bwd", BWD_IN,
          [_rows(), _rows(), [[N, 1, 8, 2, 5], F32]],
          "ringattn_dilated_bwd: dv:", attrs=DILATED),
]

# a ring block's position table (rows length, start, stride; q_pieces of
# them for q, then k's) whose positions could leave +-2^60, where the
# kernels' position arithmetic would overflow int64
def _positions(q_row, k_row=(8, 0, 1)):
    return [[2, 3], "int64", [list(q_row), list(k_row)]]


POS_BAD = [
    ("pos-start-at-bound", (8, 2 ** 60, 1), (8, 0, 1)),
    ("pos-start-below-bound", (8, -(2 ** 60), 1), (8, 0, 1)),
    ("pos-start-plus-rows", (8, 2 ** 60 - 4, 1), (8, 0, 1)),
    ("pos-stride-times-rows", (8, 0, 2 ** 58), (8, 0, 1)),
    ("pos-stride-overflows-int64", (8, 0, 2 ** 62), (8, 0, 1)),
    ("pos-start-int64-min", (8, -(2 ** 63), 1), (8, 0, 1)),
    ("pos-k-start", (8, 0, 1), (8, 2 ** 62, 1)),
    ("pos-k-stride-zero", (8, 0, 1), (8, 0, 0)),
]
UNBATCHED = [_rows(lead=())] * 3
for _name, _q, _k in POS_BAD:
    _piece = "k piece 0" if _name.startswith("pos-k") else "q piece 0"
    CASES.append(_case(_name, "ringattn_attn_fwd", UNBATCHED + [_positions(_q, _k)],
                       [_rows(lead=()), _bhs(lead=())],
                       f"ringattn_attn_fwd: positions[{_piece}]",
                       attrs={"q_pieces": 1, "causal": True}))
    CASES.append(_case(_name + "-bwd", "ringattn_attn_bwd",
                       [_rows(lead=())] * 4 + [_bhs(lead=())] * 2
                       + [_positions(_q, _k)], [_rows(lead=())] * 3,
                       f"ringattn_attn_bwd: positions[{_piece}]",
                       attrs={"q_pieces": 1, "causal": True}))

# num_threads: one rule for every target (and the C entry points): absent
# or 0 the default, else 1..4096
THREADS = "num_threads: expected 0 (the default"
CASES += [
    _case("threads-fwd-negative", "ringattn_attn_fwd", QKV, [_rows(), _bhs()],
          "ringattn_attn_fwd: " + THREADS, attrs={"num_threads": -1}),
    _case("threads-merge-negative", "ringattn_merge",
          [_rows(), _bhs(), _rows(), _bhs()], [_rows(), _bhs()],
          "ringattn_merge: " + THREADS, attrs={"num_threads": -1}),
    _case("threads-bwd-pre-too-many", "ringattn_attn_bwd_pre", [_rows()] * 2,
          [_bhs()], "ringattn_attn_bwd_pre: " + THREADS,
          attrs={"num_threads": 4097}),
    _case("threads-bwd-too-many", "ringattn_attn_bwd", BWD_IN, [_rows()] * 3,
          "ringattn_attn_bwd: " + THREADS, attrs={"num_threads": 2 ** 40}),
]

# the run-time range check of 64-bit segment ids (csrc/xla/ffi_ids.c):
# ids (..., B, S) int32 and a report (..., 4) in, the ids out
IDS = [[N, 1, 8], "int32"]
REPORT = [[N, 4], "int32"]
CHECK = "ringattn_ids_check: segment_ids: expected int32 ids, an int32 report"
CASES += [
    _case("ids-result-lead-1", "ringattn_ids_check", [IDS, REPORT],
          [[[1, 1, 8], "int32"]], CHECK),
    _case("ids-result-longer", "ringattn_ids_check", [IDS, REPORT],
          [[[N, 1, 9], "int32"]], CHECK),
    _case("ids-result-int64", "ringattn_ids_check", [IDS, REPORT],
          [[[N, 1, 8], "int64"]], CHECK),
    _case("ids-report-short", "ringattn_ids_check", [IDS, [[N, 3], "int32"]],
          [IDS], CHECK),
    _case("ids-report-lead-1", "ringattn_ids_check", [IDS, [[1, 4], "int32"]],
          [IDS], CHECK),
    # a report that counts values outside int32: refused, naming the first
    _case("ids-report-outside", "ringattn_ids_check",
          [IDS, [[N, 4], "int32", [0] * 12 + [2, 2, 0, 5]]], [IDS],
          "segment_ids: expected ids that fit in int32, got 2 outside it "
          "(the first at [0, 5])"),
    _case("ids-report-other-device", "ringattn_ids_check",
          [IDS, [[N, 4], "int32", [3, 0, 0, 0] + [0] * 12]], [IDS],
          "ringattn_ids_check: kv_segment_ids: expected ids that fit in int32, "
          "got 3 outside it on another device", attrs={"which": 1}),
]

# the same calls with good results succeed (the checks refuse only bad ones)
GOOD = [
    _case("ids-check-good", "ringattn_ids_check", [IDS, REPORT], [IDS], None,
          aliases={0: 0}),
    _case("ids-check-unaliased-good", "ringattn_ids_check", [IDS, REPORT], [IDS],
          None),
    _case("fwd-good", "ringattn_attn_fwd", QKV, [_rows(), _bhs()], None),
    _case("merge-good", "ringattn_merge", [_rows(), _bhs(), _rows(), _bhs()],
          [_rows(), _bhs()], None),
    _case("bwd-good", "ringattn_attn_bwd", BWD_IN, [_rows()] * 3, None),
    _case("fwd-unbatched-good", "ringattn_attn_fwd", [_rows(lead=())] * 3,
          [_rows(lead=()), _bhs(lead=())], None),
    # an operand shared by the batch (a 1 in its vmap dim) is fine
    _case("fwd-shared-k-good", "ringattn_attn_fwd",
          [_rows(), _rows(lead=(1,)), _rows(lead=(1,))], [_rows(), _bhs()],
          None),
    _case("bwd-pre-good", "ringattn_attn_bwd_pre", [_rows()] * 2, [_bhs()],
          None),
    _case("threads-merge-good", "ringattn_merge",
          [_rows(), _bhs(), _rows(), _bhs()], [_rows(), _bhs()], None,
          attrs={"num_threads": 2}),
    # positions just inside the bound run
    _case("pos-near-bound-good", "ringattn_attn_fwd",
          UNBATCHED + [_positions((8, 2 ** 60 - 9, 1), (8, 2 ** 60 - 9, 1))],
          [_rows(lead=()), _bhs(lead=())], None,
          attrs={"q_pieces": 1, "causal": True}),
    _case("pos-near-minus-bound-good", "ringattn_attn_fwd",
          UNBATCHED + [_positions((8, -(2 ** 60) + 9, 1), (8, 0, 1))],
          [_rows(lead=()), _bhs(lead=())], None,
          attrs={"q_pieces": 1, "causal": True}),
]


@pytest.fixture(scope="module")
def outcomes():
    """{case name: error message, None, or _Crash}.  After a crash the
    worker starts again with the cases after the one that crashed."""
    got, todo = {}, CASES + GOOD
    while todo:
        proc = subprocess.run([sys.executable, WORKER], input=json.dumps(todo),
                              capture_output=True, text=True, timeout=300)
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                got[row["name"]] = row["error"]
        done = [c for c in todo if c["name"] in got]
        todo = todo[len(done):]
        if todo:     # the worker died in todo[0]
            got[todo[0]["name"]] = _Crash(proc.returncode, proc.stderr[-2000:])
            todo = todo[1:]
    return got


class _Crash:
    def __init__(self, rc, stderr):
        self.rc, self.stderr = rc, stderr

    def __repr__(self):
        return f"the worker died (exit status {self.rc}):\n{self.stderr}"


def _outcome(outcomes, name):
    got = outcomes[name]
    assert not isinstance(got, _Crash), repr(got)
    return got


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_bad_result_shape_is_an_error_naming_the_result(outcomes, case):
    error = _outcome(outcomes, case["name"])
    assert error is not None and case["expect"] in error, error


@pytest.mark.parametrize("case", GOOD, ids=[c["name"] for c in GOOD])
def test_good_result_shapes_run(outcomes, case):
    assert _outcome(outcomes, case["name"]) is None
