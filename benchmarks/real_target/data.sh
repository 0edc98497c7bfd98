#!/usr/bin/env bash
# Step 2: the target's own answers to ShareGPT prompts (its first 16,000 conversations' user turns,
# carried as .whl/sharegpt-16k.jsonl.gz), two passes side by side for REGEN_S seconds: greedy, and
# sampled (T = 0.8, top-p 0.95) for more varied contexts; labels stay the target's argmax in training.
# SIGINT at the cap keeps every finished chunk. ENGINE and CACHE: dflash.regenerate's --engine and
# --cache (engines.sh and regen_probe.py measure them); the default, the slots engine with 512 rows
# over chunks of 4,096 contexts, measured 4.3x transformers' generate on an H100. -> R/regen-all.jsonl, and each pass gzip'd
# into OUT: carried back as .regen/ in a later session (env.sh unpacks it), regeneration resumes
# after the conversations already answered, so the data grows from session to session.
#   REGEN_S=180 bash benchmarks/real_target/data.sh OUT
#   REGEN_S=180 ENGINE=generate CACHE=static BATCH=512 CHUNK=512 bash benchmarks/real_target/data.sh OUT
set -uo pipefail
OUT=$1; mkdir -p "$OUT"
. benchmarks/real_target/env.sh
RG=("${ON_R[@]}" --set data.source=\"$R/sharegpt-16k.jsonl\" --max-turns 2 --max-new-tokens 256 --max-prompt-tokens 768
    --engine ${ENGINE:-slots} --cache ${CACHE:-dynamic} --batch-size ${BATCH:-512} --chunk ${CHUNK:-4096})
T0=$(date +%s)
timeout -s INT ${REGEN_S:-180} python3 -m dflash.regenerate $G -o "$R/regen-greedy.jsonl" "${RG[@]}" > "$OUT/regen-greedy.log" 2>&1 &
timeout -s INT ${REGEN_S:-180} python3 -m dflash.regenerate $G -o "$R/regen-sampled.jsonl" "${RG[@]}" \
  --temperature 0.8 --top-p 0.95 > "$OUT/regen-sampled.log" 2>&1 &
wait
cat "$R"/regen-greedy.jsonl "$R"/regen-sampled.jsonl > "$R/regen-all.jsonl"
echo "data: $(wc -l < "$R/regen-greedy.jsonl") greedy + $(wc -l < "$R/regen-sampled.jsonl") sampled conversations in $(( $(date +%s) - T0 )) s"
for f in "$OUT"/regen-*.log; do tail -n 4 "$f"; done
for p in greedy sampled; do gzip -c "$R/regen-$p.jsonl" > "$OUT/regen-$p.jsonl.gz"; done
