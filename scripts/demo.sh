#!/usr/bin/env bash
# The main job on the default model and text: model summary, a short greedy generation, and
# perplexity of SmolLM2-135M-Instruct on a Gutenberg book at ctx 512, then a short Focus
# retrofit (routers only) with its before/after table, and sparse inference with the result; then
# the routers shipped in routers/smollm2-books-fast (blocks of 16 chosen every 16 rows) on a long
# text: perplexity, density and time against dense attention at ctx 8192, and decoding after a
# 7.9K-token prompt.
set -euo pipefail
FOCUS=${1:-build/focus}
DATA=${2:-../shared/data}
BOOK="$DATA/text/pg-1661-the-adventures-of-sherlock-holmes.txt"
[ -f "$BOOK" ] || { echo "demo: $BOOK not found (expected ../shared/data beside the checkout)" >&2; exit 1; }
echo "== focus info smollm2"
"$FOCUS" info smollm2
echo
echo "== focus generate (greedy)"
"$FOCUS" generate --model smollm2 -p "The detective looked at the letter and said" -n 32
echo
echo "== focus eval: perplexity on Sherlock Holmes, ctx 512, first 8192 tokens"
"$FOCUS" eval --model smollm2 --text "$BOOK" --ctx 512 --max-tokens 8192 --json
echo
echo "== focus retrofit: train the routers of the frozen model on two books, validate on a third"
OUT=${FOCUS_DEMO_OUT:-build/demo_routers}
"$FOCUS" retrofit --model smollm2 --train "$BOOK" "$DATA/text/pg-1342-pride-and-prejudice.txt" \
  --valid "$DATA/text/pg-345-dracula.txt" --ctx 1024 --window 64 --groups 16 --dg 16 \
  --steps 12 --batch 2 --lr 5e-3 --warmup 2 --eval-every 0 --valid-windows 4 --out "$OUT"
echo
echo "== focus eval with the trained routers, hard top-2 sparse attention (Dracula, ctx 1024)"
"$FOCUS" eval --model smollm2 --text "$DATA/text/pg-345-dracula.txt" --ctx 1024 --max-tokens 4092 \
  --focus "$OUT" --mode hard --topk 2
echo
ROUTERS="$(cd "$(dirname "$0")/.." && pwd)/routers/smollm2-books-fast"
DRACULA="$DATA/text/pg-345-dracula.txt"
echo "== the shipped routers ($ROUTERS): Dracula (held out), ctx 8192, dense then Focus hard"
"$FOCUS" eval --model smollm2 --text "$DRACULA" --ctx 8192 --max-tokens 8191
"$FOCUS" eval --model smollm2 --text "$DRACULA" --ctx 8192 --max-tokens 8191 --focus "$ROUTERS" --mode hard
echo
echo "== decoding 32 tokens after a 7.9K-token prompt (the start of Dracula): dense, then Focus hard"
TMPD=$(mktemp -d)
trap 'rm -rf "$TMPD"' EXIT
"$FOCUS" prepare "$DRACULA" "$TMPD/dracula.txt" >/dev/null
head -c 32000 "$TMPD/dracula.txt" > "$TMPD/prompt.txt"
"$FOCUS" generate --model smollm2 --prompt-file "$TMPD/prompt.txt" -n 32
echo
"$FOCUS" generate --model smollm2 --prompt-file "$TMPD/prompt.txt" -n 32 --focus "$ROUTERS" --mode hard
