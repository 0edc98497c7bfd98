"""One drafter training step and everything it is made of.

Imports: :mod:`dflash.model`, :mod:`dflash.checkpoint` (the guard demotes a poisoned checkpoint;
the state is saved there), the leaf modules and csp; never :mod:`dflash.run`, so a step can be
driven by a benchmark or a test without the graph. Modules::

    config.py          the [train] table and its checks against the loss, the drafter and the devices
    step.py            one step, top to bottom: loss, backward, clip, one host read, update
    objective.py       features -> loss: anchors to blocks to labels, the one call a step makes
    anchors.py         anchor sampling: where the training blocks of each packed row start
    loss.py            the losses: hard cross-entropy, soft KL and TV, confidence, position weights
    chunked_head.py    the LM head and per-slot loss in chunks, never the whole [M, V] logits
    liger_head.py      the LM head and hard cross-entropy fused by Liger-Kernel
    selector_loss.py   DFlash2's selector loss, and whether the selector earns its place
    xpress_loss.py     XPress's refiner loss: on true predecessors and on its own Jacobi passes
    acceptance.py      acceptance maths: per-position accuracy, accepted length, streaks, tau
    optim.py           the optimizer (AdamW, or Muon for the matrices) and the lr schedule
    budget.py          [run].time_budget_s: a schedule that ends on the wall clock
    nonfinite.py       the non-finite skip policy of a step
    sentinel.py        the non-finite check at channel boundaries ([train].check_channels)
    state.py           the training state around the weights: restore, the checkpoint window
    parallel.py        data-parallel drafter replicas on torch.distributed (DDP), their checkpoints
"""
