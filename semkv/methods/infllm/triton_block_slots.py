"""InfLLM's attended slots in one kernel: the initial tokens, the chosen blocks (ascending, each clipped to what the
initial tokens and the local window do not already cover) and the local window, written straight to their places
in the slot list. One program per row and selection set; replaces the concatenation, scan and scatter (about thirty
small kernels a layer) of the torch reference `reference.block_slots`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_slots(BLOCKS, CHOSEN, INIT, LOCAL, N, OUT, LENGTHS, capacity, shared, k,
                 BLOCK_SIZE: tl.constexpr, BLOCK_P: tl.constexpr, SPAN: tl.constexpr):
    b = tl.program_id(0)
    row = b * shared + tl.program_id(1)  # [B, S] flattened
    OUT += row.to(tl.int64) * capacity
    init, local = tl.load(INIT + b), tl.load(LOCAL + b)
    n, chosen = tl.load(N + b), tl.load(CHOSEN + b)
    span = tl.arange(0, SPAN)
    init_n = tl.minimum(init, n)
    for start in range(0, init_n, SPAN):
        tl.store(OUT + start + span, start + span, mask=start + span < init_n)
    cut = n - local  # the local window starts here
    written = init_n
    within = tl.arange(0, BLOCK_P)
    for j in range(0, chosen):  # the chosen blocks, ascending
        block = tl.load(BLOCKS + row.to(tl.int64) * k + j)
        lo = tl.maximum(block * BLOCK_SIZE, init)
        count = tl.maximum(tl.minimum(block * BLOCK_SIZE + BLOCK_SIZE, cut) - lo, 0)
        tl.store(OUT + written + within, lo + within, mask=within < count)
        written += count
    lo = tl.maximum(cut, init)
    count = tl.maximum(n - lo, 0)
    for start in range(0, count, SPAN):
        tl.store(OUT + written + start + span, lo + start + span, mask=start + span < count)
    written += count
    tl.store(LENGTHS + row, written)
    for start in range(0, capacity, SPAN):
        at = start + span
        tl.store(OUT + at, tl.zeros_like(at), mask=(at >= written) & (at < capacity))


def block_slots(top: torch.Tensor, chosen: torch.Tensor, init: torch.Tensor, local: torch.Tensor, n: torch.Tensor,
                block_size: int, capacity: int, span: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments and result as `reference.block_slots`."""
    batch, shared, k = top.shape
    taken = torch.arange(k, device=top.device) < chosen[:, None, None]
    blocks = torch.where(taken, top, 2**40).sort(dim=-1).values.contiguous()  # the chosen ones first, ascending
    out = torch.empty(batch, shared, capacity, dtype=torch.long, device=top.device)
    lengths = torch.empty(batch, shared, dtype=torch.long, device=top.device)
    _block_slots[(batch, shared)](blocks, chosen.contiguous(), init.contiguous(), local.contiguous(), n.contiguous(),
                                  out, lengths, capacity, shared, k, BLOCK_SIZE=block_size,
                                  BLOCK_P=triton.next_power_of_2(block_size), SPAN=span)
    return out, lengths
