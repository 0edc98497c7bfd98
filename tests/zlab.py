"""z-lab's reference DFlash code (their ``dflash`` 0.1.0 wheel), imported beside ours for the tests
that compare against it.

The wheel's top-level package is ``dflash``, like ours, so it is never installed here: a directory
holding its package renamed ``zlab_dflash/`` (the wheel's ``dflash/`` folder; ``model.py`` needs only
torch and transformers) is named by the environment variable ``ZLAB_DFLASH_PATH``, and
:func:`zlab_model` imports ``zlab_dflash.model`` from it. Without the variable the tests that need it
skip with :data:`SKIP_REASON`; with the variable pointing at a directory that does not hold the
package they fail (a misconfigured CI should not pass silently); under transformers 4.x, which
z-lab's code does not run on, they skip saying so.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

ENV = "ZLAB_DFLASH_PATH"
SKIP_REASON = "z-lab's dflash wheel not provided (set ZLAB_DFLASH_PATH; eval \"$(bash tests/interop_setup.sh .stacks)\" sets it)"


def zlab_root() -> str | None:
    """The directory ``ZLAB_DFLASH_PATH`` names when z-lab's decoder can run here, else ``None``
    (unset, or transformers 4.x): for a test whose z-lab part is optional."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        return None
    return os.environ.get(ENV) or None


def zlab_model():
    """The module ``zlab_dflash.model``; skips the calling test when ``ZLAB_DFLASH_PATH`` is unset
    or transformers is 4.x."""
    root = os.environ.get(ENV)
    if not root:
        pytest.skip(SKIP_REASON)
    if not (Path(root) / "zlab_dflash" / "model.py").is_file():
        pytest.fail(f"{ENV}={root} holds no zlab_dflash/model.py (the wheel's dflash/ folder, renamed)")
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:  # its decoder records the cache through 5.x's API
        pytest.skip(f"z-lab's dflash 0.1.0 needs transformers 5 (it pins 5.15.0), not {transformers.__version__}")
    if root not in sys.path:
        sys.path.append(root)  # last: it must shadow nothing
    return importlib.import_module("zlab_dflash.model")
