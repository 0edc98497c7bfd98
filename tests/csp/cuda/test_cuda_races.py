"""csp on CUDA prevents the tensor-lifetime race class (failure mode 1 of docs/failure-modes.md).

The cases live in ``benchmarks/micro/cuda_races.py`` (see its docstring); here they run with few trials.
On a GPU (tests marked ``gpu``): the naive hand-off of every case corrupts at least one trial, the
csp hand-off of the same graph corrupts none although its consumer let go of the tensor before
its read ran, and a csp CUDA pipeline runs clean under PyTorch's CUDA stream sanitizer (which
does flag the naive hand-off). On CPU the same graphs run as a smoke test of the harness.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "micro" / "cuda_races.py"
_spec = importlib.util.spec_from_file_location("cuda_races", SCRIPT)
races = importlib.util.module_from_spec(_spec)
sys.modules["cuda_races"] = races  # msgspec resolves the Structs' annotations through it
_spec.loader.exec_module(races)

pytestmark = pytest.mark.timeout(300)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device: these are GPU stream races")
needs_two = pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
SINGLE_GPU = ["d2h_unwaited_read", "d2h_source_freed", "h2d_pinned_reuse", "forward_buffer_reuse"]
WINDOW_MS = 20.0  # each deliberate delay; the host-side hand-off takes microseconds
NUMEL = 1 << 20
CSAN_RACE = "CSAN detected a possible data race"


@pytest.fixture(scope="module")
def cycles() -> int:
    return races.calibrate_cycles(WINDOW_MS)


def _run(case: str, mode: str, trials: int, cycles: int) -> dict:
    return races.run_case(case, mode, trials=trials, numel=NUMEL, cycles=cycles,
                          devices=races.case_devices(case, cuda=True))


def _check_csp(case: str, cycles: int, trials: int = 16) -> None:
    r = _run(case, "csp", trials, cycles)
    assert r["corrupted"] == 0, r
    if case in races.LIFETIME:
        # The stress was real: the consumer's last reference was gone before its read ran, and the
        # allocator still did not hand the block to the producer's next forward (record_stream).
        assert r["released"] == trials and r["block_reused"] == 0, r


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", SINGLE_GPU)
def test_naive_handoff_corrupts(case, cycles):
    """The race class is real on this GPU: without events / record_stream / a pool, data is wrong."""
    r = _run(case, "naive", 8, cycles)
    assert r["corrupted"] >= 1, r


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", SINGLE_GPU)
def test_csp_handoff_never_corrupts(case, cycles):
    """Invariant: a tensor crossing a csp channel / to_device / PinnedPool is never read early and
    its memory is never reused while a consumer stream still reads it."""
    _check_csp(case, cycles)


@pytest.mark.gpu
@needs_two
def test_cross_device_naive_corrupts_and_csp_does_not(cycles):
    """cuda:0 -> cuda:1: a plain .to() in the consumer thread is not ordered after the producer."""
    assert _run("cross_device", "naive", 8, cycles)["corrupted"] >= 1
    _check_csp("cross_device", cycles)


def _csan(mode: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), "--csan", mode], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.gpu
@needs_cuda
def test_csp_pipeline_is_clean_under_the_cuda_sanitizer():
    """Channels, to_device (H2D on a copy stream, D2H), PinnedPool and the race graphs' csp
    variants, with every process thread under CSAN: no data race reported."""
    p = _csan("csp")
    out = p.stdout + p.stderr
    assert CSAN_RACE not in out, out[-6000:]
    assert p.returncode == 0, out[-6000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["csan"] is True and result["ok"] is True, result  # the sanitizer really was on


@pytest.mark.gpu
@needs_cuda
def test_the_cuda_sanitizer_flags_the_naive_handoff():
    """Positive control: the same pipeline with the tensor hidden from csp is reported."""
    p = _csan("naive")
    assert p.returncode != 0 and CSAN_RACE in p.stderr, (p.stdout + p.stderr)[-6000:]


# ---- CPU: the same graphs and code paths, no race possible ------------------------------------------
@pytest.mark.parametrize("mode", ["naive", "csp"])
@pytest.mark.parametrize("case", SINGLE_GPU)
def test_harness_runs_every_case_on_cpu(case, mode):
    trials = 3
    r = races.run_case(case, mode, trials=trials, numel=256, cycles=0, devices=races.case_devices(case, cuda=False))
    assert r["corrupted"] == 0, r
    if case in races.LIFETIME:
        assert r["released"] == trials, r  # a csp channel keeps no reference to a delivered item


def test_dry_run_writes_the_result_file(tmp_path, capsys):
    out = tmp_path / "cuda_races.json"
    assert races.main(["--dry-run", "--trials", "2", "--numel", "256", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"].startswith("cpu (dry run")
    assert [c["case"] for c in result["cases"]] == SINGLE_GPU
    for c in result["cases"]:
        assert c["trials"] == 2 and c["naive_corrupted"] == 0 and c["csp_corrupted"] == 0
    assert result["skipped"][0]["case"] == "cross_device" and result["errors"] == []
    assert json.loads(capsys.readouterr().out) == result


@pytest.mark.parametrize("mode", ["csp", "naive"])
def test_sanitizer_pipeline_runs_on_cpu(mode, capsys):
    assert races.main(["--dry-run", "--csan", mode]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["csan"] is False and result["ok"] is True
    assert set(result["corrupted"]) == (set(SINGLE_GPU) if mode == "csp" else set())
