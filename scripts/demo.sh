#!/usr/bin/env bash
# The main job on the default model and text: model summary, a short greedy generation, and
# perplexity of SmolLM2-135M-Instruct on a held-out Gutenberg book at ctx 512.
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
