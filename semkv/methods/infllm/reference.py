"""Plain-torch references of infllm's kernels: what the Triton kernels are tested against, and the CPU path."""
from __future__ import annotations

import torch

from semkv.kernels.reference import compact_slots


def block_slots(top: torch.Tensor, chosen: torch.Tensor, init: torch.Tensor, local: torch.Tensor, n: torch.Tensor,
                block_size: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """InfLLM's attended slots: the initial tokens [0, init), the chosen blocks and the local window [n - local, n).
    top [B, S, k] block indices, best first (a top-k of the block scores); chosen [B] how many of them each row takes
    (<= k); init / local / n [B] the row's initial tokens, local window and stored slots. A block's slots that also
    lie in the initial tokens or the local window count once; with n <= init + local a row attends to [0, n).
    Returns slots [B, S, capacity], ascending and then 0, and lengths [B, S]."""
    batch, shared, k = top.shape
    device = top.device
    slot = torch.arange(capacity, device=device)
    parts = [(slot.expand(batch, 1, -1), (slot < torch.minimum(init, n)[:, None])[:, None])]
    if k:
        taken = torch.arange(k, device=device) < chosen[:, None, None]  # [B, 1, k]
        blocks = torch.where(taken, top, -1).sort(dim=-1).values  # the chosen ones ascending, after the -1s
        slots = (blocks[..., None] * block_size + torch.arange(block_size, device=device)).flatten(2)
        inside = (slots >= init[:, None, None]) & (slots < (n - local)[:, None, None])
        parts.append((slots, (blocks >= 0).repeat_interleave(block_size, dim=-1) & inside))
    window = (n - local)[:, None] + slot  # [B, capacity]
    parts.append((window[:, None], ((window >= init[:, None]) & (window < n[:, None]))[:, None]))
    slots = torch.cat([p.expand(-1, shared, -1) for p, _ in parts], -1)  # [B, S, all candidates]
    valid = torch.cat([v.expand(-1, shared, -1) for _, v in parts], -1)
    return compact_slots(slots, valid, capacity)  # [initial | blocks | local]
