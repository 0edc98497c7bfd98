"""``python -m dflash.eval CHECKPOINT ...``: see :mod:`dflash.eval.cli`.

``--help`` and usage errors answer before torch is imported (about 2 s); a Ctrl-C while torch
imports is one line and exit 130.
"""

import sys
import time

STARTED = time.perf_counter()  # --time-limit counts from here: loading the models is part of the run's time

from dflash.eval.args import INTERRUPTED, build_parser

build_parser().parse_args()
try:
    from dflash.import_noise import quiet_import_noise

    quiet_import_noise()  # torchao's and torch's import-time lines are not the evaluation's (dflash.import_noise)
    import torch  # noqa: F401

    from dflash.eval.cli import main
except KeyboardInterrupt:
    print(INTERRUPTED, file=sys.stderr)
    sys.exit(130)
sys.exit(main(started_at=STARTED))
