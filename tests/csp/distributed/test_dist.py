"""csp.distributed on CPU with gloo: graphs placed on 2-3 local ranks (subprocesses, loopback only).

Each test launches this file as a script once per rank (``python tests/csp/distributed/test_dist.py SCENARIO
OUT_DIR``) with the torchrun environment variables set by hand; every rank writes
``OUT_DIR/rank<r>.json`` and the test checks them. Every launch is bounded by a timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch

import csp

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.distributed


# ---- process kinds used by the scenarios ---------------------------------------------------------
class Item(msgspec.Struct):
    """``seq`` plus a tensor whose content is derived from ``seq`` (checked on arrival)."""

    seq: int
    data: torch.Tensor
    src: int = 0


def expected(seq: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(2, 3) + seq


class Source(csp.Process):
    class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        n: int = 10
        stamp: bool = False  # record the time each send returned

    outputs = {"out": Item}

    def run(self, inputs, outputs):
        out, times = outputs["out"], []
        for i in range(self.ctx.replica, self.options.n, self.ctx.replicas):
            out.send(Item(i, expected(i), self.ctx.replica), seq=i)
            times.append(time.monotonic())
        RESULTS[f"{self.ctx.qualname}.send_times"] = times
        RESULTS[f"{self.ctx.qualname}.blocked_s"] = out.blocked_s


class Relay(csp.Process):
    """Checks the tensor and forwards the item, keeping its seq (for ordered fan-in)."""

    class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        fail_after: int = -1  # raise ValueError after this many items (-1: never)
        fail_replica: int = -1  # ... in this replica only

    inputs = {"inp": Item}
    outputs = {"out": Item}

    def run(self, inputs, outputs):
        for k, item in enumerate(inputs["inp"]):
            if k == self.options.fail_after and self.ctx.replica == self.options.fail_replica:
                raise ValueError(f"boom in {self.ctx.qualname}")
            assert torch.equal(item.data, expected(item.seq)), item
            outputs["out"].send(Item(item.seq, item.data * 2, self.ctx.replica), seq=item.seq)


class Sink(csp.Process):
    class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        factor: float = 1.0
        delay_s: float = 0.0  # a slow consumer: seconds of "work" per item
        slow_replica: int = -1  # ... in this replica only (-1: every replica)

    inputs = {"inp": Item}

    def run(self, inputs, outputs):
        seqs, times, ok = [], [], True
        for item in inputs["inp"]:
            times.append(time.monotonic())
            seqs.append(item.seq)
            ok &= bool(torch.equal(item.data, expected(item.seq) * self.options.factor))
            if self.options.delay_s and self.options.slow_replica in (-1, self.ctx.replica):
                time.sleep(self.options.delay_s)
        RESULTS[f"{self.ctx.qualname}.seqs"] = seqs
        RESULTS[f"{self.ctx.qualname}.recv_times"] = times
        RESULTS[f"{self.ctx.qualname}.ok"] = ok


RESULTS: dict = {}


def graph_for(scenario: str) -> csp.Graph:
    g = csp.Graph()
    if scenario == "pipeline":  # src@0 -> relay[0..1]@1,2 (fan-out) -> ordered fan-in -> sink@0
        g.channel("a", capacity=4)
        g.channel("b", capacity=4, ordered=True)
        g.process("src", Source, outputs={"out": "a"}, options={"n": 60}, ranks=[0])
        g.process("relay", Relay, inputs={"inp": "a"}, outputs={"out": "b"}, replicas=2, ranks=[1, 2])
        g.process("sink", Sink, inputs={"inp": "b"}, options={"factor": 2.0}, ranks=[0])
    elif scenario == "fanin":  # src[0..2] on ranks 0,1,2 -> one sink on rank 1 (local + remote)
        g.channel("a", capacity=3)
        g.process("src", Source, outputs={"out": "a"}, replicas=3, options={"n": 45})
        g.process("sink", Sink, inputs={"inp": "a"}, ranks=[1])
    elif scenario == "backpressure":  # fast src@0 -> capacity 2 -> slow sink@1
        g.channel("a", capacity=2)
        g.process("src", Source, outputs={"out": "a"}, options={"n": 24, "stamp": True})
        g.process("sink", Sink, inputs={"inp": "a"}, options={"delay_s": 0.03}, ranks=[1])
    elif scenario == "deal":  # src@0 -> sink[0]@0 (local link, fast) and sink[1]@1 (slow)
        g.channel("a", capacity=2)
        g.process("src", Source, outputs={"out": "a"}, options={"n": 20}, ranks=[0])
        g.process("sink", Sink, inputs={"inp": "a"}, replicas=2, ranks=[0, 1],
                  options={"delay_s": 0.02, "slow_replica": 1})
    elif scenario == "failure":  # relay[1] on rank 1 raises after 3 items; ranks 0 and 2 wait on it
        g.channel("a", capacity=2)
        g.channel("b", capacity=2)
        g.process("src", Source, outputs={"out": "a"}, options={"n": 10_000}, ranks=[0])
        g.process("relay", Relay, inputs={"inp": "a"}, outputs={"out": "b"}, replicas=2, ranks=[2, 1],
                  options={"fail_after": 3, "fail_replica": 1})
        g.process("sink", Sink, inputs={"inp": "b"}, options={"factor": 2.0}, ranks=[2])
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    g.validate()
    return g


def child(scenario: str, out_dir: Path) -> None:
    from csp.distributed import launch

    result, rt = launch.run(graph_for(scenario), timeout_s=30)
    stats = {k: msgspec.structs.asdict(v) for k, v in rt.statistics()["channels"].items()}
    procs = {k: msgspec.structs.asdict(v) for k, v in rt.statistics()["processes"].items()}
    record = {"result": msgspec.structs.asdict(result), "results": RESULTS, "channels": stats,
              "processes": procs}
    (out_dir / f"rank{result.rank}.json").write_text(json.dumps(record))
    if result.error is not None:
        print(f"rank {result.rank}: error: {result.error}", file=sys.stderr)
        launch.hard_exit(result.exit_code)
    sys.exit(result.exit_code)


# ---- launching --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(scenario: str, world: int, out_dir: Path, timeout_s: float = 45.0,
                 script: str = __file__, args: tuple[str, ...] = ()) -> list[dict]:
    """Run ``script SCENARIO OUT_DIR *args`` on ``world`` local ranks (loopback rendezvous);
    returns per rank its exit code, stderr and ``OUT_DIR/rank<r>.json`` record."""
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, script, scenario, str(out_dir), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout_s
    out = []
    try:
        for r, p in enumerate(procs):
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            f = out_dir / f"rank{r}.json"
            out.append({"code": p.returncode, "stderr": err,
                        "record": json.loads(f.read_text()) if f.exists() else None})
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def _ok(runs: list[dict]) -> None:
    for r, run in enumerate(runs):
        assert run["code"] == 0, f"rank {r} exited {run['code']}:\n{run['stderr'][-3000:]}"


# ---- tests ------------------------------------------------------------------------------------
def test_cross_rank_pipeline_delivers_every_item_once_in_order(tmp_path):
    """Fan-out from rank 0 to relays on ranks 1 and 2, ordered fan-in back to rank 0: every item
    arrives exactly once, in seq order, with its tensor intact; statistics count it on rank 0."""
    runs = launch_ranks("pipeline", 3, tmp_path)
    _ok(runs)
    res = runs[0]["record"]["results"]
    assert res["sink[0].seqs"] == list(range(60))
    assert res["sink[0].ok"] is True
    b = runs[0]["record"]["channels"]["b"]
    assert b["items_moved"] == 60 and b["bytes_moved"] == 60 * 24
    assert b["open_send_ends"] == 0 and b["capacity"] == 4
    relayed = [runs[r]["record"]["processes"][f"relay[{r - 1}]"]["items_in"] for r in (1, 2)]
    assert sum(relayed) == 60  # each item went to exactly one relay
    for r in (1, 2):
        assert runs[r]["record"]["channels"]["a"]["items_moved"] == relayed[r - 1]


def test_fan_in_local_and_remote_senders_drain_before_end_of_stream(tmp_path):
    """Senders on ranks 0, 1 (local to the sink) and 2 close at different times; the sink sees
    EndOfStream only after all of them closed and every item arrived (drain semantics)."""
    runs = launch_ranks("fanin", 3, tmp_path)
    _ok(runs)
    seqs = runs[1]["record"]["results"]["sink[0].seqs"]
    assert sorted(seqs) == list(range(45))
    for rep in range(3):  # per sender, its items arrive in the order it sent them
        mine = [s for s in seqs if s % 3 == rep]
        assert mine == sorted(mine)


def test_backpressure_slow_receiver_blocks_sender_with_bounded_buffering(tmp_path):
    """A slow consumer on rank 1 makes the producer on rank 0 block: its blocked time shows in
    the statistics, and sends never run more than the link's credits ahead of the receives."""
    runs = launch_ranks("backpressure", 2, tmp_path)
    _ok(runs)
    send_t = runs[0]["record"]["results"]["src[0].send_times"]
    recv_t = runs[1]["record"]["results"]["sink[0].recv_times"]
    assert len(send_t) == len(recv_t) == 24
    credits = 2
    for k, t in enumerate(recv_t):
        done = sum(1 for s in send_t if s < t)
        assert done <= k + 1 + credits, (k, done)
    # 24 items x 30 ms of consumer work, at most ~3 buffered: the producer waited most of it. The
    # consumer's sleeps put a floor of ~0.6 s under the producer's sends (the credit check above is
    # causal, not timed); load only lengthens it, and the producer's own code per item is ~0.1 ms,
    # so 0.3 s is half the floor with a margin that load cannot eat.
    assert runs[0]["record"]["channels"]["a"]["send_blocked_s"] > 0.3
    assert runs[0]["record"]["processes"]["src[0]"]["blocked_output_s"] > 0.3
    assert runs[1]["record"]["channels"]["a"]["peak_fill"] <= credits


