#!/usr/bin/env bash
# The peers side by side: vLLM speculators 0.9 (DFlash, DFlash2, XPress) and SpecForge 0.2 (DFlash)
# train drafters of the same shape, on the same conversations and target, under the same wall-clock
# budget as ours; every drafter is then decoded by the same decoders on the same held-out prompts.
#
#   bash benchmarks/peers/run.sh cache OUT   # the peers' hidden-state caches (timed apart)
#   bash benchmarks/peers/run.sh train OUT   # each peer's own trainer, BUDGET_S each
#   bash benchmarks/peers/run.sh eval OUT    # dflash.eval and z-lab's decoder on each drafter
#   bash benchmarks/peers/run.sh all OUT
#
# PEERS (default "ours speculators specforge") chooses who trains; TYPES (default "dflash dflash2
# xpress") speculators' drafter types.
#
# cache: benchmarks/peers/cache.py over the graph G (its [data] with SETS, the held-out conversations
#        left out as dflash.run leaves them out) -> R/peer-data/{speculators,specforge}, and the
#        drafter shape as a public-layout config, R/peer-data/draft_config.json; then
#        speculators_rows.py (speculators' interpreter) writes its Arrow dataset.
#        -> OUT/cache.json (conversations, tokens, seconds).
# train: ours: `python -m dflash.run G` with SETS and OURS_SETS (default: the headline's DFlash2 recipe,
#          compiled), a schedule of OURS_STEPS (default 6000), stopped gracefully by SIGTERM at BUDGET_S
#          (a final checkpoint); tok/s the median of its windows after the first two.
#        each peer's own recipe (loss, optimizer, schedule) with the graph's drafter shape (layers,
#        block size, target layer ids, every layer full attention as ours) and batch
#        ([data].tokens_per_batch tokens per step), for BUDGET_S seconds of wall clock (default 300),
#        the process timed from its start, as ours is. Its schedule runs SPEC_STEPS / SF_STEPS steps
#        (default 6000), or, with PILOT_S > 0, as many as a pilot run of PILOT_S seconds says it makes
#        in BUDGET_S.
#        * speculators (`python -m speculators.train`, per TYPES): stopped by SIGINT at BUDGET_S (it
#          saves a checkpoint on SIGINT); steps done from its training_state.json.
#        * SpecForge (`python -m specforge.cli train`, the config specforge_config.py writes:
#          strategy dflash, the drafter built from draft_config.json): stopped by SIGTERM at BUDGET_S, which saves nothing, so it also saves
#          every SF_SAVE_EVERY steps (default 250); exported by its own `specforge.export.to_hf`.
#        The newest checkpoint -> R/conv-NAME (NAME: speculators-TYPE, specforge-dflash), a drafter
#        directory of this project (convert.py). -> OUT/train-NAME.{log,json} (rc: 124 when stopped at
#        the budget; seconds, the stop's drain and last save included; steps done; tok/s: steps x
#        tokens per step over the whole process's seconds, startup included).
# eval:  each R/conv-NAME (ours: its last checkpoint; CKPT, another of ours, when given): dflash.eval on NP held-out prompts (NEW
#        tokens, greedy and T = 1) -> OUT/eval-NAME-tT.json; for DFlash and DFlash2 also z-lab's
#        dflash_generate through benchmarks.decode.speed (ZLAB_DFLASH_PATH) -> OUT/speed-NAME.json.
#
# Each peer runs in its own interpreter and path, the device image's python3 by default:
# SPEC_PY / SPEC_PYTHONPATH (default /tmp/peers-pylib, filled from .whl/peers/*.whl) and SF_PY /
# SF_PYTHONPATH (default /tmp/specforge-pylib, from .whl/specforge/*.whl: SpecForge pins
# transformers 5.8.1); benchmarks/peers/wheels.sh downloads both. Both trainers need CUDA: on a CPU,
# the caches, their read-back by each peer's own reader, one step of speculators' DFlash model,
# `speculators train --dry-run`, SpecForge's config resolution and the converter run
# (tests/benchmarks/test_peers.py).
set -uo pipefail
PHASE=${1:-}; OUT=${2:-}; R=${R:-/tmp/peers}; NP=${NP:-32}; NEW=${NEW:-256}
G=${G:-examples/sharegpt-target-h200.toml}
if [ -z "$OUT" ]; then echo "usage: bash benchmarks/peers/run.sh cache|train|eval|all OUT" >&2; exit 2; fi
read -r -a S <<< "${SETS:-}"
PEERS=${PEERS:-ours speculators specforge}
D=$R/peer-data
mkdir -p "$R" "$OUT"
export PYTHONUNBUFFERED=1
install() {  # wheel dir, target dir: the carried wheels, once per machine
  if compgen -G "$1/*.whl" > /dev/null && [ ! -d "$2" ]; then
    python3 -m pip install -q --no-index --no-deps --target "$2" "$1"/*.whl > "$R/pip-$(basename "$2").log" 2>&1
  fi
}
if [ -z "${SPEC_PY:-}" ]; then SPEC_PY=python3; install .whl/peers /tmp/peers-pylib; fi
if [ -z "${SF_PY:-}" ]; then SF_PY=python3; install .whl/specforge /tmp/specforge-pylib; fi
SPEC_PYTHONPATH=${SPEC_PYTHONPATH:-/tmp/peers-pylib}
SF_PYTHONPATH=${SF_PYTHONPATH:-/tmp/specforge-pylib}
spec() { PYTHONPATH=$SPEC_PYTHONPATH${PYTHONPATH:+:$PYTHONPATH} "$SPEC_PY" "$@"; }
forge() { PYTHONPATH=$SF_PYTHONPATH${PYTHONPATH:+:$PYTHONPATH} "$SF_PY" "$@"; }
wants() { [[ " $PEERS " == *" $1 "* ]]; }
ready() {  # each peer's trainer importable, or one line saying what to carry
  local ok=0
  if wants speculators && ! spec -c "import datasets, speculators.train.cli" 2> "$R/spec-import.err"; then
    echo "peers: $SPEC_PY cannot import speculators' trainer ($(tail -1 "$R/spec-import.err")): carry" \
         "benchmarks/peers/wheels.sh's wheels in .whl/peers (pyarrow and pandas apart, ARROW=1)" >&2; ok=1
  fi
  if wants specforge && ! forge -c "import accelerate, specforge.cli, specforge.export.to_hf" 2> "$R/sf-import.err"; then
    echo "peers: $SF_PY cannot import SpecForge's trainer ($(tail -1 "$R/sf-import.err")): carry" \
         "benchmarks/peers/wheels.sh's wheels in .whl/specforge" >&2; ok=1
  fi
  return $ok
}
field() { python3 -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$D/cache.json" "$1"; }
seconds_since() { python3 -c "import sys, time; print(time.time() - float(sys.argv[1]))" "$1"; }

cache() {
  ready || return 1
  local p peer_args=()
  for p in $PEERS; do [ "$p" != ours ] && peer_args+=(--peer "$p"); done
  [ ${#peer_args[@]} -gt 0 ] || return 0  # ours reads the graph's data itself
  rm -rf "$D"
  python3 -m benchmarks.peers.cache "$G" -o "$D" "${peer_args[@]}" "${S[@]}" || return 1
  if wants speculators; then spec benchmarks/peers/speculators_rows.py "$D/speculators" || return 1; fi
  cp "$D/cache.json" "$OUT/cache.json"
}

record() {  # NAME RC T0 CHECKPOINT SCHEDULE_STEPS STEPS_DONE LOG [TOKENS_PER_STEP]: OUT/train-NAME.{json,log}
  python3 - "$OUT/train-$1.json" "$1" "$2" "$(seconds_since "$3")" "$4" "$5" "$6" \
    "${8:-${TOTAL_SEQ_LEN:-$(field tokens_per_batch)}}" <<'EOF'
import json, sys
out, name, rc, secs, ck, sched, done, seq = sys.argv[1:9]
secs, done = float(secs), int(done) if done else None
json.dump({"name": name, "rc": int(rc), "seconds": secs, "checkpoint": ck or None, "schedule_steps": int(sched),
           "steps_done": done, "tokens_per_step": int(seq),  # packed, padding included, as our tokens_per_batch
           "tok_s": done * int(seq) / secs if done else None}, open(out, "w"), indent=1)
EOF
  grep -v "it/s\]" "$7" | tail -40 > "$OUT/train-$1.log"
  echo "$1 rc=$2 checkpoint=${4:-none} steps=${6:-?}"
}

pilot_steps() {  # NAME DONE DEFAULT: the schedule's steps for BUDGET_S from a pilot's DONE steps in PILOT_S (DEFAULT without any)
  local steps=$3
  [ "${2:-0}" -gt 0 ] && steps=$(( $2 * ${BUDGET_S:-300} / PILOT_S ))
  echo "$1 pilot: ${2:-no} steps in $PILOT_S s -> $steps steps for ${BUDGET_S:-300} s" >&2
  echo "$steps"
}

# --- ours ------------------------------------------------------------------------------------------
ours_train() {  # dflash.run of the graph for BUDGET_S: the whole process timed, as the peers'
  local name=ours t0 rc ck steps
  rm -rf "$R/$name" "$R/conv-$name"
  read -r -a O <<< "${OURS_SETS:---set drafter.variant=\"dflash2\" --set drafter.compile=true}"
  t0=$(date +%s.%N)
  timeout --foreground -s TERM -k 180 "${BUDGET_S:-300}" python3 -m dflash.run "$G" "${S[@]}" "${O[@]}" \
    --set run.steps="${OURS_STEPS:-6000}" --set checkpoint.every=0 --set monitor.wandb=\"disabled\" \
    --set run.out_dir=\"$R/$name\" --resume none > "$R/$name.log" 2>&1 < /dev/null
  rc=$?
  ck=$(ls -d "$R/$name"/checkpoints/step_* 2>/dev/null | sort | tail -1)
  steps=${ck##*step_}
  record "$name" "$rc" "$t0" "${ck:-}" "${OURS_STEPS:-6000}" "${steps:+$((10#$steps))}" "$R/$name.log" \
    "$(python3 -c "import sys; from dflash.run.config import load_config
print(load_config(sys.argv[1], [a for a in sys.argv[2:] if a]).data.tokens_per_batch)" "$G" "${S[@]/#--set/}" \
      2>/dev/null)"
  python3 - "$OUT/train-$name.json" "$R/$name/metrics.jsonl" <<'EOF'
import json, statistics, sys
rec = json.load(open(sys.argv[1]))
try:
    w = [json.loads(line) for line in open(sys.argv[2]) if '"train"' in line]
    t = [x["tok_s"] for x in w[2:] if x.get("tok_s")]
    rec["tok_s_windows_median"] = statistics.median(t) if t else None
except OSError:
    rec["tok_s_windows_median"] = None
json.dump(rec, open(sys.argv[1], "w"), indent=1)
EOF
  [ -n "${ck:-}" ] && ln -sfn "$ck" "$R/conv-$name"
}

# --- speculators -----------------------------------------------------------------------------------
spec_global_step() {  # the newest training_state.json under a speculators save path (its global_step)
  python3 - "$1" <<'EOF'
import json, sys
from pathlib import Path
found = sorted(Path(sys.argv[1]).glob("*/training_state.json"), key=lambda p: p.stat().st_mtime)
print(json.loads(found[-1].read_text())["global_step"] if found else "")
EOF
}

