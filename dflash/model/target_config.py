"""The ``[target]`` table and the transformers config it builds: presets, overrides, dtype.

:class:`TargetConfig` is decoded from the graph file; :func:`build_hf_config` turns it into the
transformers config of a local Hugging Face directory (never a hub id) or of a Qwen3-shaped
preset, with ``target.overrides`` checked against the config class (:func:`check_overrides`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import torch

from dflash.tables import Table, added_later

__all__ = [
    "PRESETS",
    "TARGET_MODEL_TYPES",
    "TargetConfig",
    "build_hf_config",
    "check_overrides",
    "for_generation",
    "known_config_keys",
    "resolve_dtype",
]

# Qwen3 shapes (public Qwen3 config.json files); "tiny" is a CPU debug size.
_QWEN3_COMMON: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
}
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 384,
        "rms_norm_eps": 1e-6,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    "qwen3-0.6b": {**_QWEN3_COMMON, "hidden_size": 1024, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "intermediate_size": 3072, "tie_word_embeddings": True},
    "qwen3-1.7b": {**_QWEN3_COMMON, "hidden_size": 2048, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "intermediate_size": 6144, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3_COMMON, "hidden_size": 4096, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "intermediate_size": 12288, "tie_word_embeddings": False},
}


TARGET_MODEL_TYPES = ("llama", "qwen3")
"""The ``model_type`` of a ``target.path`` directory that dflash trains drafters for: decoder layers at
``model.model.layers`` whose output is the hidden state, the token embedding at
``model.model.embed_tokens``, the default RoPE. Each is tested end to end: qwen3 on the shipped target,
llama on SmolLM2-135M-Instruct (``python -m dflash.import_gguf``; tests/dflash/test_smollm2_target.py)
and on a small random Llama (tests/dflash/model/test_llama_target.py)."""


class TargetConfig(Table):
    """The graph file's ``[target]`` table.

    Attributes:
        path: local Hugging Face model directory (never a hub id: nothing is downloaded) of a llama
            or qwen3 model (:data:`TARGET_MODEL_TYPES`; a GGUF file is imported into one first:
            ``python -m dflash.import_gguf``), or None for a ``preset``-shaped model with seeded
            random weights. Relative: to the graph file's directory; given with ``--set``, to the
            current one (:mod:`dflash.run.config`).
        preset: shape used when ``path`` is None: "tiny" | "qwen3-0.6b" | "qwen3-1.7b" | "qwen3-8b".
        overrides: transformers config fields applied on top of the preset or the local config;
            a key the config class does not know is an error (:func:`check_overrides`).
        vocab_size: None = from the preset / local config; the run sets it from the tokenizer for
            "tiny".
        seed: random-init seed (only with ``path = None``).
        dtype: "auto" (bf16 on CUDA, fp32 on CPU) | "bfloat16" | "float16" | "float32".
        attn_implementation: "sdpa" | "flex_attention" | "eager" | "varlen" (packed documents as
            variable-length sequences, no mask: ``torch.nn.attention.varlen``, bf16/fp16 on CUDA;
            :mod:`dflash.model.target_engine`).
        quantization: "none" | "fp8": the decoder layers' Linear weights in float8 with dynamic
            per-row activation scales (torchao; CUDA capability >= 8.9). Embedding and LM head stay
            in the target dtype (shared with the drafter).
        compile: ``torch.compile`` each decoder layer for the fixed packed shape; a batch of
            another shape runs eagerly (one log line per shape).
        compile_mode: the ``torch.compile`` mode with ``compile``: "default" |
            "max-autotune-no-cudagraphs" | "reduce-overhead".
        layer_ids: 0-based decoder layers whose outputs feed the drafter; None = the DFlash evenly
            spaced choice for the drafter's layer count (:func:`default_layer_ids`).
        tokenizer: tokenizer spec for the data path ("builtin:tiny" or a local directory,
            resolved like ``path``); None = ``path`` (or "builtin:tiny" without a path). Not used by the model code.
    """

    path: str | None = None
    preset: Literal["tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"] = "tiny"
    overrides: dict[str, Any] = {}
    vocab_size: int | None = None
    seed: int = 0
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    attn_implementation: Literal["sdpa", "flex_attention", "eager", "varlen"] = "sdpa"
    quantization: Annotated[Literal["none", "fp8"], added_later("none")] = "none"
    compile: Annotated[bool, added_later(False)] = False
    compile_mode: Annotated[Literal["default", "max-autotune-no-cudagraphs", "reduce-overhead"],
                            added_later("default")] = "default"
    layer_ids: list[int] | None = None
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"target.vocab_size must be >= 1, got {self.vocab_size}")

    @property
    def tokenizer_source(self) -> str:
        """Where the target's tokenizer is loaded from (:func:`dflash.data.load_tokenizer`): ``tokenizer``
        when set, else the model directory ``path``, else the builtin tokenizer of the preset targets."""
        return self.tokenizer or self.path or "builtin:tiny"


def check_target_devices(cfg: TargetConfig, devices: list[str]) -> None:
    """The target's fast paths against the installed packages and where the graph runs the target.

    Args:
        devices: the device of every target replica ("cpu" where the graph gives none).

    Raises:
        ConfigError: ``target.quantization = "fp8"`` without torchao, or ``quantization = "fp8"`` /
            ``attn_implementation = "varlen"`` on a CPU target (both are CUDA kernels).
    """
    import importlib.util

    from dflash.errors import ConfigError

    if cfg.quantization == "fp8" and importlib.util.find_spec("torchao") is None:
        raise ConfigError("target.quantization = \"fp8\" needs the torchao package (pip install torchao); "
                          "set target.quantization = \"none\"")
    engine = [f"target.quantization = \"{cfg.quantization}\""] if cfg.quantization != "none" else []
    engine += ["target.attn_implementation = \"varlen\""] if cfg.attn_implementation == "varlen" else []
    cpu = [x for x in devices if not x.startswith("cuda")]
    if engine and cpu:
        raise ConfigError(f"{engine[0]} runs on CUDA only, but process 'target' runs on {cpu[0]}; "
                          "put the target on a cuda:N device or leave the setting at its default")


def for_generation(cfg: TargetConfig) -> TargetConfig:
    """``cfg`` with ``attn_implementation = "sdpa"``: the target as token-by-token generation runs it
    (``dflash.eval``, ``dflash.regenerate``, decode benchmarks). Training's ``flex_attention`` is
    for packed documents, where a ``BlockMask`` skips the other documents' tiles; a KV-cached
    decode has one sequence and no document mask, and flex would compile for every new length.
    The outputs are the same (``tests/dflash/model/test_target.py`` holds the implementations equal).
    ``compile`` is turned off too (a decode's shape changes every token); ``quantization`` is kept:
    it is the model being served."""
    return msgspec.structs.replace(cfg, attn_implementation="sdpa", compile=False)


def resolve_dtype(dtype: str, device: torch.device | str) -> torch.dtype:
    """``"auto"`` -> bf16 on CUDA, fp32 elsewhere; otherwise the named torch dtype."""
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, dtype)


def known_config_keys(config_class, loaded=None) -> set[str]:
    """The keys a transformers config of ``config_class`` understands.

    A key is known if it is a parameter of ``__init__`` of the class or a base class, or a public,
    non-method attribute of a default instance (this covers what ``PretrainedConfig.__init__``
    sets and ``attribute_map`` aliases, which ``to_dict()`` leaves out), or of ``loaded`` (a config
    read from a ``config.json``, which may carry model-specific extras).
    """
    import inspect

    keys: set[str] = set()
    for klass in config_class.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            keys |= {n for n, p in inspect.signature(init).parameters.items()
                     if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    keys |= set(getattr(config_class, "attribute_map", {}))
    for obj in (config_class(), loaded):
        if obj is not None:
            keys |= {k for k in dir(obj) if not k.startswith("_")
                     and not callable(getattr(config_class, k, None))}
    return keys


def check_overrides(overrides: dict[str, Any], config_class, loaded=None) -> None:
    """Reject ``target.overrides`` keys that ``config_class`` does not know (typos are otherwise
    set as inert attributes and silently ignored).

    Raises:
        ValueError: one line naming the first unknown key, the config class, and close matches.
    """
    import difflib

    known = known_config_keys(config_class, loaded)
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"did you mean {' or '.join(map(repr, close))}?" if close else \
                f"see the fields of transformers.{config_class.__name__}"
            raise ValueError(f"target.overrides: {key!r} is not a {config_class.__name__} field; "
                             f"{hint}")


def build_hf_config(cfg: TargetConfig):
    """The transformers config for ``cfg`` (local ``config.json`` or preset), overrides applied.

    Raises:
        FileNotFoundError: ``cfg.path`` is a ``.gguf`` file (the message gives the import command),
            is not a directory, or has no ``config.json``.
        ValueError: the directory's ``model_type`` is not one of :data:`TARGET_MODEL_TYPES`; a
            ``target.overrides`` key the config class does not know (:func:`check_overrides`).
    """
    from transformers import AutoConfig, Qwen3Config

    if cfg.path is not None:
        if Path(cfg.path).is_file() and cfg.path.endswith(".gguf"):
            raise FileNotFoundError(f"target.path = {cfg.path!r} is a GGUF file; import it into a Hugging Face "
                                    f"directory first (python -m dflash.import_gguf {cfg.path} -o DIR) and point "
                                    "target.path at DIR")
        if not Path(cfg.path).is_dir():
            raise FileNotFoundError(f"target.path = {cfg.path!r} does not exist (or is not a directory); "
                                    "point it at a local Hugging Face model directory")
        if not (Path(cfg.path) / "config.json").is_file():
            raise FileNotFoundError(f"target.path = {cfg.path!r} has no config.json; "
                                    "point it at a local Hugging Face model directory")
        hf = AutoConfig.from_pretrained(cfg.path, local_files_only=True)
        if hf.model_type not in TARGET_MODEL_TYPES:
            raise ValueError(f"target.path = {cfg.path!r} holds a {hf.model_type!r} model; dflash trains drafters "
                             f"for {' and '.join(TARGET_MODEL_TYPES)} targets: point target.path at one of those")
        _rope_base_for_4x(hf)
        check_overrides(cfg.overrides, type(hf), hf)
        for key, value in cfg.overrides.items():
            setattr(hf, key, value)
    else:
        check_overrides(cfg.overrides, Qwen3Config)
        fields = {**PRESETS[cfg.preset], **cfg.overrides}
        hf = Qwen3Config(**fields)
    if cfg.vocab_size is not None:
        hf.vocab_size = cfg.vocab_size
    hf._attn_implementation = cfg.attn_implementation
    return hf


def _rope_base_for_4x(hf) -> None:
    """A ``config.json`` written by transformers 5 names the RoPE base only in ``rope_parameters``;
    transformers 4.x does not read that key and builds the model with its default base (10,000),
    while the drafter reads ``rope_parameters`` (:func:`dflash.model.drafter_config.rope_theta_of`).
    Under 4.x, set ``rope_theta`` from it, so the target runs the base its file names (SmolLM2:
    100,000). Under 5.x (no ``rope_theta`` attribute) nothing changes."""
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params and hasattr(hf, "rope_theta"):
        hf.rope_theta = float(params["rope_theta"])
