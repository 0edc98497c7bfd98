"""``python -m dflash.export CHECKPOINT -o DIR``: check the input and the output, load, export.

Light at import (no torch): the parser and the output checks answer at once; the checkpoint, the
model and the writer are imported when an export runs.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from csp.cli import make_parser
from dflash.export.layout import (
    CARD_FILE,
    MODELING_FILE,
    NO_REMOTE_CODE,
    NOT_EXPORTED,
    ExportedThenInterrupted,
    LastLayerWarning,
    OutputTaken,
)

__all__ = ["build_parser", "check_output", "main"]


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
    import torch

    from dflash.checkpoint.model_files import load_drafter
    from dflash.eval.inputs import check_checkpoint
    from dflash.export.about import describe
    from dflash.export.write import export_drafter
    from dflash.records import over_text

    try:
        check_checkpoint(args.checkpoint, args.allow_unhealthy)  # a run directory, an unhealthy one
        check_output(args.checkpoint, args.out, args.force)
        drafter, dc, tc = load_drafter(args.checkpoint)
        about = describe(args.checkpoint, dc, tc)  # the target it was trained for, its recorded tau
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", LastLayerWarning)
            try:
                out = export_drafter(drafter, args.out, getattr(torch, args.dtype), force=args.force, about=about)
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
    m = about.measured
    tau = (f"measured tau {m.tau:.3f} tokens/verify step ({over_text(m.prompts, m.max_new_tokens)}, step "
           f"{m.step})" if m is not None else "no measured tau recorded for this step (python -m dflash.eval "
           f"{args.checkpoint} --data SOURCE measures it)")
    print(f"target {about.target.name_or_path}; {tau}: in config.json (dflash_target, dflash_eval) and {CARD_FILE}")
    print(f"load it with AutoModel.from_pretrained({str(out)!r}, trust_remote_code=True); {NO_REMOTE_CODE}")
    return True
