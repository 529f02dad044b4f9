"""What the engine holds (`Engine.memory`): KV pool pages, the state methods keep beside the pool, host memory.

Method state is measured, not declared: the bytes of every tensor reachable from a bound method and from the state of
its live requests (`held_bytes`), so a method cannot forget to report a buffer.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, Iterable

import torch

from semkv.engine.hooks import BatchedHooks
from semkv.engine.kv_cache import KVPool, SeqKV
from semkv.engine.sequence import Sequence
from semkv.models.config import ModelConfig


@dataclass(frozen=True)
class MemoryUsage:
    """A snapshot of `Engine.memory()`. Bytes by method name count what the methods of the live requests hold (their
    buffers beside the pool) and those requests' states."""

    pool_pages: int  # pages of the KV pool (it grows on demand on the CPU, up to the most ever held at once)
    pages_in_use: int  # held by live requests
    page_bytes: int  # K and V of one page, every KV head
    requests: int  # admitted and not yet released
    state_bytes: dict[str, int]  # device memory beside the KV pool, by method
    host_bytes: dict[str, int]  # offloaded K/V in host memory, by method
    cache_bytes: int  # the engine's buffers of fixed size: host staging ring, RoPE table of ranks
    cached_pages: int = 0  # pages of prefix-cache blocks no request holds (free for requests: evicted when needed)

    @property
    def pool_bytes(self) -> int:
        return self.pool_pages * self.page_bytes

    @property
    def held(self) -> tuple[int, int, int, int]:
        """(pages in use, requests, state bytes, host bytes): all zero when nothing is running and nothing leaked."""
        return self.pages_in_use, self.requests, sum(self.state_bytes.values()), sum(self.host_bytes.values())

    def as_dict(self) -> dict[str, Any]:
        return dict(asdict(self), pool_bytes=self.pool_bytes)


class HostMemory:
    """Marks a class whose tensors are host memory (offloaded K/V), counted apart from device state also when the
    device is the CPU."""


# not method state: requests (their state is a root of its own), their pages and the pool, the model and its shape
_NOT_STATE = (Sequence, SeqKV, KVPool, ModelConfig, torch.nn.Module)


def held_bytes(roots: Iterable[Any], device: torch.device) -> tuple[int, int]:
    """(device bytes, host bytes) of the tensors reachable from `roots` through containers, semkv objects, methods
    (a user's subclass too) and dataclasses, each storage counted once; objects of other libraries, functions and
    _NOT_STATE are not entered. Host bytes are those off `device`'s type or held by a `HostMemory` object."""
    seen_objects: set[int] = set()
    seen_storages: set[int] = set()
    totals = [0, 0]
    stack = [(root, False) for root in roots]
    while stack:
        obj, host = stack.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen_storages:
                seen_storages.add(storage.data_ptr())
                totals[host or obj.device.type != device.type] += storage.nbytes()
            continue
        if isinstance(obj, dict):
            stack.extend((value, host) for value in obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((value, host) for value in obj)
        elif _entered(obj):
            host = host or isinstance(obj, HostMemory)
            state = getattr(obj, "__dict__", None) or {}
            slots = [getattr(obj, name) for name in getattr(type(obj), "__slots__", ()) if hasattr(obj, name)]
            stack.extend((value, host) for value in [*state.values(), *slots])
    return totals[0], totals[1]


def _entered(obj: Any) -> bool:
    ours = type(obj).__module__.startswith("semkv.") or isinstance(obj, BatchedHooks)
    return (ours or is_dataclass(obj) and not isinstance(obj, type)) and not isinstance(obj, _NOT_STATE)
