"""The engine thread of `semkv serve`: one `LLM`, one `Session` (its `Scheduler`) for the life of the server,
requests in from the web handlers through a queue, tokens out to each request's asyncio queue.

Requests that name the same method with the same budget and parameters share one bound method object, so they decode
in one batch; different methods decode in their own batches, which take turns step by step (`Scheduler`). Every
request is released when it ends: finished, stopped, failed, or cancelled because its client went away. With tensor
parallelism the session sends each of its calls to the other ranks, which replay it.
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from semkv.engine.sequence import SamplingParams, Sequence
from semkv.llm import LLM
from semkv.methods import KVMethod
from semkv.serve.metrics import Metrics

MEASURE_EVERY_S = 0.5


@dataclass(frozen=True)
class MethodChoice:
    """A request's KV method as the client named it (checked with `get_method` by the web handler)."""

    name: str
    budget: int | float | None
    params: tuple[tuple[str, Any], ...]

    @property
    def key(self) -> str:
        return json.dumps([self.name, self.budget, self.params], default=str)


@dataclass
class Job:
    """One request between the web handler and the engine thread. The handler reads `events`: ("tokens", ids) with
    the request's new token ids, ("done", output) at its end, ("error", exception) if it failed."""

    ids: list[int]
    params: SamplingParams
    choice: MethodChoice
    method: KVMethod  # unbound, from get_method: the engine thread binds one copy per choice
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    on_end: Callable[[], None] | None = None  # called on the handler's loop when the request ends
    seq: Sequence | None = None
    sent: int = 0  # tokens announced to the handler

    def put(self, event: tuple[str, Any]) -> None:
        """Send an event to the handler's loop (from the engine thread); "done" and "error" end the request."""
        def deliver():
            self.events.put_nowait(event)
            if event[0] != "tokens" and self.on_end is not None:
                self.on_end()

        try:
            self.loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the event loop closed: nobody is waiting
            pass


class Worker:
    def __init__(self, llm: LLM, metrics: Metrics, idle_poll_s: float = 0.5):
        self.llm, self.metrics = llm, metrics
        self.session = llm.new_session()
        self.scheduler = self.session.scheduler  # read for /metrics
        self.inbox: queue.SimpleQueue[tuple[str, Job | None]] = queue.SimpleQueue()
        self.jobs: dict[Sequence, Job] = {}
        self.idle_poll_s = idle_poll_s
        self.next_id = 0
        self.stopping = False
        self.measured = 0.0  # when the engine's memory was last measured for /metrics
        self.thread = threading.Thread(target=self._loop, name="semkv-engine", daemon=True)
        self.metrics.update_engine(llm.engine.memory(), 0, 0)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        self.inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        self.inbox.put(("cancel", job))

    def stop(self) -> None:
        """Finish the requests in flight, then end the thread."""
        self.inbox.put(("stop", None))
        self.thread.join()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    # -- the engine thread ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                self._take(block=not self.scheduler.busy)
                if self.stopping and not self.scheduler.busy:
                    break
                if self.scheduler.busy:
                    for batch in self.scheduler.batches.values():
                        if batch.running:
                            self.metrics.batch.observe(len(batch.running))
                    self.session.advance()
                    self._report()

    def _take(self, block: bool) -> None:
        """Handle what the web handlers sent; wait for it when there is nothing to run."""
        while True:
            try:
                kind, job = self.inbox.get(timeout=self.idle_poll_s) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "stop":
                self.stopping = True
            elif kind == "submit":
                self._start(job)
            elif job.seq is not None and job.seq in self.jobs:  # cancel
                self.session.cancel(job.seq.seq_id)
                self._report()

    def _start(self, job: Job) -> None:
        try:
            seq = self.session.submit(self.next_id, job.ids, job.params, job.method, job.choice.key)
        except Exception as error:  # noqa: BLE001 - the client gets it; the server goes on
            self.metrics.ended(job.choice.name, "error")
            job.put(("error", error))
            return
        finally:
            self.next_id += 1
        job.seq = seq
        self.jobs[seq] = job

    def _report(self) -> None:
        """Send each request's new tokens and ends to its handler; forget ended requests."""
        failed = dict(self.scheduler.failed)
        self.scheduler.failed.clear()
        now, changed = time.perf_counter(), False
        for seq, job in list(self.jobs.items()):
            n = len(seq.output_ids)
            if n > job.sent:
                if job.sent == 0:  # admitted: the pool changed
                    self.metrics.first_token(now - job.submitted)
                    changed = True
                self.metrics.tokens(job.choice.name, n - job.sent)
                job.put(("tokens", seq.output_ids[job.sent : n]))
                job.sent = n
            if not seq.finished:
                continue
            changed = True
            del self.jobs[seq]
            if seq in failed:
                self.metrics.ended(job.choice.name, "error")
                job.put(("error", failed[seq]))
            else:
                outcome = "cancelled" if seq.finish_reason == "cancelled" else "finished"
                self.metrics.ended(job.choice.name, outcome, len(seq.prompt_ids), now - job.submitted)
                job.put(("done", self.llm.output(seq)))
        if changed or now - self.measured >= MEASURE_EVERY_S:  # memory() walks the methods' tensors: not every step
            self.measured = now
            self.metrics.update_engine(self.llm.engine.memory(), len(self.scheduler.running),
                                       len(self.scheduler.waiting))

