"""Fault injection for the tests: the N-th call of a function raises `Injected`.

An injection point is an attribute of a module or a class (a function or a method) that the test replaces, for the
length of a `with Injector(...)`, by a wrapper that counts its calls and raises at the chosen one. The points are the
allocations of method state, the host-offload copies, the hooks a method implements and the sampling step; nothing in
semkv knows about them.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import semkv.engine.engine
import semkv.engine.scheduler
import semkv.kernels
from semkv.engine.hooks import KVMethod
from semkv.engine.kv_cache import KVPool, SeqKV
from semkv.engine.offload import HostKVStore
from semkv.methods.state import rows
from semkv.methods.state.page_storage import PageStorage
from semkv.methods.state.page_summaries import PageSummaries


class Injected(RuntimeError):
    """The failure a test injects (an allocation that runs out of memory, a copy or a hook that raises...)."""


@dataclass(frozen=True)
class Point:
    kind: str  # "allocation", "offload", "hook" or "sampling"
    name: str
    owner: Any  # the module or class whose attribute is replaced
    attribute: str


# the points every method may reach (a method's hooks are added by `hook_points`)
POINTS = [
    Point("allocation", "KV pool pages (KVPool.allocate)", KVPool, "allocate"),
    Point("allocation", "page table growth (SeqKV.widen)", SeqKV, "widen"),
    Point("allocation", "DeviceRows growth, one tensor (rows.regrown)", rows, "regrown"),
    Point("allocation", "PageStorage.ensure", PageStorage, "ensure"),
    Point("allocation", "PageSummaries.ensure", PageSummaries, "ensure"),
    Point("allocation", "state kept by page, grown with the pool (PageStorage.cover)", PageStorage, "cover"),
    Point("allocation", "page summaries, grown with the pool (PageSummaries.cover)", PageSummaries, "cover"),
    Point("allocation", "HostKVStore (pinned host buffer)", HostKVStore, "__init__"),
    Point("offload", "HostKVStore.put (device to host)", HostKVStore, "put"),
    Point("offload", "working-set load (kernels.working_set)", semkv.kernels, "working_set"),
    Point("sampling", "first tokens chosen (scheduler.choose_each)", semkv.engine.scheduler, "choose_each"),
    Point("sampling", "first tokens read (scheduler.chosen)", semkv.engine.scheduler, "chosen"),
    Point("sampling", "decode token (engine.sample)", semkv.engine.engine, "sample"),
    Point("sampling", "log-probabilities (engine.token_logprob)", semkv.engine.engine, "token_logprob"),
]

# hooks the engine calls on a bound method while requests run (not `release` / `reset`: they are the cleanup)
HOOKS = ("new_state", "admission_bytes", "admission_host_bytes", "device_tokens", "admit", "prefill_context",
         "observe_prefill", "evict_prefill", "evict_prefill_layers", "finish_prefill", "begin_step", "step_plan",
         "plan_selection", "select", "observe_logits", "end_step")


def hook_points(method: KVMethod) -> list[Point]:
    """The hooks a method's class implements (those it inherits from the interface do nothing to fail)."""
    cls = type(method)
    return [Point("hook", f"hook {hook}", cls, hook) for hook in HOOKS
            if getattr(cls, hook) is not getattr(KVMethod, hook)]


class Injector:
    """While inside, every point counts its calls (`calls`); with `fail=(point, n)` the n-th call of that point
    raises Injected instead of running."""

    def __init__(self, points: list[Point], fail: tuple[Point, int] | None = None):
        self.points, self.fail = points, fail
        self.calls: Counter[Point] = Counter()
        self._saved: list[tuple[Point, Any]] = []

    def __enter__(self) -> "Injector":
        for point in self.points:
            self._saved.append((point, point.owner.__dict__.get(point.attribute, _MISSING)))
            setattr(point.owner, point.attribute, self._counted(point, getattr(point.owner, point.attribute)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for point, original in reversed(self._saved):
            if original is _MISSING:  # inherited: the class's own attribute goes again
                delattr(point.owner, point.attribute)
            else:
                setattr(point.owner, point.attribute, original)
        self._saved = []

    def _counted(self, point: Point, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls[point] += 1
            if self.fail == (point, self.calls[point]):
                raise Injected(f"injected failure: {point.name}, call {self.calls[point]}")
            return function(*args, **kwargs)

        return wrapper


_MISSING = object()
