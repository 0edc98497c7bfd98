"""The graph file's ``[train]`` table, and its checks against the loss, the drafter and the devices.

The trainer owns these settings (:mod:`dflash.train.step`, :mod:`dflash.train.optim`,
:mod:`dflash.train.state`), so their rules live here too: the table validates itself when the file
is decoded (``__post_init__``), :func:`check_train` checks it against the other tables once the run
is resolved, and :func:`lr_warnings` names a legal but unusable learning rate.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Annotated, Literal

from msgspec import Meta

from dflash.errors import ConfigError
from dflash.model.drafter_config import DrafterConfig
from dflash.model.variants import variant_of
from dflash.tables import NonNegFloat, NonNegInt, PositiveInt, Table, added_later
from dflash.train.loss import LossConfig

__all__ = ["TrainSection", "check_train", "lr_warnings"]

_FLOAT32_MAX = 3.4028234663852886e38


class TrainSection(Table):
    """``[train]``: optimizer, schedule, feature post-processing and non-finite handling."""

    num_anchors: PositiveInt = 256
    """Training blocks (anchors) sampled per packed row, the same for every batch (a sampling
    setting, not part of the drafter model: it was ``[drafter].num_anchors`` in older configs)."""
    lr: Annotated[float, Meta(gt=0.0)] = 6e-4
    """Peak learning rate (per step), reached after warmup_steps. Must be finite and small enough
    that AdamW's first step, lr / (1 - betas[0]), fits in float32; above 1 the run warns."""
    warmup_steps: NonNegInt = 20
    """Linear warmup length, in steps."""
    min_lr_ratio: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.1
    """Cosine decay floor, as a fraction of lr."""
    weight_decay: NonNegFloat = 0.0
    """AdamW's decoupled weight decay (per step, scaled by the learning rate)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's moment decays (beta1, beta2), each in [0, 1)."""
    optimizer: Annotated[Literal["adamw", "muon"], added_later("adamw")] = "adamw"
    """"adamw": AdamW for every parameter. "muon": ``torch.optim.Muon`` (Jordan et al. 2024, "Muon:
    An optimizer for hidden layers in neural networks": momentum orthogonalised by Newton-Schulz
    iterations) for the matrices of the drafter's Linear layers, with the update scaled to AdamW's
    RMS (``adjust_lr_fn = "match_rms_adamw"``, Liu et al. 2025, "Muon is Scalable for LLM Training"),
    so ``lr``, ``weight_decay`` and the schedule carry over unchanged; AdamW for the rest (norms,
    DFlash2's convolution taps and codebooks). The published Qwen3-8B DFlash2 drafter and
    speculators' trainer use Muon. :mod:`dflash.train.optim`."""
    muon_momentum: Annotated[float, Meta(ge=0.0, lt=1.0), added_later(0.95)] = 0.95
    """Muon's momentum (Nesterov), read when ``optimizer = "muon"``."""
    adamw_fused: Annotated[bool, added_later(False)] = False
    """AdamW's update as torch's fused kernel (``torch.optim.AdamW(fused=True)``, CUDA or CPU) instead
    of its ``foreach`` kernels: the same update to float rounding (tested), fewer kernels. In the
    compiled float8 drafter's profile the ``foreach`` update took 63 ms of 801 per three steps
    (benchmarks/results/LOG.md); the fused one is not measured yet."""
    compile_optimizer: Annotated[bool, added_later(False)] = False
    """With ``optimizer = "muon"``: Muon's step through ``torch.compile``, its learning rate held in
    a tensor that the schedule fills, so a new lr each step compiles nothing. Muon orthogonalises
    every matrix's update with Newton-Schulz iterations, one small matrix at a time: in the
    SmolLM2 drafter's profile on an H100 its step took 21% of the drafter step (48 ms of 221 per
    three steps, benchmarks/results/LOG.md); compiled, the same update to bf16 rounding: inductor
    keeps a fused chain's intermediates in float32 where eager rounds each bf16 op, so over five
    steps a weight's move differs from eager's by about 1% of its norm (1.5% of its largest
    element on an H100), tested at 3%; its speed not measured yet. The first step
    compiles (seconds to a minute). Ignored with ``optimizer = "adamw"`` (``adamw_fused`` is
    AdamW's kernel lever)."""
    grad_clip: NonNegFloat = 1.0
    """Global L2 gradient-norm clip; 0 disables clipping."""
    feature_noise: NonNegFloat = 0.0
    """Std of Gaussian noise added to the target features (relative to their RMS); 0 = off."""
    postprocess_side: Literal["target", "drafter"] = "drafter"
    """Where postprocess computes: on the features' source device before the move ("target") or on
    the drafter's device after it ("drafter"). Both give the same DrafterInput (tested)."""
    max_nonfinite_streak: PositiveInt = 8
    """Consecutive skipped (non-finite) steps after which the run stops."""
    check_channels: bool = False
    """Debug: check every tensor crossing a channel for non-finite values and name the first producer."""
    host_staging: bool = False
    """Move features target -> drafter through host memory instead of device to device."""
    sync_free_loss: bool = True
    """compute_loss in fixed shapes: every block slot goes through the LM head with weight 0 where
    it is not trained, and the counts stay tensors, so the loss never waits for the device (the
    step's one host read then carries them). False: the trained slots are picked by boolean masks
    (fewer LM-head rows, but each mask and count is a host sync). Same loss and gradients (tested)."""
    features_fp32: bool = False
    """Cast the target features to the drafter's fp32 master dtype before ``fc`` even under bf16
    autocast: a [B, T, k*H] fp32 copy (about 1.3 GB per 16K-token batch at the 8B shape) that
    autocast rounds straight back. False lets ``fc`` read them in bf16; bitwise equal (tested)."""
    lm_head_chunk: NonNegInt = 2048
    """With sync_free_loss: LM head and loss this many block slots at a time (dflash.train.chunked_head),
    so the [slots, vocab] logits never exist whole (about 2.3 GB fp32 per copy at the 8B shape with
    3,840 slots); 0 = all at once; ignored with sync_free_loss = false. Same loss, gradients to
    rounding (tested). On one H200 at the 8B shape, 2048 cut the drafter's peak memory from 83.3 to
    62.1 GiB and ran 2% faster (benchmarks/results/LOG.md, the performance switches), hence the default."""
    lm_head: Annotated[Literal["chunked", "liger"], added_later("chunked")] = "chunked"
    """With sync_free_loss: "chunked" (lm_head_chunk above) or "liger": Liger-Kernel's fused linear
    cross-entropy (dflash.train.liger_head; CUDA, hard-label CE only: loss.kl_weight, tv_weight and
    conf_weight must be 0).
    Same loss and gradients to bf16 rounding (a GPU test)."""

    compile_head: Annotated[bool, added_later(False)] = False
    """With the chunked head (``lm_head = "chunked"``, ``lm_head_chunk`` > 0): each chunk's
    cross-entropy and its gradient (``softmax - one-hot``, cast to the head's dtype) through
    ``torch.compile``, one fused pass over the ``[chunk, V]`` logits where eager torch makes four
    (log-softmax, exp, scatter, cast). In the SmolLM2 drafter's profile on an H100 those passes
    took about 20% of the step (benchmarks/results/LOG.md). Chunks whose loss has a KL, TV or
    "top1" confidence term run eagerly as before. The same values to float rounding (tested through
    dynamo on a CPU; a GPU test runs inductor), its speed not measured yet; the first step
    compiles (two shapes: the full chunk and the last one)."""
    init_from: Annotated[str | None, added_later(None)] = None
    """A warm start: the drafter starts from the weights of an existing drafter instead of its
    random init. A dflash checkpoint directory (``RUN/checkpoints/step_N``: ``drafter_config.json``
    and ``model.safetensors``) or a public-layout directory (``config.json`` naming a drafter's
    ``architectures`` and ``model.safetensors``: a ``python -m dflash.export`` output, a z-lab
    DFlash or DFlash2 drafter). A relative path is relative to the graph file's directory (given
    with ``--set``, to the current directory), like ``run.out_dir``. Its drafter must have the
    architecture of this run's resolved ``[drafter]`` (variant, block size, every tensor's shape;
    checked before any data work, one line naming what differs); every tensor is loaded, in fp32.
    Only the weights carry over: the optimizer and the learning-rate schedule start fresh (warmup
    included) and ``run.steps`` counts from 0. Ignored, with a log line, when the run resumes a
    checkpoint of its own (``run.resume``); on a fresh start it cannot be one of the run's own
    checkpoints (the start moves them to an archive). Unset: the seeded random init
    (:mod:`dflash.checkpoint.init_from`)."""

    def __post_init__(self) -> None:
        # AdamW's first step moves a weight by lr / (1 - beta1) (bias correction), computed in
        # float32: beyond float32's range the step overflows and the drafter crashes at step 1.
        beta1, beta2 = self.betas
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"train.betas = {list(self.betas)} must both be in [0, 1)")
        limit = _FLOAT32_MAX * (1.0 - beta1)
        if not math.isfinite(self.lr) or self.lr > limit:
            raise ValueError(f"train.lr = {self.lr:g} is not a usable learning rate: AdamW's first "
                             f"step lr / (1 - beta1) must fit in float32 (lr <= {limit:.3g}); "
                             "typical values are 1e-4 .. 1e-3")


