"""Run directories that cannot be used and full disks: one line each, never a traceback."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from collections import namedtuple

import pytest

from dflash.checkpoint import is_healthy, list_checkpoints, read_meta
from dflash.checkpoint.config import checkpoint_bytes
from dflash.errors import ConfigError
from dflash.run.cli import EXIT_DISK_FULL, main
from dflash.run.validate import check_run_dir, disk_space_warnings
from tests.dflash.run.test_run_e2e import small

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def no_data_work(monkeypatch):
    """Fail the test if dflash.run gets as far as reading the data."""
    import dflash.data

    def boom(*args, **kwargs):
        raise AssertionError("load_dataset was called: the run directory error came after data work")

    monkeypatch.setattr(dflash.data, "load_dataset", boom)


def _cases(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with_ckpt_file = tmp_path / "run-ckpt-file"
    with_ckpt_file.mkdir()
    (with_ckpt_file / "checkpoints").write_text("x")
    return {
        "out_dir is a file": (a_file, rf"{a_file} is a file, not a directory"),
        "under a file": (a_file / "run", rf"{a_file} is a file, not a directory, so .* cannot be created"),
        "checkpoints is a file": (with_ckpt_file, rf"{with_ckpt_file / 'checkpoints'} is a file, not a directory"),
        # the config's own path check may name it first; check_run_dir does too (below)
        "component over 255": (tmp_path / ("r" * 300), r"(path component of 300 bytes \(at most 255\)|"
                                                     r"is 300 bytes, over the filesystem's limit of 255)"),
    }


@pytest.mark.parametrize("case", ["out_dir is a file", "under a file", "checkpoints is a file",
                                  "component over 255"])
def test_an_unusable_run_dir_is_one_line_exit_2_before_data_work(tmp_path, capsys, no_data_work, case):
    """Invariant: a run.out_dir that is a file (or under one), whose checkpoints/ is a file, or with
    a path component over the filesystem's 255-byte limit exits 2 with one line naming the path and
    the cause, before any data work (was an uncaught OSError traceback, exit 1)."""
    path, message = _cases(tmp_path)[case]
    assert main(small(path, tmp_path / "cache")) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if not x.startswith("warning:")]
    assert line.startswith("error: run.out_dir = ") and re.search(message, line), err


def test_check_run_dir_names_an_over_long_component(tmp_path):
    """Invariant: check_run_dir itself refuses a component over the filesystem's name limit (it
    never stats such a path, which would raise ENAMETOOLONG)."""
    with pytest.raises(ConfigError, match=r"is 300 bytes, over the filesystem's limit of 255"):
        check_run_dir(str(tmp_path / ("r" * 300) / "run"))


def test_a_read_only_filesystem_is_named(tmp_path, monkeypatch):
    """Invariant: an out_dir on a read-only filesystem is a ConfigError naming it (statvfs ST_RDONLY;
    faked here, since mounting needs privileges)."""
    real = os.statvfs
    fake = namedtuple("statvfs", "f_flag")

    def statvfs(p):
        return fake(real(p).f_flag | os.ST_RDONLY)

    monkeypatch.setattr(os, "statvfs", statvfs)
    with pytest.raises(ConfigError, match=rf"{tmp_path} is on a read-only filesystem"):
        check_run_dir(str(tmp_path / "run"))


def test_acquire_run_lock_turns_os_errors_into_one_line(tmp_path):
    """Invariant: acquire_run_lock itself never lets an OSError out (a race after the check)."""
    from dflash.run.run_dir import acquire_run_lock

    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"cannot create .*f/run"):
        acquire_run_lock(f / "run")


def test_free_space_short_of_the_checkpoints_warns(tmp_path, monkeypatch):
    """Invariant: before a run, less free space than keep_last + 1 checkpoints is a warning naming
    the device, the free space and the need; enough space is silent."""
    import shutil

    from dflash.run.config import load_config
    from dflash.run.resolve import resolve_drafter, target_hf_config
    from tests.dflash.run.test_run_e2e import GRAPH

    cfg = load_config(GRAPH)
    drafter = resolve_drafter(cfg, target_hf_config(cfg.target))
    one = checkpoint_bytes(drafter)
    assert one > 4 * 1000  # fp32 weights and two AdamW moments of a real drafter
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=one * 2))
    (w,) = disk_space_warnings(str(tmp_path / "run"), drafter, keep_last=3)
    assert "free, short of the" in w and "4 checkpoints" in w and "mounted at" in w
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=one * 4))
    assert disk_space_warnings(str(tmp_path / "run"), drafter, keep_last=3) == []


def test_a_full_disk_during_a_checkpoint_stops_cleanly_with_exit_4(tmp_path, capsys, monkeypatch):
    """Invariant: ENOSPC while a checkpoint is written: one error line naming the device and saying
    it is full, the partial .tmp-step_* removed, the previous checkpoint intact and healthy, no
    traceback on the terminal, and the documented exit code 4."""
    from dflash.checkpoint import writer

    real = writer.save_file
    calls = {"n": 0}

    def save_file(tensors, path, metadata=None):
        calls["n"] += 1
        if calls["n"] > 2:  # the first checkpoint's two files go through; the second one's do not
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(writer, "save_file", save_file)
    run = tmp_path / "run"
    code = main(small(run, tmp_path / "cache", steps=12))
    err = capsys.readouterr().err
    assert code == EXIT_DISK_FULL == 4, err[-3000:]
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert "no space left on device" in line and "is full" in line and "mounted at" in line
    assert "step_00000004" in line
    root = run / "checkpoints"
    assert not list(root.glob(".tmp-*"))
    assert [p.name for p in list_checkpoints(root)] == ["step_00000004"]
    assert is_healthy(root / "step_00000004") and read_meta(root / "step_00000004")["step"] == 4
    # csp's own record of the run says the exit code the process exits with (csp.inspect reads it)
    final = json.loads((run / "csp" / "stats.jsonl").read_text().splitlines()[-1])
    assert final["kind"] == "final" and final["exit_code"] == EXIT_DISK_FULL


def test_logging_that_cannot_write_says_so_once(tmp_path, capsys):
    """Invariant: when run.log cannot be written (a full disk), one warning line says so and later
    records are dropped: no "--- Logging error ---" traceback per record."""
    from dflash.observe import runlog

    runlog.setup(tmp_path)
    try:
        (handler,) = runlog.file_handlers()

        class Full:
            def write(self, s):
                raise OSError(errno.ENOSPC, "No space left on device")

            def flush(self):
                raise OSError(errno.ENOSPC, "No space left on device")

            def close(self):
                pass

        handler.stream.close()
        handler.stream = Full()
        for i in range(50):
            logging.getLogger("dflash.test").warning("line %d", i)
    finally:
        runlog.close()
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err
    assert err.count("warning: cannot write") == 1 and "run.log (No space left on device;" in err
    assert "bytes free there" in err  # the free space is named


def test_metrics_that_cannot_write_say_so_once(tmp_path, capsys):
    """Invariant: a metrics.jsonl write that fails (a full disk) warns once and drops later records
    instead of raising into the training stage."""
    from dflash.observe.metrics_writer import MetricsLog
    from dflash.records import SkipRecord

    m = MetricsLog(tmp_path / "metrics.jsonl")
    real = m._file

    class Full:
        closed = False

        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            real.close()

    m._file = Full()
    for step in range(5):
        m.write(SkipRecord(step=step))
    m.close()
    err = capsys.readouterr().err
    assert err.count("warning: cannot write") == 1 and "metrics.jsonl (No space left on device;" in err


class _FullFile:
    """A file on a full disk: every write and flush raises ENOSPC."""

    closed = False

    def write(self, b):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        self.closed = True


def test_observability_files_on_a_full_disk_cost_one_line_each(tmp_path, capsys, monkeypatch):
    """Regression: a full disk under csp's stats log logged a traceback every snapshot, then its
    close() raised: exit 1, a traceback, no summary. Invariant: the stats log and the trace that
    cannot be written are one line each naming the file and the free space, the run goes on to
    its end, the closing summary is printed, and the exit code is the run's own."""
    from csp.observe import statslog, trace

    real_start = statslog.StatsWriter.start

    def start_then_fill(self):  # the header is written; every later line meets a full disk
        self._file.close()
        self._file = _FullFile()
        real_start(self)

    def write_full(self, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(statslog.StatsWriter, "start", start_then_fill)
    monkeypatch.setattr(trace.Tracer, "write", write_full)
    run = tmp_path / "run"
    code = main(small(run, tmp_path / "cache", "trace.perfetto=true", "trace.stats_interval_s=0.05", steps=6))
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert "Traceback" not in err and "run summary: completed" in err
    stats = [x for x in err.splitlines() if f"cannot write {run / 'csp' / 'stats.jsonl'}" in x]
    traces = [x for x in err.splitlines() if f"cannot write {run / 'csp' / 'trace.json'}" in x]
    assert len(stats) == 1 and len(traces) == 1, err[-3000:]
    assert "bytes free there" in stats[0] and "the run goes on" in stats[0]


def test_a_truly_full_disk_stops_with_one_line_a_summary_and_exit_4(tmp_path, capsys):
    """Invariant, on a real 48 KiB tmpfs as the run directory (root can mount one; elsewhere the
    injected-ENOSPC tests above stand for it): the run ends with exit 4, no traceback, one line per
    file that could not be written, and the closing summary on the terminal."""
    import subprocess

    mnt = tmp_path / "full"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN); the injected-ENOSPC tests cover it")
    try:
        code = main(small(mnt / "run", tmp_path / "cache", "checkpoint.every=0", "monitor.window=1",
                          "trace.stats_interval_s=0.05", steps=40))
        err = capsys.readouterr().err
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
    assert code == EXIT_DISK_FULL, err[-3000:]
    assert "Traceback" not in err and "run summary: stopped: the disk is full" in err
    for name in ("stats.jsonl", "metrics.jsonl"):
        assert sum(f"cannot write {mnt / 'run'}" in x and name in x for x in err.splitlines()) <= 1, name
