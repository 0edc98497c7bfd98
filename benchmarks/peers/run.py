"""The peers side by side: speculators 0.9 and SpecForge 0.2 drafters trained and decoded beside ours.

vLLM speculators 0.9 (DFlash, DFlash2, XPress) and SpecForge 0.2 (DFlash) train drafters of the same
shape, on the same conversations and target, under the same wall-clock budget as this project's;
every drafter is then decoded by the same decoders on the same held-out prompts.

  cache  benchmarks/peers/cache.py over the graph (its [data] with --set; the held-out conversations
         left out as dflash.run leaves them out) -> SCRATCH/peer-data/{speculators,specforge} and the
         drafter shape as a public-layout config (draft_config.json); then speculators_rows.py (in
         speculators' interpreter) writes its Arrow dataset -> OUT/cache.json (conversations, tokens,
         seconds)
  train  ours: dflash.run of the graph with --set and --ours-set (default: the headline's DFlash2
         recipe, compiled), a schedule of --ours-steps, SIGTERM at --budget-s (a final checkpoint);
         each peer's own recipe (loss, optimizer, schedule) with the graph's drafter shape (layers,
         block size, target layer ids, every layer full attention) and batch ([data].tokens_per_batch
         tokens per step) for --budget-s seconds, timed from the process's start as ours is; its
         schedule runs --spec-steps / --sf-steps steps or, with --pilot-s, as many as a pilot run of
         that many seconds makes in the budget. speculators is stopped by SIGINT (it saves on it);
         SpecForge by SIGTERM, which saves nothing, so it also saves every --sf-save-every steps and
         is exported by its own specforge.export.to_hf. Each newest checkpoint -> SCRATCH/conv-NAME,
         a drafter directory of this project (convert.py) -> OUT/train-NAME.{log,json} (rc: 124
         when stopped at the budget; seconds, the stop's drain and last save included; steps done;
         tok/s: steps x tokens per step over the whole process's seconds, startup included)
  eval   each SCRATCH/conv-NAME (and --checkpoint): dflash.eval on the held-out prompts (--prompts;
         by default the quality runs' ShareGPT prompts, held out for the shipped 7M target only), greedy and
         at T = 1 -> OUT/eval-NAME-tT.json; for DFlash and DFlash2 also z-lab's dflash_generate
         through benchmarks.decode.speed (ZLAB_DFLASH_PATH) -> OUT/speed-NAME.json
  all    cache, train and eval

Each peer runs in its own interpreter and path: by default this interpreter with the wheels of
.whl/peers (installed once into /tmp/peers-pylib) or .whl/specforge (/tmp/specforge-pylib: SpecForge
pins transformers 5.8.1); benchmarks/peers/wheels.sh downloads both. Both trainers need CUDA; what
runs on a CPU is tested in tests/benchmarks/test_peers.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

from benchmarks.recipe import carry, cli, metrics, report
from benchmarks.recipe.step import python, run, tail

PROG = "python -m benchmarks.peers.run"
SHIPPED_TARGET = Path(__file__).resolve().parents[2] / "dflash" / "assets" / "target-sharegpt-7m"
OURS_SETS = ['drafter.variant="dflash2"', "drafter.compile=true"]


class Peers:
    """The phases of one invocation: its arguments, the cache's figures, each peer's interpreter."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.a, self.r = args, args.scratch
        self.data = args.scratch / "peer-data"

    # --- what every phase reads -------------------------------------------------------------------
    def field(self, name: str):
        """A figure of the cache (SCRATCH/peer-data/cache.json): target, drafter_layers, block_size ..."""
        return json.loads((self.data / "cache.json").read_text())[name]

    def env(self, pythonpath: str) -> dict[str, str]:
        """A peer's environment: its own path first."""
        old = os.environ.get("PYTHONPATH")
        return {"PYTHONPATH": pythonpath + (f":{old}" if old else "")}

    def wants(self, peer: str) -> bool:
        """Whether ``peer`` is among --peers."""
        return peer in self.a.peers

    def ready(self) -> bool:
        """Each wanted peer's trainer importable, or one line saying what to carry."""
        ok = True
        checks = (("speculators", self.a.spec_python, self.a.spec_pythonpath, "import datasets, speculators.train.cli",
                   "speculators' trainer", ".whl/peers (pyarrow and pandas apart, ARROW=1)"),
                  ("specforge", self.a.sf_python, self.a.sf_pythonpath,
                   "import accelerate, specforge.cli, specforge.export.to_hf", "SpecForge's trainer", ".whl/specforge"))
        for peer, py, path, code, what, carried in checks:
            err = self.r / f"{'spec' if peer == 'speculators' else 'sf'}-import.err"
            if self.wants(peer) and run([py, "-c", code], err, env=self.env(path)):
                print(f"peers: {py} cannot import {what} ({tail(err, 1)}): carry benchmarks/peers/wheels.sh's "
                      f"wheels in {carried}", file=sys.stderr)
                ok = False
        return ok

    def tokens_per_step(self, given: int | None = None) -> int:
        """Tokens per training step: ``given``, else --total-seq-len, else the cache's tokens_per_batch."""
        return given or self.a.total_seq_len or self.field("tokens_per_batch")

    def record(self, name: str, rc: int, t0: float, ck: object, schedule: int, done: int | None, log: Path,
               tokens: int | None = None) -> dict:
        """OUT/train-NAME.json (the run's rc, seconds, steps, tok/s) and the end of its log."""
        secs, seq = time.time() - t0, self.tokens_per_step(tokens)
        rec = {"name": name, "rc": rc, "seconds": secs, "checkpoint": str(ck) if ck else None,
               "schedule_steps": schedule, "steps_done": done,
               "tokens_per_step": seq,  # packed, padding included, as our tokens_per_batch
               "tok_s": done * seq / secs if done else None}
        report.write_json(self.a.out / f"train-{name}.json", rec)
        (self.a.out / f"train-{name}.log").write_text(tail(log, 40, drop=r"it/s\]") + "\n")
        print(f"{name} rc={rc} checkpoint={ck or 'none'} steps={done if done is not None else '?'}")
        return rec

    def pilot_steps(self, name: str, done: int | None, default: int) -> int:
        """The schedule's steps for --budget-s from a pilot's ``done`` steps in --pilot-s (``default`` without any)."""
        steps = done * int(self.a.budget_s) // self.a.pilot_s if done else default
        print(f"{name} pilot: {done or 'no'} steps in {self.a.pilot_s} s -> {steps} steps for {self.a.budget_s} s",
              file=sys.stderr)
        return steps

    def convert(self, checkpoint: Path, name: str) -> int:
        """A peer's checkpoint (or public-layout export) -> SCRATCH/conv-NAME, a drafter directory of ours."""
        return run(python("-m", "benchmarks.peers.convert", self.a.graph, checkpoint, "-o", self.r / f"conv-{name}",
                          *cli.sets(extra=self.a.sets)), None)

    # --- cache ------------------------------------------------------------------------------------
    def cache(self) -> int:
        """The peers' hidden-state caches, written by our target (timed apart)."""
        if not self.ready():
            return 1
        peer_args = [w for p in self.a.peers if p != "ours" for w in ("--peer", p)]
        if not peer_args:
            return 0  # ours reads the graph's data itself
        shutil.rmtree(self.data, ignore_errors=True)
        if run(python("-m", "benchmarks.peers.cache", self.a.graph, "-o", self.data, *peer_args,
                      *cli.sets(extra=self.a.sets)), None):
            return 1
        if self.wants("speculators") and run([self.a.spec_python, "benchmarks/peers/speculators_rows.py",
                                              self.data / "speculators"], None, env=self.env(self.a.spec_pythonpath)):
            return 1
        shutil.copyfile(self.data / "cache.json", self.a.out / "cache.json")
        return 0

    # --- train ------------------------------------------------------------------------------------
    def train(self) -> int:
        """Ours, then each peer's own trainer, --budget-s each."""
        if not self.ready():
            return 1
        if self.wants("ours"):
            self.ours()
        if self.wants("speculators"):
            for t in self.a.types:
                self.speculators(t)
        if self.wants("specforge"):
            self.specforge()
        return 0

    def ours(self) -> None:
        """dflash.run of the graph for --budget-s: the whole process timed, as the peers'."""
        name, out_dir = "ours", self.r / "ours"
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(self.r / "conv-ours", ignore_errors=True)
        t0 = time.time()
        rc = run(python("-m", "dflash.run", self.a.graph, *cli.sets(extra=self.a.sets),
                        *cli.sets(extra=self.a.ours_set or OURS_SETS),
                        *cli.sets(("run.steps", self.a.ours_steps), ("checkpoint.every", 0),
                                  ("monitor.wandb", "disabled"), ("run.out_dir", str(out_dir))), "--resume", "none"),
                 self.r / "ours.log", cap_s=self.a.budget_s, grace_s=180)
        ck = metrics.last_checkpoint(out_dir)
        done = int(ck.name.removeprefix("step_")) if ck else None
        rec = self.record(name, rc, t0, ck, self.a.ours_steps, done, self.r / "ours.log", self.graph_tokens())
        try:
            rec["tok_s_windows_median"] = metrics.steady_tok_s(metrics.read_records(out_dir / "metrics.jsonl"))
        except OSError:
            rec["tok_s_windows_median"] = None
        report.write_json(self.a.out / f"train-{name}.json", rec)
        if ck:
            link = self.r / "conv-ours"
            link.unlink(missing_ok=True)
            link.symlink_to(ck)

    def graph_tokens(self) -> int | None:
        """The graph's [data].tokens_per_batch under --set; None when the config does not load here."""
        try:
            from dflash.run.config import load_config

            return load_config(self.a.graph, list(self.a.sets)).data.tokens_per_batch
        except Exception:
            return None

    def spec_argv(self, kind: str, max_steps: int, save: Path) -> list:
        """speculators' trainer command: the cache's shape, batch and mask token, then --spec-args.

        The mask token is passed because speculators resolves an unset one from the tokenizer
        alone: a target whose tokenizer has no mask token and no spare embedding row (SmolLM2,
        whose graph sets ``drafter.mask_token_id``) would get its pad token, ``<|im_end|>``, a token
        chat text holds, where ours and SpecForge's (``draft_config.json``) use the graph's."""
        layers = self.field("drafter_layers")
        mask = json.loads((self.data / "cache.json").read_text()).get("mask_token_id")
        return [self.a.spec_python, "-m", "speculators.train", "--speculator-type", kind,
                "--verifier-name-or-path", self.field("target"), "--data-path", self.data / "speculators",
                "--num-layers", layers, "--target-layer-ids", *self.field("target_layer_ids"),
                "--block-size", self.field("block_size"), "--full-attention-indices", *range(layers),
                *(["--mask-token-id", mask] if mask is not None else []),
                "--total-seq-len", self.tokens_per_step(), "--max-steps", max_steps, "--epochs", 1000,
                "--train-data-ratio", 0.99, "--seed", 0, "--save-path", save, "--log-dir", f"{save}-logs",
                "--logger", "", *self.a.spec_args.split()]

    def spec_run(self, kind: str, seconds: float, max_steps: int, save: Path) -> int:
        """speculators' trainer for ``seconds`` (SIGINT: it saves a checkpoint)."""
        shutil.rmtree(save, ignore_errors=True)
        return run(self.spec_argv(kind, max_steps, save), Path(f"{save}.log"), cap_s=seconds, stop=signal.SIGINT,
                   grace_s=180, env=self.env(self.a.spec_pythonpath))

    @staticmethod
    def spec_global_step(save: Path) -> int | None:
        """The newest training_state.json under a speculators save path: its global_step."""
        found = sorted(Path(save).glob("*/training_state.json"), key=lambda p: p.stat().st_mtime)
        return json.loads(found[-1].read_text())["global_step"] if found else None

    def speculators(self, kind: str) -> None:
        """One speculators drafter type trained for the budget, recorded and converted."""
        name, steps = f"speculators-{kind}", self.a.spec_steps
        shutil.rmtree(self.r / f"conv-{name}", ignore_errors=True)
        if self.a.pilot_s > 0:
            self.spec_run(kind, self.a.pilot_s, 1000000, self.r / f"{name}-pilot")
            steps = self.pilot_steps(name, self.spec_global_step(self.r / f"{name}-pilot"), steps)
        t0 = time.time()
        rc = self.spec_run(kind, self.a.budget_s, steps, self.r / name)
        saved = sorted((d for d in (self.r / name).glob("*/") if (d / "config.json").is_file()),
                       key=lambda d: d.stat().st_mtime)
        ck = saved[-1] if saved else None
        self.record(name, rc, t0, ck, steps, self.spec_global_step(self.r / name), self.r / f"{name}.log")
        if ck:
            self.convert(ck, name)

    def sf_run(self, seconds: float, max_steps: int, out: Path, save_every: int) -> int:
        """SpecForge's trainer for ``seconds`` (SIGTERM), from the config specforge_config.py writes."""
        shutil.rmtree(out, ignore_errors=True)
        tokens = ["--tokens-per-step", self.a.total_seq_len] if self.a.total_seq_len else []
        if run(python("-m", "benchmarks.peers.specforge_config", self.data, "-o", out, "--max-steps", max_steps,
                      "--save-every", save_every, *tokens), None):
            return 1
        return run([self.a.sf_python, "-m", "specforge.cli", "train", "--config", f"{out}.yaml",
                    *self.a.sf_overrides.split()], Path(f"{out}.log"), cap_s=seconds, grace_s=120,
                   env=self.env(self.a.sf_pythonpath))

    @staticmethod
    def sf_step(out: Path) -> int | None:
        """The step of SpecForge's newest checkpoint under its output directory (a directory name's number)."""
        steps = [int(m.group(1)) for p in Path(out).glob("*") if p.is_dir() and not p.is_symlink()
                 for m in [re.search(r"(\d+)$", p.name)] if m]
        return max(steps) if steps else None

    def specforge(self) -> None:
        """SpecForge's DFlash drafter trained for the budget, recorded, exported by its own to_hf and converted."""
        name, steps, out = "specforge-dflash", self.a.sf_steps, self.r / "specforge-dflash"
        for d in (self.r / f"conv-{name}", self.r / f"{name}-hf"):
            shutil.rmtree(d, ignore_errors=True)
        if self.a.pilot_s > 0:
            self.sf_run(self.a.pilot_s, 1000000, self.r / f"{name}-pilot", 10)
            steps = self.pilot_steps(name, self.sf_step(self.r / f"{name}-pilot"), steps)
        t0 = time.time()
        rc = self.sf_run(self.a.budget_s, steps, out, self.a.sf_save_every)
        done = self.sf_step(out)
        self.record(name, rc, t0, out if done is not None else None, steps, done, self.r / f"{name}.log")
        if done is None:
            return
        log = self.r / f"{name}-export.log"
        hf = self.r / f"{name}-hf"
        if run([self.a.sf_python, "-m", "specforge.export.to_hf", "--checkpoint", out, "--draft-config",
                self.data / "draft_config.json", "--output-dir", hf, "--embedding-source", self.field("target")],
               log, env=self.env(self.a.sf_pythonpath)) or self.convert(hf, name):
            print(tail(log, 3))

    # --- eval -------------------------------------------------------------------------------------
    def eval_prompts(self) -> str | None:
        """--prompts, else the quality runs' ShareGPT prompts (SCRATCH/prompts.jsonl) where the graph's
        target is the shipped 7M one: those are held out of its pretraining (its ``heldout.json``) and
        past the records its drafter recipes train on. Any other target's data may hold them (SmolLM2's
        regenerated answers cover the first 16,000 ShareGPT prompts), so there None, said in one line."""
        if self.a.prompts:
            return self.a.prompts
        import msgspec

        from dflash.errors import DFlashError
        from dflash.run.config import load_config

        try:
            path = load_config(self.a.graph, list(self.a.sets)).target.path
        except (OSError, ValueError, DFlashError, msgspec.ValidationError) as e:  # the line says why
            path, why = None, f"{self.a.graph} does not load ({type(e).__name__}: {e})"
        else:
            why = f"the graph's target ({path}) is not the shipped {SHIPPED_TARGET}"
        if path is not None and Path(path).resolve() == SHIPPED_TARGET.resolve():
            prompts = self.r / "prompts.jsonl"
            carry.held_out_prompts(prompts, self.a.num_prompts)
            return str(prompts)
        print(f"peers eval: {why}, whose training data the quality prompts may be in: give --prompts "
              "(mtbench, humaneval or a JSONL file of prompts held out of the graph's data)", file=sys.stderr)
        return None

    def evaluate(self) -> int:
        """dflash.eval (greedy, T = 1) and z-lab's dflash_generate on every drafter."""
        prompts = self.eval_prompts()
        if prompts is None:
            return 1
        drafters = [(d.name.removeprefix("conv-"), d) for d in sorted(self.r.glob("conv-*")) if d.is_dir()]
        if self.a.checkpoint:
            drafters.append(("ckpt", self.a.checkpoint))
        for name, d in drafters:
            err = self.r / f"eval-{name}.err"
            for temp in self.a.eval_temps:
                if run(python("-m", "dflash.eval", d, "--prompts", prompts, "--num-prompts", self.a.num_prompts,
                              "--max-new-tokens", self.a.new_tokens, "--temperature", temp, "--seed", 0,
                              "--no-speedup", "--json"), self.a.out / f"eval-{name}-t{temp}.json", err=err):
                    print(tail(err, 3))
            if report.read_json(Path(d) / "drafter_config.json").get("variant") != "xpress":
                log = self.r / f"speed-{name}.log"
                if run(python("-m", "benchmarks.decode.speed", d, "--prompts", prompts, "--num-prompts",
                              self.a.speed_num_prompts, "--max-new-tokens", self.a.speed_new_tokens, "--dtypes",
                              "bfloat16", "--out", self.a.out / f"speed-{name}.json"), log):
                    print(tail(log, 3))
            print(name, report.pick(report.read_json(self.a.out / f"eval-{name}-t0.json"), ("tau", "mean_accepted")))
        return 0


