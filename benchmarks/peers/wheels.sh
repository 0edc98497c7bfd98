#!/usr/bin/env bash
# Download the wheels `benchmarks/peers/run.sh` installs on the GPU machine (Python 3.12, x86_64),
# which reaches no package index: vLLM speculators 0.9.0 and what its trainer imports beyond the
# image's torch, transformers, safetensors, numpy, tqdm, rich and huggingface-hub.
#
#   bash benchmarks/peers/wheels.sh [DIR]          # DIR default .whl/peers: about 5 MB
#   ARROW=1 bash benchmarks/peers/wheels.sh DIR    # also pyarrow and pandas (about 67 MB)
#
# `datasets` needs pyarrow and pandas. Together they exceed what one device call carries (64 MiB),
# so where the image lacks them (python3 -c "import pyarrow, pandas" on the device says), carry them
# alone in a first call that installs them into /tmp/peers-pylib (it stays while the machine is warm):
#   pip install --no-index --no-deps --target /tmp/peers-pylib .whl/peers-arrow/*.whl
set -euo pipefail
dir=${1:-.whl/peers}
mkdir -p "$dir"
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
          --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
          -d "$dir" "$@"; }
get speculators==0.9.0 hs-connectors==0.9.0 "datasets>=4.0.0,<=5.1.0" dill multiprocess xxhash fsspec \
    "loguru>=0.7.2,<=0.7.3" "openai>=2" jiter distro pydantic-settings python-dotenv "typer>=0.12" shellingham \
    psutil protobuf
[ "${ARROW:-0}" = 1 ] && get pyarrow pandas
du -sh "$dir"
