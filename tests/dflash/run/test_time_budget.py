"""``[run].time_budget_s`` end to end: the tiny preset trains against an injected clock, so where the
budget ends the run is decided by steps, not by how loaded the machine is."""

from __future__ import annotations

from pathlib import Path

import pytest

import dflash.run.cli as cli
from dflash.checkpoint import is_healthy, list_checkpoints, read_meta
from dflash.run.cli import main
from dflash.run.config import load_config
from dflash.run.validate import check_time_budget
from dflash.train.optim import Schedule
from tests.dflash.run.test_run_e2e import GRAPH, records, small


class StepClock:
    """One second per read: the drafter stage reads the budget's clock once before its first step
    and once after each step, so step s ends at second s."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture
def step_clock(monkeypatch) -> StepClock:
    clock, prepare = StepClock(), cli.prepare

    def with_clock(*args, **kwargs):
        app = prepare(*args, **kwargs)
        app.clock = clock
        return app

    monkeypatch.setattr(cli, "prepare", with_clock)
    return clock


def test_a_budget_ends_the_schedule_and_the_run_as_completed(tmp_path, cache_dir, step_clock, capfd):
    """The budget's deadline, not run.steps, ends training: exit 0, a final healthy checkpoint at the
    step reached, the lr at its floor there, the data after it untouched, and the summary says so."""
    run = tmp_path / "run"
    args = small(run, cache_dir, "run.time_budget_s=10", "train.warmup_steps=2", "checkpoint.every=0", steps=40)
    assert main(args) == 0
    out = capfd.readouterr()
    text = out.out + out.err
    train = {r["step"]: r for r in records(run, "train")}
    # rate measured from step 4 on (a tenth of run.steps), one step a second: step 10 ends at the deadline
    assert max(train) == 10 and sorted(train) == list(range(1, 11))
    ckpts = list_checkpoints(run / "checkpoints")
    assert [read_meta(c)["step"] for c in ckpts] == [10] and is_healthy(ckpts[0])
    lr = 3e-3
    # steps 1..6 follow the run.steps cosine (the rate is known after step 5, and the lr of a step is
    # set after the one before); from step 7 on the cosine ends at step 10
    assert train[5]["lr"] == pytest.approx(lr * Schedule(2, 40, 0.1)(4))
    assert train[10]["lr"] == pytest.approx(lr * Schedule(2, 10, 0.1)(9))
    assert train[10]["lr"] < lr * 0.15  # the floor is min_lr_ratio * lr = 3e-4
    assert records(run, "end")[-1]["exit_code"] == 0
    assert "time budget 10 s: the schedule's end follows the measured step rate" in text
    assert "stopped at the time budget (10 s): 10 steps (run.steps 40)" in text
    assert "final checkpoint" in text.split("run summary:")[1]
    # the progress line counts to where the schedule ends, not to run.steps
    log = (run / "run.log").read_text()
    assert "step 4/40 10.0%" in log and "step 5/10 50.0%" in log and "step 10/10 100.0%" in log


def test_a_budget_longer_than_run_steps_ends_at_run_steps(tmp_path, cache_dir, step_clock, capfd):
    run = tmp_path / "run"
    assert main(small(run, cache_dir, "run.time_budget_s=1000", "checkpoint.every=0", steps=6)) == 0
    assert max(r["step"] for r in records(run, "train")) == 6
    out = capfd.readouterr()
    assert "run.steps reached at 6.0 s of the 1000 s time budget" in out.out + out.err


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_budget_must_be_positive(tmp_path, cache_dir, value, capsys):
    assert main(small(tmp_path / "run", cache_dir, f"run.time_budget_s={value}")) == 2
    err = capsys.readouterr().err
    assert "time_budget_s" in err and err.count("\n") == 1


def test_torchrun_refuses_a_budget_in_one_line():
    """The budget reaches the prefetch stage through an object of one process; torchrun runs several."""
    cfg = load_config(GRAPH, ["run.time_budget_s=300"])
    check_time_budget(cfg, launched=False)
    with pytest.raises(Exception, match="run.time_budget_s = 300 works in one process only") as exc:
        check_time_budget(cfg, launched=True)
    assert "\n" not in str(exc.value)
