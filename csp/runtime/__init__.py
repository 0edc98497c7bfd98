"""Running a graph: the runtime engine and its deadlock watch.

Owns :mod:`csp.runtime.engine` (:class:`~csp.runtime.engine.Runtime`: one thread per blocking
replica, bound to its device and its own CUDA stream, one event loop for the async ones;
structured stop, failure and abort; exit codes) and :mod:`csp.runtime.deadlock` (the watch that
names a cycle of processes all waiting on channels). It imports the core, the graph and the
stats writer and tracer of :mod:`csp.observe`; only :mod:`csp.distributed` and the ``python -m csp.run``
entry module import it. ``csp.Runtime`` and ``csp.RunResult`` are the public names. This
``__init__`` imports nothing.
"""
