"""DFlash block-diffusion drafter training, expressed as a csp process graph.

Entry points: ``python -m dflash.run GRAPH.toml``, ``python -m dflash.eval``,
``python -m dflash.export``, ``python -m dflash.logs``.
"""

from pathlib import Path as _Path

from csp._guard import check as _check_owner

__version__ = "0.1.0"
_check_owner("dflash", _Path(__file__).parent)  # PyPI's upstream 'dflash' mixed in: one line, exit 1
