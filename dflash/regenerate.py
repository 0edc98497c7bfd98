"""Regenerate a dataset's assistant turns with the target itself: labels that match inference.

At inference a drafter must predict the *target's* continuation, not the dataset's text. This
command answers each conversation's user turns with the target (greedy by default, or sampled) and
writes OpenAI-style JSONL that ``[data].source`` reads, as the vLLM speculators project's
``regenerate_responses`` and SpecForge's data regeneration do::

    python -m dflash.regenerate GRAPH.toml -o responses.jsonl [--max-new-tokens 256] [--temperature 0]

What it reads: ``[data]`` (source, format, max_samples) and ``[target]`` of the graph file (``--set``
overrides work as in ``dflash.run``). Each conversation keeps its system and user turns (up to
``--max-turns`` assistant turns; the rest of the conversation is cut); assistant
turn ``k`` is replaced by the target's answer to the conversation so far (user turns plus the
answers already regenerated), generated in rounds: round ``k`` answers turn ``k`` of every
conversation of a chunk (:mod:`dflash.model.answers`; ``--engine auto``, the default, is the slots
engine on a GPU for a target it runs, rows over one static KV cache refilled as answers end, and
``transformers``' ``generate`` over left-padded batches elsewhere: :func:`choose_engine`).
Generation stops at the tokenizer's end-of-turn token or at ``--max-new-tokens``, and with
``--repetition-keep N`` that many tokens into a repetition loop (:mod:`dflash.repetition`).

Output lines: ``{"messages": [...], "source_index": i, "finished": bool}``; ``source_index`` is the
record's index in the source file, ``finished`` False when a turn hit ``--max-new-tokens`` or was
cut in a loop.

Resumable: lines are appended and flushed one finished conversation at a time; a second run with
the same ``-o`` skips the ``source_index`` values already written (a torn last line from a kill is
cut off first), so an interrupted run loses at most the chunk in flight. ``--time-limit`` plans
to lose none: the run starts no chunk that the last one's rate says would end after the limit,
sizes the last ones to the time left, and stops by itself (:class:`dflash.regenerate_plan.ChunkPlanner`);
give an outer limit (``timeout``) some seconds more. The generation settings are kept in
``OUT.meta.json`` (rewritten at every start, atomically: a temporary file renamed over it);
resuming with different settings is refused, and an unreadable one is an error naming it.

Counted, never silently dropped: the source's own skip reasons (``malformed_json``...),
``leading_assistant_turns_dropped`` (assistant turns before the first user turn are dropped, the
rest of the conversation kept; counted, not a skip), ``prompt_too_long`` (context longer than
``--max-prompt-tokens`` before some turn; the conversation keeps the turns answered so far, or is
dropped if none), ``no_user_turn`` (nothing to answer), ``empty_response`` (the target answered
with nothing; that conversation is dropped, an empty turn cannot be trained),
``excluded`` (its ``source_index`` is listed in ``--exclude``: e.g. the eval prompts, so a
drafter trained on the output never sees them).

Exit codes: 0 done (or stopped at ``--time-limit``, everything answered written), 2 bad arguments,
config or data, 130 interrupted (what was written is kept).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

from dflash.regenerate_files import (  # stdlib only: --help stays quick
    done_indices,
    excluded_indices,
    generation_settings,
    read_meta_settings,
    write_meta,
)
from dflash.regenerate_plan import (  # stdlib only at import, as the above
    ChunkPlanner,
    choose_engine,
)

__all__ = ["choose_engine", "done_indices", "excluded_indices", "generation_settings", "main",
           "read_meta_settings", "regenerate", "write_meta"]


def regenerate(conversations: list, source_index: list[int], model, tok, args, out_path: Path,
               skipped: Counter, device, progress: bool = True, planner: ChunkPlanner | None = None) -> int:
    """Regenerate ``conversations`` (module docstring); append finished ones to ``out_path``.

    ``planner`` sizes the chunks (default: ``--chunk`` conversations each, no deadline); one with a
    deadline may stop before the end (its ``stopped`` then says so).

    Returns the number of conversations written by this call.
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from dflash.model import answers as target_answers

    eos = [t for t in {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
           if isinstance(t, int) and t >= 0 and t != tok.unk_token_id]
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    written = 0
    planner = planner or ChunkPlanner(args.chunk, args.batch_size or 1)
    columns = (TextColumn("regenerating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with open(out_path, "a", encoding="utf-8") as f, \
            Progress(*columns, console=Console(stderr=True), disable=not progress) as bar:
        task = bar.add_task("", total=len(conversations))
        start = 0
        while size := planner.next_size(len(conversations) - start):
            t_chunk = planner.clock()
            chunk = conversations[start: start + size]
            state, turn = [], 0
            for c in chunk:
                first_user = next((j for j, m in enumerate(c) if m["role"] == "user"), len(c))
                lead = [m for m in c[:first_user] if m["role"] == "assistant"]
                if lead:        # an answer to no question: drop it, keep the rest of the conversation
                    skipped["leading_assistant_turns_dropped"] += 1
                rest = [m for m in c[:first_user] if m["role"] != "assistant"] + list(c[first_user:])
                state.append({"messages": [], "rest": rest, "finished": True, "alive": True,
                              "answered": 0})
            while True:
                # advance each conversation to its next assistant turn (copying system/user turns)
                todo = []
                for s in state:
                    if s["answered"] >= args.max_turns:
                        s["alive"] = False                   # later turns are not regenerated
                    while s["alive"] and s["rest"] and s["rest"][0]["role"] != "assistant":
                        s["messages"].append(s["rest"].pop(0))
                    if s["alive"] and s["rest"]:
                        ctx = tok.apply_chat_template(s["messages"], tokenize=False,
                                                      add_generation_prompt=True)
                        ids = tok(ctx, add_special_tokens=False)["input_ids"]
                        if len(ids) > args.max_prompt_tokens:
                            if s["answered"] == 0:
                                s["answered"] = -1           # nothing answered: counted, dropped
                            skipped["prompt_too_long"] += 1
                            s["alive"] = False
                        else:
                            todo.append((s, ids))
                if not todo:
                    break
                t_round = time.perf_counter()
                answers = target_answers.answer(model, [ids for _, ids in todo],
                                                max_new_tokens=args.max_new_tokens, eos=eos, pad=pad,
                                                temperature=args.temperature, top_p=args.top_p,
                                                batch_size=args.batch_size, engine=args.engine,
                                                cache=args.cache, repetition_keep=args.repetition_keep)
                turn += 1
                _say_round(bar.console, start, len(chunk), turn, answers, time.perf_counter() - t_round,
                           args.max_new_tokens)
                for (s, _), (ans, fin) in zip(todo, answers):
                    text = tok.decode(ans, skip_special_tokens=True)
                    s["rest"].pop(0)
                    if not text.strip():
                        skipped["empty_response"] += 1
                        s["alive"], s["answered"] = False, -1
                        continue
                    s["messages"].append({"role": "assistant", "content": text})
                    s["finished"] &= fin
                    s["answered"] += 1
            for s, i in zip(state, source_index[start: start + size]):
                if s["answered"] == 0:
                    skipped["no_user_turn"] += 1
                if s["answered"] > 0:
                    last = max(j for j, m in enumerate(s["messages"]) if m["role"] == "assistant")
                    f.write(json.dumps({"messages": s["messages"][: last + 1], "source_index": i,
                                        "finished": s["finished"]}, ensure_ascii=False) + "\n")
                    written += 1
            f.flush()
            os.fsync(f.fileno())
            planner.finished(size, planner.clock() - t_chunk)
            bar.advance(task, size)
            start += size
    return written


def _say_round(console, start: int, size: int, turn: int, answers: list[tuple[list[int], bool]],
               seconds: float, max_new_tokens: int) -> None:
    """One line per round of answers (a turn of a chunk): how many, their tokens, the tokens per
    second the engine reached and how many hit ``--max-new-tokens`` (or were cut in a repetition
    loop: unfinished and shorter), so a slow regeneration shows where it stands (terminal or log
    alike)."""
    tokens = sum(len(a) for a, _ in answers)
    cut = sum(not fin and len(a) >= max_new_tokens for a, fin in answers)
    looped = sum(not fin and len(a) < max_new_tokens for a, fin in answers)
    console.print(f"dflash.regenerate: conversations {start + 1}-{start + size}, turn {turn}: {len(answers)} "
                  f"answer{'s' if len(answers) != 1 else ''}, {tokens} tokens in {seconds:.1f} s "
                  f"({tokens / max(seconds, 1e-9):.0f} tokens/s; {cut} cut at --max-new-tokens"
                  + (f", {looped} in a repetition loop)" if looped else ")"),
                  markup=False, highlight=False, soft_wrap=True)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    from csp.cli import make_parser

    p = make_parser(
        "python -m dflash.regenerate",
        "Answer a dataset's user turns with the target itself and write JSONL that [data].source reads.",
        details="Each assistant turn is replaced by the target's answer to the conversation so far "
                "(greedy unless --temperature > 0).\nResumable: run the same command again after an "
                "interruption; finished conversations are never redone.",
        exit_codes={0: "done, or stopped at --time-limit (run it again to continue)",
                    2: "bad arguments, config or data (nothing generated)",
                    130: "interrupted (everything finished so far is kept)"},
        examples=["python -m dflash.regenerate examples/dflash-tiny.toml -o runs/regenerated.jsonl",
                  "python -m dflash.regenerate G.toml -o out.jsonl --temperature 0.7 --max-turns 2"])
    p.add_argument("graph", help="graph file (TOML); its [data] and [target] tables are used")
    p.add_argument("-o", "--out", required=True, help="output JSONL (appended to; resumes)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, as in dflash.run")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer at most (default 256)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024,
                   help="longest context answered, in tokens (default 1024)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--max-turns", type=int, default=1_000_000,
                   help="answer at most N assistant turns per conversation; the rest of it is cut "
                        "(default: all)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="rows answered at once (default: with --engine slots on a GPU as many as fill half of "
                        "its free memory with KV cache, at most 512; otherwise 32)")
    p.add_argument("--engine", choices=("auto", "generate", "continuous", "slots"), default="auto",
                   help="auto (default): slots on a GPU for a target it runs, else generate; generate: left-padded "
                        "batches; continuous: transformers' continuous batching (a paged KV cache, answers "
                        "scheduled as others finish; transformers >= 5); slots: --batch-size rows over a static "
                        "KV cache, the decode step a CUDA graph, a row refilled as its answer ends (Llama and "
                        "Qwen3 targets)")
    p.add_argument("--cache", choices=("dynamic", "static"), default="dynamic",
                   help="the KV cache of --engine generate: dynamic (grows by concatenation; default) or static "
                        "(allocated once per batch; transformers compiles the decode step, once per batch shape)")
    p.add_argument("--chunk", type=int, default=None,
                   help="conversations per resumable unit: written together, lost together on a kill (default "
                        "8 x --batch-size with --engine slots, so that refilled rows stay busy; otherwise 64)")
    p.add_argument("--num-conversations", type=int, default=None,
                   help="regenerate at most N conversations of the source (default: the graph's data.max_samples)")
    p.add_argument("--exclude", default=None, metavar="FILE",
                   help="JSONL whose lines carry a source_index (e.g. eval prompts): those conversations "
                        "are not answered (counted as 'excluded')")
    p.add_argument("--repetition-keep", type=int, default=None, metavar="N",
                   help="end an answer that falls into a repetition loop (a 16-token window repeating an "
                        "earlier one of the same answer) N tokens after the loop's start, unfinished; the "
                        "slots engine stops decoding it there. Default: answers run to their end token or "
                        "--max-new-tokens (small targets' greedy answers often loop until the limit)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="end within about S seconds of the command's start (loading included): start no "
                        "chunk that the rate of the last one says would not finish, size the last ones to "
                        "the time left, and stop with everything answered written (exit 0; run the same "
                        "command again to continue). The first chunk is one --batch-size of conversations, "
                        "to measure the rate. Default: none (a kill loses the chunk in flight)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", default=None, help="where the target runs (default: cuda if available, else cpu)")
    args = p.parse_args(argv)
    if min(args.max_new_tokens, args.max_prompt_tokens, args.batch_size or 1, args.chunk or 1, args.max_turns) < 1 \
            or (args.num_conversations is not None and args.num_conversations < 1):
        p.error("--max-new-tokens, --max-prompt-tokens, --max-turns, --batch-size, --chunk and "
                "--num-conversations must be >= 1")
    if args.time_limit is not None and not 0 < args.time_limit < float("inf"):
        p.error("--time-limit must be a finite number of seconds > 0")
    if args.repetition_keep is not None and args.repetition_keep < 0:
        p.error("--repetition-keep must be >= 0 (tokens kept from a loop's start)")
    if not 0 <= args.temperature < float("inf") or not 0 < args.top_p <= 1:  # nan fails both comparisons
        p.error("--temperature must be a finite number >= 0 and --top-p in (0, 1]")
    return args


def out_of_memory_line(args: argparse.Namespace, out: Path, device) -> str:
    """What to change after the GPU ran out of memory: the setting that sizes a round's memory and
    may change on resume (``--batch-size``: rows x (prompt + answer) positions of KV cache per layer),
    and how much of the GPU other processes hold (two passes sharing a GPU each need a round's room)."""
    import torch

    kept = len(done_indices(out))
    held = ""
    if torch.cuda.is_available() and str(device).startswith("cuda"):
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        mine = torch.cuda.memory_reserved()
        held = (f"; other processes hold {(total - free - mine) / 2**30:.1f} of the GPU's "
                f"{total / 2**30:.1f} GiB")
    return (f"the GPU ran out of memory answering a chunk{held}. {out} keeps its {kept} finished "
            f"conversations; lower --batch-size (now {args.batch_size}: rows answered at once) or free "
            "the GPU, then run the same command again to continue (the other settings must stay)")


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()   # --time-limit counts from here, as a timeout around the command does
    args = _parse(argv)
    args.deadline = None if args.time_limit is None else started + args.time_limit
    locks: list = []
    try:
        return _main(args, locks)
    finally:
        for f in locks:
            f.close()                                  # releases the output's lock


def _main(args: argparse.Namespace, locks: list) -> int:
    import msgspec
    import torch

    from dflash.data import DataError, load_tokenizer
    from dflash.data.sources import read_source
    from dflash.errors import DFlashError
    from dflash.model.target import for_generation, load_target
    from dflash.observe.runlog import quiet_progress_bars_when_piped
    from dflash.run.config import load_config

    quiet_progress_bars_when_piped()  # no "Loading weights" tqdm bar in a log file
    out = Path(args.out)
    from dflash.model.answers import check_engine

    try:
        if args.engine != "auto":
            check_engine(args.engine)  # before any work: the continuous engine needs transformers 5
        cfg = load_config(args.graph, args.overrides)
        limit = args.num_conversations or cfg.data.max_samples
        records = read_source(cfg.data.source, cfg.data.format, limit)
        tok = load_tokenizer(cfg.target.tokenizer_source)
        settings = generation_settings(args, cfg.data.source)
        meta = out.with_name(out.name + ".meta.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        lock = open(out.with_name(out.name + ".lock"), "a+")  # held until main returns
        locks.append(lock)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise DataError(f"{out} is being written by another dflash.regenerate (lock "
                            f"{lock.name}); wait for it or use another -o") from None
        recorded = read_meta_settings(meta, out)
        if recorded is not None and recorded != settings:
            raise DataError(f"{out} was written with other settings ({meta}); use another -o or "
                            "the same --max-new-tokens/--temperature/--top-p/--seed")
        done = done_indices(out)
        excluded = excluded_indices(Path(args.exclude)) if args.exclude else set()
        write_meta(meta, {"settings": settings, "graph": str(args.graph),
                          "target": cfg.target.path or cfg.target.preset})
    except (OSError, ValueError, DFlashError, msgspec.ValidationError) as e:  # DataError, ConfigError
        print(f"dflash.regenerate: {e}", file=sys.stderr)
        return 2
    todo = [(c, i) for c, i in zip(records.conversations, records.source_index)
            if i not in done and i not in excluded]
    from dflash.eval.inputs import EvalInputError, check_device

    try:  # a CUDA device this machine lacks: one line, before the target loads
        device = check_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except EvalInputError as e:
        print(f"dflash.regenerate: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    if cfg.target.path is None and cfg.target.vocab_size is None:
        cfg.target.vocab_size = len(tok)
    model = load_target(for_generation(cfg.target), device, cfg.drafter.num_layers,
                        need_final=True).model.eval()
    try:  # before any answer: a family the slots engine does not run is one line
        how = choose_engine(args, model, device)
    except ValueError as e:
        print(f"dflash.regenerate: {e}", file=sys.stderr)
        return 2
    print(f"dflash.regenerate: {len(records.conversations)} conversations of {cfg.data.source}, "
          f"{len(done)} already in {out}, {len(todo)} to answer on {device}; {how}", file=sys.stderr)
    skipped: Counter[str] = Counter(records.skipped)
    if n_excluded := sum(i in excluded for i in records.source_index):
        skipped["excluded"] = n_excluded
    t0 = time.perf_counter()
    planner = ChunkPlanner(args.chunk, args.batch_size, deadline=args.deadline)
    try:
        written = regenerate([c for c, _ in todo], [i for _, i in todo], model, tok, args, out,
                             skipped, device, progress=sys.stderr.isatty(), planner=planner)
    except KeyboardInterrupt:
        kept = len(done_indices(out))
        print(f"dflash.regenerate: interrupted; {out} holds {kept} finished conversations (the chunk "
              f"in flight, up to --chunk {args.chunk}, is redone); run the same command again to "
              "continue", file=sys.stderr)
        return 130
    except torch.OutOfMemoryError:
        print(f"dflash.regenerate: {out_of_memory_line(args, out, device)}", file=sys.stderr)
        return 1
    counts = ", ".join(f"{k} {v}" for k, v in sorted(skipped.items())) or "none"
    if planner.stopped:
        left = len(todo) - planner.conversations_done
        print(f"dflash.regenerate: stopped at --time-limit {args.time_limit:g}: the next chunk would not "
              f"have finished in time ({left} conversations left); run the same command again to continue",
              file=sys.stderr)
    print(f"dflash.regenerate: wrote {written} conversations to {out} in {time.perf_counter() - t0:.0f}s "
          f"({len(done) + written} in total); skipped: {counts}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from dflash.import_noise import quiet_import_noise

    quiet_import_noise()
    sys.exit(main())
