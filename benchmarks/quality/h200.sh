#!/usr/bin/env bash
# The H200 quality run of benchmarks/results/LOG.md ("Proven drafters"): three label strategies, same
# steps, same held-out prompts, against the shipped target. Two phases (one device call each):
#
#   bash benchmarks/quality/h200.sh phase1 OUT   # regenerate 8000 conversations; train "data" and "target_argmax"
#   bash benchmarks/quality/h200.sh phase2 OUT   # train on the regenerated data (STEPS, and LONG); eval; decode speed
#   N=16000 bash benchmarks/quality/h200.sh extend OUT  # answer conversations up to N (resumes REGEN_GZ)
#   N=16000 bash benchmarks/quality/h200.sh long OUT    # one LONG run on that data alone; eval; decode speed
#   VARIANT=dflash2 BS=16 bash benchmarks/quality/h200.sh variant OUT  # one drafter variant at block BS; eval; decode
#
# DFlash vs DFlash2 at equal budgets: two `variant` calls (one device call each, the GPU to itself),
# VARIANT=dflash then VARIANT=dflash2, same STEPS, TRAIN_S, BS, data (SRC=regenerated: REGEN_GZ's
# conversations answered by the target, the phase-2 data; SRC=sharegpt: the raw conversations)
# and prompts. eval-VARIANT_bsBS.json has tau and, for DFlash2, recall@K / oracle top-K / backbone tau.
#
# Every run: examples/sharegpt-target-h200.toml (block 16, 3 drafter layers), the first 8000
# ShareGPT conversations (regenerated: the same 8000 answered by the target), STEPS steps.
# Prompts: benchmarks/quality/prompts.py (held out of the target's pretraining and of every run):
# the first NP held-out records from P_FROM on (default 8000: the same prompts in every phase; extend
# regenerates past them, so it excludes them by source_index).
set -euo pipefail
PHASE=$1; OUT=$2; STEPS=${STEPS:-3000}; N=${N:-8000}; R=${R:-/tmp/quality}
mkdir -p "$R" "$OUT"
export DFLASH_CACHE=$R/cache PYTHONUNBUFFERED=1
G=${G:-examples/sharegpt-target-h200.toml}
COMMON=(--set monitor.wandb=\"disabled\" --set run.steps=$STEPS --set data.max_samples=$N --resume none)
# EXTRA: more --set arguments, word-split (no test runs this script)
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"; COMMON+=("${EXTRA_ARGS[@]}")
NEW=${NEW:-256}; NP=${NP:-32}
train() {  # name, extra --set args...
  local name=$1; shift
  # SIGTERM after TRAIN_S seconds: a graceful stop with a final checkpoint (exit 130), steps logged;
  # --foreground: one signal (without it timeout also signals the group: a second stop, no checkpoint)
  timeout --foreground -s TERM ${TRAIN_S:-400} python3 -m dflash.run $G "${COMMON[@]}" --set run.out_dir=\"$R/$name\" "$@" \
    > "$R/$name.log" 2>&1 || true
}
evaluate() {  # name
  local ck; ck=$(ls -d "$R/$1"/checkpoints/step_* | sort | tail -1)
  python3 -m dflash.eval "$ck" --prompts "$R/prompts.jsonl" --num-prompts $NP --max-new-tokens $NEW --json \
    > "$OUT/eval-$1.json" 2> "$R/eval-$1.err" || { tail -5 "$R/eval-$1.err"; return 1; }
  python3 -c "import json; d = json.load(open('$OUT/eval-$1.json')); print('$1', '$ck', {k: d[k] for k in
    ('tau', 'mean_accepted', 'tau_sim', 'streak_visited', 'streak_all')}, [a if a is None else round(a, 2) for a in d['acc_per_pos']],
    d.get('selector') and {k: d['selector'][k] for k in ('top_k', 'recall', 'oracle_tau', 'backbone_tau')})"
}
P_FROM=${P_FROM:-8000}
python3 -m benchmarks.quality.prompts -o "$R/prompts.jsonl" --first-unused $P_FROM --num $NP
decode() {  # name [tag]: target-only greedy vs draft-and-verify with its last checkpoint -> decode[-tag].json
  local ck; ck=$(ls -d "$R/$1"/checkpoints/step_* | sort | tail -1)
  python3 -m benchmarks.decode.speed "$ck" --prompts "$R/prompts.jsonl" --num-prompts $NP --max-new-tokens $NEW \
    --out "$OUT/decode${2:+-$2}.json" 2>&1 | tail -20
}
case $PHASE in
phase1)
  python3 -m dflash.regenerate $G -o "$R/regenerated.jsonl" --set data.max_samples=$N --max-turns 2 \
      --max-new-tokens $NEW --max-prompt-tokens 768 --batch-size 512 --chunk 2048 > "$R/regen.log" 2>&1 &
  REGEN=$!
  train data --set loss.label=\"data\" &
  A=$!
  sleep ${WAIT_S:-45}   # let the first run write the tokenized cache; the second reuses it
  train target_argmax --set loss.label=\"target_argmax\" &
  B=$!
  wait $REGEN; tail -2 "$R/regen.log"
  wait $A; wait $B
  for n in data target_argmax; do tail -3 "$R/$n.log"; evaluate $n; cp "$R/$n/metrics.jsonl" "$OUT/metrics-$n.jsonl"; done
  gzip -c "$R/regenerated.jsonl" > "$OUT/regenerated.jsonl.gz"; cp "$R/regen.log" "$OUT/";;
