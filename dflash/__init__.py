"""DFlash block-diffusion drafter training, expressed as a csp process graph.

Entry points: ``python -m dflash.run GRAPH.toml``, ``python -m dflash.eval``,
``python -m dflash.export``, ``python -m dflash.logs``.
"""

__version__ = "0.1.0"
