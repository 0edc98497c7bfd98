"""The drafter on fused kernels: Liger-Kernel's RMSNorm and SwiGLU, and ``torch.compile`` of its layers.

``[drafter].kernels = "liger"`` swaps the forward of every :class:`dflash.model.drafter.RMSNorm`
(the layer norms, QK-norm, ``hidden_norm`` and the final ``norm``) for ``liger_rms_norm`` and of
every :class:`dflash.model.drafter.MLP` for ``down(liger_swiglu(gate(x), up(x)))`` (Triton kernels
of Liger-Kernel, Hsu et al. 2024, "Liger Kernel: Efficient Triton Kernels for LLM Training"). The
modules and their parameters stay as they are, so the state-dict keys do not change and a checkpoint
trained either way loads either way. Off CUDA the torch ops run (Triton has no CPU backend), so an
exported drafter still evaluates on a CPU.

RoPE stays the torch op: Liger's rotary kernel rotates a query and a key tensor of one length, and
the drafter's queries (the block tokens) and keys (context plus block) differ in length;
``[drafter].compile`` fuses it instead.

RMSNorm runs in Liger's "llama" casting mode (the rstd in fp32, the product cast to the input dtype:
the same as :class:`dflash.model.drafter.RMSNorm`) and not in place: the input gradient must not
overwrite the output gradient, which the residual stream still reads.

``[drafter].compile = true`` compiles each decoder layer in place (``nn.Module.compile``: the keys
stay ``layers.N....``, unlike a ``torch.compile`` wrapper's ``_orig_mod.``).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from dflash.errors import ConfigError

__all__ = ["apply_kernels"]


def _liger_norm_forward(norm: nn.Module):
    from liger_kernel.transformers.functional import liger_rms_norm

    eager = norm.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return eager(x)
        return liger_rms_norm(x, norm.weight, norm.eps, 0.0, "llama", False)

    return forward


def _liger_mlp_forward(mlp: nn.Module):
    from liger_kernel.transformers.functional import liger_swiglu

    eager = mlp.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return eager(x)
        return mlp.down_proj(liger_swiglu(mlp.gate_proj(x), mlp.up_proj(x)))

    return forward


def apply_kernels(drafter: nn.Module, kernels: str, compile: bool, norm_type: type, mlp_type: type, *,
                  precision: str = "bf16", fp8_recipe: str = "tensorwise") -> None:
    """Put ``drafter`` (a :class:`dflash.model.drafter.DFlashDrafter`) on fused kernels in place:
    Liger's ops, then float8 Linears, then ``torch.compile`` (which then sees both).

    Args:
        norm_type, mlp_type: the drafter's RMSNorm and MLP classes (passed in, so this module does
            not import the drafter's).
        kernels: "torch" (no swap) | "liger" (RMSNorm and SwiGLU, see the module docstring).
        compile: ``torch.compile`` each of ``drafter.layers`` in place.
        precision, fp8_recipe: ``"fp8"`` swaps the backbone Linears for torchao's float8 training
            Linears (:func:`dflash.model.drafter_fp8.convert_to_fp8`); "bf16" leaves them.

    Raises:
        ConfigError: ``kernels = "liger"`` and the liger_kernel (or triton) package is missing;
            ``precision = "fp8"`` without torchao; an unknown ``kernels`` or ``precision`` value.
    """
    if kernels == "liger":
        missing = [p for p in ("liger_kernel", "triton") if importlib.util.find_spec(p) is None]
        if missing:
            raise ConfigError(f"drafter.kernels = 'liger' needs the {' and '.join(missing)} package(s) "
                              "(pip install liger-kernel; CUDA only): set drafter.kernels = 'torch'")
        for module in drafter.modules():
            if isinstance(module, norm_type):
                module.forward = _liger_norm_forward(module)
            elif isinstance(module, mlp_type):
                module.forward = _liger_mlp_forward(module)
    elif kernels != "torch":
        raise ConfigError(f"drafter.kernels = {kernels!r}: expected 'torch' or 'liger'")
    if precision == "fp8":
        from dflash.model.drafter_fp8 import convert_to_fp8

        convert_to_fp8(drafter, fp8_recipe)
    elif precision != "bf16":
        raise ConfigError(f"drafter.precision = {precision!r}: expected 'bf16' or 'fp8'")
    if compile:
        for layer in drafter.layers:
            layer.compile()

