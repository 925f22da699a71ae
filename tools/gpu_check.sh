#!/usr/bin/env bash
# gpu_check.sh -- the one command a GPU session runs: build and install
# ringattn with CUDA, run the GPU tests, run compute-sanitizer (memcheck and
# racecheck) on a small grid with the caching allocator off, then the kernel
# benchmark.  Logs go to $OUT (or ./gpu_check_logs).  Exit status is non-zero
# if any stage failed; every stage runs regardless.
set -u
cd "$(dirname "$0")/.."
LOG="${OUT:-$PWD/gpu_check_logs}"
mkdir -p "$LOG"
status=0
stage() {  # stage NAME CMD...: run, tee the log, remember failures
    local name="$1"; shift
    echo "=== $name: $*" | tee "$LOG/$name.log"
    local t0=$SECONDS
    "$@" >>"$LOG/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG/$name.log"
    tail -n 25 "$LOG/$name.log"
    [ $rc -eq 0 ] || status=1
    return $rc
}

nvidia-smi >"$LOG/nvidia-smi.log" 2>&1 || true
export RINGATTN_CUDA=1

# 1. the kernels alone, against a float64 CPU reference (no Python layer)
NVCC="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
SELF="$LOG/selftest_build"; mkdir -p "$SELF"
build_selftest() {
    local flags="-O3 -std=c++17 -Xcompiler -fPIC --expt-relaxed-constexpr -Icsrc -Icuda -DRA_WITH_CUDA -arch=native"
    ls cuda/*.cu | xargs -P 8 -I{} sh -c "$NVCC $flags -c {} -o $SELF/\$(basename {} .cu).o" &&
    gcc -c -O2 -std=gnu11 -Icsrc csrc/core/status.c -o "$SELF/status_c.o" &&
    $NVCC $flags tools/cuda_selftest.cu "$SELF"/*.o -o "$SELF/selftest"
}
stage selftest_build build_selftest
stage selftest "$SELF/selftest"
# 2. the package and its GPU tests
stage build python -m pip install --no-build-isolation -v . || { echo "build failed"; exit 1; }
# run the tests from outside the source tree so the installed package is used
stage tests bash -c "cd /tmp && python -m pytest -x -q -m gpu '$PWD/tests/test_cuda.py' -p no:cacheprovider"

cat >"$LOG/sanitize_case.py" <<'PY'
import numpy as np, ringattn as ra, torch
rng = np.random.default_rng(0)
for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
    for D in (8, 64, 128, 200):
        for causal in (False, True):
            q = torch.tensor(rng.standard_normal((2, 77, 4, D)), device="cuda", dtype=dt)
            k = torch.tensor(rng.standard_normal((2, 130, 2, D)), device="cuda", dtype=dt)
            v = torch.tensor(rng.standard_normal((2, 130, 2, D)), device="cuda", dtype=dt)
            out, lse = ra.attention(q, k, v, causal=causal, return_lse=True)
            dq, dk, dv = ra.attention_backward(torch.ones_like(out), q, k, v, out, lse, causal=causal)
            o1, l1 = ra.attention(q, k[:, :60], v[:, :60], return_lse=True)
            o2, l2 = ra.attention(q, k[:, 60:], v[:, 60:], return_lse=True)
            ra.merge(o1, l1, o2, l2)
torch.cuda.synchronize()
print("sanitize case done")
PY
SAN=compute-sanitizer
command -v $SAN >/dev/null || SAN=/usr/local/cuda/bin/compute-sanitizer
for tool in memcheck racecheck; do
    RINGATTN_CUDA_CACHING=0 stage "sanitizer_$tool" \
        $SAN --tool $tool --error-exitcode 9 python "$LOG/sanitize_case.py"
done
RINGATTN_CUDA_CACHING=0 stage sanitizer_synccheck \
    $SAN --tool synccheck --error-exitcode 9 python "$LOG/sanitize_case.py"
# the quick grid covers the tensor-core backward (bf16/fp16, D 64/128, causal,
# GQA, empty rows, accumulate); synccheck/initcheck for its barriers and reads
for tool in memcheck racecheck synccheck initcheck; do
    stage "sanitizer_selftest_$tool" $SAN --tool $tool --error-exitcode 9 "$SELF/selftest" quick
done

stage bench python -c "import ringattn.bench_gpu as b; open('$LOG/bench_table.txt','w').write(b.run())"
# ---------------------------------------------------------------------------
# NCCL backend (comm_nccl.c): world size 1 through the whole ring path, then,
# where NCCL >= 2.30 lets several ranks share the one GPU
# (NCCL_MULTI_RANK_GPU_ENABLE=1), 2-4 ranks forward+backward vs the float64
# reference for every layout and causal, a silent peer and a killed rank.
# (Kept before the summary below so that it runs.)
stage nccl_version python -c "import ringattn as ra; print(ra.nccl_version())"
stage nccl_world1 bash -c "cd /tmp && python -m pytest -q -m gpu -p no:cacheprovider '$PWD/tests/test_nccl.py' -k 'not test_ring_matches_reference and not explicit_unique_id and not silent_peer and not killed_rank'"
if python -c "import ringattn as ra, sys; v = ra.nccl_version(); sys.exit(0 if v is not None and v >= (2, 30, 0) else 1)"; then
    NCCL_MULTI_RANK_GPU_ENABLE=1 stage nccl_multirank bash -c "cd /tmp && python -m pytest -q -m gpu -p no:cacheprovider '$PWD/tests/test_nccl.py' -k 'test_ring_matches_reference or explicit_unique_id or silent_peer or killed_rank'"
else
    echo "=== nccl_multirank: skipped (NCCL < 2.30 cannot put several ranks on one GPU)" | tee "$LOG/nccl_multirank.log"
fi
# ---------------------------------------------------------------------------

echo "logs in $LOG; overall status $status"
exit $status
