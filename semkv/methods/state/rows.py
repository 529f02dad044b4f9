"""Rows of per-sequence method state kept in batched device tensors (SentenceKV's buckets, DynSplit-KV's chunks):
which rows are taken (row 0 is never handed out: the padding rows of a graphed step read and write it; a row is free
again once the engine releases its request), growing the tensors, what a growth would cost (the
engine admits a request only when the device has that memory free beside the KV pool), and the admission hooks of a
method that keeps such rows (`RowHolder`)."""
from __future__ import annotations

import math
from typing import Callable

import torch

from semkv.engine.hooks import BatchedHooks
from semkv.engine.kv_cache import KVPool
from semkv.engine.offload import HostKVStore, grown_capacity, token_bytes
from semkv.engine.sequence import Sequence


class RowOwners:
    def __init__(self) -> None:
        self.taken: set[int] = set()

    def next_row(self) -> int:
        """The row `take` would hand out now (>= 1)."""
        return next(r for r in range(1, len(self.taken) + 2) if r not in self.taken)

    def take(self) -> int:
        """A free row (>= 1); the caller empties it (a freed row holds its last owner's state)."""
        row = self.next_row()
        self.taken.add(row)
        return row

    def free(self, row: int) -> None:
        self.taken.discard(row)


class DeviceRows:
    """Tensors whose shapes follow a few sizes (rows first): a subclass names its sizes now (`sizes`), the minimum
    growth of each (`slack`) and the shape of every tensor for given sizes (`shapes`). A name in `layered` is a list
    of one tensor per layer (its shape's first size; DynSplit-KV's chunk summaries, 0.29 GB a 32k sequence). A
    growth is all or nothing: every new tensor is made before any replaces its old one, so a growth that runs out
    of memory leaves the rows as they were for the requests that hold them (admission counts the new tensors:
    `growth_bytes`)."""

    slack: tuple[int, ...]
    layered: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.owners = RowOwners()

    def sizes(self) -> tuple[int, ...]:
        raise NotImplementedError

    def shapes(self, *sizes: int) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def grow(self, needs: tuple[int, ...]) -> bool:
        """Room for `needs`; True when the tensors moved."""
        size = grown_sizes(needs, self.sizes(), self.slack)
        if size is None:
            return False
        try:
            grown = self._grown(size)
        except torch.cuda.OutOfMemoryError:
            # torch's cached, unused blocks (`Engine.state_room` counts those of whole free segments) may be split
            # into pieces smaller than these tensors: give them back to the driver and try once more
            torch.cuda.empty_cache()
            grown = self._grown(size)
        for name, value in grown.items():
            if name in self.layered:
                getattr(self, name)[:] = value
            else:
                setattr(self, name, value)
        return True

    def _grown(self, size: list[int]) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """The tensors of `size`, each holding its old one in its leading corner."""
        return {name: [regrown(t, shape[1:]) for t in getattr(self, name)] if name in self.layered
                else regrown(getattr(self, name), shape) for name, shape in self.shapes(*size).items()}

    def ensure(self, needs: tuple[int, ...], pool: KVPool) -> bool:
        """Room for `needs` (and for whatever else follows the pool's size); True when a tensor moved."""
        return self.grow(needs)

    def growth_bytes(self, needs: tuple[int, ...], pool: KVPool) -> int:
        """Device bytes `ensure(needs, pool)` allocates (every grown tensor; each old one is freed once replaced)."""
        size = grown_sizes(needs, self.sizes(), self.slack)
        return 0 if size is None else self._bytes(size)

    def peak_bytes(self, needs: Callable[[int], tuple[int, ...]], rows: int) -> int:
        """Device bytes beside what the tensors hold now that admitting requests into rows 1..`rows` (row r needing
        `needs(r)`) takes at its peak: each growth makes the new tensors while the old ones are still alive, so the
        peak is a growth's new tensors beside those an earlier growth of this count made."""
        have, peak, earlier = self.sizes(), 0, 0
        for row in range(1, rows + 1):
            size = grown_sizes(needs(row), have, self.slack)
            if size is not None:
                new = self._bytes(size)
                peak, earlier, have = max(peak, new + earlier), new, tuple(size)
        return peak

    def _bytes(self, size: list[int]) -> int:
        return sum(math.prod(shape) * self._tensors(name)[0].element_size()
                   for name, shape in self.shapes(*size).items() if math.prod(shape))

    def held_bytes(self) -> int:
        """Device bytes of the tensors now."""
        return sum(t.nbytes for name in self.shapes(*self.sizes()) for t in self._tensors(name))

    def _tensors(self, name: str) -> list[torch.Tensor]:
        value = getattr(self, name)
        return value if name in self.layered else [value]


