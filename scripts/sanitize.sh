#!/usr/bin/env bash
# The whole test suite under AddressSanitizer + UBSan: the library, the `focus` binary and the
# tests built with -fsanitize=address,undefined into BUILD (default build-san), every test run with
# a sanitizer finding fatal (halt_on_error). Usage: scripts/sanitize.sh [BUILD] [DATA]
# Takes about 3x the plain suite's time; the numbers of a run are in docs/RESULTS.md section 10.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$ROOT/build-san}
DATA=${2:-$(cd "$ROOT/.." && pwd)/shared/data}
JOBS=${JOBS:-$(nproc)}
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFOCUS_ASAN=ON -DFOCUS_TESTS=ON -DFOCUS_BENCH=OFF >/dev/null
cmake --build "$BUILD" -j "$JOBS"
export FOCUS_DATA="$DATA"
export ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:abort_on_error=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
start=$(date +%s)
(cd "$BUILD" && OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive ctest -j "$JOBS" --timeout 3600 --output-on-failure)
echo "sanitize.sh: the whole suite passed under ASan + UBSan in $(( $(date +%s) - start )) s"
