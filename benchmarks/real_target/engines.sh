#!/usr/bin/env bash
# Regeneration's two answer engines on the same prompts, greedy, one after the other for ENGINE_S
# seconds each (dflash.model.answers: "generate", left-padded batches of BATCH; "continuous",
# transformers' continuous batching over chunks of CHUNK): conversations per second and how many
# answers agree. Needs target.sh's import first. -> OUT/engines.json
#   ENGINE_S=90 bash benchmarks/real_target/engines.sh OUT
set -uo pipefail
OUT=$1; mkdir -p "$OUT"
. benchmarks/real_target/env.sh
S=${ENGINE_S:-90}
RG=("${ON_R[@]}" --set data.source=\"$R/sharegpt-16k.jsonl\" --max-turns 1 --max-new-tokens 256
    --max-prompt-tokens 768)
rm -f "$R"/engine-*.jsonl*
timeout -s INT "$S" python3 -m dflash.regenerate $G -o "$R/engine-generate.jsonl" "${RG[@]}" --engine generate \
  --batch-size ${BATCH:-512} --chunk ${BATCH:-512} > "$OUT/engine-generate.log" 2>&1
timeout -s INT "$S" python3 -m dflash.regenerate $G -o "$R/engine-continuous.jsonl" "${RG[@]}" --engine continuous \
  --chunk ${CHUNK:-4096} > "$OUT/engine-continuous.log" 2>&1
tail -n 2 "$OUT"/engine-*.log
python3 -m benchmarks.real_target.engines "$R/engine-generate.jsonl" "$R/engine-continuous.jsonl" --seconds "$S" \
  --json "$OUT/engines.json"
