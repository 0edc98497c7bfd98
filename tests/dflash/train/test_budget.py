"""``[run].time_budget_s`` in parts: the schedule whose end moves, and the estimate of that end from
a step rate measured on an injected clock."""

from __future__ import annotations

import math

import pytest
import torch

from dflash.train.budget import TimeBudget, rate_warmup_steps
from dflash.train.optim import Schedule, load_optimizer_state, lr_lambda, make_optimizer


class FakeClock:
    """Seconds that advance only when told (or by ``tick`` on every read)."""

    def __init__(self, tick: float = 0.0) -> None:
        self.now, self.tick = 1000.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def _train(optimizer: str = "adamw"):
    from dflash.train.config import TrainSection

    return TrainSection(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01, warmup_steps=2, min_lr_ratio=0.1,
                        optimizer=optimizer)


def _advance(o, steps: int = 1) -> None:
    for _ in range(steps):
        o.step()  # no gradients: nothing moves, but the schedules see the optimizer step first
        o.schedule_step()


def _lrs(o) -> list[float]:
    return [o.lr] + ([o.muon.param_groups[0]["lr"]] if o.muon is not None else [])


def test_the_default_schedule_is_unchanged():
    """Without a budget the schedule is the warmup + cosine over run.steps it always was."""
    f, g = lr_lambda(4, 14, 0.1), Schedule(4, 14, 0.1)
    old = lambda s: (s + 1) / 4 if s < 4 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min((s - 4) / 10, 1.0)))  # noqa: E731
    assert [f(s) for s in range(20)] == pytest.approx([old(s) for s in range(20)])
    assert [g(s) for s in range(20)] == [f(s) for s in range(20)]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_moving_the_schedules_end_moves_the_lr_of_every_optimizer(optimizer):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    o = make_optimizer(model, _train(optimizer), total_steps=100)
    _advance(o, 5)
    assert _lrs(o) == pytest.approx([1e-3 * Schedule(2, 100, 0.1)(5)] * len(_lrs(o)))
    o.schedule.total = 6  # the cosine now ends at step 6
    _advance(o)
    assert _lrs(o) == pytest.approx([1e-3 * 0.1] * len(_lrs(o)))
    o.schedule.total = 20
    _advance(o)
    assert _lrs(o) == pytest.approx([1e-3 * Schedule(2, 20, 0.1)(7)] * len(_lrs(o)))


def test_the_moving_end_is_not_saved_into_the_checkpoint():
    """A resume follows its own run.steps (and budget), not the end the saved run had reached."""
    model = torch.nn.Linear(4, 4)
    o = make_optimizer(model, _train(), total_steps=100)
    o.schedule.total = 10
    _advance(o, 4)
    state = o.state_dict()
    assert state["scheduler"]["lr_lambdas"] == [None]
    o2 = make_optimizer(torch.nn.Linear(4, 4), _train(), total_steps=100)
    load_optimizer_state(o2, state, _train())
    assert o2.schedule.total == 100 and o2.lr == pytest.approx(1e-3 * Schedule(2, 100, 0.1)(4))


def test_rate_warmup_skips_twenty_steps_or_a_tenth_of_a_short_run():
    assert rate_warmup_steps(10_000) == 20 and rate_warmup_steps(50) == 5 and rate_warmup_steps(3) == 1


def test_the_end_follows_the_measured_rate_to_the_deadline():
    clock = FakeClock()
    b = TimeBudget(100.0, max_total=10_000, clock=clock, warmup_steps=2, window=4)
    b.start(0)
    clock.now += 30.0  # a slow first step (compilation): not timed
    assert b.after_step(1) == 10_000 and b.rate is None
    for step in range(2, 12):  # then 2 steps a second
        clock.now += 0.5
        b.after_step(step)
    assert b.rate == pytest.approx(2.0)
    # 35 s gone, 65 s left at 2 steps/s: 130 more steps
    assert b.total == 11 + 130 and not b.expired(11)
    clock.now += 0.25  # the rate is a moving window: faster steps pull the end later
    b.after_step(12)
    assert b.rate == pytest.approx(4 / 1.75) and b.total == 12 + int(4 / 1.75 * 64.75)


def test_the_budget_expires_at_the_deadline_and_never_past_run_steps():
    clock = FakeClock(tick=1.0)  # one second per read: one read per step
    b = TimeBudget(10.0, max_total=1000, clock=clock, warmup_steps=1, window=50)
    b.start(0)
    ends = []
    for step in range(1, 100):
        ends.append(b.after_step(step))
        if b.expired(step):
            break
    assert step == 10 and ends[-1] == 10 and b.elapsed() == pytest.approx(10.0)
    short = TimeBudget(10.0, max_total=5, clock=FakeClock(tick=1.0), warmup_steps=1)
    short.start(0)
    assert [short.after_step(s) for s in range(1, 6)] == [5] * 5 and short.expired(5)


def test_a_resumed_run_gets_its_own_budget():
    clock = FakeClock(tick=1.0)
    b = TimeBudget(5.0, max_total=1000, clock=clock, warmup_steps=1)
    b.start(400)  # steps before the resume are neither timed nor counted
    step = 400
    while not b.expired(step):
        step += 1
        b.after_step(step)
    assert step == 405 and b.total == 405


def test_an_infinite_budget_ends_at_run_steps():
    clock = FakeClock(tick=1.0)
    b = TimeBudget(math.inf, max_total=30, clock=clock, warmup_steps=1)
    b.start(0)
    assert [b.after_step(s) for s in range(1, 4)] == [30, 30, 30] and not b.expired(3)
