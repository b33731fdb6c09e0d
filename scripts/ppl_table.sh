#!/usr/bin/env bash
# Perplexity of the default models on WikiText-2 (raw test) and two Gutenberg books at ctx 512
# and 2048, as JSON lines (one per run) in OUT.
#   scripts/ppl_table.sh OUT [MAX_TOKENS] [FOCUS_BIN] [DATA]
set -euo pipefail
OUT=${1:-ppl_table.jsonl} MAX=${2:-0} FOCUS=${3:-build/focus} DATA=${4:-../shared/data}
texts=("$DATA/bench/wikitext-2/wiki.test.raw" "$DATA/text/pg-1661-the-adventures-of-sherlock-holmes.txt"
       "$DATA/text/pg-345-dracula.txt")
: > "$OUT"
for model in smollm2 gemma3-270m; do
  for ctx in 512 2048; do
    for t in "${texts[@]}"; do
      echo "== $model ctx $ctx $(basename "$t")" >&2
      line=$("$FOCUS" eval --model "$model" --text "$t" --ctx "$ctx" --max-tokens "$MAX" --json | tail -n 1)
      python3 -c "import json,sys; j=json.loads(sys.argv[1]); j['model_name']=sys.argv[2]; j['text']=sys.argv[3]; print(json.dumps(j))" \
        "$line" "$model" "$(basename "$t")" >> "$OUT"
      tail -n 1 "$OUT" >&2
    done
  done
done