def test_fan_out_across_ranks_deals_items_in_turn(tmp_path):
    """Fan-out from rank 0 to a consumer on rank 0 (local link) and one on rank 1: the ranks get
    items in turn (0, 2, 4, ... and 1, 3, 5, ...), however fast each consumes. Data-parallel
    replicas in lockstep (DDP) rely on it: an unequal share left one replica waiting forever in
    a gradient all-reduce that the other never joined."""
    runs = launch_ranks("deal", 2, tmp_path)
    _ok(runs)
    assert runs[0]["record"]["results"]["sink[0].seqs"] == list(range(0, 20, 2))
    assert runs[1]["record"]["results"]["sink[1].seqs"] == list(range(1, 20, 2))


def test_failure_on_one_rank_stops_every_rank_naming_it(tmp_path):
    """relay[1] on rank 1 raises; ranks 0 and 2 (blocked on channels that cross to rank 1) stop
    with exit code 1 and an error that names rank 1 and the exception, in bounded time."""
    t0 = time.monotonic()
    runs = launch_ranks("failure", 3, tmp_path, timeout_s=40)
    assert time.monotonic() - t0 < 40
    for r, run in enumerate(runs):
        assert run["code"] == 1, f"rank {r} exited {run['code']}:\n{run['stderr'][-3000:]}"
        rec = run["record"]["result"]
        assert rec["failed_rank"] == 1 and rec["status"] == "failed", rec
        assert "rank 1" in rec["error"] and "boom in relay[1]" in rec["error"], rec["error"]


def test_torchrun_csp_run_matches_single_process(tmp_path):
    """``torchrun --nproc-per-node 2 -m csp.run examples/text_pipeline_dist.toml`` gives the same
    word counts as the same file run in one process (placement changes where, not what)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    dist_dir, single_dir = tmp_path / "dist", tmp_path / "single"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(port), "-m", "csp.run",
           str(ROOT / "examples/text_pipeline_dist.toml"), "--run-dir", str(dist_dir)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rank 0: completed" in p.stdout and "rank 1: completed" in p.stdout
    from csp.run import main

    assert main([str(ROOT / "examples/text_pipeline_dist.toml"), "--run-dir", str(single_dir), "-q"]) == 0
    got = json.loads((dist_dir / "rank1" / "textpipe" / "top_words.json").read_text())
    want = json.loads((single_dir / "textpipe" / "top_words.json").read_text())
    assert got == want and got["lines"] == 2000
    assert (dist_dir / "csp" / "stats.jsonl").exists() and (dist_dir / "rank1" / "csp" / "stats.jsonl").exists()


if __name__ == "__main__":
    child(sys.argv[1], Path(sys.argv[2]))
