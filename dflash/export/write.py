"""Writing a drafter in the public DFlash layout (:mod:`dflash.export.layout`): ``config.json``,
``model.safetensors``, ``modeling_dflash.py`` and the model card, renamed into place atomically.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import tempfile
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from dflash.export.layout import (
    CARD_FILE,
    EXPORT_FILES,
    MODELING_FILE,
    NO_REMOTE_CODE,
    NOT_EXPORTED,
    ExportedThenInterrupted,
    LastLayerWarning,
    OutputTaken,
)
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.variants import variant_of

if TYPE_CHECKING:
    from dflash.export.about import ExportInfo

__all__ = ["export_drafter", "exported_weights", "hf_config_dict", "last_layer_problem", "model_card"]


def model_card(cfg: DrafterConfig, dtype: torch.dtype, about: ExportInfo | None = None,
               where: str | Path = "DIR") -> str:
    """The export's ``README.md``: what it is (the drafter, the target it was trained for, its
    measured tau when ``about`` has one) and code that loads and decodes with it as written, here
    or where z-lab's package is installed. ``where``: the export directory, as the code names it."""
    target = about.target if about is not None else None
    name = f"`{target.name_or_path}`" if target is not None else "its target"
    spec = variant_of(cfg.variant)
    where = where if str(where) == "DIR" else Path(where).absolute()  # runs from any directory, as the target's path
    return f"""---
library_name: transformers
tags: [dflash, speculative-decoding, drafter]
---
# {spec.title} drafter for {name}

A {spec.title} block drafter ({cfg.num_layers} layer{"s" if cfg.num_layers != 1 else ""}, hidden size {cfg.hidden_size}, block size {cfg.block_size},
mask token {cfg.mask_token_id}) conditioned on target layers {list(cfg.target_layer_ids)} of
{_target_text(target, cfg)}; weights in {str(dtype).removeprefix("torch.")}. It has no embedding and no LM head:
it uses the target's. Trained with dflash-csp.

{_measured_text(about.measured if about is not None else None)}

## Load it and decode

```python
{_load_code(target, where)}
out = drafter.spec_generate(target, input_ids, max_new_tokens=64, stop_token_ids=[tok.eos_token_id])
print(tok.decode(out[0, input_ids.shape[1]:]))
```

**`trust_remote_code=True` is required**: {NO_REMOTE_CODE}.
`modeling_dflash.py` (torch and transformers only) is the model class; its `spec_generate` is
greedy draft-and-verify with z-lab's signature (the target's own greedy text, `[1, N + n]` ids).

## Decode with z-lab's loop

z-lab's reference package is also named `dflash`, as is dflash-csp: where only z-lab's is installed,
`from dflash.model import dflash_generate` works; beside dflash-csp it finds dflash-csp's package and
fails. Unpack z-lab's wheel under another name there (as dflash-csp's `tests/interop_setup.sh` does):

```bash
pip download --no-deps --only-binary=:all: dflash==0.1.0 -d zlab && python -c "import glob, zipfile; zipfile.ZipFile(glob.glob('zlab/dflash-0.1.0-*.whl')[0]).extractall('zlab')" && mv zlab/dflash zlab/zlab_dflash
```

```python
import sys; sys.path.append("zlab")  # holds zlab_dflash/: z-lab's dflash 0.1.0, renamed
from zlab_dflash.model import dflash_generate
out = dflash_generate(drafter, target, input_ids, max_new_tokens=64, stop_token_ids=[tok.eos_token_id])
```

Serving engines pick the drafter by `architectures = ["{spec.architecture}"]` and read
`dflash_config` (`block_size`, `mask_token_id`, `target_layer_ids`); `config.json` also names the
target (`dflash_target`) and, when one was recorded, the measured tau (`dflash_eval`).
{spec.card_note}"""


def _target_text(target, cfg: DrafterConfig) -> str:
    """``the target `PATH` (qwen3, Qwen3ForCausalLM, 8 layers, hidden 256, vocabulary 4096)``."""
    if target is None:
        return f"a {cfg.num_target_layers}-layer target"
    shape = [x for x in (target.model_type, ", ".join(target.architectures or []) or None,
                         f"{target.num_hidden_layers} layers" if target.num_hidden_layers else None,
                         f"hidden size {target.hidden_size}" if target.hidden_size else None,
                         f"vocabulary {target.vocab_size}" if target.vocab_size else None) if x]
    where = ("recorded relative to the directory training started in" if not target.name_or_path.startswith("preset:")
             and not Path(target.name_or_path).is_absolute() else "")
    if target.name_or_path.startswith("preset:"):
        where = "a random-init preset shape, for plumbing runs: there is no target to load"
    return f"the target `{target.name_or_path}` ({', '.join(shape + ([where] if where else []))})"


