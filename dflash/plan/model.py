"""The layout model: predicted tok/s of every layout worth considering for N GPUs over H hosts.

The terms are documented in :mod:`dflash.plan`; this module is their arithmetic. A layout is one of

* ``pods``: N / g identical *pods* of g GPUs, each one rank with ``a`` target replicas and one
  drafter replica; the hidden states stay inside the pod (``rank_local`` channels), the drafters
  are data-parallel over the pods. ``a = g`` puts the drafter on a GPU with a target (``shared``,
  a hybrid); ``g = 1`` is colocated data-parallel (every GPU runs both);
* ``split``: k target GPUs and m drafter GPUs (k + m = N, both spread evenly over the hosts); one
  ``hidden`` channel deals the target outputs to the m drafter ranks in turn, so with H hosts
  (H - 1) / H of the hidden-state bytes cross the network.
"""

from __future__ import annotations

import msgspec

GIB = 2 ** 30
NVLINK_BYTES_PER_S = 450e9  # H200 class (NVLink 4, 18 links): 900 GB/s bidirectional, 450 GB/s per direction


class Inputs(msgspec.Struct, frozen=True, kw_only=True):
    """What the model knows: measured rates and the sizes that set the traffic and memory.

    Attributes:
        target_tok_s: one target replica alone on a GPU, tokens/s.
        drafter_tok_s: one drafter replica alone on a GPU (forward, backward, optimizer), tokens/s.
        coloc: colocation efficiency: tok/s of one GPU running both stages over their serial bound
            ``1 / (1/target + 1/drafter)`` (dimensionless, <= ~1).
        coloc_source: where ``coloc`` comes from (printed with the plan).
        bytes_per_token: hidden-state channel bytes per token (k x H x 2 + ids and masks), bytes.
        grad_bytes: the drafter's trainable gradient bytes all-reduced per step, bytes.
        tokens_per_batch: tokens one drafter replica trains per step.
        target_mem: bytes one target replica holds on its GPU (weights and activations).
        drafter_mem: bytes one drafter replica holds (weights, gradients, Adam state, activations).
        nvlink_bytes_per_s: GPU-to-GPU bandwidth within a host, per direction, bytes/s.
        net_bytes_per_s: network bandwidth between hosts per GPU (its NIC), per direction, bytes/s.
    """

    target_tok_s: float
    drafter_tok_s: float
    coloc: float
    coloc_source: str
    bytes_per_token: float
    grad_bytes: float
    tokens_per_batch: int
    target_mem: float = 0.0
    drafter_mem: float = 0.0
    nvlink_bytes_per_s: float = NVLINK_BYTES_PER_S
    net_bytes_per_s: float = 400e9 / 8


class Layout(msgspec.Struct, frozen=True, kw_only=True):
    """One evaluated layout.

    Attributes:
        name: e.g. "colocated x8", "pods 3t+1d x2", "split 5:3".
        kind: "pods" | "split".
        gpus, hosts: the GPUs and hosts it uses.
        targets, drafters: replica counts over all GPUs.
        pod_gpus: GPUs per pod (``pods``; 0 for ``split``).
        shared: the drafter shares a GPU with a target.
        tok_s: predicted throughput, tokens/s.
        bound: what limits it ("target", "drafter", "shared GPU", "hidden over the network",
            "all-reduce over NVLink", ...).
        mem_gib: the fullest GPU's memory, GiB.
        cross_host_gb_s: hidden-state bytes crossing hosts at ``tok_s``, GB/s (all hosts together).
    """

    name: str
    kind: str
    gpus: int
    hosts: int
    targets: int
    drafters: int
    pod_gpus: int
    shared: bool
    tok_s: float
    bound: str
    mem_gib: float
    cross_host_gb_s: float = 0.0


def _allreduce(inp: Inputs, drafters: int, one_host: bool) -> tuple[float, str]:
    """The tok/s the drafters' gradient all-reduce allows (ring: each GPU sends 2 (n-1)/n of the
    gradient bytes per step; DDP overlaps it with the backward, so it is a bound of its own)."""
    if drafters <= 1 or inp.grad_bytes <= 0:
        return float("inf"), "all-reduce"
    link, where = (inp.nvlink_bytes_per_s, "NVLink") if one_host else (inp.net_bytes_per_s, "the network")
    step_s = 2 * (drafters - 1) / drafters * inp.grad_bytes / link
    return drafters * inp.tokens_per_batch / step_s, f"all-reduce over {where}"


def pod_rate(inp: Inputs, gpus: int, targets: int) -> tuple[float, str]:
    """Tok/s of one pod: ``targets`` target replicas and one drafter on ``gpus`` GPUs (the drafter
    shares a GPU with a target when ``targets == gpus``; that GPU splits its time between them,
    at the colocation efficiency). Returns (tok/s, bound)."""
    t, d, f = inp.target_tok_s, inp.drafter_tok_s, inp.coloc
    if targets == gpus - 1:  # the drafter on its own GPU
        return min((targets * t, "target"), (d, "drafter"))
    # x tokens/s: the g - 1 dedicated targets give (g-1) t, the shared GPU's target the rest, x_s,
    # with x_s / t + x / d <= f; so x (1 + t / d) <= t (g - 1 + f), and x <= f d with x_s = 0
    x = t * (gpus - 1 + f) / (1 + t / d)
    return (x, "shared GPU") if x <= f * d else (f * d, "drafter")


