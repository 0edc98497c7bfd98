"""dflash.train.sentinel: the channel-boundary NaN check names the first producer (failure mode 2 of
docs/failure-modes.md)."""

from __future__ import annotations

import math

import pytest
import torch

from dflash.messages import TargetOutput
from dflash.train.sentinel import FiniteSentinel, NonFiniteError, floating_tensors
from tests.helpers import make_batch


def test_finds_nested_floating_tensors_only():
    b = make_batch()
    out = TargetOutput(batch=b, layer_hidden=torch.zeros(1, 4, 6), final_hidden=None, replica=0)
    names = [n for n, _ in floating_tensors(out)]
    assert names == ["layer_hidden"]  # ids/masks are integer/bool, final_hidden is None


def test_names_producer_channel_batch_and_tensor():
    """Invariant (failure mode 2 of docs/failure-modes.md): the error names the
    producer replica, the channel, the training step the batch was for, the batch and the tensor."""
    s = FiniteSentinel("target[1]", enabled=True)
    h = torch.zeros(1, 4, 6)
    s.check(TargetOutput(batch=make_batch(), layer_hidden=h, final_hidden=None, replica=1), batch_id=3,
            channel="hidden")
    h[0, 2, 1] = math.nan
    with pytest.raises(NonFiniteError,
                       match=r"target\[1\] on channel 'hidden' \(step 12, batch 7, tensor layer_hidden\)"):
        s.check(TargetOutput(batch=make_batch(), layer_hidden=h, final_hidden=None, replica=1), batch_id=7,
                channel="hidden", step=12)


def test_disabled_costs_nothing_and_checks_nothing():
    s = FiniteSentinel("x", enabled=False)
    s.check({"a": torch.tensor([math.inf])}, batch_id=0, channel="c")
    assert s.checked == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_every_kind_of_non_finite_value_is_caught(bad):
    s = FiniteSentinel("drafter[0]", enabled=True)
    t = torch.zeros(3, 4, dtype=torch.bfloat16)
    t[1, 2] = bad
    with pytest.raises(NonFiniteError, match="tensor x"):
        s.check({"x": t, "ok": torch.ones(2)}, batch_id=0, channel="c")
