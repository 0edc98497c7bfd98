"""The held-out decode behind ``dflash.evaluator``, in the training process or in a child process.

:class:`HeldoutDecoder` holds what an evaluation needs (its own target for generation, a drafter of
the run's shape, the run's first held-out prompts) and measures one snapshot's tau. The evaluator
stage runs it on its own thread by default. With ``[eval].isolate = true`` it runs in a child
process instead (:class:`HeldoutProcess`, started with ``spawn``): the decode then has its own
Python interpreter, so neither it nor the training thread waits on the other for the interpreter
lock. (A script that starts a run itself, rather than ``python -m dflash.run``, needs the usual
``if __name__ == "__main__":`` guard: ``spawn`` imports the main script in the child.) That wait is
what the in-process decode costs on a GPU: a batch-1 decode issues a few hundred
small kernels per verify step, each of which gives up the interpreter and asks for it back while
the training thread holds it for its own launches (measured on one H200: an evaluation took 45 s
beside training against 3.6 s alone, benchmarks/results/LOG.md).

The child receives each snapshot's weights through ``torch.multiprocessing`` (CUDA tensors as IPC
handles, so a GPU snapshot is not copied; CPU tensors through shared memory); the parent keeps the
snapshot alive until the child has answered, as CUDA IPC requires. The child costs its own CUDA
context and a second import of torch and transformers at start-up.

Either way an evaluation asks the run's stop request between verify steps (``should_stop``): a
long decode would otherwise hold a graceful stop for the whole evaluation (tens of seconds to
minutes), which is when a user presses Ctrl-C again. The child sees the request through a shared
event the parent sets while it waits for the answer.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import msgspec
import torch

from dflash.data.config import DataError
from dflash.errors import ConfigError, DFlashError
from dflash.eval.decode import DecodeStopped
from dflash.messages import HeldoutTau
from dflash.run.options import EvaluatorOptions

__all__ = ["EvaluatorProcessError", "HeldoutDecoder", "HeldoutProcess"]

log = logging.getLogger("dflash.evaluator")

_ERRORS: dict[str, type[Exception]] = {"DataError": DataError, "ConfigError": ConfigError}


class EvaluatorProcessError(DFlashError, RuntimeError):
    """The evaluator's child process failed or exited; the message (one line) says how."""


class HeldoutDecoder:
    """The target, drafter and prompts of the in-training evaluation (``[eval]``).

    Args:
        o: the run's :class:`~dflash.run.options.EvaluatorOptions`.
        device: where the target and drafter decode.

    Raises:
        DataError: the run's held-out conversations hold no usable prompt.
    """

    def __init__(self, o: EvaluatorOptions, device: torch.device) -> None:
        from dflash.data.prompts import heldout_prompts
        from dflash.data.tokenizer import load_tokenizer
        from dflash.model.drafter import DFlashDrafter
        from dflash.model.target import for_generation, load_target

        self.opts, self.device = o, device
        self.target = load_target(for_generation(o.target), device, o.drafter.num_layers, need_final=True)
        self.head = self.target.shared_head()
        # decodes with sdpa in the target's dtype whatever training uses (flex, float8): the same
        # outputs, no compile per length
        cfg = msgspec.structs.replace(o.drafter, attn_implementation="sdpa", compile=False, precision="bf16")
        self.drafter = DFlashDrafter(cfg, seed=0).to(device, self.target.model.dtype).eval()
        tok = load_tokenizer(o.target.tokenizer_source)
        ids = heldout_prompts(o.data, tok, o.eval.prompts, o.eval.max_prompt_tokens)
        if not ids:
            raise DataError("[eval]: the run's held-out conversations hold no usable prompt (each opens with an "
                            "assistant turn); set eval.every = 0 or hold out more (data.holdout)")
        if len(ids) < o.eval.prompts:
            log.warning("[eval] decodes the %d usable held-out prompts (eval.prompts = %d)", len(ids), o.eval.prompts)
        self.prompts = [torch.tensor(x, device=device) for x in ids]

    def evaluate(self, step: int, weights: dict[str, torch.Tensor], dropped: int, lock: Any = None,
                 should_stop: Callable[[], bool] | None = None) -> HeldoutTau:
        """Measured tau of ``weights`` (the drafter's state dict after ``step``) on the prompts.

        Args:
            dropped: snapshots the drafter dropped before this one (the record's ``skipped``).
            lock: a context manager held while decoding (the in-process evaluator holds the
                process's step lock shared, :mod:`dflash.run.step_gate`); None in a child process.
            should_stop: the run's stop request, asked between prompts and verify steps.

        Raises:
            DecodeStopped: ``should_stop()`` returned True before the evaluation finished.
        """
        from dflash.eval.measure import decode_tau

        e = self.opts.eval
        t0 = time.perf_counter()
        with lock if lock is not None else nullcontext(), torch.no_grad():
            self.drafter.load_state_dict(weights)
            got = decode_tau(self.target, self.drafter, self.head, self.prompts, e.max_new_tokens,
                             temperature=e.temperature, seed=e.seed, should_stop=should_stop)
        return HeldoutTau(step=step, tau=got.tau, accepted=got.accepted, sampled_tau=got.sampled_tau,
                          prompts=len(self.prompts), new_tokens=got.new_tokens, steps=got.steps,
                          seconds=time.perf_counter() - t0, skipped=dropped, time=time.time())


