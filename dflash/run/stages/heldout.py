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
context and a second import of torch and transformers at start-up. While it decodes it sends its
progress lines (:mod:`dflash.eval.progress`) up the same pipe, and the parent logs them.

**CPU threads** (``[eval].threads``). ``torch.set_num_threads`` is process-wide in name only:
under OpenMP, torch's CPU backend in the Linux and Windows wheels, it sets the *calling thread's*
OpenMP and MKL thread counts (OpenMP keeps one per thread) and the process default that a thread
adopts the first time it runs torch. So the in-process evaluator calls it from its own thread
(:func:`own_threads`) and puts the process default back from a short-lived thread: the training
threads, already running, keep their counts, and a thread started later gets torch's default, not
the evaluator's. Under another backend (native, TBB) the count is one pool's for the whole process:
the in-process evaluator then leaves it alone and says so, and ``[eval].isolate = true`` is the way
to give the decode a count of its own. The isolated child sets its count for its whole process.

**CUDA graphs** (``[eval].cuda_graphs``). In the child on a CUDA device the decode replays CUDA
graphs of the target's and the drafter's fixed-shape steps (:mod:`dflash.eval.static_target`,
:mod:`dflash.eval.static_drafter`), as ``dflash.eval`` does by default: the same tokens (the
same weights and prompts gave the same tau, 1.622 over 8 x 128 tokens, eager here and with graphs in
``dflash.eval``), measured 14x faster per prompt on one H100 against SmolLM2-135M (54 s for 8 x 128
tokens eager; 7.8 s for 16 x 128 with graphs). The in-process evaluator stays eager: a capture in
a process whose other threads launch work on the same device is not yet tested on a GPU.

Either way an evaluation asks the run's stop request between verify steps (``should_stop``): a
long decode would otherwise hold a graceful stop for the whole evaluation (tens of seconds to
minutes), which is when a user presses Ctrl-C again. The child sees the request through a shared
event the parent sets while it waits for the answer.
"""

from __future__ import annotations

import logging
import signal
import threading
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
from dflash.records import over_text
from dflash.run.options import EvaluatorOptions

__all__ = ["EvaluatorProcessError", "HeldoutDecoder", "HeldoutProcess", "own_threads", "threads_are_per_thread"]

log = logging.getLogger("dflash.evaluator")

_ERRORS: dict[str, type[Exception]] = {"DataError": DataError, "ConfigError": ConfigError}


class EvaluatorProcessError(DFlashError, RuntimeError):
    """The evaluator's child process failed or exited; the message (one line) says how."""


