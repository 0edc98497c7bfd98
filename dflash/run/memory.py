"""GPU memory a run needs, estimated before any work, and the check that stops a run that will not fit.

A length or batch that will not fit used to show itself as an out-of-memory error minutes into the
run (after the target loaded, the data tokenized and the kernels compiled). :func:`check_memory`
estimates each CUDA device's peak from the resolved config alone and stops a run whose estimate is
clearly over the card, with one line naming what would fit: activation checkpointing, fewer
anchors, fewer tokens per batch, or the stages on separate GPUs.

The model (bytes; ``P`` trainable drafter parameters, ``H`` hidden size, ``n`` drafter layers,
``V`` vocabulary, ``S`` drafter slots per step = ``packed_rows x num_anchors x block_size``, ``c``
slots the LM head and loss take at a time = ``min(S, [train].lm_head_chunk)``, ``T`` tokens per batch):

- drafter: ``13.4 P`` (fp32 weights, gradients and optimizer state) + the frozen bf16 embedding and
  LM head + ``16 V c`` (the chunked head's fp32 ``[c, V]`` buffers: they grow with the vocabulary,
  not with the drafter's width) + ``54 H n S`` of activations (``34 H n S`` with
  ``[drafter].activation_checkpointing``), the batches' captured features in flight included;
  DFlash2 adds 1/3 to each layer's activations (its two convolutions) and ``8 K r`` per slot for
  its selector (the ``[K, r]`` fp32 successor rows of each slot's K candidates, kept for the
  backward, and their gradient); the ``sdpa`` attention adds its dense mask, ``3`` bytes an
  element of ``[rows, A bs, L + A bs]`` (the bool mask and the bf16 bias made of it);
- target: its bf16 weights up to the last captured layer (1 byte a weight in FP8) + ``35 H T`` of
  no-grad forward activations and captured hidden states.

The activation constants are fitted on ``benchmarks/results/lengths_h200`` (one H200, the Qwen3-8B
shape, a 5-layer drafter, one row of 2K-32K tokens, anchors at one per 16 tokens): the drafter's
peak less the target's resident weights, 22.2 / 28.6 / 37.0 / 54.0 GiB measured at 2K / 8K / 16K /
32K against 22.2 / 28.5 / 37.0 / 53.8 estimated, and 41.3 GiB against 41.2 with checkpointing at
32K; the target's 13.6 / 14.5 / 15.6 / 17.7 GiB against 13.7 / 14.5 / 15.6 / 17.8. That table alone
cannot tell the parameters' bytes from the head's buffers (one width, one vocabulary); a second
shape does: Qwen3-1.7B's (half the width, the same vocabulary) whole-run peak on one H100, 21.8
GiB at 4 rows of 4,096 tokens (``benchmarks/results/memory_h100``), fixes ``13.4 P`` and ``16 V c``
(a model with ``18 P`` and no head term had estimated 18.3 GiB there). The Qwen3-8B file as shipped
then estimates 52.5 GiB against 53.5 measured on that H100. DFlash2's terms come from the tensors
autograd saves, counted on a CPU (per slot and layer 24.5 KB against DFlash's 18.5 KB at ``H = 128``;
per slot 18.9 KB more outside the layers, ``K r = 4,096``); the dense mask's 3 bytes an element are
an assumption. Together they bring SmolLM2-135M's DFlash2 run at 512 anchors a row (sdpa, one
H100: 25.2 GiB) from an estimate of 14.0 GiB to 25.5. Checkpointing's saving is not linear in
the measurements (5.5 GiB of 28.6 at 8K, 12.7 of 37.0 at 16K and of 54.0 at 32K): its constant is
fitted at 32K, so it overestimates shorter rows (25.2 GiB against 23.1 at 8K, 30.5 against 24.4 at
16K), which is why the check refuses only an estimate that is over the card by more than
:data:`REFUSE_OVER` and warns nearer the edge. ``run.memory_check = false`` skips it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import msgspec

from dflash.checkpoint.config import checkpoint_bytes
from dflash.errors import ConfigError

if TYPE_CHECKING:
    from dflash.model.drafter_config import DrafterConfig
    from dflash.run.config import DFlashFile

__all__ = [
    "ACT_BYTES",
    "ACT_BYTES_CHECKPOINTED",
    "DENSE_MASK_BYTES",
    "DFLASH2_LAYER_FACTOR",
    "DRAFTER_BYTES_PER_PARAM",
    "HEAD_BYTES",
    "REFUSE_OVER",
    "SELECTOR_BYTES",
    "TARGET_ACT_BYTES",
    "WARN_OVER",
    "DeviceMemory",
    "check_memory",
    "dense_mask_elements",
    "drafter_bytes",
    "drafter_slots",
    "estimate",
    "estimate_line",
    "head_rows",
    "levers",
    "mask_elements",
    "memory_fields",
    "slot_bytes",
    "target_bytes",
]

GIB = 2**30
DRAFTER_BYTES_PER_PARAM = 13.4
"""The drafter's weights, gradients and optimizer state per trainable parameter (fitted at two widths)."""
HEAD_BYTES = 16
"""The chunked LM head and loss per vocabulary entry and slot of one chunk: four fp32 ``[c, V]`` buffers."""
ACT_BYTES = 54
"""Drafter activations per slot, hidden unit and layer, without checkpointing (features in flight included)."""
ACT_BYTES_CHECKPOINTED = 34
"""The same with ``[drafter].activation_checkpointing`` (fitted at 32K tokens; high for shorter rows)."""
DFLASH2_LAYER_FACTOR = 4 / 3
"""DFlash2's activations per layer against DFlash's (its two convolutions per layer)."""
SELECTOR_BYTES = 8
"""DFlash2's selector per slot, candidate and codebook rank: fp32 successor rows and their gradient."""
DENSE_MASK_BYTES = 3
"""``drafter.attn_implementation = "sdpa"``: per element of the dense mask (bool, and the bf16 bias)."""
TARGET_ACT_BYTES = 35
"""Target forward activations and captured hidden states per batch token and hidden unit."""
REFUSE_OVER = 1.15
"""The run stops when a device's estimate is above this multiple of its memory."""
WARN_OVER = 0.9
"""The run warns (and goes on) when a device's estimate is above this multiple of its memory."""


