#!/usr/bin/env bash
# The whole test suite under AddressSanitizer + UBSan, on the sanitized library of the fuzzing build
# (build-fuzz: clang -O1 with line tables; scripts/fuzz.sh 0 builds it): focus_tests_san, with the
# command-line binary focus_san for the tests that run it, in SHARDS processes (default: the core
# count) of one thread each, every finding fatal. Usage: scripts/test_asan.sh [DATA] [FILTER]
# Every test by default. The slowest (whole real models against Python references and the exact
# path, the shipped routers, the symmetric kernel's float64 reference at 1000 and 3001 rows) check
# smaller shapes when sanitized (tests/test_util.h: small_shapes()); the plain suite runs the full
# ones. KEEP_LOGS=DIR keeps each shard's log there.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD="$ROOT/build-fuzz"
DATA=${1:-$(cd "$ROOT/.." && pwd)/shared/data}
FILTER=${2:-'*'}
SHARDS=${SHARDS:-$(nproc)}
[ -x "$BUILD/focus_san" ] || { echo "test_asan.sh: no $BUILD/focus_san: run scripts/fuzz.sh 0 first" >&2; exit 2; }
cmake --build "$BUILD" --target focus_tests_san -j "${JOBS:-$(nproc)}" >/dev/null
export FOCUS_DATA="$DATA" FOCUS_BIN="$BUILD/focus_san" OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive OPENBLAS_NUM_THREADS=1
export ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:abort_on_error=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/focus-test-asan.XXXXXX")
trap '[ -n "${KEEP_LOGS:-}" ] && cp "$LOGS"/shard*.log "$KEEP_LOGS"/; rm -rf "$LOGS"' EXIT
start=$(date +%s)
pids=()
for ((i = 0; i < SHARDS; i++)); do
  GTEST_TOTAL_SHARDS=$SHARDS GTEST_SHARD_INDEX=$i "$BUILD/focus_tests_san" --gtest_filter="$FILTER" --gtest_brief=1 \
    > "$LOGS/shard$i.log" 2>&1 &
  pids+=($!)
done
failed=0
for ((i = 0; i < SHARDS; i++)); do
  if ! wait "${pids[$i]}"; then
    failed=1
    echo "test_asan.sh: shard $i of $SHARDS failed; its log:" >&2
    tail -n 60 "$LOGS/shard$i.log" >&2
  fi
done
passed=$(cat "$LOGS"/shard*.log | sed -nE 's/^\[  PASSED  \] ([0-9]+) tests?\..*/\1/p' | awk '{s += $1} END {print s + 0}')
[ "$failed" = 0 ] || { echo "test_asan.sh: FAILED under ASan + UBSan (filter $FILTER)" >&2; exit 1; }
[ "$passed" -gt 0 ] || { echo "test_asan.sh: no test passed (filter $FILTER)" >&2; exit 1; }
echo "test_asan.sh: $passed tests passed under ASan + UBSan in $SHARDS shards, no sanitizer report, $(( $(date +%s) - start )) s (filter $FILTER)"
