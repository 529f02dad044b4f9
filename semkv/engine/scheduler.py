"""Continuous batching of requests that arrive over time, each with its own method object.

Requests of one method object decode in one batch; the batches of different methods take turns, one decode step each
per `advance`. Admission is first come, first served: the oldest waiting request is prefilled as soon as the pool can
hold it to its end beside every running request (`Engine.blocked`), and the ones behind it wait. `Engine.run` drives
a scheduler over a fixed list of requests; `semkv serve` keeps one for the life of the server and submits requests as
they arrive (with `contain=True`, so that a request that fails ends alone).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from semkv.engine.cuda_graph import GraphRunner
from semkv.engine.hooks import KVMethod
from semkv.engine.sampler import sample
from semkv.engine.sequence import Sequence

StopTest = Callable[[Sequence], str]  # why a request stops after its last token ("eos", "stop", "length"), or ""


@dataclass
class Counters:
    """What a scheduler has done, for a server's metrics: counts since it was made, and the last step's tokens."""

    admitted: int = 0  # requests admitted
    prompt_tokens: int = 0  # prompt tokens of the admitted requests
    cached_tokens: int = 0  # of those, read from the prefix cache instead of computed
    preemptions: int = 0  # running requests whose pages were freed to make room (recomputed later)
    steps: int = 0  # engine steps (`advance` calls that ran something)
    step_tokens: int = 0  # tokens the last step computed: one per decoding request plus its prefill chunks


@dataclass
class Batch:
    """The running requests of one method object and the CUDA graphs of their decode steps."""

    method: KVMethod
    running: list[Sequence] = field(default_factory=list)
    graphs: GraphRunner | None = None


class Scheduler:
    def __init__(self, engine, contain: bool = False, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None, prefix_caching: bool = False):
        """contain: a request that cannot be admitted even alone, or whose prefill or decode step raises, ends with
        its error in `failed` (with the other requests of its batch for a failed step) and the others go on; without
        it the error propagates (the caller then ends the run: `Engine.end`). max_num_batched_tokens: tokens one
        step computes at most (decode rows and prefill chunks); max_num_seqs: requests running at once;
        prefix_caching: reuse the prompt pages of earlier requests with the same prefix."""
        self.engine, self.contain = engine, contain
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.prefix_caching = prefix_caching
        self.counters = Counters()
        self.waiting: deque[Sequence] = deque()
        self.batches: dict[int, Batch] = {}  # id(method) -> its batch
        self.failed: list[tuple[Sequence, BaseException]] = []  # contained errors; the caller takes them
        self._method: dict[Sequence, KVMethod] = {}
        self._stop: dict[Sequence, StopTest] = {}

    def submit(self, seq: Sequence, method: KVMethod, is_stop: StopTest) -> None:
        """Queue a request (its `method_state` made already) behind the waiting ones."""
        self.waiting.append(seq)
        self._method[seq], self._stop[seq] = method, is_stop

    @property
    def running(self) -> list[Sequence]:
        return [seq for batch in self.batches.values() for seq in batch.running]

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.batches)

    def cancel(self, seq: Sequence) -> None:
        """End a waiting or running request now: it finishes as "cancelled" and everything it holds is freed."""
        if seq not in self._method:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.finished, seq.finish_reason = True, seq.finish_reason or "cancelled"
        self._end(seq)

    def advance(self, progress: bool = False) -> None:
        """Admit the waiting requests that fit (each is prefilled and gets its first token), then one decode step of
        each batch; finished requests are released."""
        while self.waiting:
            seq = self.waiting[0]
            method = self._method[seq]
            try:
                blocked = self.engine.blocked(seq, self.running, method)
            except Exception as error:  # noqa: BLE001 - a method's admission hook failed: contained or re-raised
                self._fail([seq], error)
                continue
            if blocked is not None:
                if self.running:
                    break  # it waits for pages or state memory that running requests give back
                self._fail([seq], MemoryError(blocked))  # it cannot fit even alone
                continue
            self.waiting.popleft()
            try:
                first = self.engine.prefill(seq, method, progress)
                token = self.engine.agree([sample(first, seq.params, seq.generator)])[0]
                self.engine.append_token(seq, token, self._stop[seq], first)
            except Exception as error:  # noqa: BLE001 - contained or re-raised by _fail
                self._fail([seq], error)
                continue
            if seq.finished:
                self._end(seq)
            else:
                self._batch(method, seq).running.append(seq)
        for batch in [b for b in self.batches.values() if b.running]:
            try:
                self.engine.step(batch.running, batch.method, batch.graphs, self._stop_any)
            except Exception as error:  # noqa: BLE001
                self._fail(list(batch.running), error)
                continue
            for seq in [s for s in batch.running if s.finished]:
                self._end(seq)

    def _stop_any(self, seq: Sequence) -> str:
        return self._stop[seq](seq)

    def _batch(self, method: KVMethod, joining: Sequence) -> Batch:
        """The batch of a method that `joining` enters, with CUDA graphs sized for its longest request, waiting ones
        included (re-made, at least twice as large, when a longer one joins)."""
        batch = self.batches.get(id(method))
        if batch is None:
            batch = self.batches[id(method)] = Batch(method)
        members = [joining, *batch.running, *(s for s in self.waiting if self._method[s] is method)]
        longest = max(len(s.prompt_ids) + s.params.max_new_tokens for s in members)
        pages = -(-longest // self.engine.pool.page_size) + 1
        if batch.graphs is None or batch.graphs.max_pages < pages:
            if batch.graphs is not None:
                pages = max(pages, 2 * batch.graphs.max_pages)
            batch.graphs = self.engine.graph_runner(batch.method, members, pages)
        return batch

    def _end(self, seq: Sequence) -> None:
        """Release a request that finished, was cancelled or failed; a method without requests left drops its batch
        and its buffers (`Engine.end`)."""
        method = self._method.pop(seq)
        del self._stop[seq]
        batch = self.batches.get(id(method))
        if batch is not None and seq in batch.running:
            batch.running.remove(seq)
        self.engine.finish(seq)
        if not any(m is method for m in self._method.values()):
            self.batches.pop(id(method), None)
            self.engine.end([], method)

    def _fail(self, seqs: list[Sequence], error: BaseException) -> None:
        if not self.contain:
            raise error
        for seq in seqs:
            if seq in self.waiting:
                self.waiting.remove(seq)
            seq.finished, seq.finish_reason = True, "error"
            self.failed.append((seq, error))
            self._end(seq)
