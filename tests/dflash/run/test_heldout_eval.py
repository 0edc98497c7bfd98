"""Held-out tau while training: the drafter's snapshots feed the ``dflash.evaluator`` process, whose
measured tau reaches metrics.jsonl and the run summary; a busy evaluator makes snapshots drop,
never the step wait; the evaluation changes nothing trained (the config hash)."""

from __future__ import annotations

import json
import time

import pytest

from dflash.checkpoint import list_checkpoints
from dflash.errors import ConfigError
from dflash.eval.config import EvalSection, check_eval
from dflash.run.cli import main
from tests.dflash.run.test_run_e2e import GRAPH, cache_dir, records, small  # noqa: F401 - fixture


def _eval_sets(every: int, *extra: str) -> list[str]:
    return ["eval.every=" + str(every), "eval.prompts=2", "eval.max_new_tokens=8", *extra]


def test_heldout_tau_is_measured_at_every_interval_and_at_the_end(tmp_path, cache_dir, capsys):  # noqa: F811
    """Invariant: with eval.every = 2 over 6 steps the weights of steps 2, 4 and 6 are each either
    evaluated (a ``heldout`` record: measured tau in [1, block size], the prompts and tokens it
    decoded) or counted as skipped in the next record; the final weights always are; the summary
    names the last figure."""
    run = tmp_path / "run"
    args = small(run, cache_dir, steps=6)
    args += [a for s in _eval_sets(2, "eval.max_busy=1") for a in ("--set", s)]
    assert main(args) == 0  # the later --set eval.every wins over small()'s eval.every=0
    held = records(run, "heldout")
    assert held and held[-1]["step"] == 6
    assert len(held) + sum(r["skipped"] for r in held) == 3
    for r in held:
        assert r["step"] in (2, 4, 6) and 1.0 <= r["tau"] <= 8 and r["accepted"] == pytest.approx(r["tau"] - 1)
        assert r["prompts"] == 2 and r["new_tokens"] == 2 * 8 and r["steps"] >= 2
    assert f"held-out     tau {held[-1]['tau']:.4g} tokens/verify step measured at step 6" in capsys.readouterr().err


def test_a_busy_evaluator_drops_snapshots_and_never_holds_the_step(tmp_path, cache_dir, monkeypatch):  # noqa: F811
    """Invariant: while an evaluation runs the drafter keeps training: the snapshots it could not
    hand over are counted (``skipped``), every step's weights are either evaluated or counted, the
    final ones are evaluated, and the steps finish before the slow evaluations do."""
    from dflash.run.stages.evaluator import EvaluatorStage

    slow = EvaluatorStage.evaluate

    def evaluate(self, snap):
        time.sleep(1.0)
        return slow(self, snap)

    monkeypatch.setattr(EvaluatorStage, "evaluate", evaluate)
    run = tmp_path / "run"
    args = small(run, cache_dir, steps=6) + [a for s in _eval_sets(1, "eval.max_busy=1") for a in ("--set", s)]
    assert main(args) == 0  # the later --set eval.every wins over small()'s eval.every=0
    held = records(run, "heldout")
    assert len(held) + sum(r["skipped"] for r in held) == 6
    assert sum(r["skipped"] for r in held) >= 1 and held[-1]["step"] == 6
    last_train = max(r["time"] for r in records(run, "train"))
    assert last_train < held[-1]["time"] - 0.9  # training ended while the last evaluation still ran


def test_the_evaluator_keeps_to_its_share_of_the_run(tmp_path, cache_dir):  # noqa: F811
    """Invariant: with eval.max_busy = 0.01 an evaluation of a fraction of a second allows the next
    one only after many seconds: of 6 steps' snapshots the first and the final ones are evaluated,
    the 4 between are counted as skipped."""
    run = tmp_path / "run"
    args = small(run, cache_dir, steps=6) + [a for s in _eval_sets(1, "eval.max_busy=0.01") for a in ("--set", s)]
    assert main(args) == 0
    held = records(run, "heldout")
    assert [r["step"] for r in held] == [1, 6] and [r["skipped"] for r in held] == [0, 4]