class DeviceMemory(msgspec.Struct, frozen=True, kw_only=True):
    """One CUDA device's estimated peak, in bytes, split into what the settings scale.

    Attributes:
        device: the device ("cuda:0").
        target_weights, target_act: the target replicas' weights, and their forward activations
            (in proportion to ``data.tokens_per_batch``).
        drafter_fixed, drafter_act: the drafter replicas' parameters, optimizer state and frozen
            embedding and head, and their activations (in proportion to the slots per step).
    """

    device: str
    target_weights: float = 0.0
    target_act: float = 0.0
    drafter_fixed: float = 0.0
    drafter_act: float = 0.0

    @property
    def total(self) -> float:
        return self.target_weights + self.target_act + self.drafter_fixed + self.drafter_act

    def __add__(self, other: DeviceMemory) -> DeviceMemory:
        return DeviceMemory(device=self.device, **{f: getattr(self, f) + getattr(other, f) for f in _PARTS})


_PARTS = ("target_weights", "target_act", "drafter_fixed", "drafter_act")


def drafter_slots(cfg: DFlashFile, block_size: int) -> int:
    """Drafter positions trained per step: ``packed_rows x num_anchors x block_size``."""
    return cfg.data.packed_rows * cfg.train.num_anchors * block_size


def head_rows(slots: int, *, lm_head_chunk: int, sync_free_loss: bool) -> int:
    """Slots the LM head and loss take at a time, from ``[train]``'s settings: ``lm_head_chunk``
    with the sync-free loss (0 = all), every slot without it (an over-estimate: only the trained
    slots go through)."""
    chunk = lm_head_chunk if sync_free_loss else 0
    return min(slots, chunk) if chunk else slots


