"""The graph file's ``[eval]`` table: real draft-and-verify tau on held-out prompts while training.

Every ``every`` steps the drafter stage puts a copy of its weights on its ``snapshots`` output and
goes on training; the ``dflash.evaluator`` process (:mod:`dflash.run.stages.evaluator`) decodes
the run's first ``prompts`` held-out conversations with those weights against its own copy of the
target and sends the measured tau to the monitor (``metrics.jsonl`` kind ``heldout``, wandb
``heldout/*``, the plot and the run summary). A snapshot that arrives while the evaluator is still
busy with the previous one is dropped (the step never waits; the log says so); the final weights
are always evaluated, unless the run is stopping
(:mod:`dflash.run.stages.evaluator`). ``python -m dflash.eval CHECKPOINT --data SOURCE`` measures the same figure
the same way: for a checkpoint in its run directory, with ``SOURCE`` the run's ``data.source``, it
decodes the same held-out prompts with this table's ``prompts``, ``max_new_tokens`` and
``max_prompt_tokens`` unless told otherwise, so on the final weights it reproduces the run's last
held-out tau. The defaults below are ``dflash.eval``'s own (:data:`DEFAULT_PROMPTS`,
:data:`DEFAULT_MAX_NEW_TOKENS`, :data:`DEFAULT_MAX_PROMPT_TOKENS`), so a run that leaves them out
measures what a plain ``dflash.eval`` does; ``examples/dflash-tiny.toml`` sets 64 tokens to fit a
CPU's time. ``max_busy`` caps the share of the run the evaluator spends decoding, and ``threads``
the CPU threads it decodes with.
"""

from __future__ import annotations

import math
from typing import Annotated

from msgspec import Meta

from dflash.errors import ConfigError
from dflash.tables import NonNegInt, PositiveInt, Table

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "DEFAULT_MAX_PROMPT_TOKENS", "DEFAULT_PROMPTS", "DEFAULT_THREADS",
           "EVALUATOR_KIND", "EvalSection", "check_eval"]

EVALUATOR_KIND = "dflash.evaluator"

DEFAULT_PROMPTS = 8
"""Held-out conversations decoded by default, by ``[eval]`` and by ``dflash.eval --data``."""
DEFAULT_MAX_NEW_TOKENS = 128
"""Tokens generated per prompt by default, by ``[eval]`` and by ``dflash.eval``."""
DEFAULT_MAX_PROMPT_TOKENS = 1024
"""Prompt tokens kept (the last ones) by default, by ``[eval]`` and by ``dflash.eval``."""
DEFAULT_THREADS = 1
"""torch CPU threads of a decode by default, in ``[eval]`` and ``dflash.eval --threads``: a batch-1
decode is launch-bound, and one thread per core made it up to 50x slower on a busy 2-core machine."""



