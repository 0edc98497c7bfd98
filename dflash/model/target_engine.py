"""The target as an inference engine: FP8 Linear layers, varlen attention over packed documents,
and ``torch.compile`` of the decoder layers. Each is a ``[target]`` switch, off by default.

* ``quantization = "fp8"`` (:func:`quantize_fp8`): torchao's float8 inference recipe, dynamic
  per-row activation scales and per-row weight scales (``Float8DynamicActivationFloat8WeightConfig``
  with ``PerRow()``; torchao, "Float8 inference" in its README), on the decoder layers' ``nn.Linear``
  weights only. The embedding and the LM head are left in bf16: the drafter shares them
  (:class:`dflash.model.shared_head.SharedHead`), and torchao replaces a quantized weight's
  Parameter, which would untie them. Needs a CUDA GPU of compute capability 8.9 or newer (float8
  tensor cores) and the ``torchao`` package.
* ``attn_implementation = "varlen"`` (:func:`varlen_attention`): ``torch.nn.attention.varlen.varlen_attn``
  (FlashAttention-2 in aten) over the packed rows flattened to ``[B*T, heads, d]`` with one causal
  sequence per document, so no ``[B, 1, T, T]`` mask is built and no tile of another document is
  visited. Registered with transformers' ``AttentionInterface`` under the name ``"varlen"``; the
  model then builds no mask (a custom attention name has no mask function) and reads the sequence
  boundaries from the ``cu_seq_lens_q`` / ``max_length_q`` keyword arguments that transformers
  passes through to every attention call. bf16/fp16 on CUDA only (the kernel has no CPU path).
* ``compile = true`` (:class:`CompiledLayers`): ``torch.compile`` of each decoder layer's forward
  for the fixed packed shape. The capture hooks stay outside the compiled code. A batch of another
  shape runs eagerly, with one log line per new shape, instead of recompiling.
"""

from __future__ import annotations

import inspect
import logging

import torch
from torch import nn

from dflash.errors import ConfigError

__all__ = ["CompiledLayers", "VARLEN", "check_engine", "quantize_fp8", "register_varlen",
           "varlen_attention", "varlen_kwargs"]

log = logging.getLogger(__name__)

VARLEN = "varlen"  # the transformers attention name of varlen_attention


def check_engine(quantization: str, attn_implementation: str, device: torch.device | str,
                 dtype: torch.dtype) -> None:
    """Refuse, in one line, a ``[target]`` engine setting this device or install cannot run.

    Raises:
        ConfigError: ``quantization = "fp8"`` without torchao, off CUDA, below compute capability
            8.9 or with a non-bf16 target; ``attn_implementation = "varlen"`` off CUDA, with a
            dtype other than bf16/fp16, or on a torch without ``torch.nn.attention.varlen``.
    """
    import importlib.util

    device = torch.device(device)
    if quantization == "fp8":
        if importlib.util.find_spec("torchao") is None:
            raise ConfigError("target.quantization = 'fp8' needs the torchao package (pip install "
                              "torchao); set target.quantization = 'none' to run in bf16")
        if device.type != "cuda":
            raise ConfigError(f"target.quantization = 'fp8' needs a CUDA GPU; the target is on {device}: "
                              "set target.quantization = 'none'")
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ConfigError(f"target.quantization = 'fp8' needs float8 tensor cores (compute capability "
                              f">= 8.9); {torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}: "
                              "set target.quantization = 'none'")
        if dtype != torch.bfloat16:
            raise ConfigError(f"target.quantization = 'fp8' quantizes bf16 weights (per-row scales); "
                              f"the target dtype is {dtype}: set target.dtype = 'bfloat16' or 'auto'")
    if attn_implementation == VARLEN:
        if importlib.util.find_spec("torch.nn.attention.varlen") is None:
            raise ConfigError(f"target.attn_implementation = 'varlen' needs torch.nn.attention.varlen "
                              f"(torch >= 2.10; this is {torch.__version__}): use 'flex_attention'")
        if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
            raise ConfigError(f"target.attn_implementation = 'varlen' runs bf16/fp16 on CUDA only (the "
                              f"target is {dtype} on {device}): use 'sdpa' or 'flex_attention'")


