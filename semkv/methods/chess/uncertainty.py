"""Uncertainty of next-token distributions: entropy per token, mean entropy and varentropy per page of tokens, and
teacher-forced entropies of a text for offline calibration (CHESS's re-selection trigger)."""
from __future__ import annotations

from typing import Any

import torch

from semkv.engine.kv_cache import SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.engine.step import PrefillStep
from semkv.methods.full import FullKV


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(logits): [..., vocab] -> [...]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def page_uncertainty(entropies: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean entropy and varentropy (the population variance of the entropies) over the last dim: [..., n] -> [...]."""
    return entropies.mean(-1), entropies.var(-1, unbiased=False)


@torch.inference_mode()
def teacher_forced_entropies(llm: Any, ids: list[int]) -> torch.Tensor:
    """Entropy of the model's next-token distribution at every token of `ids` [n], run with Full KV in prefill chunks
    (the logits of one chunk at a time, never of the whole text)."""
    engine = llm.engine
    seq = Sequence(0, ids, SamplingParams(), SeqKV(engine.pool))
    tokens = torch.tensor(ids, device=engine.device)
    out = []
    try:
        for start in range(0, len(ids), engine.prefill_chunk):
            end = min(start + engine.prefill_chunk, len(ids))
            step = PrefillStep(engine, seq, FullKV(), start, end, evict=False)
            out.append(token_entropy(engine.model(tokens[start:end], step)))  # [chunk]
    finally:
        seq.kv.release()
    return torch.cat(out).cpu() if out else torch.zeros(0)