class RowHolder(BatchedHooks):
    """Admission hooks of a method whose batched per-sequence state is a `DeviceRows` in `self._rows` (and, when it
    offloads, the working sets in `self._sets`, rows numbered alike): a request that takes a row (`takes_row`) gets
    one at admission, with room for what it needs there (`row_needs`, `set_needs`), and gives it back when released;
    a move of the tensors makes captured graphs be captured again (`graph_epoch`); a reset drops the tensors."""

    _rows: DeviceRows | None
    _sets: DeviceRows | None = None

    def takes_row(self, seq: Sequence) -> bool:
        raise NotImplementedError

    def row_needs(self, seq: Sequence, row: int) -> tuple[int, ...]:
        raise NotImplementedError

    def set_needs(self, seq: Sequence, row: int) -> tuple[int, ...] | None:
        """Sizes the working sets need for `seq` in `row` (`WorkingSets`: rows, working-set slots, offloaded tokens;
        the last is also the capacity of the `HostKVStore` made at admission); None: it offloads nothing."""
        return None

    def admit(self, seq: Sequence) -> None:
        if not self.takes_row(seq):
            return
        seq.method_state.row = row = self._rows.owners.take()
        self.ensure_rows(self.row_needs(seq, row), seq.kv.pool)
        self._rows.clear(row)
        needs = self.set_needs(seq, row)
        if needs is not None:
            pool = seq.kv.pool
            self.ensure_sets(needs, pool)
            store = HostKVStore(pool.num_layers, pool.num_kv_heads, pool.head_dim, needs[2], pool.dtype, pool.device)
            seq.method_state.store = store
            self._sets.attach(row, store)

    def admission_bytes(self, seq: Sequence) -> int:
        """What admitting `seq` into row `next_row` allocates: the grown rows and working sets."""
        if not self.takes_row(seq):
            return 0
        row, pool = self._rows.owners.next_row(), seq.kv.pool
        needs = self.set_needs(seq, row)
        sets = 0 if needs is None else self._sets.growth_bytes(needs, pool)
        return self._rows.growth_bytes(self.row_needs(seq, row), pool) + sets

    def batch_state_bytes(self, seq: Sequence, batch: int) -> int:
        """The rows (and working sets) of `batch` requests like `seq`: the peak of growing them to rows 1..batch, a
        growth's new tensors beside the old ones (a request admitted now takes row `next_row`: `admission_bytes`)."""
        if not self.takes_row(seq):
            return 0
        sets = 0 if self.set_needs(seq, batch) is None else self._sets.peak_bytes(
            lambda row: self.set_needs(seq, row), batch)
        return self._rows.peak_bytes(lambda row: self.row_needs(seq, row), batch) + sets

    def admission_host_bytes(self, seq: Sequence) -> int:
        needs = self.set_needs(seq, self._rows.owners.next_row()) if self.takes_row(seq) else None
        if needs is None:
            return 0
        pool = seq.kv.pool
        return needs[2] * pool.num_layers * token_bytes(pool.num_kv_heads, pool.head_dim, pool.dtype)

    def release(self, seq: Sequence) -> None:
        row = getattr(seq.method_state, "row", 0)
        if row and self._rows is not None:
            self._rows.owners.free(row)
            if self._sets is not None:
                self._sets.drop(row)

    def reset(self) -> None:
        self._rows = None
        self._sets = None

    def ensure_rows(self, needs: tuple[int, ...], pool: KVPool) -> None:
        """Room in the device rows for `needs`."""
        if self._rows.ensure(needs, pool):
            self.graph_epoch += 1

    def ensure_sets(self, needs: tuple[int, ...], pool: KVPool) -> None:
        """Room in the working sets for `needs`."""
        if self._sets.ensure(needs, pool):
            self.graph_epoch += 1


def grown_sizes(needs: tuple[int, ...], have: tuple[int, ...], slack: tuple[int, ...]) -> list[int] | None:
    """Sizes that hold `needs` (a grown size gets an eighth more, at least its `slack`), or None when `have` holds
    them already."""
    if all(n <= h for n, h in zip(needs, have)):
        return None
    return [grown_capacity(n, s) if n > h else h for n, h, s in zip(needs, have, slack)]


def regrown(old: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A zero tensor of `shape` (dtype and device of `old`) holding `old` in its leading corner: a normal tensor,
    written outside generation too."""
    with torch.inference_mode(False):
        new = torch.zeros(shape, dtype=old.dtype, device=old.device)
        new[tuple(slice(0, n) for n in old.shape)] = old
    return new