PHASES = {"cache": [Peers.cache], "train": [Peers.train], "eval": [Peers.evaluate],
          "all": [Peers.cache, Peers.train, Peers.evaluate]}


def build_parser() -> argparse.ArgumentParser:
    """The peers recipe's parser: cache, train, eval, or all."""
    p = cli.recipe_parser(PROG, __doc__, [f"{PROG} all OUT", f"{PROG} train OUT --peers ours speculators --pilot-s 60",
                                          f"{PROG} eval OUT --checkpoint runs/other/checkpoints/step_00001000"])
    s = cli.phase_arguments("/tmp/peers", "working directory (caches, runs, drafters)",
                            "the graph whose data, target and drafter shape every trainer shares")
    cli.add_set(s, "the graph wherever it is read (cache, our run, conversions)")
    s.add_argument("--peers", nargs="+", choices=("ours", "speculators", "specforge"),
                   default=["ours", "speculators", "specforge"], help="who trains")
    s.add_argument("--types", nargs="+", default=["dflash", "dflash2", "xpress"], help="speculators' drafter types")
    s.add_argument("--budget-s", type=int, default=300, help="wall-clock seconds each trainer gets")
    s.add_argument("--ours-set", action="append", metavar="KEY=VALUE",
                   help="our run's recipe, repeatable (default: drafter.variant=\"dflash2\", drafter.compile=true)")
    s.add_argument("--ours-steps", type=int, default=6000, help="our run's schedule, in steps")
    s.add_argument("--spec-steps", type=int, default=6000, help="speculators' schedule, in steps (without a pilot)")
    s.add_argument("--sf-steps", type=int, default=6000, help="SpecForge's schedule, in steps (without a pilot)")
    s.add_argument("--pilot-s", type=int, default=0,
                   help="seconds of a pilot run that sets each peer's schedule; 0: none")
    s.add_argument("--sf-save-every", type=int, default=250, help="SpecForge's checkpoint interval, in steps")
    s.add_argument("--total-seq-len", type=int, help="the peers' tokens per step (default: [data].tokens_per_batch)")
    s.add_argument("--spec-args", default="", help="more arguments for speculators.train (one string, word-split)")
    s.add_argument("--sf-overrides", default="", help="section.field=value words for specforge.cli train")
    s.add_argument("--spec-python", help="speculators' interpreter (default: this one, .whl/peers installed)")
    s.add_argument("--spec-pythonpath", default="/tmp/peers-pylib", help="put first on speculators' path")
    s.add_argument("--sf-python", help="SpecForge's interpreter (default: this one, .whl/specforge installed)")
    s.add_argument("--sf-pythonpath", default="/tmp/specforge-pylib", help="put first on SpecForge's path")
    s.add_argument("--checkpoint", help="one more drafter of ours to evaluate beside the peers' (as ckpt)")
    s.add_argument("--prompts", help="eval's prompts: a dflash.eval set (mtbench, humaneval) or a JSONL file "
                   "(default: the quality runs' held-out ShareGPT prompts, the shipped 7M target's only)")
    s.add_argument("--num-prompts", type=int, default=32, help="held-out prompts dflash.eval decodes")
    s.add_argument("--new-tokens", type=int, default=256, help="tokens per held-out prompt")
    s.add_argument("--eval-temps", nargs="*", default=["0", "1"], help="dflash.eval's temperatures")
    s.add_argument("--speed-num-prompts", type=int, default=8, help="prompts z-lab's decoder is timed on")
    s.add_argument("--speed-new-tokens", type=int, default=128, help="tokens per timed prompt")
    sub = p.add_subparsers(dest="phase", required=True, metavar="PHASE")
    for name, fns in PHASES.items():
        doc = fns[0].__doc__ if len(fns) == 1 else "The caches, the training and the eval in one call."
        cli.add_phase(sub, name, doc, fns, [s])
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse, install each peer's carried wheels once, run the phases until one fails."""
    args = build_parser().parse_args(argv)
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONUNBUFFERED"] = "1"
    for attr, wheels, path in (("spec_python", "peers", Path(args.spec_pythonpath)),
                               ("sf_python", "specforge", Path(args.sf_pythonpath))):
        if getattr(args, attr) is None:  # this interpreter, with the peer's carried wheels
            setattr(args, attr, sys.executable)
            carry.install_wheels(carry.WHEELS / wheels, path, args.scratch / f"pip-{path.name}.log", once=True)
    peers = Peers(args)
    for phase in args.run:
        if phase(peers):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