class EvalSection(Table):
    """``[eval]``: held-out tau measured by real decoding while the drafter trains."""

    every: NonNegInt = 0
    """Steps between evaluations (and one of the final weights); 0 = off, even in a graph with an
    evaluator (--set eval.every=0). A positive value needs a process of kind "dflash.evaluator" fed
    by the drafter's snapshots output (examples/dflash-tiny.toml has one)."""
    prompts: PositiveInt = DEFAULT_PROMPTS
    """Held-out conversations decoded per evaluation (the first ones of the run's hold-out); what
    ``dflash.eval CHECKPOINT --data SOURCE`` decodes by default for this run too."""
    max_new_tokens: PositiveInt = DEFAULT_MAX_NEW_TOKENS
    """Tokens generated per prompt (dflash.eval's default too, and what it follows for this run's
    held-out prompts)."""
    max_prompt_tokens: PositiveInt = DEFAULT_MAX_PROMPT_TOKENS
    """Prompt tokens kept (the last ones), as dflash.eval keeps them."""
    temperature: float = 0.0
    """0: greedy only; > 0 also decodes sampled at this temperature and logs its tau."""
    seed: int = 0
    """Seed of the sampled decode (each evaluation starts from it)."""
    max_busy: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.05
    """The most of the run's wall time the evaluator may spend decoding (1 = no limit). A snapshot
    that arrives while the evaluations so far exceed this share is skipped (counted in the next
    record's ``skipped``); the final weights are evaluated whatever the share. It cannot bound the
    first evaluation: on one H200 with the shipped 7M target, every 200 steps, the run still cost
    7.8% of its tok/s, the first in-process evaluation taking 45 s beside training (3.6 s alone)."""
    isolate: bool = False
    """Decode in a child process of its own (``spawn``) instead of a thread of the training
    process: its own interpreter, so that the decode and the training thread's launches do not
    wait on each other's interpreter lock, which is what the in-process decode costs on a GPU. It
    costs a second CUDA context and a start-up of a few seconds (dflash.run.stages.heldout)."""
    tree_budget: NonNegInt = 0
    """> 0: decode every prompt once more under tree verification of this many draft tokens and
    log its tau beside the chain's (``tree_tau``; dflash.eval --tree-budget, the same decode; DFlash
    and DFlash2, whose tree is its backbone's; none for XPress). Greedy, eager; it adds about one
    chain decode's time to each evaluation. 0: off."""
    cuda_graphs: bool = True
    """With ``isolate`` on a CUDA device: decode through CUDA-graph replays of the target's and the
    drafter's fixed-shape steps, as ``dflash.eval`` does by default (the same tokens; 14x faster
    per prompt measured against SmolLM2-135M on one H100). Ignored on a CPU and by the in-process
    evaluator, which stays eager (dflash.run.stages.heldout says why)."""
    threads: NonNegInt = DEFAULT_THREADS
    """torch intra-op CPU threads the evaluator decodes with (0: torch's default, one per core). In
    the training process they are the evaluator thread's own: OpenMP keeps a thread count per
    thread, so the training threads keep theirs (dflash.run.stages.heldout); with ``isolate``, the
    child process's. 1, as ``dflash.eval --threads``: a batch-1 decode is launch-bound, and with
    one thread per core it fought the training threads for the cores (on 2 shared cores the final
    evaluation of a short CPU run took 14.9 s with 2 threads, 0.8 s with 1)."""


def check_eval(section: EvalSection, *, evaluators: int, holdout: int | None) -> None:
    """The ``[eval]`` table against the graph and the data.

    Args:
        evaluators: processes of kind :data:`EVALUATOR_KIND` in the graph.
        holdout: ``[data].holdout`` (None: the automatic hold-out, which is never 0).

    Raises:
        ConfigError: ``every > 0`` without an evaluator process, more than one evaluator, ``every > 0`` with ``data.holdout = 0``, or a temperature
            that is negative or not finite.
    """
    if section.every > 0 and evaluators == 0:
        raise ConfigError(
            f"eval.every = {section.every} but the graph has no process of kind '{EVALUATOR_KIND}': add "
            "[[channel]] name = \"snapshots\" and [[process]] kind = \"dflash.evaluator\" with inputs = "
            "{ snapshots = \"snapshots\" } and outputs = { metrics = \"metrics\" }, and outputs.snapshots = "
            "\"snapshots\" on the drafter (examples/dflash-tiny.toml has them), or set eval.every = 0")
    if evaluators > 1:
        raise ConfigError(f"the graph has {evaluators} '{EVALUATOR_KIND}' processes; one evaluates every snapshot")
    if section.every > 0 and holdout == 0:
        raise ConfigError(f"eval.every = {section.every} decodes held-out conversations, but data.holdout = 0 "
                          "holds none out: leave data.holdout out (automatic) or set it > 0, or set eval.every = 0")
    if not (math.isfinite(section.temperature) and section.temperature >= 0):
        raise ConfigError(f"eval.temperature = {section.temperature}: give a finite number >= 0 (0: greedy only)")
