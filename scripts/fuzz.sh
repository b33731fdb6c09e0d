#!/usr/bin/env bash
# Builds the libFuzzer harnesses (fuzz/fuzz_*.cpp: clang, AddressSanitizer + UBSan) in build-fuzz/
# and runs each for SECONDS, one after the other, on a scratch copy of its seed corpus
# (fuzz/corpus/<harness>/, left unmodified).
#   scripts/fuzz.sh SECONDS [HARNESS...]      e.g. scripts/fuzz.sh 60 fuzz_gguf fuzz_text
#   scripts/fuzz.sh 0                          builds only (the harnesses and build-fuzz/focus_san,
#                                              the command-line binary on the sanitized library)
# Installs clang (Debian packages) when it is missing. Prints the executions of each harness;
# exits non-zero when any harness found a crash, naming the harness and the crash file (kept
# under build-fuzz/findings/<harness>/). Reproduce one with build-fuzz/<harness> CRASH_FILE.
#   FOCUS_FUZZ_JOBS   build parallelism (default: the number of cores)
#   FOCUS_FUZZ_NICE   niceness of the fuzzing runs (default 10)
#   FOCUS_FUZZ_RUNS   stop each harness after this many executions, SECONDS still being the cap
#                     (e.g. FOCUS_FUZZ_RUNS=10000000 scripts/fuzz.sh 36000 fuzz_dequant)
#   FOCUS_FUZZ_BUILD  0: use the harnesses already built (two runs side by side on one build)
#   FOCUS_FUZZ_TIMEOUT  seconds of wall time one input may take before it counts as a hang
#                     (default 10; raise it for long runs at low priority beside other work)
#   FOCUS_FUZZ_TMP    folder for the corpora and the files each input is written to (default
#                     /dev/shm when it is writable with 1 GiB free, else $TMPDIR or /tmp): the harnesses write
#                     every input to a file before reading it, about three times faster in memory
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$ROOT/build-fuzz"