# -- FP8 -------------------------------------------------------------------------------------------

def quantize_fp8(layers: nn.Module) -> int:
    """Quantize every ``nn.Linear`` under ``layers`` (the decoder layers, never the embedding or the
    LM head) to float8 e4m3 with dynamic per-row activation scales and per-row weight scales, in
    place (torchao ``quantize_``). Inference only: the weights become frozen ``Float8Tensor``
    parameters. Linears whose dims are not multiples of 16 are left in bf16 by torchao.

    ``set_inductor_config=False``: torchao's default would set TF32 matmuls and inductor options
    for the whole process, which includes the drafter's fp32 master weights.

    Returns:
        the number of Linear modules passed to torchao.
    """
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    count = sum(isinstance(m, nn.Linear) for m in layers.modules())
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    quantize_(layers, config, filter_fn=lambda module, fqn: isinstance(module, nn.Linear))
    # said once in the run log: a run's speed and features depend on it, and nothing else shows it
    log.info("target: %d decoder Linear layers quantized to float8 (torchao, dynamic per-row scales)", count)
    return count


# -- varlen attention --------------------------------------------------------------------------------

def varlen_kwargs(doc_ids: torch.Tensor, max_length: int | None = None) -> dict[str, object]:
    """The transformers varlen keyword arguments for packed rows ``doc_ids [B, T]`` (-1 = padding).

    A sequence is a maximal run of one document within a row; every padding token is a sequence of
    its own (it attends only to itself, as in :func:`dflash.model.document_mask.document_causal_mask`).
    Boundaries are data, so this reads ``doc_ids`` on the host once (one device sync when it is on
    CUDA), then copies ``cu_seq_lens [N + 1]`` int32 back.

    Args:
        max_length: the ``max_length_q/k`` to pass; None = the longest sequence. A fixed value (the
            row length ``T``) keeps a compiled forward from specialising on each batch's maximum.

    Returns:
        ``{"cu_seq_lens_q", "cu_seq_lens_k"}`` (the same ``[N + 1]`` int32 tensor on ``doc_ids``'s
        device) and ``{"max_length_q", "max_length_k"}`` (Python ints).
    """
    doc = doc_ids.detach().to("cpu", torch.int64)
    B, T = doc.shape
    start = torch.ones(B, T, dtype=torch.bool)
    start[:, 1:] = (doc[:, 1:] != doc[:, :-1]) | (doc[:, 1:] < 0)
    idx = start.reshape(-1).nonzero().squeeze(1)
    cu = torch.cat([idx, torch.tensor([B * T])]).to(torch.int32)
    longest = int(cu.diff().max()) if len(cu) > 1 else 0
    cu = cu.to(doc_ids.device, non_blocking=True)
    m = longest if max_length is None else max(max_length, longest)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": m, "max_length_k": m}


_GQA_KWARG: bool | None = None