def test_an_isolated_evaluator_measures_what_the_in_process_one_does(tmp_path, cache_dir, caplog):  # noqa: F811
    """Invariant: with eval.isolate = true the decode runs in a child process (another pid) and
    measures, for the same weights, exactly what the in-process evaluator measures (greedy, CPU
    fp32, deterministic run): the same tau, verify steps and tokens at the same steps."""
    import logging

    got = {}
    for isolate in (False, True):
        run = tmp_path / f"run-{isolate}"
        sets = _eval_sets(2, "eval.max_busy=1", f"eval.isolate={str(isolate).lower()}")
        args = small(run, cache_dir, steps=4) + [a for s in sets for a in ("--set", s)]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dflash.evaluator"):
            assert main(args) == 0
        got[isolate] = [(r["step"], r["tau"], r["steps"], r["new_tokens"]) for r in records(run, "heldout")]
        said = [r.getMessage() for r in caplog.records]
        # the progress of the final evaluation is logged, from the child through its pipe when isolated
        assert any(m.startswith("evaluator: step 4: 1/") and "prompts | tau " in m for m in said), said
    assert got[True] == got[False] and got[True][-1][0] == 4
    assert any("decoding in its own process (pid" in m and "with 1 torch CPU thread(s)" in m for m in said)


def _isolated_run_error(tmp_path, cache_dir, capsys, monkeypatch, before) -> str:  # noqa: F811
    """Run two steps with eval.isolate = true, ``before(process, weights)`` giving the weights the
    child is sent; the run must fail, and its stderr is returned."""
    from dflash.run.stages import heldout

    real = heldout.HeldoutProcess.evaluate
    monkeypatch.setattr(heldout.HeldoutProcess, "evaluate",
                        lambda self, step, weights, dropped, **kw: real(self, step, before(self, weights), dropped, **kw))
    run = tmp_path / "run"
    args = small(run, cache_dir, steps=2) + [a for s in _eval_sets(2, "eval.isolate=true") for a in ("--set", s)]
    assert main(args) != 0
    return capsys.readouterr().err


def test_an_isolated_evaluator_that_fails_says_why(tmp_path, cache_dir, capsys, monkeypatch):  # noqa: F811
    """A child that cannot evaluate (here: weights of another shape reach it) stops the run with
    one line naming the child's error, not a hang and not a traceback from the child's pipe."""
    err = _isolated_run_error(tmp_path, cache_dir, capsys, monkeypatch,
                              lambda process, weights: {k: v[..., :1] for k, v in weights.items()})
    assert "the evaluator's process failed: RuntimeError" in err and "size mismatch" in err


def test_an_isolated_evaluator_that_dies_is_named_with_its_exit_code(tmp_path, cache_dir,  # noqa: F811
                                                                      capsys, monkeypatch):
    """A child killed mid-run (here: SIGKILL before the first snapshot reaches it) stops the run
    with one line naming its pid and exit code, instead of a hang on its pipe, and with no
    traceback before it (there was one of 20 lines: the line says all; run.log keeps it)."""
    def kill(process, weights):
        process.proc.kill()
        process.proc.join(timeout=10)
        return weights

    err = _isolated_run_error(tmp_path, cache_dir, capsys, monkeypatch, kill)
    assert "exited with code -9 before answering" in err and "set eval.isolate = false" in err
    assert "Traceback" not in err, err
    assert "Traceback" in (tmp_path / "run" / "run.log").read_text()


def test_the_evaluation_changes_nothing_trained():
    """Invariant: the [eval] table, the evaluator process, its snapshots channel and the drafter's
    port to it are left out of the config hash: a checkpoint trained with or without them resumes
    without a "config differs" warning."""
    import msgspec

    from dflash.eval.config import EvalSection as Section
    from dflash.run.config import config_hash, load_config

    with_eval = load_config(GRAPH)
    assert with_eval.eval.every > 0 and any(p.kind == "dflash.evaluator" for p in with_eval.process)
    replace = msgspec.structs.replace
    procs = [replace(p, outputs={k: v for k, v in p.outputs.items() if k != "snapshots"}) if p.kind == "dflash.drafter"
             else p for p in with_eval.process if p.kind != "dflash.evaluator"]
    plain = replace(with_eval, eval=Section(), process=procs,
                    channel=[c for c in with_eval.channel if c.name != "snapshots"])
    assert [c.name for c in plain.channel] == ["batches", "hidden", "features", "metrics"]
    assert config_hash(plain) == config_hash(with_eval)
    assert config_hash(replace(plain, train=replace(plain.train, lr=1e-4))) != config_hash(with_eval)


