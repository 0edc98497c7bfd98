"""The drafter's optimizer and learning-rate schedule: AdamW (or Muon for the Linear layers' matrices
and AdamW for the rest), linear warmup then cosine decay.

:func:`make_optimizer` builds them from ``[train]``; :func:`load_optimizer_state` restores them
from a checkpoint's ``train_state.pt`` and then applies the run's own ``[train]`` values. With
``[train].optimizer = "muon"`` there are two optimizers and two schedules of the same shape, stepped
together; ``train_state.pt`` then holds ``"muon"`` and ``"muon_scheduler"`` beside the AdamW ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dflash.train.config import TrainSection

__all__ = ["DrafterOptimizer", "Schedule", "load_optimizer_state", "lr_lambda", "make_optimizer",
           "muon_parameters"]


@dataclass
class Schedule:
    """Linear warmup then cosine decay, whose end (``total``) may move while it runs.

    ``[run].time_budget_s`` sets ``total`` from the measured step rate
    (:class:`dflash.train.budget.TimeBudget`); without it ``total`` stays ``[run].steps``.

    Attributes:
        warmup: warmup length, in steps.
        total: the step (in steps counted over the whole run) where the cosine reaches ``min_ratio``.
        min_ratio: the multiplier of the peak lr at and after ``total``.
    """

    warmup: int
    total: int
    min_ratio: float

    def __call__(self, s: int) -> float:
        """Multiplier of the peak lr at step s (0-based)."""
        warmup, total, min_ratio = self.warmup, self.total, self.min_ratio
        if warmup > 0 and s < warmup:
            return (s + 1) / warmup
        progress = min(max(s - warmup, 0) / max(total - warmup, 1), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak lr at step s (0-based): linear warmup over ``warmup`` steps, then
    cosine decay to ``min_ratio`` at ``total`` (the usual warmup + cosine schedule)."""
    return _as_function(Schedule(warmup, total, min_ratio))


def _as_function(schedule: Schedule) -> Callable[[int], float]:
    # A plain function, not the object: LambdaLR saves a callable object's __dict__ in its state and
    # a resume would restore the old total over this run's [run].steps. Checkpoints stay as they were.
    def f(s: int) -> float:
        return schedule(s)

    return f


@dataclass
class DrafterOptimizer:
    """The trained parameters, their optimizers and schedules (stepped once per batch).

    Attributes:
        params: every trained parameter (the gradient clip's set).
        opt: AdamW: over every parameter, or with Muon over those Muon does not take.
        sched: ``opt``'s schedule.
        muon, muon_sched: ``torch.optim.Muon`` over the Linear layers' matrices and its schedule
            (the same warmup + cosine); None with ``[train].optimizer = "adamw"``.
        schedule: the lr multiplier both schedules read; setting ``schedule.total`` moves the
            cosine's end from the next :meth:`schedule_step` on.
        muon_step: ``muon.step`` compiled (``[train].compile_optimizer``), which :meth:`step`
            calls instead; None: eager.
    """

    params: list[torch.nn.Parameter]
    opt: torch.optim.AdamW
    sched: torch.optim.lr_scheduler.LambdaLR
    muon: torch.optim.Optimizer | None = None
    muon_sched: torch.optim.lr_scheduler.LambdaLR | None = None
    schedule: Schedule | None = None
    muon_step: Callable[[], Any] | None = None

    @property
    def lr(self) -> float:
        """The lr the next :meth:`step` uses."""
        return self.opt.param_groups[0]["lr"]

    def step(self) -> None:
        """One update of every parameter."""
        self.opt.step()
        if self.muon_step is not None:
            self.muon_step()
        elif self.muon is not None:
            self.muon.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.muon is not None:
            self.muon.zero_grad(set_to_none=True)

    def schedule_step(self) -> None:
        """Advance the schedules by one batch (an update skipped or not)."""
        self.sched.step()
        if self.muon_sched is not None:
            self.muon_sched.step()

    def state_dict(self) -> dict[str, Any]:
        """``{"optimizer": ..., "scheduler": ...}`` (and ``"muon"``, ``"muon_scheduler"``), the
        optimizer part of ``train_state.pt``."""
        out = {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()}
        if self.muon is not None:
            out |= {"muon": self.muon.state_dict(), "muon_scheduler": self.muon_sched.state_dict()}
        return out


