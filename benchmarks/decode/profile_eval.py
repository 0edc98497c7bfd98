"""Where ``dflash.eval``'s time goes: each phase of :func:`dflash.eval.measure.evaluate` timed apart,
then one draft-and-verify decode under ``cProfile`` (host time per Python function) and
``torch.profiler`` (time per aten op and CUDA kernel, host-device syncs counted).

    python -m benchmarks.decode.profile_eval CHECKPOINT [--prompts mtbench] [--num-prompts 8]
        [--max-new-tokens 128] [--dtype float32] [--device cuda] [--out DIR]

Phases (each synchronised): the greedy draft-and-verify decodes, the target-alone greedy decodes
(the speed baseline), the sampled decodes (``--temperature``), and the teacher-forced scoring of
the decoded text (the backbone's blocks at every anchor, :func:`dflash.eval.measure.teacher_forced`). Per verify step: milliseconds, and the share of it in the proposer (the
drafter's forward and, for DFlash2, the selector's walk) against the target's verify forward.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Timed:
    """Wraps a proposer: synchronised seconds spent in ``propose``/``sample`` (the drafter side)."""

    def __init__(self, inner, device):
        self.inner, self.device, self.seconds, self.calls = inner, device, 0.0, 0

    def propose(self, tokens, features):
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.inner.propose(tokens, features)
        _sync(self.device)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--prompts", default="mtbench")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="directory for profile.json and the profiler tables")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    import msgspec

    from dflash.checkpoint.model_files import load_drafter, locate_target
    from dflash.data.prompts import encode_prompt
    from dflash.data.tokenizer import load_tokenizer
    from dflash.eval.decode import greedy_decode, speculative_decode
    from dflash.eval.measure import proposer_factory, teacher_forced
    from dflash.eval.sets import load_prompt_set
    from dflash.model.target import for_generation, load_target

    device = torch.device(args.device)
    drafter, dc, tc = load_drafter(args.checkpoint, device)
    drafter.cfg = msgspec.structs.replace(dc, attn_implementation="sdpa")
    tc = msgspec.structs.replace(locate_target(tc, args.checkpoint), dtype=args.dtype)
    target = load_target(for_generation(tc), device, dc.num_layers, need_final=True)
    drafter.eval().to(target.model.dtype)
    head = target.shared_head()
    tok = load_tokenizer(tc.tokenizer_source)
    _, chosen = load_prompt_set(args.prompts)
    prompts = [torch.tensor(encode_prompt(tok, [{"role": "user", "content": q.turns[0]}], 1024, None),
                            device=device) for q in chosen[: args.num_prompts]]
    N, bs = args.max_new_tokens, dc.block_size
    factory = proposer_factory(drafter, head)
    speculative_decode(target, factory(), prompts[0], N, bs)           # warm-up
    greedy_decode(target, prompts[0], N)

    res: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                 "dtype": args.dtype, "variant": dc.variant, "block_size": bs, "prompts": len(prompts),
                 "max_new_tokens": N, "torch": torch.__version__}
    decoded, steps, prop_s = [], 0, 0.0  # (tokens, prompt length) of each decode
    _sync(device)
    t0 = time.perf_counter()
    for i, pr in enumerate(prompts):
        prop = _Timed(factory(), device)
        out, acc, vis = speculative_decode(target, prop, pr, N, bs)
        decoded.append((out, pr.shape[0]))
        steps += len(acc)
        prop_s += prop.seconds
    _sync(device)
    spec_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for pr in prompts:
        greedy_decode(target, pr, N)
    _sync(device)
    greedy_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for out, n in decoded:  # the backbone's teacher-forced blocks at every anchor of the text
        teacher_forced(target, drafter, head, out, torch.arange(n, out.shape[0], device=device))
    _sync(device)
    score_s = time.perf_counter() - t0
    res.update(spec_seconds=spec_s, verify_steps=steps, ms_per_verify_step=1e3 * spec_s / steps,
               proposer_ms_per_step=1e3 * prop_s / steps, tau=N * len(prompts) / steps,
               greedy_seconds=greedy_s, greedy_ms_per_token=1e3 * greedy_s / (N * len(prompts)),
               score_seconds=score_s)
    print(json.dumps(res, indent=1), flush=True)

    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    prof = cProfile.Profile()
    prof.enable()
    speculative_decode(target, factory(), prompts[1 % len(prompts)], N, bs)
    _sync(device)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
    text = s.getvalue()
    print(text[:6000], flush=True)
    if out_dir:
        (out_dir / "cprofile.txt").write_text(text)

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as tp:
        speculative_decode(target, factory(), prompts[1 % len(prompts)], N, bs)
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    t1 = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    t2 = tp.key_averages().table(sort_by=key, row_limit=25)
    print(t1[:7000], "\n", t2[:5000], flush=True)
    if out_dir:
        (out_dir / "torch_profile.txt").write_text(t1 + "\n\n" + t2)
        (out_dir / "profile.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
