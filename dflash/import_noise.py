"""Log lines other packages print while they import, which say nothing about the user's run.

transformers imports torchao (its quantizer registry) as soon as a model class loads, when torchao
is installed (``.[test]`` installs it). torchao then logs a WARNING for each of its prebuilt CUDA
libraries it cannot load here (``Failed to load .../torchao/_C_mxfp8...so``: built for another
Python or CUDA; nothing in dflash needs them, and float8 training checks torchao itself,
:mod:`dflash.model.drafter_fp8`) and that Triton is missing (a CPU machine), and its enum
registrations make torch log a deprecation notice (``... is an Enum subclass and is now natively
supported by torch.compile ...``, ``torch/utils/_pytree.py``). Every command that loads a model
printed these five lines before its own output.

:func:`quiet_import_noise` drops exactly those messages, by logger and text: any other record of
those loggers still gets through. The entry points that load a model (``python -m dflash.run``,
``dflash.eval``, ``dflash.regenerate``, ``dflash.pretrain``, ``dflash.import_gguf``, the isolated
evaluator's process) call it first; a library user's process is left as it is.
"""

from __future__ import annotations

import logging
import re

__all__ = ["NOISE", "quiet_import_noise"]

NOISE = (
    ("torchao", re.compile(r"^Failed to load \S*torchao[/\\]_C\S*\.so: ")),
    ("torchao.kernel.intmm", re.compile(r"^Warning: Detected no triton, on systems without Triton")),
    ("torch.utils._pytree", re.compile(r" is an Enum subclass and is now natively supported by torch\.compile ")),
)
"""``(logger name, message pattern)`` of each dropped line: the logger that emits it, so a
message of the same text from elsewhere is kept."""


class _Drop(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet_import_noise() -> None:
    """Install the filters of :data:`NOISE` on their loggers (idempotent). Call before the first
    model import: a filter on a logger applies to the records it emits from then on."""
    for name, pattern in NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.pattern is pattern for f in logger.filters):
            logger.addFilter(_Drop(pattern))
