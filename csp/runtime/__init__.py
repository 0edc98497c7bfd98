"""Running a graph: the runtime engine and its deadlock watch.

It imports the core, the graph and the stats writer and tracer of :mod:`csp.observe`; only
:mod:`csp.distributed` and the ``python -m csp.run`` entry module import it. ``csp.Runtime`` and
``csp.RunResult`` are the public names. This ``__init__`` imports nothing. Modules::

    engine.py      Runtime: one thread per blocking replica, bound to its device and its own CUDA
                   stream, one event loop for the async ones; structured stop, failure and abort;
                   exit codes
    worker.py      Worker: one replica's ends, state and statistics, and its setup, run, teardown
                   (in a thread on its device and stream, or as an async task)
    signals.py     SIGINT and SIGTERM: taken in the main thread, routed through the event loop,
                   logged, and the drain report of a graceful stop
    result.py      RunResult, the exit codes and the status a run's end gets
    deadlock.py    DeadlockWatch: names the cycle of processes when all wait on channels and
                   nothing moves
"""
