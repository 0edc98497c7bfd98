"""A host lost mid-run, on the loopback: two torchrun "nodes" train the tiny dflash graph (one gloo
rank each, DDP drafters across the nodes); once a checkpoint exists every process of the node that
does not host the rendezvous store is SIGKILLed. The surviving node stops within a bounded time
with exit code 1 and one line naming the lost rank, and relaunching both nodes resumes from the
last checkpoint (the step the survivor's summary named) and finishes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from csp.distributed.control import PEER_TIMEOUT_S
from tests.dflash.run.test_dist import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(560)]
ROOT = Path(__file__).resolve().parents[3]
STEPS = 60
# How long the survivors may take: the heartbeat timeout (a rank silent that long is reported lost
# even when no socket error ever arrives), the abort's linger (csp.distributed.control.Control.linger, 5 s)
# and torchrun's agent tearing down. On the loopback the kill closes the sockets, so it is sooner.
STOP_BOUND_S = PEER_TIMEOUT_S + 5 + 25


def _cmd(run_dir: Path, cache: Path, port: int, is_host: bool) -> list[str]:
    sets = [f"run.out_dir={run_dir}", f"run.steps={STEPS}", "checkpoint.every=4", "checkpoint.keep_last=3",
            "monitor.wandb=disabled", "eval.every=0", "monitor.display=plain", "monitor.plot=false", "data.max_samples=120",
            "data.max_length=256", "data.tokens_per_batch=512", "data.packed_rows=2", "data.num_workers=1",
            f"data.cache_dir={cache}", "train.num_anchors=8", "process.drafter.replicas=2",
            "process.target.replicas=1", "monitor.window=1", "run.deterministic=true"]
    # is_host: which node serves the rendezvous store (on the loopback both could; the first to bind
    # would). The node killed is the other one, as when a worker host is lost and HOST0 survives.
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "dflash-host-lost",
            "--rdzv-conf", f"is_host={int(is_host)}", "--max-restarts", "0", "-m", "dflash.run",
            str(ROOT / "examples" / "dflash-tiny.toml"), *[x for s in sets for x in ("--set", s)], "--resume", "auto"]


def _start(run_dir: Path, cache: Path, logs: Path) -> list[subprocess.Popen]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    port = free_port()
    # own sessions: a node is its agent's process group plus its workers' (torchrun starts each
    # worker in a session of its own)
    procs = []
    for i in range(2):
        with open(logs / f"node{i}.log", "w") as f:  # the child keeps its own copy of the descriptor
            procs.append(subprocess.Popen(_cmd(run_dir, cache, port, is_host=i == 0), cwd=ROOT, env=env,
                                          start_new_session=True, stdout=f, stderr=subprocess.STDOUT))
    return procs


def _workers(agent: subprocess.Popen) -> dict[int, int]:
    """pid -> global RANK of the agent's worker processes."""
    out = {}
    for pid in Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split():
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        out[int(pid)] = next(int(e[5:]) for e in env if e.startswith(b"RANK="))
    return out


def _kill_node(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def _steps(ckpts: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in ckpts.glob("step_*") if p.is_dir())


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds torchrun's workers through /proc (Linux)")
def test_a_lost_host_stops_the_survivors_naming_it_and_the_run_resumes(tmp_path):
    """Invariant: losing a host never leaves the others hanging or starts the run over: the
    survivors exit 1 within STOP_BOUND_S naming the lost rank, and a relaunch continues from the
    last checkpoint's step."""
    run_dir, cache, logs = tmp_path / "run", tmp_path / "cache", tmp_path
    ckpts = run_dir / "checkpoints"
    procs = _start(run_dir, cache, logs)
    try:
        deadline = time.monotonic() + 300
        while not _steps(ckpts):
            assert all(p.poll() is None for p in procs), (logs / "node0.log").read_text()
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.1)
        survivor, lost = procs
        lost_ranks = sorted(_workers(lost).values())
        lost_pgids = [os.getpgid(pid) for pid in _workers(lost)]
        t_kill = time.monotonic()
        os.killpg(lost.pid, signal.SIGKILL)  # the agent, then every worker of that node
        for pg in lost_pgids:
            os.killpg(pg, signal.SIGKILL)
        lost.wait()
        try:
            rc = survivor.wait(timeout=STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the surviving node still runs {STOP_BOUND_S:g} s after the other was killed")
        stopped_s = time.monotonic() - t_kill
    finally:
        _kill_node(procs)
    out = (logs / "node0.log").read_text()
    assert rc == 1, out  # csp.runtime.engine.EXIT_FAILED, passed on by torchrun's agent
    assert stopped_s < STOP_BOUND_S
    survivor_rank = 1 - lost_ranks[0]
    errors = [ln for ln in out.splitlines() if ln.startswith(f"rank {survivor_rank}: error:")]
    assert len(errors) == 1 and f"rank {lost_ranks[0]}" in errors[0].removeprefix(f"rank {survivor_rank}:"), out
    # no storm: at most torchrun's own ChildFailedError report, and the failed stage's traceback when
    # the broken socket reached a stage (the DDP all-reduce) before the control plane stopped it
    assert out.count("Traceback") <= 2, out
    resume_line = next(ln for ln in out.splitlines() if ln.strip().startswith("# resume from step"))
    k = int(resume_line.split()[-1])
    assert k > 0 and k in _steps(ckpts)

    again = _start(run_dir, cache, logs)
    try:
        rcs = [p.wait(timeout=400) for p in again]
    except subprocess.TimeoutExpired:
        pytest.fail("the resumed run did not finish within 400 s")
    finally:
        _kill_node(again)
    out = (logs / "node0.log").read_text()
    assert rcs == [0, 0], out + (logs / "node1.log").read_text()
    assert f"RESUMING from step {k}:" in out
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "resume"] == [k]
    assert records[-1]["kind"] == "end" and records[-1]["status"] == "completed"
    assert _steps(ckpts)[-1] == STEPS
