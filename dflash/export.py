"""Export a trained drafter to the public DFlash Hugging Face layout, and read it back.

``python -m dflash.export CHECKPOINT -o DIR [--dtype bfloat16]`` writes

* ``config.json``: a Qwen3-style config as the public DFlash drafters ship it:
  ``architectures = ["DFlashDraftModel"]``, ``model_type = "qwen3"``, the drafter's dims
  (``num_hidden_layers`` = drafter layers), ``block_size``, ``num_target_layers``, and
  ``dflash_config = {"block_size", "mask_token_id", "target_layer_ids"}``;
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
* ``README.md``: the model card (:func:`model_card`): what the drafter is and how to load it.

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
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

from csp.cli import make_parser


def build_parser():
    """The ``dflash.export`` parser (light: built before torch is imported, so ``--help`` answers at once)."""
    p = make_parser(
        "python -m dflash.export", "Export a trained drafter checkpoint to the public DFlash Hugging Face "
        "layout (config.json + model.safetensors + modeling_dflash.py + README.md).",
        details="The output loads where DFlash drafters are served (architectures = [\"DFlashDraftModel\"], "
                "the public\nparameter names; [\"DFlash2DraftModel\"] and z-lab's DFlash2 layout for a drafter.variant = \"dflash2\"\ndrafter) and back with dflash.export.load_exported. It also holds "
                "modeling_dflash.py, the\ntransformers model class (torch and transformers only): load it "
                "with\nAutoModel.from_pretrained(DIR, trust_remote_code=True); without trust_remote_code, "
                "transformers\nsilently builds a plain Qwen3Model instead, which is not a drafter. Files "
                "are written with\nthe usual permissions (0644 under umask 022).",
        exit_codes={0: "exported", 1: "an unexpected error (traceback)",
                    2: "bad input: no such checkpoint, a run directory instead of a checkpoint, the "
                       "output is a\n       checkpoint, the input itself, a file, or a non-empty directory "
                       "without --force;\n       an unhealthy checkpoint (healthy: false or NaN/Inf weights) "
                       "without --allow-unhealthy",
                    130: "interrupted (Ctrl-C): -o holds all of the export or none of it (the line on "
                         "stderr says which)"},
        examples=["python -m dflash.export runs/dflash-tiny/checkpoints/step_00000300 -o exports/dflash-tiny",
                  "python -m dflash.export CKPT -o OUT --dtype float32 --force"])
    p.add_argument("checkpoint", help="a dflash checkpoint directory, e.g. RUN_DIR/checkpoints/step_00000300")
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="output directory (created if missing)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the written weights")
    p.add_argument("--force", action="store_true", help="write into a non-empty output directory")
    p.add_argument("--allow-unhealthy", action="store_true",
                   help="export a checkpoint marked healthy: false or holding NaN/Inf weights (refused "
                        "otherwise, naming the nearest healthy one)")
    return p


if __name__ == "__main__":  # --help and usage errors answer before torch is imported (~2 s)
    _args = build_parser().parse_args()
    try:  # a Ctrl-C while torch imports (before main runs) is one line too, not a traceback
        import torch  # noqa: F401

        import dflash.checkpoint.model_files  # noqa: F401
    except KeyboardInterrupt:
        print(f"dflash.export: interrupted (Ctrl-C); nothing was written to {_args.out}", file=sys.stderr)
        raise SystemExit(130) from None

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from dflash.checkpoint.model_files import load_drafter  # noqa: E402
from dflash.eval.inputs import check_checkpoint  # noqa: E402
from dflash.model.drafter import DFlashDrafter, DrafterConfig  # noqa: E402

__all__ = ["CARD_FILE", "EXPORT_FILES", "MODELING_FILE", "NOT_EXPORTED", "NO_REMOTE_CODE",
           "ExportedThenInterrupted", "LastLayerWarning", "OutputTaken", "build_parser", "check_output",
           "export_drafter", "exported_weights", "hf_config_dict", "last_layer_problem", "load_exported", "main", "model_card"]

MODELING_FILE = "modeling_dflash.py"  # written next to config.json; auto_map points at it
CARD_FILE = "README.md"  # the model card: how to load it (trust_remote_code) and decode with it
EXPORT_FILES = ("model.safetensors", "config.json", MODELING_FILE, CARD_FILE)
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}  # by [drafter].variant
DFLASH2_CONFIG_KEYS = ("conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank")

NO_REMOTE_CODE = ("without trust_remote_code=True, AutoModel ignores modeling_dflash.py and silently "
                  "builds a plain Qwen3Model from config.json, which is not a drafter")
"""The one-line warning about forgetting ``trust_remote_code`` (printed by the CLI, in the card)."""


def model_card(cfg: DrafterConfig, dtype: torch.dtype) -> str:
    """The export's ``README.md``: what it is and the load-and-decode calls that work."""
    return f"""---
library_name: transformers
tags: [dflash, speculative-decoding, drafter]
---
# {"DFlash2" if cfg.variant == "dflash2" else "DFlash"} drafter

A DFlash block drafter ({cfg.num_layers} layers, hidden size {cfg.hidden_size}, block size {cfg.block_size},
mask token {cfg.mask_token_id}) conditioned on target layers {list(cfg.target_layer_ids)} of a
{cfg.num_target_layers}-layer target; weights in {str(dtype).removeprefix("torch.")}. It has no embedding
and no LM head: it uses the target's.

## Load it

```python
from transformers import AutoModel
drafter = AutoModel.from_pretrained(DIR, trust_remote_code=True)
```

**`trust_remote_code=True` is required**: {NO_REMOTE_CODE}.
`modeling_dflash.py` (torch and transformers only) is the model class.

## Decode with z-lab's loop

```python
from dflash.model import dflash_generate   # z-lab's dflash package
out = dflash_generate(drafter, target, input_ids, max_new_tokens=256, stop_token_ids=None)
```

Serving engines pick the drafter by `architectures = ["{ARCHITECTURES[cfg.variant]}"]` and read
`dflash_config` (`block_size`, `mask_token_id`, `target_layer_ids`).
"""


