"""The drafter's backbone matmuls in float8 while it trains (``[drafter].precision = "fp8"``).

torchao's float8 training (``torchao.float8.convert_to_float8_training``; torchao's float8 README,
the recipe torchtitan and NeMo Automodel train with) swaps each chosen ``nn.Linear`` for a
``Float8Linear``. Forward and backward cast the input, the weight and the output gradient to float8
e4m3 with dynamic scales (one per tensor, or one per row for the rowwise recipes) and run the three
matmuls of the layer (output, input gradient, weight gradient) on float8 tensor cores. Everything else
stays as with bf16: the weight is still an fp32 ``nn.Parameter`` under the same state-dict key (so
AdamW, checkpoints, the snapshot and the export see the same tensors), the layer's output is bf16
under autocast, and the loss, the norms, attention and the LM head are untouched.

Which Linears: ``fc`` and every attention and MLP projection of the decoder layers, the matmuls that
carry the drafter's FLOPs. DFlash2's convolution-tap and selector projections and the confidence head
are small (their outputs are ``2*K*H/16``, ``rank`` and 1 wide), so float8's two casts per matmul
would cost more than they save, and the selector's codebook scores decide which candidate wins.
A Linear whose dimensions are not multiples of 16 (the float8 kernels' tile) stays as it is.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from dflash.errors import ConfigError

__all__ = ["FP8_LINEARS", "check_fp8", "convert_to_fp8", "fp8_linear_count"]

log = logging.getLogger(__name__)

FP8_LINEARS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The last name of every drafter Linear that trains in float8 (see the module docstring)."""


def check_fp8(device: torch.device | str) -> None:
    """Refuse, in one line, ``[drafter].precision = "fp8"`` where it cannot run.

    Raises:
        ConfigError: torchao is not installed, the drafter is not on a CUDA GPU (or none is
            visible), or the GPU has no float8 tensor cores (compute capability below 8.9: Ada,
            Hopper and newer have them).
    """
    device = torch.device(device)
    _need_torchao()
    if device.type != "cuda":
        raise ConfigError(f"drafter.precision = \"fp8\" needs a CUDA GPU with float8 tensor cores, but process "
                          f"'drafter' runs on {device}: set drafter.precision = \"bf16\"")
    if not torch.cuda.is_available():
        raise ConfigError(f"drafter.precision = \"fp8\" needs a CUDA GPU, and process 'drafter' is placed on "
                          f"{device}, but this machine has none visible: set drafter.precision = \"bf16\"")
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise ConfigError(f"drafter.precision = \"fp8\" needs float8 tensor cores (compute capability >= 8.9); "
                          f"{torch.cuda.get_device_name(device)} on {device} is {cap[0]}.{cap[1]}: set "
                          "drafter.precision = \"bf16\"")


def _need_torchao() -> None:
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("drafter.precision = \"fp8\" needs the torchao package (pip install torchao); "
                          "set drafter.precision = \"bf16\"")


def _chosen(module: nn.Module, fqn: str) -> bool:
    return (isinstance(module, nn.Linear) and fqn.rsplit(".", 1)[-1] in FP8_LINEARS
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_to_fp8(drafter: nn.Module, recipe: str = "tensorwise") -> int:
    """Swap the drafter's backbone Linears for torchao ``Float8Linear`` in place (before
    ``torch.compile``, which then fuses the casts and scales into the surrounding kernels).

    Args:
        drafter: a :class:`dflash.model.drafter.DFlashDrafter` (any device: the swap keeps each
            weight's tensor; the float8 matmuls run once it is on a GPU of compute capability >= 8.9).
        recipe: torchao's ``Float8LinearRecipeName``: "tensorwise" | "rowwise" | "rowwise_with_gw_hp".

    Returns:
        the number of Linears swapped.

    Raises:
        ConfigError: torchao is not installed.
    """
    _need_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(drafter, module_filter_fn=_chosen,
                               config=Float8LinearConfig.from_recipe_name(recipe))
    count = fp8_linear_count(drafter)
    # said once in the run log: the run's speed and numerics depend on it
    log.info("drafter: %d Linear layers train in float8 (torchao, %s scaling)", count, recipe)
    return count


def fp8_linear_count(module: nn.Module) -> int:
    """How many of ``module``'s Linears are torchao ``Float8Linear`` (0 without torchao)."""
    if importlib.util.find_spec("torchao") is None:
        return 0
    from torchao.float8.float8_linear import Float8Linear

    return sum(isinstance(m, Float8Linear) for m in module.modules())
