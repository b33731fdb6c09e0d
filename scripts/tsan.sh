#!/usr/bin/env bash
# ThreadSanitizer over the threaded code: the library, the `focus` binary and the tests built with
# clang -fsanitize=thread into BUILD (default build-tsan), then the tests of the multi-threaded
# kernels (dense, grouped, sparse and soft attention, the quantised matrix-vector and GEMM kernels,
# attention mass, block top-k, the KV caches), of inference shared between threads, and of the
# trainers (routers, distillation, LoRA, training from scratch) run with OpenMP teams of THREADS
# (default 3: more threads than cores makes more interleavings), every report fatal.
#   scripts/tsan.sh [BUILD] [DATA] [GTEST_FILTER]
#   scripts/tsan.sh --kernels [BUILD] [DATA] [GTEST_FILTER]
#   scripts/tsan.sh --ci [BUILD] [DATA] [GTEST_FILTER]
# --kernels: only the threaded kernels (attention: dense, grouped, hybrid, soft, attention mass;
# the quantised matrix-vector products and the integer GEMM) with their tests, built on their own
# at -O1 into focus_kernel_tests (default BUILD build-tsan-kernels): a tenth of the whole build.
# --ci (what CI runs): the library with the tests of the kernels, of shared inference and of the
# trainers, at -O1 into focus_threaded_tests (default BUILD build-tsan-ci; no command-line
# binary), the trainers on the smaller shapes of tests/test_util.h. Its default filter leaves out
# what repeats the same threaded code at more cost: six of the ten integer types of the quantised
# kernels (they thread alike), decoding from group runs, the symmetric kernel's long references
# (its small shapes stay), the resume tests of retrofit (three balances), LoRA and training from
# scratch (five architectures), retrofit from saved routers and with a checkpoint every step, and
# the tests that run the binary.
# OpenMP's own synchronisation (barriers, reductions, tasks) is made visible to ThreadSanitizer by
# LLVM's archer tool (libarcher.so, loaded through OMP_TOOL_LIBRARIES); without it every parallel
# region would report races on the runtime's uninstrumented barriers. OpenBLAS is not instrumented
# (ignore_noninstrumented_modules): races inside it are out of reach, races between our threads and
# the buffers it reads or writes are not.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LEAN=0  # 1: one of the lean -O1 targets below (--kernels, --ci) instead of the whole build
TARGET=focus_tests
case "${1:-}" in
  --kernels) LEAN=1; TARGET=focus_kernel_tests; shift ;;
  --ci) LEAN=1; TARGET=focus_threaded_tests; shift ;;
esac
case "$TARGET" in
  focus_kernel_tests) BUILD=${1:-$ROOT/build-tsan-kernels} ;;
  focus_threaded_tests) BUILD=${1:-$ROOT/build-tsan-ci} ;;
  *) BUILD=${1:-$ROOT/build-tsan} ;;
esac
DATA=${2:-$(cd "$ROOT/.." && pwd)/shared/data}
FILTER=${3:-'FlashAttention.*:FocusAttention.*:FocusCachedAttention.*:GroupedAttention.*:GroupedKeyIndex.*:AsymmetricRouting.*:SoftAttentionKernel.*:AttentionMassKernel.*:BlockTopK.*:QuantMatvec*:KvTypes.*:Concurrency.*:Stories260K.*:Distill.*:Retrofit.*:LoraTrain.*:TrainScratch.*:Archs/FullModelGrad.*:Ops*'}
THREADS=${THREADS:-3}
JOBS=${JOBS:-$(nproc)}
ARCHER=$(ls /usr/lib/llvm-*/lib/libarcher.so 2>/dev/null | sort -V | tail -1 || true)
if ! command -v clang++ >/dev/null || [ -z "$ARCHER" ]; then
  SUDO=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi
  echo "[tsan] installing clang and LLVM's OpenMP runtime with archer (Debian packages)"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang libomp-dev
  ARCHER=$(ls /usr/lib/llvm-*/lib/libarcher.so 2>/dev/null | sort -V | tail -1 || true)
  [ -n "$ARCHER" ] || { echo "[tsan] error: libarcher.so not found after installing libomp-dev" >&2; exit 1; }
fi
if [ "$LEAN" = 1 ]; then
  if [ -z "${3:-}" ] && [ "$TARGET" = focus_kernel_tests ]; then FILTER='*'; fi
  if [ -z "${3:-}" ] && [ "$TARGET" = focus_threaded_tests ]; then
    FILTER='*-GroupedAttention.DecodingFromGroupRunsMatchesReference:Retrofit.InterruptedRunResumesToTheSameBits'
    FILTER+=':TrainScratch.ResumeGivesTheBitsOfAnUninterruptedRun:*CommandLine*:FocusAttention.N*MatchesReference'
    FILTER+=':Retrofit.InitContinuesFromSavedRouters:Retrofit.ElapsedTimeIsWallTimeWithCheckpointsEveryStep'
    FILTER+=':LoraTrain.InterruptedRunResumesToTheSameBits'
    for t in Q2_K Q3_K Q4_0 Q5_0 Q5_1 Q5_K; do FILTER+=":QuantMatvec/QuantMatvecType.*/$t"; done
  fi
  t0=$(date +%s)
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=None -DCMAKE_C_FLAGS="-O1 -gline-tables-only" \
    -DCMAKE_CXX_FLAGS="-O1 -gline-tables-only" -DFOCUS_TSAN=ON -DFOCUS_TESTS=ON -DFOCUS_BENCH=OFF \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ >/dev/null
  cmake --build "$BUILD" --target "$TARGET" -j "$JOBS" >/dev/null
  echo "tsan.sh: built $TARGET in $(( $(date +%s) - t0 )) s"
  TESTS="$BUILD/$TARGET"
else
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFOCUS_TSAN=ON -DFOCUS_TESTS=ON -DFOCUS_BENCH=OFF \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ >/dev/null
  cmake --build "$BUILD" --target focus focus_tests -j "$JOBS"
  TESTS="$BUILD/focus_tests"
fi
export FOCUS_DATA="$DATA"
[ "$LEAN" = 1 ] || export FOCUS_BIN="$BUILD/focus"  # (the kernel and CI targets run no binary)
export OMP_NUM_THREADS="$THREADS" OPENBLAS_NUM_THREADS=1 OMP_TOOL_LIBRARIES="$ARCHER"
export TSAN_OPTIONS="halt_on_error=1 ignore_noninstrumented_modules=1 second_deadlock_stack=1"
start=$(date +%s)
"$TESTS" --gtest_filter="$FILTER" --gtest_brief=1
echo "tsan.sh: no ThreadSanitizer report ($OMP_NUM_THREADS threads, filter $FILTER) in $(( $(date +%s) - start )) s"