class LastLayerWarning(UserWarning):
    """The exported drafter is conditioned on the target's last layer (see the module doc)."""


def last_layer_problem(cfg: DrafterConfig) -> str | None:
    """Why ``cfg.target_layer_ids`` may not load where drafters are served, or None if fine.

    None also when the target depth is unknown (``num_target_layers`` unset).
    """
    L = cfg.num_target_layers
    if L is None or not cfg.target_layer_ids or max(cfg.target_layer_ids) < L - 1:
        return None
    return (f"target_layer_ids {list(cfg.target_layer_ids)} include the target's last layer "
            f"({L - 1} of a {L}-layer target); the public DFlash rule uses layers 1..{L - 3} and "
            "the vLLM speculators converter fails on this drafter (fc.weight size mismatch); "
            "retrain with target.layer_ids inside [1, L-3] for vLLM")


def hf_config_dict(cfg: DrafterConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The public-layout ``config.json`` content for a resolved drafter config.

    Raises:
        ValueError: ``mask_token_id`` is unset.
    """
    cfg.check_resolved()
    if cfg.mask_token_id is None:
        raise ValueError("drafter.mask_token_id is unset; the exported config must name it")
    sliding = "sliding_attention" in cfg.types
    arch = ARCHITECTURES[cfg.variant]
    dflash_config = {
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
    }
    if cfg.variant == "dflash2":
        dflash_config.update({k: getattr(cfg, k) for k in DFLASH2_CONFIG_KEYS})
    return {
        "architectures": [arch],
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "dflash_config": dflash_config,
        "num_target_layers": cfg.num_target_layers,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "layer_types": cfg.types,
        "use_sliding_window": sliding,
        "sliding_window": cfg.sliding_window if sliding else None,
        "max_window_layers": cfg.num_layers,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
        "auto_map": {"AutoModel": f"{MODELING_FILE.removesuffix('.py')}.{arch}"},
    }


NOT_EXPORTED = ("confidence_head.",)
"""State-dict key prefixes left out of the export: training-only modules the public loaders lack."""


def exported_weights(drafter: DFlashDrafter, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The drafter's state dict on the CPU in ``dtype``, less the :data:`NOT_EXPORTED` keys."""
    return {k: t.detach().to("cpu", dtype).contiguous() for k, t in drafter.state_dict().items()
            if not k.startswith(NOT_EXPORTED)}


def export_drafter(drafter: DFlashDrafter, out_dir: str | Path,
                   dtype: torch.dtype = torch.bfloat16, *, force: bool = True) -> Path:
    """Write ``config.json``, ``model.safetensors``, ``modeling_dflash.py`` and the model card
    ``README.md`` into ``out_dir`` (created if needed, with its parents).

    The files are written into a temporary sibling directory (``.NAME.tmp-*``), which is then
    renamed to ``out_dir`` when that is missing or empty, so an interrupted export leaves nothing
    there. The rename is the check: with ``force=False`` an ``out_dir`` that is non-empty by then
    (another export to the same directory finished first) is left as it is and
    :class:`OutputTaken` is raised. With ``force`` (the default; ``--force``) the files are moved
    into a non-empty ``out_dir`` one by one, each atomically (a Ctrl-C is held until all are in
    place; only a hard kill in that instant can leave a mix of old and new files). The temporary
    directory is always removed.

    Raises:
        OutputTaken: ``force`` is False and ``out_dir`` was not missing or empty at the final move.
        ExportedThenInterrupted: a Ctrl-C came while the files were moved; the export is complete.

    Warns :class:`LastLayerWarning` (and still exports) when :func:`last_layer_problem` finds one.
    """
    problem = last_layer_problem(drafter.cfg)
    if problem is not None:
        warnings.warn(problem, LastLayerWarning, stacklevel=2)
    out = Path(out_dir)
    cfg = hf_config_dict(drafter.cfg, dtype)
    weights = exported_weights(drafter, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / MODELING_FILE).write_bytes((Path(__file__).parent / "model" / MODELING_FILE).read_bytes())
        (tmp / CARD_FILE).write_text(model_card(drafter.cfg, dtype))
        umask = os.umask(0)
        os.umask(umask)
        for name in EXPORT_FILES:
            os.chmod(tmp / name, 0o666 & ~umask)
        os.chmod(tmp, 0o777 & ~umask)
        with _ctrl_c_deferred():
            try:  # rename(2) onto a missing or empty directory: atomic; onto anything else it fails
                os.replace(tmp, out)
            except OSError as e:
                if e.errno not in _TAKEN or not out.exists():
                    raise
                if not force:  # filled since check_output (a concurrent export): leave it alone
                    raise OutputTaken(e.errno, f"{out} is not empty", str(out)) from None
                if not out.is_dir():
                    raise
                for name in EXPORT_FILES:  # --force into a non-empty directory: each file atomically
                    os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


_TAKEN = (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR)
"""What ``rename(2)`` of the temporary directory says when ``out_dir`` is a non-empty directory or a file."""


class OutputTaken(FileExistsError):
    """:func:`export_drafter` with ``force=False`` found ``out_dir`` non-empty (or a file) at the
    final rename; nothing of this export was moved there."""


class ExportedThenInterrupted(KeyboardInterrupt):
    """A Ctrl-C that arrived while :func:`export_drafter` moved the finished files into place;
    raised once they are all there, so the export is complete."""


@contextlib.contextmanager
def _ctrl_c_deferred():
    """Hold a Ctrl-C (SIGINT) until the block has run, then raise :class:`ExportedThenInterrupted`
    (in the main thread only, where Python handles signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if got:
        raise ExportedThenInterrupted


def check_output(checkpoint: str | Path, out_dir: str | Path, force: bool = False) -> None:
    """Refuse an export destination that would destroy or mix with other files.

    Raises:
        ValueError: ``out_dir`` is empty (``""``, not the current directory), the checkpoint itself, is a checkpoint (holds ``meta.json`` or
            ``train_state.pt``), is not a directory, or is a non-empty directory and ``force``
            is False. The message says what to change.
    """
    if str(out_dir) == "":
        raise ValueError("-o is an empty path; give an output directory, e.g. -o exports/NAME")
    out, src = Path(out_dir), Path(checkpoint)
    if out.exists() and src.exists() and out.resolve() == src.resolve():
        raise ValueError(f"-o {out_dir} is the checkpoint being exported; give a new directory")
    if out.exists() and not out.is_dir():
        raise ValueError(f"-o {out_dir} is a file, not a directory; give a directory path")
    if not out.is_dir():
        return
    from dflash.checkpoint import is_checkpoint_dir

    if is_checkpoint_dir(out):
        raise ValueError(f"-o {out_dir} is a training checkpoint; exporting there would overwrite "
                         "its weights; give a new directory")
    if any(out.iterdir()) and not force:
        raise ValueError(f"-o {out_dir} is not empty; give an empty or new directory, or --force "
                         f"to overwrite config.json, model.safetensors, {MODELING_FILE} and {CARD_FILE} there")


def load_exported(directory: str | Path, device: torch.device | str = "cpu",
                  dtype: torch.dtype | None = None) -> tuple[DFlashDrafter, DrafterConfig]:
    """Build a :class:`DFlashDrafter` from a public-layout directory (ours or a z-lab one; DFlash or
    DFlash2, whose codebooks may be stored bare or as ``.weight``).

    Raises:
        ValueError: ``architectures`` is neither ``["DFlashDraftModel"]`` nor ``["DFlash2DraftModel"]``.
        RuntimeError: the weights do not match the config.
    """
    d = Path(directory)
    raw = json.loads((d / "config.json").read_text())
    variants = {v: k for k, v in ARCHITECTURES.items()}
    arch = raw.get("architectures")
    if not (isinstance(arch, list) and len(arch) == 1 and arch[0] in variants):
        raise ValueError(f"{d}/config.json: architectures {arch} is not one of "
                         f"{[[a] for a in variants]}")
    variant = variants[arch[0]]
    dfc = raw.get("dflash_config", {})
    extra = {}
    for k in DFLASH2_CONFIG_KEYS if variant == "dflash2" else ():
        if dfc.get(k, raw.get(k)) is None:
            raise ValueError(f"{d}/config.json: a DFlash2DraftModel config needs dflash_config.{k}")
        extra[k] = int(dfc.get(k, raw.get(k)))
    rope = raw.get("rope_parameters") or {}
    n = raw["num_hidden_layers"]
    types = raw.get("layer_types") or ["full_attention"] * n
    cfg = DrafterConfig(
        num_layers=n,
        block_size=dfc.get("block_size", raw.get("block_size", 16)),
        mask_token_id=dfc.get("mask_token_id"),
        layer_types=types,
        sliding_window=raw.get("sliding_window") if "sliding_attention" in types else None,
        hidden_size=raw["hidden_size"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        intermediate_size=raw["intermediate_size"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0))),
        max_position_embeddings=raw.get("max_position_embeddings"),
        vocab_size=raw.get("vocab_size"),
        target_layer_ids=list(dfc["target_layer_ids"]),
        num_target_layers=raw.get("num_target_layers"),
        variant=variant,
        **extra,
    )
    drafter = DFlashDrafter(cfg)
    weights = {_BARE.get(k, k): t for k, t in load_file(str(d / "model.safetensors")).items()}
    drafter.load_state_dict(weights, strict=True)
    drafter.to(device=device, dtype=dtype or torch.float32)
    return drafter.eval(), cfg


# z-lab's save_pretrained writes the codebooks with ".weight" (its nn.Embedding names); ours are bare
_BARE = {f"candidate_selector.{n}_codebook.weight": f"candidate_selector.{n}_codebook"
         for n in ("predecessor", "successor")}


def _interrupted(out: str, complete: bool) -> str:
    """The one line printed on Ctrl-C (exit 130)."""
    if complete:
        return f"dflash.export: interrupted (Ctrl-C) after the export was written: {out} is complete"
    return f"dflash.export: interrupted (Ctrl-C); nothing was written to {out}"


def main(argv: list[str] | None = None) -> int:
    """The CLI (see ``--help``); returns the exit code: 0, 2 on bad input (one line on stderr),
    130 on Ctrl-C (one line saying whether ``-o`` holds the export; it never holds part of one)."""
    args = build_parser().parse_args(argv)
    written: list[Path] = []
    try:
        return 0 if _export(args, written) else 2
    except KeyboardInterrupt as e:
        print(_interrupted(args.out, bool(written) or isinstance(e, ExportedThenInterrupted)),
              file=sys.stderr)
        return 130


def _export(args, written: list[Path]) -> bool:
    """Check, load and export (appending the output directory to ``written`` once it is complete,
    then printing what was written); False after a bad-input line."""
    try:
        check_checkpoint(args.checkpoint, args.allow_unhealthy)  # a run directory, an unhealthy one
        check_output(args.checkpoint, args.out, args.force)
        drafter, _, _ = load_drafter(args.checkpoint)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", LastLayerWarning)
            try:
                out = export_drafter(drafter, args.out, getattr(torch, args.dtype), force=args.force)
            except OutputTaken as e:  # another export (or anything) filled -o after check_output
                raise ValueError(f"-o {args.out} was filled by another writer while this export ran "
                                 "(a second dflash.export to the same -o?) and is left as it is; give "
                                 "a new directory, or --force to overwrite it") from e
            except OSError as e:  # not the internal .NAME.tmp-* path: the -o the user gave, and why
                raise ValueError(f"-o {args.out}: cannot create or write the export there "
                                 f"({e.strerror or e}); give a directory you can write to") from e
            written.append(out)
        for w in caught:
            if issubclass(w.category, LastLayerWarning):
                print(f"dflash.export: warning: {w.message}", file=sys.stderr)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    except (FileNotFoundError, ValueError) as e:
        print(f"dflash.export: {e}", file=sys.stderr)
        return False
    n = sum(t.numel() for k, t in drafter.state_dict().items() if not k.startswith(NOT_EXPORTED))
    print(f"wrote {out}/config.json, model.safetensors ({n / 1e6:.1f}M parameters, {args.dtype}), "
          f"{MODELING_FILE} (the transformers model class) and {CARD_FILE}")
    print(f"load it with AutoModel.from_pretrained({str(out)!r}, trust_remote_code=True); {NO_REMOTE_CODE}")
    return True


if __name__ == "__main__":
    sys.exit(main())
