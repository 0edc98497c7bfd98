"""Data-parallel training through csp channels on 2 gloo ranks (dflash.train.parallel helpers).

Graph (both ranks): ``shard[r] --batches (rank_local)--> trainer[r] --metrics (crosses)--> monitor``
on rank 0. ``trainer`` is a tiny ``nn.Linear`` wrapped in DDP over the trainer ranks; its step
draws noise from the global torch RNG, so per-rank RNG state matters for an exact resume. A run
of 6 steps is compared with 3 steps + checkpoint, then a resume for steps 4..6.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from torch import nn

import csp

try:
    from tests.csp.distributed.test_dist import _ok, launch_ranks
except ImportError:  # run as a script by a rank
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from tests.csp.distributed.test_dist import _ok, launch_ranks

pytestmark = pytest.mark.distributed
STEPS = 6
RESULTS: dict = {}


class Batch(msgspec.Struct):
    step: int  # 0-based
    x: torch.Tensor  # [8, 4] float32
    y: torch.Tensor  # [8, 1] float32


class Metric(msgspec.Struct):
    step: int
    replica: int
    loss: float


class Shard(csp.Process):
    """Replica r's deterministic share: the batch of (step, r) for step in [start, stop)."""

    class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        start: int = 0
        stop: int = STEPS

    outputs = {"batches": Batch}

    def run(self, inputs, outputs):
        w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        for step in range(self.options.start, self.options.stop):
            g = torch.Generator().manual_seed(1000 * step + self.ctx.replica)
            x = torch.randn(8, 4, generator=g)
            outputs["batches"].send(Batch(step, x, x @ w))


class Trainer(csp.Process):
    class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        ckpt: str = ""
        save_at: int = 0  # checkpoint after this step (1-based; 0 = never)
        resume_from: int = 0  # resume from the checkpoint of this step (0 = fresh)

    inputs = {"batches": Batch}
    outputs = {"metrics": Metric}

    def setup(self):
        from dflash.train import parallel

        torch.manual_seed(self.ctx.replica)  # different per replica: DDP must broadcast replica 0's
        model = nn.Linear(4, 1)
        self.opt_model = model
        ckpt, step = Path(self.options.ckpt), self.options.resume_from
        if step:
            model.load_state_dict(torch.load(ckpt / f"step_{step}" / "model.pt"))
        self.model = parallel.wrap(model, self.ctx)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        if step:
            state = parallel.load_rank_state(ckpt, step, self.ctx)
            self.opt.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"])

    def run(self, inputs, outputs):
        from dflash.train import parallel

        for b in inputs["batches"]:
            pred = self.model(b.x)
            noise = 0.01 * torch.randn_like(b.y)  # per-rank RNG stream
            loss = ((pred - b.y - noise) ** 2).mean()
            loss.backward()  # DDP: gradients averaged over the 2 ranks here
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            step = b.step + 1
            outputs["metrics"].send(Metric(step, self.ctx.replica, float(loss)))
            if step == self.options.save_at:
                ckpt = Path(self.options.ckpt)
                if parallel.is_writer(self.ctx):
                    (ckpt / f"step_{step}").mkdir(parents=True, exist_ok=True)
                    torch.save(parallel.unwrap(self.model).state_dict(), ckpt / f"step_{step}" / "model.pt")
                parallel.save_rank_state(ckpt, step, self.ctx, {"optimizer": self.opt.state_dict(),
                                                               "rng": torch.get_rng_state()})
        m = parallel.unwrap(self.model)
        RESULTS["params"] = torch.cat([p.detach().flatten() for p in m.parameters()]).tolist()
        st = self.opt.state_dict()["state"]
        RESULTS["exp_avg_sq"] = torch.cat([st[k]["exp_avg_sq"].flatten() for k in sorted(st)]).tolist()
        RESULTS["rng"] = torch.get_rng_state()[:64].tolist()


class Monitor(csp.Process):
    inputs = {"metrics": Metric}

    def run(self, inputs, outputs):
        RESULTS["metrics"] = sorted((m.step, m.replica) for m in inputs["metrics"])


def graph_for(scenario: str, ckpt: str) -> csp.Graph:
    start, stop, save_at, resume = {"full": (0, STEPS, 0, 0), "first": (0, 3, 3, 0),
                                    "resume": (3, STEPS, 0, 3)}[scenario]
    g = csp.Graph()
    g.channel("batches", capacity=2, rank_local=True)
    g.channel("metrics", capacity=4)
    g.process("shard", Shard, outputs={"batches": "batches"}, replicas=2, ranks=[0, 1],
              options={"start": start, "stop": stop})
    g.process("trainer", Trainer, inputs={"batches": "batches"}, outputs={"metrics": "metrics"},
              replicas=2, ranks=[0, 1], options={"ckpt": ckpt, "save_at": save_at, "resume_from": resume})
    g.process("monitor", Monitor, inputs={"metrics": "metrics"}, ranks=[0])
    g.validate()
    return g


def child(scenario: str, out_dir: Path, ckpt: str) -> None:
    from csp.distributed import launch

    result, _ = launch.run(graph_for(scenario, ckpt), timeout_s=30)
    record = {"result": msgspec.structs.asdict(result), "results": RESULTS}
    (out_dir / f"rank{result.rank}.json").write_text(json.dumps(record))
    if result.error is not None:
        print(f"rank {result.rank}: error: {result.error}", file=sys.stderr)
        launch.hard_exit(result.exit_code)
    sys.exit(result.exit_code)


def test_ddp_through_channels_checkpoint_and_resume_match_uninterrupted(tmp_path):
    """Two DDP replicas fed through csp channels: replicas stay identical, and 3 steps +
    checkpoint + resume for 3 more give the same weights, optimizer moments and per-rank RNG
    state on both ranks as 6 uninterrupted steps. Protects the per-rank checkpoint contract of
    dflash.train.parallel."""
    ckpt = tmp_path / "ckpt"
    runs = {}
    for scenario in ("full", "first", "resume"):
        out = tmp_path / scenario
        out.mkdir()
        runs[scenario] = launch_ranks(scenario, 2, out, script=__file__, args=(str(ckpt),))
        _ok(runs[scenario])
    full = [r["record"]["results"] for r in runs["full"]]
    resumed = [r["record"]["results"] for r in runs["resume"]]
    assert full[0]["params"] == full[1]["params"]  # DDP replicas
    assert full[0]["exp_avg_sq"] == full[1]["exp_avg_sq"]
    assert full[0]["rng"] != full[1]["rng"]  # per-rank RNG streams differ...
    for r in (0, 1):  # ...and each one resumes exactly
        for key in ("params", "exp_avg_sq", "rng"):
            assert torch.allclose(torch.tensor(resumed[r][key], dtype=torch.float64),
                                  torch.tensor(full[r][key], dtype=torch.float64), rtol=0, atol=1e-7), key
    want = [(s, r) for s in range(1, STEPS + 1) for r in (0, 1)]  # both ranks' metrics, via rank 0
    assert [tuple(m) for m in full[0]["metrics"]] == want
    assert (ckpt / "rank_state" / "step_00000003.rank1.pt").exists()


if __name__ == "__main__":
    child(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
