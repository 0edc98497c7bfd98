"""csp._guard: another distribution installing a top-level 'csp' or 'dflash' is refused at import
with one line, instead of silently mixing its modules with this project's (PyPI's ``csp`` and
``dflash`` install the same top-level names)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(site: Path, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}")
    return subprocess.run([sys.executable, "-c", code], cwd=site, env=env, capture_output=True, text=True,
                          timeout=120)


def _fake_dist(site: Path, name: str, version: str = "9.9") -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{name}/__init__.py,,\n{name}-{version}.dist-info/RECORD,,\n")


@pytest.mark.parametrize("package", ["csp", "dflash"])
def test_another_distribution_owning_the_package_directory_is_one_line_exit_1(tmp_path, package):
    """Invariant: when another distribution's files put ``PKG/__init__.py`` into this project's
    package directory (pip installed it over ours), importing PKG exits 1 with one line naming it
    and saying to use a separate environment."""
    site = tmp_path / "site"
    site.mkdir()
    (site / package).symlink_to(ROOT / package)  # its RECORD now resolves into our directory
    _fake_dist(site, package)
    proc = _run(site, f"import {package}")
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith(f"error: the distribution '{package} 9.9' owns {ROOT / package} too")
    assert "separate virtual environment" in err


def test_another_dflash_init_with_our_submodules_is_refused(tmp_path):
    """Regression: with upstream dflash installed, ``import dflash`` loaded its
    ``__init__`` while ``python -m dflash.run`` loaded ours. Invariant: our entry modules refuse
    to run under another package's ``__init__``, with one line."""
    site = tmp_path / "site"
    (site / "dflash").mkdir(parents=True)
    # stands in for an editable finder that maps dflash.* to this checkout whatever __path__ says
    (site / "dflash" / "__init__.py").write_text(f"__path__.append({str(ROOT / 'dflash')!r})\n")
    for module in ("dflash.run.args", "dflash.observe.plot", "dflash.model.drafter"):
        proc = _run(site, f"import {module}")
        assert proc.returncode == 1, (module, proc.stderr)
        err = proc.stderr.strip()
        assert "\n" not in err and err.startswith(f"error: 'import dflash' loaded {site / 'dflash' / '__init__.py'}")


def test_our_own_editable_install_passes():
    """Invariant: the project itself (editable or not) is never refused."""
    from csp._guard import check, other_owner

    assert other_owner("csp", ROOT / "csp") is None
    check("csp", ROOT / "csp")
    check("dflash", ROOT / "dflash")
