"""The dflash error family: every error dflash raises for a mistake a user can fix.

===================  =========================================================  ==========
``DFlashError``      base class; ``except dflash.errors.DFlashError`` catches all
``ConfigError``      a bad graph file (syntax, schema, unknown key) or a mistake    exit 2
                     across tables (drafter vs target, devices, schedule): one
                     line naming the key path, raised before any data is read
``DataError``        unusable training data (:mod:`dflash.data`, its home)          exit 2
``CheckpointError``  a checkpoint that cannot be found, read or trusted             exit 2
                     (:mod:`dflash.checkpoint`, its home)
===================  =========================================================  ==========

Each message is one line that says what to change. csp's own errors (``csp.GraphError`` for a
graph that csp cannot build) stay csp's; :func:`dflash.config.load_config` turns the ones it gets
while reading a graph file into :class:`ConfigError` with the same message.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "ConfigError", "DFlashError", "DataError"]


class DFlashError(Exception):
    """Base class of dflash's own errors (the message is one line saying what to change)."""


class ConfigError(DFlashError):
    """A bad graph file or a cross-table config mistake; ``python -m dflash.run`` exits 2 with
    the message as its one line, before any data is read or the run directory is written."""


def __getattr__(name: str):
    # DataError and CheckpointError live with the code that raises them; imported lazily here
    # because their modules import this one.
    if name == "DataError":
        from dflash.data.config import DataError
        return DataError
    if name == "CheckpointError":
        from dflash.checkpoint.format import CheckpointError
        return CheckpointError
    raise AttributeError(f"module 'dflash.errors' has no attribute {name!r}")
