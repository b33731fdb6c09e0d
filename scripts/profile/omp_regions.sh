#!/usr/bin/env bash
# Where a program's parallel time goes, region by region: builds omp_regions.c into build/, runs
# COMMAND with it preloaded, and prints each OpenMP region's function with its total time, calls
# and time per call, slowest first, then the time outside the regions.
# Usage: scripts/profile/omp_regions.sh [--delay S] [--per N] -- COMMAND ...
#   --delay S  leave out the regions that start in the first S seconds (a prefill, say)
#   --per N    also divide each time by N (decoding steps measured, for time per step)
# Example (a decoding step at depth 8000, after the prefill's 11 s):
#   scripts/profile/omp_regions.sh --delay 13 -- build/focus -t 2 bench model --model smollm2 \
#     --prefill 0 --depth 8000 --gen 64 --reps 20 --focus routers/smollm2-books-fast --mode hard
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
delay=0 per=0
while [ $# -gt 0 ]; do
  case "$1" in
    --delay) delay=$2; shift 2 ;;
    --per) per=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "omp_regions.sh: unknown option $1 (usage: omp_regions.sh [--delay S] [--per N] -- COMMAND ...)" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "omp_regions.sh: no command given" >&2; exit 2; }
mkdir -p "$ROOT/build"
lib="$ROOT/build/omp_regions.so"
if [ ! -f "$lib" ] || [ "$ROOT/scripts/profile/omp_regions.c" -nt "$lib" ]; then
  cc -O2 -shared -fPIC "$ROOT/scripts/profile/omp_regions.c" -o "$lib" -ldl
fi
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT
OMP_REGIONS_DELAY=$delay OMP_REGIONS_OUT=$raw LD_PRELOAD=$lib "$@"
echo "--- OpenMP regions (after ${delay} s) ---"
{ grep -v '^#' "$raw" || true; } | sort -rn | while read -r sec calls file off; do
  name=$(addr2line -f -C -e "$file" "$off" 2>/dev/null | head -n 1 | cut -c1-120)
  awk -v s="$sec" -v c="$calls" -v p="$per" -v n="$name" 'BEGIN {
    line = sprintf("%9.4f s %9d calls %8.2f us/call", s, c, 1e6 * s / c)
    if (p > 0) line = line sprintf(" %8.3f ms/step", 1e3 * s / p)
    print line "  " n }'
done
read -r inside span < <(grep '^#' "$raw" | sed 's/^# //')
awk -v p="$per" -v inside="$inside" -v span="$span" 'BEGIN {
  printf "%.4f s inside the regions, %.4f s from the first one measured to the last\n", inside, span
  printf "outside the regions: %.4f s", span - inside; if (p > 0) printf " (%.3f ms/step)", 1e3 * (span - inside) / p; print "" }'
