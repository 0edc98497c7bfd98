#!/usr/bin/env bash
# The peers side by side: vLLM speculators 0.9 trains DFlash, DFlash2 and XPress drafters of the same
# shape, on the same conversations and target, under the same wall-clock budget as ours; every drafter
# is then decoded by the same decoders on the same held-out prompts.
#
#   bash benchmarks/peers/run.sh cache OUT   # speculators' hidden-state cache (timed apart)
#   bash benchmarks/peers/run.sh train OUT   # `speculators train` per TYPES, BUDGET_S each
#   bash benchmarks/peers/run.sh eval OUT    # dflash.eval and z-lab's decoder on each drafter
#   bash benchmarks/peers/run.sh all OUT
#
# cache: benchmarks/peers/speculators_cache.py over the graph G (its [data] with SETS, the held-out
#        conversations left out as dflash.run leaves them out) -> R/spec-data, then
#        speculators_rows.py (speculators' interpreter) writes its Arrow dataset there.
#        -> OUT/cache.json (conversations, tokens, seconds).
# train: for each of TYPES (default "dflash dflash2 xpress"): speculators' own trainer
#        (`python -m speculators.train`, its default recipe: loss, optimizer, schedule) with the graph's
#        drafter shape (layers, block size, target layer ids, every layer full attention as ours),
#        TOTAL_SEQ_LEN tokens per step (default: the graph's [data].tokens_per_batch), SPEC_STEPS steps
#        for its schedule (default 6000; with PILOT_S > 0, a pilot run of PILOT_S seconds measures its
#        rate and the schedule is set to the steps it makes in BUDGET_S), stopped by SIGINT at BUDGET_S
#        seconds of wall clock (default 300; speculators saves a checkpoint on SIGINT). The process is
#        timed from its start, as ours is; steps done are read from its training_state.json. The newest checkpoint -> R/conv-TYPE, a drafter directory of this project
#        (from_speculators.py). -> OUT/train-TYPE.log, OUT/train-TYPE.json (seconds, steps done, and
#        tok/s: steps x tokens per step over the whole process's seconds, startup included).
# eval:  each R/conv-TYPE (and CKPT, ours, when given): dflash.eval on NP held-out prompts (NEW
#        tokens, greedy and T = 1) -> OUT/eval-TYPE-tT.json; for DFlash and DFlash2 also z-lab's
#        dflash_generate through benchmarks.decode.speed (ZLAB_DFLASH_PATH) -> OUT/speed-TYPE.json.
#
# speculators runs in SPEC_PY (default: python3 with /tmp/peers-pylib first on PYTHONPATH, filled from
# .whl/peers/*.whl: speculators 0.9.0, hs-connectors 0.9.0, datasets and what the device image lacks;
# benchmarks/peers/wheels.sh downloads them). Its trainer needs CUDA: on a CPU only `cache`, one step
# of its DFlash model, `speculators train --dry-run` and the converter run (tests/benchmarks/test_peers.py).
set -uo pipefail
PHASE=${1:-}; OUT=${2:-}; R=${R:-/tmp/peers}; NP=${NP:-32}; NEW=${NEW:-256}
G=${G:-examples/sharegpt-target-h200.toml}
if [ -z "$OUT" ]; then echo "usage: bash benchmarks/peers/run.sh cache|train|eval|all OUT" >&2; exit 2; fi
read -r -a S <<< "${SETS:-}"
mkdir -p "$R" "$OUT"
export PYTHONUNBUFFERED=1
if [ -z "${SPEC_PY:-}" ]; then
  SPEC_PY=python3
  if compgen -G ".whl/peers/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/peers-pylib .whl/peers/*.whl > "$R/pip.log" 2>&1
  fi
  export SPEC_PYTHONPATH=/tmp/peers-pylib
