#!/usr/bin/env bash
# Build the peers' stacks that the interop tests load this project's exports in, each apart from
# the project's environment (their transformers pins differ from ours and from each other), then
# print the environment variables that point the tests at them:
#
#   eval "$(bash tests/interop_setup.sh .stacks)" && python -m pytest tests/dflash/export
#
# * z-lab's reference `dflash` 0.1.0 wheel, unpacked as `zlab_dflash` (its top-level package is
#   also named `dflash`): ZLAB_DFLASH_PATH;
# * vLLM speculators 0.9.0 in a venv with transformers 5.19.0 and its imports (not torchvision or
#   torchaudio, which would pull a CUDA torch; speculators never imports them on this path):
#   DFLASH_SPECULATORS_PYTHON;
# * SpecForge 0.2.0: a venv with transformers 5.8.1 (its pin) and the unpacked wheel, whose DFlash
#   model file is loaded without the rest of SpecForge (that needs sglang and CUDA):
#   DFLASH_SPECFORGE_PYTHON, DFLASH_SPECFORGE_SRC;
# * transformers 5.8.1 alone (--target directory) for the AutoModel check: DFLASH_TRANSFORMERS_5_8.
#
# Each stack is best effort: one that cannot be installed is said in one line on stderr and its
# tests skip, saying what is missing. TORCH (default torch==2.13.0, this workplace's CPU build)
# is the torch each venv gets; on another machine give e.g. TORCH="torch --index-url
# https://download.pytorch.org/whl/cpu". Takes about 2 minutes; the log is DIR/setup.log.
set -uo pipefail
dir=${1:-.stacks}
mkdir -p "$dir" && dir=$(cd "$dir" && pwd)
log="$dir/setup.log"
: >"$log"
py=${PYTHON:-python3}
read -r -a torch_spec <<<"${TORCH:-torch==2.13.0}"
pipq() { "$1" -m pip install -q --disable-pip-version-check "${@:2}" >>"$log" 2>&1; }
skip() { echo "interop_setup: $1 could not be installed (see $log); its tests will skip" >&2; }

# z-lab dflash 0.1.0
if [ -d "$dir/zlab/zlab_dflash" ] || {
    rm -rf "$dir/zlab" && mkdir -p "$dir/zlab/wheel" &&
    "$py" -m pip download -q --no-deps --only-binary=:all: -d "$dir/zlab/wheel" dflash==0.1.0 >>"$log" 2>&1 &&
    "$py" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
        "$dir"/zlab/wheel/dflash-0.1.0-*.whl "$dir/zlab/unpacked" &&
    mv "$dir/zlab/unpacked/dflash" "$dir/zlab/zlab_dflash"; }; then
    echo "export ZLAB_DFLASH_PATH=$dir/zlab"
else
    skip "z-lab's dflash 0.1.0"
fi

# vLLM speculators 0.9.0
spec="$dir/speculators"
if [ -x "$spec/bin/python" ] && "$spec/bin/python" -c "import speculators" 2>/dev/null || {
    rm -rf "$spec" && "$py" -m venv "$spec" &&
    pipq "$spec/bin/python" "${torch_spec[@]}" &&
    pipq "$spec/bin/python" "transformers==5.19.0" "datasets>=4.0.0,<=5.1.0" "loguru>=0.7.2,<=0.7.3" pydantic \
        pydantic-settings aiohttp click httpx huggingface-hub "numpy>=2,<=2.5.4" "openai>=2" protobuf psutil rich \
        safetensors "tqdm<=4.70.1" "typer>=0.12" &&
    pipq "$spec/bin/python" --no-deps speculators==0.9.0 hs-connectors==0.9.0; }; then
    echo "export DFLASH_SPECULATORS_PYTHON=$spec/bin/python"
else
    skip "speculators 0.9.0"
fi

# SpecForge 0.2.0
sf="$dir/specforge"
if [ -x "$sf/venv/bin/python" ] && [ -d "$sf/src/specforge" ] || {
    rm -rf "$sf" && mkdir -p "$sf/wheel" && "$py" -m venv "$sf/venv" &&
    pipq "$sf/venv/bin/python" "${torch_spec[@]}" "transformers==5.8.1" &&
    "$py" -m pip download -q --no-deps --only-binary=:all: -d "$sf/wheel" specforge==0.2.0 >>"$log" 2>&1 &&
    "$py" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
        "$sf"/wheel/specforge-0.2.0-*.whl "$sf/src"; }; then
    echo "export DFLASH_SPECFORGE_PYTHON=$sf/venv/bin/python DFLASH_SPECFORGE_SRC=$sf/src"
else
    skip "SpecForge 0.2.0"
fi

# transformers 5.8.1 for the AutoModel check (run with the project's python, this on PYTHONPATH)
tf="$dir/tf581"
if [ -f "$tf/transformers/__init__.py" ] || {
    rm -rf "$tf" &&
    pipq "$py" --no-deps --target "$tf" transformers==5.8.1 tokenizers==0.22.2 "huggingface-hub>=1.5,<2"; }; then
    echo "export DFLASH_TRANSFORMERS_5_8=$tf"
else
    skip "transformers 5.8.1"
fi
