#!/usr/bin/env bash
# Step 3: the DFlash2 drafter on the regenerated data for TRAIN_S seconds of training
# (run.time_budget_s: the cosine schedule ends on the wall clock, at most STEPS steps; then the final
# checkpoint and evaluation); SETS adds --set arguments; DATA the conversations (default the
# regenerated R/regen-all.jsonl; R/sharegpt-16k.jsonl holds user turns only, its answers "."). -> R/run
#   STEPS=1500 TRAIN_S=420 bash benchmarks/real_target/train.sh OUT
set -uo pipefail
OUT=$1; mkdir -p "$OUT"
. benchmarks/real_target/env.sh
T0=$(date +%s)
timeout --foreground -s INT $(( ${TRAIN_S:-420} + 150 )) python3 -m dflash.run $G "${ON_R[@]}" \
  --set data.source=\"${DATA:-$R/regen-all.jsonl}\" --set run.steps=${STEPS:-20000} --set run.time_budget_s=${TRAIN_S:-420} ${SETS:-} > "$OUT/train.log" 2>&1
echo "train: rc=$? in $(( $(date +%s) - T0 )) s"
tail -14 "$OUT/train.log"
cp "$R/run/metrics.jsonl" "$OUT/metrics-train.jsonl" 2>/dev/null