def varlen_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None,
                     dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention function over packed documents: ``varlen_attn`` causal per sequence.

    Args:
        query: ``[B, heads, T, d]``; key, value: ``[B, kv_heads, T, d]`` (bf16/fp16, CUDA).
        attention_mask: ignored (None: the model builds no mask for this implementation).
        scaling: softmax scale (None = ``d ** -0.5``).
        kwargs: ``cu_seq_lens_q [N + 1]`` int32 and ``max_length_q`` (:func:`varlen_kwargs`).

    Returns:
        ``(out [B, T, heads, d], None)``, the layout transformers' attention functions return.

    Raises:
        ValueError: no ``cu_seq_lens_q`` was passed (the forward did not come through
            :class:`dflash.model.target.Target`).
    """
    global _GQA_KWARG
    from torch.nn.attention.varlen import varlen_attn

    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None or max_len is None:
        raise ValueError("attn_implementation 'varlen' needs cu_seq_lens_q and max_length_q "
                         "(dflash.model.target_engine.varlen_kwargs of the packed batch's doc_ids)")
    B, nh, T, d = query.shape
    flat = lambda x: x.transpose(1, 2).reshape(B * T, x.shape[1], d)  # noqa: E731 - [B*T, h, d]
    if _GQA_KWARG is None:  # set by register_varlen; here only for a caller that skipped it
        _GQA_KWARG = _takes_enable_gqa()
    extra = {"enable_gqa": True} if _GQA_KWARG and key.shape[1] != nh else {}
    out = varlen_attn(flat(query), flat(key), flat(value), cu, cu, int(max_len), int(max_len),
                      scale=scaling, window_size=(-1, 0), **extra)
    return out.view(B, T, nh, d), None


def _takes_enable_gqa() -> bool:
    """Whether ``varlen_attn`` asks for ``enable_gqa`` (later torch) or takes fewer kv heads as is (2.11)."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def register_varlen() -> None:
    """Register :func:`varlen_attention` as transformers' ``"varlen"`` attention (idempotent).

    Also settles which ``varlen_attn`` signature the installed torch has, before any forward: a
    compiled layer guards on that module global, and one that changed after its first trace would
    recompile every layer once more."""
    global _GQA_KWARG
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention)
    if _GQA_KWARG is None:
        _GQA_KWARG = _takes_enable_gqa()


# -- compile ---------------------------------------------------------------------------------------

class CompiledLayers:
    """``torch.compile`` of each decoder layer's ``forward`` for one packed batch shape.

    The first batch's ``input_ids`` shape is the compiled one. :meth:`use_for` switches every layer
    to its compiled forward for that shape and to the eager one otherwise, logging one line the
    first time each other shape is seen (a recompile per shape would stall the stage for seconds).
    Forward hooks (the feature capture) run outside the compiled code.

    Args:
        layers: the decoder layers (their ``forward`` is wrapped in place).
        mode: ``torch.compile`` mode (None = default; "max-autotune-no-cudagraphs" tunes the matmul
            kernels; "reduce-overhead" adds CUDA graphs).
    """

    def __init__(self, layers: nn.ModuleList, mode: str | None) -> None:
        self.shape: tuple[int, ...] | None = None
        self._seen: set[tuple[int, ...]] = set()
        self._on = False
        # every layer's forward is one code object: dynamo may keep a cache entry per layer (and a
        # second once the varlen boundaries' length turns dynamic), so the per-code-object limit
        # (8 by default) must hold them all, or the deeper layers would silently stay eager
        import torch._dynamo

        limit = torch._dynamo.config.cache_size_limit
        torch._dynamo.config.cache_size_limit = max(limit, 2 * len(layers) + 8)
        for layer in layers:
            eager = layer.forward
            compiled = torch.compile(eager, mode=mode)

            def forward(*args, _eager=eager, _compiled=compiled, **kw):
                return (_compiled if self._on else _eager)(*args, **kw)

            layer.forward = forward

    def off(self) -> None:
        """Run every layer eagerly until the next :meth:`use_for` (a caller that detaches this
        object from its target for a while, to run another attention implementation, calls it)."""
        self._on = False

    def use_for(self, shape: tuple[int, ...]) -> bool:
        """Choose compiled (True: ``shape`` is the compiled shape, or the first) or eager layers."""
        shape = tuple(shape)
        if self.shape is None:
            self.shape = shape
        self._on = shape == self.shape
        if not self._on and shape not in self._seen:
            self._seen.add(shape)
            log.warning("target.compile: batch shape %s differs from the compiled %s; batches of this "
                        "shape run eagerly", list(shape), list(self.shape))
        return self._on
