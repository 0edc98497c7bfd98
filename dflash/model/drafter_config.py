"""The graph file's ``[drafter]`` table: the drafter's shape, variant and switches, and how its
dimensions are resolved against the target (hidden size, heads, vocabulary, RoPE, the captured
target layers).

:class:`DrafterConfig` is what a checkpoint's and an export's ``config.json`` are made from
(:mod:`dflash.checkpoint.model_files`); the module it configures is
:class:`dflash.model.drafter.DFlashDrafter`. :func:`check_drafter_devices` is the one check of the
table against where the graph runs the drafter.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from dflash.model.target_config import TargetConfig
from dflash.model.variants import VARIANT_NAMES, variant_of
from dflash.tables import NonNegInt, PositiveInt, Table, added_later

__all__ = ["DrafterConfig", "LayerType", "VariantName", "check_drafter_devices", "resolve_drafter_config",
           "rope_theta_of"]

LayerType = Literal["full_attention", "sliding_attention"]
VariantName = Literal[VARIANT_NAMES]  # type: ignore[valid-type]  # the registry's names (dflash.model.variants)


class DrafterConfig(Table):
    """The graph file's ``[drafter]`` table; dims left None are filled by :meth:`resolve`.

    Attributes:
        num_layers: drafter decoder layers (also the default number of captured target layers).
        block_size: tokens per block, anchor included (``bs``; bs-1 predictions per block).
        mask_token_id: id of the mask token fed at block slots 1..bs-1 (None = from tokenizer).
        layer_types: per layer "full_attention" | "sliding_attention" (None = all full).
        sliding_window: window in tokens for sliding layers (required if any layer slides).
        attn_implementation: "sdpa" (bool mask) | "flex_attention" (BlockMask; compiled on CUDA).
        hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
            rms_norm_eps, rope_theta, max_position_embeddings, vocab_size: the drafter's
            dimensions, copied from the target config by :meth:`resolve` when left out
            (``hidden_size`` and ``vocab_size`` must equal the target's: the embedding and LM
            head are shared).
        target_layer_ids: captured target layers (set by :meth:`resolve`).
        num_target_layers: depth of the target (recorded for export).
        kernels: "torch" (the ops below) | "liger": Liger-Kernel's fused RMSNorm and SwiGLU
            (Triton, CUDA only; :mod:`dflash.model.drafter_kernels`). Same parameters and
            state-dict keys; equal loss and gradients to bf16 rounding (tested on the GPU).
        compile: ``torch.compile`` each decoder layer in place (same state-dict keys).
        activation_checkpointing: keep only each decoder layer's input during the forward and
            recompute the layer in the backward (``torch.utils.checkpoint``, non-reentrant): the
            layers' activations, which grow with the sequence length times the anchors, are then
            held one layer at a time, at the cost of a second forward of the layers. The same loss
            and gradients (tested). For long sequences; training only (decoding never stores them).
        precision: the training matmuls of the drafter's backbone Linears (``fc`` and every
            attention and MLP projection): "bf16" (under autocast on CUDA, fp32 on a CPU) |
            "fp8": torchao's float8 training (``Float8Linear``, dynamic scaling;
            :mod:`dflash.model.drafter_fp8`). The weights, AdamW's state and the loss stay as with
            "bf16" (fp32 master weights, same state-dict keys), so a checkpoint trained either way
            resumes, evaluates and exports either way. Needs CUDA compute capability >= 8.9 and
            torchao. Decoding (eval, the in-training evaluator) always runs bf16.
        fp8_recipe: torchao's float8 training recipe when ``precision = "fp8"``: "tensorwise" (one
            scale per tensor, cuBLAS) | "rowwise" (per-row scales, power-of-two rounded) |
            "rowwise_with_gw_hp" (rowwise, the weight gradient kept in bf16).
        variant: a name declared in :data:`dflash.model.variants.VARIANTS`: "dflash" (the DFlash
            drafter) | "dflash2" (z-lab's DFlash2: adds a grouped dynamic causal convolution
            around every sublayer and a candidate selector, :mod:`dflash.model.dflash2`) | "xpress"
            (XPress: the DFlash backbone and a causal low-rank refiner head resolved by parallel
            Jacobi passes, :mod:`dflash.model.xpress`) | "resblock" (the DFlash backbone and a
            Medusa-style residual block before the LM head, :mod:`dflash.model.resblock`). Each variant's entry names the fields
            only it reads: the next four are DFlash2's, the three after them XPress's; their
            defaults are the published checkpoints' values.
        conv_kernel_size: convolution taps (in block tokens, the current one included).
        conv_group_size: channels sharing one dynamic tap (``hidden_size`` must be a multiple).
        selector_top_k: candidates per block position the selector re-ranks.
        selector_rank: rank of the selector's predecessor/successor codebooks.
        xpress_rank: the XPress refiner's rank ``r``.
        xpress_mlp_ratio: the refiner MLP's width over ``r``.
        jacobi_passes: Jacobi passes an XPress drafter decodes with (0: the backbone's argmax;
            ``>= block_size - 1``: exactly the serial left-to-right walk).
        confidence_head: add DSpark's confidence head (:mod:`dflash.model.confidence_head`),
            trained by ``[loss].confidence = "head"``. The run sets it from that key; setting it
            here by hand without it is a config error. Checkpointed, not exported.
    """

    num_layers: int = 5
    block_size: int = 16
    mask_token_id: int | None = None
    layer_types: list[LayerType] | None = None
    sliding_window: int | None = None
    attn_implementation: Literal["sdpa", "flex_attention"] = "sdpa"
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    rms_norm_eps: float | None = None
    rope_theta: float | None = None
    max_position_embeddings: int | None = None
    vocab_size: int | None = None
    target_layer_ids: list[int] | None = None
    num_target_layers: int | None = None
    kernels: Annotated[Literal["torch", "liger"], added_later("torch")] = "torch"
    compile: Annotated[bool, added_later(False)] = False
    activation_checkpointing: Annotated[bool, added_later(False)] = False
    precision: Annotated[Literal["bf16", "fp8"], added_later("bf16")] = "bf16"
    fp8_recipe: Annotated[Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"], added_later("tensorwise")] = "tensorwise"
    variant: Annotated[VariantName, added_later("dflash")] = "dflash"
    conv_kernel_size: Annotated[PositiveInt, added_later(2, hashed=False)] = 2
    conv_group_size: Annotated[PositiveInt, added_later(16, hashed=False)] = 16
    selector_top_k: Annotated[PositiveInt, added_later(16, hashed=False)] = 16
    selector_rank: Annotated[PositiveInt, added_later(256, hashed=False)] = 256
    xpress_rank: Annotated[PositiveInt, added_later(256, hashed=False)] = 256
    xpress_mlp_ratio: Annotated[PositiveInt, added_later(2, hashed=False)] = 2
    jacobi_passes: Annotated[NonNegInt, added_later(6, hashed=False)] = 6
    confidence_head: Annotated[bool, added_later(False)] = False

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"drafter.num_layers must be >= 1, got {self.num_layers}")
        if self.block_size < 2:
            raise ValueError(f"drafter.block_size must be >= 2, got {self.block_size}")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"drafter.layer_types has {len(self.layer_types)} entries; "
                             f"num_layers is {self.num_layers}")
        if "sliding_attention" in self.types:
            if self.sliding_window is None or self.sliding_window < self.block_size:
                raise ValueError("drafter.sliding_window must be set and >= block_size when a "
                                 "layer is 'sliding_attention'")
        # a variant's own fields are checked where that variant reads them
        if variant_of(self.variant).reads("conv_kernel_size") and self.conv_kernel_size > self.block_size:
            raise ValueError(f"drafter.conv_kernel_size = {self.conv_kernel_size} is longer than a block "
                             f"(block_size = {self.block_size}): the convolution restarts at every block, so "
                             "taps past its start only see zeros; use at most block_size (published: 2)")

    @property
    def types(self) -> list[str]:
        return list(self.layer_types) if self.layer_types else ["full_attention"] * self.num_layers

    def resolve(self, target_hf_config, layer_ids: list[int]) -> "DrafterConfig":
        """A copy with every None dim taken from the target config and ``target_layer_ids`` set.

        Raises:
            ValueError: ``hidden_size`` or ``vocab_size`` differs from the target's (the embedding
                and LM head are shared); ``mask_token_id`` is outside the target's vocabulary;
                ``target_layer_ids`` or ``num_target_layers`` is set and disagrees with the
                target (they are derived: ``[target].layer_ids`` chooses the layers).
        """
        hf = target_hf_config
        H, V, L = hf.hidden_size, hf.vocab_size, hf.num_hidden_layers
        if self.hidden_size is not None and self.hidden_size != H:
            raise ValueError(f"drafter.hidden_size = {self.hidden_size} must equal the target's "
                             f"hidden size {H} (the embedding and LM head are shared)")
        if self.vocab_size is not None and self.vocab_size != V:
            raise ValueError(f"drafter.vocab_size = {self.vocab_size} must equal the target's "
                             f"vocabulary size {V} (the embedding and LM head are shared); leave it unset")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < V:
            raise ValueError(f"drafter.mask_token_id = {self.mask_token_id} is outside the target's "
                             f"vocabulary (0..{V - 1}); set it to an unused token id of the tokenizer")
        if self.target_layer_ids is not None and list(self.target_layer_ids) != list(layer_ids):
            raise ValueError(f"drafter.target_layer_ids = {list(self.target_layer_ids)} is derived, not "
                             f"read (the layers chosen here are {list(layer_ids)}): set target.layer_ids = "
                             f"{list(self.target_layer_ids)} instead and leave drafter.target_layer_ids unset")
        if self.num_target_layers is not None and self.num_target_layers != L:
            raise ValueError(f"drafter.num_target_layers = {self.num_target_layers} is derived from the "
                             f"target, which has {L} layers; leave it unset")
        heads = self.num_attention_heads or hf.num_attention_heads
        fill = {
            "hidden_size": H,
            "num_attention_heads": heads,
            "num_key_value_heads": self.num_key_value_heads or getattr(hf, "num_key_value_heads", heads),
            "head_dim": self.head_dim or getattr(hf, "head_dim", None) or H // heads,
            "intermediate_size": self.intermediate_size or hf.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps or getattr(hf, "rms_norm_eps", 1e-6),
            "rope_theta": self.rope_theta or rope_theta_of(hf),
            "max_position_embeddings": self.max_position_embeddings or hf.max_position_embeddings,
            "vocab_size": self.vocab_size or hf.vocab_size,
            "target_layer_ids": list(layer_ids),
            "num_target_layers": hf.num_hidden_layers,
        }
        return msgspec.structs.replace(self, **fill)

    def check_resolved(self) -> None:
        """Raise ValueError naming the first dim still None (call :meth:`resolve` first)."""
        for f in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "rms_norm_eps", "rope_theta", "target_layer_ids"):
            if getattr(self, f) is None:
                raise ValueError(f"drafter.{f} is unset; call DrafterConfig.resolve(target config)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("drafter.num_attention_heads must be a multiple of num_key_value_heads")
        if variant_of(self.variant).reads("conv_group_size") and self.hidden_size % self.conv_group_size:
            raise ValueError(f"drafter.conv_group_size = {self.conv_group_size} does not divide the "
                             f"hidden size {self.hidden_size} (the target's); use a divisor of it "
                             "(published: 16)")
        if (variant_of(self.variant).reads("selector_top_k") and self.vocab_size is not None
                and self.selector_top_k > self.vocab_size):
            raise ValueError(f"drafter.selector_top_k = {self.selector_top_k} exceeds the vocabulary "
                             f"({self.vocab_size} tokens); published: 16")


def resolve_drafter_config(cfg: DrafterConfig, target_cfg: TargetConfig) -> DrafterConfig:
    """:meth:`DrafterConfig.resolve` against the target described by ``target_cfg``
    (a :class:`dflash.model.target.TargetConfig`), without building the target."""
    from dflash.model.target import build_hf_config, resolve_layer_ids

    hf = build_hf_config(target_cfg)
    return cfg.resolve(hf, resolve_layer_ids(target_cfg, hf, cfg.num_layers))


def rope_theta_of(hf_config) -> float:
    """RoPE base of a transformers config (``rope_parameters`` in 5.x, ``rope_theta`` before).

    Raises:
        ValueError: a scaled RoPE (yarn, llama3, ...): the drafter implements the default only.
    """
    params = getattr(hf_config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"target rope_type {kind!r} is not supported by the drafter (default only)")
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10_000.0)))


def check_drafter_devices(cfg: DrafterConfig, devices: list[str]) -> None:
    """The drafter's kernels against the installed packages and where the graph runs the drafter.

    Args:
        devices: the device of every drafter replica ("cpu" where the graph gives none).

    Raises:
        ConfigError: ``drafter.attn_implementation = "flex_attention"`` on a CPU drafter
            (FlexAttention has no CPU backward), ``drafter.kernels = "liger"`` without liger-kernel,
            or ``drafter.precision = "fp8"`` without torchao or off a GPU with float8 tensor cores
            (:func:`dflash.model.drafter_fp8.check_fp8`).
    """
    import importlib.util

    from dflash.errors import ConfigError

    if cfg.precision == "fp8":
        from dflash.model.drafter_fp8 import check_fp8

        for device in devices:
            check_fp8(device)

    if cfg.kernels == "liger" and importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("drafter.kernels = \"liger\" needs the liger-kernel package (pip install liger-kernel); "
                          "set drafter.kernels = \"torch\"")
    if cfg.attn_implementation != "flex_attention":
        return
    cpu = [d for d in devices if not d.startswith("cuda")]
    if cpu:
        raise ConfigError(
            f"drafter.attn_implementation = \"flex_attention\" needs a CUDA drafter, but process "
            f"'drafter' runs on {cpu[0]} (PyTorch's FlexAttention has no backward on CPU); set "
            "drafter.attn_implementation = \"sdpa\" or put the drafter on a cuda:N device")