def _measured_text(m) -> str:
    if m is None:
        return ("**Measured tau:** none was recorded with the checkpoint this was exported from; "
                "`python -m dflash.eval CHECKPOINT --data SOURCE` measures it.")
    tokens = f" x {m.max_new_tokens} tokens" if m.max_new_tokens else ""
    sampled = (f"; sampled at T={m.temperature:g}, tau {m.sampled_tau:.3f}" if m.sampled_tau is not None
               and m.temperature else "")
    return (f"**Measured tau: {m.tau:.3f} tokens per verify step** (accepted + 1: {m.accepted:.3f} drafted "
            f"tokens accepted per step), over {m.prompt_source}, {m.prompts} prompts{tokens}: "
            f"{m.decoder}, with the weights of step {m.step}{sampled}.")


def _load_code(target, where: str | Path) -> str:
    """The card's load lines: the drafter from ``where``, the target and its tokenizer from where
    the export found it (else as recorded, or a placeholder for a preset)."""
    if target is None or target.name_or_path.startswith("preset:"):
        path, note = "TARGET", "  # the target's Hugging Face directory"
    else:
        path, note = target.found_at or target.name_or_path, ""
    return f"""import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
if device == "cpu":
    torch.set_num_threads(1)  # batch-1 decoding of a small model: more threads contend (often several times slower)
drafter = AutoModel.from_pretrained({str(where)!r}, trust_remote_code=True, dtype=dtype).to(device)
target = AutoModelForCausalLM.from_pretrained({path!r}, dtype=dtype).to(device){note}
tok = AutoTokenizer.from_pretrained({path!r})
input_ids = tok.apply_chat_template([{{"role": "user", "content": "Name three colours."}}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=False).to(device)"""


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


def hf_config_dict(cfg: DrafterConfig, dtype: torch.dtype = torch.bfloat16,
                   about: ExportInfo | None = None) -> dict[str, Any]:
    """The public-layout ``config.json`` content for a resolved drafter config; with ``about``
    (:func:`dflash.export.about.describe`) also ``dflash_target`` (the target it was trained
    for) and, when recorded, ``dflash_eval`` (its measured tau): keys the public loaders ignore.

    Raises:
        ValueError: ``mask_token_id`` is unset.
    """
    cfg.check_resolved()
    if cfg.mask_token_id is None:
        raise ValueError("drafter.mask_token_id is unset; the exported config must name it")
    sliding = "sliding_attention" in cfg.types
    spec = variant_of(cfg.variant)
    arch = spec.architecture
    dflash_config = {
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        **{key: getattr(cfg, ours) for key, ours in spec.export_keys},
    }
    out = {
        "architectures": [arch],
        "model_type": "qwen3",  # the drafter's layers, for a Llama target too (dflash.export's docstring)
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
        "auto_map": {"AutoModel": f"{(spec.remote_code or MODELING_FILE).removesuffix('.py')}.{arch}"},
    }
    if about is not None:
        import msgspec

        target = msgspec.to_builtins(about.target)
        target.pop("found_at")  # where this machine found it: no part of what the drafter is
        out["dflash_target"] = target
        if about.measured is not None:
            out["dflash_eval"] = msgspec.to_builtins(about.measured)
    return out


def exported_weights(drafter: DFlashDrafter, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The drafter's state dict on the CPU in ``dtype``, less the :data:`NOT_EXPORTED` keys."""
    return {k: t.detach().to("cpu", dtype).contiguous() for k, t in drafter.state_dict().items()
            if not k.startswith(NOT_EXPORTED)}


def export_drafter(drafter: DFlashDrafter, out_dir: str | Path,
                   dtype: torch.dtype = torch.bfloat16, *, force: bool = True,
                   about: ExportInfo | None = None) -> Path:
    """Write ``config.json``, ``model.safetensors``, ``modeling_dflash.py`` and the model card
    ``README.md`` into ``out_dir`` (created if needed, with its parents). ``about``: the target
    and measured tau the config and the card name (:func:`dflash.export.about.describe`; the CLI
    reads them from the checkpoint); None: the card names neither.

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
    cfg = hf_config_dict(drafter.cfg, dtype, about)
    weights = exported_weights(drafter, dtype)
    remote = variant_of(drafter.cfg.variant).remote_code  # a variant's own model file, beside modeling_dflash.py
    files = EXPORT_FILES + ((remote,) if remote else ())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        for name in (MODELING_FILE, remote) if remote else (MODELING_FILE,):
            (tmp / name).write_bytes((Path(__file__).parent.parent / "model" / name).read_bytes())
        (tmp / CARD_FILE).write_text(model_card(drafter.cfg, dtype, about, out_dir))
        umask = os.umask(0)
        os.umask(umask)
        for name in files:
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
                for name in files:  # --force into a non-empty directory: each file atomically
                    os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


_TAKEN = (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR)
"""What ``rename(2)`` of the temporary directory says when ``out_dir`` is a non-empty directory or a file."""


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
