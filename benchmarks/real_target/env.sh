# Sourced by every step of this recipe on the device machine: the packages the image lacks (the
# wheels carried in .whl, installed once per warm machine) and the scratch directory R that the
# steps share across device calls (/tmp stays while the machine is warm).
R=${R:-/tmp/rt}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 DFLASH_CACHE=$R/cache
if [ ! -d "$R/site" ] && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$R/site" .whl/*.whl
fi
for f in .whl/sharegpt-16k .sgt/sharegpt-deep; do   # the ShareGPT prompts data.sh answers (carry.sh builds them)
  if [ -f $f.jsonl.gz ] && [ ! -f "$R/${f#*/}.jsonl" ]; then gunzip -c $f.jsonl.gz > "$R/${f#*/}.jsonl"; fi
done
for p in greedy sampled t1 deep; do   # answers of earlier sessions (data.sh's OUT files, carried as .regen/)
  if [ -f .regen/regen-$p.jsonl.gz ] && [ ! -f "$R/regen-$p.jsonl" ]; then
    gunzip -c .regen/regen-$p.jsonl.gz > "$R/regen-$p.jsonl"
  fi
done
# A drafter of an earlier session (eval.sh KEEP_EXPORT=1's parts, kept here in .drafter/ and carried a
# few a call): gathered in R/init-parts as calls bring them; train.sh INIT=1 rebuilds and starts from it.
if compgen -G ".drafter/export.tar.*" > /dev/null; then
  mkdir -p "$R/init-parts" && cp -n .drafter/export.tar.* "$R/init-parts/"
fi
# R/regen-all.jsonl: every pass's answers so far, in one file (what train.sh trains on by default).
regen_all() {
  local p; FILES=()
  for p in greedy sampled t1 deep; do [ -f "$R/regen-$p.jsonl" ] && FILES+=("$R/regen-$p.jsonl"); done
  [ ${#FILES[@]} -gt 0 ] && cat "${FILES[@]}" > "$R/regen-all.jsonl"
}
export PYTHONPATH=$R/site:$PWD
# The graph every step runs: the shipped one, pointed at this recipe's files.
G=examples/smollm2-h200.toml
ON_R=(--set target.path=\"$R/smollm2\" --set run.out_dir=\"$R/run\" --set run.resume=\"none\"
      --set monitor.wandb=\"disabled\")
