"""Write the config of SpecForge 0.2's offline DFlash run that ``python -m benchmarks.peers.run`` starts:
the cache and drafter shape of ``benchmarks/peers/cache.py``, SpecForge's own recipe otherwise.

* ``model``: the target (its embedding and LM head, frozen) and ``draft_model_config`` =
  ``DIR/draft_config.json``, so the drafter's layers, block size, target layers and mask token are
  the graph's;
* ``data``: ``hidden_states_path`` = ``DIR/specforge`` (offline mode), the graph's ``max_length``;
* ``training``: ``strategy = "dflash"``, ``max_steps``, and ``batch_size`` rows of ``max_length``
  tokens per step, so that a step holds the graph's ``[data].tokens_per_batch`` tokens; checkpoints
  every ``save_interval`` steps (SpecForge saves nothing when it is stopped by a signal).

Learning rate, schedule, loss and optimizer are SpecForge's defaults; ``specforge.cli train`` takes
``section.field=value`` overrides after the config. The file is JSON, which YAML reads as it is.

    python -m benchmarks.peers.specforge_config DIR -o RUN_DIR --max-steps N [--save-every 250]
        [--tokens-per-step T]   # writes RUN_DIR.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def specforge_config(cache_dir: Path, output_dir: Path, max_steps: int, save_every: int = 250,
                     tokens_per_step: int | None = None) -> dict:
    """The config as a dict (module doc), from ``cache_dir/cache.json``."""
    info = json.loads((cache_dir / "cache.json").read_text())
    rows = max(1, (tokens_per_step or info["tokens_per_batch"]) // info["max_length"])
    return {
        "model": {"target_model_path": info["target"],
                  "draft_model_config": str((cache_dir / "draft_config.json").resolve())},
        "data": {"hidden_states_path": str((cache_dir / "specforge").resolve()), "max_length": info["max_length"]},
        "training": {"strategy": "dflash", "max_steps": max_steps, "batch_size": rows,
                     "save_interval": save_every, "log_interval": 50, "seed": 0},
        "output_dir": str(output_dir),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers.specforge_config",
                                description=__doc__.split("\n")[0])
    p.add_argument("cache_dir", help="the directory benchmarks/peers/cache.py filled")
    p.add_argument("-o", "--output-dir", required=True, help="SpecForge's run directory (the config goes beside it)")
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--save-every", type=int, default=250)
    p.add_argument("--tokens-per-step", type=int, default=None, help="default: the graph's [data].tokens_per_batch")
    args = p.parse_args(argv)
    out = Path(args.output_dir)
    try:
        cfg = specforge_config(Path(args.cache_dir), out, args.max_steps, args.save_every, args.tokens_per_step)
    except (OSError, ValueError, KeyError) as e:
        print(f"peers.specforge_config: {args.cache_dir}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.yaml").write_text(json.dumps(cfg, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
