"""The model's inputs from a finished run directory: ``csp/stats.jsonl`` (busy time per stage, bytes
per channel), ``metrics.jsonl`` (padding), ``config.toml`` (the graph, the batch) and the newest
checkpoint (the drafter's size). Stage capacities come from :func:`csp.observe.whatif.fit`, converted from
batches/s to tokens/s with the real tokens per batch."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from csp.errors import GraphError
from csp.graph.load import read_toml
from csp.observe.backpressure import StatsFormatError, read_stats, summarize
from csp.observe.whatif import fit
from dflash.errors import ConfigError
from dflash.plan.model import Inputs
from dflash.run.memory import drafter_bytes, head_rows, mask_elements

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Colocation efficiency when the run cannot measure it: benchmarks/results/LOG.md, "Both stages on
# flex_attention, one H200": colocated data-parallel on one GPU ran 19.1K tok/s against the serial
# bound 1 / (1/33.6K + 1/44.8K) = 19.2K of the two stages measured alone.
DEFAULT_COLOC = 0.99
DEFAULT_COLOC_SOURCE = "default 0.99 (benchmarks/results/LOG.md: colocated 19.1K vs serial bound 19.2K, one H200)"
IDS_BYTES_PER_TOKEN = 21  # input_ids int64 + position_ids int64 + doc_ids int32 + loss_mask bool


class PlanError(ConfigError):
    """A run directory or a number the plan cannot use; the message says what to change."""


class Measured(msgspec.Struct, kw_only=True):
    """A run's inputs to the model and its own check.

    Attributes:
        inputs: the model's inputs (:class:`dflash.plan.model.Inputs`).
        measured_tok_s: the run's throughput (batches sent over the stats window x real tokens per batch).
        predicted_tok_s: the model's throughput for the run's own layout: the lowest stage capacity.
        bottleneck: the stage (or channel) with that capacity.
        config: the run's ``config.toml`` as a dict (the base of the written graph).
        notes: what the reader should know about the inputs (shared devices, defaults used).
        measured_over: the span ``measured_tok_s`` covers, in words (the whole stats log, start-up
            included, or its last W s): the run summary's throughput is a mean of its training
            windows instead, so the two differ by the start-up.
        measured_on: the device kind the stage rates come from: "cuda" when the target and the
            drafter both ran on CUDA devices, else "cpu"; "given" when both rates were given
            (``--target-tok-s`` and ``--drafter-tok-s``).
    """

    inputs: Inputs
    measured_tok_s: float
    predicted_tok_s: float
    bottleneck: str
    config: dict[str, Any]
    notes: list[str]
    measured_over: str
    measured_on: str = "cuda"


def safetensors_bytes(path: Path) -> int:
    """Tensor bytes in a ``.safetensors`` file, from its header (nothing else is read)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


def target_params(hf: PretrainedConfig) -> int:
    """Parameters of a Qwen3/Llama-style decoder from its transformers config (embedding, LM head
    unless tied, per layer q/k/v/o projections, the gated MLP and two norms)."""
    h, inter, n_layers = hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers
    hd = getattr(hf, "head_dim", None) or h // hf.num_attention_heads
    attn = h * hd * (hf.num_attention_heads + 2 * hf.num_key_value_heads) + hf.num_attention_heads * hd * h
    tied = getattr(hf, "tie_word_embeddings", False)
    return hf.vocab_size * h * (1 if tied else 2) + n_layers * (attn + 3 * h * inter + 2 * h)


def _proc(cfg: dict, kind: str, run: Path) -> dict:
    found = [p for p in cfg.get("process", []) if p.get("kind") == kind]
    if len(found) != 1:
        raise PlanError(f"{run}/config.toml has {len(found)} processes of kind {kind!r}; the plan needs one "
                        "(a dflash.run graph)")
    return found[0]


def _devices(p: dict) -> list[str]:
    return list(p.get("devices") or [p.get("device") or "cpu"] * p.get("replicas", 1))


def _newest_checkpoint(run: Path) -> Path | None:
    steps = sorted((run / "checkpoints").glob("step_*/model.safetensors"))
    return steps[-1].parent if steps else None


def _target_mem(cfg: dict, device: str, notes: list[str]) -> float:
    from dflash.model.target_config import TargetConfig, build_hf_config

    try:
        hf = build_hf_config(msgspec.convert(cfg.get("target", {}), TargetConfig))
    except (FileNotFoundError, msgspec.ValidationError, ValueError) as exc:
        notes.append(f"target memory unknown ({exc}); --gpu-mem counts the drafter only")
        return 0.0
    return target_params(hf) * (2 if device.startswith("cuda") else 4)


