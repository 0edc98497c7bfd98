"""The commands keep the terminal for the user's run: the lines torchao and torch log while
transformers imports them (dflash.import_noise) are not printed, and nothing else is dropped."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from dflash.import_noise import NOISE, quiet_import_noise
from tests.dflash.run.test_run_e2e import ROOT, cache_dir, small  # noqa: F401 - the fixture

NOISY = ("Failed to load", "is an Enum subclass and is now natively supported", "Detected no triton")


def test_only_the_listed_lines_of_the_listed_loggers_are_dropped(caplog):
    """Invariant: each filter drops its one message on its one logger; the same logger's other
    records, and the same text from another logger, get through."""
    quiet_import_noise()
    quiet_import_noise()  # idempotent: one filter per logger
    assert all(len(logging.getLogger(name).filters) == 1 for name, _ in NOISE)
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/site-packages/torchao/_C_mxfp8.abi3.so: nope")
        logging.getLogger("torchao").warning("Failed to load something else")
        logging.getLogger("torch.utils._pytree").warning(
            "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type.", "E")
        logging.getLogger("dflash.x").warning("Failed to load /x/torchao/_C_mxfp8.so: said by us")
    assert [r.getMessage() for r in caplog.records] == ["Failed to load something else",
                                                        "Failed to load /x/torchao/_C_mxfp8.so: said by us"]


def test_a_run_prints_none_of_the_import_noise(tmp_path, cache_dir):  # noqa: F811
    """Invariant: ``python -m dflash.run`` prints no torchao "Failed to load ..._C_*.so" line, no
    "Detected no triton" line and no torch ``_pytree`` deprecation line. Regression: every command
    that loads a model printed them (five lines) before its own output."""
    plain = subprocess.run([sys.executable, "-c", "import transformers.modeling_utils"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    if not any(n in plain.stderr for n in NOISY):
        pytest.skip("importing transformers prints none of these lines here (torchao not installed?)")
    out = subprocess.run([sys.executable, "-m", "dflash.run", *small(tmp_path / "run", cache_dir, steps=1)],
                         cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr
    assert not [line for line in out.stderr.splitlines() if any(n in line for n in NOISY)], out.stderr
    assert "run summary: completed (exit 0)" in out.stderr
