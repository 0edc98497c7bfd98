"""One drafter training step and everything it is made of.

Owns the objective (:mod:`~dflash.train.objective`: anchors to blocks to the loss), the losses
(:mod:`~dflash.train.loss`, with the LM head computed in chunks by
:mod:`~dflash.train.chunked_head`), anchor sampling (:mod:`~dflash.train.anchors`), the step itself
(:mod:`~dflash.train.step`: forward, backward, clip, optimizer), the optimizer and schedule
(:mod:`~dflash.train.optim`), the trainer's resumable state (:mod:`~dflash.train.state`),
data-parallel helpers (:mod:`~dflash.train.parallel`), the non-finite guard
(:mod:`~dflash.train.nonfinite`) and channel sentinel (:mod:`~dflash.train.sentinel`), and the
simulated acceptance from per-position accuracy (:mod:`~dflash.train.acceptance`, which eval
reports too). Imports: :mod:`dflash.model`, :mod:`dflash.checkpoint` (the guard demotes a poisoned
checkpoint; the state is saved there), the leaf modules and csp; never :mod:`dflash.run`, so a step
can be driven by a benchmark or a test without the graph.
"""
