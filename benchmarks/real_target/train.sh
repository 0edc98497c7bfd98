#!/usr/bin/env bash
# Step 3: the DFlash2 drafter on the regenerated data -> R/run. SETS adds --set arguments; DATA the
# conversations (default R/regen-all.jsonl, every regenerated pass's answers in R; R/sharegpt-16k.jsonl
# holds user turns only, its answers ".").
#
# In one device call (at most 10 minutes): TRAIN_S seconds of training (run.time_budget_s: the
# cosine schedule ends on the wall clock, at most STEPS steps; then the final checkpoint and
# evaluation):
#   STEPS=20000 TRAIN_S=420 bash benchmarks/real_target/train.sh OUT
# Across two calls on a warm machine (R stays): one schedule of STEPS steps (size it from a measured
# rate: about 4.9 steps/s for SmolLM2 on an H100), the first call stopped by SIGINT after STOP_S
# seconds (drained, final checkpoint), the second resuming it (RESUME=auto) with a time budget that
# ends the same cosine on its clock:
#   STEPS=5000 STOP_S=540 bash benchmarks/real_target/train.sh OUT
#   STEPS=5000 TRAIN_S=500 RESUME=auto bash benchmarks/real_target/train.sh OUT
# INIT=1 on the first call: the drafter starts from an earlier session's (carried .drafter/ parts).
set -uo pipefail
OUT=$1; mkdir -p "$OUT"
. benchmarks/real_target/env.sh
# A fresh run trains on every pass's answers present in R, carried ones too (a call may bring a pass's
# file that data.sh never saw); a resumed run keeps the file its first call trained on.
[ -z "${DATA:-}" ] && [ "${RESUME:-none}" = none ] && regen_all
[ -z "${STOP_S:-}" ] && TRAIN_S=${TRAIN_S:-420}   # one call: the budget ends the schedule
BUDGET=(); [ -n "${TRAIN_S:-}" ] && BUDGET=(--set run.time_budget_s=$TRAIN_S)
# INIT=1: a fresh run starts from the drafter of an earlier session ([train].init_from: its weights,
# a fresh optimizer and schedule), rebuilt from the parts env.sh gathered; an incomplete set stops here
if [ -n "${INIT:-}" ] && [ "${RESUME:-none}" = none ]; then
  rm -rf "$R/init" && mkdir -p "$R/init"
  cat "$R"/init-parts/export.tar.* 2>/dev/null | tar -x -C "$R/init" && [ -f "$R/init/export/model.safetensors" ] || {
    echo "train: INIT=1 but the parts in $R/init-parts ($(ls "$R/init-parts" 2>/dev/null | tr '\n' ' ')) do not make an export: carry every .drafter/export.tar.* first"; exit 1; }
  BUDGET+=(--set train.init_from=\"$R/init/export\")
fi
CAP=${STOP_S:-$(( ${TRAIN_S:-420} + 150 ))}
T0=$(date +%s)
timeout --foreground -s INT $CAP python3 -m dflash.run $G "${ON_R[@]}" --set run.resume=\"${RESUME:-none}\" \
  --set data.source=\"${DATA:-$R/regen-all.jsonl}\" --set run.steps=${STEPS:-20000} "${BUDGET[@]}" ${SETS:-} > "$OUT/train.log" 2>&1
echo "train: rc=$? in $(( $(date +%s) - T0 )) s"
tail -14 "$OUT/train.log"
cp "$R/run/metrics.jsonl" "$OUT/metrics-train.jsonl" 2>/dev/null
