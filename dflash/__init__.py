"""DFlash block-diffusion drafter training, expressed as a csp process graph.

The commands (each ``python -m dflash.X``): ``run`` (train from a graph file), ``eval`` (measure a
checkpoint by real draft-and-verify decoding), ``export`` (the public DFlash layout), ``logs`` and
``plot`` (read a run directory), ``regenerate`` (answer the data with the target), ``pretrain``
(train a small target).

The rooms, from the bottom floor up; a module imports its own room and lower floors only
(``tests/test_layering.py`` checks it; ``docs/architecture.md`` draws it):

0. leaves: :mod:`dflash.errors` (the error family), :mod:`dflash.messages` (the items on the
   graph's channels), :mod:`dflash.records` (the lines of ``metrics.jsonl``), :mod:`dflash.seeding`
   (every random stream's seed), :mod:`dflash.import_noise` (other packages' import-time log lines),
   :mod:`dflash.tables` (what every config table shares: strict keys, the late-added key mark),
   :mod:`dflash.gguf_tokenizer` (a GGUF file's metadata and tokenizer, checked for the import),
   :mod:`dflash.repetition` (where an answer falls into a repetition loop: the data, regeneration
   and the evaluation count loops by one rule);
1. :mod:`dflash.data` (conversations to packed token batches) and :mod:`dflash.model` (the target,
   the drafter, their shared head and features);
2. :mod:`dflash.checkpoint` (everything a run keeps on disk, written and read) and
   :mod:`dflash.regenerate_files` (the files regeneration writes and resumes from),
   :mod:`dflash.regenerate_plan` (its engine, rows and chunk sizes, a deadline's among them);
3. :mod:`dflash.train` (the objective, the losses, one step) and :mod:`dflash.observe` (what an
   operator reads: display, run log, metrics, logs, plot, summary);
4. :mod:`dflash.eval` (decoding a drafter against its target, the evaluation sets);
5. :mod:`dflash.run` (the graph file to a running graph; the stages, the in-training evaluator
   among them);
6. the tools: :mod:`dflash.export`, :mod:`dflash.regenerate`, :mod:`dflash.pretrain`,
   :mod:`dflash.import_gguf` (a GGUF target to a local directory), :mod:`dflash.plan` (the layout
   for N GPUs, from a run's measurements), and the thin entry modules ``dflash.logs`` and
   ``dflash.plot``.

Where to look first: the loss is :mod:`dflash.train.objective` (blocks and labels) and
:mod:`dflash.train.loss`; a checkpoint is written by :mod:`dflash.checkpoint.writer`; what
``dflash.run`` does first, and in what order, is :func:`dflash.run.cli.main`.
"""

from pathlib import Path as _Path

from csp._guard import check as _check_owner

__version__ = "0.1.0"
_check_owner("dflash", _Path(__file__).parent)  # PyPI's upstream 'dflash' mixed in: one line, exit 1
