"""``python -m csp.graph GRAPH.toml -o graph.svg``: draw a graph file (see :mod:`csp.draw`)."""

from csp.draw import main

raise SystemExit(main())
