"""``python -m dflash.export``: see :mod:`dflash.export.cli`.

``--help`` and usage errors answer before torch is imported (about 2 s); a Ctrl-C while torch
imports is one line, exit 130, not a traceback.
"""

import sys

from dflash.export.cli import build_parser

_args = build_parser().parse_args()
try:
    import torch  # noqa: F401

    import dflash.export.write  # noqa: F401
except KeyboardInterrupt:
    print(f"dflash.export: interrupted (Ctrl-C); nothing was written to {_args.out}", file=sys.stderr)
    raise SystemExit(130) from None

from dflash.export.cli import main  # noqa: E402

sys.exit(main())
