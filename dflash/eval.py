"""Real draft-and-verify decoding against the target, next to the teacher-forced simulation.

One step of speculative decoding (greedy; DFlash / speculative decoding, Leviathan et al. 2023):

1. The last accepted token is the anchor; its target features are not known yet. The drafter
   sees the features of every earlier token and proposes ``bs - 1`` tokens for the block
   ``[anchor, mask, ..., mask]`` in one forward.
2. The target runs over ``[anchor, d_1 .. d_{bs-1}]`` with its KV cache and takes its argmax
   ``g_0 .. g_{bs-1}`` (``g_i`` is its token for the position after block slot ``i``).
3. Accept ``m`` = the longest prefix with ``d_i == g_{i-1}``, then the bonus token ``g_m``; the
   target's features of the anchor and the ``m`` accepted drafts join the context, its cache is
   cropped to the accepted tokens. Output equals plain greedy decoding (tested).

``m`` is the *accepted length* of the step (bonus not counted); the step produces ``tau = m + 1``
tokens, the figure z-lab's reference decoder and SGLang report (:mod:`dflash.acceptance`). Near the
end of a generation only as many tokens are drafted as remain (``min(bs - 1, remaining)``), and
the output is cut to exactly ``max_new_tokens``. Next to the measurement, the same text is scored
teacher-forced: a block at every anchor of the generated region, labels = target argmax. Its streak
at the anchors the decode visited reproduces each measured ``m`` (up to kernel numerics), and its
marginal per-position accuracies give the simulated figure printed in training
(``tau_sim = 1 + sum_j prod_{i<=j} acc_i``).

``python -m dflash.eval CHECKPOINT [--prompts FILE.jsonl | --data SOURCE] [--num-prompts N]
[--max-new-tokens N] [--device DEV]``. Prompts are the first N ``{"prompt": str}`` lines of
``--prompts``, or, with ``--data SOURCE``, the context before the first assistant turn of N
conversations that open with a user turn (others are skipped, so N is honoured when possible):

* when CHECKPOINT is ``RUN_DIR/checkpoints/step_N``, ``RUN_DIR/config.toml`` exists and its
  ``data.source`` is SOURCE: the run's held-out conversations, ``split(data.holdout, data.seed)[1]``
  of its tokenized data (:func:`heldout_prompts`), i.e. none the drafter was trained on;
* otherwise (a copied checkpoint, another source, ``data.holdout = 0``): the *last* N usable
  conversations of SOURCE in file order (:func:`source_prompts`), which may be training data; a
  note on stderr says so.

Bad input (missing checkpoint, a run directory instead of a checkpoint, an unknown ``--data``)
is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path
from typing import Protocol

import math

import msgspec
import torch
import torch.nn.functional as F

from dflash.attention import decode_layout, training_layout
from dflash.drafter import DFlashDrafter, _rope
from dflash.eval_prompts import (EvalInputError, check_checkpoint, encode_prompt, heldout_prompts,
                                 run_data_config, source_prompts)
from dflash.acceptance import (accuracy_per_position, simulated_accepted_length, streak_lengths,
                               tau_from_accepted)
from dflash.target import SharedHead, Target

__all__ = ["CachedDrafterProposer", "DrafterProposer", "EvalResult", "OracleProposer", "PromptResult", "evaluate", "explain",
           "format_result", "greedy_decode", "greedy_labels", "speculative_decode", "teacher_forced"]


class PromptResult(msgspec.Struct, kw_only=True):
    """Per-prompt numbers; ``tau*`` are tokens per verify step (accepted + 1), the others are
    accepted drafts per step (bonus token excluded)."""

    prompt_len: int
    new_tokens: int
    steps: int
    tau: float
    mean_accepted: float
    tau_sim: float
    accepted_sim: float
    streak_all: float
    streak_visited: float


class EvalResult(msgspec.Struct, kw_only=True):
    """Aggregate over prompts.

    Attributes:
        tau: measured tokens per verify step (accepted + 1), over all steps of all prompts: the
            figure z-lab's decoder and SGLang report.
        mean_accepted: measured drafted tokens accepted per verify step (``tau - 1``).
        tau_sim: simulated tokens per step, ``1 + accepted_sim``.
        accepted_sim: ``sum_j prod_{i<=j} acc_j`` from teacher-forced accuracies on the generated
            text (assumes independent errors across block positions).
        streak_visited: teacher-forced streak (accepted drafts) at the anchors the decode visited
            (equals ``mean_accepted`` up to kernel numerics).
        streak_all: teacher-forced mean streak over every anchor of the generated text (the
            simulated accepted length without the independence assumption).
        acc_per_pos: ``[bs-1]`` teacher-forced accuracies.
        block_size: the drafter's block size (tau is at most ``block_size``).
        per_prompt: one :class:`PromptResult` per prompt.
    """

    tau: float
    mean_accepted: float
    tau_sim: float
    accepted_sim: float
    streak_visited: float
    streak_all: float
    acc_per_pos: list[float]
    block_size: int
    per_prompt: list[PromptResult]

    @property
    def tokens_per_step(self) -> float:
        """Alias of :attr:`tau`."""
        return self.tau


class Proposer(Protocol):
    def propose(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """``tokens [n]`` accepted so far (last = anchor), ``features [1, n-1, k*H]`` of all but
        the anchor -> ``[bs-1]`` drafted token ids (the decoder may use only a prefix)."""


class DrafterProposer:
    """Drafts with a :class:`DFlashDrafter` (recomputes the context each step; no drafter cache)."""

    def __init__(self, drafter: DFlashDrafter, head: SharedHead) -> None:
        self.drafter, self.head = drafter, head
        self.bs = drafter.cfg.block_size

    @torch.no_grad()
    def propose(self, tokens, features):
        n = tokens.shape[0]
        block = torch.full((1, 1, self.bs), self.drafter.cfg.mask_token_id, device=tokens.device)
        block[0, 0, 0] = tokens[-1]
        layout = decode_layout(n - 1, n - 1, self.bs, tokens.device)
        hidden = self.drafter(features, self.head.embed(block), layout)      # [1, 1, bs, H]
        return self.head.logits(hidden[0, 0, 1:]).argmax(-1)


class CachedDrafterProposer:
    """Drafts with a :class:`DFlashDrafter` keeping a per-layer KV cache of the context.

    The drafter's context keys/values depend only on the context features (every layer attends to
    the same ``hidden_norm(fc(features))``), and the context only grows by accepted tokens, so each
    step projects the new features alone and the block attends to ``cat(cache, block)`` with no
    mask (full-attention layers: the block sees all context and itself). Same drafts as
    :class:`DrafterProposer` up to float rounding (tested). Use one instance per generation.

    Raises:
        ValueError: the drafter has sliding-window layers (use :class:`DrafterProposer`).
    """

    def __init__(self, drafter: DFlashDrafter, head: SharedHead) -> None:
        if any(t != "full_attention" for t in drafter.cfg.types):
            raise ValueError("CachedDrafterProposer supports full-attention drafter layers only")
        self.drafter, self.head = drafter, head
        self.bs = drafter.cfg.block_size
        self.keys: list[torch.Tensor | None] = [None] * len(drafter.layers)
        self.values: list[torch.Tensor | None] = [None] * len(drafter.layers)
        self.cached = 0

    @torch.no_grad()
    def _extend(self, features: torch.Tensor) -> None:
        """Project the features of context positions ``cached..`` into every layer's cache."""
        d = self.drafter
        new = features[:, self.cached:]                                      # [1, t, k*H]
        if new.shape[1] == 0:
            return
        ctx = d.hidden_norm(d.fc(new.to(d.fc.weight.dtype)))                 # [1, t, H]
        pos = torch.arange(self.cached, self.cached + new.shape[1], device=new.device)[None]
        cos, sin = d._rope_table(pos)
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            k = a.k_norm(a.k_proj(ctx).view(1, -1, a.nkv, a.d)).transpose(1, 2)
            v = a.v_proj(ctx).view(1, -1, a.nkv, a.d).transpose(1, 2)
            k = _rope(k, cos, sin)
            self.keys[i] = k if self.keys[i] is None else torch.cat([self.keys[i], k], dim=2)
            self.values[i] = v if self.values[i] is None else torch.cat([self.values[i], v], dim=2)
        self.cached += new.shape[1]

    @torch.no_grad()
    def propose(self, tokens, features):
        d = self.drafter
        self._extend(features)
        block = torch.full((1, self.bs), d.cfg.mask_token_id, device=tokens.device)
        block[0, 0] = tokens[-1]
        x = self.head.embed(block).to(d.fc.weight.dtype)                     # [1, bs, H]
        qpos = torch.arange(tokens.shape[0] - 1, tokens.shape[0] - 1 + self.bs, device=tokens.device)[None]
        cos, sin = d._rope_table(qpos)
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = _rope(a.q_norm(a.q_proj(h).view(1, self.bs, a.nh, a.d)).transpose(1, 2), cos, sin)
            kb = _rope(a.k_norm(a.k_proj(h).view(1, self.bs, a.nkv, a.d)).transpose(1, 2), cos, sin)
            vb = a.v_proj(h).view(1, self.bs, a.nkv, a.d).transpose(1, 2)
            k = torch.cat([self.keys[i], kb], dim=2) if self.keys[i] is not None else kb
            v = torch.cat([self.values[i], vb], dim=2) if self.values[i] is not None else vb
            out = F.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(a.d),
                                                 enable_gqa=a.nh != a.nkv)
            x = x + a.o_proj(out.transpose(1, 2).reshape(1, self.bs, a.nh * a.d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.head.logits(d.norm(x)[0, 1:]).argmax(-1)


class OracleProposer:
    """Proposes the target's own greedy continuation (an upper bound: every draft is accepted)."""

    def __init__(self, target: Target, block_size: int) -> None:
        self.target, self.bs = target, block_size

    @torch.no_grad()
    def propose(self, tokens, features):
        return greedy_decode(self.target, tokens, self.bs - 1)[tokens.shape[0]:]


def _cache_kwarg(target: Target) -> str:
    """The KV-cache keyword of the base model's forward (``cache`` in newer transformers 5.x)."""
    params = inspect.signature(target.model.model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(target: Target):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=target.hf_config)
    except TypeError:
        return DynamicCache()


def _crop(cache, keep: int) -> None:
    """Keep the first ``keep`` cached tokens. A negative ``crop`` argument means "remove that
    many" in every transformers 5.x; 0 must be skipped (older 5.x read it as "keep 0")."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


@torch.no_grad()
def _target_step(target: Target, ids: torch.Tensor, start: int, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached forward of ``ids [n]`` at positions ``start..``: ``(features [1, n, k*H],
    argmax [n])`` (logits only for these ``n`` positions)."""
    pos = torch.arange(start, start + ids.shape[0], device=ids.device)[None]
    out = target.model.model(input_ids=ids[None], position_ids=pos, use_cache=True,
                              **{_cache_kwarg(target): cache})
    feats = target.collect()
    logits = target.model.get_output_embeddings()(out.last_hidden_state[0])
    return feats, logits.argmax(-1)


@torch.no_grad()
def greedy_decode(target: Target, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Plain greedy decoding with a KV cache: ``prompt [n]`` -> ``[n + max_new_tokens]``."""
    cache = _new_cache(target)
    _, g = _target_step(target, prompt, 0, cache)
    out = [*prompt.tolist(), int(g[-1])]
    for _ in range(max_new_tokens - 1):
        _, g = _target_step(target, torch.tensor(out[-1:], device=prompt.device), len(out) - 1, cache)
        out.append(int(g[-1]))
    return torch.tensor(out, device=prompt.device)


@torch.no_grad()
def speculative_decode(target: Target, proposer: Proposer, prompt: torch.Tensor,
                       max_new_tokens: int, block_size: int
                       ) -> tuple[torch.Tensor, list[int], list[int]]:
    """Greedy draft-and-verify (module docstring).

    Returns:
        ``(tokens [n + max_new_tokens], accepted m per step, anchor index per step)``: the last
        step drafts only as many tokens as remain; a bonus token past the end is dropped.
    """
    cache = _new_cache(target)
    feats, g = _target_step(target, prompt, 0, cache)                        # prefill
    tokens = torch.cat([prompt, g[-1:]])
    accepted, anchors = [], []
    while tokens.shape[0] - prompt.shape[0] < max_new_tokens:
        n = tokens.shape[0]
        remaining = max_new_tokens - (n - prompt.shape[0])                   # >= 1
        draft = proposer.propose(tokens, feats)[: min(block_size - 1, remaining)]  # [<= bs-1]
        block = torch.cat([tokens[-1:], draft])
        f_blk, g = _target_step(target, block, n - 1, cache)                 # g: [bs]
        match = (draft == g[: draft.shape[0]]).long().cumprod(0)
        m = int(match.sum())
        tokens = torch.cat([tokens, draft[:m], g[m:m + 1]])
        feats = torch.cat([feats, f_blk[:, : m + 1]], dim=1)
        _crop(cache, n + m)
        accepted.append(m)
        anchors.append(n - 1)
    return tokens[: prompt.shape[0] + max_new_tokens], accepted, anchors


@torch.no_grad()
def greedy_labels(target: Target, head: SharedHead, tokens: torch.Tensor, anchors: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What greedy verification would accept at each anchor of ``tokens [L]``.

    Returns ``(labels [A, bs-1], valid [A, bs-1], features [1, L+1, k*H])``: ``labels[:, j-1]`` is
    the target's argmax for token ``a + j``, read at position ``a + j - 1``; slot ``j`` is valid
    iff ``a + j < L`` (token ``a + j`` is part of the text, so the decode could have drafted it).
    """
    L = tokens.shape[0]
    ext = torch.cat([tokens, tokens[-1:]])[None]          # one dummy token: features stay causal
    pos = torch.arange(L + 1, device=tokens.device)[None]
    feats, final = target(ext, pos, torch.zeros_like(pos), need_final=True)
    greedy = head.logits(final[0, :L]).argmax(-1)        # greedy[t] = target's token t + 1
    lab_pos = anchors[:, None] + torch.arange(block_size - 1, device=tokens.device)   # a + j - 1
    valid = lab_pos + 1 < L
    return greedy[lab_pos.clamp(max=L - 1)], valid, feats


@torch.no_grad()
def teacher_forced(target: Target, drafter: DFlashDrafter, head: SharedHead, tokens: torch.Tensor,
                   anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Score drafter blocks at ``anchors [A]`` of ``tokens [L]`` against :func:`greedy_labels`.

    Returns ``(correct, valid)``, both ``[A, bs-1]`` bool.
    """
    bs = drafter.cfg.block_size
    labels, valid, feats = greedy_labels(target, head, tokens, anchors, bs)
    pos = torch.arange(feats.shape[1], device=tokens.device)[None]
    block = torch.full((1, anchors.shape[0], bs), drafter.cfg.mask_token_id, device=tokens.device)
    block[0, :, 0] = tokens[anchors]
    layout = training_layout(pos, torch.zeros_like(pos), anchors[None], bs)
    hidden = drafter(feats, head.embed(block), layout)[0]
    return head.logits(hidden[:, 1:]).argmax(-1) == labels, valid


def evaluate(target: Target, drafter: DFlashDrafter, head: SharedHead,
             prompts: list[torch.Tensor], max_new_tokens: int) -> EvalResult:
    """Speculative decode of each prompt ``[n]`` + teacher-forced scoring of the same text."""
    bs = drafter.cfg.block_size
    cached = all(t == "full_attention" for t in drafter.cfg.types)
    per, all_m, all_streak, all_streaks, corrects, valids = [], [], [], [], [], []
    for prompt in prompts:
        proposer = CachedDrafterProposer(drafter, head) if cached else DrafterProposer(drafter, head)
        tokens, acc_m, visited = speculative_decode(target, proposer, prompt, max_new_tokens, bs)
        n = prompt.shape[0]
        region = torch.arange(n, tokens.shape[0], device=tokens.device)     # anchors after prefill
        correct, valid = teacher_forced(target, drafter, head, tokens, region)
        streaks = streak_lengths(correct, valid)
        s_vis = streaks[torch.tensor(visited, device=tokens.device) - n]
        acc = accuracy_per_position(correct, valid)
        mean_m, sim = sum(acc_m) / len(acc_m), simulated_accepted_length(acc)
        per.append(PromptResult(
            prompt_len=n, new_tokens=tokens.shape[0] - n, steps=len(acc_m),
            tau=tau_from_accepted(mean_m), mean_accepted=mean_m,
            tau_sim=tau_from_accepted(sim), accepted_sim=sim,
            streak_all=float(streaks.float().mean()), streak_visited=float(s_vis.float().mean())))
        all_m += acc_m
        all_streaks.append(streaks)
        all_streak += s_vis.tolist()
        corrects.append(correct)
        valids.append(valid)
    acc = accuracy_per_position(torch.cat(corrects), torch.cat(valids))
    mean_m = sum(all_m) / max(len(all_m), 1)
    sim = simulated_accepted_length(acc)
    return EvalResult(tau=tau_from_accepted(mean_m), mean_accepted=mean_m,
                      tau_sim=tau_from_accepted(sim), accepted_sim=sim,
                      streak_visited=sum(all_streak) / max(len(all_streak), 1),
                      streak_all=float(torch.cat(all_streaks).float().mean()),
                      acc_per_pos=acc.tolist(), block_size=bs, per_prompt=per)


def explain(res: EvalResult) -> list[str]:
    """One line per way the measured and simulated figures differ by more than 0.05 tokens/step,
    saying why (empty when they agree)."""
    out = []
    if abs(res.streak_visited - res.mean_accepted) > 0.05:
        out.append("streak@visited != measured: the decode's cached, block-sized target forwards "
                   "round differently from the teacher-forced full forward (kernel numerics), so "
                   "a few near-tied argmaxes flip")
    if res.streak_visited < res.streak_all - 0.05:
        out.append("streak@visited < streak@all: a decode visits anchors in proportion to how short "
                   "their streak is (an accepted run skips the anchors inside it), so the measured "
                   "figure weighs the hard anchors more than an average over all anchors does")
    elif res.streak_visited > res.streak_all + 0.05:
        out.append("streak@visited > streak@all: the anchors this decode happened to visit were "
                   "easier than the average anchor of the same text (few prompts, short texts)")
    if abs(res.accepted_sim - res.streak_all) > 0.05:
        sign = "above" if res.accepted_sim > res.streak_all else "below"
        out.append(f"tau_sim is {sign} streak@all: tau_sim multiplies per-position accuracies as "
                   "if errors were independent; in a block they are correlated (a wrong slot "
                   "makes the next one likelier wrong)" if sign == "above" else
                   f"tau_sim is {sign} streak@all: correct slots cluster in the same blocks, "
                   "which the product of marginals undercounts")
    return out


def format_result(res: EvalResult) -> str:
    """The side-by-side table ``dflash.eval`` prints (tau = tokens per verify step = accepted + 1)."""
    rows = [("measured: draft-and-verify decode", res.tau, res.mean_accepted),
            ("teacher-forced streak @ visited anchors", res.streak_visited + 1, res.streak_visited),
            ("teacher-forced streak @ all anchors", res.streak_all + 1, res.streak_all),
            ("simulated tau_sim (per-position accuracy)", res.tau_sim, res.accepted_sim)]
    lines = [f"{'':44s}{'tau (tokens/step)':>18s}{'accepted/step':>15s}"]
    lines += [f"{name:44s}{t:>18.3f}{a:>15.3f}" for name, t, a in rows]
    lines.append(f"block size {res.block_size} (tau <= {res.block_size}); plain target decoding "
                 "has tau = 1")
    lines.append("acc per position: " + " ".join(f"{a:.2f}" for a in res.acc_per_pos))
    lines += [f"why they differ: {why}" for why in explain(res)]
    return "\n".join(lines)


def _prompts(args, tok) -> list[list[int]]:
    """Token ids of the CLI's prompts (module docstring says which conversations)."""
    if args.prompts:
        lines = Path(args.prompts).read_text(encoding="utf-8-sig").split("\n")  # not splitlines: U+2028 is JSON text
        convs = []
        for n, x in enumerate(lines, 1):
            if not x.strip():
                continue
            try:
                prompt = json.loads(x)["prompt"]
                if not isinstance(prompt, str):
                    raise TypeError("not a string")
            except (ValueError, KeyError, TypeError) as e:
                raise EvalInputError(f"--prompts {args.prompts}:{n}: expected a JSON object with a string "
                                     f'"prompt" ({type(e).__name__}: {e})') from None
            convs.append([{"role": "user", "content": prompt}])
        return [encode_prompt(tok, c, args.max_prompt_tokens) for c in convs[: args.num_prompts]]
    data_cfg = run_data_config(Path(args.checkpoint))
    if data_cfg is None:
        print(f"dflash.eval: {args.checkpoint} is not inside a run directory with config.toml: "
              f"using the last {args.num_prompts} conversations of {args.data} (may be training data)",
              file=sys.stderr)
    elif data_cfg.source != args.data:
        print(f"dflash.eval: --data {args.data} is not the run's data.source ({data_cfg.source}): "
              f"using its last {args.num_prompts} conversations", file=sys.stderr)
    elif data_cfg.holdout == 0:
        print("dflash.eval: the run held out no conversations (data.holdout = 0): using the last "
              f"{args.num_prompts} conversations of {args.data} (training data)", file=sys.stderr)
    else:
        out = heldout_prompts(data_cfg, tok, args.num_prompts, args.max_prompt_tokens)
        if len(out) < args.num_prompts:
            print(f"dflash.eval: only {len(out)} usable held-out conversations "
                  f"(data.holdout = {data_cfg.holdout})", file=sys.stderr)
        return out
    return source_prompts(args.data, tok, args.num_prompts, args.max_prompt_tokens)


def main(argv: list[str] | None = None) -> int:
    from csp.cli import HelpFormatter

    p = argparse.ArgumentParser(
        prog="python -m dflash.eval", formatter_class=HelpFormatter,
        description="Measure a drafter's accepted length by real draft-and-verify decoding against its target.\n\n"
                    "Next to it, the same generated text is scored teacher-forced (the simulation training "
                    "reports).\n"
                    "Output columns (per prompt, then over all prompts; greedy decoding):\n"
                    "  accepted/step   drafted tokens the target accepted per verify step, measured "
                    "(bonus token not counted)\n"
                    "  tokens/step     accepted/step + 1: tokens each verify step emits (the bonus "
                    "token counted)\n"
                    "  streak@visited  teacher-forced accepted streak at the anchors the decode visited; "
                    "equals\n"
                    "                  accepted/step up to kernel numerics (a gap means train/inference "
                    "mismatch)\n"
                    "  streak@all      teacher-forced mean streak over every anchor of the generated "
                    "text\n"
                    "  tau_sim         sum_j prod_{i<=j} acc_i from per-position accuracies (assumes "
                    "independent positions)\n"
                    "  acc per position  teacher-forced accuracy of block positions 1..block_size-1",
        epilog="exit codes:\n  0  evaluated and printed\n  1  an unexpected error (traceback)\n"
               "  2  bad input: missing checkpoint, a run directory instead of a checkpoint, no such "
               "--prompts file,\n     unknown --data source, no usable prompt, target/drafter "
               "layer mismatch\n\nexamples:\n"
               "  python -m dflash.eval runs/dflash-tiny/checkpoints/step_00000300 --data sharegpt\n"
               "  python -m dflash.eval CKPT --prompts prompts.jsonl --num-prompts 32 --json")
    p.add_argument("checkpoint", help="dflash checkpoint directory, e.g. RUN_DIR/checkpoints/step_00000300")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", metavar="FILE.jsonl", help='JSONL file, one {"prompt": str} per line')
    src.add_argument("--data", metavar="SOURCE", help="a dflash.data source (e.g. sharegpt): the run's "
                     "held-out conversations when the checkpoint is in its run directory, else the last "
                     "N of SOURCE")
    p.add_argument("--num-prompts", type=int, default=8, metavar="N", help="prompts to decode")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="tokens to generate per prompt")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, metavar="N",
                   help="prompt tokens kept (the last ones)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--json", action="store_true", help="print the EvalResult as one JSON object")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.max_prompt_tokens < 1:
        p.error("--num-prompts, --max-new-tokens and --max-prompt-tokens must be >= 1")
    from dflash.data import DataError
    from dflash.data.sources import resolve_source

    try:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise EvalInputError(f"--device {args.device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
        if device.type == "cuda" and (not torch.cuda.is_available()
                                      or (device.index or 0) >= torch.cuda.device_count()):
            raise EvalInputError(f"--device {args.device}: this machine has {torch.cuda.device_count()} "
                                 "CUDA device(s); use --device cpu")
        check_checkpoint(args.checkpoint)
        if args.prompts and not Path(args.prompts).is_file():
            raise EvalInputError(f"--prompts {args.prompts}: no such file")
        if args.data:
            resolve_source(args.data)  # an unknown source fails here, before loading any model
    except (EvalInputError, DataError) as exc:
        print(f"dflash.eval: {exc}", file=sys.stderr)
        return 2

    from dflash.data.tokenizer import load_tokenizer
    from dflash.model_io import load_drafter
    from dflash.runlog import quiet_progress_bars_when_piped
    from dflash.target import for_generation, load_target

    quiet_progress_bars_when_piped()  # no "Loading weights" tqdm bar in a log file
    try:
        drafter, dc, tc = load_drafter(args.checkpoint, args.device)
    except ValueError as exc:
        print(f"dflash.eval: {exc}", file=sys.stderr)
        return 2
    # a run trained with flex_attention decodes with sdpa: same outputs, no compile per length
    drafter.cfg = dc = msgspec.structs.replace(dc, attn_implementation="sdpa")
    target = load_target(for_generation(tc), args.device, dc.num_layers, need_final=True)
    if target.layer_ids != list(dc.target_layer_ids):
        print(f"dflash.eval: target layers {target.layer_ids} != drafter's {dc.target_layer_ids}",
              file=sys.stderr)
        return 2
    drafter.to(target.model.dtype)
    head = target.shared_head()
    tok = load_tokenizer(tc.tokenizer or tc.path or "builtin:tiny")
    try:
        ids = _prompts(args, tok)
    except (EvalInputError, DataError, ValueError, KeyError) as exc:
        print(f"dflash.eval: {exc}", file=sys.stderr)
        return 2
    if not ids:
        print("dflash.eval: no usable prompt (every conversation opens with an assistant turn)",
              file=sys.stderr)
        return 2
    prompts = [torch.tensor(x, device=args.device) for x in ids]
    res = evaluate(target, drafter, head, prompts, args.max_new_tokens)
    if args.json:
        print(msgspec.json.encode(res).decode())
        return 0
    for i, r in enumerate(res.per_prompt):
        print(f"prompt {i}: len {r.prompt_len} new {r.new_tokens} steps {r.steps} "
              f"tau {r.tau:.3f} (accepted {r.mean_accepted:.3f}) streak@visited {r.streak_visited:.3f} "
              f"streak@all {r.streak_all:.3f} tau_sim {r.tau_sim:.3f}")
    print(format_result(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
