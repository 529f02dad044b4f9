"""Rows of per-sequence method state kept in batched device tensors (SentenceKV's buckets, DynSplit-KV's chunks):
which row belongs to which sequence (row 0 is never handed out: the padding rows of a graphed step read and write it;
a row is free again once its sequence has finished or is gone), and growing the tensors."""
from __future__ import annotations

import weakref

import torch

from semkv.engine.offload import grown_capacity
from semkv.engine.sequence import Sequence


class RowOwners:
    def __init__(self) -> None:
        self.owners: dict[int, weakref.ref] = {}  # row -> its sequence

    def take(self, seq: Sequence) -> int:
        """A free row (>= 1) for `seq`; the caller empties it (a freed row holds its last owner's state)."""
        for row, ref in list(self.owners.items()):
            owner = ref()
            if owner is None or owner.finished:
                del self.owners[row]
        row = next(r for r in range(1, len(self.owners) + 2) if r not in self.owners)
        self.owners[row] = weakref.ref(seq)
        return row


def grown_sizes(needs: tuple[int, ...], have: tuple[int, ...], slack: tuple[int, ...]) -> list[int] | None:
    """Sizes that hold `needs` (a grown size gets an eighth more, at least its `slack`), or None when `have` holds
    them already."""
    if all(n <= h for n, h in zip(needs, have)):
        return None
    return [grown_capacity(n, s) if n > h else h for n, h, s in zip(needs, have, slack)]


def regrown(old: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A zero tensor of `shape` (dtype and device of `old`) holding `old` in its leading corner: a normal tensor,
    written outside generation too. One tensor at a time, so growing needs the memory of one new tensor at most."""
    with torch.inference_mode(False):
        new = torch.zeros(shape, dtype=old.dtype, device=old.device)
        new[tuple(slice(0, n) for n in old.shape)] = old
    return new
