"""Wall-clock decode speed, four decoders side by side, batch 1, greedy, per dtype.

Rows (each on the same target, drafter, prompts and GPU):

* ``hf_generate``: target-only ``transformers`` ``generate`` (``do_sample=False``, exactly
  ``--max-new-tokens`` tokens): the baseline users compare against;
* ``greedy``: this project's target-only loop (:func:`dflash.eval.decode.greedy_decode`);
* ``dflash``: this project's draft-and-verify (:func:`~dflash.eval.decode.speculative_decode`, a
  :class:`~dflash.eval.decode.CachedDrafterProposer`);
* ``greedy_graphs``, ``dflash_graphs`` (with ``--cuda-graphs``): ``greedy`` and ``dflash`` with
  ``cuda_graphs=True``, each target step a CUDA-graph replay of a static-shape forward
  (:mod:`dflash.eval.static_target`), and ``dflash_graphs``'s drafter step too
  (:mod:`dflash.eval.static_drafter`); the row's ``target_steps`` (and ``drafter_steps``) says
  whether the graphs were captured, ran eagerly (a CPU, or a failed capture) or fell back to the
  dynamic cache; ``tree_graphs``: tree-verified decoding (:func:`dflash.eval.tree_decode.tree_decode`,
  ``--tree-budget`` draft tokens per tree) with the tree step graphed (:mod:`dflash.eval.static_tree`);
* ``zlab``: z-lab's ``dflash_generate`` on the drafter exported by :func:`dflash.export.export_drafter`
  and loaded by its ``DFlashDraftModel.from_pretrained``, where its package is importable
  (``import zlab_dflash.model``; the directory holding it from ``ZLAB_DFLASH_PATH``, else
  ``/tmp/zl/pkg``); otherwise the row says why it is missing;
* ``export``, ``export_tree``: the same export loaded as a user loads it
  (``AutoModel.from_pretrained(..., trust_remote_code=True)``, its shipped ``modeling_dflash.py``)
  and decoding with its ``spec_generate``: the chain, and the tree of ``--tree-budget`` draft tokens
  per step (``tree_budget``); their verify steps are the target's calls after the prefill.

Each row gives tok/s, ms per verify step (a target forward: one token for the target-only rows),
tau (tokens per verify step), whether every output equals the reference row's (``hf_generate``,
or with ``--decoders`` leaving it out, the first row timed; the JSON's ``reference``), tokens
before the first difference, and the speedup over the reference. On a GPU every timed region ends
with ``torch.cuda.synchronize()``; one warm-up decode per decoder is not timed. Each row is
printed as soon as it is timed (a line with its seconds), the table once every row is: on a large
target the eager rows take minutes, and ``--decoders greedy_graphs,dflash_graphs,zlab`` times only
the rows asked for.

    python -m benchmarks.decode.speed CHECKPOINT (--data SOURCE | --prompts FILE.jsonl)
        [--num-prompts 16] [--max-new-tokens 256] [--dtypes float32,bfloat16] [--threads 1]
        [--cuda-graphs] [--decoders NAME,...] [--tree-budget 32] [--out benchmarks/results/decode_speed_h200.json]

Why bf16 can be slower than fp32 at the shipped 7M target: batch-1 decode there is bound by
kernel launches, not by weight reads, and bf16 adds kernels. Counted with ``torch.profiler`` on
CPU per greedy token of that target: 2,171 aten ops in bf16 against 1,967 in fp32, 274 copies /
dtype casts against 138 (RMSNorm and RoPE compute in fp32 and cast back; in fp32 those casts are
no-ops). Halving bytes buys nothing while the weights fit in cache; at 8B the weight reads
dominate and bf16 wins (``benchmarks/decode/projection.py`` times those shapes).

Prompts are chosen as ``dflash.eval`` chooses them (the run's held-out conversations). Without a
checkpoint, ``--random-drafter`` times a seeded random drafter against ``--target`` (speed does
not need a trained drafter; tau is then about 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch


ROWS = ("hf_generate", "greedy", "dflash", "greedy_graphs", "dflash_graphs", "tree_graphs", "zlab", "export",
        "export_tree")
"""Every row, in the order timed by default."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _zlab():
    """``(zlab_dflash.model, None)`` or ``(None, why it is not importable)``."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:  # its decoder records the cache through 5.x's API
        return None, f"z-lab's dflash 0.1.0 needs transformers 5 (it pins 5.15.0), not {transformers.__version__}"
    where = os.environ.get("ZLAB_DFLASH_PATH", "/tmp/zl/pkg")
    if where not in sys.path:
        sys.path.insert(0, where)
    try:
        import zlab_dflash.model as zl
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to skip the row
        return None, f"zlab_dflash.model not importable from {where} ({type(exc).__name__}: {exc})"
    return zl, None


def _load(args, dtype: str, device: torch.device):
    """``(target, drafter, head, target_config)`` at ``dtype`` (drafter cast to the target's)."""
    import msgspec

    from dflash.model.target import TargetConfig, for_generation, load_target

    if args.random_drafter:
        from dflash.model.drafter import DFlashDrafter, DrafterConfig

        tc = TargetConfig(path=args.target, dtype=dtype, tokenizer=args.target)
        target = load_target(for_generation(tc), device, args.drafter_layers, need_final=True)
        dc = DrafterConfig(num_layers=args.drafter_layers, block_size=args.block_size,
                           mask_token_id=args.mask_token_id).resolve(target.hf_config, target.layer_ids)
        drafter = DFlashDrafter(dc, seed=0).to(device)
    else:
        from dflash.checkpoint.model_files import load_drafter

        drafter, dc, tc = load_drafter(args.checkpoint, device)
        drafter.cfg = msgspec.structs.replace(dc, attn_implementation="sdpa")  # as dflash.eval
        tc = msgspec.structs.replace(tc, dtype=dtype)
        target = load_target(for_generation(tc), device, dc.num_layers, need_final=True)
    drafter.eval().to(target.model.dtype)
    return target, drafter, target.shared_head(), tc


def _prompt_ids(args, tc) -> list[list[int]]:
    from dflash.data.tokenizer import load_tokenizer
    from dflash.eval.cli import prompt_ids

    tok = load_tokenizer(tc.tokenizer_source)
    if args.random_drafter and args.data:
        from dflash.data.prompts import source_prompts
        return source_prompts(args.data, tok, args.num_prompts, args.max_prompt_tokens)
    return prompt_ids(args, tok)


def _decoders(args, target, drafter, head, tmp: Path, wanted: list[str] | None = None):
    """``{name: decode(prompt [n]) -> (tokens [n + N], verify steps)}`` and ``{name: why skipped}``; the
    export rows (and the target-call hook that counts their steps) only when ``wanted`` asks for one."""
    from dflash.eval.decode import CachedDrafterProposer, greedy_decode, speculative_decode
    from dflash.eval.measure import tree_proposer_factory
    from dflash.eval.selector import is_dflash2, selector_proposer
    from dflash.eval.static_drafter import static_proposer
    from dflash.eval.tree_decode import tree_decode

    N, bs = args.max_new_tokens, drafter.cfg.block_size
    dflash2 = is_dflash2(drafter)  # drafts with its selector walk; z-lab's row loads DFlash2DraftModel

    def hf_generate(pr):
        out = target.model.generate(pr[None], attention_mask=torch.ones_like(pr[None]), do_sample=False,
                                    max_new_tokens=N, min_new_tokens=N, pad_token_id=0,
                                    top_p=None, top_k=None, temperature=None)
        return out[0], N

    def spec(pr, graphs=False):
        proposer = None
        if graphs:    # the drafter's step graphed too (dflash.eval.static_drafter), where it can be
            try:
                proposer = static_proposer(drafter, head)
            except ValueError:   # sliding-window layers: the row says so (drafter_steps)
                pass
        if proposer is None:
            proposer = selector_proposer(drafter, head) if dflash2 else CachedDrafterProposer(drafter, head)
        out, acc, _ = speculative_decode(target, proposer, pr, N, bs, cuda_graphs=graphs)
        return out, len(acc)

    def tree(pr):
        make = tree_proposer_factory(drafter, head, cuda_graphs=True)
        out, acc, _ = tree_decode(target, make(), pr, N, bs, args.tree_budget, cuda_graphs=True)
        return out, len(acc)

    found = {"hf_generate": hf_generate, "greedy": lambda pr: (greedy_decode(target, pr, N), N),
             "dflash": spec}
    if args.cuda_graphs:
        found["greedy_graphs"] = lambda pr: (greedy_decode(target, pr, N, cuda_graphs=True), N)
        found["dflash_graphs"] = lambda pr: spec(pr, graphs=True)
        if tree_proposer_factory(drafter, head) is not None:     # XPress has no tree
            found["tree_graphs"] = tree
    skipped = {}
    if wanted is not None and not {"zlab", "export", "export_tree"} & set(wanted):
        return found, skipped      # no export to load, and no counting hook on the timed target
    from dflash.export import export_drafter

    where = tmp / f"export-{target.model.dtype}"
    export_drafter(drafter, where, dtype=target.model.dtype)
    calls = [0]

    def count(*_):
        calls[0] += 1

    target.model.register_forward_pre_hook(count)  # one target call per verify step + prefill

    def counted(decode):
        """``decode(prompt [1, n]) -> [1, n + N]`` as a row: its tokens and the target calls after the prefill."""
        def row(pr):
            before = calls[0]
            with warnings.catch_warnings():  # the past_key_values= spelling, deprecated in transformers 5.x
                warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
                out = decode(pr[None])
            return out[0], calls[0] - before - 1
        return row

    zl, why = _zlab()
    if zl is None:
        skipped["zlab"] = why
    else:
        zmodel = (zl.DFlash2DraftModel if dflash2 else zl.DFlashDraftModel).from_pretrained(
            str(where), dtype=target.model.dtype).to(target.device).eval()
        found["zlab"] = counted(lambda ids: zl.dflash_generate(zmodel, target.model, ids, N, None, block_size=bs))
    from transformers import AutoModel

    ours = AutoModel.from_pretrained(str(where), trust_remote_code=True, dtype=target.model.dtype).to(target.device)
    found["export"] = counted(lambda ids: ours.spec_generate(target.model, ids, N, None))
    found["export_tree"] = counted(lambda ids: ours.spec_generate(target.model, ids, N, None,
                                                                  tree_budget=args.tree_budget))
    return found, skipped


def _target_steps(target, width: int, tree_budget: int | None = None) -> str:
    """How a ``*_graphs`` row's target steps ran: its pooled static step (dflash.eval.static_target;
    with ``tree_budget``, the tree step of dflash.eval.static_tree) captured as a CUDA graph, eager,
    or absent (the target is one the static step refuses)."""
    from dflash.eval import static_target, static_tree

    if tree_budget is None:
        run = static_target.pooled(target, width)
        graph = None if run is None else run.graph
    else:
        run = static_tree.pooled(target, tree_budget)
        graph = None if run is None else run.tree_step.graph
    if run is None:
        return "dynamic cache (the static step refuses this target; see the log)"
    if graph is not None:
        return "cuda graph"
    return "eager static forward" + (" (capture failed; see the log)" if run.k.is_cuda else " (no CUDA)")


def _drafter_steps(drafter) -> str:
    """How ``dflash_graphs``'s drafter steps ran (dflash.eval.static_drafter), as :func:`_target_steps`."""
    from dflash.eval.static_drafter import pooled

    run = pooled(drafter)
    if run is None:
        return "eager cached proposer (the static step refuses this drafter)"
    if run.step.graph is not None:
        return "cuda graph"
    return "eager static forward" + (" (capture failed; see the log)" if run.feats.is_cuda else " (no CUDA)")


def _time_rows(decoders, prompts, device, N, say=None):
    """``{name: row}`` (module docstring), each decoder timed over every prompt after one warm-up;
    ``say(name, row)`` as each row is timed. The first row is the reference of the others'."""
    rows: dict[str, dict] = {}
    outs: dict[str, list[torch.Tensor]] = {}
    for name, fn in decoders.items():
        with torch.no_grad():
            fn(prompts[0])                                          # warm-up (kernels, allocator)
            secs, steps, outs[name] = 0.0, 0, []
            for pr in prompts:
                _sync(device)
                t0 = time.perf_counter()
                out, k = fn(pr)
                _sync(device)
                secs += time.perf_counter() - t0
                steps += k
                outs[name].append(out[: pr.shape[0] + N].cpu())
        rows[name] = {"tok_s": N * len(prompts) / secs, "ms_per_verify_step": 1e3 * secs / steps,
                      "tau": N * len(prompts) / steps, "seconds": secs, "verify_steps": steps}
        if say is not None:
            say(name, rows[name])
    first = next(iter(rows))
    ref = outs[first]
    for name, row in rows.items():
        same = []
        for a, b, pr in zip(outs[name], ref, prompts):
            diff = (a != b).nonzero()
            same.append(int(diff[0, 0]) - pr.shape[0] if len(diff) else N)
        row["outputs_equal"] = sum(s == N for s in same)
        row["tokens_before_first_difference"] = sum(same) / len(same)
        row["speedup_vs_reference"] = rows[first]["seconds"] / row["seconds"]
        if first == "hf_generate":
            row["speedup_vs_hf_generate"] = row["speedup_vs_reference"]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode.speed", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", nargs="?", help="a dflash drafter checkpoint (or --random-drafter)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="the run's data source (its held-out prompts, as dflash.eval)")
    src.add_argument("--prompts", help='JSONL of {"prompt": str}, as dflash.eval --prompts')
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated, one block of rows each")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (batch 1 is launch-bound)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="add the rows greedy_graphs, dflash_graphs and tree_graphs: target steps as CUDA graphs")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--random-drafter", action="store_true", help="a seeded random drafter instead of CHECKPOINT")
    p.add_argument("--target", default="dflash/assets/target-sharegpt-7m", help="with --random-drafter")
    p.add_argument("--block-size", type=int, default=16, help="with --random-drafter")
    p.add_argument("--drafter-layers", type=int, default=3, help="with --random-drafter")
    p.add_argument("--mask-token-id", type=int, default=3, help="with --random-drafter")
    p.add_argument("--decoders", default=None, metavar="NAME,...",
                   help=f"time only these rows, in this order (of {', '.join(ROWS)}; default all, the graphed "
                        "ones with --cuda-graphs); the first is the reference of the others")
    p.add_argument("--tree-budget", type=int, default=32,
                   help="draft tokens per tree of the tree_graphs and export_tree rows")
    p.add_argument("--out", default=None, help="write the result JSON here (e.g. benchmarks/results/decode_speed_h200.json)")
    args = p.parse_args(argv)
    if (args.checkpoint is None) != args.random_drafter:
        p.error("give CHECKPOINT or --random-drafter (one of them)")
    wanted = None
    if args.decoders is not None:
        wanted = [n.strip() for n in args.decoders.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in ROWS]
        if unknown or not wanted:
            p.error(f"--decoders {args.decoders!r}: name rows of {', '.join(ROWS)}")
        if {"greedy_graphs", "dflash_graphs", "tree_graphs"} & set(wanted):
            args.cuda_graphs = True
    torch.set_num_threads(args.threads)
    import tempfile

    device = torch.device(args.device)
    res: dict = {"command": "python -m benchmarks.decode.speed " + " ".join(sys.argv[1:] if argv is None else argv),
                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "threads": args.threads, "new_tokens_per_prompt": args.max_new_tokens, "by_dtype": {}}
    if device.type == "cpu" and hasattr(os, "getloadavg"):
        res["load_average_1min"] = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            target, drafter, head, tc = _load(args, dtype, device)
            prompts = [torch.tensor(x, device=device) for x in _prompt_ids(args, tc)]
            decoders, skipped = _decoders(args, target, drafter, head, Path(tmp), wanted)
            if wanted is not None:
                skipped = {n: why for n, why in skipped.items() if n in wanted}
                decoders = {n: decoders[n] for n in wanted if n in decoders}
            if not decoders:
                print(f"{dtype:9s} no row to time: " + "; ".join(f"{n}: {w}" for n, w in skipped.items()), flush=True)
                continue

            def timed(name, r, dtype=dtype):
                print(f"{dtype:9s} {name:13s} timed: {r['tok_s']:8.1f} tok/s {r['ms_per_verify_step']:7.2f} ms/step "
                      f"tau {r['tau']:.3f} ({r['seconds']:.1f} s)", flush=True)

            rows = _time_rows(decoders, prompts, device, args.max_new_tokens, say=timed)
            for name, width in (("greedy_graphs", 1), ("dflash_graphs", drafter.cfg.block_size)):
                if name in rows:
                    rows[name]["target_steps"] = _target_steps(target, width)
            if "tree_graphs" in rows:
                rows["tree_graphs"]["target_steps"] = _target_steps(target, 0, args.tree_budget)
                rows["tree_graphs"]["tree_budget"] = args.tree_budget
            if "dflash_graphs" in rows:
                rows["dflash_graphs"]["drafter_steps"] = _drafter_steps(drafter)
            res.update(target=tc.path or tc.preset, block_size=drafter.cfg.block_size,
                       drafter_layers=drafter.cfg.num_layers, prompts=len(prompts))
            first = next(iter(rows))
            res["by_dtype"][dtype] = {"rows": rows, "skipped": skipped, "reference": first}
            for name, r in rows.items():
                print(f"{dtype:9s} {name:13s} {r['tok_s']:8.1f} tok/s {r['ms_per_verify_step']:7.2f} ms/step "
                      f"tau {r['tau']:.3f} equal {r['outputs_equal']}/{len(prompts)} "
                      f"speedup {r['speedup_vs_reference']:.2f}x"
                      + ("" if first == "hf_generate" else f" vs {first}")
                      + (f" [target: {r['target_steps']}]" if "target_steps" in r else "")
                      + (f" [drafter: {r['drafter_steps']}]" if "drafter_steps" in r else ""), flush=True)
            for name, why in skipped.items():
                print(f"{dtype:9s} {name:13s} skipped: {why}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
