"""What a device call carries beside the working tree, made usable on the machine: wheels the image
lacks (``.whl/*.whl``, installed without an index into a directory put on the path), gzipped data
(unpacked once), and the held-out prompts file every quality recipe decodes.

The GPU machine reaches no package index, so every package a recipe needs beyond the image comes
as a wheel in ``.whl`` (``pip download --no-deps ... --python-version 3.12``; the peers' wheels:
``benchmarks/peers/wheels.sh``).
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.recipe.step import python, run

WHEELS = Path(".whl")


def on_path(directory: Path) -> None:
    """Put ``directory`` first on the import path of this process and of every step it starts."""
    directory = str(directory)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = directory + (f":{old}" if old else "")


def install_wheels(wheels: Path, target: Path, log: Path, *, once: bool = False) -> int | None:
    """``pip install --no-index --no-deps --target TARGET WHEELS/*.whl``, its output in ``log``.

    Returns pip's exit status, or None when ``wheels`` holds no wheel (or, with ``once``, when
    ``target`` already exists: installed by an earlier call on this machine).
    """
    found = sorted(Path(wheels).glob("*.whl"))
    if not found or (once and Path(target).is_dir()):
        return None
    return run(python("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", target, *found), log)


def use_wheels(target: Path, log: Path, wheels: Path = WHEELS) -> int | None:
    """The carried wheels installed into ``target`` and put on the path (see :func:`install_wheels`)."""
    rc = install_wheels(wheels, target, log)
    if rc is not None:
        on_path(target)
    return rc


def gunzip(src: Path, dst: Path, *, once: bool = True) -> bool:
    """``src`` (gzip) unpacked to ``dst``; with ``once``, an existing ``dst`` is kept. False when
    ``src`` is missing."""
    if not Path(src).is_file():
        return False
    if once and Path(dst).exists():
        return True
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(src, "rb") as f, open(dst, "wb") as out:
        shutil.copyfileobj(f, out)
    return True


def gzip_to(src: Path, dst: Path) -> None:
    """``src`` compressed to ``dst`` (``gzip -c SRC > DST``)."""
    with open(src, "rb") as f, gzip.open(dst, "wb") as out:
        shutil.copyfileobj(f, out)


def concat(sources: list[Path], dst: Path) -> int:
    """The files of ``sources`` (gzipped ones unpacked) one after another into ``dst``; its lines."""
    with open(dst, "wb") as out:
        for src in sources:
            with (gzip.open(src, "rb") if str(src).endswith(".gz") else open(src, "rb")) as f:
                shutil.copyfileobj(f, out)
    with open(dst, "rb") as f:
        return sum(1 for _ in f)


def held_out_prompts(path: Path, num: int, first_unused: int = 8000, *, carried: Path = WHEELS / "prompts.jsonl",
                     reuse: bool = True) -> None:
    """The quality runs' eval prompts at ``path``: kept if there (``reuse``), else the carried copy,
    else written by ``benchmarks.quality.prompts`` (the first ``num`` held-out conversations from
    ``first_unused`` on).

    Raises:
        RuntimeError: benchmarks.quality.prompts failed (its output is in the message).
    """
    path = Path(path)
    if reuse and path.is_file():
        return
    if reuse and Path(carried).is_file():
        shutil.copyfile(carried, path)
        return
    proc = subprocess.run(python("-m", "benchmarks.quality.prompts", "-o", path, "--first-unused", first_unused,
                                 "--num", num), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmarks.quality.prompts failed: {proc.stderr.strip()[-300:]}")
    print(proc.stderr.strip(), file=sys.stderr)


def split_tar(directory: Path, prefix: str, part_bytes: int = 15 * 2**20, *,
              exclude: str = "train_state") -> list[Path]:
    """``directory`` as a tar archive cut into parts of ``part_bytes`` (``PREFIXaa``, ``PREFIXab`` ...,
    as ``tar cf - | split -b`` names them) small enough for a device call to carry back; members
    whose name starts with ``exclude`` (the optimizer state) are left out."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(directory, arcname=Path(directory).name,
                filter=lambda m: None if Path(m.name).name.startswith(exclude) else m)
    data, parts = buf.getvalue(), []
    for i in range(0, len(data), part_bytes):
        n = i // part_bytes
        part = Path(f"{prefix}{chr(97 + n // 26)}{chr(97 + n % 26)}")
        part.write_bytes(data[i:i + part_bytes])
        parts.append(part)
    return parts


def join_tar(parts: list[Path], dest: Path) -> None:
    """Parts written by :func:`split_tar` (or ``split``), in name order, unpacked under ``dest``."""
    import io
    import tarfile

    Path(dest).mkdir(parents=True, exist_ok=True)
    data = b"".join(Path(p).read_bytes() for p in sorted(parts))
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(dest, filter="data")
