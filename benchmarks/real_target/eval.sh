#!/usr/bin/env bash
# Step 4: the last checkpoint of R/run measured. Each line is capped (CAP_S) so the call ends in time:
# dflash.eval plans to end by CAP_S - 10 s from its start (--time-limit: loading counts, and no
# prompt starts that its predicted time would carry past it) and reports the prompts it finished,
# saying how many of how many; `timeout` sends SIGTERM at CAP_S (dflash.eval then finishes the
# prompt under way and still prints its result) and SIGKILL 30 s later, the backstop.
#   0. the GPU tests of the CUDA-graph decode path (capture, replay equal to the eager step);
#   1. this project's decoder (CUDA graphs; its eager rows take minutes on a 30-layer target) beside z-lab's dflash_generate on the
#      same export, prompts and dtype (benchmarks/decode/speed.py: ms per verify step, tau, outputs
#      equal to transformers' generate);
#   2. MT-Bench (80 questions, both turns) and HumanEval (164), 128 tokens, greedy (TEMP=1: and
#      sampled at T = 1 beside it, per category too; 2-3x the time: 3.2x for the 7M target; SET_TREE=32: and each
#      prompt decoded again under tree verification of 32 draft tokens, tree tau beside the chain's,
#      about twice the time again), with the measured
#      speedup over the target alone; the held-out conversations greedy and at T = 1, and under
#      tree verification of TREE draft tokens (measured and teacher-forced; default 32);
#   3. the export (python -m dflash.export; KEEP_EXPORT=1 returns it in parts).
# PARTS picks which run (default all: export tests speed mtbench humaneval heldout profile; also
# bylength, tau by context length), so that
# the whole fits in more than one device call.
#   ZLAB_DFLASH_PATH=... PARTS="export speed mtbench" bash benchmarks/real_target/eval.sh OUT
set -uo pipefail
OUT=$1; mkdir -p "$OUT"
. benchmarks/real_target/env.sh
CK=$(ls -d "$R"/run/checkpoints/step_* | tail -1); echo "eval: $CK"
T0=$(date +%s)
PARTS=" ${PARTS:-export tests speed mtbench humaneval heldout profile} "
on() { [[ "$PARTS" == *" $1 "* ]]; }
# each part's exit status, printed and remembered: the script exits 1 if any part failed, 0 if all
# that ran passed (a part not in PARTS does not count)
FAILED=""
done_() { echo "$1 rc=$2 ($(( $(date +%s) - T0 )) s)"; [ "$2" = 0 ] || FAILED="$FAILED, $1"; }
LIMIT=$(( ${CAP_S:-150} > 40 ? ${CAP_S:-150} - 10 : 30 ))
on export && { python3 -m dflash.export "$CK" -o "$R/export" > "$OUT/export.log" 2>&1; done_ export $?
  cp "$R/export/config.json" "$OUT/export-config.json" 2>/dev/null
  # KEEP_EXPORT=1: the export (bf16, about 39 MB for the 5-layer drafter) comes back as 15 MB parts
  # (a call returns files of at most 16 MiB): `cat export.tar.* | tar -x` rebuilds it here, for a
  # later session's [train].init_from or the peers' decoders
  [ -n "${KEEP_EXPORT:-}" ] && tar -C "$R" -c export | split -b 15m -d - "$OUT/export.tar."; }
on tests && { timeout ${CAP_S:-150} python3 -m pytest -q -m gpu tests/dflash/eval/test_static_target.py \
  tests/dflash/eval/test_static_drafter.py > "$OUT/gpu-tests.log" 2>&1; done_ "gpu tests" $?; tail -3 "$OUT/gpu-tests.log"; }
on speed && { timeout ${CAP_S:-150} python3 -m benchmarks.decode.speed "$CK" --prompts mtbench --num-prompts 8 \
  --max-new-tokens 128 --dtypes bfloat16 --decoders hf_generate,greedy_graphs,dflash_graphs,tree_graphs,zlab --out "$OUT/decode-speed.json" > "$OUT/decode-speed.log" 2>&1
done_ speed $?; tail -12 "$OUT/decode-speed.log"; }
for set in mtbench humaneval; do
  on $set || continue
  timeout -k 30 ${CAP_S:-150} python3 -m dflash.eval "$CK" --prompts $set --max-new-tokens 128 --device cuda \
    --time-limit $LIMIT ${EAGER:+--no-cuda-graphs} ${TEMP:+--temperature $TEMP} ${SET_TREE:+--tree-budget $SET_TREE} \
    --json > "$OUT/eval-$set.json" 2> "$OUT/eval-$set.err"
  done_ "eval $set" $?; tail -4 "$OUT/eval-$set.err"
done
on heldout && { timeout -k 30 ${CAP_S:-150} python3 -m dflash.eval "$CK" --data "${DATA:-$R/regen-all.jsonl}" --num-prompts 32 --max-new-tokens 128 \
  --temperature 1.0 --tree-budget ${TREE:-32} --device cuda --time-limit $LIMIT --json > "$OUT/eval-heldout.json" 2> "$OUT/eval-heldout.err"
done_ "eval held-out" $?; tail -4 "$OUT/eval-heldout.err"; }
# tau by context length: the held-out conversations' last turns as prompts (earlier turns included;
# a run trained with SETS="--set data.join=true --set data.max_length=8192" holds documents many
# conversations deep), up to CTX tokens of context, bucketed <1K / 1-4K / 4-8K in the output
on bylength && { timeout -k 30 ${CAP_S:-150} python3 -m dflash.eval "$CK" --data "${DATA:-$R/regen-all.jsonl}" --prompt-turn last \
  --max-prompt-tokens ${CTX:-8192} --num-prompts 64 --max-new-tokens 128 --device cuda --time-limit $LIMIT --json \
  > "$OUT/eval-bylength.json" 2> "$OUT/eval-bylength.err"
done_ "eval by length" $?; tail -8 "$OUT/eval-bylength.err"; }
on profile && { timeout ${CAP_S:-150} python3 -m benchmarks.decode.profile_eval "$CK" --prompts mtbench --num-prompts 4 --max-new-tokens 128 \
  --dtype bfloat16 --out "$OUT/profile" > "$OUT/profile.log" 2>&1
done_ profile $?; head -c 800 "$OUT/profile/profile.json"; }
[ -z "$FAILED" ] || { echo "eval: failed: ${FAILED#, }"; exit 1; }
