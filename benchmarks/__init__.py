"""Reproducible measurements, in rooms; each script runs directly (``python benchmarks/ROOM/NAME.py``)
or as a module (``python -m benchmarks.ROOM.NAME``) from the repository root.

* ``h200/``: the stage and pipeline rates on H200s (``perf.sh`` runs a suite in one device call),
  MFU accounting (``flops.py``), the results file and its picture;
* ``micro/``: small measurements that run anywhere: channels, batching, tokenizing, the CUDA
  hand-off races, the non-finite sentinel, one DFlash2 step, NCCL across ranks;
* ``decode/``: batch-1 decode speed and its projection to real target sizes;
* ``quality/``: acceptance of trained drafters against the shipped target (shell recipes);
* ``plan/``: ``dflash.plan``'s layouts on paper;
* ``peers/``: the public trainers (vLLM speculators) trained beside this project on the same data,
  target, drafter shape and budget, and decoded by the same decoders (``run.sh``).

Measured data lives under ``results/``; ``RESULTS.md`` is the index of today's figures and
``results/LOG.md`` the dated log behind it. A benchmark uses only public names of ``csp`` and
``dflash``. A regular package (not a namespace one) so ``benchmarks.*`` always resolves to this
directory when the repository root is on ``sys.path``, whatever else is installed.
"""
