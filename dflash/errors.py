"""The dflash error family: every error dflash raises for a mistake a user can fix.

===================  =========================================================  ==========
``DFlashError``      base class; ``except dflash.errors.DFlashError`` catches all
``ConfigError``      a bad graph file (syntax, schema, unknown key) or a mistake    exit 2
                     across tables (drafter vs target, devices, schedule): one
                     line naming the key path, raised before any data is read
``DataError``        unusable training data (raised by :mod:`dflash.data`)         exit 2
``CheckpointError``  a checkpoint that cannot be found, read or trusted             exit 2
                     (raised by :mod:`dflash.checkpoint`)
``DiskFullError``    a checkpoint could not be written: no space left on the         exit 4
                     device (a ``CheckpointError``; the line names the device)
===================  =========================================================  ==========

Each message is one line that says what to change. csp's own errors (``csp.GraphError`` for a
graph that csp cannot build) stay csp's; :func:`dflash.run.config.load_config` turns the ones it gets
while reading a graph file into :class:`ConfigError` with the same message.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "ConfigError", "DFlashError", "DataError", "DiskFullError"]


class DFlashError(Exception):
    """Base class of dflash's own errors (the message is one line saying what to change)."""


class ConfigError(DFlashError):
    """A bad graph file or a cross-table config mistake; ``python -m dflash.run`` exits 2 with
    the message as its one line, before any data is read or the run directory is written."""


class DataError(DFlashError, ValueError):
    """A problem with the training data a user can fix (bad path, unusable file, bad setting).

    The message names the file or the ``data.*`` key and says what to change. Raised by
    :mod:`dflash.data` (which re-exports it).
    """


class CheckpointError(DFlashError, RuntimeError):
    """A checkpoint could not be found, read or trusted; the message says which and what to do.
    Raised by :mod:`dflash.checkpoint` (which re-exports it)."""


class DiskFullError(CheckpointError):
    """No space left on the device while writing a checkpoint (``ENOSPC``). The message names the
    device and the last good checkpoint; the partial save was removed. ``python -m dflash.run``
    stops with exit code 4."""
