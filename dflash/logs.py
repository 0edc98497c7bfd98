"""``python -m dflash.logs``: runs :mod:`dflash.observe.logs` as the program (its ``--help`` answers
before torch is imported)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("dflash.observe.logs", run_name="__main__", alter_sys=True)
