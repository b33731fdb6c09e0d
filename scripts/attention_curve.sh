#!/usr/bin/env bash
# Focus hard attention vs dense causal attention on this CPU for N = 4K ... 256K (D 64, H 8,
# W 256, G 16, k 1 by default), one JSON line per N in OUT. Dense runs once (no warm-up) from
# 32K on, where a single run takes seconds to minutes, and from 256K on without the dense-t
# diagnostic (ten more minutes). NS="..." picks the N.
#   [NS="4096 65536"] scripts/attention_curve.sh OUT [FOCUS_BIN] [extra bench flags...]
set -euo pipefail
OUT=${1:-attention_curve.jsonl} FOCUS=${2:-build/focus}
shift $(( $# >= 2 ? 2 : $# ))
: > "$OUT"
for n in ${NS:-4096 8192 16384 32768 65536 131072 262144}; do
  reps=3 dense=-1 extra=()
  if [ "$n" -ge 32768 ]; then reps=2 dense=1; fi
  if [ "$n" -ge 262144 ]; then extra=(--no-dense-tiles); fi
  echo "== n $n" >&2
  "$FOCUS" bench attention --n "$n" --heads 8 --dim 64 --window 256 --groups 16 --topk 1 \
    --reps "$reps" --dense-reps "$dense" "${extra[@]}" --json "$@" | tail -n 1 >> "$OUT"
  tail -n 1 "$OUT" >&2
done
