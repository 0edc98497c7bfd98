"""What the end-to-end recipes share (``quality/headline.py``, ``quality/frontier.py``,
``quality/labels.py``, ``peers/run.py``, ``h200/suite.py``), written once:

* ``step.py``: a command run with its log and a wall-clock cap (the stop signal, then a kill);
* ``metrics.py``: a run's ``metrics.jsonl`` read back: the steady tok/s (median of the train windows
  after the first two), the last step, the training seconds, the newest checkpoint;
* ``carry.py``: what a device call carries: wheels installed onto the path, gzipped data, the
  held-out prompts, a checkpoint cut into parts and joined again;
* ``report.py``: results files (JSON), the fields a recipe quotes, the listing of its output;
* ``cli.py``: the recipes' command line: phases as subcommands, typed options with their defaults,
  ``--set`` passed through, the exit codes.

A recipe module reads top to bottom as the list of commands a person would type; the measuring
lives in the modules it runs (``dflash.run``, ``dflash.eval``, ``benchmarks/h200/perf.py`` ...).
"""