def serve(o: EvaluatorOptions, device: str, conn: Any, stop: Any = None) -> None:
    """The child process's main: build a :class:`HeldoutDecoder`, answer ``("ready", None)``, then
    answer each ``(step, weights, dropped)`` with ``("tau", HeldoutTau)``, or ``("stopped", None)``
    once the parent has set ``stop`` (a multiprocessing event: the run is stopping), until ``None``
    arrives. An exception is answered with ``("error", (type name, message))`` and ends the process."""
    from dflash.import_noise import quiet_import_noise

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends this process
    quiet_import_noise()  # a spawned process imports torchao again: the parent's filters are not here
    should_stop = stop.is_set if stop is not None else None
    try:
        decoder = HeldoutDecoder(o, torch.device(device))
        conn.send(("ready", None))
        while (msg := conn.recv()) is not None:
            step, weights, dropped = msg
            try:
                answer = ("tau", decoder.evaluate(step, weights, dropped, should_stop=should_stop))
            except DecodeStopped:
                answer = ("stopped", None)
            del weights, msg  # the parent may free the snapshot once it has the answer
            conn.send(answer)
    except (EOFError, BrokenPipeError):  # the parent is gone: nothing to answer
        return
    except Exception as exc:  # noqa: BLE001 - every failure is reported to the parent, which raises it
        lines = str(exc).strip().splitlines() or [""]
        more = f" (and {len(lines) - 2} more lines)" if len(lines) > 2 else ""
        conn.send(("error", (type(exc).__name__, " ".join(line.strip() for line in lines[:2]) + more)))


class HeldoutProcess:
    """A :class:`HeldoutDecoder` in a child process (``[eval].isolate``); the evaluator stage's
    thread sends it snapshots and waits for their tau (the wait does not hold the interpreter lock).

    Raises:
        DataError, ConfigError: the child could not build its decoder, for these reasons.
        EvaluatorProcessError: the child failed otherwise or exited (its exit code is named).
        DecodeStopped: ``should_stop()`` turned True while the child started (it is ended).
    """

    POLL_S = 0.1
    """How often the parent, waiting for an answer, looks at the run's stop request (seconds)."""
    STOP_GRACE_S = 5.0
    """How long the child may take to end its decode after a stop request before it is ended (seconds)."""

    def __init__(self, o: EvaluatorOptions, device: torch.device,
                 should_stop: Callable[[], bool] | None = None) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.stop = ctx.Event()  # set by the parent when the run stops; the child's decode asks it
        self.proc = ctx.Process(target=serve, args=(o, str(device), child, self.stop), name="dflash-evaluator",
                                daemon=True)
        self.proc.start()
        child.close()
        # the child's start-up (imports, the target) takes seconds: a stop meanwhile ends it
        if self._wait(should_stop, on_stop=self.proc.terminate):
            self.proc.join(timeout=5)
            raise DecodeStopped("the run stopped while the evaluator's process started")
        self._answer("ready")
        log.info("evaluator: decoding in its own process (pid %d, eval.isolate = true)", self.proc.pid)

    def evaluate(self, step: int, weights: dict[str, torch.Tensor], dropped: int,
                 should_stop: Callable[[], bool] | None = None) -> HeldoutTau:
        """The child's :meth:`HeldoutDecoder.evaluate` of ``weights``; keep them alive until it returns.

        Raises:
            DecodeStopped: ``should_stop()`` turned True and the child ended the evaluation unfinished.
        """
        try:
            self.conn.send((step, weights, dropped))
        except (BrokenPipeError, EOFError, OSError):
            self._answer("tau")  # the child is gone: say why
        if self._wait(should_stop, on_stop=self.stop.set) and not self.proc.is_alive():
            raise DecodeStopped("the run is stopping; the evaluator's process was ended")
        return self._answer("tau")  # a stopped decode answers "stopped": DecodeStopped

    def _wait(self, should_stop: Callable[[], bool] | None, on_stop: Callable[[], None]) -> bool:
        """Wait for the child's next answer (or its end) in short polls that look at
        ``should_stop``; when it turns True, call ``on_stop`` and wait at most ``STOP_GRACE_S``
        more, then end the child. Returns whether the stop was seen."""
        if should_stop is None:
            return False
        stopped_at = None
        while not self.conn.poll(self.POLL_S):
            if stopped_at is None and should_stop():
                on_stop()
                stopped_at = time.monotonic()
            elif stopped_at is not None and time.monotonic() - stopped_at > self.STOP_GRACE_S:
                self.proc.terminate()  # the run's stop must not wait on it (the csp join timeout is 10 s)
                self.proc.join(timeout=5)
                break
        return stopped_at is not None

    def _answer(self, kind: str) -> Any:
        try:
            got, value = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(timeout=5)
            raise EvaluatorProcessError(f"the evaluator's process (pid {self.proc.pid}) exited with code "
                                        f"{self.proc.exitcode} before answering; its output above says why "
                                        "(set eval.isolate = false to evaluate in the training process)") from None
        if got == "error":
            name, message = value
            raise _ERRORS.get(name, EvaluatorProcessError)(
                message if name in _ERRORS else f"the evaluator's process failed: {name}: {message}")
        if got == "stopped":
            raise DecodeStopped("the run is stopping")
        assert got == kind, (got, kind)
        return value

    def close(self) -> None:
        """Ask the child to end, then end it (at most 10 s)."""
        try:
            self.conn.send(None)
        except (BrokenPipeError, EOFError, OSError):
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=5)
        self.conn.close()
