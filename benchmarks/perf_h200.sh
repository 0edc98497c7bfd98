#!/usr/bin/env bash
# The performance measurements (per-stage MFU, attention variants, drafter switches) in one
# device call (one H200; results in benchmarks/results/):
#
#   bash benchmarks/perf_h200.sh OUT
#
# 1. the GPU-only sync test of the training step (torch.cuda.set_sync_debug_mode("error"));
# 2. bench_h200.py on one GPU: matmul peak, target alone per attention implementation, the plain
#    transformers forward, drafter alone, serial loop, colocated baseline, csp pipeline (MFU, HFU,
#    peak memory, the 2-GPU bounds, goal rows);
# 3. drafter alone again under each switch in VARIANTS (each its own invocation, same shapes).
set -uo pipefail
OUT=$1; mkdir -p "$OUT/v"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_step_sync.py > "$OUT/v/gpu-sync.log" 2>&1
echo "sync test rc=$? ($(tail -1 "$OUT/v/gpu-sync.log"))"
timeout ${MAIN_S:-360} python3 benchmarks/bench_h200.py --budget-s ${BUDGET_S:-320} \
  --skip sweep_1gpu,checkpoint_1gpu,target_alone_eager --out "$OUT/h200-x1.json" --artifacts "$OUT/x1" \
  > "$OUT/bench.log" 2>&1
echo "main bench rc=$?"; tail -30 "$OUT/bench.log"
ONLY_DRAFTER=target_alone,target_alone_sdpa,target_alone_flex_attention,target_alone_eager,plain_forward,serial,colocated_1gpu,colocated_2gpu,pipeline_1gpu,pipeline_2gpu,checkpoint_1gpu,checkpoint_2gpu,sweep_1gpu,sweep_2gpu
i=0
for v in ${VARIANTS:-train.sync_free_loss=false drafter.attn_implementation=\"flex_attention\" train.lm_head_chunk=2048}; do
  i=$((i + 1))
  left=$(( ${TOTAL_S:-570} - ($(date +%s) - T0) ))
  [ $left -lt 60 ] && { echo "variant $v: skipped, ${left}s left"; continue; }
  timeout $((left - 5)) python3 benchmarks/bench_h200.py --budget-s $((left - 20)) --skip $ONLY_DRAFTER \
    --set "$v" --out "$OUT/v/variant-$i.json" > "$OUT/v/variant-$i.log" 2>&1
  echo "variant $i $v rc=$?"; grep -m3 "drafter_alone\|drafter_stage_mfu" "$OUT/v/variant-$i.log"
done
tar czf "$OUT/variants.tgz" -C "$OUT" v && rm -rf "$OUT/v"
ls -la "$OUT" "$OUT/x1" 2>/dev/null
