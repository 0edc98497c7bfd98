"""``python -m dflash.plan``: see :mod:`dflash.plan.cli`."""

import sys

from dflash.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