spec_run() {  # TYPE SECONDS MAX_STEPS SAVE_PATH: speculators' trainer, SIGINT (it saves) at SECONDS
  local t=$1 nl ids full
  nl=$(field drafter_layers); ids=$(field target_layer_ids | tr -d '[],')
  full=$(seq -s ' ' 0 $(( nl - 1 )))
  rm -rf "$4"
  # shellcheck disable=SC2086  # ids, full and SPEC_ARGS are space-separated lists
  timeout --foreground -s INT -k 180 "$2" env PYTHONPATH="$SPEC_PYTHONPATH${PYTHONPATH:+:$PYTHONPATH}" \
    "$SPEC_PY" -m speculators.train --speculator-type "$t" --verifier-name-or-path "$(field target)" \
    --data-path "$D/speculators" --num-layers "$nl" --target-layer-ids $ids --block-size "$(field block_size)" \
    --full-attention-indices $full --total-seq-len "${TOTAL_SEQ_LEN:-$(field tokens_per_batch)}" \
    --max-steps "$3" --epochs 1000 --train-data-ratio 0.99 --seed 0 \
    --save-path "$4" --log-dir "$4-logs" --logger "" ${SPEC_ARGS:-} > "$4.log" 2>&1 < /dev/null
}

spec_train() {
  local t name steps t0 rc ck
  for t in ${TYPES:-dflash dflash2 xpress}; do
    name=speculators-$t; steps=${SPEC_STEPS:-6000}; rm -rf "$R/conv-$name"
    if [ "${PILOT_S:-0}" -gt 0 ]; then
      spec_run "$t" "$PILOT_S" 1000000 "$R/$name-pilot"
      steps=$(pilot_steps "$name" "$(spec_global_step "$R/$name-pilot")" "$steps")
    fi
    t0=$(date +%s.%N)
    spec_run "$t" "${BUDGET_S:-300}" "$steps" "$R/$name"
    rc=$?
    ck=$(ls -td "$R/$name"/*/ 2>/dev/null | while read -r d; do [ -f "$d/config.json" ] && echo "$d" && break; done)
    record "$name" "$rc" "$t0" "${ck:-}" "$steps" "$(spec_global_step "$R/$name")" "$R/$name.log"
    [ -n "${ck:-}" ] && python3 -m benchmarks.peers.convert "$G" "$ck" -o "$R/conv-$name" "${S[@]}"
  done
}

# --- SpecForge -------------------------------------------------------------------------------------
sf_run() {  # SECONDS MAX_STEPS OUTPUT_DIR: SpecForge's trainer, SIGTERM at SECONDS
  rm -rf "$3"
  python3 -m benchmarks.peers.specforge_config "$D" -o "$3" --max-steps "$2" --save-every "${SF_SAVE_EVERY:-250}" \
    ${TOTAL_SEQ_LEN:+--tokens-per-step $TOTAL_SEQ_LEN} || return 1
  # shellcheck disable=SC2086  # SF_OVERRIDES: section.field=value words
  timeout --foreground -s TERM -k 120 "$1" env PYTHONPATH="$SF_PYTHONPATH${PYTHONPATH:+:$PYTHONPATH}" \
    "$SF_PY" -m specforge.cli train --config "$3.yaml" ${SF_OVERRIDES:-} > "$3.log" 2>&1 < /dev/null
}

sf_step() {  # the step of SpecForge's newest checkpoint under OUTPUT_DIR (its directory name's number)
  python3 - "$1" <<'EOF'
import re, sys
from pathlib import Path
steps = [int(m.group(1)) for p in Path(sys.argv[1]).glob("*") if p.is_dir() and not p.is_symlink()
         for m in [re.search(r"(\d+)$", p.name)] if m]
print(max(steps) if steps else "")
EOF
}

sf_train() {
  local name=specforge-dflash steps=${SF_STEPS:-6000} t0 rc
  rm -rf "$R/conv-$name" "$R/$name-hf"
  if [ "${PILOT_S:-0}" -gt 0 ]; then
    SF_SAVE_EVERY=10 sf_run "$PILOT_S" 1000000 "$R/$name-pilot"
    steps=$(pilot_steps "$name" "$(sf_step "$R/$name-pilot")" "$steps")
  fi
  t0=$(date +%s.%N)
  sf_run "${BUDGET_S:-300}" "$steps" "$R/$name"
  rc=$?
  local done; done=$(sf_step "$R/$name")
  record "$name" "$rc" "$t0" "${done:+$R/$name}" "$steps" "$done" "$R/$name.log"
  [ -n "$done" ] || return 0
  forge -m specforge.export.to_hf --checkpoint "$R/$name" --draft-config "$D/draft_config.json" \
    --output-dir "$R/$name-hf" --embedding-source "$(field target)" > "$R/$name-export.log" 2>&1 \
    && python3 -m benchmarks.peers.convert "$G" "$R/$name-hf" -o "$R/conv-$name" "${S[@]}" \
    || tail -3 "$R/$name-export.log"
}

train() {
  ready || return 1
  if wants ours; then ours_train; fi
  if wants speculators; then spec_train; fi
  if wants specforge; then sf_train; fi
}

evaluate() {
  [ -f "$R/prompts.jsonl" ] || cp .whl/prompts.jsonl "$R/prompts.jsonl" 2>/dev/null \
    || python3 -m benchmarks.quality.prompts -o "$R/prompts.jsonl" --first-unused 8000 --num "$NP"
  local names=() d name nd temp
  for d in "$R"/conv-*; do [ -d "$d" ] && names+=("${d##*/conv-}=$d"); done
  [ -n "${CKPT:-}" ] && names+=("ckpt=$CKPT")
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
