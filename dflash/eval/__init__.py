"""``python -m dflash.eval``: a trained drafter measured by real draft-and-verify decoding.

Owns the command line (:mod:`~dflash.eval.cli`, its parser in :mod:`~dflash.eval.args` and its
input checks in :mod:`~dflash.eval.inputs`), the decode loops (:mod:`~dflash.eval.decode`: greedy
and draft-and-verify, the proposers), the measurement (:mod:`~dflash.eval.measure`: decode, then
score the same text teacher-forced, time it against the target alone), the evaluation sets
(:mod:`~dflash.eval.sets`, later turns in :mod:`~dflash.eval.turns`), the 8B-class projection
(:mod:`~dflash.eval.projection`) and the printed result (:mod:`~dflash.eval.report`). Imports:
:mod:`dflash.model`, :mod:`dflash.data` (prompts built as training builds contexts),
:mod:`dflash.checkpoint` (the drafter on disk), :mod:`dflash.train.acceptance` and
:mod:`dflash.observe.runlog`; never :mod:`dflash.run`. This ``__init__`` imports nothing, so
``--help`` answers before torch loads.
"""