def threads_are_per_thread() -> bool:
    """Whether torch's CPU parallel backend is OpenMP, which keeps a thread count per thread (the
    module docstring says why that matters)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def own_threads(n: int) -> int:
    """Give the calling thread ``n`` torch intra-op CPU threads and leave every other thread's
    count, and the process default, as they were; ``n = 0`` changes nothing. Returns the calling
    thread's count afterwards. Under a backend that is not OpenMP nothing is changed either (one
    pool serves the process; the caller says so).

    Why it works (OpenMP): ``torch.set_num_threads`` sets this thread's own OpenMP and MKL counts
    and the process default; this thread has read its count first, so it never re-reads the
    default, which a short-lived thread then puts back.
    """
    if n == 0 or not threads_are_per_thread():
        return torch.get_num_threads()
    before = torch.get_num_threads()  # also fixes this thread's count: it is initialised once per thread
    torch.set_num_threads(n)
    restore = threading.Thread(target=torch.set_num_threads, args=(before,), name="dflash-threads-default")
    restore.start()
    restore.join()
    return torch.get_num_threads()


class HeldoutDecoder:
    """The target, drafter and prompts of the in-training evaluation (``[eval]``).

    Args:
        o: the run's :class:`~dflash.run.options.EvaluatorOptions`.
        device: where the target and drafter decode.

    Raises:
        DataError: the run's held-out conversations hold no usable prompt.
    """

    def __init__(self, o: EvaluatorOptions, device: torch.device, graphs: bool = False) -> None:
        from dflash.data.prompts import heldout_prompts
        from dflash.data.tokenizer import load_tokenizer
        from dflash.model.drafter import DFlashDrafter
        from dflash.model.target import for_generation, load_target

        self.opts, self.device = o, device
        self.graphs = graphs and device.type == "cuda"  # CUDA-graph replays (module docstring)
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
                 say: Callable[[str], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> HeldoutTau:
        """Measured tau of ``weights`` (the drafter's state dict after ``step``) on the prompts.

        Args:
            dropped: snapshots the drafter dropped before this one (the record's ``skipped``).
            lock: a context manager held while decoding (the in-process evaluator holds the
                process's step lock shared, :mod:`dflash.run.step_gate`); None in a child process.
            say: called with progress lines while it decodes (a line when it starts, then
                prompts done, tau so far, time left, at most one every 10 s); None: quiet.
            should_stop: the run's stop request, asked between prompts and verify steps.

        Raises:
            DecodeStopped: ``should_stop()`` returned True before the evaluation finished.
        """
        from dflash.eval.measure import decode_tau
        from dflash.eval.progress import ProgressLines

        e = self.opts.eval
        progress = None
        if say is not None:
            sampled = f", then sampled at T={e.temperature:g}" if e.temperature > 0 else ""
            sampled += f", then tree-verified ({e.tree_budget} draft tokens)" if e.tree_budget else ""
            cpu = f", {torch.get_num_threads()} CPU thread(s)" if self.device.type == "cpu" else ""
            cpu += ", CUDA graphs" if self.graphs else ""
            say(f"evaluator: step {step}: decoding the held-out conversations, "
                f"{over_text(len(self.prompts), e.max_new_tokens)}{sampled} ({self.device}{cpu})")
            progress = ProgressLines(say, prefix=f"evaluator: step {step}: ", done_line=False)
        t0 = time.perf_counter()
        with lock if lock is not None else nullcontext(), torch.no_grad():
            self.drafter.load_state_dict(weights)
            got = decode_tau(self.target, self.drafter, self.head, self.prompts, e.max_new_tokens,
                             temperature=e.temperature, seed=e.seed, progress=progress,
                             should_stop=should_stop, cuda_graphs=self.graphs, tree_budget=e.tree_budget)
        return HeldoutTau(step=step, tau=got.tau, accepted=got.accepted, sampled_tau=got.sampled_tau,
                          prompts=len(self.prompts), new_tokens=got.new_tokens, steps=got.steps,
                          seconds=time.perf_counter() - t0, skipped=dropped, time=time.time(),
                          max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                          tree_tau=got.tree_tau, tree_budget=e.tree_budget or None,
                          loop_share=got.loop_share, fresh_tau=got.fresh_tau,
                          dtype=str(self.target.model.dtype).removeprefix("torch."))


def serve(o: EvaluatorOptions, device: str, conn: Any, stop: Any = None) -> None:
    """The child process's main: set its CPU threads (``[eval].threads``, the whole process's),
    build a :class:`HeldoutDecoder`, answer ``("ready", threads)``, then answer each ``(step,
    weights, dropped)`` with ``("progress", line)`` messages while decoding and ``("tau",
    HeldoutTau)`` at the end, or ``("stopped", None)`` once the parent has set ``stop`` (a
    multiprocessing event: the run is stopping), until ``None`` arrives. An exception is answered
    with ``("error", (type name, message))`` and ends the process."""
    from dflash.import_noise import quiet_import_noise

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends this process
    quiet_import_noise()  # a spawned process imports torchao again: the parent's filters are not here
    should_stop = stop.is_set if stop is not None else None
    try:
        if o.eval.threads:  # this process decodes only: its count is the decode's
            torch.set_num_threads(o.eval.threads)
        decoder = HeldoutDecoder(o, torch.device(device), graphs=o.eval.cuda_graphs)
        conn.send(("ready", torch.get_num_threads()))
        while (msg := conn.recv()) is not None:
            step, weights, dropped = msg
            try:
                answer = ("tau", decoder.evaluate(step, weights, dropped, should_stop=should_stop,
                                                  say=lambda line: conn.send(("progress", line))))
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
        self._stop_seen_at: float | None = None
        if self._wait(should_stop, on_stop=self.proc.terminate):
            self.proc.join(timeout=5)
            raise DecodeStopped("the run stopped while the evaluator's process started")
        threads = self._answer("ready")
        log.info("evaluator: decoding in its own process (pid %d, eval.isolate = true) with %d torch CPU "
                 "thread(s)", self.proc.pid, threads)

    def evaluate(self, step: int, weights: dict[str, torch.Tensor], dropped: int,
                 say: Callable[[str], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> HeldoutTau:
        """The child's :meth:`HeldoutDecoder.evaluate` of ``weights``; keep them alive until it
        returns. ``say`` gets the child's progress lines as they arrive.

        Raises:
            DecodeStopped: ``should_stop()`` turned True and the child ended the evaluation unfinished.
        """
        try:
            self.conn.send((step, weights, dropped))
        except (BrokenPipeError, EOFError, OSError):
            self._answer("tau")  # the child is gone: say why
        self._stop_seen_at = None
        while True:  # progress lines until the answer, the stop request looked at while waiting
            if self._wait(should_stop, on_stop=self.stop.set) and not self.proc.is_alive():
                raise DecodeStopped("the run is stopping; the evaluator's process was ended")
            got, value = self._recv()
            if got != "progress":
                return self._check(got, value, "tau")  # a stopped decode answers "stopped": DecodeStopped
            if say is not None:
                say(value)

    def _wait(self, should_stop: Callable[[], bool] | None, on_stop: Callable[[], None]) -> bool:
        """Wait for the child's next message (or its end) in short polls that look at
        ``should_stop``; when it turns True, call ``on_stop`` and wait at most ``STOP_GRACE_S``
        more (counted from the first time it was seen in this evaluation), then end the child.
        Returns whether the stop was seen."""
        if should_stop is None:
            return False
        while not self.conn.poll(self.POLL_S):
            if self._stop_seen_at is None and should_stop():
                on_stop()
                self._stop_seen_at = time.monotonic()
            elif self._stop_seen_at is not None and time.monotonic() - self._stop_seen_at > self.STOP_GRACE_S:
                self.proc.terminate()  # the run's stop must not wait on it (the csp join timeout is 10 s)
                self.proc.join(timeout=5)
                break
        return self._stop_seen_at is not None

    def _recv(self) -> tuple[str, Any]:
        """The child's next ``(kind, value)`` message."""
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(timeout=5)
            raise EvaluatorProcessError(f"the evaluator's process (pid {self.proc.pid}) exited with code "
                                        f"{self.proc.exitcode} before answering; its output above says why "
                                        "(set eval.isolate = false to evaluate in the training process)") from None

    def _check(self, got: str, value: Any, kind: str) -> Any:
        """``value`` of an answer of ``kind``; an error or a stopped decode raised as such."""
        if got == "error":
            name, message = value
            raise _ERRORS.get(name, EvaluatorProcessError)(
                message if name in _ERRORS else f"the evaluator's process failed: {name}: {message}")
        if got == "stopped":
            raise DecodeStopped("the run is stopping")
        assert got == kind, (got, kind)
        return value

    def _answer(self, kind: str) -> Any:
        return self._check(*self._recv(), kind)

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
