"""``python -m dflash.plan RUN_DIR --gpus N``: the layouts worth considering for N GPUs, ranked by
predicted tok/s from a finished run's measurements, and the best one written as a graph file.

The model (each term a number the plan prints or a stated default):

* **Stage rates measured alone.** One target replica's and one drafter replica's tokens/s, from
  the run's busy time per stage (:func:`csp.observe.whatif.fit`: capacity = replicas x batches / busy
  replica-seconds), times the real tokens per batch (``data.tokens_per_batch`` less the padding
  ``metrics.jsonl`` reports). A run whose target and drafter shared a device measured *shared*
  rates; ``--target-tok-s`` / ``--drafter-tok-s`` give rates measured alone instead.
* **Colocation cost.** One GPU running both stages reaches ``coloc / (1/T + 1/D)``. ``coloc`` is
  measured when the run shared a device and the alone rates are given (measured per shared device
  x ``(1/T + 1/D)``), else ``--coloc``, else 0.99 (benchmarks/results/LOG.md: colocated
  data-parallel 19.1K tok/s on one H200 against the serial bound 19.2K of the stages alone).
* **Channel bytes per token.** The bytes/s of the target's output channel over tokens/s
  (measured; on paper ``k x H x 2`` bytes of bf16 hidden states plus 21 bytes of ids and masks).
  Within a host each GPU moves them over NVLink (450 GB/s per direction, H200 class); between
  hosts over its NIC (``--net-gbps``, per GPU and direction). A split layout deals the hidden
  states to every drafter rank, so (H - 1) / H of them cross hosts: the multi-host bound.
* **The drafter's gradient all-reduce.** Ring all-reduce of the fp32 gradients (the checkpoint's
  weight bytes) per step: ``2 (n - 1) / n x bytes`` per GPU over NVLink (one host) or the NIC.
  DDP overlaps it with the backward, so it is a bound ``n x tokens_per_batch / t_allreduce``.
* **Memory per GPU.** Target weights (2 bytes a parameter on CUDA), drafter weights, gradients
  and Adam moments (4 x the fp32 weights) and activations (131 bytes per token, hidden unit and
  drafter layer: the H200 drafter's measured peak). ``--gpu-mem`` drops layouts that do not fit.
* **Integer replica counts.** Layouts are whole pods or whole k:m splits, uniform over hosts.

Throughput = the minimum of these bounds over the layout (:mod:`dflash.plan.model`); its argmin is
the layout's ``bound``. The model's own check, printed first: the run's layout predicted (lowest
stage capacity) against its measured tok/s. Modules::

    __main__.py   python -m dflash.plan: runs cli.py
    cli.py        the command: read the run, rank the layouts, write the best one as a graph file
    measure.py    the model's inputs from a finished run directory (csp/stats.jsonl, metrics.jsonl)
    model.py      the layout model: predicted tok/s of every layout worth considering for N GPUs
    write.py      a layout as a graph file (the run's config.toml, replicas placed) and its torchrun line
"""

from dflash.plan.model import Inputs, Layout, colocated, layouts


def __getattr__(name: str):
    # the run-dir reader pulls in csp (and torch): loaded on first use, so --help stays fast
    if name in ("Measured", "PlanError", "from_run"):
        from dflash.plan import measure

        return getattr(measure, name)
    raise AttributeError(f"module 'dflash.plan' has no attribute {name!r}")


__all__ = ["Inputs", "Layout", "Measured", "PlanError", "colocated", "from_run", "layouts"]