def drafter_bytes(drafter: DrafterConfig, slots: int, *, checkpointing: bool,
                  head_rows: int | None = None, mask_elements: int = 0,
                  params: float | None = None) -> tuple[float, float]:
    """One drafter replica's estimated peak, bytes, as ``(fixed, activations)`` (the model in the
    module docstring).

    Args:
        drafter: the resolved drafter config (every dimension set).
        slots: drafter positions per step (:func:`drafter_slots`).
        checkpointing: ``[drafter].activation_checkpointing``.
        head_rows: slots the LM head takes at a time (:func:`head_rows`; default: all of them).
        mask_elements: elements of the dense attention mask per step (:func:`dense_mask_elements`;
            0 with flex attention's block mask).
        params: the drafter's parameter count when known (a saved checkpoint's weights, as
            :mod:`dflash.plan` reads them); default: counted from the config.
    """
    if params is None:
        params = checkpoint_bytes(drafter) / 12  # fp32 weights and two moments: 12 bytes a parameter
    frozen = 2 * drafter.vocab_size * drafter.hidden_size * 2  # bf16 embedding and LM head
    head = HEAD_BYTES * drafter.vocab_size * (slots if head_rows is None else head_rows)
    per_slot = _drafter_slot_bytes(drafter, checkpointing)
    return (DRAFTER_BYTES_PER_PARAM * params + frozen + head,
            per_slot * slots + DENSE_MASK_BYTES * mask_elements)


def slot_bytes(hidden: int, layers: int, *, checkpointing: bool = False, variant: str = "dflash",
               top_k: int = 16, rank: int = 256) -> float:
    """Drafter activation bytes per slot (the model in the module docstring): ``54 H n``
    (``34 H n`` checkpointed), DFlash2's layers a third more and its selector ``8 K r``."""
    per_slot = (ACT_BYTES_CHECKPOINTED if checkpointing else ACT_BYTES) * hidden * layers
    if variant == "dflash2":
        per_slot = per_slot * DFLASH2_LAYER_FACTOR + SELECTOR_BYTES * top_k * rank
    return per_slot


def _drafter_slot_bytes(drafter: DrafterConfig, checkpointing: bool) -> float:
    """:func:`slot_bytes` for a resolved drafter config."""
    return slot_bytes(drafter.hidden_size, drafter.num_layers, checkpointing=checkpointing,
                      variant=drafter.variant, top_k=drafter.selector_top_k, rank=drafter.selector_rank)


def dense_mask_elements(cfg: DFlashFile, drafter: DrafterConfig) -> int:
    """Elements of the drafter's dense ``[rows, 1, A bs, L + A bs]`` attention mask per step
    (:func:`dflash.model.attention.sdpa_mask`) with ``attn_implementation = "sdpa"``, else 0."""
    return mask_elements(drafter.attn_implementation, cfg.data.packed_rows, cfg.train.num_anchors,
                         drafter.block_size, cfg.data.pack_length)


def mask_elements(attn_implementation: str, rows: int, anchors: int, block_size: int, pack_length: int) -> int:
    """:func:`dense_mask_elements` from the plain numbers (a finished run's ``config.toml`` and
    ``drafter_config.json``, as :mod:`dflash.plan` reads them): ``rows x A bs x (L + A bs)`` for
    "sdpa", 0 for flex attention's block mask."""
    if attn_implementation != "sdpa":
        return 0
    queries = anchors * block_size
    return rows * queries * (pack_length + queries)


