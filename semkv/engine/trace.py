"""Trace of what one sequence's attention touched, by original token position.

Set `seq.trace = Trace(steps={0})` before prefill and the engine records (1) after prefill, the positions resident
in every layer and KV head (what eviction kept), and (2) at the chosen decode steps, the positions each layer's KV
head attended to (the method's Selection mapped through the page table to `pool.pos`, or every stored slot when the
method selects nothing). Decode step i feeds the i-th generated token, so step 0 is the first step a selection
method chooses for. Sequences without a trace cost the engine one `is None` check per step.
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

    def wants(self, step: int) -> bool:
        return self.steps is None or step in self.steps

    def record_resident(self, kv: SeqKV) -> None:
        self.resident = [list(kv.positions(layer).long().sort(-1).values.cpu().unbind(0))
                         for layer in range(len(kv.num_slots))]

    def record_attended(self, step: int, layer: int, positions: list[torch.Tensor]) -> None:
        layers = self.attended.setdefault(step, [])
        layers.extend([] for _ in range(layer + 1 - len(layers)))
        layers[layer] = positions


def attended_positions(pool: KVPool, table: torch.Tensor, slots: torch.Tensor | None, lengths: torch.Tensor,
                       num_slots: int) -> list[torch.Tensor]:
    """Original positions one sequence's KV heads attend to in one layer: table [max_pages]; slots [S, n] with
    lengths [S] (S = 1 or kv_heads), or None for every one of `num_slots` stored slots -> per KV head ascending
    positions [n]."""
    heads, size = pool.num_kv_heads, pool.page_size
    pos = pool.flat()[2]  # [rows, kv_heads]
    out = []
    for h in range(heads):
        if slots is None:
            chosen = torch.arange(num_slots, device=table.device)
        else:
            s = h if slots.shape[0] > 1 else 0
            chosen = slots[s, : int(lengths[s])]
        rows = table[chosen // size] * size + chosen % size
        out.append(pos[rows, h].long().sort().values.cpu())
    return out