def evaluate_pods(inp: Inputs, gpus: int, hosts: int, pod_gpus: int, targets: int) -> Layout:
    """The ``pods`` layout with ``gpus / pod_gpus`` pods (module doc)."""
    pods = gpus // pod_gpus
    x, bound = pod_rate(inp, pod_gpus, targets)
    x *= pods
    ar, ar_name = _allreduce(inp, pods, hosts == 1)
    # within a pod the hidden states move over NVLink unless the drafter shares the only GPU
    link = float("inf") if pod_gpus == 1 else pods * inp.nvlink_bytes_per_s / inp.bytes_per_token
    x, bound = min((x, bound), (ar, ar_name), (link, "hidden over NVLink"))
    shared = targets == pod_gpus
    mem = inp.target_mem + inp.drafter_mem if shared else max(inp.target_mem, inp.drafter_mem)
    name = f"colocated x{gpus}" if pod_gpus == 1 else (
        f"pods {targets}t+1d{' shared' if shared else ''} on {pod_gpus} GPUs x{pods}")
    return Layout(name=name, kind="pods", gpus=gpus, hosts=hosts, targets=pods * targets, drafters=pods,
                  pod_gpus=pod_gpus, shared=shared, tok_s=x, bound=bound, mem_gib=mem / GIB)


def evaluate_split(inp: Inputs, gpus: int, hosts: int, targets: int) -> Layout:
    """The ``split`` layout with ``targets`` target GPUs and the rest drafter GPUs (module doc)."""
    drafters = gpus - targets
    b = inp.bytes_per_token
    options = [(targets * inp.target_tok_s, "target"), (drafters * inp.drafter_tok_s, "drafter"),
               _allreduce(inp, drafters, hosts == 1),
               # every target GPU sends and every drafter GPU receives its share over NVLink (or its NIC)
               (min(targets, drafters) * inp.nvlink_bytes_per_s / b, "hidden over NVLink")]
    cross = (hosts - 1) / hosts
    if hosts > 1:  # a host's targets send (H-1)/H of their output out through the target GPUs' NICs
        options.append((min(targets, drafters) * inp.net_bytes_per_s / (b * cross), "hidden over the network"))
    x, bound = min(options)
    return Layout(name=f"split {targets}:{drafters}", kind="split", gpus=gpus, hosts=hosts, targets=targets,
                  drafters=drafters, pod_gpus=0, shared=False, tok_s=x, bound=bound,
                  mem_gib=max(inp.target_mem, inp.drafter_mem) / GIB, cross_host_gb_s=x * b * cross / 1e9)


def layouts(inp: Inputs, gpus: int, hosts: int = 1, gpu_mem_gib: float | None = None) -> list[Layout]:
    """Every layout worth considering, best first (ties: fewer drafters first).

    Pods of every size g dividing the GPUs per host (g - 1 targets + a drafter, and g targets with
    a shared drafter); split k:m for every k when ``hosts == 1``, else for k, m both multiples of
    ``hosts`` (uniform hosts: torchrun starts the same number of ranks on each). Layouts whose
    fullest GPU needs more than ``gpu_mem_gib`` are left out.

    Raises:
        ValueError: gpus < 1, hosts < 1, or gpus not a multiple of hosts.
    """
    if gpus < 1 or hosts < 1 or gpus % hosts:
        raise ValueError(f"--gpus {gpus} over --hosts {hosts}: need gpus >= 1, hosts >= 1 and gpus a multiple "
                         "of hosts (the same GPUs on every host)")
    per_host = gpus // hosts
    out = []
    for g in (g for g in range(1, per_host + 1) if per_host % g == 0):
        out.append(evaluate_pods(inp, gpus, hosts, g, g))
        if g > 1:
            out.append(evaluate_pods(inp, gpus, hosts, g, g - 1))
    for k in range(1, gpus):
        if hosts == 1 or (k % hosts == 0 and (gpus - k) % hosts == 0):
            out.append(evaluate_split(inp, gpus, hosts, k))
    if gpu_mem_gib is not None:
        out = [lay for lay in out if lay.mem_gib <= gpu_mem_gib]
    return sorted(out, key=lambda lay: (-lay.tok_s, lay.drafters, lay.name))


def colocated(inp: Inputs, gpus: int, hosts: int = 1) -> Layout:
    """Colocated data-parallel on the same GPUs: the baseline every ratio divides by."""
    return evaluate_pods(inp, gpus, hosts, 1, 1)


__all__ = ["GIB", "NVLINK_BYTES_PER_S", "Inputs", "Layout", "colocated", "evaluate_pods", "evaluate_split",
           "layouts", "pod_rate"]