def target_bytes(hf, layers_kept: int, tokens: int, *, fp8: bool) -> tuple[float, float]:
    """One target replica's estimated peak, bytes, as ``(weights, activations)``: the embedding and
    ``layers_kept`` decoder layers (bf16, or 1 byte a weight in FP8 layers), and the forward's
    activations for ``tokens`` batch tokens.

    Args:
        hf: the target's transformers config (Qwen3 or Llama family).
        layers_kept: decoder layers run (the last captured layer's index + 1).
        tokens: tokens per batch (``data.tokens_per_batch``).
        fp8: ``[target].quantization = "fp8"``.
    """
    h, inter = hf.hidden_size, hf.intermediate_size
    hd = getattr(hf, "head_dim", None) or h // hf.num_attention_heads
    attn = h * hd * (hf.num_attention_heads + 2 * hf.num_key_value_heads) + hf.num_attention_heads * hd * h
    weights = 2 * hf.vocab_size * h + (1 if fp8 else 2) * layers_kept * (attn + 3 * h * inter)
    return weights, TARGET_ACT_BYTES * h * tokens


def estimate(cfg: DFlashFile, drafter: DrafterConfig, hf, devices: dict[str, list[str]]) -> list[DeviceMemory]:
    """Each CUDA device's estimated peak for a resolved run.

    Args:
        cfg: the resolved graph file.
        drafter: the resolved drafter config.
        hf: the target's transformers config.
        devices: ``{"target": [...], "drafter": [...]}``: the device of every replica ("cuda" is
            read as "cuda:0"; other devices are left out).

    Returns:
        One :class:`DeviceMemory` per CUDA device, in the order they first appear.
    """
    tw, ta = target_bytes(hf, max(drafter.target_layer_ids) + 1, cfg.data.tokens_per_batch,
                          fp8=cfg.target.quantization == "fp8")
    slots = drafter_slots(cfg, drafter.block_size)
    df, da = drafter_bytes(drafter, slots, checkpointing=drafter.activation_checkpointing,
                           head_rows=head_rows(slots, lm_head_chunk=cfg.train.lm_head_chunk,
                                               sync_free_loss=cfg.train.sync_free_loss),
                           mask_elements=dense_mask_elements(cfg, drafter))
    out: dict[str, DeviceMemory] = {}
    for role, part in (("target", dict(target_weights=tw, target_act=ta)),
                       ("drafter", dict(drafter_fixed=df, drafter_act=da))):
        for dev in devices.get(role, []):
            if dev.startswith("cuda"):
                dev = dev if ":" in dev else "cuda:0"
                out[dev] = out.get(dev, DeviceMemory(device=dev)) + DeviceMemory(device=dev, **part)
    return list(out.values())


def levers(cfg: DFlashFile, drafter: DrafterConfig, m: DeviceMemory, card: float) -> list[str]:
    """What would bring ``m``'s estimate under ``card`` bytes, each setting changed alone, with the value."""
    out = []
    rest = m.total - m.drafter_act
    if m.drafter_act and not drafter.activation_checkpointing:
        # checkpointing shrinks the layers' share of each slot; the selector's and the mask's stay
        per_slot = _drafter_slot_bytes(drafter, False)
        ratio = _drafter_slot_bytes(drafter, True) / per_slot
        slot_part = per_slot * drafter_slots(cfg, drafter.block_size)  # one replica's, as the mask's
        mask = DENSE_MASK_BYTES * dense_mask_elements(cfg, drafter)
        ckpt = rest + m.drafter_act * (slot_part * ratio + mask) / (slot_part + mask)
        if ckpt <= card:
            out.append(f"set [drafter].activation_checkpointing = true (about {ckpt / GIB:.0f} GiB)")
    if m.drafter_act and rest < card:
        anchors = min(cfg.train.num_anchors - 1, int(cfg.train.num_anchors * (card - rest) / m.drafter_act))
        if anchors >= 1:
            out.append(f"lower train.num_anchors to {anchors:,} (now {cfg.train.num_anchors:,})")
    fixed = m.target_weights + m.drafter_fixed
    scaled = m.target_act + m.drafter_act
    rows = cfg.data.packed_rows
    if scaled and fixed < card:
        fit = min(rows - 1, int(rows * (card - fixed) / scaled))
        if fit >= 1:
            out.append(f"lower data.packed_rows to {fit} with data.tokens_per_batch = {fit * cfg.data.pack_length:,} "
                       f"(now {rows} and {cfg.data.tokens_per_batch:,})")
    if m.target_weights and m.drafter_fixed:
        out.append("place the target and the drafter on separate GPUs")
    return out


