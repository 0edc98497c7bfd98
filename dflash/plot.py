"""``python -m dflash.plot``: runs :mod:`dflash.observe.plot` as the program (its ``--help`` answers
before torch is imported)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("dflash.observe.plot", run_name="__main__", alter_sys=True)
