#!/usr/bin/env bash
# Cross-checks `focus eval` against the independent numpy forward pass
# (scripts/reference_forward.py, float64) on the first windows of a text: same token ids, same
# windows (BOS + CTX-1 text tokens each, as focus eval makes them). Exits non-zero, saying so,
# when the two mean NLLs differ by more than the tolerance.
#   scripts/verify_ppl.sh [--windows N] [--tol NATS] [--weights MODE] [--prefill-gemm G] MODEL TEXT [CTX] [FOCUS_BIN]
#     --windows N   windows to compare (default 1: quick; each costs one reference pass)
#     --weights M   focus eval --weights M (default f32, the exact path; native keeps the file's
#                   quantised blocks)
#     --prefill-gemm G  focus eval --prefill-gemm G for native weights (default dequant: tiles of
#                   the blocks dequantised on the fly, the same weights as f32; int8 quantises the
#                   activations, which needs a looser --tol, see below)
#     --tol NATS    largest accepted |mean NLL difference| (default 1e-3, see below)
#
# Tolerance. Both passes run the same dequantised weights on the same ids; they differ only by
# rounding (ours float32, the reference float64). A token's NLL is logsumexp(z) - z[target]; both
# terms move by at most max|dz| when the logits z move by dz (logsumexp is 1-Lipschitz in the max
# norm), so the mean NLL over any tokens differs by at most 2 * max|dz|. float32 logits agree
# with float64 to about 1e-4: reference_forward.py in float32 against float64 on SmolLM2 (128
# tokens of Sherlock Holmes, all 49152 logits) gives max|dz| = 7.6e-5 with |z| up to 38, and the
# shared data's manifest expects ~1e-4 for stories260K. With 5x headroom, max|dz| <= 5e-4 gives
# the bound 2 * 5e-4 = 1e-3 nats. Real mistakes (a wrong RoPE base or layout, a missing norm, a
# window off by one token) move the mean NLL by far more than that.
# With --prefill-gemm int8 the activations of every quantised product are rounded to int8 per
# 32-element block (each product within the bound stated in kernels/cpu/quant_matvec.h). That
# moves the mean NLL by 0.003-0.004 nats on WikiText-2 (8192 tokens, ctx 2048: SmolLM2 and Gemma 3
# 270M) and, on one window of Sherlock Holmes (SmolLM2), by 0.006-0.011 nats at ctx 128-512 with
# AVX-512 VNNI (2026-11-25) and by 0.017, 0.0076 and 0.0088 nats at ctx 128, 256 and 512 with AVX2
# (2026-11-29), so CI checks it at ctx 256 with --tol 0.02; a wrong scale, offset or layout moves
# it by far more.
set -euo pipefail
WINDOWS=1 TOL=1e-3 WEIGHTS=f32 GEMM=dequant
while [ $# -gt 0 ]; do
  case "$1" in
    --windows) WINDOWS=${2:?--windows needs a number}; shift 2 ;;
    --tol) TOL=${2:?--tol needs a number}; shift 2 ;;
    --weights) WEIGHTS=${2:?--weights needs native, f32 or bf16}; shift 2 ;;
    --prefill-gemm) GEMM=${2:?--prefill-gemm needs int8 or dequant}; shift 2 ;;
    -*) echo "verify_ppl: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -ge 2 ] || { echo "usage: scripts/verify_ppl.sh [--windows N] [--tol NATS] [--weights MODE] [--prefill-gemm G] MODEL TEXT [CTX] [FOCUS_BIN]" >&2; exit 2; }
