"""``python -m csp.graph GRAPH.toml -o graph.svg``: draw a graph file (see :mod:`csp.observe.draw`)."""

from csp.observe.draw import main

raise SystemExit(main())
