#!/usr/bin/env bash
# gpu_check.sh -- ringattn's GPU bring-up kit, in ONE call of the device
# tool (timeout_s 600) on a machine of 16 cores with one GPU.  Run from
# anywhere; it works on the repository it lives in.
#
#   tools/gpu_check.sh all
#
# runs, estimated from the H100 run of 2026-11-26 (16 cores: build 45 s for
# sm_90, selftest full 21 s, tests 82 s, nccl 37 s, memcheck + racecheck
# 129 s, ringbench 16 s, bench 40 s) and what the stages gained since; no
# GPU run has timed this order yet:
#
#   1. build (sm_90a, more kernels)                                 ~1.25 min
#   2. the selftest binary, once (selftest and sanitize share it)   ~0.5 min
#   3. ptx, selftest, tests, sanitize, nccl, threadring, all at once
#      (each alone: ~0.5, ~0.75, ~2.5, ~4.5 one tool after another,
#      ~0.75, ~1 min; they share the GPU and the cores, sanitize runs its
#      four tools and the Python case at once too)                  ~3.5 min
#   4. bench, then ringbench, alone on the GPU                      ~1.75 min
#                                                    about 7 minutes in all
#
# Any subset reruns alone, e.g. "tools/gpu_check.sh sanitize" (it builds
# first when no installed build of these sources is there);
# GPU_CHECK_SERIAL=1 runs the stages (and the sanitizer's tools) one after
# the other as given (for debugging; "all" then takes ~13 minutes: more than
# one call).
#
# Stages (any subset, run in the phases above whatever order is given;
# "all" = every stage):
#   build      pip install --no-build-isolation --no-deps . with the CUDA
#              part (RINGATTN_CUDA=1, RINGATTN_CUDA_ARCHS, default 90a: the
#              wgmma/TMA kernels and, forced per call, the mma.sync ones), only
#              when no installed CUDA build of these sources is there (the
#              installed package is imported from outside the tree); REBUILD=1
#              forces it.  Stages that need the package build it first.
#   ptx        tools/ptx_conformance.cu, built with nvcc for sm_90a (needs no
#              package): every PTX instruction the emulated GPU models, on
#              fixed inputs, its digests compared with the emulator's
#              (tools/ptx_conformance.expected); a difference names the
#              instruction whose emulated model is wrong
#   selftest   tools/cuda_selftest.cu, every kernel variant vs float64
#              ("full" grid; both tensor-core families on an sm_90a build);
#              linked with the build's CUDA objects
#   tests      pytest -m gpu tests/test_cuda.py tests/test_cuda_fwd_tc.py
#              tests/test_cuda_families.py tests/test_cuda_bwd_wg.py
#              tests/test_cuda_interop.py
#              tests/test_cuda_lifetime.py tests/test_cuda_dilated.py
#              tests/test_cuda_branches.py tests/test_jax_ffi_gpu.py (the
#              XLA FFI CUDA handlers: they skip, with the reason shown, where
#              JAX there has no CUDA); then the races of borrowed arrays
#              with PyTorch tensors, each test 20 times in a row
#              (--repeat 20): the 9 "docs" cases of test_cuda.py's
#              test_masked_ring_steps_accumulate (summary line
#              "repeat-docs") and test_cuda_lifetime.py's PyTorch tests
#              ("repeat-lifetime"); they fail where PyTorch sees no GPU
#   sanitize   compute-sanitizer memcheck, racecheck, synccheck, initcheck
#              on "selftest quick", and memcheck on tools/sanitize_case.py,
#              all five at once, limited to ringattn's kernels; first a canary
#              (tools/sanitizer_canary.cu) the filtered memcheck must catch
#   nccl       pytest -m gpu tests/test_nccl.py (world size 1; 2-4 ranks on
#              one GPU where NCCL >= 2.30; masks; ringattn demo --backend
#              nccl; a silent and a killed peer)
#   threadring pytest -m gpu tests/test_threads_cuda.py: the ring on thread
#              ranks sharing GPU 0 (p = 2, 4, 8; masks; Ulysses u = 2) against
#              one rank, n = 8192 bfloat16; the ring, Ulysses, alltoall/split,
#              a raising and a stalling rank, and examples/ring_threads_gpu.py
#              at a small size, on thread ranks without NCCL
#   bench      ringattn bench --gpu (TFLOP/s next to SDPA flash/cuDNN, and
#              accuracy by flash-attention's rule)
#   ringbench  ringattn bench --ring --gpu (the NCCL ring, p = 1..4, and
#              thread ranks, p = 2, 4, 8; RINGBENCH_SEQ_LEN sets --seq-len)
#   profile    not in "all" (it would not fit one call): Nsight Compute
#              (ncu --clock-control none) on every wgmma kernel of
#              tools/profile_case.py (bf16, B 1, H 16, S 8192 or
#              PROFILE_SEQ_LEN; forward, both backwards, D 64/128, causal
#              and not, a window and documents), its sections and the
#              PROFILE_METRICS this ncu knows; tools/profile_report.py
#              tabulates each launch next to the model's prediction
#              (profile_report.log, the report profile.ncu-rep)
#
# What it prints: "== <stage> ..." as a stage starts and, for a stage that
# failed, the tail of its log (a stage of phase 3 writes to
# $LOGDIR/<stage>.out, shown in stage order as each one ends); the last
# lines are one "SUMMARY <stage>: PASS|FAIL ..." line per stage (counts and
# key numbers), in stage order.  Every log (and
# the junit XML of the pytest stages) is written under $GPU_CHECK_WORK
# (default /tmp/ringattn-gpu-check, outside $OUT and the tree) and packed
# at exit into ONE archive, $OUT/gpu_check-<stages>.tar.gz (or under the
# work folder when OUT is unset).  A stage without a GPU, or in which no
# GPU test ran, FAILS.  The whole run keeps inside GPU_CHECK_BUDGET seconds
# (default 570): a stage gets at most what is left, so the archive and the
# summary are always written before the device tool's 600 s limit.  The
# stages of phase 3 get what is left less GPU_CHECK_RESERVE (default 90 s
# for bench plus 60 s for ringbench, when asked for); one still running
# then is killed and reported FAIL "timed out", as is any command cut by
# the budget.
#
# Environment: PYTHON (default python3: the interpreter with torch there),
# RINGATTN_CUDA_ARCHS (default 90a), REBUILD=1, GPU_CHECK_WORK,
# GPU_CHECK_BUDGET, GPU_CHECK_RESERVE, GPU_CHECK_SERIAL, SANITIZE_TOOLS (default "memcheck racecheck synccheck
# initcheck"; a subset reruns one that ran out of time), RINGBENCH_SEQ_LEN
# (the ringbench stage's --seq-len), CUDA_HOME.
# Exit status: 0 when every stage passed.
set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WORK="${GPU_CHECK_WORK:-/tmp/ringattn-gpu-check}"
BUDGET="${GPU_CHECK_BUDGET:-570}"
ARCHS="${RINGATTN_CUDA_ARCHS:-90a}"
export RINGATTN_CUDA_ARCHS="$ARCHS" PYTHONUNBUFFERED=1
START=$SECONDS
ALL_STAGES="build ptx selftest tests sanitize nccl threadring bench ringbench"
# ringattn's kernels only, by either name the sanitizer may match: the
# mangled one (nvcc names a kernel of an anonymous namespace after its
# source file: _GLOBAL__N__<hash>_<n>_attn_fwd_simt_cu_...) or the
# demangled one ("(anonymous namespace)::fwd_simt_kernel<...>(...)").
# tests/test_gpu_kit.py keeps both lists complete; the sanitize stage's
# canary (tools/sanitizer_canary.cu) proves the filter matches a kernel.
KERNEL_FILES='attn_[a-z_]+|merge|copy|sanitizer_canary'
KERNEL_NAMES='bwd_tc|bwd_wg|copy|delta|dilated_ids|dkdv_simt|dkdv_tc|dkdv_wg|dq_convert|dq_simt|dq_tc|dq_wg|fill_state|fwd_simt|fwd_tc|fwd_wg|merge|sanitizer_canary'
KERNEL_FILTER="regex=(_GLOBAL__N__[0-9a-f]+_[0-9]+_($KERNEL_FILES)_cu_|($KERNEL_NAMES)_kernel)"

