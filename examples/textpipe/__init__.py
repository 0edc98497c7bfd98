"""A word-count pipeline that shows csp is generic (nothing here knows about DFlash).

    read --lines--> tokenize[0..1] --tokens (ordered)--> count --counts--> merge

* ``textpipe.lines`` (source, thread): lines of a text file, or generated sentences; polls
  ``ctx.stopping()`` so Ctrl-C drains instead of killing.
* ``textpipe.tokenize`` (thread, ``replicas = 2``): fan-out of ``lines`` over the replicas, fan-in of
  their output into the ordered ``tokens`` channel, which restores line order by ``seq``.
* ``textpipe.count`` (async anyio task): counts words over ``batch`` consecutive lines.
* ``textpipe.merge`` (sink, thread): sums the counts and writes ``RUN_DIR/textpipe/top_words.json``.

Run it: ``python -m csp.run examples/text_pipeline.toml``.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import re
import time
from typing import Annotated, Iterator

import anyio
import msgspec

import csp

log = logging.getLogger("examples.textpipe")

WORDS = ("the channel process graph item queue thread task stream buffer token word line count "
         "merge split drain stop start send receive close open batch fill wait block busy").split()
_WORD = re.compile(r"[A-Za-z0-9']+")


class Line(msgspec.Struct, frozen=True):
    """One input line; ``seq`` is its 0-based position in the input."""

    seq: int
    text: str


class Tokens(msgspec.Struct, frozen=True):
    """The words of line ``seq``."""

    seq: int
    words: list[str]


class Counts(msgspec.Struct, frozen=True):
    """Word counts over ``lines`` consecutive lines, the first being ``first_seq``."""

    first_seq: int
    lines: int
    counts: dict[str, int]


def generate_lines(n: int, seed: int = 0) -> Iterator[str]:
    """``n`` deterministic pseudo-random sentences of 3-12 words from :data:`WORDS`, lazily."""
    rng = random.Random(seed)
    for _ in range(n):
        yield " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize() + "."


def read_lines(path: str) -> Iterator[str]:
    """The lines of a UTF-8 text file, without line endings, lazily."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield line.rstrip("\r\n")


def tokenize(text: str, lowercase: bool = True) -> list[str]:
    """Split ``text`` into words (letters, digits, apostrophes)."""
    words = _WORD.findall(text)
    return [w.lower() for w in words] if lowercase else words


@csp.register("textpipe.lines")
class ReadLines(csp.Process):
    """Source: lines of ``path`` (UTF-8), or ``generate`` sentences when ``path`` is empty."""

    class Options(csp.Strict):
        path: str = ""  # text file to read; empty = generate
        generate: Annotated[int, msgspec.Meta(ge=0)] = 1000  # generated lines (when path is empty)
        seed: int = 0

        def __post_init__(self) -> None:
            # Checked when the graph is built, so a typo is a one-line config error (exit 2)
            # rather than a process failure with a traceback once the run has started.
            if self.path and not os.path.isfile(self.path):
                raise ValueError(f"path: no such file: {self.path!r} (cwd {os.getcwd()})")

    outputs = {"line": Line}

    def run(self, inputs, outputs):
        opts = self.options
        lines = read_lines(opts.path) if opts.path else generate_lines(opts.generate, opts.seed)
        for seq, text in enumerate(lines):
            if self.ctx.stopping():
                log.info("%s: stop requested after %d lines", self.ctx.qualname, seq)
                return
            outputs["line"].send(Line(seq, text))


@csp.register("textpipe.tokenize")
class Tokenize(csp.Process):
    """Line -> Tokens, keeping ``seq`` so the ordered channel can restore line order."""

    class Options(csp.Strict):
        lowercase: bool = True
        sleep_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
        """Extra service time per line, in s (a stand-in for a slow stage that releases the GIL,
        such as a GPU forward; what-if tests use it). 0 = none."""

    inputs = {"line": Line}
    outputs = {"tokens": Tokens}

    def run(self, inputs, outputs):
        for line in inputs["line"]:
            if self.options.sleep_s:
                time.sleep(self.options.sleep_s)
            outputs["tokens"].send(Tokens(line.seq, tokenize(line.text, self.options.lowercase)),
                                   seq=line.seq)


@csp.register("textpipe.count")
class Count(csp.Process):
    """Tokens -> Counts over ``batch`` consecutive lines (an async process)."""

    class Options(csp.Strict):
        batch: Annotated[int, msgspec.Meta(ge=1)] = 32  # lines per Counts item
        sleep_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
        """Extra service time per line, in s (``anyio.sleep``; as tokenize's). 0 = none."""

    inputs = {"tokens": Tokens}
    outputs = {"counts": Counts}

    async def run(self, inputs, outputs):
        counter: collections.Counter[str] = collections.Counter()
        first, n = 0, 0
        async for tokens in inputs["tokens"]:
            if n == 0:
                first = tokens.seq
            if self.options.sleep_s:
                await anyio.sleep(self.options.sleep_s)
            with self.ctx.span("count"):
                counter.update(tokens.words)
            n += 1
            if n == self.options.batch:
                await outputs["counts"].asend(Counts(first, n, dict(counter)))
                counter, n = collections.Counter(), 0
        if n:
            await outputs["counts"].asend(Counts(first, n, dict(counter)))


@csp.register("textpipe.merge")
class Merge(csp.Process):
    """Sink: total word counts; writes ``RUN_DIR/textpipe/top_words.json`` when there is a run dir."""

    class Options(csp.Strict):
        top: int = 10

    inputs = {"counts": Counts}

    def setup(self):
        self.total: collections.Counter[str] = collections.Counter()
        self.lines = 0

    def run(self, inputs, outputs):
        for c in inputs["counts"]:
            self.total.update(c.counts)
            self.lines += c.lines

    def teardown(self):
        top = self.total.most_common(self.options.top)
        result = {"lines": self.lines, "words": sum(self.total.values()), "top": top}
        log.info("%d lines, %d words; top: %s", result["lines"], result["words"],
                 ", ".join(f"{w}={n}" for w, n in top[:5]))
        if self.ctx.run_dir is not None:
            out = self.ctx.run_dir / "textpipe" / "top_words.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1))


__all__ = ["Count", "Counts", "Line", "Merge", "ReadLines", "Tokenize", "Tokens", "generate_lines", "read_lines",
           "tokenize"]