fi
spec() { PYTHONPATH=${SPEC_PYTHONPATH:-}${PYTHONPATH:+:$PYTHONPATH} "$SPEC_PY" "$@"; }
ready() {  # speculators' trainer and datasets importable, or one line saying what to carry
  spec -c "import datasets, speculators.train.cli" 2> "$R/spec-import.err" && return 0
  echo "peers: $SPEC_PY cannot import speculators' trainer ($(tail -1 "$R/spec-import.err")): carry" \
       "benchmarks/peers/wheels.sh's wheels in .whl/peers (pyarrow and pandas apart, ARROW=1)" >&2
  return 1
}
field() { python3 -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$R/spec-data/cache.json" "$1"; }

cache() {
  ready || return 1
  rm -rf "$R/spec-data"
  python3 -m benchmarks.peers.speculators_cache "$G" -o "$R/spec-data" "${S[@]}" || return 1
  spec benchmarks/peers/speculators_rows.py "$R/spec-data" || return 1
  cp "$R/spec-data/cache.json" "$OUT/cache.json"
}

global_step() {  # the newest training_state.json under a speculators save path (its global_step)
  python3 - "$1" <<'EOF'
import json, sys
from pathlib import Path
found = sorted(Path(sys.argv[1]).glob("*/training_state.json"), key=lambda p: p.stat().st_mtime)
print(json.loads(found[-1].read_text())["global_step"] if found else "")
EOF
}

run_spec() {  # TYPE SECONDS MAX_STEPS [SUFFIX]: speculators' trainer, SIGINT (it saves) at SECONDS
  local t=$1 secs=$2 steps=$3 sfx=${4:+-$4} nl ids full
  nl=$(field drafter_layers); ids=$(field target_layer_ids | tr -d '[],')
  full=$(seq -s ' ' 0 $(( nl - 1 )))
  rm -rf "$R/spec-$t$sfx"
  # shellcheck disable=SC2086  # ids, full and SPEC_ARGS are space-separated lists
  timeout --foreground -s INT -k 180 "$secs" env PYTHONPATH="${SPEC_PYTHONPATH:-}${PYTHONPATH:+:$PYTHONPATH}" \
    "$SPEC_PY" -m speculators.train --speculator-type "$t" --verifier-name-or-path "$(field target)" \
    --data-path "$R/spec-data" --num-layers "$nl" --target-layer-ids $ids --block-size "$(field block_size)" \
    --full-attention-indices $full --total-seq-len "${TOTAL_SEQ_LEN:-$(field tokens_per_batch)}" \
    --max-steps "$steps" --epochs 1000 --train-data-ratio 0.99 --seed 0 \
    --save-path "$R/spec-$t$sfx" --log-dir "$R/spec-$t$sfx-logs" --logger "" ${SPEC_ARGS:-} \
    > "$R/train-$t$sfx.log" 2>&1 < /dev/null
}

train() {
  local t0 rc ck
  ready || return 1
  for t in ${TYPES:-dflash dflash2 xpress}; do
    local steps=${SPEC_STEPS:-6000}
    rm -rf "$R/conv-$t"
    if [ "${PILOT_S:-0}" -gt 0 ]; then  # its schedule should end at the budget: steps from a pilot's rate
      run_spec "$t" "$PILOT_S" 1000000 pilot
      local done_steps; done_steps=$(global_step "$R/spec-$t-pilot")
      [ "${done_steps:-0}" -gt 0 ] && steps=$(( done_steps * ${BUDGET_S:-300} / PILOT_S ))
      echo "speculators $t pilot: ${done_steps:-no} steps in $PILOT_S s -> $steps steps for ${BUDGET_S:-300} s"
    fi
    t0=$(date +%s.%N)
    run_spec "$t" "${BUDGET_S:-300}" "$steps"
    rc=$?
    ck=$(ls -td "$R/spec-$t"/*/ 2>/dev/null | while read -r d; do [ -f "$d/config.json" ] && echo "$d" && break; done)
    python3 - "$OUT/train-$t.json" "$t" "$rc" "$t0" "$(date +%s.%N)" "${ck:-}" "$steps" "$(global_step "$R/spec-$t")" \
      "${TOTAL_SEQ_LEN:-$(field tokens_per_batch)}" <<'EOF'
import json, sys
out, kind, rc, t0, t1, ck, sched, done, seq = sys.argv[1:10]
secs, done = float(t1) - float(t0), int(done) if done else None
json.dump({"type": kind, "rc": int(rc), "seconds": secs, "checkpoint": ck or None, "schedule_steps": int(sched),
           "steps_done": done, "tokens_per_step": int(seq),  # packed, padding included, as our tokens_per_batch
           "tok_s": done * int(seq) / secs if done else None}, open(out, "w"), indent=1)
EOF
    grep -v "it/s\]" "$R/train-$t.log" | tail -40 > "$OUT/train-$t.log"
    echo "speculators $t rc=$rc checkpoint=${ck:-none}"
    [ -n "${ck:-}" ] && python3 -m benchmarks.peers.from_speculators "$G" "$ck" -o "$R/conv-$t" "${S[@]}"
  done
}

evaluate() {
  [ -f "$R/prompts.jsonl" ] || cp .whl/prompts.jsonl "$R/prompts.jsonl" 2>/dev/null \
    || python3 -m benchmarks.quality.prompts -o "$R/prompts.jsonl" --first-unused 8000 --num "$NP"
  local names=() d
  for t in ${TYPES:-dflash dflash2 xpress}; do [ -d "$R/conv-$t" ] && names+=("$t=$R/conv-$t"); done
  [ -n "${CKPT:-}" ] && names+=("ours=$CKPT")
  for nd in "${names[@]}"; do
    name=${nd%%=*}; d=${nd#*=}
    for temp in ${EVAL_TEMPS:-0 1}; do
      python3 -m dflash.eval "$d" --prompts "$R/prompts.jsonl" --num-prompts "$NP" --max-new-tokens "$NEW" \
        --temperature "$temp" --seed 0 --no-speedup --json > "$OUT/eval-$name-t$temp.json" 2> "$R/eval-$name.err" \
        || tail -3 "$R/eval-$name.err"
    done
    if [ "$(python3 -c "import json; print(json.load(open('$d/drafter_config.json'))['variant'])")" != xpress ]; then
      python3 -m benchmarks.decode.speed "$d" --prompts "$R/prompts.jsonl" --num-prompts "${SPEED_NP:-8}" \
        --max-new-tokens "${SPEED_NEW:-128}" --dtypes bfloat16 --out "$OUT/speed-$name.json" > "$R/speed-$name.log" 2>&1 \
        || tail -3 "$R/speed-$name.log"
    fi
    python3 -c "import json; d = json.load(open('$OUT/eval-$name-t0.json')); print('$name', {k: d.get(k) for k in ('tau', 'mean_accepted')})"
  done
}

case $PHASE in
  cache) cache ;;
  train) train ;;
  eval) evaluate ;;
  all) cache && train && evaluate ;;
  *) echo "usage: bash benchmarks/peers/run.sh cache|train|eval|all OUT" >&2; exit 2 ;;
esac
