"""``python -m csp.graph GRAPH.toml -o graph.svg``: draw a graph file (see :mod:`csp.graph.draw`)."""

from csp.graph.draw import main

raise SystemExit(main())
