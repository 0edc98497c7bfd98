"""Which target layers feed the drafter: the public DFlash default, or ``target.layer_ids`` checked.

Layer ids are 0-based decoder layer indices; the captured tensor is that decoder layer's raw
*output*. For ``i < L - 1`` that is transformers' ``output_hidden_states[i + 1]``, which z-lab's
``extract_context_feature`` and SpecForge read. For the last layer (``i = L - 1``) it is not:
transformers' ``hidden_states[L]`` is taken *after* the final norm (they differ by tens), and
vLLM speculators reject that layer outright. So a new run may not list the last layer
(:func:`check_not_last_layer`, raised while ``dflash.run`` resolves the drafter): rejecting it, rather than
capturing the post-norm tensor, keeps every export decoding right in z-lab's loop *and* in the
stacks that refuse the layer. Checkpoints trained on it before still load (``dflash.export``
warns).
"""

from __future__ import annotations

from dflash.errors import ConfigError
from dflash.model.target_config import TargetConfig

__all__ = ["check_not_last_layer", "default_layer_ids", "resolve_layer_ids"]


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The DFlash evenly spaced target layers: exactly the public ``build_target_layer_ids`` rule
    (z-lab dflash, SGLang, vLLM speculators), so an exported drafter matches what they rebuild.

    One layer: ``[L // 2]``. Otherwise ``int(round(1 + i * (L - 4) / (k - 1)))`` for ``i < k``,
    i.e. evenly spaced over ``[1, L - 3]`` (36 layers, k=5 -> ``[1, 9, 17, 25, 33]``; 6 layers,
    k=2 -> ``[1, 3]``). The rule never takes the last layer, whose output feeds the final norm and
    is not what the public drafters are trained on.

    Where the rule cannot give ``k`` distinct layers short of the last one (``k >= 2`` needs
    ``L >= k + 3``; ``k = 1`` needs ``L >= 3``), there is no public choice to follow: rather than
    invent one (an earlier fallback picked ``[0, 2, 3, 5]`` on a 6-layer target, last layer
    included, which the vLLM speculators converter rejects), this raises.

    Raises:
        ValueError: the target is too shallow for the rule; the message says to set
            ``target.layer_ids`` or lower ``drafter.num_layers``.
    """
    L, k = num_target_layers, num_draft_layers
    if k < 1:
        raise ValueError(f"drafter.num_layers must be >= 1, got {k}")
    if k == 1:
        ids = [L // 2]
    else:
        ids = [int(round(1 + i * (L - 4) / (k - 1))) for i in range(k)]
    if ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] > L - 2:
        fix = (f"set drafter.num_layers <= {max(L - 3, 1)} or list target.layer_ids explicitly"
               if L >= 3 else "list target.layer_ids explicitly")
        raise ValueError(
            f"drafter.num_layers = {k}: a {L}-layer target is too shallow for the DFlash default "
            "target layers ([L//2] for one drafter layer, else k distinct layers evenly spaced in "
            f"[1, L-3], never the last layer); {fix}")
    return ids


def resolve_layer_ids(cfg: TargetConfig, hf_config, num_draft_layers: int) -> list[int]:
    """``cfg.layer_ids`` (sorted) or :func:`default_layer_ids`, checked against the target depth.

    Raises:
        ValueError: ids out of ``[0, L-1]`` or repeated.
    """
    L = hf_config.num_hidden_layers
    if cfg.layer_ids is None:
        return default_layer_ids(L, num_draft_layers)
    ids = sorted(cfg.layer_ids)
    if not ids or ids[0] < 0 or ids[-1] >= L or len(set(ids)) != len(ids):
        raise ValueError(f"target.layer_ids = {cfg.layer_ids} must be distinct ids in [0, {L - 1}]")
    return ids


def check_not_last_layer(layer_ids: list[int], num_target_layers: int) -> None:
    """Refuse the target's last layer as a drafter feature (module docstring says why).

    Raises:
        ConfigError: ``num_target_layers - 1`` is in ``layer_ids``; one line naming the ids.
    """
    L = num_target_layers
    if L - 1 in layer_ids:
        raise ConfigError(
            f"target.layer_ids = {list(layer_ids)} include {L - 1}, the last layer of the {L}-layer target: "
            "z-lab's and SpecForge's decoders feed the drafter hidden_states[L] for it (after the final "
            "norm, not the layer output trained on here) and vLLM speculators reject it, so an export "
            f"would draft wrong; use ids in [0, {L - 2}]")
