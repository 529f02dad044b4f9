"""Selection diagnostics: needle retention and critical-token recall, per layer and KV head, from engine traces.

Needle retention (samples with a known answer span): a (layer, KV head) retains the needle when every token of the
answer span is among the positions it attended at every traced decode step, the answer's steps (for eviction methods
these are the resident positions, so this is "still in the cache"). The answer span is each gold answer's occurrence
inside the sample's needles (any one occurrence of an answer, all answers), or the whole needle when no answer occurs
in it. Reported as the fraction of (layer, head) pairs that retain it and the number of layers where all heads do.

Critical-token recall (any prompt): at each traced decode step that Full KV reached with the same tokens, per layer
and query head, the share of the attention mass of Full KV's top-k positions (k = the method's budget in tokens) that
the method's attended set covers, and the attention-mass recall, the Full KV attention probability summed over the
attended set (TokenSelect, Figure 2b). Both are averaged over the query heads of a KV head and over the steps. The
Full KV probabilities come from its trace (`Trace.weights`), computed by the engine one key chunk at a time, so no
[L, L] matrix is formed.
"""
from __future__ import annotations

from typing import Any

import torch

from semkv.engine.hooks import resolve_budget
from semkv.engine.trace import Trace


def _occurrences(text: str, piece: str, lo: int = 0, hi: int | None = None) -> list[tuple[int, int]]:
    out, hi = [], len(text) if hi is None else hi
    at = text.find(piece, lo, hi) if piece else -1
    while at >= 0:
        out.append((at, at + len(piece)))
        at = text.find(piece, at + 1, hi)
    return out


def answer_spans(text: str, offsets: list[tuple[int, int]], needles: list[str],
                 answers: list[str]) -> list[list[torch.Tensor]]:
    """Token positions the answer depends on, as requirements each met by any one of its alternatives: for every gold
    answer found inside a needle of `text`, its occurrences there; else each needle itself. offsets: each prompt
    token's (start, end) character span in `text` (special tokens (0, 0))."""
    found = [span for needle in needles for span in _occurrences(text, needle)]
    spans = [[occ for lo, hi in found for occ in _occurrences(text, answer, lo, hi)] for answer in answers]
    requirements = [alts for alts in spans if alts] or [[span] for span in found]
    starts = torch.tensor([s for s, _ in offsets])  # [n_prompt]
    ends = torch.tensor([e for _, e in offsets])  # [n_prompt]
    return [[torch.nonzero((ends > lo) & (starts < hi) & (ends > starts)).flatten() for lo, hi in alts]
            for alts in requirements]


def prompt_requirements(llm: Any, prompt: str, question: str | None, chat: bool, answer_prefix: str,
                        needles: list[str], answers: list[str]) -> list[list[torch.Tensor]] | None:
    """`answer_spans` of a prompt as `LLM.encode` tokenizes it (None without a needle found in it)."""
    if not needles:
        return None
    text = llm.prompt_text(prompt, question, chat, answer_prefix)
    enc = llm.tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True)
    return answer_spans(text, enc["offset_mapping"], needles, answers) or None


def kept_positions(trace: Trace, steps: list[int]) -> list[list[torch.Tensor]]:
    """[layer][kv_head] -> positions attended at every one of `steps` (the resident ones when none was traced)."""
    if not steps:
        return trace.resident
    kept = trace.attended[steps[0]]
    for step in steps[1:]:
        kept = [[a[torch.isin(a, b)] for a, b in zip(la, lb)] for la, lb in zip(kept, trace.attended[step])]
    return kept


def retention(trace: Trace, requirements: list[list[torch.Tensor]]) -> torch.Tensor:
    """bool [layers, kv_heads]: whether each (layer, head) retains every requirement at all traced steps."""
    kept = kept_positions(trace, sorted(trace.attended))
    return torch.tensor([[all(any(bool(torch.isin(alt, positions).all()) for alt in alts) for alts in requirements)
                          for positions in heads] for heads in kept])


def _shared_steps(out: Any, full: Any) -> list[int]:
    """Traced steps at which the method's inputs so far equal Full KV's (the same query context)."""
    return [s for s in sorted(full.trace.attention) if s in out.trace.attended
            and out.token_ids[: s + 1] == full.token_ids[: s + 1]]


def recall(out: Any, full: Any, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(top-k recall, mass recall) [layers, kv_heads] of a method's output against Full KV's (both `GenerationOutput`
    of the same prompt with traces, Full KV's with weights), averaged over shared steps; None without one."""
    steps = _shared_steps(out, full)
    if not steps:
        return None
    topk_sum = mass_sum = 0.0
    for step in steps:
        rows_top, rows_mass = [], []
        for full_heads, probs_heads, attended_heads in zip(full.trace.attended[step], full.trace.attention[step],
                                                           out.trace.attended[step]):
            top, mass = [], []
            for positions, probs, attended in zip(full_heads, probs_heads, attended_heads):
                inside = torch.isin(positions, attended).float()  # [n]
                best = probs.topk(min(k, probs.shape[1]), dim=1)  # [g, k]
                top.append(((best.values * inside[best.indices]).sum(1) / best.values.sum(1)).mean())
                mass.append((probs * inside).sum(1).mean())
            rows_top.append(torch.stack(top))
            rows_mass.append(torch.stack(mass))
        topk_sum = topk_sum + torch.stack(rows_top)
        mass_sum = mass_sum + torch.stack(rows_mass)
    return topk_sum / len(steps), mass_sum / len(steps)


def head_maps(out: Any, full: Any | None, budget: int | float | None,
              requirements: list[list[torch.Tensor]] | None, n_prompt: int) -> dict[str, torch.Tensor]:
    """Per (layer, KV head) maps [layers, kv_heads]: retention (0/1, when there are requirements), recall and mass
    recall (when Full KV's output with weights is given and shares a step); k = the budget in tokens."""
    maps: dict[str, torch.Tensor] = {}
    if requirements:
        maps["retention"] = retention(out.trace, requirements).float()
    if full is not None and full.trace.attention:
        both = recall(out, full, n_prompt if budget is None else resolve_budget(budget, n_prompt))
        if both is not None:
            maps["recall"], maps["mass_recall"] = both
    return maps


def summarize(maps: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A result row's `diag`: the overall numbers and per-layer ones (retention: share of heads; recall: head mean)."""
    diag: dict[str, Any] = {}
    for name, values in maps.items():
        diag[name] = round(float(values.mean()), 4)
        diag[f"layers_{name}"] = [round(float(x), 4) for x in values.mean(1)]
    if "retention" in maps:
        diag["retained_layers"] = int((maps["retention"] == 1).all(1).sum())
    return diag
