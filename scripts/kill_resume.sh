#!/usr/bin/env bash
# Kill anywhere: a training run killed with SIGKILL at random moments (during a step, a
# validation, a checkpoint write) and resumed each time ends with the same bits as a run never
# interrupted, same seed and threads. Then a checkpoint write that fails (file-size limit) must
# leave the previous checkpoint intact and say so clearly, and so must a resume in a folder it may
# not write to (refused at its first write, before any step).
#   scripts/kill_resume.sh [--kills N] [--trainers retrofit,lora,train] FOCUS_BIN DATA_DIR
# Trainers: focus retrofit (routers) and focus lora (adapters) on the stories260K model, focus
# train (a small Llama-style model with Focus routers, from scratch, with stories260K's
# tokenizer); three Gutenberg books of DATA_DIR (../shared/data). Exits
# non-zero, saying why, on any difference. Prints one line per trainer: kills, resumes, result.
set -euo pipefail
KILLS=20 TRAINERS=retrofit,lora,train STEPS=120
while [ $# -gt 0 ]; do
  case "$1" in
    --kills) KILLS=${2:?--kills needs a number}; shift 2 ;;
    --trainers) TRAINERS=${2:?--trainers needs a list}; shift 2 ;;
    *) break ;;
  esac
done
[ $# -eq 2 ] || { echo "usage: scripts/kill_resume.sh [--kills N] [--trainers retrofit,lora,train] FOCUS_BIN DATA_DIR" >&2; exit 2; }
FOCUS=$(realpath "$1")
DATA=$(realpath "$2")
MODEL="$DATA/models/stories260K/stories260K.bin"
for f in "$MODEL" "$DATA/text/pg-345-dracula.txt"; do
  [ -e "$f" ] || { echo "kill_resume: $f: missing" >&2; exit 1; }
done
TMP=$(mktemp -d)
trap 'chmod -R u+w "$TMP" 2>/dev/null; rm -rf "$TMP"' EXIT

# focus train's model: two layers of width 64, grouped-query attention (4 heads, 2 kv heads).
cat > "$TMP/config.json" <<'JSON'
{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": true}
JSON
common=(--train "$DATA/text/pg-1661-the-adventures-of-sherlock-holmes.txt" "$DATA/text/pg-345-dracula.txt"
        --valid "$DATA/text/pg-1342-pride-and-prejudice.txt" --ctx 128 --steps "$STEPS" --batch 2 --warmup 4
        --eval-every 8 --valid-windows 4 --checkpoint-seconds 0 --seed 11)
args_of() {  # sets extra: the trainer's own flags
  case "$1" in
    retrofit) extra=(--model "$MODEL" --window 16 --groups 8 --dg 16 --lr 3e-3) ;;
    lora) extra=(--model "$MODEL" --rank 4 --lr 1e-3) ;;
    train) extra=(--config "$TMP/config.json" --tokenizer "$DATA/models/stories260K/tok512.bin" --lr 3e-3
                  --attention focus --window 16 --groups 4 --balance swav) ;;
    *) extra=() ;;
  esac
}
outputs_of() {
  case "$1" in
    retrofit) echo router.safetensors focus.json ;;
    lora) echo lora.safetensors lora.json ;;
    train) echo model/model.safetensors model/config.json routers/router.safetensors routers/focus.json ;;
  esac
}

steps_logged() { cat "$out/metrics.jsonl" 2>/dev/null | grep -c grad_norm || true; }