if [ $# -lt 1 ] || ! [[ "$1" =~ ^[0-9]+$ ]]; then
  echo "usage: scripts/fuzz.sh SECONDS [HARNESS...]" >&2
  exit 2
fi
SECONDS_EACH="$1"
shift

# ---- clang with libFuzzer and the sanitizer runtimes, OpenMP for clang
probe() {
  local dir
  dir=$(mktemp -d)
  echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' > "$dir/p.cpp"
  clang++ -fsanitize=fuzzer,address,undefined -fopenmp "$dir/p.cpp" -o "$dir/p" >/dev/null 2>&1
  local rc=$?
  rm -rf "$dir"
  return $rc
}
if ! command -v clang++ >/dev/null || ! probe; then
  SUDO=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi
  echo "[fuzz] installing clang, libFuzzer and libomp (Debian packages)"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang libclang-rt-dev libomp-dev
  probe || { echo "[fuzz] error: clang++ -fsanitize=fuzzer does not link after installing clang" >&2; exit 1; }
fi

# ---- build (-O1 with line tables: what libFuzzer and the sanitizers are made for, and much
# quicker to compile than -O2 with full debug information)
if [ "${FOCUS_FUZZ_BUILD:-1}" != 0 ]; then
  cmake -S "$ROOT" -B "$BUILD" -DFOCUS_FUZZ=ON -DFOCUS_TESTS=OFF -DFOCUS_BENCH=OFF -DCMAKE_BUILD_TYPE=None \
    -DCMAKE_C_FLAGS="-O1" -DCMAKE_CXX_FLAGS="-O1" \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ >/dev/null
  cmake --build "$BUILD" --target fuzz_all -j "${FOCUS_FUZZ_JOBS:-$(nproc)}" >/dev/null
fi

if [ "$SECONDS_EACH" = 0 ]; then
  echo "[fuzz] built the harnesses and $BUILD/focus_san"
  exit 0
fi
if [ $# -gt 0 ]; then
  harnesses=("$@")
else
  harnesses=()
  for f in "$ROOT"/fuzz/fuzz_*.cpp; do harnesses+=("$(basename "$f" .cpp)"); done
fi

# ---- run
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
if [ -z "${FOCUS_FUZZ_TMP:-}" ] && [ -d /dev/shm ] && [ -w /dev/shm ] &&
  [ "$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 { print $4 }')" -ge 1048576 ] 2>/dev/null; then
  FOCUS_FUZZ_TMP=/dev/shm  # with at least 1 GiB free (a container's default is 64 MiB)
fi
export TMPDIR="${FOCUS_FUZZ_TMP:-${TMPDIR:-/tmp}}"
SCRATCH=$(mktemp -d "$TMPDIR/focus-fuzz-run.XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT
# The harnesses' own folders (fuzz_util.h: TMPDIR/focus-fuzz-PID) inside it too, so that a harness
# that stops on a finding, without its exit handlers, leaves nothing behind in memory.
export TMPDIR="$SCRATCH"
failed=()
printf "%-22s %12s %10s %s\n" harness executions exec/s result
for h in "${harnesses[@]}"; do
  bin="$BUILD/$h"
  [ -x "$bin" ] || { echo "[fuzz] error: no harness '$h' in $BUILD (fuzz/$h.cpp; with FOCUS_FUZZ_BUILD=0, build first: scripts/fuzz.sh 0)" >&2; exit 2; }
  corpus="$SCRATCH/$h/corpus"
  findings="$BUILD/findings/$h"
  rm -rf "$findings"
  mkdir -p "$corpus" "$findings"
  [ -d "$ROOT/fuzz/corpus/$h" ] && cp -r "$ROOT/fuzz/corpus/$h/." "$corpus/"
  log="$SCRATCH/$h/log"
  set +e
  (cd "$SCRATCH/$h" && nice -n "${FOCUS_FUZZ_NICE:-10}" "$bin" -max_total_time="$SECONDS_EACH" -runs="${FOCUS_FUZZ_RUNS:--1}" -rss_limit_mb=2048 \
    -malloc_limit_mb=1024 -timeout="${FOCUS_FUZZ_TIMEOUT:-10}" -print_final_stats=1 -artifact_prefix="$findings/" "$corpus" >"$log" 2>&1)
  rc=$?
  set -e
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1 || true)
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1 || true)
  # libFuzzer also writes inputs slower than -report_slow_units (10 s) as slow-unit-*: kept, named
  # in the result, not a finding (a stopped or starved process makes them; hangs are -timeout's).
  crash=$(grep -o "Test unit written to .*" "$log" | sed 's/Test unit written to //' | grep -v '/slow-unit-' | tail -1 || true)
  slow=$( (grep -o "Test unit written to .*/slow-unit-.*" "$log" || true) | wc -l)
  if [ -z "$crash" ] && grep -q "libFuzzer: run interrupted" "$log"; then
    # Ctrl-C (SIGINT to the harness): libFuzzer stops cleanly with its own exit code; not a finding,
    # and the harnesses after it are not started.
    printf "%-22s %12s %10s %s\n" "$h" "${execs:-?}" "${rate:-?}" "interrupted"
    echo "[fuzz] interrupted: no finding in the executions above; the remaining harnesses were not run" >&2
    exit 130
  fi
  if [ $rc -ne 0 ] || [ -n "$crash" ]; then
    printf "%-22s %12s %10s %s\n" "$h" "${execs:-?}" "${rate:-?}" "FINDING ${crash:-(exit $rc)}"
    cp "$log" "$findings/log.txt"
    grep -E "ERROR: |runtime error|SUMMARY|terminate called|what\(\)" "$log" | head -5 | sed 's/^/    /'
    failed+=("$h: ${crash:-exit $rc} (log: $findings/log.txt)")
  else
    note=""
    [ "$slow" -gt 0 ] && note=" ($slow slow units over 10 s kept in $findings; replay each with $bin FILE)"
    printf "%-22s %12s %10s %s\n" "$h" "${execs:-?}" "${rate:-?}" "ok$note"
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "[fuzz] findings:" >&2
  for f in "${failed[@]}"; do echo "  $f" >&2; done
  exit 1
fi
