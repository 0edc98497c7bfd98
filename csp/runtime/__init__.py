"""Running a graph: the runtime engine and its deadlock watch.

It imports the core, the graph and the stats writer and tracer of :mod:`csp.observe`; only
:mod:`csp.distributed` and the ``python -m csp.run`` entry module import it. ``csp.Runtime`` and
``csp.RunResult`` are the public names. This ``__init__`` imports nothing. Modules::

    engine.py      Runtime: one thread per blocking replica, bound to its device and its own CUDA
                   stream, one event loop for the async ones; structured stop, failure and abort;
                   exit codes
    deadlock.py    DeadlockWatch: names the cycle of processes when all wait on channels and
                   nothing moves
"""
