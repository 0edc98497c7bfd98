"""The public DFlash export layout (file names, architectures, what it leaves out) and the
warning and errors an export raises.

Torch-free, so ``python -m dflash.export --help`` and the output checks answer before torch loads;
:mod:`dflash.export.write` writes this layout and :mod:`dflash.export.read` reads it back.
What a variant adds to the layout (its architecture, its ``dflash_config`` keys, a model file of
its own) is declared in its :mod:`dflash.model.variants` entry.
"""

from dflash.model.variants import VARIANTS

__all__ = ["ARCHITECTURES", "CARD_FILE", "EXPORT_FILES", "MODELING_FILE", "NOT_EXPORTED",
           "NO_REMOTE_CODE", "ExportedThenInterrupted", "LastLayerWarning", "OutputTaken"]

MODELING_FILE = "modeling_dflash.py"  # written next to config.json; auto_map points at it
CARD_FILE = "README.md"  # the model card: how to load it (trust_remote_code) and decode with it
EXPORT_FILES = ("model.safetensors", "config.json", MODELING_FILE, CARD_FILE)
ARCHITECTURES = {v.name: v.architecture for v in VARIANTS}
"""``config.json``'s ``architectures[0]`` by ``[drafter].variant``."""

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