@pytest.mark.parametrize("kwargs, says", [
    ({"section": EvalSection(every=5), "evaluators": 0, "holdout": None}, "no process of kind 'dflash.evaluator'"),
    ({"section": EvalSection(every=5), "evaluators": 2, "holdout": None}, "2 'dflash.evaluator' processes"),
    ({"section": EvalSection(every=5), "evaluators": 1, "holdout": 0}, "data.holdout = 0"),
    ({"section": EvalSection(every=5, temperature=float("nan")), "evaluators": 1, "holdout": None}, "finite"),
])
def test_eval_rules_name_the_key_to_change(kwargs, says):
    with pytest.raises(ConfigError, match=says):
        check_eval(kwargs.pop("section"), **kwargs)
    check_eval(EvalSection(every=0), evaluators=1, holdout=0)  # off: the evaluator idles


def test_an_eval_without_held_out_data_stops_before_any_work(tmp_path, capsys):
    assert main([GRAPH, "--set", f"run.out_dir={tmp_path / 'run'}", "--set", "data.holdout=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("eval.every = 200 decodes held-out conversations, but data.holdout = 0" in x for x in err), err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_run_and_dflash_eval_take_the_same_held_out_measure(tmp_path, cache_dir, capsys):  # noqa: F811
    """Invariant (one measure): ``dflash.eval CKPT --data SOURCE`` on a run's final checkpoint, with
    no flag, decodes what the run's evaluator decoded for the same weights (the run's [eval]
    prompts and max_new_tokens, the same held-out conversations, one CPU thread each), so it
    prints the same tau over the same prompts, tokens and verify steps; the run's log line, its
    summary and dflash.eval say what the tau is over in the same words. The final evaluation's
    progress reaches the terminal; an earlier one's only run.log (the live view stays put)."""
    from dflash.eval.cli import main as eval_main

    run = tmp_path / "run"
    sets = ["eval.every=2", "eval.prompts=2", "eval.max_new_tokens=12", "eval.max_busy=1", "eval.tree_budget=4"]
    assert main(small(run, cache_dir, *sets, steps=4)) == 0
    err = capsys.readouterr().err
    last = records(run, "heldout")[-1]
    assert last["step"] == 4 and last["max_new_tokens"] == 12 and last["dtype"] == "float32"
    assert last["tree_budget"] == 4 and 1.0 <= last["tree_tau"] <= 8
    assert f"tree of 4 {last['tree_tau']:.3f}" in err and "then tree-verified (4 draft tokens)" in err
    over = f"({last['prompts']} prompts x 12 tokens"
    assert f"held-out tau {last['tau']:.3f} tokens/verify step {over}; accepted" in err
    assert f"measured at step 4 {over}, tree of 4 {last['tree_tau']:.4g})" in err  # the closing summary
    assert "evaluator: step 4: 1/" in err  # the final evaluation's progress, on the terminal
    log = (run / "run.log").read_text()
    assert "decoding in the training process with 1 torch CPU thread(s) of its own (eval.threads)" in log
    if any(r["step"] == 2 for r in records(run, "heldout")):  # evaluated, not skipped as busy
        assert "evaluator: step 2: 1/" in log and "evaluator: step 2: 1/" not in err

    ckpt = run / "checkpoints" / "step_00000004"
    assert eval_main([str(ckpt), "--data", "sharegpt", "--no-speedup", "--json", "--quiet"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["heldout"] and res["max_new_tokens"] == 12 and res["threads"] == 1
    assert len(res["per_prompt"]) == last["prompts"]
    assert sum(p["new_tokens"] for p in res["per_prompt"]) == last["new_tokens"]
    assert sum(p["steps"] for p in res["per_prompt"]) == last["steps"]
    assert res["tau"] == pytest.approx(last["tau"], abs=1e-12)
    assert res["loop_share"] == pytest.approx(last["loop_share"], abs=1e-12)  # the loops counted alike
    assert res["fresh_tau"] == pytest.approx(last["fresh_tau"], abs=1e-12)
    assert eval_main([str(ckpt), "--data", "sharegpt", "--no-speedup", "--json", "--quiet", "--tree-budget", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["tree_tau"] == pytest.approx(last["tree_tau"], abs=1e-12)
    assert eval_main([str(ckpt), "--data", "sharegpt", "--no-speedup", "--quiet"]) == 0
    assert f"held-out tau {last['tau']:.3f} tokens/verify step {over})" in capsys.readouterr().out
    assert eval_main([str(ckpt), "--data", "sharegpt", "--no-speedup", "--json", "--quiet", "--max-new-tokens", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["max_new_tokens"] == 5  # a flag overrides the run's setting


def test_eval_threads_are_the_evaluator_threads_own():
    """Invariant: ``own_threads(n)`` (the in-process evaluator's [eval].threads, applied in its own
    thread) gives the calling thread n torch threads while a thread already running torch keeps
    its count and a thread started afterwards gets the process default, not n: the training
    threads' parallelism is not the evaluator's to change. ``n = 0`` changes nothing."""
    import threading

    import torch

    from dflash.run.stages.heldout import own_threads, threads_are_per_thread

    if not threads_are_per_thread():
        pytest.skip("torch's CPU backend here is not OpenMP: the thread count is the whole process's")
    default = torch.get_num_threads()
    seen: dict[str, int] = {}
    running, set_done = threading.Event(), threading.Event()

    def training():  # runs torch before the evaluator sets its count, and after
        torch.ones(4).sum()
        seen["training before"] = torch.get_num_threads()
        running.set()
        set_done.wait(30)
        seen["training after"] = torch.get_num_threads()

    def evaluator():
        running.wait(30)
        seen["evaluator"] = own_threads(1)
        seen["evaluator later"] = torch.get_num_threads()
        seen["evaluator, 0"] = own_threads(0)
        set_done.set()

    threads = [threading.Thread(target=training), threading.Thread(target=evaluator)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    later = threading.Thread(target=lambda: seen.setdefault("started later", torch.get_num_threads()))
    later.start()
    later.join(30)
    assert seen == {"training before": default, "training after": default, "evaluator": 1, "evaluator later": 1,
                    "evaluator, 0": 1, "started later": default}
    assert torch.get_num_threads() == default


def test_eval_threads_must_be_zero_or_more():
    """A negative eval.threads is refused naming the key (0 is torch's default, one per core)."""
    from dflash.run.config import load_config

    with pytest.raises(ConfigError, match=r"\$\.eval\.threads"):
        load_config(GRAPH, ["eval.threads=-1"])
    assert load_config(GRAPH, ["eval.threads=0"]).eval.threads == 0
    assert load_config(GRAPH).eval.threads == 1


@pytest.mark.parametrize("keep_best", [True, False])
def test_the_best_held_out_checkpoint_is_kept_and_named(tmp_path, cache_dir, capsys, monkeypatch, keep_best):
    """Invariant: with [checkpoint].keep_best (the default) the checkpoint of the step whose
    held-out tau was best survives keep_last's retention, and the summary names it with the
    command that exports it, also across a resume; without it, retention keeps the newest only."""
    from dflash.messages import HeldoutTau
    from dflash.run.stages.evaluator import EvaluatorStage

    taus = {2: 3.0, 4: 1.5, 6: 1.2, 8: 1.1}   # an overfitting drafter: its best weights are early

    def scripted(self, snap):
        return HeldoutTau(step=snap.step, tau=taus[snap.step], accepted=taus[snap.step] - 1, prompts=2,
                          new_tokens=24, steps=10, seconds=0.01, max_new_tokens=12)

    monkeypatch.setattr(EvaluatorStage, "evaluate", scripted)
    run = tmp_path / "run"
    sets = ["eval.every=2", "eval.prompts=2", "eval.max_new_tokens=12", "eval.max_busy=1", "checkpoint.every=2",
            "checkpoint.keep_last=2", f"checkpoint.keep_best={'true' if keep_best else 'false'}"]
    assert main(small(run, cache_dir, *sets, steps=8)) == 0
    err = capsys.readouterr().err
    kept = [p.name for p in list_checkpoints(run / "checkpoints")]
    best = run / "checkpoints" / "step_00000002"
    if keep_best:
        assert kept == ["step_00000002", "step_00000006", "step_00000008"]
        assert f"best 3 at step 2 (its checkpoint kept: {best})" in err
        assert f"python -m dflash.export {best} -o {run / 'export-best'}" in err
        taus.update({10: 1.0, 12: 1.0})   # a resumed segment remembers the earlier best (metrics.jsonl)
        assert main(small(run, cache_dir, *sets, steps=12)) == 0
        kept = [p.name for p in list_checkpoints(run / "checkpoints")]
        assert kept == ["step_00000002", "step_00000010", "step_00000012"]
    else:
        assert kept == ["step_00000006", "step_00000008"]
        assert "best 3 at step 2;" in err and "export-best" not in err
