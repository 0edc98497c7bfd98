"""The end-to-end benchmark recipes (benchmarks/quality, benchmarks/peers, benchmarks/h200) and what
they share (benchmarks/recipe): each answers --help on a bare interpreter, the shared measurements
are right on hand-made metrics and reproduce every committed results file from its committed
inputs, a capped step ends as coreutils timeout reports it, and what is left in shell stays a recipe
a person reads top to bottom."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.h200.suite import build_parser as suite_parser
from benchmarks.quality.frontier import frontier
from benchmarks.quality.headline import build_parser as headline_parser
from benchmarks.quality.headline import evalcost, variants
from benchmarks.recipe import carry, cli, metrics
from benchmarks.recipe.step import CAPPED, KILLED, Step, python, run, tail

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
RECIPES = {"benchmarks.quality.headline": ["data", "probe", "train", "evalcost", "variants", "evalsets"],
           "benchmarks.quality.frontier": ["train", "eval", "all"],
           "benchmarks.quality.labels": ["phase1", "phase2", "extend", "long", "variant"],
           "benchmarks.peers.run": ["cache", "train", "eval", "all"],
           "benchmarks.h200.suite": ["engine", "fp8", "fastest", "stages"]}
HEAVY = ("torch", "msgspec", "csp", "dflash")


@pytest.mark.parametrize("module", sorted(RECIPES))
def test_every_recipe_and_phase_answers_help_without_the_carried_packages(module):
    """Invariant: a recipe's --help (and each phase's) lists its exit codes and imports none of torch,
    msgspec, csp or dflash: on the GPU image those come from wheels the recipe installs first."""
    code = (f"import runpy, sys\nfor argv in {[[p, '--help'] for p in RECIPES[module]] + [['--help']]!r}:\n"
            f"    sys.argv = [{module!r}, *argv]\n    try:\n        runpy.run_module({module!r}, run_name='__main__')\n"
            "    except SystemExit as e:\n        assert e.code == 0, (argv, e.code)\n"
            f"print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("exit codes:") == len(RECIPES[module]) + 1, proc.stdout[-500:]
    for phase in RECIPES[module]:
        assert f"\n    {phase} " in proc.stdout, phase
    assert proc.stdout.strip().endswith("HEAVY []"), proc.stdout[-300:]


def test_bad_arguments_end_in_one_line_and_exit_2(capsys):
    """A typo in a row name, a row without a name, or a missing phase says so in one line (exit 2)."""
    for argv in (["all", "OUT", "--rows", "dflahs"], ["train"], []):
        with pytest.raises(SystemExit) as e:
            __import__("benchmarks.quality.frontier", fromlist=["main"]).main(argv)
        assert e.value.code == 2
    assert "unknown row 'dflahs'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        headline_parser().parse_args(["variants", "OUT", "--variant", "--set x=1"])


def test_options_keep_the_old_knobs_defaults():
    """The phases' defaults are the shell recipes' (R, NP, NEW, STEPS, TRAIN_S, EVAL_EVERY, TOTAL_S ...),
    so a command without options runs what the script ran."""
    a = headline_parser().parse_args(["train", "OUT", "--set", "drafter.compile=true"])
    assert (a.scratch, a.num_prompts, a.new_tokens, a.steps, a.train_s, a.eval_temps, a.data_dir, a.sets) == (
        Path("/tmp/headline"), 32, 256, 10000, 420, ["0", "1"], Path(".whl/data"), ["drafter.compile=true"])
    a = headline_parser().parse_args(["evalcost", "OUT"])
    assert (a.cap_s, a.eval_every, a.order) == (90, 200, None)
    a = headline_parser().parse_args(["variants", "OUT", "--variant", 'fp8 --set drafter.precision="fp8"'])
    assert (a.steps, a.cap_s, a.eval_prompts, a.eval_new_tokens) == (1800, 480, 32, 128)
    assert a.variant == [("fp8", ["--set", 'drafter.precision="fp8"'])]  # quotes kept: a TOML string
    a = suite_parser().parse_args(["fp8", "OUT"])
    assert (a.total_s, a.perf_s, a.warmup, a.perf_warmup, a.perf_steps) == (530, 330, 10, 3, 8)


def test_set_arguments_are_toml_values():
    """Strings are quoted and booleans lower case, as the shell recipes wrote them (--set k=\\"v\\")."""
    assert cli.sets(("drafter.variant", "dflash2"), ("run.steps", 7), ("drafter.compile", True),
                    ("eval.temperature", 1.0), extra=["a.b=1"]) == [
        "--set", 'drafter.variant="dflash2"', "--set", "run.steps=7", "--set", "drafter.compile=true",
        "--set", "eval.temperature=1.0", "--set", "a.b=1"]


def _metrics(path: Path, rates: list[float | None], heldout: list[dict] = ()) -> Path:
    lines = [{"kind": "start", "step": 0, "time": 100.0}]
    lines += [{"kind": "train", "step": 10 * (i + 1), "window": 10, "time": 100.0 + 5 * (i + 1), "tau_sim": 1.5,
               **({"tok_s": r} if r is not None else {})} for i, r in enumerate(rates)]
    lines += [{"kind": "heldout", **h} for h in heldout]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_steady_tok_s_is_the_median_of_the_train_windows_after_the_first_two(tmp_path):
    """The rate every recipe reports: the first two windows (compiling, warm-up) left out, then the
    median; a window without a rate does not count; too few windows give None."""
    recs = metrics.read_records(_metrics(tmp_path / "m.jsonl", [1.0, 2.0, 30.0, 10.0, None, 20.0, 1000.0],
                                         [{"step": 70, "tau": 2.5}]))
    assert metrics.steady_tok_s(recs) == 25.0  # median of 30, 10, 20, 1000
    assert metrics.steady_tok_s(recs, warmup=0) == 15.0  # median of 1, 2, 30, 10, 20, 1000
    assert metrics.last_step(recs) == 70
    assert metrics.train_seconds(recs) == 35.0
    assert metrics.of_kind(recs, "heldout") == [{"kind": "heldout", "step": 70, "tau": 2.5}]
    short = metrics.read_records(_metrics(tmp_path / "s.jsonl", [5.0, 6.0]))
    assert metrics.steady_tok_s(short) is None and metrics.last_step([]) is None
    assert metrics.train_seconds([]) is None


def test_evalcost_and_variants_summaries_from_fabricated_runs(tmp_path):
    """evalcost.json: the two runs' steady rates and the cost; variants.json: one row per run, a run
    without metrics said so."""
    _metrics(tmp_path / "metrics-evalcost-0.jsonl", [1, 1, 100, 100, 100])
    _metrics(tmp_path / "metrics-evalcost-50.jsonl", [1, 1, 90, 80, 90], [{"step": 50, "tau": 2.0, "seconds": 3.0}])
    res = evalcost(tmp_path, 50)
    assert (res["tok_s_without"], res["tok_s_with"], res["eval_every"]) == (100, 90, 50)
    assert res["cost"] == pytest.approx(0.1)
    assert res["evaluations"] == [{"step": 50, "tau": 2.0, "seconds": 3.0, "skipped": None, "prompts": None,
                                   "new_tokens": None}]
    _metrics(tmp_path / "metrics-var-a.jsonl", [1, 1, 7], [{"step": 30, "tau": 3.0, "sampled_tau": 1.5, "prompts": 4}])
    assert variants(tmp_path, ["a", "b"]) == {
        "a": {"steps": 30, "tok_s_concurrent": 7, "tau": 3.0, "tau_t1": 1.5, "heldout_prompts": 4},
        "b": {"status": "no metrics"}}


def test_the_committed_results_files_reproduce_from_their_committed_inputs():
    """Regression: the summaries the recipes write (evalcost.json, variants.json, frontier.json) come
    out of the committed metrics and eval files exactly as committed, so moving the figures from
    inline Python into benchmarks/recipe changed none of them."""
    for d in ("evalcost_cap_h200", "evalsets_h200"):
        committed = json.loads((RESULTS / d / "evalcost.json").read_text())
        assert evalcost(RESULTS / d, committed["eval_every"]) == committed, d
    isolated = json.loads((RESULTS / "evalcost_isolate_h200" / "evalcost.json").read_text())
    for order in ("evaluator-first", "evaluator-second"):
        got = evalcost(RESULTS / "evalcost_isolate_h200" / order, 200)
        assert {k: got[k] for k in ("tok_s_without", "tok_s_with", "cost")} == {
            k: isolated[order][k] for k in ("tok_s_without", "tok_s_with", "cost")}, order
    committed = json.loads((RESULTS / "variants_h200" / "variants.json").read_text())
    assert variants(RESULTS / "variants_h200", list(committed)) == committed
    committed = json.loads((RESULTS / "variants_muon_xpress_h200" / "variants.json").read_text())
    got = variants(RESULTS / "variants_muon_xpress_h200", list(committed))
    assert {n: {k: committed[n][k] for k in row} for n, row in got.items()} == got  # the extra keys were added by hand
    for name in ("frontier.json", "frontier-b8.json"):
        committed = json.loads((RESULTS / "frontier_h200" / name).read_text())
        assert frontier(RESULTS / "frontier_h200", [r["row"] for r in committed]) == committed, name


def test_a_step_reports_its_end_as_timeout_does(tmp_path):
    """Exit status passed through; 124 when stopped at the cap (whatever the command returned after
    the signal); 137 when it ignored the signal past the grace period; output in the log."""
    assert run(python("-c", "print('hi'); raise SystemExit(3)"), tmp_path / "a.log") == 3
    assert tail(tmp_path / "a.log") == "hi"
    stops = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(130)); "
             "print('up', flush=True); time.sleep(30)")
    step = Step(python("-c", stops), tmp_path / "b.log", cap_s=1.0)
    assert step.wait() == CAPPED and step.seconds < 20
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(30)"
    assert run(python("-c", deaf), tmp_path / "c.log", cap_s=1.0, grace_s=0.5) == KILLED
    assert run(python("-c", "import sys; print('out'); print('err', file=sys.stderr)"), tmp_path / "d.log",
               err=tmp_path / "d.err") == 0
    assert (tail(tmp_path / "d.log"), tail(tmp_path / "d.err")) == ("out", "err")
    (tmp_path / "e.log").write_text("step 1\nkept\nstep 2\n50%|##\nlast\n")
    assert tail(tmp_path / "e.log", 3, drop="^step|%") == "kept\nlast"


def test_a_checkpoint_cut_into_parts_joins_again_without_its_optimizer_state(tmp_path):
    """The train phase carries its checkpoint back in parts; evalsets joins them."""
    ck = tmp_path / "step_00000010"
    ck.mkdir()
    (ck / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (ck / "train_state.pt").write_bytes(b"x" * 100)
    parts = carry.split_tar(ck, str(tmp_path / "ckpt.tar.part-"), part_bytes=4096)
    assert [p.name for p in parts][:2] == ["ckpt.tar.part-aa", "ckpt.tar.part-ab"] and len(parts) > 2
    carry.join_tar(parts, tmp_path / "back")
    back = tmp_path / "back" / "step_00000010"
    assert (back / "model.safetensors").read_bytes() == (ck / "model.safetensors").read_bytes()
    assert not (back / "train_state.pt").exists()
    assert metrics.last_checkpoint(tmp_path / "back" / "..") is None
    (tmp_path / "run" / "checkpoints" / "step_00000002").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_00000010").mkdir()
    assert metrics.last_checkpoint(tmp_path / "run").name == "step_00000010"


# python -c ..., python - <<'EOF' (a heredoc program), "$SOME_PY" -c ...
INLINE_PYTHON = re.compile(r"(\bpython[\w.]*|\$\{?\w*PY\w*\}?)\"?\s+(-c\b|-\s|-$)")


def _shell_problems(path: Path) -> list[str]:
    text = path.read_text()
    found = [f"{len(text.splitlines())} lines (more than 80)"] if len(text.splitlines()) > 80 else []
    found += [f"inline Python: {line.strip()}" for line in text.splitlines()
              if INLINE_PYTHON.search(line) and not line.lstrip().startswith("#")]  # a comment may quote one
    return found


def test_no_benchmark_shell_script_is_a_program():
    """Invariant: a shell script under benchmarks/ is a recipe a person reads top to bottom: at most
    80 lines and no figure computed in inline Python (that lives in a module the recipe runs)."""
    problems = {str(p.relative_to(ROOT)): found for p in sorted((ROOT / "benchmarks").rglob("*.sh"))
                if (found := _shell_problems(p))}
    assert problems == {}


def test_the_shell_check_sees_long_scripts_and_each_form_of_inline_python(tmp_path):
    """The check above can fail: a heredoc to python, python -c, and a script over 80 lines."""
    f = tmp_path / "x.sh"
    f.write_text("python3 - \"$1\" <<'EOF'\nprint(1)\nEOF\nx=$(python3 -c 'print(2)')\n\"$SPEC_PY\" -c 'import a'\n"
                 "python3 -m dflash.run g.toml\ncat <<EOF\nrows\nEOF\n" + "echo\n" * 76)
    assert _shell_problems(f) == ["85 lines (more than 80)", "inline Python: python3 - \"$1\" <<'EOF'",
                                  "inline Python: x=$(python3 -c 'print(2)')",
                                  "inline Python: \"$SPEC_PY\" -c 'import a'"]


def test_every_peer_wheel_is_pinned():
    """Regression: the peers' wheel script fetched the newest versions (openai 3.x then needed httpx2,
    which the GPU image lacks). Invariant: every wheel it downloads is pinned to one version."""
    text = (ROOT / "benchmarks" / "peers" / "wheels.sh").read_text()
    lists = dict(re.findall(r"^(\w+)=\(([^)]*)\)", text, flags=re.M))
    # what each download takes: the arrays named in its `get .whl/DIR "${NAME[@]}"` line, and common
    calls = [line for line in text.splitlines() if re.search(r"(^|\s)get \.whl/", line)]
    used = {"common"} | {name for line in calls for name in re.findall(r'"\$\{(\w+)\[@\]\}"', line)}
    assert len(calls) == 3 and used == {"common", "peers", "specforge", "arrow"}, calls
    assert all(re.fullmatch(r'get \.whl/[\w-]+ "\$\{\w+\[@\]\}"', re.search(r"get .*?\]\}\"", line)[0])
               for line in calls), calls  # nothing but the pinned list on a download line
    specs = [w for name in used for w in lists[name].split()]
    assert specs and all(re.fullmatch(r"[A-Za-z0-9][\w.-]*==[\w.]+", w) for w in specs), specs
    assert {"speculators==0.9.0", "specforge==0.2.0", "transformers==5.8.1"} <= set(specs)