phase2)
  gunzip -c "${REGEN_GZ:-.quality/regenerated.jsonl.gz}" > "$R/regenerated.jsonl"
  # the same STEPS as phase 1, and (concurrently) a LONG run: what more steps buy
  train regenerated --set data.source=\"$R/regenerated.jsonl\" --set loss.label=\"target_argmax\" &
  A=$!
  sleep ${WAIT_S:-20}
  train regenerated_long --set data.source=\"$R/regenerated.jsonl\" --set loss.label=\"target_argmax\" \
    --set run.steps=${LONG:-9000} &
  B=$!
  wait $A; wait $B
  for n in regenerated regenerated_long; do
    tail -3 "$R/$n.log"; evaluate $n; cp "$R/$n/metrics.jsonl" "$OUT/metrics-$n.jsonl"
  done
  decode regenerated_long;;
extend)
  [ -f "$R/regenerated.jsonl" ] || gunzip -c "${REGEN_GZ:-.quality/regenerated.jsonl.gz}" > "$R/regenerated.jsonl"
  python3 -m dflash.regenerate $G -o "$R/regenerated.jsonl" --set data.max_samples=$N --max-turns 2 \
      --max-new-tokens $NEW --max-prompt-tokens 768 --batch-size 512 --chunk 2048 \
      --exclude "$R/prompts.jsonl" > "$R/regen.log" 2>&1
  tail -2 "$R/regen.log"; cp "$R/regen.log" "$OUT/regen-extend.log"
  gzip -c "$R/regenerated.jsonl" > "$OUT/regenerated.jsonl.gz";;
long)
  [ -f "$R/regenerated.jsonl" ] || gunzip -c "${REGEN_GZ:-.quality/regenerated.jsonl.gz}" > "$R/regenerated.jsonl"
  train regenerated_long --set data.source=\"$R/regenerated.jsonl\" --set loss.label=\"target_argmax\" \
    --set run.steps=${LONG:-9000}
  tail -3 "$R/regenerated_long.log"; evaluate regenerated_long
  cp "$R/regenerated_long/metrics.jsonl" "$OUT/metrics-regenerated_long.jsonl"
  cp "$R/regenerated_long.log" "$OUT/"
  decode regenerated_long;;
variant)
  V=${VARIANT:-dflash2}; BS=${BS:-16}; name=${V}_bs$BS; SRC=${SRC:-regenerated}
  DATA=()
  if [ "$SRC" = regenerated ]; then
    [ -f "$R/regenerated.jsonl" ] || gunzip -c "${REGEN_GZ:-.quality/regenerated.jsonl.gz}" > "$R/regenerated.jsonl"
    DATA=(--set data.source=\"$R/regenerated.jsonl\")
  fi
  train $name "${DATA[@]}" --set loss.label=\"target_argmax\" --set drafter.variant=\"$V\" --set drafter.block_size=$BS
  tail -3 "$R/$name.log"; evaluate $name
  cp "$R/$name/metrics.jsonl" "$OUT/metrics-$name.jsonl"; cp "$R/$name.log" "$OUT/"
  decode $name $name;;
esac
ls -la "$OUT"
