#!/usr/bin/env bash
# The performance measurements of the target and drafter stages in one device call (one H200,
# at most ~9 minutes; results under OUT):
#
#   bash benchmarks/h200/perf.sh OUT                 # SUITE=engine (default), see below
#   SUITE=stages bash benchmarks/h200/perf.sh OUT    # the earlier stage/pipeline suite
#
# 0. Packages: every wheel in .whl/ (torchao, liger-kernel, msgspec, tomli-w: carried, not in the
#    image) installed with --no-deps into a --target dir put on PYTHONPATH; the ShareGPT subset
#    .whl/data/sharegpt-subset.jsonl.gz unpacked to .devdata/ when present (DATA= overrides the source).
# SUITE=engine:
#   1. the GPU tests of the engine and kernel switches (tests/dflash/train/test_perf_switches.py -m gpu) and the
#      sync test of the training step -> OUT/gpu-tests.log;
#   2. benchmarks/h200/perf.py: bf16 and fp8 matmul peaks, the target alone (flex, varlen, varlen
#      compiled; then fp8 in place: flex, varlen, varlen compiled) with MFU against the matching peak,
#      the fp8 feature error per captured layer, the drafter alone (default, Liger kernels, Liger
#      head, compiled, all three) with its peak memory at the 151,936 vocabulary, and torch.profiler
#      top kernels -> OUT/perf.json, OUT/profile_*.txt, OUT/perf.log.
#   Knobs: ROWS (comma list, default all), PERF_STEPS (8), PERF_WARMUP (3), TOTAL_S (530), TESTS=0 skips 1.
# SUITE=fp8 (~9 minutes): perf.py's compiled drafter rows in bf16 and float8 (tensorwise with the
#   profiles of both, then rowwise), the fp8 target compiled with its profile; then h200/bench.py's target alone,
#   drafter alone, serial and pipeline with the fp8 target and the float8 drafter (FP8_RECIPE= picks
#   the drafter's recipe) -> OUT/perf.json, OUT/h200-fp8-fp8.json. PERF_S (330) bounds the first part.
# SUITE=stages: the sync test, h200/bench.py on one GPU, and the drafter under each switch in VARIANTS.
# SUITE=fastest (~7 minutes): the compiled and fp8 target rows with their profiles, then h200/bench.py's
#   serial, colocated and pipeline with the fastest target (fp8, varlen, compiled) and with the bf16
#   one, both with the example graph's compiled drafter -> OUT/perf.json, OUT/h200-fp8.json,
#   OUT/h200-bf16.json (results/LOG.md, "Fastest settings"); last, benchmarks/h200/combine.py puts the
#   three side by side with the goals, MFU against the matching peak -> OUT/h200.json (the format of
#   benchmarks/results/h200.json, its "2gpu" run kept from KEEP_2GPU, default that file; KEEP_2GPU=
#   keeps none). WARMUP (10): untimed steps of each bench measurement; a compiled target in a
#   pipeline thread needed about 8 steps to reach its rate.
set -uo pipefail
OUT=$1; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
left() { echo $(( ${TOTAL_S:-530} - ($(date +%s) - T0) )); }
# the SM clock, power and utilisation every 250 ms -> OUT/smi.csv: a rate that drops with the clock is
# the power limit, one that drops at full clock is the host or a sync
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -lms 250 > "$OUT/smi.csv" 2>/dev/null &
  SMI=$!; trap 'kill $SMI 2>/dev/null' EXIT
fi

