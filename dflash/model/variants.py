"""The drafter variants: one declaration each, which the rest of the project reads instead of
comparing variant names.

A variant is the DFlash backbone (:mod:`dflash.model.drafter`) plus what its own module adds. Its
:class:`Variant` entry says, as data:

* ``name``: its ``[drafter].variant`` value; ``title`` and ``about``: how docs and the model card
  name it, and where it comes from;
* ``drafter_fields`` / ``loss_fields``: the ``[drafter]`` and ``[loss]`` keys only it reads. The
  config hash leaves a variant's keys out of every variant declared before it (a DFlash run hashes
  as it did before DFlash2's keys existed), so the order of :data:`VARIANTS` is the order in which
  variants were added, and a new one goes last;
* ``module``: the module in this room that builds what it adds to the backbone (``None``: nothing).
  That module defines ``decoder_layer_parts(cfg) -> dict[str, nn.Module]`` (set on every decoder
  layer) and ``drafter_parts(cfg) -> dict[str, nn.Module]`` (set on the drafter; the part named
  ``output_block``, when given, maps the post-norm hidden states before every reader of them).
  Each part has ``reset_parameters(generator)``;
* ``drafts_with``: how its blocks are drafted and what the objective adds for it: ``"top1"`` (the
  backbone's argmax per slot; no term beyond the backbone's loss), ``"selector"`` (DFlash2's
  candidate walk, :mod:`dflash.eval.selector`, :mod:`dflash.train.selector_loss`) or
  ``"refiner"`` (XPress's Jacobi passes, :mod:`dflash.eval.xpress`, :mod:`dflash.train.xpress_loss`).
  The decode (:func:`dflash.eval.measure.proposer_factory`) and the objective
  (:func:`dflash.train.objective.compute_loss`) dispatch on it;
* ``fused_head`` / ``masked_loss``: whether it trains under ``train.lm_head = "liger"`` (the fused
  hard-label loss gives no top-K and no refined logits) and under ``train.sync_free_loss = false``;
* the export: ``architecture`` (``config.json``'s ``architectures``), ``export_keys`` (the
  ``dflash_config`` keys and the ``[drafter]`` fields they hold; ``export_keys_required``: a
  loader refuses a config without them), ``remote_code`` (a model file of this room written
  beside ``modeling_dflash.py`` and named by ``auto_map``, for a class the public loaders lack),
  ``card_note`` (a section of the model card).

Torch-free: the graph file's checks and ``--help`` read it before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["VARIANTS", "VARIANT_NAMES", "Variant", "by_architecture", "variant_of"]

DraftsWith = Literal["top1", "selector", "refiner"]


@dataclass(frozen=True)
class Variant:
    """One drafter variant (the module docstring says what each field is for)."""

    name: str
    title: str
    about: str
    architecture: str
    drafts_with: DraftsWith = "top1"
    drafter_fields: tuple[str, ...] = ()
    loss_fields: tuple[str, ...] = ()
    module: str | None = None
    fused_head: bool = False
    masked_loss: bool = True
    export_keys: tuple[tuple[str, str], ...] = ()
    export_keys_required: bool = False
    remote_code: str | None = None
    card_note: str = ""

    def reads(self, field: str) -> bool:
        """Whether ``field`` (a ``[drafter]`` or ``[loss]`` key) is one this variant owns."""
        return field in self.drafter_fields or field in self.loss_fields


_XPRESS_NOTE = """
## XPress

`refiner_head.*` is XPress's causal refiner (rank `dflash_config.xpress_rank`); its drafts are the
last of up to `num_jacobi_passes` parallel Jacobi passes. z-lab's `dflash_generate` knows no refiner
and drafts with the backbone alone; `drafter.spec_generate(target, input_ids, max_new_tokens=256,
stop_token_ids=None)` decodes with the passes. vLLM speculators 0.9 loads these tensors as they are
into its `XPressDraftModel` (the project's `docs/interop.md` gives the lines).
"""

_RESBLOCK_NOTE = """
## ResBlock

`output_block.linear` is a Medusa-style residual block, `h + SiLU(linear(h))`, applied to the
drafter's post-norm hidden states before the target's LM head; `modeling_resblock.py` (beside
`modeling_dflash.py`) defines the class. z-lab's `dflash_generate` and `drafter.spec_generate` decode
with it through `AutoModel`; vLLM speculators and SpecForge have no such class.
"""

VARIANTS: tuple[Variant, ...] = (
    Variant(
        name="dflash", title="DFlash", architecture="DFlashDraftModel", fused_head=True,
        about="the DFlash drafter (z-lab, \"DFlash: Block Diffusion for Flash Speculative Decoding\")",
    ),
    Variant(
        name="dflash2", title="DFlash2", architecture="DFlash2DraftModel", drafts_with="selector",
        about="z-lab's DFlash2: a grouped dynamic causal convolution around every sublayer and a candidate "
              "selector that re-ranks each slot's top-K (dflash.model.dflash2)",
        drafter_fields=("conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank"),
        loss_fields=("selector_weight",),
        module="dflash.model.dflash2",
        export_keys=(("conv_kernel_size", "conv_kernel_size"), ("conv_group_size", "conv_group_size"),
                     ("selector_top_k", "selector_top_k"), ("selector_rank", "selector_rank")),
        export_keys_required=True,
    ),
    Variant(
        name="xpress", title="XPress", architecture="XPressDraftModel", drafts_with="refiner",
        about="XPress (vLLM speculators 0.9): the DFlash backbone and a causal low-rank refiner head "
              "resolved by parallel Jacobi passes (dflash.model.xpress)",
        drafter_fields=("xpress_rank", "xpress_mlp_ratio", "jacobi_passes"),
        loss_fields=("xpress_base_weight", "xpress_consistency_weight", "xpress_consistency_passes"),
        module="dflash.model.xpress", masked_loss=False,
        # speculators' XPressSpeculatorConfig names; left out, a loader takes speculators' defaults (ours)
        export_keys=(("xpress_rank", "xpress_rank"), ("xpress_mlp_ratio", "xpress_mlp_ratio"),
                     ("num_jacobi_passes", "jacobi_passes")),
        card_note=_XPRESS_NOTE,
    ),
    Variant(
        name="resblock", title="DFlash+ResBlock", architecture="DFlashResBlockDraftModel", fused_head=True,
        about="the DFlash backbone with a Medusa-style residual SiLU block before the shared LM head "
              "(Cai et al. 2024, Medusa; dflash.model.resblock)",
        module="dflash.model.resblock", remote_code="modeling_resblock.py", card_note=_RESBLOCK_NOTE,
    ),
)
"""Every variant, in the order they were added (the config hash depends on the order)."""

VARIANT_NAMES: tuple[str, ...] = tuple(v.name for v in VARIANTS)
_BY_NAME = {v.name: v for v in VARIANTS}
_BY_ARCHITECTURE = {v.architecture: v for v in VARIANTS}


def variant_of(name: str) -> Variant:
    """The declaration of ``[drafter].variant = name``.

    Raises:
        ValueError: no variant has that name (the message lists them).
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"drafter.variant = {name!r} is not a variant; use one of {list(VARIANT_NAMES)}") from None


def by_architecture(architecture: str) -> Variant | None:
    """The variant an export's ``architectures = [architecture]`` names, or None."""
    return _BY_ARCHITECTURE.get(architecture)
