"""Export a trained drafter to the public DFlash Hugging Face layout, and read it back.

``python -m dflash.export CHECKPOINT -o DIR [--dtype bfloat16]`` writes

* ``config.json``: a Qwen3-style config as the public DFlash drafters ship it:
  ``architectures = ["DFlashDraftModel"]``, ``model_type = "qwen3"``, the drafter's dims
  (``num_hidden_layers`` = drafter layers), ``block_size``, ``num_target_layers``, and
  ``dflash_config = {"block_size", "mask_token_id", "target_layer_ids"}``. ``model_type`` names the
  drafter's own (Qwen3-style) layers whatever the target's family: a drafter for a Llama target is
  written the same way (z-lab's drafter for Llama-3.1-8B-Instruct loads into the same
  ``DFlashDraftModel`` class). The public layout has no field for the target's family; the target
  shows only through ``target_layer_ids``, ``num_target_layers``, ``mask_token_id`` and the shared
  ``hidden_size`` and ``vocab_size`` (tests/dflash/test_smollm2_target.py exports one for SmolLM2);
* ``model.safetensors``: the drafter weights under the public names (``fc.weight``,
  ``hidden_norm.weight``, ``layers.N.self_attn.q_proj.weight``, ...; no embedding / LM head).

A DFlash2 drafter (``[drafter].variant = "dflash2"``) is written as z-lab's DFlash2 checkpoints are:
``architectures = ["DFlash2DraftModel"]``, ``conv_kernel_size``, ``conv_group_size``,
``selector_top_k`` and ``selector_rank`` in ``dflash_config``, and the extra tensors under the
published names (``layers.N.{attention,mlp}_conv.base_kernel``, ``...kernel_projection.weight``,
``candidate_selector.hidden_projection.weight`` and the two codebooks *bare*,
``candidate_selector.predecessor_codebook`` / ``successor_codebook``, no ``.weight``: z-lab's
``DFlash2DraftModel.from_pretrained`` maps them onto its embeddings, its MLX loader reads only the
bare names). That class loads it with no missing or unexpected key (tested).

DSpark's confidence head (``[loss].confidence = "head"``: ``confidence_head.proj.{weight,bias}``,
:mod:`dflash.model.confidence_head`) is not exported: neither z-lab's classes nor serving engines
have such a module, so its keys would be unexpected there; it stays in the training checkpoint
(:func:`exported_weights`). The export of a drafter with a head equals that of one without it.

* ``modeling_dflash.py``: this project's transformers model of the drafter (a copy of
  :mod:`dflash.model.modeling_dflash`; torch and transformers only), named by ``auto_map``, so
  ``AutoModel.from_pretrained(DIR, trust_remote_code=True)`` loads it with no other package.
  Serving engines select the drafter by ``architectures`` and ignore it. Without
  ``trust_remote_code=True`` transformers ignores it too and silently builds a plain ``Qwen3Model``
  (not a drafter); the CLI says so when it finishes;
* ``README.md``: the model card (:func:`model_card`): what the drafter is, the target it was
  trained for and its measured tau, and code that loads and decodes with it as written, beside
  this project too (z-lab's package, also named ``dflash``, unpacked as ``zlab_dflash``).

``config.json`` also names the target (``dflash_target``: ``[target].path`` as recorded, its
``model_type``, ``architectures``, depth, width, vocabulary) and, when the run's ``metrics.jsonl``
holds a held-out evaluation of the exported step, its measured tau (``dflash_eval``: over which
prompts, how many tokens, which decoder); :func:`describe` (:mod:`~dflash.export.about`) reads
both from the checkpoint. The public loaders ignore these keys (the interop tests export with them).

The CLI refuses (one line, exit 2) an output directory that is a checkpoint (it holds
``meta.json`` or ``train_state.pt``) or the input itself, an empty ``-o ""``, an output path that is
a file, a non-empty output directory unless ``--force``, and an output it cannot create or write
(naming ``-o`` and the reason, not the temporary directory). It warns (a line on stderr; a
:class:`LastLayerWarning` from :func:`export_drafter`) when the drafter's ``target_layer_ids``
include the target's last layer: the public rule never takes it (``[1, L-3]``, see
:func:`dflash.model.target.default_layer_ids`) and the vLLM speculators converter rejects such a drafter
(size mismatch on ``fc.weight``). Written files get the usual ``0o666 & ~umask``
permissions (safetensors alone writes them ``0600``).

The export is written into a temporary sibling directory and renamed into place
(:func:`export_drafter`), so a Ctrl-C leaves ``-o`` as it was: one line on stderr says so, exit 130.
The rename also refuses (one line, exit 2) an ``-o`` that another writer filled while this export
ran, e.g. two exports to the same new directory: the first one's files are left as they are.
The room: :mod:`~dflash.export.layout` (file names and architectures, torch-free),
:mod:`~dflash.export.about`, :mod:`~dflash.export.write`, :mod:`~dflash.export.read`,
:mod:`~dflash.export.cli`. Every public
name is importable from here; they load on first use, so ``python -m dflash.export --help``
imports no torch. Imports: :mod:`dflash.model`, :mod:`dflash.checkpoint`, :mod:`dflash.eval`
(the checkpoint checks the evaluator shares) and csp.
"""

from dflash.export.layout import (
    ARCHITECTURES,
    CARD_FILE,
    EXPORT_FILES,
    MODELING_FILE,
    NO_REMOTE_CODE,
    NOT_EXPORTED,
    ExportedThenInterrupted,
    LastLayerWarning,
    OutputTaken,
)

__all__ = ["ARCHITECTURES", "CARD_FILE", "EXPORT_FILES", "MODELING_FILE", "NOT_EXPORTED",
           "NO_REMOTE_CODE", "ExportedThenInterrupted", "LastLayerWarning", "OutputTaken", "build_parser",
           "check_output", "describe", "export_drafter", "exported_config", "exported_weights", "hf_config_dict", "last_layer_problem",
           "load_exported", "main", "model_card"]

_HOME = {"export_drafter": "write", "exported_weights": "write", "hf_config_dict": "write",
         "last_layer_problem": "write", "model_card": "write", "load_exported": "read", "exported_config": "read",
         "build_parser": "cli", "check_output": "cli", "main": "cli", "describe": "about"}


def __getattr__(name: str):  # lazy: write and read import torch
    if name in _HOME:
        import importlib

        return getattr(importlib.import_module(f"dflash.export.{_HOME[name]}"), name)
    raise AttributeError(f"module 'dflash.export' has no attribute {name!r}")
