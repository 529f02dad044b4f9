"""DynSplit-KV's splitting side: delimiter candidates from the vocabulary, their importance by attention dependency
(the paper's Algorithm 1), and DD-Select, which cuts a token sequence into chunks of about `chunk_size` tokens that
end at the most important nearby delimiter. Used by `semkv.methods.dynsplit.method`.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from semkv.methods.base import window_attention
from semkv.models.parallel import TensorParallel, over_heads

DEFAULT_DELIMITERS = ".!?;:,'\"()[]{}\n"
# The paper's Table 7 (Mistral-7B-Instruct-v0.2), by delimiter text. Newline and braces are not in the table; they
# get the weight of their nearest kind: a line break ends a paragraph or a statement (as "."), "}" closes a block
# (as ";"), "{" opens one (as "(").
TABLE7 = {".": 1.0, "!": 1.0, "?": 0.9, ";": 0.7, ":": 0.7, ",": 0.6, "'": 0.5, '"': 0.9, "(": 0.5, ")": 0.6,
          "[": 0.5, "]": 0.5, "\n": 1.0, "{": 0.5, "}": 0.7}
ROWS_PER_PASS = 256  # query rows whose attention is materialised at once by the dependency scorer


@lru_cache(maxsize=4)
def _token_texts(tokenizer: Any) -> tuple[str, ...]:
    """Decoded text of every vocabulary id (private scan; SentenceKV's `sentencekv/vocab.py` does the same)."""
    return tuple(tokenizer.batch_decode([[i] for i in range(len(tokenizer))]))


@lru_cache(maxsize=8)
def delimiter_candidates(tokenizer: Any, delimiters: str) -> dict[int, str]:
    """Token id -> text of every token made only of delimiter characters and whitespace, with at least one delimiter
    (byte-level BPE merges punctuation with spaces and newlines: " (", "\\n   ", "):" are candidates). Cached per
    tokenizer: do not modify the result."""
    special = set(getattr(tokenizer, "all_special_ids", []))
    chars = set(delimiters)
    out = {}
    for i, text in enumerate(_token_texts(tokenizer)):
        if i in special or not any(c in chars for c in text):
            continue
        if all(c in chars or c.isspace() for c in text):
            out[i] = text
    return out


def table7_weight(text: str) -> float:
    """A candidate's fallback weight: the largest Table 7 weight among its characters ("..." counts as ".")."""
    return max((TABLE7.get(c, 0.0) for c in text), default=0.0)


def arrange_weights(weights: dict[int, float], mode: str) -> dict[int, float]:
    """The ablations of the paper's Figure 11: 'uniform' (all delimiters equal), 'reversed' (importance order
    reversed: w -> max + min - w, same range); anything else keeps the weights."""
    if mode == "uniform":
        return dict.fromkeys(weights, 1.0)
    if mode == "reversed" and weights:
        hi, lo = max(weights.values()), min(weights.values())
        return {t: hi + lo - w for t, w in weights.items()}
    return dict(weights)


class AttentionDependency:
    """Algorithm 1, accumulated chunk by chunk during a prefill, so no full L x L attention map ever exists.

    For a delimiter at position i, future queries F_i = {i+1..i+W}, retained keys O_i = {i-R+1..i} and dropped keys
    D_i = {0..i-R}: s_i = mean over layers, query heads and q in F_i of
    sum_{k in O_i} A[q, k] - alpha * sum_{k in D_i} A[q, k]. Only positions i >= R are scored: below R the paper's
    max(0, .) bounds put key 0 (the attention sink) in both sets, which cancels the drop term and would favour
    delimiters that occur early in a text.
    `observe` takes the queries of one prefill chunk with all keys stored so far; each query row contributes to the
    delimiters among the W positions before it. Rows are processed ROWS_PER_PASS at a time: memory is O(rows * L).
    """

    def __init__(self, is_delimiter: torch.Tensor, future_window: int, overlap: int, drop_penalty: float,
                 limit: int, tp: TensorParallel | None = None):
        self.tp = tp  # the mean over query heads takes every rank's heads
        self.is_delimiter = is_delimiter  # [n] bool, by position
        self.future_window, self.overlap, self.drop_penalty = future_window, overlap, drop_penalty
        self.limit = min(limit, is_delimiter.shape[0])  # only queries at positions < limit are used
        self.sums = torch.zeros(is_delimiter.shape[0], dtype=torch.float64)  # [n]
        self.counts = torch.zeros(is_delimiter.shape[0], dtype=torch.long)  # [n]

    def observe(self, q: torch.Tensor, keys: torch.Tensor, start: int) -> None:
        """q [C, heads, D] (after RoPE) of positions [start, start + C); keys [kv_heads, >= start + C, D]."""
        end = min(start + q.shape[0], self.limit)
        for lo in range(start, end, ROWS_PER_PASS):
            hi = min(lo + ROWS_PER_PASS, end)
            qpos = torch.arange(lo, hi, device=q.device)
            key_pos = torch.arange(hi, device=q.device)[None].expand(keys.shape[0], -1)
            probs = window_attention(q[lo - start:hi - start], keys[:, :hi], key_pos, qpos)  # [heads, m, hi]
            self.add_rows(over_heads(self.tp, probs, 0), qpos)

    def add_rows(self, probs: torch.Tensor, qpos: torch.Tensor) -> None:
        """probs [m, n] attention rows (already averaged over heads) of queries at positions qpos [m]."""
        cum = probs.double().cumsum(-1)  # [m, n]
        delim = qpos[:, None] - torch.arange(1, self.future_window + 1, device=qpos.device)[None]  # [m, W]
        cut = delim - self.overlap  # last dropped key
        valid = (cut >= 0) & self.is_delimiter.to(qpos.device)[delim.clamp(min=0)]
        upto_i, dropped = cum.gather(1, delim.clamp(min=0)), cum.gather(1, cut.clamp(min=0))
        score = (upto_i - dropped) - self.drop_penalty * dropped  # [m, W]
        self.sums.index_add_(0, delim[valid].cpu(), score[valid].cpu())
        self.counts.index_add_(0, delim[valid].cpu(), torch.ones_like(delim[valid]).cpu())

    def by_token(self, ids: list[int]) -> dict[int, tuple[float, int]]:
        """Token id -> (sum of position scores s_i, number of scored positions)."""
        out: dict[int, tuple[float, int]] = {}
        for i in torch.nonzero(self.counts).flatten().tolist():
            s, c = out.get(ids[i], (0.0, 0))
            out[ids[i]] = (s + float(self.sums[i] / self.counts[i]), c + 1)
        return out


def normalise(scores: dict[int, float]) -> dict[int, float]:
    """Mean dependency score per delimiter token -> weight in [0, 1]: min-max over the scored tokens (the most
    important delimiter gets 1, the least 0; all equal -> 1)."""
    if not scores:
        return {}
    hi, lo = max(scores.values()), min(scores.values())
    return {t: (s - lo) / (hi - lo) if hi > lo else 1.0 for t, s in scores.items()}


def dd_select(weights: list[float], start: int, chunk_size: int, max_deviation: int, alpha: float,
              fixed: bool = False) -> list[int]:
    """DD-Select from `start` over per-position delimiter weights (< 0: not a delimiter): the ends (exclusive) of the
    chunks that can be closed. A chunk [s, e) ends at the boundary e in [s+C-Delta, s+C+Delta] (e > s) whose token
    e-1 is a delimiter, maximising alpha * w + (1 - alpha) * p with p = 1 - |e - (s+C)| / Delta (1 when Delta = 0);
    ties go to the earlier boundary; no delimiter in range (or `fixed`) -> s + C. A chunk is closed only once its
    whole search range is known (s + C + Delta <= len(weights)), so the open tail is recomputed as tokens arrive and
    a prefix is always split as the full sequence would be."""
    n = len(weights)
    ends = []
    s = start
    while s + chunk_size + max_deviation <= n:
        target = s + chunk_size
        best, best_score = target, float("-inf")
        for e in range(max(s + 1, target - max_deviation), target + max_deviation + 1):
            w = weights[e - 1]
            if fixed or w < 0:
                continue
            closeness = 1.0 - abs(e - target) / max_deviation if max_deviation else 1.0
            score = alpha * w + (1.0 - alpha) * closeness
            if score > best_score:
                best, best_score = e, score
        ends.append(best)
        s = best
    return ends
