"""The peers side by side: the field's public trainers (vLLM speculators 0.9, SpecForge 0.2) trained
on the same conversations, target, drafter shape and wall-clock budget as this project, then decoded
by the same decoders on the same held-out prompts (``run.py``, the recipe).

* ``run.py``: the recipe: ``python -m benchmarks.peers.run cache|train|eval|all OUT``;
* ``cache.py``: each peer's offline hidden-state cache, written by this project's target, and the
  drafter shape as a public-layout config;
* ``speculators_rows.py``: speculators' Arrow dataset (run by speculators' interpreter);
* ``specforge_config.py``: the config of SpecForge's offline DFlash run;
* ``convert.py``: a speculators checkpoint or a public-layout export -> a drafter directory
  ``dflash.eval`` reads;
* ``wheels.sh``: the wheels (each pinned) the GPU machine installs the peers from.
"""