MODEL=$1 TEXT=$2 CTX=${3:-512} FOCUS=${4:-build/focus}
case "$WINDOWS" in ''|*[!0-9]*|0) echo "verify_ppl: --windows must be a positive integer, got '$WINDOWS'" >&2; exit 2 ;; esac
case "$CTX" in ''|*[!0-9]*|0|1) echo "verify_ppl: CTX must be an integer >= 2, got '$CTX'" >&2; exit 2 ;; esac
[ -f "$TEXT" ] || { echo "verify_ppl: $TEXT: no such file" >&2; exit 2; }
[ -x "$FOCUS" ] || { echo "verify_ppl: $FOCUS: not an executable (build first, or pass FOCUS_BIN)" >&2; exit 2; }
SCRIPTS=$(cd "$(dirname "$0")" && pwd)
TEXT_TOKENS=$((WINDOWS * (CTX - 1)))
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$FOCUS" prepare "$TEXT" "$tmp/full.txt" 2>/dev/null
# A prefix long enough for the windows (cut on a character boundary).
python3 -c "import sys; open(sys.argv[2],'w').write(open(sys.argv[1]).read()[:8 * $CTX * $WINDOWS])" \
  "$tmp/full.txt" "$tmp/text.txt"
# BOS, then the text tokens focus eval scores; each window is BOS + the next CTX-1 of them.
"$FOCUS" tokenize --model "$MODEL" --bos -p "$(cat "$tmp/text.txt")" > "$tmp/ids.txt"
info=$("$FOCUS" info "$MODEL" --json)
ref=$(python3 - "$SCRIPTS" "$info" "$tmp/ids.txt" "$CTX" "$WINDOWS" <<'PY'
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import reference_forward as rf
info = json.loads(sys.argv[2])
bos, *ids = [int(t) for t in open(sys.argv[3]).read().split()]
ctx, windows = int(sys.argv[4]), int(sys.argv[5])
path = info["path"]
# The file's own BOS id (llama2.c tokenizers: 1), against the one focus tokenize put first.
if path.endswith(".gguf"):
    import gguf
    want_bos = rf._gguf_field(path, gguf.GGUFReader(path), "tokenizer.ggml.bos_token_id", -1)
else:
    want_bos = 1
if bos != want_bos:
    sys.exit(f"verify_ppl: {path}: focus tokenize --bos gave {bos} first, the file's BOS is {want_bos}"
             " (models without a BOS are not supported here)")
need = windows * (ctx - 1)
if len(ids) < need:
    sys.exit(f"verify_ppl: the text has {len(ids)} tokens, {windows} window(s) of {ctx} need {need}")
m = rf.load_gguf(path, np.float64) if path.endswith(".gguf") else rf.load_llama2c(path, np.float64)
nll = []
for w in range(windows):
    window = [bos] + ids[w * (ctx - 1):(w + 1) * (ctx - 1)]
    nll.append(rf.evaluate(m, window, [])[0])
print("%.6f" % float(np.concatenate(nll).mean()))
PY
)
ours=$("$FOCUS" eval --model "$MODEL" --text "$tmp/text.txt" --ctx "$CTX" --max-tokens "$TEXT_TOKENS" --weights "$WEIGHTS" --prefill-gemm "$GEMM" --json 2>/dev/null |
       tail -n 1 | python3 -c 'import json,sys; r=json.load(sys.stdin); print("%.6f %d" % (r["nll"], r["tokens"]))')
read -r ours scored <<<"$ours"
echo "model $MODEL (weights $WEIGHTS, prefill gemm $GEMM) text $(basename "$TEXT") ctx $CTX, $WINDOWS window(s), $scored tokens:" \
     "numpy float64 mean NLL $ref | focus $ours"
python3 - "$ref" "$ours" "$TOL" "$scored" "$TEXT_TOKENS" <<'PY'
import sys
ref, ours, tol = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
scored, expected = int(sys.argv[4]), int(sys.argv[5])
if scored != expected:
    sys.exit(f"verify_ppl: FAIL: focus eval scored {scored} tokens, the reference {expected}")
diff = abs(ref - ours)
if diff > tol:
    sys.exit(f"verify_ppl: FAIL: mean NLLs differ by {diff:.6f} nats (> tolerance {tol:g})")
print(f"verify_ppl: ok (|difference| {diff:.6f} <= {tol:g} nats)")
PY
