"""Refuse to run mixed with another distribution that installs the same top-level package.

PyPI already has a ``csp`` (a stream-processing library) and a ``dflash`` (the upstream DFlash
package), and both install the top-level names this project uses. With one of them in the same
environment, Python can load that one's ``__init__`` and this project's submodules (an editable
install's finder maps ``dflash.run`` to this checkout whatever ``dflash.__path__`` says), which
fails far from the cause, or worse, runs. :func:`check` stops that at import with one line on
stderr (exit status 1). The fix is a separate virtual environment for each (docs/csp.md, "Install next to other packages").

Only distributions *named* like the package are inspected (``importlib.metadata.distribution``
is a cheap lookup; scanning every installed distribution costs ~0.1 s per import).
"""

from __future__ import annotations

import sys
from pathlib import Path

DIST = "dflash-csp"


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def other_owner(package: str, here: Path) -> str | None:
    """``"name version"`` of a distribution other than dflash-csp whose files put
    ``package/__init__.py`` into ``here`` (this package's directory), or None."""
    import importlib.metadata as md

    try:
        dist = md.distribution(package)
    except md.PackageNotFoundError:
        return None
    if _canonical(dist.metadata["Name"] or "") == DIST:
        return None
    for f in dist.files or ():
        if f.parts[:1] == (package,) and f.name == "__init__.py" and len(f.parts) == 2:
            try:
                if Path(dist.locate_file(f)).resolve().parent == here:
                    return f"{dist.metadata['Name']} {dist.version}"
            except OSError:
                continue
    return None


def check(package: str, here: str | Path) -> None:
    """Exit with one line when ``package`` is (partly) another distribution's.

    Args:
        package: the top-level package name ("csp" or "dflash").
        here: this project's directory of that package (``Path(__file__).parent`` of a module
            directly inside it).

    Raises:
        SystemExit: ``import package`` loaded another directory's ``__init__``, or another
            distribution's files own this package directory. The message says what to do.
    """
    here = Path(here).resolve()
    loaded = sys.modules.get(package)
    init = getattr(loaded, "__file__", None)
    if init is not None and Path(init).resolve().parent != here:
        raise SystemExit(
            f"error: 'import {package}' loaded {Path(init).resolve()}, not this project's {here}: another "
            f"package named '{package}' is installed in this environment ({sys.prefix}) and the two would "
            f"mix; use a separate virtual environment for dflash-csp (or pip uninstall the other '{package}')")
    owner = other_owner(package, here)
    if owner is not None:
        raise SystemExit(
            f"error: the distribution '{owner}' owns {here} too (it installs a top-level '{package}' package, "
            f"as dflash-csp does) and the two would mix; use a separate virtual environment for dflash-csp "
            f"(or pip uninstall {owner.split()[0]})")


__all__ = ["check", "other_owner"]
