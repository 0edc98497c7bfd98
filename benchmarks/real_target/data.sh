#!/usr/bin/env bash
# Step 2: the target's own answers to ShareGPT prompts (its first 16,000 conversations' user turns,
# carried as .whl/sharegpt-16k.jsonl.gz), two passes side by side for REGEN_S seconds: greedy, and
# sampled (T = 0.8, top-p 0.95) for more varied contexts; labels stay the target's argmax in training.
# Each pass stops itself between chunks 10 s before the cap (--time-limit: a chunk that would
# not finish is not begun, so no answered turn is lost); SIGINT at the cap is the backstop.
# ENGINE and CACHE: dflash.regenerate's --engine and --cache (engines.sh and regen_probe.py measure
# them); the default, the slots engine with 512 rows over chunks of 4,096 contexts, measured 4.3x
# transformers' generate on an H100. -> R/regen-all.jsonl, and each pass gzip'd into OUT: carried
# back as .regen/ in a later session (env.sh unpacks it), regeneration resumes after the
# conversations already answered, so the data grows from session to session.
#   REGEN_S=180 bash benchmarks/real_target/data.sh OUT
#   PASSES="sampled t1" REGEN_S=150 bash benchmarks/real_target/data.sh OUT      # once greedy has answered all
#   PASSES="sampled deep" REGEN_S=150 bash benchmarks/real_target/data.sh OUT    # new prompts: turns 3 and 4
#   REGEN_S=180 ENGINE=generate CACHE=static BATCH=512 CHUNK=512 bash benchmarks/real_target/data.sh OUT
# KEEP=64 ends an answer 64 tokens into a repetition loop (--repetition-keep: the slots engine frees
# the row there; 39% of SmolLM2's answer tokens so far lay in loops, 54% of the greedy pass's). A
# file keeps the settings it started with, so only for a pass that starts its file (PASSES=t1 while
# .regen/ holds no regen-t1): a resumed pass given KEEP is refused.
set -uo pipefail
OUT=$1; mkdir -p "$OUT"
. benchmarks/real_target/env.sh
RG=("${ON_R[@]}" --max-new-tokens 256 --engine ${ENGINE:-slots} --cache ${CACHE:-dynamic}
    --batch-size ${BATCH:-512} --chunk ${CHUNK:-4096} ${KEEP:+--repetition-keep $KEEP})
FIRST2=(--set data.source=\"$R/sharegpt-16k.jsonl\" --max-turns 2 --max-prompt-tokens 768)
T0=$(date +%s)
# Each pass answers every prompt once into its own file: greedy, sampled (T = 0.8, top-p 0.95) and t1
# (T = 1, seed 1: more varied answers again, for when the first two have answered every prompt) over
# the first two user turns of sharegpt-16k; deep (T = 0.8, top-p 0.95, seed 1) over up to four user
# turns of each ShareGPT conversation with three or more (9,917 of them, .sgt/sharegpt-deep.jsonl.gz):
# their third and fourth turns are 17,183 human prompts that no two-turn pass reaches.
PASSES=${PASSES:-greedy sampled}
for p in $PASSES; do
  case $p in
    greedy) T=("${FIRST2[@]}") ;;
    sampled) T=("${FIRST2[@]}" --temperature 0.8 --top-p 0.95) ;;
    t1) T=("${FIRST2[@]}" --temperature 1.0 --seed 1) ;;
    deep) T=(--set data.source=\"$R/sharegpt-deep.jsonl\" --max-turns 4 --max-prompt-tokens 1536
             --temperature 0.8 --top-p 0.95 --seed 1) ;;
    *) echo "data: unknown pass $p (greedy, sampled, t1, deep)"; exit 2 ;;
  esac
  timeout -s INT ${REGEN_S:-180} python3 -m dflash.regenerate $G -o "$R/regen-$p.jsonl" "${RG[@]}" "${T[@]}" \
    --time-limit $(( ${REGEN_S:-180} - 10 )) \
    > "$OUT/regen-$p.log" 2>&1 &
done
wait
regen_all
echo "data: $(wc -l "${FILES[@]}" | tr '\n' ' ') conversations, in $(( $(date +%s) - T0 )) s"
for f in "$OUT"/regen-*.log; do tail -n 4 "$f"; done
for f in "${FILES[@]}"; do gzip -c "$f" > "$OUT/$(basename "$f").gz"; done