def _card_bytes(device: str) -> float:
    import torch

    return float(torch.cuda.get_device_properties(torch.device(device)).total_memory)


def check_memory(cfg: DFlashFile, drafter: DrafterConfig, hf, devices: dict[str, list[str]], *,
                 card_bytes: Callable[[str], float] | None = None) -> list[str]:
    """Stop a run whose estimated peak is clearly over a CUDA device's memory; warn near the edge.

    Skipped (no warnings) when ``run.memory_check`` is false, when the graph places nothing on a
    CUDA device, or when CUDA is not available here (the run's own device check says so).

    Args:
        cfg, drafter, hf, devices: as for :func:`estimate`.
        card_bytes: a device's total memory in bytes (default: CUDA's device properties).

    Returns:
        Warnings, one line per device whose estimate is above :data:`WARN_OVER` of its memory.

    Raises:
        ConfigError: a device's estimate is above :data:`REFUSE_OVER` times its memory; the line
            gives the estimate by stage and the settings that would fit.
    """
    if not cfg.run.memory_check:
        return []
    estimates = estimate(cfg, drafter, hf, devices)
    if not estimates:
        return []
    if card_bytes is None:
        import torch

        if not torch.cuda.is_available():
            return []
        card_bytes = _card_bytes
    warnings = []
    for m in estimates:
        try:
            card = card_bytes(m.device)
        except (RuntimeError, AssertionError, ValueError):  # no such device here: the device checks say so
            continue
        if m.total <= WARN_OVER * card:
            continue
        what = (f"{m.device} needs about {m.total / GIB:.1f} GiB ({_by_stage(m)}; an estimate, docs/gpus.md) of its "
                f"{card / GIB:.1f} GiB at data.max_length = {cfg.data.max_length:,}, data.tokens_per_batch = "
                f"{cfg.data.tokens_per_batch:,}, train.num_anchors = {cfg.train.num_anchors:,}")
        fixes = " or ".join(levers(cfg, drafter, m, card)) or "use a GPU with more memory"
        if m.total > REFUSE_OVER * card:
            raise ConfigError(f"the run will not fit: {what}. To fit: {fixes} "
                              "(run.memory_check = false starts it anyway)")
        warnings.append(f"the run may run out of GPU memory: {what}. If it does: {fixes}")
    return warnings


def estimate_line(estimates: list[DeviceMemory]) -> str:
    """The run's start-up line: each device's estimate by stage (empty when nothing is on CUDA)."""
    return "; ".join(f"{m.device} about {m.total / GIB:.1f} GiB ({_by_stage(m)})" for m in estimates)


def _by_stage(m: DeviceMemory) -> str:
    """"target 14.5, drafter 28.3", or the one stage's name when the device holds one."""
    stages = (("target", m.target_weights + m.target_act), ("drafter", m.drafter_fixed + m.drafter_act))
    on = [(name, b) for name, b in stages if b]
    return on[0][0] if len(on) == 1 else ", ".join(f"{name} {b / GIB:.1f}" for name, b in on)


def memory_fields(estimates: list[DeviceMemory]) -> dict[str, dict[str, float]]:
    """The end record's memory fields: ``estimated_gib`` and, where CUDA is here, ``peak_gib`` (the
    most this process allocated on each device, ``torch.cuda.max_memory_allocated``), GiB per device;
    ``{}`` when the graph places nothing on CUDA."""
    if not estimates:
        return {}
    out = {"estimated_gib": {m.device: round(m.total / GIB, 2) for m in estimates}}
    import torch

    if torch.cuda.is_available():
        try:
            out["peak_gib"] = {m.device: round(torch.cuda.max_memory_allocated(m.device) / GIB, 2) for m in estimates}
        except (RuntimeError, AssertionError, ValueError):  # a device this process never reached
            pass
    return out
