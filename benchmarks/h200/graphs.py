"""The example graphs the H200 scripts build their runs from, and the settings that shrink them.

``GRAPH_1GPU`` (examples/qwen3-8b-h200.toml: both stages on cuda:0) and ``GRAPH_2GPU``
(examples/qwen3-8b-h200x2.toml: target cuda:0, drafter cuda:1); ``TINY_SETTINGS`` (``--smoke`` /
``--tiny``: the same graphs and code paths with tiny shapes) and ``CPU_SETTINGS`` (``--smoke``:
every stage on the CPU). Used by ``bench_plan.py`` and ``perf_rows.py``; ``bench.py`` and ``perf.py``
re-export them (``lengths.py`` and ``compile_gap.py`` import them from ``bench.py``).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GRAPH_1GPU = ROOT / "examples" / "qwen3-8b-h200.toml"
GRAPH_2GPU = ROOT / "examples" / "qwen3-8b-h200x2.toml"

# --smoke / --tiny: the same graphs and code paths with tiny shapes (the vocabulary is the tokenizer's).
TINY_SETTINGS = [
    "target.preset=tiny", "drafter.num_layers=2", "drafter.block_size=8", "train.num_anchors=8",
    "data.max_samples=160", "data.max_length=256", "data.tokens_per_batch=512", "data.packed_rows=2",
    "data.num_workers=1", "data.holdout=8", "trace.stats_interval_s=0.2",
]
CPU_SETTINGS = ["process.target.device=cpu", "process.postprocess.device=cpu", "process.drafter.device=cpu",
                # the graphs' flex_attention trains on CUDA only (no flex backward on the CPU)
                'drafter.attn_implementation="sdpa"', 'target.attn_implementation="sdpa"']