def muon_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters Muon trains: the 2-D weights of ``model``'s ``nn.Linear`` layers (attention and
    MLP projections, ``fc``, DFlash2's tap and selector projections). Muon orthogonalises a matrix's
    update, which is meaningful for a linear map; vectors (norms), DFlash2's 3-D convolution taps and
    its codebooks (rows looked up by token id, like an embedding) stay with AdamW, as Muon's
    authors advise for embeddings, gains and biases."""
    return [m.weight for m in model.modules()
            if isinstance(m, torch.nn.Linear) and m.weight.requires_grad and m.weight.ndim == 2]


def make_optimizer(model: torch.nn.Module, train: TrainSection, total_steps: int) -> DrafterOptimizer:
    """The optimizer ``[train].optimizer`` names over ``model``'s trainable parameters, with
    ``[train]``'s lr, betas and weight decay, and the warmup + cosine schedule over ``total_steps``
    (``[run].steps``). With "muon", Muon takes :func:`muon_parameters` and AdamW the rest."""
    params = [p for p in model.parameters() if p.requires_grad]
    shape = Schedule(train.warmup_steps, total_steps, train.min_lr_ratio)
    schedule = _as_function(shape)
    muon = muon_sched = muon_step = None
    rest = params
    if train.optimizer == "muon":
        matrices = muon_parameters(model)
        taken = {id(p) for p in matrices}
        rest = [p for p in params if id(p) not in taken]
        muon = torch.optim.Muon(matrices, lr=train.lr, weight_decay=train.weight_decay,
                                momentum=train.muon_momentum, nesterov=True, adjust_lr_fn="match_rms_adamw")
        muon_sched = torch.optim.lr_scheduler.LambdaLR(muon, schedule)
        if train.compile_optimizer:
            muon_step = _compiled_step(muon)
    # AdamW always exists (a drafter always has norms), so the lr and the checkpoint keep one place
    opt = torch.optim.AdamW(rest, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay,
                            fused=train.adamw_fused or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    return DrafterOptimizer(params=params, opt=opt, sched=sched, muon=muon, muon_sched=muon_sched, schedule=shape,
                            muon_step=muon_step)


def _compiled_step(opt: torch.optim.Optimizer) -> Callable[[], Any]:
    """``opt.step`` through ``torch.compile``, with every group's lr moved into a 0-d float32 tensor
    on the parameters' device: ``LambdaLR`` then fills that tensor in place each step, where a
    Python float would be a constant of the compiled graph and each new value a recompile."""
    for g in opt.param_groups:
        g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32, device=g["params"][0].device)

    @torch.compile(fullgraph=False)
    def step() -> None:
        opt.step()

    return step


def load_optimizer_state(o: DrafterOptimizer, state: dict[str, Any], train: TrainSection) -> None:
    """Restore ``state["optimizer"]`` and ``state["scheduler"]`` (a ``train_state.pt``) into ``o``.

    The saved states carry the lr, betas and weight decay they were saved with; the run follows its
    own ``[train]`` table (a changed key is named at start-up), so an unchanged config restores the
    same values and a changed one takes effect.
    """
    saved = "muon" if "muon" in state else "adamw"
    if saved != train.optimizer:  # the moments of one optimizer mean nothing to the other
        raise ValueError(f"the checkpoint was trained with train.optimizer = {saved!r} and this run sets "
                         f"{train.optimizer!r}: resume with {saved!r}, or start fresh (--resume none or "
                         "another run.out_dir)")
    # the kernel choice is this run's, not the saved one's (a resume may switch it either way)
    pairs = [(o.opt, o.sched, state["optimizer"], state["scheduler"],
              {"betas": train.betas, "fused": train.adamw_fused or None})]
    if o.muon is not None:
        pairs.append((o.muon, o.muon_sched, state["muon"], state["muon_scheduler"],
                      {"momentum": train.muon_momentum}))
    for opt, sched, opt_state, sched_state, own in pairs:
        # a compiled step (train.compile_optimizer) reads its lr from these tensors, which loading
        # the saved groups would replace: they are refilled below and put back
        lr_tensors = [g["lr"] if isinstance(g["lr"], torch.Tensor) else None for g in opt.param_groups]
        opt.load_state_dict(opt_state)
        sched.load_state_dict(sched_state)
        sched.base_lrs = [train.lr for _ in opt.param_groups]
        for g, lam, held in zip(opt.param_groups, sched.lr_lambdas, lr_tensors):
            g.update(initial_lr=train.lr, lr=train.lr * lam(sched.last_epoch), weight_decay=train.weight_decay, **own)
            if held is not None:  # a compiled step reads this very tensor: refill it, keep it
                g["lr"] = held.fill_(g["lr"])
        sched._last_lr = [float(g["lr"]) for g in opt.param_groups]  # what get_last_lr() reports
    # where each kernel keeps its step counts (float32): the fused one beside the parameter, the
    # foreach one on the host; a resume that switches kernels moves them
    for p, st in o.opt.state.items():
        if "step" in st:
            st["step"] = torch.as_tensor(st["step"], dtype=torch.float32,
                                         device=p.device if train.adamw_fused else "cpu")
