"""``python -m dflash.run GRAPH.toml``: see :mod:`dflash.run.cli`.

``--help`` and usage errors answer before torch is imported (about 3 s); a Ctrl-C while torch and
transformers import is one line and exit 130, like a Ctrl-C anywhere else before training.
"""

import sys

from dflash.run.args import INTERRUPTED_STARTING, build_parser

build_parser().parse_args()
try:
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from dflash.run.cli import main
except KeyboardInterrupt:
    print(INTERRUPTED_STARTING, file=sys.stderr)
    sys.exit(130)
sys.exit(main())
