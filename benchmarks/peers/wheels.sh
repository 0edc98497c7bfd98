#!/usr/bin/env bash
# Download the wheels `python -m benchmarks.peers.run` installs on the GPU machine (Python 3.12,
# x86_64), which reaches no package index, beyond the image's torch, transformers, safetensors, numpy,
# tqdm and huggingface-hub (what else is missing there, the recipe's import check names in one line):
#
#   bash benchmarks/peers/wheels.sh            # .whl/peers (speculators, about 11 MB) and
#                                              # .whl/specforge (SpecForge and its transformers pin, about 20 MB)
#   ARROW=1 bash benchmarks/peers/wheels.sh    # also pyarrow and pandas into .whl/peers-arrow (about 70 MB)
#
# Every wheel is pinned to the version the peers' tests passed with: the stacks tests/interop_setup.sh
# builds (speculators 0.9.0 with what its resolver chose; SpecForge 0.2.0 with transformers 5.8.1 and
# tokenizers 0.22.2), accelerate and psutil as the project's own environment and CI pin them. Unpinned,
# the newest openai (3.x) needs httpx2, httpcore2 and truststore, which the image lacks: they are here.
# speculators' `datasets` needs pyarrow and pandas. pyarrow's wheel alone (53,756 KiB) exceeds what one
# device call carries beside the working tree (64 MiB in disk blocks, the tree about 25,500 KiB), so
# where the image lacks them (python3 -c "import pyarrow, pandas" on the device says), cut it in two
# (split -n 2 -d FILE .pa/part), carry each half in a call of its own and, in the second, join it and
# install it with pandas *and* .whl/peers in one command (/tmp/peers-pylib stays while the machine is
# warm; benchmarks.peers.run installs .whl/peers only where that folder does not exist yet):
#   pip install --no-index --no-deps --target /tmp/peers-pylib .whl/peers/*.whl .whl/peers-arrow/*.whl
# SpecForge's offline trainer imports neither SGLang nor datasets; its transformers pin goes into its
# own path (/tmp/specforge-pylib) with the tokenizers that version takes.
set -euo pipefail
# what both peers import and a bare image may lack (pydantic-core and pyyaml are binary wheels)
common=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 pyyaml==6.0.4
        click==8.5.1 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0)
peers=(speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
       fsspec==2026.7.0 loguru==0.7.3 openai==3.63.0 jiter==0.19.0 httpx2==2.17.0 httpcore2==2.17.0
       truststore==0.10.5 sniffio==1.3.1 pydantic-settings==2.16.3 python-dotenv==1.2.4 typer==0.29.2
       shellingham==1.5.4 psutil==7.2.2 protobuf==7.36.2)
specforge=(specforge==0.2.0 transformers==5.8.1 tokenizers==0.22.2 accelerate==1.16.0 psutil==7.2.2)
arrow=(pyarrow==26.0.1 pandas==3.1.1)
get() { local dir=$1; shift; mkdir -p "$dir"
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
          --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
          -d "$dir" "$@" "${common[@]}"; }
get .whl/peers "${peers[@]}"
get .whl/specforge "${specforge[@]}"
dirs=(.whl/peers .whl/specforge)
if [ "${ARROW:-0}" = 1 ]; then get .whl/peers-arrow "${arrow[@]}"; dirs+=(.whl/peers-arrow); fi
du -sh "${dirs[@]}"
