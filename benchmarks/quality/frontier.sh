#!/usr/bin/env bash
# Variants at an equal budget on one H200, against the shipped target: every row trains the same
# STEPS steps (the same cosine schedule), concurrently (each gets about an equal share of the GPU;
# TRAIN_S caps the wall time, a row stopped by it reports the steps it reached), on the same data
# (the first N ShareGPT conversations, target-argmax labels), from the same seed; then each final
# checkpoint is decoded on the same held-out prompts, greedy and at temperature 1. Each row's
# training wall time is in its metrics (frontier.json: train_s), for the equal-time comparison.
#
#   bash benchmarks/quality/frontier.sh OUT                       # the default rows below
#   ROWS="dflash dflash2" TRAIN_S=300 bash benchmarks/quality/frontier.sh OUT
#   PHASE=train ... ; PHASE=eval ...     # the two halves, e.g. in two device calls on one warm machine
#
# Time on one H200: six rows of 2,500 steps trained side by side in about 330 s (the slowest row,
# plus about 40 s of tokenizing and compiling), and their six decodes (16 prompts x 128 tokens,
# greedy then T = 1) side by side in about 150 s; with the wheel install that is more than one
# 600 s device call, so split it with PHASE (R must survive between the calls: a warm machine).
#
# Rows (name: the --set arguments that make it):
#   dflash     the default DFlash drafter, CE on the target's argmax (examples/sharegpt-target-h200.toml)
#   dspark     the same drafter, DSpark's loss: 0.1 CE + 0.9 TV + 1.0 confidence
#   dflash2    the DFlash2 variant (grouped dynamic causal convolutions + candidate selector)
#   dspark_head  DSpark's recipe as its paper and DeepSpec's trainer write it, in this project's units
#              (their L1 "TV" is twice ours; divided by 1.9): dataset labels, 0.947 TV, 0.526 conf
#              with the confidence head, gamma 4
#   tv         TV alone (CE weight 0, no confidence term)
#   fp8        the dflash row with the target in float8 (target.quantization = "fp8", torchao, CUDA):
#              trained on fp8-captured features, evaluated against the bf16 target it would serve
#              (dflash.eval --target-quantization none): the fp8 quality check, against the dflash row
#   dflash_eqtime  the dflash row with EQ_STEPS steps (default 1.54 x STEPS: DFlash2's measured step
#              cost over DFlash's on this GPU), for DFlash vs DFlash2 at equal training time
#   dflash_b8, dflash2_b8  the dflash and dflash2 rows at block 8
# Block 8 for every row: BS=8 (gamma stays the graph's unless the row sets it).
# Prompts: benchmarks/quality/prompts.py (held out of the target's pretraining and of every run).
# Output: OUT/frontier.json (one object per row: greedy tau and tau at T = 1) and each run's metrics and eval JSON.
set -euo pipefail
OUT=$1; R=${R:-/tmp/frontier}; TRAIN_S=${TRAIN_S:-400}; STEPS=${STEPS:-5000}; N=${N:-8000}; NP=${NP:-16}; NEW=${NEW:-128}
BS=${BS:-16}; PHASE=${PHASE:-all}; ROWS=${ROWS:-"dflash dflash2 dspark_head tv"}; EQ_STEPS=${EQ_STEPS:-$(( STEPS * 154 / 100 ))}
mkdir -p "$R" "$OUT"
export DFLASH_CACHE=$R/cache PYTHONUNBUFFERED=1
G=${G:-examples/sharegpt-target-h200.toml}
COMMON=(--set monitor.wandb=\"disabled\" --set run.steps=$STEPS --set data.max_samples=$N --resume none
        --set drafter.block_size=$BS --set checkpoint.every=0)
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"; COMMON+=("${EXTRA_ARGS[@]}")
row_args() {
  case $1 in
    dflash) ;;
    dspark) echo --set loss.tv_weight=0.9 --set loss.conf_weight=1.0 ;;
    dflash2) echo --set drafter.variant=\"dflash2\" ;;
    dspark_head) echo --set loss.label=\"data\" --set loss.tv_weight=0.947 --set loss.conf_weight=0.526 \
      --set loss.confidence=\"head\" --set loss.gamma=4 ;;
    tv) echo --set loss.tv_weight=1.0 ;;
    fp8) echo --set target.quantization=\"fp8\" ;;
    dflash_eqtime) echo --set run.steps=$EQ_STEPS ;;
    dflash_b8) echo --set drafter.block_size=8 ;;
    dflash2_b8) echo --set drafter.variant=\"dflash2\" --set drafter.block_size=8 ;;
    *) echo "unknown row $1" >&2; return 1 ;;
  esac
}
if [ "$PHASE" != eval ]; then
  python3 -m benchmarks.quality.prompts -o "$R/prompts.jsonl" --first-unused $N --num $NP
  # the first run tokenizes the data into the shared cache; the others start once it is there
  python3 -m dflash.run $G "${COMMON[@]}" --set run.steps=1 --set run.out_dir=\"$R/warm\" > "$R/warm.log" 2>&1 || tail -5 "$R/warm.log"
  pids=()
  for row in $ROWS; do
    read -r -a args <<< "$(row_args $row)"
    # SIGTERM after TRAIN_S: a graceful stop with a final checkpoint (exit 130); --foreground: one signal
    timeout --foreground -s TERM $TRAIN_S python3 -m dflash.run $G "${COMMON[@]}" --set run.out_dir=\"$R/$row\" \
      "${args[@]}" > "$R/$row.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait $p || true; done
fi
[ "$PHASE" = train ] && exit 0
pids=()
for row in $ROWS; do
  tail -2 "$R/$row.log"; cp "$R/$row/metrics.jsonl" "$OUT/metrics-$row.jsonl" || true
  ck=$(ls -d "$R/$row"/checkpoints/step_* | sort | tail -1)
  # one decode per row: greedy, then sampled at T = 1 (the JSON's tau and sampled_tau)
  python3 -m dflash.eval "$ck" --prompts "$R/prompts.jsonl" --num-prompts $NP --max-new-tokens $NEW \
    --temperature 1 --seed 0 --target-quantization none --json > "$OUT/eval-$row.json" 2> "$R/eval-$row.err" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait $p || true; done
python3 - "$OUT" $ROWS <<'EOF'
import json, sys
from pathlib import Path
out, rows = Path(sys.argv[1]), sys.argv[2:]
table = []
for row in rows:
    lines = [json.loads(l) for l in (out / f"metrics-{row}.jsonl").read_text().splitlines()]
    steps = [l for l in lines if l.get("kind") == "train"]
    last = steps[-1] if steps else {}
    t0 = next((l["time"] for l in lines if l.get("kind") == "start" and "time" in l), None)
    p = out / f"eval-{row}.json"
    d = json.loads(p.read_text()) if p.exists() and p.stat().st_size else {}
    table.append({"row": row, "steps": last.get("step"),
                  "train_s": round(last["time"] - t0, 1) if t0 is not None and "time" in last else None,
                  "tau": d.get("tau"), "accepted": d.get("mean_accepted"),
                  "tau_t1": d.get("sampled_tau"), "accepted_t1": d.get("sampled_accepted"),
                  "tau_sim_train": last.get("tau_sim"), "block_size": d.get("block_size"),
                  **{k: d[k] for k in ("selector", "dtype") if d.get(k) is not None}})
    print(table[-1])
(out / "frontier.json").write_text(json.dumps(table, indent=1))
EOF
