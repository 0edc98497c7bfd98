"""Channel throughput and latency: csp vs queue.Queue vs anyio memory streams vs deque+Condition.

Run from the repository root (about 30-60 s on a 2-core machine)::

    python benchmarks/micro/channels.py [--items 100000] [--capacity 128] [--pings 2000]

Writes ``benchmarks/results/channels.json``::

    {"command": "...", "results": [{"impl", "mode", "items_per_s", "p50_us", "p99_us"}, ...]}

What is measured, per implementation and mode ("thread": one producer OS thread, one consumer OS
thread; "async": two anyio tasks on the asyncio backend):

* ``items_per_s``: a producer pushes ``--items`` small ints through a channel of ``--capacity``
  slots to a consumer; best of ``--repeats`` runs (best, not mean: the machine is shared, and the
  slowest runs measure the neighbours). ``1e6 / items_per_s`` is the per-item cost in us.
* ``p50_us`` / ``p99_us``: one-way hand-off latency of a single item into an idle channel whose
  receiver is already waiting (so it includes the wake-up of the blocked receiver): ping-pong over
  two channels of the same implementation, ``--pings`` round trips, timing only the ping leg
  (``perf_counter`` at the send call to the return of the receive).

queue.Queue and deque+Condition have no async form and anyio memory streams are not thread-safe,
so those combinations are not measured rather than measured unfairly.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import csp  # noqa: E402

_END = None  # end-of-stream sentinel for the implementations without close semantics


class DequeChannel:
    """The baseline: a bounded deque guarded by one lock and two conditions."""

    def __init__(self, capacity: int) -> None:
        self.items: deque = deque()
        self.capacity = capacity
        lock = threading.Lock()
        self.not_empty = threading.Condition(lock)
        self.not_full = threading.Condition(lock)

    def put(self, item) -> None:
        with self.not_full:
            while len(self.items) >= self.capacity:
                self.not_full.wait()
            self.items.append(item)
            self.not_empty.notify()

    def get(self):
        with self.not_empty:
            while not self.items:
                self.not_empty.wait()
            item = self.items.popleft()
            self.not_full.notify()
            return item


# ---- thread mode: each factory gives (put, get, finish) ---------------------------------------
def _csp_thread(capacity):
    send, recv = csp.channel(object, capacity=capacity)
    return send.send, recv.receive, send.close, recv


def _queue_thread(capacity):
    import queue

    q = queue.Queue(maxsize=capacity)
    return q.put, q.get, lambda: q.put(_END), None


def _deque_thread(capacity):
    q = DequeChannel(capacity)
    return q.put, q.get, lambda: q.put(_END), None


THREAD_IMPLS = {"csp": _csp_thread, "queue.Queue": _queue_thread, "deque": _deque_thread}


def thread_throughput(factory, items: int, capacity: int) -> float:
    put, get, finish, recv = factory(capacity)

    def produce():
        for i in range(items):
            put(i)
        finish()

    t = threading.Thread(target=produce)
    start = time.perf_counter()
    t.start()
    n = 0
    if recv is not None:  # csp: iterate to end of stream
        for _ in recv:
            n += 1
    else:
        while get() is not _END:
            n += 1
    elapsed = time.perf_counter() - start
    t.join()
    assert n == items, (n, items)
    return items / elapsed


def thread_latency(factory, pings: int) -> list[float]:
    put1, get1, _, _ = factory(1)
    put2, get2, _, _ = factory(1)
    lat: list[float] = []

    def echo():
        for _ in range(pings):
            t_sent = get1()
            lat.append(time.perf_counter() - t_sent)
            put2(None)

    t = threading.Thread(target=echo)
    t.start()
    for _ in range(pings):
        put1(time.perf_counter())
        get2()
    t.join()
    return lat


# ---- async mode ---------------------------------------------------------------------------------
def _csp_async(capacity):
    send, recv = csp.channel(object, capacity=capacity)
    return send.asend, recv.areceive, send.close


def _anyio_async(capacity):
    send, recv = anyio.create_memory_object_stream(capacity)

    async def receive():
        try:
            return await recv.receive()
        except anyio.EndOfStream:
            return _END

    return send.send, receive, send.close


ASYNC_IMPLS = {"csp": _csp_async, "anyio": _anyio_async}


async def async_throughput(factory, items: int, capacity: int) -> float:
    put, get, finish = factory(capacity)
    got = 0

    async def consume():
        nonlocal got
        while True:
            try:
                await get()
            except csp.EndOfStream:
                return
            got += 1
            if got == items:
                return

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        for i in range(items):
            await put(i)
        finish()
    elapsed = time.perf_counter() - start
    assert got == items
    return items / elapsed


async def async_latency(factory, pings: int) -> list[float]:
    put1, get1, _ = factory(1)
    put2, get2, _ = factory(1)
    lat: list[float] = []

    async def echo():
        for _ in range(pings):
            t_sent = await get1()
            lat.append(time.perf_counter() - t_sent)
            await put2(None)

    async with anyio.create_task_group() as tg:
        tg.start_soon(echo)
        for _ in range(pings):
            await put1(time.perf_counter())
            await get2()
    return lat


def _row(impl: str, mode: str, rates: list[float], lat: list[float]) -> dict:
    lat_us = sorted(x * 1e6 for x in lat)
    return {
        "impl": impl,
        "mode": mode,
        "items_per_s": round(max(rates), 1),
        "p50_us": round(statistics.median(lat_us), 2),
        "p99_us": round(lat_us[min(len(lat_us) - 1, int(0.99 * len(lat_us)))], 2),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", type=int, default=100_000, help="items per throughput run")
    p.add_argument("--capacity", type=int, default=128, help="channel capacity in items")
    p.add_argument("--pings", type=int, default=2000, help="round trips for latency")
    p.add_argument("--repeats", type=int, default=3, help="throughput runs (best is kept)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/channels.json"))
    args = p.parse_args(argv)

    results = []
    for impl, factory in THREAD_IMPLS.items():
        rates = [thread_throughput(factory, args.items, args.capacity) for _ in range(args.repeats)]
        results.append(_row(impl, "thread", rates, thread_latency(factory, args.pings)))
        print(results[-1], flush=True)
    for impl, factory in ASYNC_IMPLS.items():
        rates = [
            anyio.run(async_throughput, factory, args.items, args.capacity)
            for _ in range(args.repeats)
        ]
        results.append(_row(impl, "async", rates, anyio.run(async_latency, factory, args.pings)))
        print(results[-1], flush=True)

    command = "python benchmarks/micro/channels.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": command.strip(), "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
