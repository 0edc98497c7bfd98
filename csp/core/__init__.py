"""The core of csp: channels and processes, what every other room is built on.

Owns the channel (:mod:`csp.core.channel`: the public send and receive ends; its shared state,
buffer cores and waiter queues are the private :mod:`~csp.core._state`, :mod:`~csp.core._cores`
and :mod:`~csp.core._waiting`), the statistics records every channel and process reports
(:mod:`csp.core.stats`), the process protocol and its per-replica context
(:mod:`csp.core.process`), and the registry that maps a graph file's ``kind`` strings to process
classes (:mod:`csp.core.registry`). It imports only :mod:`csp.errors` and :mod:`csp.cuda` (a
channel orders the tensors it carries across CUDA streams); every public name is re-exported by
``import csp``. This ``__init__`` imports nothing.
"""