status=0
for trainer in ${TRAINERS//,/ }; do
  args_of "$trainer"
  [ ${#extra[@]} -gt 0 ] || { echo "kill_resume: unknown trainer $trainer" >&2; exit 2; }
  ref="$TMP/$trainer-ref" out="$TMP/$trainer-killed"
  "$FOCUS" -t 2 "$trainer" "${common[@]}" "${extra[@]}" --out "$ref" > "$TMP/ref.log" 2>&1 ||
    { cat "$TMP/ref.log" >&2; echo "kill_resume: the reference $trainer run failed" >&2; exit 1; }
  kills=0 runs=0 done=0 at=""
  while [ $done -eq 0 ]; do
    resume=()
    [ -e "$out/checkpoint.safetensors" ] && resume=(--resume)
    runs=$((runs + 1))
    "$FOCUS" -t 2 "$trainer" "${common[@]}" "${extra[@]}" --out "$out" "${resume[@]}" > "$TMP/run.log" 2>&1 &
    pid=$!
    if [ $kills -lt "$KILLS" ]; then
      # Kill after a random number of further steps (0 .. STEPS/N: N kills spread over about half
      # the run; 0 lands in the start-up validation), then a random few milliseconds more, so the
      # signal falls anywhere in a step, a validation or a checkpoint write.
      target=$(( $(steps_logged) + RANDOM % (STEPS / KILLS + 1) ))
      while kill -0 "$pid" 2>/dev/null && [ "$(steps_logged)" -lt "$target" ]; do sleep 0.005; done
      sleep "$(awk -v r=$RANDOM 'BEGIN { printf "%.3f", 0.03 * r / 32768 }')"
      if kill -9 "$pid" 2>/dev/null; then
        wait "$pid" 2>/dev/null || true
        kills=$((kills + 1))
        at+=" $(steps_logged)"
        continue
      fi
    fi
    if wait "$pid"; then done=1; else
      cat "$TMP/run.log" >&2
      echo "kill_resume: $trainer: a resumed run failed (after $kills kills)" >&2
      exit 1
    fi
  done
  same=1
  for f in $(outputs_of "$trainer"); do
    cmp -s "$ref/$f" "$out/$f" || { same=0; echo "kill_resume: $trainer: $f differs from the uninterrupted run" >&2; }
  done
  if [ $same -eq 1 ]; then
    echo "$trainer: $kills SIGKILLs, $runs runs, outputs bitwise identical to the uninterrupted run ($(outputs_of "$trainer"))"
    echo "$trainer: steps logged when each kill landed:$at (of ${STEPS})"
  else
    status=1
  fi

  # A checkpoint write that fails: the file-size limit below the checkpoint's size (SIGXFSZ
  # ignored, so the write returns an error instead of killing the process).
  fail_dir="$TMP/$trainer-full"
  # (--stop-after ends a run as an interruption: a non-zero exit with its checkpoint written)
  "$FOCUS" -t 2 "$trainer" "${common[@]}" "${extra[@]}" --out "$fail_dir" --stop-after 3 > /dev/null 2>&1 || true
  [ -e "$fail_dir/checkpoint.safetensors" ] || { echo "kill_resume: $trainer: --stop-after 3 wrote no checkpoint" >&2; exit 1; }
  cp "$fail_dir/checkpoint.safetensors" "$TMP/before.safetensors"
  limit_kb=$(( $(stat -c %s "$fail_dir/checkpoint.safetensors") / 2048 ))
  set +e
  (trap '' XFSZ; ulimit -f "$limit_kb"; "$FOCUS" -t 2 "$trainer" "${common[@]}" "${extra[@]}" --out "$fail_dir" --resume --stop-after 2) \
    > "$TMP/full.log" 2>&1
  rc=$?
  set -e
  msg=$(grep -i "error" "$TMP/full.log" | tail -1 || true)
  if [ $rc -ne 0 ] && cmp -s "$TMP/before.safetensors" "$fail_dir/checkpoint.safetensors" && [ -n "$msg" ]; then
    echo "$trainer: failed checkpoint write (ulimit -f ${limit_kb}): exit $rc, previous checkpoint intact; message: $msg"
  else
    echo "kill_resume: $trainer: failed checkpoint write: exit $rc, message '$msg', previous checkpoint" \
         "$(cmp -s "$TMP/before.safetensors" "$fail_dir/checkpoint.safetensors" && echo intact || echo CHANGED)" >&2
    status=1
  fi

  # A resume in a folder the run may not write to (root writes anyway, so as user nobody there): it
  # must stop at its first write with an error naming the folder, the checkpoint untouched.
  as_user=()
  if [ "$(id -u)" = 0 ]; then
    if ! command -v setpriv > /dev/null; then
      echo "$trainer: read-only folder not tried (running as root without setpriv)"; continue; fi
    as_user=(setpriv --reuid=65534 --regid=65534 --clear-groups)
    chmod 755 "$TMP"
    chmod -R a+rX "$TMP"
    # nobody must be able to run the binary and read the data (not so when they live in root's home)
    if ! "${as_user[@]}" "$FOCUS" --help > /dev/null 2>&1 ||
       ! "${as_user[@]}" test -r "$MODEL" -a -r "$DATA/models/stories260K/tok512.bin" -a -r "$TMP/config.json" \
         -a -r "$DATA/text/pg-1661-the-adventures-of-sherlock-holmes.txt" -a -r "$DATA/text/pg-345-dracula.txt" \
         -a -r "$DATA/text/pg-1342-pride-and-prejudice.txt" -a -r "$fail_dir/checkpoint.safetensors"; then
      echo "$trainer: read-only folder not tried (user nobody cannot run $FOCUS or read its data and checkpoint)"; continue
    fi
  fi
  chmod -R a-w "$fail_dir"
  set +e
  "${as_user[@]}" "$FOCUS" -t 2 "$trainer" "${common[@]}" "${extra[@]}" --out "$fail_dir" --resume --stop-after 2 \
    > "$TMP/ro.log" 2>&1
  rc=$?
  set -e
  chmod -R u+w "$fail_dir"
  msg=$(grep -i "error: $fail_dir/.*Permission denied" "$TMP/ro.log" | tail -1 || true)
  if [ $rc -ne 0 ] && cmp -s "$TMP/before.safetensors" "$fail_dir/checkpoint.safetensors" && [ -n "$msg" ]; then
    echo "$trainer: read-only folder: exit $rc, previous checkpoint intact; message: $msg"
  else
    cat "$TMP/ro.log" >&2
    echo "kill_resume: $trainer: read-only folder: exit $rc, message '$msg', previous checkpoint" \
         "$(cmp -s "$TMP/before.safetensors" "$fail_dir/checkpoint.safetensors" && echo intact || echo CHANGED)" >&2
    status=1
  fi
done
exit $status
