"""Acceptance of trained drafters against the shipped target (dflash/assets/target-sharegpt-7m),
on held-out prompts, each recipe one device call per phase:

* ``headline.py``: the fixed-budget run (regenerate, probe, train, eval cost, variants, eval sets);
* ``frontier.py``: drafter variants at equal steps, side by side;
* ``labels.py``: label strategies at equal steps, longer runs, one variant at a time;
* ``prompts.py``: the held-out prompts every recipe decodes.
"""
