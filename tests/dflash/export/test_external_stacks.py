"""An export loads in SpecForge's and vLLM speculators' own DFlash classes with no missing or
unexpected key and gives this project's drafter's logits (``tests/external_stacks.py`` says how).

Each stack runs in its own venv, named by an environment variable; unset, the test skips and says
how to make one.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.external_stacks import SLIDING_THEN_FULL, fixture, fixture_xpress

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).resolve().parents[3] / "tests" / "external_stacks.py"
SETUP = ' (eval "$(bash tests/interop_setup.sh .stacks)" builds both stacks and sets the variables)'
HOW = {
    "speculators": "DFLASH_SPECULATORS_PYTHON unset: a venv's python with torch, "
                   "`pip install --no-deps speculators==0.9.0` and its imports (transformers==5.19.0, loguru, "
                   "pydantic, pydantic-settings, datasets, ...; not torchvision/torchaudio, which pull a CUDA torch)",
    "specforge": "DFLASH_SPECFORGE_PYTHON or DFLASH_SPECFORGE_SRC unset: a venv's python with torch and "
                 "transformers==5.8.1 (SpecForge's pin), and the unpacked specforge==0.2.0 wheel "
                 "(`pip download --no-deps specforge==0.2.0`; its sglang dependency needs CUDA)",
}


def _run(stack: str, tmp_path, types, *extra: str, check: str | None = None) -> dict:
    if check == "speculators_xpress":
        fixture_xpress(tmp_path)
    else:
        fixture(tmp_path, types)
    py = os.environ[f"DFLASH_{stack.upper()}_PYTHON"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    # cwd outside the repository: the child must not import this project's dflash package
    proc = subprocess.run([py, str(SCRIPT), check or stack, str(tmp_path), *extra], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=540, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-3000:]
    got = json.loads(lines[-1])
    assert proc.returncode == 0, got
    return got


def test_speculators_loads_the_export_and_gives_our_logits(tmp_path):
    """Invariant: speculators' ``DFlashConverter`` accepts the export with the tiny target as its
    verifier, its ``DFlashDraftModel`` loads the result with no missing or unexpected key, and one
    block after a context gets this project's drafter's logits (within 1e-4). Full-attention drafter
    layers only: speculators 0.9.0 measures a sliding window from the block's anchor for every
    block token (context ``[a - w, a)``), z-lab and this project from each token (``[a + j - w, a)``),
    so a sliding-window drafter's logits differ there (0.26 on this fixture)."""
    if not os.environ.get("DFLASH_SPECULATORS_PYTHON"):
        pytest.skip(HOW["speculators"] + SETUP)
    got = _run("speculators", tmp_path, None)
    assert got["missing"] == [] and got["unexpected"] == [] and got["max_abs_logit_diff"] <= 1e-4


def test_speculators_xpress_loads_the_export_and_gives_our_logits_and_refiner_bias(tmp_path):
    """Invariant: an XPress export loads in speculators' ``XPressDraftModel`` (the converter's config
    plus the ``dflash_config`` XPress fields) with no unexpected key and none missing but those
    filled from the verifier; one block gets our backbone's logits and, for the same predecessors,
    our refiner's logit bias (within 1e-4)."""
    if not os.environ.get("DFLASH_SPECULATORS_PYTHON"):
        pytest.skip(HOW["speculators"] + SETUP)
    got = _run("speculators", tmp_path, None, check="speculators_xpress")
    assert got["missing"] == [] and got["unexpected"] == [] and got["max_abs_logit_diff"] <= 1e-4


@pytest.mark.parametrize("types", [None, SLIDING_THEN_FULL])
def test_specforge_loads_the_export_and_gives_our_logits(tmp_path, types):
    """Invariant: SpecForge's ``DFlashDraftModel.from_pretrained(export)`` (transformers 5.8.1) has no
    missing or unexpected key, and one block after a context gets this project's drafter's logits
    (sliding layers given the DFlash decode mask, which SpecForge's forward takes per layer type)."""
    src = os.environ.get("DFLASH_SPECFORGE_SRC")
    if not (os.environ.get("DFLASH_SPECFORGE_PYTHON") and src):
        pytest.skip(HOW["specforge"] + SETUP)
    got = _run("specforge", tmp_path, types, src)
    assert got["missing"] == [] and got["unexpected"] == [] and got["max_abs_logit_diff"] <= 1e-4