def check_train(train: TrainSection, loss: LossConfig, drafter: DrafterConfig, drafter_devices: list[str]) -> None:
    """The fused LM head (``train.lm_head = "liger"``) and the masked loss against the loss, the
    drafter and its devices.

    Args:
        drafter_devices: the device of every drafter replica ("cpu" where the graph gives none).

    Raises:
        ConfigError: ``train.lm_head = "liger"`` with ``loss.kl_weight``, ``tv_weight`` or
            ``conf_weight`` > 0 (the fused loss is the hard-label CE only), with a variant whose
            entry says it needs more than that (``fused_head``: DFlash2's top-K candidates, XPress's
            refined logits), with ``train.sync_free_loss = false`` (it replaces the fixed-shape
            head), on a CPU drafter, or without liger_kernel installed; a variant that trains in
            fixed shapes only (``masked_loss``: XPress) with ``train.sync_free_loss = false``.
    """
    spec = variant_of(drafter.variant)
    if not spec.masked_loss and not train.sync_free_loss:
        raise ConfigError(f"drafter.variant = \"{spec.name}\" trains with the fixed-shape loss only: "
                          "set train.sync_free_loss = true")
    if train.lm_head != "liger":
        return
    soft = [k for k in ("kl_weight", "tv_weight", "conf_weight") if getattr(loss, k) > 0]
    if soft:
        raise ConfigError(f"train.lm_head = \"liger\" fuses the hard-label cross-entropy only, but "
                          f"loss.{soft[0]} = {getattr(loss, soft[0]):g}: set it to 0 or "
                          "train.lm_head = \"chunked\"")
    if not spec.fused_head:
        needs = _TRAINS_ON.get(spec.drafts_with, "what it trains on")
        raise ConfigError(f"train.lm_head = \"liger\" gives the hard-label loss only, not {spec.title}'s {needs}: "
                          f"set train.lm_head = \"chunked\" with drafter.variant = \"{spec.name}\"")
    if not train.sync_free_loss:
        raise ConfigError("train.lm_head = \"liger\" replaces the fixed-shape LM head: set "
                          "train.sync_free_loss = true or train.lm_head = \"chunked\"")
    cpu = [x for x in drafter_devices if not x.startswith("cuda")]
    if cpu:
        raise ConfigError(f"train.lm_head = \"liger\" runs Triton kernels on CUDA, but process "
                          f"'drafter' runs on {cpu[0]}: set train.lm_head = \"chunked\"")
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("train.lm_head = \"liger\" needs the liger-kernel package (pip install liger-kernel); "
                          "set train.lm_head = \"chunked\"")


_TRAINS_ON = {"selector": "top-K candidates (its selector's)", "refiner": "refined logits"}
"""What a variant's training reads beyond the hard-label loss, by its ``drafts_with``."""


def lr_warnings(train: TrainSection) -> list[str]:
    """A learning rate that decodes (finite, float32-safe) but no AdamW run survives."""
    if train.lr > 1.0:
        return [f"train.lr = {train.lr:g} is above 1, far beyond a usable AdamW learning rate (6e-4 is "
                "typical); expect the weights to blow up and steps to be skipped"]
    return []
