"""A layout as a graph file: the run's ``config.toml`` with the target, postprocess and drafter
replicas placed on devices and ranks, and the torchrun command that starts it.

Placement (docs/distributed.md): ``devices`` are host-local (``cuda:0`` on every host), ``ranks``
global; torchrun numbers ranks host by host (node rank x processes per node + local rank). A
drafter replica is one rank (its DDP group spans them); targets run on a rank of their own host.
Pods keep ``hidden`` and ``features`` inside their rank (``rank_local``); a split layout deals
``hidden`` to the drafter ranks, so it cannot be ``ordered`` there (one receiving rank only).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import msgspec

from dflash.plan.model import Layout
from dflash.run.config import PATH_KEYS, is_path


def placement(lay: Layout) -> dict[str, tuple[list[str], list[int]]]:
    """``{"target" | "drafter": (devices, ranks)}`` for ``lay``, one entry per replica."""
    per_host = lay.gpus // lay.hosts
    t_dev, t_rank, d_dev, d_rank = [], [], [], []
    if lay.kind == "pods":
        pods_per_host = per_host // lay.pod_gpus
        for p in range(lay.drafters):
            first = (p % pods_per_host) * lay.pod_gpus  # host-local GPU index
            gpus = [f"cuda:{first + i}" for i in range(lay.pod_gpus)]
            mine = gpus if lay.shared else gpus[:-1]
            t_dev += mine
            t_rank += [p] * len(mine)
            d_dev.append(gpus[-1])
            d_rank.append(p)
    else:
        k_h, m_h = lay.targets // lay.hosts, lay.drafters // lay.hosts
        for h in range(lay.hosts):
            t_dev += [f"cuda:{i}" for i in range(k_h)]
            t_rank += [h * m_h + i % m_h for i in range(k_h)]
            d_dev += [f"cuda:{k_h + j}" for j in range(m_h)]
            d_rank += [h * m_h + j for j in range(m_h)]
    return {"target": (t_dev, t_rank), "drafter": (d_dev, d_rank)}


def world_size(lay: Layout) -> int:
    """Ranks the layout needs: one per drafter replica."""
    return lay.drafters


def graph_dict(config: dict[str, Any], lay: Layout, slug: str, cwd: str | Path | None = None) -> dict[str, Any]:
    """The run's config with ``lay`` placed. Relative paths become absolute against ``cwd`` (the
    directory the measured run started in; default the current one), since a graph file's relative
    paths are read against its own directory. ``run.out_dir`` gets ``-<slug>`` appended."""
    cfg = copy.deepcopy(config)
    base = Path(cwd or os.getcwd())
    for key in PATH_KEYS:
        table, _, field = key.partition(".")
        value = cfg.get(table, {}).get(field)
        if isinstance(value, str) and is_path(key, value) and not Path(value).is_absolute():
            cfg[table][field] = str(base / value)
    cfg["run"]["out_dir"] = cfg["run"]["out_dir"].rstrip("/") + f"-{slug}"
    cfg["run"]["name"] = f"{cfg['run'].get('name', 'run')}-{slug}"
    place = placement(lay)
    multi = world_size(lay) > 1
    by_kind = {p["kind"]: p for p in cfg["process"]}
    tgt, post, dft = (by_kind[k] for k in ("dflash.target", "dflash.postprocess", "dflash.drafter"))
    for proc, (devs, ranks) in ((tgt, place["target"]), (post, place["drafter"]), (dft, place["drafter"])):
        proc.pop("device", None)
        proc.update(replicas=len(devs), devices=devs)
        proc.pop("ranks", None)
        if multi:
            proc["ranks"] = ranks
    for proc in cfg["process"]:
        if proc not in (tgt, post, dft):
            proc.pop("ranks", None)
            if multi:
                proc["ranks"] = [0] * proc.get("replicas", 1)
    inner = set(tgt["outputs"].values()) | set(post["outputs"].values())
    for ch in cfg["channel"]:
        if ch["name"] in inner and multi:
            ch["ordered"] = False
            ch["rank_local"] = lay.kind == "pods"
    return cfg


def graph_toml(config: dict[str, Any], lay: Layout, slug: str, header: str, cwd: str | Path | None = None) -> str:
    """:func:`graph_dict` as TOML text, ``header`` (lines) first as comments."""
    body = msgspec.toml.encode(graph_dict(config, lay, slug, cwd)).decode()
    return "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines()) + "\n" + body


def command(lay: Layout, graph: str) -> str:
    """The command that starts ``graph`` for ``lay``: plain ``python -m dflash.run`` when one rank
    suffices, else torchrun, the same line on every host (c10d rendezvous at ``HOST0``, the first
    host's address; every host holds the same replicas, so the order c10d numbers them in does not
    matter)."""
    if world_size(lay) == 1:
        return f"python -m dflash.run {graph}"
    nproc = world_size(lay) // lay.hosts
    if lay.hosts == 1:
        return f"torchrun --nproc-per-node {nproc} -m dflash.run {graph}"
    return (f"torchrun --nnodes {lay.hosts} --nproc-per-node {nproc} --rdzv-backend c10d "
            f"--rdzv-endpoint HOST0:29500 --rdzv-id dflash -m dflash.run {graph}")


__all__ = ["command", "graph_dict", "graph_toml", "placement", "world_size"]
