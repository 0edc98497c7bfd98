"""``dflash.resume``: the older name of :mod:`dflash.checkpoint.resume` (the same module object,
so ``monkeypatch.setattr("dflash.resume.X", ...)`` patches what the package uses)."""

import sys

from dflash.checkpoint import resume as _resume

sys.modules[__name__] = _resume