case "$PY" in
    */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;;
esac

usage() {
    sed -n '2,/^set -u/p' "$0" | sed 's/^# \{0,1\}//; /^set -u/d'
    exit 2
}

STAGES=()
for a in "$@"; do
    case "$a" in
        all) read -r -a STAGES <<<"$ALL_STAGES" ;;
        build | ptx | selftest | tests | sanitize | nccl | threadring | bench | ringbench | profile) STAGES+=("$a") ;;
        -h | --help) usage ;;
        *) echo "gpu_check.sh: unknown stage '$a' (stages: $ALL_STAGES, all)" >&2; exit 2 ;;
    esac
done
[ ${#STAGES[@]} -gt 0 ] || usage

RUN_ID="$(date +%Y%m%d-%H%M%S)-$$"
LOGDIR="$WORK/logs/$RUN_ID"
mkdir -p "$LOGDIR" || exit 2
NAME="gpu_check-$(IFS=-; echo "${STAGES[*]}")"
ARCHIVE="${OUT:-$WORK}/$NAME.tar.gz"
declare -A RESULT=()        # stage -> "PASS ..." / "FAIL ..."
ORDER=()                    # stages in the order they ran

note() { echo "$*" | tee -a "$LOGDIR/gpu_check.log"; }

set_result() {  # set_result STAGE "VERDICT DETAILS"
    [ -n "${RESULT[$1]:-}" ] || ORDER+=("$1")
    RESULT[$1]="${2//$'\n'/ }"
    # a stage running in the background also writes it to its results
    # file, which the main shell reads back (stage_bg, collect_stage)
    [ -z "${STAGE_RESULTS:-}" ] || printf '%s\t%s\n' "$1" "${RESULT[$1]}" >>"$STAGE_RESULTS"
}

record() {  # record STAGE VERDICT DETAILS...
    local stage="$1" verdict="$2"; shift 2
    set_result "$stage" "$verdict $*"
}

# Seconds left in the budget, less RESERVE: what the timing stages (bench,
# ringbench) keep for themselves while the correctness stages run.
RESERVE=0
left() { echo $((BUDGET - RESERVE - (SECONDS - START))); }

# run_logged NAME LIMIT CMD...: run CMD (cwd: the work folder, so Python
# imports the installed ringattn) with output to $LOGDIR/NAME.log, killed
# after LIMIT seconds or when the budget runs out; returns its status
# (124 on timeout).
run_logged() {
    local name="$1" limit="$2"; shift 2
    local budget=$(( $(left) - 20 ))
    [ "$budget" -lt "$limit" ] && limit=$budget
    if [ "$limit" -le 5 ]; then
        echo "no time left in the ${BUDGET} s budget" >>"$LOGDIR/$name.log"
        return 124
    fi
    echo "\$ $* (limit ${limit} s)" >>"$LOGDIR/$name.log"
    (cd "$WORK" && timeout --signal=TERM --kill-after=10 "$limit" "$@") >>"$LOGDIR/$name.log" 2>&1
}

show_tail() {  # the end of a log on stdout (the device tool returns 12 KB)
    echo "---- last lines of $1.log ----"
    tail -n "${2:-25}" "$LOGDIR/$1.log" 2>/dev/null | cut -c1-300
    echo "----"
}

py() { (cd "$WORK" && "$PY" "$@"); }

cuda_reason() {  # empty when the installed ringattn sees a usable GPU
    py -c 'import ringattn as ra
print("" if ra.cuda_available() else "no GPU: " + ra.cuda_info()["reason"])' 2>&1 | tail -n 1
}

# gpu_tool STAGE NAME: TOOL set to the toolkit program NAME (PATH,
# $CUDA_HOME/bin, /usr/local/cuda/bin) when it is there and the installed
# ringattn sees a GPU; else STAGE's FAIL recorded and status 1.
gpu_tool() {
    local stage="$1" name="$2" why
    TOOL="$(command -v "$name" || true)"
    [ -n "$TOOL" ] || TOOL="${CUDA_HOME:-/usr/local/cuda}/bin/$name"
    if [ ! -x "$TOOL" ]; then
        record "$stage" FAIL "no $name (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin)"
        return 1
    fi
    why="$(cuda_reason)"
    if [ -n "$why" ]; then
        record "$stage" FAIL "$why"
        return 1
    fi
}

source_hash() {  # what the installed package is built from, and for which archs
    { (cd "$REPO" && find setup.py pyproject.toml csrc cuda ringattn -type f \
        ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum); echo "archs $ARCHS"; } |
        sha256sum | cut -c1-16
}

# ---- stages ------------------------------------------------------------------

stage_build() {
    local hash have
    hash="$(source_hash)"
    have="$(py -c 'import ringattn as ra; print(ra.cuda_info()["built"])' 2>/dev/null)"
    if [ "${REBUILD:-0}" != 1 ] && [ "$have" = True ] &&
        { [ ! -f "$WORK/build.hash" ] || [ "$(cat "$WORK/build.hash")" = "$hash" ]; }; then
        record build PASS "installed CUDA build already there (no rebuild)"
        return 0
    fi
    note "== build: pip install --no-build-isolation (RINGATTN_CUDA=1, archs $ARCHS, $(nproc) jobs; ~1.25 min)"
    local t0=$SECONDS
    run_logged build 420 env -C "$REPO" RINGATTN_CUDA=1 RINGATTN_BUILD_JOBS="$(nproc)" \
        "$PY" -m pip install --no-build-isolation --no-deps --no-index \
        --disable-pip-version-check --no-cache-dir -v .
    local rc=$?
    local info
    info="$(py -c 'import ringattn as ra
i = ra.cuda_info()
print("built=%s available=%s devices=%s nccl=%s forward_kernels=%s"
      % (i["built"], i["available"], i["devices"], ra.nccl_version(),
         i.get("forward_kernels")))' 2>&1 | tail -n 1)"
    echo "installed: $info" >>"$LOGDIR/build.log"
    if [ $rc -eq 0 ] && [[ "$info" == built=True* ]]; then
        echo "$hash" >"$WORK/build.hash"
        record build PASS "$((SECONDS - t0)) s; $info"
    else
        [ $rc -eq 124 ] && info="timed out; $info"
        record build FAIL "rc=$rc; $info"
        show_tail build 40
        return 1
    fi
}

need_build() {  # build first unless this run built or checked already
    [ -n "${RESULT[build]:-}" ] || stage_build
    [[ "${RESULT[build]}" == PASS* ]]
}

nvcc_path() {  # the toolkit's nvcc ($CUDA_HOME, /usr/local/cuda, PATH)
    local nvcc="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
    [ -x "$nvcc" ] || nvcc="$(command -v nvcc)"
    echo "$nvcc"
}

# The selftest binary, linked with the CUDA objects the build made (or
# compiled here when there are none); rebuilt when its sources changed.
selftest_binary() {
    local dir="$WORK/selftest" arch="${ARCHS%%[;, ]*}"
    arch="${arch#sm_}"
    local hash
    hash="$( (cd "$REPO" && find tools/cuda_selftest.cu tools/cuda_selftest_ref.h csrc cuda \
        -type f \( -name '*.h' -o -name '*.cuh' -o -name '*.cu' -o -name 'status.c' \) \
        -print0 | sort -z | xargs -0 cat) | sha256sum | cut -c1-16)-$arch"
    if [ -x "$dir/selftest" ] && [ "$(cat "$dir/hash" 2>/dev/null)" = "$hash" ]; then
        echo "$dir/selftest"
        return 0
    fi
    mkdir -p "$dir/obj"
    local nvcc
    nvcc="$(nvcc_path)"
    local flags=(-O3 -std=c++17 -Xcompiler -fPIC --expt-relaxed-constexpr -DRA_WITH_CUDA
                 -I"$REPO/csrc" -I"$REPO/cuda" -gencode "arch=compute_$arch,code=sm_$arch")
    # an sm_90a build has the wgmma/TMA kernels (as setup.py says to cuda/attn_family.cu)
    [ "$arch" = 90a ] && flags+=(-DRA_CUDA_SM90A)
    local srcs=("$REPO"/cuda/*.cu "$REPO"/cuda/hopper/*.cu) objs=() src pid pids=() bad=0
    # the objects of the build of these sources (same flags), when complete
    if [ -f "$WORK/build.hash" ] && [ "$(cat "$WORK/build.hash")" = "$(source_hash)" ]; then
        objs=("$REPO"/build/temp.*/cuda/*.cu.o)
        [ -f "${objs[0]}" ] || objs=()
    fi
    if [ "${#objs[@]}" -ne "${#srcs[@]}" ]; then
        objs=()
        for src in "${srcs[@]}"; do     # one compile per file, all at once
            objs+=("$dir/obj/$(basename "$(dirname "$src")")__$(basename "$src").o")
            "$nvcc" -c "$src" -o "${objs[-1]}" "${flags[@]}" &
            pids+=($!)
        done
        for pid in "${pids[@]}"; do wait "$pid" || bad=1; done
        [ $bad -eq 0 ] || return 1
    fi
    gcc -c -O2 -std=gnu11 -I"$REPO/csrc" "$REPO/csrc/core/status.c" -o "$dir/obj/status_c.o" &&
        "$nvcc" "${flags[@]}" "$REPO/tools/cuda_selftest.cu" "${objs[@]}" "$dir/obj/status_c.o" \
            -o "$dir/selftest" || return 1
    echo "$hash" >"$dir/hash"
    echo "$dir/selftest"
}

# build_selftest: print the selftest binary's path; fails (with the tail
# of its log on stderr) when it does not build.  selftest and sanitize share
# the binary: when they run concurrently it is built once before them
# (SELFTEST_BIN), never by both at once.
build_selftest() {
    if [ -n "${SELFTEST_BIN:-}" ]; then
        echo "$SELFTEST_BIN"
        [ -x "$SELFTEST_BIN" ]
        return
    fi
    export -f selftest_binary source_hash nvcc_path
    export ARCHS WORK REPO
    run_logged selftest_build 300 bash -c selftest_binary
    local bin
    bin="$(tail -n 1 "$LOGDIR/selftest_build.log")"
    if [ ! -x "$bin" ]; then
        show_tail selftest_build 30 >&2
        return 1
    fi
    echo "$bin"
}

stage_selftest() {
    note "== selftest: every kernel variant vs float64, full grid (~0.75 min)"
    local bin rc
    if ! bin="$(build_selftest)"; then
        record selftest FAIL "the selftest did not build (selftest_build.log)"
        return 1
    fi
    run_logged selftest 300 "$bin" full
    rc=$?
    local last fails
    last="$(grep -E '^selftest (full|quick):' "$LOGDIR/selftest.log" | tail -n 1)"
    fails="$(grep -E '^FAIL' "$LOGDIR/selftest.log" | head -n 3 | tr '\n' ';')"
    fails="${fails:+; first failures: ${fails%;}}"
    if [ $rc -eq 0 ]; then
        record selftest PASS "${last#selftest full: }"
    else
        grep -q 'no CUDA device' "$LOGDIR/selftest.log" && last="no GPU (no CUDA device)"
        [ $rc -eq 124 ] && last="timed out; $last"
        record selftest FAIL "rc=$rc; ${last:-no summary line}${fails}"
        show_tail selftest 30
        return 1
    fi
}

# The conformance program, built with nvcc for sm_90a (rebuilt when its
# sources changed); its path, or a failure with the build log's tail.
ptx_binary() {
    local dir="$WORK/ptx" hash
    hash="$( (cd "$REPO" && cat tools/ptx_conformance.cu cuda/mma.cuh cuda/common.cuh \
        cuda/hopper/*) | sha256sum | cut -c1-16)"
    if [ -x "$dir/ptx_conformance" ] && [ "$(cat "$dir/hash" 2>/dev/null)" = "$hash" ]; then
        echo "$dir/ptx_conformance"
        return 0
    fi
    mkdir -p "$dir"
    local nvcc
    nvcc="$(nvcc_path)"
    "$nvcc" -O2 -std=c++17 -arch=sm_90a -DRA_WITH_CUDA -I"$REPO/csrc" -I"$REPO/cuda" \
        "$REPO/tools/ptx_conformance.cu" -o "$dir/ptx_conformance" || return 1
    echo "$hash" >"$dir/hash"
    echo "$dir/ptx_conformance"
}

stage_ptx() {
    note "== ptx: tools/ptx_conformance.cu (sm_90a) vs the emulator's digests (~0.5 min)"
    export -f ptx_binary nvcc_path
    export WORK REPO
    run_logged ptx_build 240 bash -c ptx_binary
    local bin rc
    bin="$(tail -n 1 "$LOGDIR/ptx_build.log")"
    if [ ! -x "$bin" ]; then
        record ptx FAIL "the conformance program did not build (ptx_build.log)"
        show_tail ptx_build 30
        return 1
    fi
    run_logged ptx 120 "$bin" --expected "$REPO/tools/ptx_conformance.expected"
    rc=$?
    local last differ overall
    last="$(grep -E '^ptx_conformance: ' "$LOGDIR/ptx.log" | tail -n 1)"
    overall="$(grep -E '^overall ' "$LOGDIR/ptx.log" | awk '{print $NF}')"
    differ="$(grep -E '^(DIFFERS|MISSING)' "$LOGDIR/ptx.log" | cut -d: -f1 | cut -c9- |
        head -n 8 | tr '\n' ';')"
    if [ $rc -eq 0 ]; then
        record ptx PASS "${last#ptx_conformance: } (overall $overall)"
    else
        [ $rc -eq 124 ] && last="timed out; $last"
        record ptx FAIL "rc=$rc; ${last:-no summary line}${differ:+; differ: ${differ%;}}"
        show_tail ptx 45
        return 1
    fi
}

# pytest_stage NAME FILES...: the GPU tests of FILES; PASS only when some
# ran and none failed
pytest_stage() {
    local name="$1"; shift
    local why
    why="$(cuda_reason)"
    if [ -n "$why" ]; then
        record "$name" FAIL "$why"
        return 1
    fi
    run_logged "$name" 500 "$PY" -m pytest -m gpu -rs --maxfail=30 -q -p no:cacheprovider \
        --junitxml="$LOGDIR/$name.xml" "$@"
    local rc=$?
    local counts
    counts="$(py - "$LOGDIR/$name.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("0 0 0")
    sys.exit()
run = failed = skipped = 0
for case in root.iter("testcase"):
    kinds = {child.tag for child in case}
    if "skipped" in kinds:
        skipped += 1
    elif kinds & {"failure", "error"}:
        failed += 1
    else:
        run += 1
print(run, failed, skipped)
PY
)"
    local passed failed skipped
    read -r passed failed skipped <<<"$counts"
    local text="$passed passed, $failed failed, $skipped skipped"
    if [ "$rc" -eq 0 ] && [ "${passed:-0}" -gt 0 ] && [ "${failed:-0}" -eq 0 ]; then
        # what was skipped and why (multi-rank NCCL, a missing framework, ...)
        grep -E '^SKIPPED' "$LOGDIR/$name.log" | head -n 8 | cut -c1-200
        record "$name" PASS "$text"
    else
        [ "${passed:-0}" -eq 0 ] && text="$text: no GPU test ran"
        [ "$rc" -eq 124 ] && text="timed out; $text"
        record "$name" FAIL "rc=$rc; $text"
        grep -E '^(FAILED|ERROR)' "$LOGDIR/$name.log" | head -n 15 | cut -c1-300
        show_tail "$name" 15
        return 1
    fi
}

REPEAT_RUNS=20

stage_tests() {
    note "== tests: pytest -m gpu test_cuda.py test_cuda_fwd_tc.py test_cuda_families.py test_cuda_bwd_wg.py test_cuda_interop.py test_cuda_lifetime.py test_cuda_dilated.py test_cuda_branches.py test_jax_ffi_gpu.py (~1.5 min)"
    pytest_stage tests "$REPO/tests/test_cuda.py" "$REPO/tests/test_cuda_fwd_tc.py" \
        "$REPO/tests/test_cuda_families.py" "$REPO/tests/test_cuda_bwd_wg.py" \
        "$REPO/tests/test_cuda_interop.py" "$REPO/tests/test_cuda_lifetime.py" \
        "$REPO/tests/test_cuda_dilated.py" "$REPO/tests/test_cuda_branches.py" \
        "$REPO/tests/test_jax_ffi_gpu.py"
    local rc=$?
    # borrowed arrays freed while ringattn's stream still used them gave a
    # wrong dq now and then on an H100 (PyTorch tensors): the tests of it,
    # each $REPEAT_RUNS times in a row
    local torch_gpu
    torch_gpu="$(py -c 'import torch; print(torch.cuda.is_available())' 2>/dev/null | tail -n 1)"
    if [ "$torch_gpu" != True ]; then
        record repeat-docs FAIL "not run: PyTorch sees no GPU ($PY)"
        record repeat-lifetime FAIL "not run: PyTorch sees no GPU ($PY)"
        return 1
    fi
    note "== tests, $REPEAT_RUNS runs each with PyTorch tensors: the ring-step docs cases, test_cuda_lifetime.py (~1 min)"
    pytest_stage repeat-docs --repeat "$REPEAT_RUNS" -k "docs" \
        "$REPO/tests/test_cuda.py::test_masked_ring_steps_accumulate" || rc=1
    set_result repeat-docs "${RESULT[repeat-docs]} ($REPEAT_RUNS runs of the 9 docs cases of test_masked_ring_steps_accumulate)"
    pytest_stage repeat-lifetime --repeat "$REPEAT_RUNS" -k "torch and not ulysses" \
        "$REPO/tests/test_cuda_lifetime.py" || rc=1
    set_result repeat-lifetime "${RESULT[repeat-lifetime]} ($REPEAT_RUNS runs of test_cuda_lifetime.py's PyTorch tests)"
    return $rc
}

stage_nccl() {
    local v
    v="$(py -c 'import ringattn as ra; print(ra.nccl_version())' 2>&1 | tail -n 1)"
    note "== nccl: pytest -m gpu test_nccl.py; NCCL $v (~0.75 min)"
    pytest_stage nccl "$REPO/tests/test_nccl.py"
    local rc=$?
    set_result nccl "${RESULT[nccl]}; NCCL $v"
    return $rc
}

stage_threadring() {
    note "== threadring: pytest -m gpu test_threads_cuda.py: thread ranks on one GPU, no NCCL (~1 min)"
    pytest_stage threadring "$REPO/tests/test_threads_cuda.py"
}

stage_sanitize() {
    note "== sanitize: ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck} on selftest quick, memcheck on sanitize_case.py (~2 min, all at once)"
    gpu_tool sanitize compute-sanitizer || return 1
    local san="$TOOL"
    local bin
    if ! bin="$(build_selftest)"; then
        record sanitize FAIL "the selftest did not build (selftest_build.log)"
        return 1
    fi
    local tool rc out verdict=PASS parts=()
    # the positive control: memcheck with the same filter must catch the
    # canary's out-of-bounds write, or every "clean" below means nothing
    local nvcc arch="${ARCHS%%[;, ]*}"
    nvcc="$(nvcc_path)"
    run_logged sanitize_canary 120 bash -c "'$nvcc' -O1 -arch=sm_${arch#sm_} \
        '$REPO/tools/sanitizer_canary.cu' -o '$WORK/canary' && '$san' --tool memcheck \
        --error-exitcode 9 --kernel-name '$KERNEL_FILTER' '$WORK/canary'"
    rc=$?
    if [ $rc -eq 9 ] && grep -q 'Invalid __global__ write' "$LOGDIR/sanitize_canary.log"; then
        parts+=("canary caught")
    else
        record sanitize FAIL "the kernel filter's canary was not caught (rc=$rc): a clean run would prove nothing"
        show_tail sanitize_canary 20
        return 1
    fi
    # the tools and the Python case all at once (one after the other with
    # GPU_CHECK_SERIAL=1), each with its own log
    local tools pids=() i
    read -r -a tools <<<"${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}"
    for tool in "${tools[@]}"; do
        run_logged "sanitize_$tool" 300 "$san" --tool "$tool" --error-exitcode 9 \
            --kernel-name "$KERNEL_FILTER" "$bin" quick &
        pids+=($!)
        [ "$SERIAL" = 1 ] && wait "${pids[-1]}"
    done
    run_logged sanitize_python 180 env RINGATTN_CUDA_CACHING=0 "$san" --tool memcheck \
        --error-exitcode 9 --kernel-name "$KERNEL_FILTER" "$PY" "$REPO/tools/sanitize_case.py" &
    local python_pid=$!
    for i in "${!tools[@]}"; do
        tool="${tools[$i]}"
        wait "${pids[$i]}"
        rc=$?
        out="$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SUMMARY:' "$LOGDIR/sanitize_$tool.log" |
            tail -n 1 | sed 's/^=* *//')"
        if [ $rc -eq 0 ]; then
            parts+=("$tool clean")
        else
            verdict=FAIL
            [ $rc -eq 124 ] && out="timed out"
            parts+=("$tool rc=$rc ${out}")
            show_tail "sanitize_$tool" 20
        fi
    done
    wait "$python_pid"
    rc=$?
    if [ $rc -eq 0 ] && grep -q 'sanitize case done' "$LOGDIR/sanitize_python.log"; then
        parts+=("python memcheck clean")
    else
        verdict=FAIL
        [ $rc -eq 124 ] && rc="$rc timed out"
        parts+=("python memcheck rc=$rc")
        show_tail sanitize_python 20
    fi
    local joined
    joined="$(printf '%s, ' "${parts[@]}")"
    record sanitize "$verdict" "${joined%, }"
    [ "$verdict" = PASS ]
}

bench_stage() {  # bench_stage NAME SUMMARY-PREFIX ARGS...
    local name="$1" prefix="$2"; shift 2
    run_logged "$name" 420 "$PY" -m ringattn bench "$@"
    local rc=$?
    local line
    line="$(grep -E "^$prefix:" "$LOGDIR/$name.log" | tail -n 1)"
    line="${line#"$prefix": }"
    if [ $rc -eq 0 ]; then
        record "$name" PASS "$line"
    else
        [ $rc -eq 124 ] && line="timed out; $line"
        record "$name" FAIL "rc=$rc; ${line:-no summary line}"
        show_tail "$name" 30
        return 1
    fi
}

stage_bench() {
    note "== bench: ringattn bench --gpu (~1 min)"
    bench_stage bench bench-gpu --gpu
}

# The raw metrics the profile stage asks for besides its sections, where
# this ncu knows them (an unknown name would fail the whole run): spill
# traffic, dq's reductions at L1 and L2, the wgmma pipe, and the bytes per
# second L2 served (with the L2 throughput percentage: the L2 rate the
# model assumes, tools/profile_report.py).
PROFILE_METRICS="${PROFILE_METRICS:-l1tex__t_requests_pipe_lsu_mem_local_op_ld.sum l1tex__t_requests_pipe_lsu_mem_local_op_st.sum l1tex__t_requests_pipe_lsu_mem_global_op_red.sum lts__t_sectors_op_red.sum sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active sm__inst_executed_pipe_tensor_op_gmma.sum lts__t_bytes.sum.per_second}"

stage_profile() {
    note "== profile: Nsight Compute on each Hopper kernel, tools/profile_case.py (~1.5 min)"
    gpu_tool profile ncu || return 1
    local ncu="$TOOL"
    local m metrics=() extra=()
    "$ncu" --query-metrics >"$LOGDIR/profile_metrics.log" 2>&1 ||
        "$ncu" --query-metrics --chip gh100 >>"$LOGDIR/profile_metrics.log" 2>&1
    for m in $PROFILE_METRICS; do
        grep -qw -- "${m%%.*}" "$LOGDIR/profile_metrics.log" && metrics+=("$m")
    done
    [ ${#metrics[@]} -gt 0 ] && extra=(--metrics "$(IFS=,; echo "${metrics[*]}")")
    # the clocks as they are (the device's METHOD.md); one launch of each
    # case, every wgmma kernel of them and nothing else
    run_logged profile 300 env PROFILE_SEQ_LEN="${PROFILE_SEQ_LEN:-8192}" "$ncu" \
        --clock-control none --target-processes all \
        --kernel-name "regex:(fwd_wg|bwd_wg|dkdv_wg|dq_wg)_kernel" \
        --section SpeedOfLight --section LaunchStats --section Occupancy \
        --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis "${extra[@]}" \
        --export "$LOGDIR/profile" --force-overwrite "$PY" "$REPO/tools/profile_case.py"
    local rc=$?
    if [ $rc -ne 0 ] || ! grep -q 'profile case done' "$LOGDIR/profile.log"; then
        [ $rc -eq 124 ] && rc="$rc timed out"
        record profile FAIL "ncu rc=$rc"
        show_tail profile 30
        return 1
    fi
    run_logged profile_csv 120 "$ncu" --import "$LOGDIR/profile.ncu-rep" --csv --page details
    run_logged profile_report 60 "$PY" "$REPO/tools/profile_report.py" \
        "$LOGDIR/profile_csv.log" --seq-len "${PROFILE_SEQ_LEN:-8192}"
    rc=$?
    local line
    line="$(grep -E '^profile:' "$LOGDIR/profile_report.log" | tail -n 1)"
    line="${line#profile: }"
    if [ $rc -eq 0 ]; then
        record profile PASS "$line (tables: profile_report.log)"
        grep -E '^\|' "$LOGDIR/profile_report.log" | head -n 24 | cut -c1-300
    else
        record profile FAIL "rc=$rc; ${line:-no summary line}"
        show_tail profile_report 20
        return 1
    fi
}

stage_ringbench() {
    note "== ringbench: ringattn bench --ring --gpu, NCCL and thread ranks (~0.75 min)"
    bench_stage ringbench bench-gpu-ring --ring --gpu ${RINGBENCH_SEQ_LEN:+--seq-len "$RINGBENCH_SEQ_LEN"}
}

# ---- environment, summary, archive ---------------------------------------------

environment() {
    {
        echo "date: $(date -u)"
        echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo no git))"
        echo "python: $PY"
        nvidia-smi 2>&1 || echo "nvidia-smi: not available"
        "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version 2>&1 || echo "nvcc: not found"
        py -c 'import sys; print("python", sys.version.split()[0])' 2>&1
        py -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())' 2>&1 | tail -n 1
        "$PY" -m pip list 2>/dev/null | grep -iE '^(numpy|torch|cupy|jax|jaxlib|nvidia-nccl)' || true
        nproc
    } >"$LOGDIR/env.log" 2>&1
    local gpu
    gpu="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
    note "gpu_check: stages ${STAGES[*]}; GPU: ${gpu:-none found}; python $PY; budget ${BUDGET} s; logs $LOGDIR"
    ENV_LINE="GPU ${gpu:-none}; $(grep -m1 -E '^torch ' "$LOGDIR/env.log" || echo 'no torch'); nvcc $(grep -m1 -oE 'release [0-9.]+' "$LOGDIR/env.log" | cut -d' ' -f2)"
}

finish() {
    local status=0 s shown=" "
    # the stages in their usual order (the tests stage's repeat-* lines after
    # it), whatever order they ended in
    for s in build ptx selftest tests repeat-docs repeat-lifetime sanitize nccl threadring \
        bench ringbench profile "${ORDER[@]}"; do
        [ -n "${RESULT[$s]:-}" ] && [[ "$shown" != *" $s "* ]] && shown+="$s "
    done
    read -r -a ORDER <<<"$shown"
    {
        echo "env: $ENV_LINE"
        for s in "${ORDER[@]}"; do echo "$s: ${RESULT[$s]}"; done
    } >"$LOGDIR/summary.txt"
    mkdir -p "$(dirname "$ARCHIVE")" 2>/dev/null
    if tar -czf "$ARCHIVE" -C "$WORK/logs" "$RUN_ID" 2>/dev/null; then
        echo "logs: $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1)), $(( SECONDS - START )) s in all"
    else
        echo "logs: could not write $ARCHIVE; they are in $LOGDIR"
    fi
    echo "SUMMARY env: $ENV_LINE"
    for s in "${ORDER[@]}"; do
        echo "SUMMARY $s: ${RESULT[$s]}" | cut -c1-400
        [[ "${RESULT[$s]}" == PASS* ]] || status=1
    done
    return $status
}

# ---- running the stages ----------------------------------------------------------

CONCURRENT_STAGES=" ptx selftest tests sanitize nccl threadring "
TIMING_STAGES=" bench ringbench profile "

requested() { [[ " ${STAGES[*]} " == *" $1 "* ]]; }

# run_stage STAGE: run it here (the stages run before or after the
# concurrent ones, and every stage with GPU_CHECK_SERIAL=1)
run_stage() {
    local stage="$1" t0=$SECONDS
    [ -n "${RESULT[$stage]:-}" ] && return 0          # ran already (build via need_build)
    if [ "$(left)" -le 30 ]; then
        record "$stage" FAIL "not run: no time left in the ${BUDGET} s budget"
        return 1
    fi
    if [ "$stage" != build ] && [ "$stage" != ptx ] && ! need_build; then
        record "$stage" FAIL "not run: no installed CUDA build"
        return 1
    fi
    "stage_$stage"
    local rc=$?
    echo "   ($stage took $((SECONDS - t0)) s)" >>"$LOGDIR/gpu_check.log"
    return $rc
}

# stage_bg STAGE: a stage in a background subshell.  Its records cannot
# reach the main shell's RESULT, so each one also goes to
# $LOGDIR/STAGE.results as "stage<TAB>verdict details" (set_result), and
# the final values once more at the end (later lines win).
stage_bg() {
    local stage="$1" n=${#ORDER[@]} rc s
    STAGE_RESULTS="$LOGDIR/$stage.results"
    "stage_$stage"
    rc=$?
    for s in "${ORDER[@]:n}"; do set_result "$s" "${RESULT[$s]}"; done
    exit $rc
}

descendants() {  # every process under PID, children first
    local child
    for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
        descendants "$child"
        echo "$child"
    done
}

kill_tree() {  # kill_tree PID...: each PID and everything it started
    local victims=() more=() pid
    for pid in "$@"; do
        read -r -d '' -a more < <(descendants "$pid")
        victims+=("${more[@]}" "$pid")
    done
    kill -TERM "${victims[@]}" 2>/dev/null
    sleep 2
    kill -KILL "${victims[@]}" 2>/dev/null
}

# collect_stage STAGE RC KILLED: the background stage's records into
# RESULT/ORDER and its output to stdout
collect_stage() {
    local stage="$1" rc="$2" killed="$3" took=$((SECONDS - BG_T0[$1])) s v
    while IFS=$'\t' read -r s v; do     # (run_concurrent made the file)
        [ -n "$s" ] && set_result "$s" "$v"
    done <"$LOGDIR/$stage.results"
    if [ "$killed" = 1 ]; then
        v="${RESULT[$stage]:-}"
        set_result "$stage" "FAIL timed out: killed at the budget's end after $took s${v:+ (had: $v)}"
        if [ "$stage" = tests ]; then
            for s in repeat-docs repeat-lifetime; do
                [ -n "${RESULT[$s]:-}" ] || set_result "$s" "FAIL not run: the tests stage timed out"
            done
        fi
    elif [ -z "${RESULT[$stage]:-}" ]; then
        set_result "$stage" "FAIL the stage ended (rc=$rc) without a result"
    fi
    cat "$LOGDIR/$stage.out" 2>/dev/null
    echo "   ($stage took $took s)" | tee -a "$LOGDIR/gpu_check.log"
}

declare -A BG_PID=() BG_T0=()

# The correctness stages requested, all at once in the background (they
# share the GPU and the cores); their output is shown in stage order as each
# one ends.  Each keeps inside the budget less RESERVE; one still running
# RESERVE + 5 s before the budget's end is killed and reported timed out.
run_concurrent() {
    local stage bg=() next=0
    declare -A done_=() killed=()
    for stage in "${STAGES[@]}"; do
        [[ "$CONCURRENT_STAGES" == *" $stage "* ]] || continue
        [ -n "${RESULT[$stage]:-}${BG_PID[$stage]:-}" ] && continue
        # (run_logged keeps 20 s of it for what follows, and needs 5 more)
        if [ "$(left)" -le 25 ]; then
            record "$stage" FAIL "not run: no time left in the ${BUDGET} s budget (less ${RESERVE} s kept for the timing stages)"
            continue
        fi
        if [ "$stage" != ptx ] && [[ "${RESULT[build]:-}" != PASS* ]]; then
            record "$stage" FAIL "not run: no installed CUDA build"
            continue
        fi
        : >"$LOGDIR/$stage.results"
        ( stage_bg "$stage" ) >"$LOGDIR/$stage.out" 2>&1 &
        BG_PID[$stage]=$!
        BG_T0[$stage]=$SECONDS
        bg+=("$stage")
    done
    [ ${#bg[@]} -gt 0 ] || return 0
    note "== at once in the background: ${bg[*]} (the output of each as it ends, in stage order)"
    local deadline=$((START + BUDGET - RESERVE - 5))
    local late=()
    while [ "$next" -lt ${#bg[@]} ]; do
        for stage in "${bg[@]}"; do
            [ -n "${done_[$stage]:-}" ] && continue
            if ! kill -0 "${BG_PID[$stage]}" 2>/dev/null; then
                wait "${BG_PID[$stage]}"
                done_[$stage]=$?
            elif [ "$SECONDS" -ge "$deadline" ]; then
                late+=("$stage")
            fi
        done
        if [ ${#late[@]} -gt 0 ]; then     # all at once: the summary must not wait
            local pids=()
            for stage in "${late[@]}"; do pids+=("${BG_PID[$stage]}"); done
            kill_tree "${pids[@]}"
            for stage in "${late[@]}"; do
                wait "${BG_PID[$stage]}"
                done_[$stage]=$?
                killed[$stage]=1
            done
            late=()
        fi
        while [ "$next" -lt ${#bg[@]} ] && [ -n "${done_[${bg[$next]}]:-}" ]; do
            stage="${bg[$next]}"
            collect_stage "$stage" "${done_[$stage]}" "${killed[$stage]:-0}"
            next=$((next + 1))
        done
        [ "$next" -lt ${#bg[@]} ] && sleep 0.5
    done
}

SERIAL="${GPU_CHECK_SERIAL:-0}"
ENV_LINE="unknown"
environment
if [ "$SERIAL" = 1 ]; then
    for stage in "${STAGES[@]}"; do run_stage "$stage"; done
else
    # 1. the build (also when only a stage that needs it was asked for)
    printf '%s\n' "${STAGES[@]}" | grep -vx ptx >/dev/null && run_stage build
    # 2. the selftest binary, once, for selftest and sanitize
    if { requested selftest || requested sanitize; } && [[ "${RESULT[build]:-}" == PASS* ]]; then
        bin=""
        if [ "$(left)" -gt 30 ]; then
            note "== selftest binary: tools/cuda_selftest.cu with the build's CUDA objects"
            bin="$(build_selftest)" || bin=""
        fi
        SELFTEST_BIN="${bin:-$LOGDIR/selftest-did-not-build}"
    fi
    # 3. the correctness stages, concurrently, keeping time for 4.
    reserve=0
    requested bench && reserve=$((reserve + 90))
    requested ringbench && reserve=$((reserve + 60))
    requested profile && reserve=$((reserve + 120))
    RESERVE="${GPU_CHECK_RESERVE:-$reserve}"
    run_concurrent
    RESERVE=0
    # 4. the timing stages, alone on the GPU, one after the other
    for stage in "${STAGES[@]}"; do
        [[ "$TIMING_STAGES" == *" $stage "* ]] && run_stage "$stage"
    done
fi
finish
