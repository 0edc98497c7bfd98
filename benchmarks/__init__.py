"""Reproducible measurements, in rooms; each runs as a module (``python -m benchmarks.ROOM.NAME``) from
the repository root, and most of the h200 and micro scripts also directly (``python benchmarks/ROOM/NAME.py``).

* ``h200/``: the stage and pipeline rates on H200s (``suite.py`` runs a suite in one device call),
  MFU accounting (``flops.py``), the results file and its picture;
* ``micro/``: small measurements that run anywhere: channels, batching, tokenizing, the CUDA
  hand-off races, the non-finite sentinel, one DFlash2 step, NCCL across ranks;
* ``decode/``: batch-1 decode speed and its projection to real target sizes;
* ``quality/``: acceptance of trained drafters against the shipped target (``headline.py``,
  ``frontier.py``, ``labels.py``: recipes with one subcommand per phase);
* ``plan/``: ``dflash.plan``'s layouts on paper;
* ``peers/``: the public trainers (vLLM speculators) trained beside this project on the same data,
  target, drafter shape and budget, and decoded by the same decoders (``run.py``);
* ``real_target/``: SmolLM2-135M-Instruct end to end, one short shell step per device call;
* ``recipe/``: what the end-to-end recipes share: steps with a wall-clock cap and a log, a run's
  metrics read back (the median tok/s after the first two windows), carried wheels and files,
  results files, their command line.

An end-to-end recipe runs as ``python -m benchmarks.ROOM.NAME PHASE OUT [options]`` (``--help``
lists the phases and every option with its default). Measured data lives under ``results/``;
``RESULTS.md`` is the index of today's figures and ``results/LOG.md`` the dated log behind it. A benchmark uses only public names of ``csp`` and
``dflash``. A regular package (not a namespace one) so ``benchmarks.*`` always resolves to this
directory when the repository root is on ``sys.path``, whatever else is installed.
"""
