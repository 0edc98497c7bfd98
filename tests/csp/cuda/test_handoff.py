"""csp.cuda.handoff: the channel hand-off hooks, device moves and the pinned pool.

The CPU tests check the walk, the container rebuilding and the pool's bookkeeping; the tests
marked ``gpu`` check stream ordering and memory lifetime on a CUDA device (run on the H200).
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import msgspec
import pytest
import torch

import csp
from csp.cuda import handoff as ccuda

pytestmark = pytest.mark.timeout(60)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


class Pair(NamedTuple):
    x: torch.Tensor
    tag: str


class Item(msgspec.Struct, frozen=True):
    a: torch.Tensor
    rest: dict
    n: int = 0


# ---- CPU ------------------------------------------------------------------------------------------
def test_outbound_is_a_passthrough_for_items_without_cuda_tensors():
    item = Item(torch.ones(4), {"k": [torch.zeros(2)]})
    assert ccuda.outbound(item) == (16 + 8, item)
    assert ccuda.outbound(3) == (0, 3)
    assert ccuda.inbound(item) is item


def test_to_device_keeps_tensors_already_there_and_the_same_object():
    item = Item(torch.ones(2), {"k": (torch.zeros(1), "s")})
    assert ccuda.to_device(item, "cpu") is item


def test_to_device_rebuilds_structs_and_containers_around_moved_tensors():
    """Uses the meta device to exercise the rebuild path without a GPU."""
    item = Item(torch.ones(2), {"k": [Pair(torch.zeros(3), "p"), 5], "s": "text"}, n=7)
    moved = ccuda.to_device(item, "meta")
    assert type(moved) is Item and moved.n == 7
    assert moved.a.device.type == "meta" and moved.a.shape == (2,)
    pair = moved.rest["k"][0]
    assert type(pair) is Pair and pair.tag == "p" and pair.x.device.type == "meta"
    assert moved.rest["k"][1] == 5 and moved.rest["s"] == "text"
    assert item.a.device.type == "cpu"  # the original is untouched


def test_pinned_pool_reuses_bounds_and_waits():
    pool = ccuda.PinnedPool(max_bytes=1 << 18)  # 256 KiB
    a = pool.take(100)
    assert a.numel() == ccuda.PinnedPool.MIN_BYTES and a.dtype == torch.uint8
    pool.give(a)
    kept = pool.take(1000)  # held to the end of the test
    assert kept.data_ptr() == a.data_ptr()  # reused
    b = pool.take(1 << 17)
    assert pool.allocated == (1 << 16) + (1 << 17)
    with pytest.raises(ValueError, match="raise max_bytes"):
        pool.take((1 << 18) + 1)
    c = pool.take(1 << 16)
    assert pool.allocated == 1 << 18
    with pytest.raises(TimeoutError, match="not given back"):
        pool.take(1 << 16, timeout=0.01)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.take(1 << 16, timeout=10)))
    t.start()
    pool.give(c)  # wakes the waiting taker
    t.join(10)
    assert got and got[0].data_ptr() == c.data_ptr()
    pool.give(b)
    d = pool.take(1 << 17)  # same size as b: reused, no new allocation
    assert d.data_ptr() == b.data_ptr() and pool.allocated == 1 << 18
    pool.give(d)
    pool.give(got[0])
    # The whole pool is needed: free buffers of other sizes are dropped, but `kept` is still taken.
    with pytest.raises(TimeoutError):
        pool.take(1 << 18, timeout=0.01)
    assert pool.allocated == 1 << 16
    pool.give(kept)
    assert pool.take(1 << 18, timeout=1).numel() == 1 << 18


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
def test_handoff_orders_a_side_stream_producer_before_a_side_stream_consumer():
    """The consumer's stream waits for the producer's event: it reads finished data."""
    send, recv = csp.channel(torch.Tensor, capacity=2)
    n = 1 << 22
    out: list[float] = []

    def produce():
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda._sleep(50_000_000)  # keep the producer stream busy
            x = torch.full((n,), 3.0, device="cuda")
            send.send(x)

    def consume():
        with torch.cuda.stream(torch.cuda.Stream()):
            x = recv.receive()
            out.append(float(x.sum()))  # sum runs on the consumer stream, after the event

    threads = [threading.Thread(target=f) for f in (produce, consume)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == [3.0 * n]
    assert recv.statistics().bytes_moved == 4 * n


@pytest.mark.gpu
@needs_cuda
def test_handoff_keeps_producer_memory_alive_while_the_consumer_reads_it():
    """record_stream: the producer's freed block is not reused before the consumer's kernels ran."""
    send, recv = csp.channel(object, capacity=1)
    n = 1 << 24
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(producer):
        send.send({"x": torch.full((n,), 1.0, device="cuda")})
    with torch.cuda.stream(consumer):
        x = recv.receive()["x"]
        torch.cuda._sleep(100_000_000)  # the consumer reads late
        y = x * 2
        del x  # the consumer's last reference
    with torch.cuda.stream(producer):
        z = torch.full((n,), 7.0, device="cuda")  # would reuse the block without record_stream
    torch.cuda.synchronize()
    assert float(y.min()) == 2.0 and float(y.max()) == 2.0
    assert float(z.min()) == 7.0


@pytest.mark.gpu
@needs_cuda
def test_to_device_host_to_gpu_and_back():
    item = Item(torch.arange(10, dtype=torch.float32).pin_memory(), {"k": [torch.ones(3)]})
    on_gpu = ccuda.to_device(item, "cuda")
    assert on_gpu.a.is_cuda and on_gpu.rest["k"][0].is_cuda
    back = ccuda.to_device(on_gpu, "cpu")
    assert back.a.is_pinned() and torch.equal(back.a, item.a)
    copy_stream = torch.cuda.Stream()
    via_stream = ccuda.to_device(item, "cuda", stream=copy_stream)
    assert torch.equal(via_stream.a.cpu(), item.a)


@pytest.mark.gpu
@needs_two
def test_to_device_gpu_to_gpu_direct_and_staged_through_the_host():
    src = torch.randn(1 << 20, device="cuda:0")
    pool = ccuda.PinnedPool(max_bytes=1 << 24)
    direct = ccuda.to_device({"t": src}, "cuda:1")["t"]
    with torch.cuda.device(1), torch.cuda.stream(torch.cuda.Stream()):
        staged = ccuda.to_device({"t": src}, "cuda:1", via_host=True, pool=pool)["t"]
        same = torch.equal(staged.cpu(), src.cpu())
    assert direct.device.index == 1 and staged.device.index == 1
    assert torch.equal(direct.cpu(), src.cpu()) and same
    assert pool.allocated == 1 << 22
