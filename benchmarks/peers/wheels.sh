#!/usr/bin/env bash
# Download the wheels `benchmarks/peers/run.sh` installs on the GPU machine (Python 3.12, x86_64),
# which reaches no package index, beyond the image's torch, transformers, safetensors, numpy, tqdm
# and huggingface-hub (what else is missing there, run.sh's import check names in one line):
#
#   bash benchmarks/peers/wheels.sh            # .whl/peers (speculators, about 11 MB) and
#                                              # .whl/specforge (SpecForge and its transformers pin, about 20 MB)
#   ARROW=1 bash benchmarks/peers/wheels.sh    # also pyarrow and pandas into .whl/peers-arrow (about 67 MB)
#
# speculators' `datasets` needs pyarrow and pandas. Together they exceed what one device call carries
# (64 MiB), so where the image lacks them (python3 -c "import pyarrow, pandas" on the device says),
# carry them alone in a first call that installs them into /tmp/peers-pylib (it stays while the
# machine is warm): pip install --no-index --no-deps --target /tmp/peers-pylib .whl/peers-arrow/*.whl
# SpecForge's offline trainer imports neither SGLang nor datasets; it pins transformers 5.8.1, which
# goes into its own path (/tmp/specforge-pylib) with the tokenizers that version takes.
set -euo pipefail
# what both peers import and a bare image may lack (pydantic-core and pyyaml are binary wheels)
common=(pydantic pydantic-core annotated-types typing-inspection pyyaml click rich markdown-it-py mdurl pygments)
get() { local dir=$1; shift; mkdir -p "$dir"
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
          --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
          -d "$dir" "$@" "${common[@]}"; }
get .whl/peers speculators==0.9.0 hs-connectors==0.9.0 "datasets>=4.0.0,<=5.1.0" dill multiprocess xxhash fsspec \
    "loguru>=0.7.2,<=0.7.3" "openai>=2" jiter distro pydantic-settings python-dotenv "typer>=0.12" shellingham \
    psutil protobuf
get .whl/specforge specforge==0.2.0 transformers==5.8.1 tokenizers==0.22.2 accelerate psutil
if [ "${ARROW:-0}" = 1 ]; then get .whl/peers-arrow pyarrow pandas; fi
du -sh .whl/peers .whl/specforge ${ARROW:+.whl/peers-arrow}
