"""Reproducible measurements; each ``bench_*.py`` script runs directly (``python benchmarks/NAME.py``).

A regular package (not a namespace one) so ``benchmarks.h200_*`` helpers always resolve to this
directory when the repository root is on ``sys.path``, whatever else is installed.
"""
