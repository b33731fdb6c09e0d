#!/usr/bin/env bash
# Cross-checks `focus eval` against the independent numpy forward pass
# (scripts/reference_forward.py) on the first window of a text: same token ids, same window.
#   scripts/verify_ppl.sh MODEL TEXT [CTX] [FOCUS_BIN]
set -euo pipefail
MODEL=$1 TEXT=$2 CTX=${3:-512} FOCUS=${4:-build/focus}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$FOCUS" prepare "$TEXT" "$tmp/full.txt" 2>/dev/null
# A prefix long enough for the window (cut on a character boundary).
python3 -c "import sys; open(sys.argv[2],'w').write(open(sys.argv[1]).read()[:8 * $CTX])" "$tmp/full.txt" "$tmp/text.txt"
# The window focus eval uses: BOS + the first CTX-1 text tokens.
"$FOCUS" tokenize --model "$MODEL" --bos -p "$(cat "$tmp/text.txt")" > "$tmp/all_ids.txt"
python3 -c "import sys; ids=open(sys.argv[1]).read().split()[:$CTX]; assert len(ids) == $CTX, 'text too short'; open(sys.argv[2],'w').write(','.join(ids))" "$tmp/all_ids.txt" "$tmp/ids.txt"
path=$("$FOCUS" info "$MODEL" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["path"])')
python3 "$(dirname "$0")/reference_forward.py" --gguf "$path" --ids-file "$tmp/ids.txt" --out "$tmp/ref.json" >/dev/null
ref=$(python3 -c "import json; print('%.6f' % json.load(open('$tmp/ref.json'))['mean_nll'])")
ours=$("$FOCUS" eval --model "$MODEL" --text "$tmp/text.txt" --ctx "$CTX" --max-tokens $((CTX - 1)) --json 2>/dev/null |
       tail -n 1 | python3 -c 'import json,sys; print("%.6f" % json.load(sys.stdin)["nll"])')
echo "model $MODEL text $(basename "$TEXT") ctx $CTX: numpy float64 mean NLL $ref | focus $ours"
