"""``python -m dflash.run GRAPH.toml``: see :mod:`dflash.run.cli`.

``--help`` and usage errors answer before torch is imported (about 3 s); a Ctrl-C while torch and
transformers import is one line and exit 130, like a Ctrl-C anywhere else before training. A run
left with a stuck stage thread (exit 3) leaves at once, without the interpreter's shutdown.
"""

import sys

from dflash.run.args import INTERRUPTED_STARTING, build_parser

build_parser().parse_args()
try:
    from dflash.import_noise import quiet_import_noise

    quiet_import_noise()  # torchao's and torch's import-time lines are not the run's (dflash.import_noise)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from csp.distributed import hard_exit
    from csp.runtime.engine import EXIT_STUCK
    from dflash.run.cli import main
except KeyboardInterrupt:
    print(INTERRUPTED_STARTING, file=sys.stderr)
    sys.exit(130)
code = main()
if code == EXIT_STUCK:
    # a stage thread still runs (inside a torch op): the interpreter's shutdown would abort in C++
    # ("terminate called without an active exception", SIGABRT, exit 134) instead of exiting 3
    hard_exit(code)
sys.exit(code)