if compgen -G ".whl/*.whl" > /dev/null; then
  LIB=${PYLIB:-/tmp/dflash-pylib}
  python3 -m pip install -q --no-index --no-deps --target "$LIB" .whl/*.whl > "$OUT/pip.log" 2>&1
  echo "wheels rc=$? -> $LIB: $(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' ')"
  export PYTHONPATH="$LIB${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -f .whl/data/sharegpt-subset.jsonl.gz ] && [ ! -f .devdata/sharegpt-subset.jsonl ]; then
  mkdir -p .devdata && gunzip -c .whl/data/sharegpt-subset.jsonl.gz > .devdata/sharegpt-subset.jsonl
fi
DATA=${DATA:-$( [ -f .devdata/sharegpt-subset.jsonl ] && echo .devdata/sharegpt-subset.jsonl || echo sharegpt )}
python3 -c "import torch, importlib.util as u; print('torch', torch.__version__, torch.cuda.get_device_name(0), \
{p: u.find_spec(p) is not None for p in ('torchao', 'liger_kernel', 'msgspec', 'tomli_w', 'triton')})"

if [ "${SUITE:-engine}" = fastest ]; then
  timeout 260 python3 benchmarks/h200/perf.py --out "$OUT" --budget-s 240 --warmup 3 --steps 8 --set data.source="$DATA" \
    --rows target_bf16,target_bf16_varlen_compile,profile_target_bf16_varlen_compile,fp8_feature_error,target_fp8_varlen,target_fp8_varlen_compile,profile_target_fp8_varlen_compile,drafter_compile \
    > "$OUT/perf.log" 2>&1
  echo "h200_perf rc=$? in $(( $(date +%s) - T0 )) s"; tail -12 "$OUT/perf.log"
  SKIP=sweep_1gpu,checkpoint_1gpu,target_alone_sdpa,target_alone_flex_attention,target_alone_eager,plain_forward
  for v in fp8 bf16; do
    E=(--set target.attn_implementation=\"varlen\" --set target.compile=true)
    [ $v = fp8 ] && E+=(--set target.quantization=\"fp8\")
    b=$(( $(left) - 15 )); [ $b -lt 60 ] && { echo "bench $v: skipped, ${b}s left"; continue; }
    timeout $(( b + 10 )) python3 benchmarks/h200/bench.py --budget-s $b --warmup ${WARMUP:-10} --steps 10 \
      --set data.source="$DATA" "${E[@]}" --skip $SKIP --out "$OUT/h200-$v.json" > "$OUT/bench-$v.log" 2>&1
    echo "bench $v rc=$?"; grep -E "^(serial|pipeline_1gpu|colocated_1gpu|target_alone|drafter_alone)_tok_s" "$OUT/bench-$v.log"
  done
  KEEP=${KEEP_2GPU-benchmarks/results/h200.json}
  python3 -m benchmarks.h200.combine "$OUT" ${KEEP:+--keep-2gpu "$KEEP"} > "$OUT/combine.log" 2>&1
  echo "combine rc=$? -> $OUT/h200.json"; head -9 "$OUT/combine.log"
  exit 0
fi
if [ "${SUITE:-engine}" = fp8 ]; then
  # the drafter's float8 training against its bf16 compiled step, the fp8 target, then the one-GPU
  # loop with both stages in float8 (serial and pipeline)
  timeout ${PERF_S:-330} python3 benchmarks/h200/perf.py --out "$OUT" --budget-s $(( ${PERF_S:-330} - 20 )) \
    --warmup ${PERF_WARMUP:-3} --steps ${PERF_STEPS:-8} --set data.source="$DATA" \
    --rows ${ROWS:-drafter_compile,profile_drafter_compile,drafter_fp8_compile,profile_drafter_fp8_compile,drafter_fp8_rowwise_compile,target_fp8_varlen_compile,profile_target_fp8_varlen_compile} \
    > "$OUT/perf.log" 2>&1
  echo "h200_perf rc=$? in $(( $(date +%s) - T0 )) s"; tail -14 "$OUT/perf.log"
  E=(--set target.attn_implementation=\"varlen\" --set target.compile=true --set target.quantization=\"fp8\"
     --set drafter.precision=\"fp8\" ${FP8_RECIPE:+--set drafter.fp8_recipe=\"$FP8_RECIPE\"})
  b=$(( $(left) - 15 ))
  if [ $b -lt 60 ]; then echo "bench fp8+fp8: skipped, ${b}s left"; else
    timeout $(( b + 10 )) python3 benchmarks/h200/bench.py --budget-s $b --warmup ${WARMUP:-10} --steps 10 \
      --set data.source="$DATA" "${E[@]}" --skip sweep_1gpu,checkpoint_1gpu,target_alone_sdpa,target_alone_flex_attention,target_alone_eager,plain_forward,colocated_1gpu \
      --out "$OUT/h200-fp8-fp8.json" > "$OUT/bench-fp8-fp8.log" 2>&1
    echo "bench fp8+fp8 rc=$?"; grep -E "^(serial|pipeline_1gpu|target_alone|drafter_alone)_tok_s" "$OUT/bench-fp8-fp8.log"
  fi
  exit 0
fi
if [ "${SUITE:-engine}" = engine ]; then
  if [ "${TESTS:-1}" = 1 ]; then
    timeout 200 python3 -m pytest -v -m gpu -p no:cacheprovider -rs tests/dflash/train/test_perf_switches.py \
      tests/dflash/train/test_step_sync.py > "$OUT/gpu-tests.log" 2>&1
    echo "gpu tests rc=$? ($(tail -1 "$OUT/gpu-tests.log"))"
  fi
  b=$(( $(left) - 25 ))
  timeout $(( b + 20 )) python3 benchmarks/h200/perf.py --out "$OUT" --budget-s $b \
    --warmup ${PERF_WARMUP:-3} --steps ${PERF_STEPS:-8} --set data.source="$DATA" ${ROWS:+--rows $ROWS} \
    > "$OUT/perf.log" 2>&1
  echo "h200_perf rc=$? in $(( $(date +%s) - T0 )) s"; tail -25 "$OUT/perf.log"
  ls -la "$OUT"
  exit 0
fi

mkdir -p "$OUT/v"
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/dflash/train/test_step_sync.py > "$OUT/v/gpu-sync.log" 2>&1
echo "sync test rc=$? ($(tail -1 "$OUT/v/gpu-sync.log"))"
timeout ${MAIN_S:-360} python3 benchmarks/h200/bench.py --budget-s ${BUDGET_S:-320} --set data.source="$DATA" \
  --skip sweep_1gpu,checkpoint_1gpu,target_alone_eager --out "$OUT/h200-x1.json" --artifacts "$OUT/x1" \
  > "$OUT/bench.log" 2>&1
echo "main bench rc=$?"; tail -30 "$OUT/bench.log"
ONLY_DRAFTER=target_alone,target_alone_sdpa,target_alone_flex_attention,target_alone_eager,plain_forward,serial,colocated_1gpu,colocated_2gpu,pipeline_1gpu,pipeline_2gpu,checkpoint_1gpu,checkpoint_2gpu,sweep_1gpu,sweep_2gpu
i=0
for v in ${VARIANTS:-train.sync_free_loss=false drafter.attn_implementation=\"flex_attention\" train.lm_head_chunk=2048}; do
  i=$((i + 1))
  l=$(left)
  [ $l -lt 60 ] && { echo "variant $v: skipped, ${l}s left"; continue; }
  timeout $((l - 5)) python3 benchmarks/h200/bench.py --budget-s $((l - 20)) --skip $ONLY_DRAFTER \
    --set data.source="$DATA" --set "$v" --out "$OUT/v/variant-$i.json" > "$OUT/v/variant-$i.log" 2>&1
  echo "variant $i $v rc=$?"; grep -m3 "drafter_alone\|drafter_stage_mfu" "$OUT/v/variant-$i.log"
done
tar czf "$OUT/variants.tgz" -C "$OUT" v && rm -rf "$OUT/v"
ls -la "$OUT" "$OUT/x1" 2>/dev/null
