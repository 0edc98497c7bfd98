"""The public DFlash export layout (file names, architectures, what it leaves out) and the
warning and errors an export raises.

Torch-free, so ``python -m dflash.export --help`` and the output checks answer before torch loads;
:mod:`dflash.export.write` writes this layout and :mod:`dflash.export.read` reads it back.
"""

__all__ = ["ARCHITECTURES", "CARD_FILE", "DFLASH2_CONFIG_KEYS", "XPRESS_CONFIG_KEYS", "EXPORT_FILES", "MODELING_FILE", "NOT_EXPORTED",
           "NO_REMOTE_CODE", "ExportedThenInterrupted", "LastLayerWarning", "OutputTaken"]

MODELING_FILE = "modeling_dflash.py"  # written next to config.json; auto_map points at it
CARD_FILE = "README.md"  # the model card: how to load it (trust_remote_code) and decode with it
EXPORT_FILES = ("model.safetensors", "config.json", MODELING_FILE, CARD_FILE)
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel",  # by [drafter].variant
                 "xpress": "XPressDraftModel"}
DFLASH2_CONFIG_KEYS = ("conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank")
XPRESS_CONFIG_KEYS = {"xpress_rank": "xpress_rank", "xpress_mlp_ratio": "xpress_mlp_ratio",
                      "num_jacobi_passes": "jacobi_passes"}
"""``dflash_config`` key (speculators' ``XPressSpeculatorConfig`` field names) -> ``[drafter]`` key."""

NO_REMOTE_CODE = ("without trust_remote_code=True, AutoModel ignores modeling_dflash.py and silently "
                  "builds a plain Qwen3Model from config.json, which is not a drafter")
"""The one-line warning about forgetting ``trust_remote_code`` (printed by the CLI, in the card)."""


NOT_EXPORTED = ("confidence_head.",)
"""State-dict key prefixes left out of the export: training-only modules the public loaders lack."""


class LastLayerWarning(UserWarning):
    """The exported drafter is conditioned on the target's last layer (see the module doc)."""


class OutputTaken(FileExistsError):
    """:func:`export_drafter` with ``force=False`` found ``out_dir`` non-empty (or a file) at the
    final rename; nothing of this export was moved there."""


class ExportedThenInterrupted(KeyboardInterrupt):
    """A Ctrl-C that arrived while :func:`export_drafter` moved the finished files into place;
    raised once they are all there, so the export is complete."""
