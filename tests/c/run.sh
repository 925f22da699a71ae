#!/bin/sh
# Build and run the CPU attention harness.
#   tests/c/run.sh            correctness grid
#   tests/c/run.sh quick      small grid
#   tests/c/run.sh asan       small grid under -fsanitize=address,undefined
#   tests/c/run.sh bench [S]  timings, 1 and 2 threads, plus the NumPy sgemm rate
set -e
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${TMPDIR:-/tmp}/ringattn_test_attn_cpu
mkdir -p "$out"
srcs="$root/csrc/attn/attn_cpu_*.c $root/csrc/core/alloc.c $root/csrc/core/status.c"
flags="-O3 -std=gnu11 -fopenmp -fno-math-errno -fno-trapping-math -Wall -I$root/csrc"
mode=${1:-full}
if [ "$mode" = asan ]; then
    gcc $flags -g -fsanitize=address,undefined -fno-sanitize-recover=undefined \
        -o "$out/test_asan" "$here/test_attn_cpu.c" $srcs -lm
    exec "$out/test_asan" quick
fi
gcc $flags -o "$out/test" "$here/test_attn_cpu.c" $srcs -lm
if [ "$mode" = bench ]; then
    py=${PYTHON:-/work/venv/bin/python}
    for t in 1 2; do
        OPENBLAS_NUM_THREADS=$t OMP_NUM_THREADS=$t MKL_NUM_THREADS=$t "$py" -c "
import numpy as np, time
a = np.random.rand(2048, 2048).astype(np.float32); b = np.random.rand(2048, 2048).astype(np.float32)
a @ b; best = 1e9
for _ in range(5):
    t0 = time.perf_counter(); a @ b; best = min(best, time.perf_counter() - t0)
print('numpy sgemm 2048^3, $t thread(s): %.1f GFLOP/s' % (2 * 2048**3 / best / 1e9))
" || echo "numpy not available"
        RINGATTN_NUM_THREADS=$t "$out/test" bench $2
    done
    exit 0
fi
exec "$out/test" $mode
