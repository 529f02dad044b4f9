"""Trace of what one sequence's attention touched, by original token position.

Set `seq.trace = Trace(steps={0})` before prefill and the engine records (1) after prefill, the positions resident
in every layer and KV head (what eviction kept), and (2) at the chosen decode steps, the positions each layer's KV
head attended to (the method's Selection mapped through the page table to `pool.pos`, or every stored slot when the
method selects nothing). Decode step i feeds the i-th generated token, so step 0 is the first step a selection
method chooses for. With `weights=True` it also records, at those steps, the attention probability every query head
gave each attended position (computed over key chunks, so a long context never needs more than one chunk of scores
at a time beyond the [heads, n] result); steps whose keys are rotated by rank (`rope_by_rank`) record none.
Sequences without a trace cost the engine one `is None` check per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from semkv.engine.kv_cache import KVPool, SeqKV


@dataclass
class Trace:
    steps: frozenset[int] | None = frozenset({0})  # decode steps to record; None records every step
    # positions are ascending int64 cpu tensors (slot order differs after decode-time eviction overwrites slots)
    resident: list[list[torch.Tensor]] = field(default_factory=list)  # [layer][kv_head] -> positions [n]
    attended: dict[int, list[list[torch.Tensor]]] = field(default_factory=dict)  # step -> [layer][kv_head] -> [n]
    weights: bool = False  # also record `attention`
    # step -> [layer][kv_head] -> float32 [query heads of the group, n], aligned with `attended`
    attention: dict[int, list[list[torch.Tensor]]] = field(default_factory=dict)

    def wants(self, step: int) -> bool:
        return self.steps is None or step in self.steps

    def record_resident(self, kv: SeqKV) -> None:
        self.resident = [list(kv.positions(layer).long().sort(-1).values.cpu().unbind(0))
                         for layer in range(len(kv.num_slots))]

    def record_attended(self, step: int, layer: int, positions: list[torch.Tensor],
                        attention: list[torch.Tensor] | None = None) -> None:
        for store, value in ((self.attended, positions), (self.attention, attention)):
            if value is not None:
                layers = store.setdefault(step, [])
                layers.extend([] for _ in range(layer + 1 - len(layers)))
                layers[layer] = value


def attended_positions(pool: KVPool, table: torch.Tensor, slots: torch.Tensor | None, lengths: torch.Tensor,
                       num_slots: int, q: torch.Tensor | None = None, scale: float = 1.0,
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Original positions one sequence's KV heads attend to in one layer: table [max_pages]; slots [S, n] with
    lengths [S] (S = 1 or kv_heads), or None for every one of `num_slots` stored slots -> per KV head ascending
    positions [n]; with the (rotated) query q [heads, D], also each query head's attention probabilities over them
    [heads / kv_heads, n] per KV head (else None)."""
    heads, size = pool.num_kv_heads, pool.page_size
    keys, _, pos = pool.flat()  # [rows, kv_heads, D], [rows, kv_heads]
    out, probs = [], []
    for h in range(heads):
        if slots is None:
            chosen = torch.arange(num_slots, device=table.device)
        else:
            s = h if slots.shape[0] > 1 else 0
            chosen = slots[s, : int(lengths[s])]
        rows = table[chosen // size] * size + chosen % size
        positions, order = pos[rows, h].long().sort()
        out.append(positions.cpu())
        if q is not None:
            group = q.shape[0] // heads
            probs.append(attention_probs(q[h * group : (h + 1) * group], keys[:, h], rows[order], scale).cpu())
    return out, probs if q is not None else None


def attention_probs(q: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, scale: float,
                    chunk: int = 4096) -> torch.Tensor:
    """softmax(q . k / sqrt(d)) of queries q [g, D] over the keys at `rows` of keys [rows, D] -> float32 [g, n],
    gathering and scoring `chunk` keys at a time."""
    logits = torch.cat([q.float() @ keys[rows[i : i + chunk]].float().T for i in range(0, len(rows), chunk)], dim=1)
    return torch.softmax(logits * scale, dim=-1)  # [g, n]