def from_run(run: str | Path, *, target_tok_s: float | None = None, drafter_tok_s: float | None = None,
             coloc: float | None = None, window_s: float | None = None,
             net_bytes_per_s: float | None = None) -> Measured:
    """Read a finished ``dflash.run`` directory into the model's inputs.

    ``target_tok_s`` / ``drafter_tok_s`` replace the run's stage rates (e.g. rates measured alone
    by ``benchmarks/h200/bench.py`` when this run shared a device); ``coloc`` replaces the
    colocation efficiency. Raises PlanError (a one-line message) for a directory that is not a
    finished run or whose stats window holds too few batches.
    """
    run = Path(run)
    if not (run / "config.toml").is_file():
        raise PlanError(f"{run} has no config.toml: point at a dflash.run directory (its run.out_dir)")
    try:
        cfg = read_toml(run / "config.toml")  # bad TOML, a too-long integer, not UTF-8: one line
    except GraphError as exc:
        raise PlanError(str(exc)) from None
    try:
        summary = summarize(read_stats(run), window_s)
    except (FileNotFoundError, StatsFormatError) as exc:
        raise PlanError(f"{run}: {exc}") from None
    model = fit(summary)
    if model is None:
        raise PlanError(f"{run}: too few batches in the stats window to measure the stages; run more steps "
                        "(or widen --window)")
    tgt, dft = _proc(cfg, "dflash.target", run), _proc(cfg, "dflash.drafter", run)
    caps = {b.name: b for b in model.bounds}
    for p in (tgt, dft):
        if p["name"] not in caps:
            raise PlanError(f"{run}: process {p['name']!r} did no work in the stats window; run more steps")
    waste = [r["padding_waste"] for r in _records(run) if r.get("kind") == "train" and "padding_waste" in r]
    tokens = cfg.get("data", {}).get("tokens_per_batch", 16384)
    per_item = tokens * (1 - sum(waste) / len(waste) if waste else 1.0)  # real tokens per batch
    measured = model.measured * per_item
    rate = lambda b: b.capacity / b.replicas * per_item  # one replica's tokens/s
    notes: list[str] = []
    t_dev, d_dev = _devices(tgt), _devices(dft)
    measured_on = ("given" if target_tok_s and drafter_tok_s else
                   "cuda" if all(d.startswith("cuda") for d in t_dev + d_dev) else "cpu")
    shared = sorted(set(t_dev) & set(d_dev))
    t_rate, d_rate = target_tok_s or rate(caps[tgt["name"]]), drafter_tok_s or rate(caps[dft["name"]])
    coloc_source = "given (--coloc)"
    if coloc is None and shared and target_tok_s and drafter_tok_s:
        coloc = measured / len(shared) * (1 / t_rate + 1 / d_rate)
        coloc_source = f"measured: this run on {len(shared)} shared device(s) against the rates given"
    elif coloc is None:
        coloc, coloc_source = DEFAULT_COLOC, DEFAULT_COLOC_SOURCE
    if shared and not (target_tok_s and drafter_tok_s):
        notes.append(f"target and drafter shared {', '.join(shared)} in this run: the stage rates are "
                     "shared rates; give --target-tok-s and --drafter-tok-s measured alone")
    hidden = sum(c.bytes_per_s for c in summary.channels if tgt["name"] in c.writers)
    ckpt = _newest_checkpoint(run)
    grad, d_mem = 0.0, 0.0
    if ckpt is None:
        notes.append("no checkpoint in the run: the drafter's all-reduce and memory are left out")
    else:
        from dflash.checkpoint.resume import saved_drafter_config

        drafter = saved_drafter_config(json.loads((ckpt / "drafter_config.json").read_text(encoding="utf-8")))
        grad = float(safetensors_bytes(ckpt / "model.safetensors"))  # fp32 masters: gradients as large
        data, train = cfg.get("data", {}), cfg.get("train", {})
        packed, anchors = data.get("packed_rows", 1), train.get("num_anchors", 256)
        slots = packed * anchors * drafter.block_size
        # the model the run's own memory check uses, with the parameters the checkpoint holds
        d_mem = sum(drafter_bytes(
            drafter, slots, checkpointing=drafter.activation_checkpointing, params=grad / 4,
            head_rows=head_rows(slots, lm_head_chunk=train.get("lm_head_chunk", 2048),
                                sync_free_loss=train.get("sync_free_loss", True)),
            mask_elements=mask_elements(drafter.attn_implementation, packed, anchors, drafter.block_size,
                                        data.get("tokens_per_batch", 0) // packed)))
    inputs = Inputs(target_tok_s=t_rate, drafter_tok_s=d_rate, coloc=coloc, coloc_source=coloc_source,
                    bytes_per_token=hidden / model.measured / per_item, grad_bytes=grad, tokens_per_batch=tokens,
                    target_mem=_target_mem(cfg, t_dev[0], notes), drafter_mem=d_mem,
                    **({"net_bytes_per_s": net_bytes_per_s} if net_bytes_per_s else {}))
    return Measured(inputs=inputs, measured_tok_s=measured, predicted_tok_s=model.bounds[0].capacity * per_item,
                    bottleneck=model.bounds[0].name, config=cfg, notes=notes,
                    measured_over="the whole stats log, start-up included" if window_s is None
                    else f"the stats log's last {window_s:g} s", measured_on=measured_on)


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line of a crashed run
            continue
    return out


__all__ = ["DEFAULT_COLOC", "IDS_BYTES_PER_TOKEN", "Measured", "PlanError",
           "from_run", "safetensors_bytes", "target_params"]
