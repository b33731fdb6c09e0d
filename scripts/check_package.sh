#!/usr/bin/env bash
# Checks the installed library as another project sees it: installs BUILD into a temporary
# prefix, configures and builds examples/ against that prefix only (find_package(focus)), and
# runs the example on the stories260K model of the shared data. Fails on any error.
#   scripts/check_package.sh [BUILD] [DATA]      (defaults: build, ../shared/data)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$(cd "${1:-$ROOT/build}" && pwd)
DATA=${2:-$ROOT/../shared/data}
MODEL="$DATA/models/stories260K/stories260K.bin"   # tok512.bin beside it is found by the loader
TEXT="$DATA/text/tinystories-sample-cs336.txt"
for f in "$MODEL" "$TEXT"; do
  [ -f "$f" ] || { echo "check_package: $f not found (pass the shared data folder as the second argument)" >&2; exit 1; }
done
[ -f "$BUILD/CMakeCache.txt" ] || { echo "check_package: $BUILD is not a configured build folder" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "[check_package] installing $BUILD into $tmp/prefix"
cmake --install "$BUILD" --prefix "$tmp/prefix" >/dev/null
for f in lib/libfocus.so include/focus/libfocus.h include/focus/model/model.h \
         lib/cmake/focus/focusConfig.cmake lib/cmake/focus/focusConfigVersion.cmake lib/cmake/focus/focusTargets.cmake; do
  [ -e "$tmp/prefix/$f" ] || { echo "check_package: the install lacks $f" >&2; exit 1; }
done

echo "[check_package] building examples/ against the installed package"
cmake -S "$ROOT/examples" -B "$tmp/examples" -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$tmp/examples" -j "$(nproc)" >/dev/null

echo "[check_package] running the example"
out=$("$tmp/examples/perplexity" "$MODEL" "$TEXT" 128)
echo "$out"
# stories260K was trained on TinyStories: its perplexity there is small (karpathy reports a
# validation loss of 1.30 nats); anything outside (1, 20) means the example did not work.
python3 - "$out" <<'PY'
import re, sys
m = re.search(r"perplexity ([0-9.]+)", sys.argv[1])
if not m or not (1.0 < float(m.group(1)) < 20.0):
    sys.exit("check_package: unexpected output from the example: " + sys.argv[1])
PY
echo "[check_package] ok"
