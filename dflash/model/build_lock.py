"""One module build at a time per process: :data:`BUILD_LOCK`.

transformers builds a model under process-wide patches: ``from_pretrained`` swaps
``torch.nn.init``'s functions for no-ops (every 5.x release) and, in 4.x, also
``nn.Module.register_parameter`` for one that puts each new parameter on the meta device
(``init_empty_weights``). A module built in another thread meanwhile gets those patches too:
uninitialised or meta-device weights, or a failed import when two builds race. The pipeline's
stages set up in threads of their own (targets, the trainer, the evaluator), so every build of a
target, a drafter or the shared embedding and LM head holds this lock. It is re-entrant, so a
build may call another (the evaluator builds its target, then its drafter, under one hold).
"""

from __future__ import annotations

import threading

__all__ = ["BUILD_LOCK"]

BUILD_LOCK = threading.RLock()
