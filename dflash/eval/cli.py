"""``python -m dflash.eval``: a drafter's accepted length measured by real draft-and-verify decoding
against its target, next to the teacher-forced simulation of the same text, per category of an
evaluation set, with the measured wall-clock speedup over the target alone.

The pieces: :mod:`dflash.eval.decode` (greedy and draft-and-verify decoding, the proposers),
:mod:`dflash.eval.measure` (:func:`evaluate`: decode, time, and score the text teacher-forced),
:mod:`dflash.eval.report` (:class:`EvalResult` and the printed tables), :mod:`dflash.eval.sets`
(MT-Bench, HumanEval and prompt files), :mod:`dflash.eval.turns` (later turns after the target's
own answer), :mod:`dflash.eval.projection` (the 8B-class projection), :mod:`dflash.eval.inputs`
(the command line's checks) and :mod:`dflash.data.prompts` (prompts built as training builds
contexts).

``python -m dflash.eval CHECKPOINT (--prompts NAME|FILE | --data SOURCE) [--num-prompts N]
[--max-new-tokens N] [--device DEV] [--dtype auto|float32|bfloat16] [--threads N] [--no-speedup]
[--temperature T [--top-p P] [--top-k K] [--seed S]] [--json] [--quiet]``. The decode runs with
``--threads`` torch CPU threads (default 1: batch-1 decode is launch-bound, more threads only
contend), in ``--dtype`` (default: the run's ``[target].dtype``); both are recorded in the result.

Progress goes to stderr as plain lines, terminal or not (:mod:`dflash.eval.progress`): what is
loaded, a line when the set starts (which set, prompts and turns, tokens, device, dtype, threads),
then prompts done, tau so far, time elapsed and left, at most one line every 10 s, and a line when
the speed baseline's warm-up starts. ``--quiet`` drops them; stdout
holds only the result (``--json``: one JSON object). Prompts:

* ``--prompts NAME`` (``mtbench``, ``humaneval``; :mod:`dflash.eval.sets`) or ``--prompts FILE``
  (JSONL): every prompt of the set, or ``--num-prompts N`` of them taken across its categories in
  turn; each turn after the first is asked after the target's own answer. A table per category
  follows the overall figures.
* ``--data SOURCE``: the context before the first assistant turn of N conversations (default 8)
  that open with a user turn (others are skipped, so N is honoured when possible):

  * when CHECKPOINT is ``RUN_DIR/checkpoints/step_N``, ``RUN_DIR/config.toml`` exists and its
    ``data.source`` is SOURCE: the run's held-out conversations, ``split(data.holdout, data.seed)[1]``
    of its tokenized data (:func:`~dflash.data.prompts.heldout_prompts`), i.e. none the drafter was
    trained on. This is the run's held-out measure, the one its in-training evaluator took: N,
    ``--max-new-tokens`` and ``--max-prompt-tokens`` default to the run's ``[eval]`` ``prompts``,
    ``max_new_tokens`` and ``max_prompt_tokens``, so on the final checkpoint it prints the run's
    last held-out tau (a flag given overrides its setting);
  * otherwise (a copied checkpoint, another source, ``data.holdout = 0``): the *last* N usable
    conversations of SOURCE in file order (:func:`~dflash.data.prompts.source_prompts`), which may be
    training data; a note on stderr says so.

Bad input (missing checkpoint, a run directory instead of a checkpoint, an unknown ``--data`` or
set, a set whose package is missing) is one line on stderr and exit code 2; Ctrl-C is one line and
exit code 130. SIGTERM while decoding ends the run after the prompt under way and prints the
result over the prompts finished (headline: ``stopped by SIGTERM``), as ``--time-limit`` does.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import torch

from dflash.data.prompts import encode_prompt, heldout_prompts, source_prompts
from dflash.eval.args import INTERRUPTED, build_parser
from dflash.eval.config import DEFAULT_MAX_NEW_TOKENS, DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_PROMPTS
from dflash.eval.grouped import format_by_length, format_categories, format_speed
from dflash.eval.inputs import (
    EvalInputError,
    check_checkpoint,
    check_device,
    run_data_config,
    run_eval_config,
)
from dflash.eval.measure import evaluate
from dflash.eval.progress import ProgressLines
from dflash.eval.projection import project_8b
from dflash.eval.report import format_headline, format_prompt, format_result
from dflash.eval.sets import EvalPrompt, load_prompt_set
from dflash.eval.turns import Turns, stratified
from dflash.model.variants import variant_of
from dflash.records import over_text

__all__ = ["DEFAULT_NUM_PROMPTS", "main", "prompt_ids", "sigterm_ends_early"]

DEFAULT_NUM_PROMPTS = DEFAULT_PROMPTS
"""Conversations decoded with ``--data`` when ``--num-prompts`` is left out (or as many as exist,
said in one line), unless they are the run's held-out ones (then its ``[eval].prompts``); a
``--prompts`` set is decoded whole."""

PER_PROMPT_LINES = 16
"""Decodes up to which one line per decode is printed before the tables (``--json`` has them all)."""


def prompt_ids(args, tok, prompts: list[EvalPrompt] | None = None, data_cfg=None) -> list[list[int]]:
    """Token ids of the first turn of the CLI's prompts (module docstring says which
    conversations); ``prompts``: the ``--prompts`` set when the caller has read it already (read
    here when None); ``data_cfg``: the run's ``[data]`` table (:func:`run_data_config` of the
    checkpoint, read by the caller before any model loads), None when the checkpoint is not in a
    run directory.

    Raises:
        EvalInputError: a malformed ``--prompts`` line, an unknown set.
        DataError: an unknown ``--data`` source or a chat template the data path cannot split.
    """
    if args.prompts:
        prompts = load_prompt_set(args.prompts)[1] if prompts is None else prompts
        convs = [[{"role": "user", "content": p.turns[0]}] for p in prompts]
        return [encode_prompt(tok, c, args.max_prompt_tokens, data_cfg) for c in convs[: args.num_prompts]]
    if data_cfg is None:
        print(f"dflash.eval: {args.checkpoint} is not inside a run directory with config.toml: "
              f"using the last {args.num_prompts} conversations of {args.data} (may be training data)",
              file=sys.stderr)
    elif data_cfg.source != args.data:
        print(f"dflash.eval: --data {args.data} is not the run's data.source ({data_cfg.source}): "
              f"using its last {args.num_prompts} conversations", file=sys.stderr)
    elif data_cfg.holdout == 0:
        print("dflash.eval: the run held out no conversations (data.holdout = 0): using the last "
              f"{args.num_prompts} conversations of {args.data} (training data)", file=sys.stderr)
    else:
        return heldout_prompts(data_cfg, tok, args.num_prompts, args.max_prompt_tokens, args.prompt_turn)
    return source_prompts(args.data, tok, args.num_prompts, args.max_prompt_tokens)


def main(argv: list[str] | None = None, started_at: float | None = None) -> int:
    """The CLI (see ``--help``); returns the exit code: 0, 2 on bad input (one line on stderr),
    130 on Ctrl-C (one line, :data:`INTERRUPTED`) while importing, loading models or decoding.
    ``started_at``: the ``time.perf_counter()`` ``--time-limit`` counts from (``python -m
    dflash.eval`` passes the moment it started, before torch's import); None: now."""
    try:
        return _main(argv, time.perf_counter() if started_at is None else started_at)
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 130


@contextmanager
def sigterm_ends_early() -> Iterator[Callable[[], bool]]:
    """While the block runs, SIGTERM (``timeout``'s signal, a scheduler's) only raises a flag:
    yields the flag's reader, for :func:`evaluate`'s ``stop_early``, so the prompt under way
    finishes and the finished prompts' result is printed instead of lost. Outside the main thread
    (where no handler can be set) SIGTERM keeps its handler and the flag never rises."""
    raised = threading.Event()
    try:
        before = signal.signal(signal.SIGTERM, lambda *_: raised.set())
    except ValueError:  # not the main thread
        yield raised.is_set
        return
    try:
        yield raised.is_set
    finally:
        signal.signal(signal.SIGTERM, before)


def _main(argv: list[str] | None, started_at: float) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.cuda_graphs is None:  # graphs where they pay: a batch-1 decode on a GPU is launch-bound
        args.cuda_graphs = str(args.device).startswith("cuda")
    asked = args.num_prompts  # None: the default (--data: the run's [eval].prompts or 8; a --prompts set: all)
    if any(v is not None and v < 1 for v in (args.num_prompts, args.max_new_tokens, args.max_prompt_tokens)):
        p.error("--num-prompts, --max-new-tokens and --max-prompt-tokens must be >= 1")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.time_limit is not None and not 0 < args.time_limit < float("inf"):
        p.error("--time-limit must be a number of seconds > 0")
    if args.tree_budget < 0:
        p.error("--tree-budget must be >= 0 (0: no tree figure)")
    if not 0 <= args.temperature < float("inf") or not 0 < args.top_p <= 1 or args.top_k < 0:
        p.error("--temperature must be a finite number >= 0, --top-p in (0, 1], --top-k >= 0")
    if args.temperature == 0 and (args.top_p != 1 or args.top_k != 0):
        p.error("--top-p and --top-k shape the sampled decode: give --temperature > 0 with them "
                "(the greedy decode ignores them)")
    torch.set_num_threads(args.threads)
    from dflash.data import DataError
    from dflash.data.sources import resolve_source

    try:
        check_device(args.device)
        check_checkpoint(args.checkpoint, args.allow_unhealthy)  # unhealthy: refused unless allowed
        set_name, chosen = None, None
        if args.prompts:  # read once, before any model loads
            set_name, chosen = load_prompt_set(args.prompts)
            if asked is not None and asked > len(chosen):
                raise EvalInputError(f"--num-prompts {asked} asked, but --prompts {args.prompts} holds "
                                     f"{len(chosen)} prompts; give --num-prompts {len(chosen)} or fewer")
            chosen = stratified(chosen, len(chosen) if asked is None else asked)
            args.num_prompts = len(chosen)
        if args.data:
            resolve_source(args.data, "--data")  # an unknown source fails here, before loading any model
        # the run's [data] table (its held-out prompts): a broken config.toml is said before the
        # models load, not after a minute of loading them
        data_cfg = run_data_config(Path(args.checkpoint))
        heldout = bool(args.data) and data_cfg is not None and data_cfg.source == args.data and data_cfg.holdout != 0
        # the run's held-out measure: the defaults its own evaluator decoded with ([eval])
        run_eval = run_eval_config(Path(args.checkpoint)) if heldout else None
        if args.prompt_turn == "last" and not heldout:
            raise EvalInputError("--prompt-turn last needs the run's held-out conversations: give --data the "
                                 "run's [data].source, from a checkpoint inside its run directory")
    except (EvalInputError, DataError) as exc:
        print(f"dflash.eval: {exc}", file=sys.stderr)
        return 2
    if args.num_prompts is None:
        args.num_prompts = run_eval.prompts if run_eval is not None else DEFAULT_NUM_PROMPTS
    if args.max_new_tokens is None:
        args.max_new_tokens = run_eval.max_new_tokens if run_eval is not None else DEFAULT_MAX_NEW_TOKENS
    if args.max_prompt_tokens is None:
        args.max_prompt_tokens = run_eval.max_prompt_tokens if run_eval is not None else DEFAULT_MAX_PROMPT_TOKENS

    def say(line: str) -> None:  # progress on stderr, terminal or not; --quiet drops it
        if not args.quiet:
            print(f"dflash.eval: {line}", file=sys.stderr, flush=True)

    from dflash.checkpoint.model_files import load_drafter, locate_target
    from dflash.data.tokenizer import load_tokenizer
    from dflash.errors import ConfigError
    from dflash.model.target import for_generation, load_target
    from dflash.observe.runlog import quiet_progress_bars_when_piped

    quiet_progress_bars_when_piped()  # no "Loading weights" tqdm bar in a log file
    try:
        drafter, dc, tc = load_drafter(args.checkpoint, args.device)
    except ValueError as exc:
        print(f"dflash.eval: {exc}", file=sys.stderr)
        return 2
    # a run trained with flex_attention decodes with sdpa: same outputs, no compile per length
    drafter.cfg = dc = msgspec.structs.replace(dc, attn_implementation="sdpa")
    if args.block_size is not None:
        try:
            drafter.serve_at_block_size(args.block_size)
        except ValueError as exc:
            print(f"dflash.eval: --block-size {args.block_size}: {exc}", file=sys.stderr)
            return 2
        dc = drafter.cfg
    if args.jacobi_passes is not None:
        passes = variant_of(dc.variant).reads("jacobi_passes")
        if not passes or args.jacobi_passes < 0:
            why = (f"this drafter is a {dc.variant} drafter; only XPress decodes with Jacobi passes"
                   if not passes else "give 0 or more passes")
            print(f"dflash.eval: --jacobi-passes {args.jacobi_passes}: {why}", file=sys.stderr)
            return 2
        drafter.cfg = dc = msgspec.structs.replace(dc, jacobi_passes=args.jacobi_passes)
    tc = locate_target(tc, args.checkpoint)  # paths recorded relative to where training started
    if args.dtype != "auto":
        tc = msgspec.structs.replace(tc, dtype=args.dtype)
    if args.target_quantization != "as-trained":
        tc = msgspec.structs.replace(tc, quantization=args.target_quantization)
    try:
        target = load_target(for_generation(tc), args.device, dc.num_layers, need_final=True)
    except FileNotFoundError as exc:  # target.path found neither from here nor above the checkpoint
        print(f"dflash.eval: {exc} (recorded relative to the directory training started in: run "
              "dflash.eval from there)", file=sys.stderr)
        return 2
    except ConfigError as exc:  # e.g. --target-quantization fp8 on a CPU or without torchao
        flag = f"--target-quantization {args.target_quantization}: " if args.target_quantization != "as-trained" else ""
        print(f"dflash.eval: {flag}{exc}", file=sys.stderr)
        return 2
    if target.layer_ids != list(dc.target_layer_ids):
        print(f"dflash.eval: target layers {target.layer_ids} != drafter's {dc.target_layer_ids}",
              file=sys.stderr)
        return 2
    drafter.to(target.model.dtype)
    head = target.shared_head()
    tok = load_tokenizer(tc.tokenizer_source)
    try:
        ids = [] if chosen else prompt_ids(args, tok, None, data_cfg)
    except (EvalInputError, DataError, ValueError, KeyError) as exc:
        print(f"dflash.eval: {exc}", file=sys.stderr)
        return 2
    if not chosen and not ids:  # a --prompts set has at least one prompt (checked above)
        print(f"dflash.eval: no usable prompt in --data {args.data} (every conversation opens with an "
              "assistant turn)", file=sys.stderr)
        return 2
    if not chosen and len(ids) < args.num_prompts:  # decode what was asked, or say how many exist
        if data_cfg is not None and data_cfg.source == args.data and data_cfg.holdout != 0:
            where = f"the run's held-out conversations of {args.data}"
        else:
            where = f"--data {args.data}"
        have = f"{len(ids)} usable prompt{'' if len(ids) == 1 else 's'}"
        if asked is not None:
            print(f"dflash.eval: --num-prompts {asked} asked, but {where} holds {have}; give --num-prompts "
                  f"{len(ids)} or fewer", file=sys.stderr)
            return 2
        default = "the run's eval.prompts" if run_eval is not None else "the default"
        print(f"dflash.eval: decoding the {have} of {where} (fewer than {default}, {args.num_prompts})",
              file=sys.stderr)
    categories, next_turn = [args.data] * len(ids), None
    if chosen:
        turns = sum(len(c.turns) for c in chosen)
        what = f"{set_name}: {over_text(len(chosen), args.max_new_tokens, turns)}"
    else:
        source = f"{args.data}, the run's held-out conversations" if heldout else f"--data {args.data}"
        what = f"{source}: {over_text(len(ids), args.max_new_tokens)}"
    if args.prompt_turn == "last":
        what += ", each the context before its last assistant turn"
    what += f", prompts cut to their last {args.max_prompt_tokens} tokens"
    if run_eval is not None:
        what += " (the run's [eval] settings; flags override them)"
    threads = f", {torch.get_num_threads()} CPU thread(s)" if torch.device(args.device).type == "cpu" else ""
    threads += ", CUDA graphs (--no-cuda-graphs: eager)" if args.cuda_graphs and threads == "" else ""
    extra = "; the target alone is timed beside each decode (--no-speedup skips it)" if not args.no_speedup else ""
    extra += f"; sampled at T={args.temperature:g} too" if args.temperature > 0 else ""
    say(f"{what}; {args.device}, {str(target.model.dtype).removeprefix('torch.')}{threads}{extra}")
    try:
        if chosen:
            next_turn = Turns(tok, chosen, args.max_prompt_tokens, data_cfg, args.device)
            prompts, categories = next_turn.first(), [p.category for p in chosen]
        else:
            prompts = [torch.tensor(x, device=args.device) for x in ids]
        with sigterm_ends_early() as stop_early:
            res = evaluate(target, drafter, head, prompts, args.max_new_tokens, temperature=args.temperature,
                           top_p=args.top_p, top_k=args.top_k, seed=args.seed, categories=categories,
                           next_turn=next_turn, speed=not args.no_speedup, cuda_graphs=args.cuda_graphs,
                           tree_budget=args.tree_budget, time_limit_s=args.time_limit, started_at=started_at,
                           stop_early=stop_early, progress=ProgressLines(say) if not args.quiet else None)
    except DataError as exc:  # a chat template that cannot render a later turn
        print(f"dflash.eval: {exc}", file=sys.stderr)
        return 2
    res.prompt_set = set_name or args.data
    res.max_new_tokens, res.heldout = args.max_new_tokens, heldout
    res.projection = project_8b(res.tau)
    if args.json:
        print(msgspec.json.encode(res).decode())
        return 0
    if len(res.per_prompt) <= PER_PROMPT_LINES:
        for r in res.per_prompt:
            print(format_prompt(r.prompt, r))
    print(format_headline(res))
    print(format_result(res))
    if chosen:
        print(format_categories(res))
    if len(res.by_length) > 1:
        print(format_by_length(res))
    print(format_speed(res))
    return 0

