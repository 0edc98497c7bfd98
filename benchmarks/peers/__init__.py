"""The peers side by side: the field's public trainers (vLLM speculators 0.9) trained on the same
conversations, target, drafter shape and wall-clock budget as this project, then decoded by the same
decoders on the same held-out prompts (``run.sh``).

* ``speculators_cache.py``: speculators' hidden-state cache, written by this project's target;
* ``speculators_rows.py``: its Arrow dataset (run by speculators' interpreter);
* ``from_speculators.py``: a speculators checkpoint -> a drafter directory ``dflash.eval`` reads;
* ``wheels.sh``: the wheels the GPU machine installs speculators from.
"""
