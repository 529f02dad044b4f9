"""The web process's end of the engine (`semkv serve`): it starts the engine process (`engine_core.run_engine`, spawned)
and waits for it to be ready, sends it requests and cancellations, and routes each `Outputs` message to the waiting
requests' asyncio queues (`receive`, a task of the web app). It notices when the engine process dies: every open
request then gets an error, new ones are refused (`EngineDead`), and `dead` says why.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.asyncio

from semkv.engine.sequence import SamplingParams, TokenLogprob
from semkv.errors import SemkvError
from semkv.serve.engine_core import run_engine
from semkv.serve.messages import (Cancel, Drain, Ended, EngineDied, EngineSettings, MethodChoice, Outputs, Ready,
                                  StartFailed, Submit)
from semkv.serve.metrics import Metrics

POLL_MS = 200  # with no message for this long, the client looks whether the engine process still lives
DRAIN_S = 120  # how long a shutdown waits for the engine process to end after the last request


class EngineDead(Exception):
    """The engine process has ended; the server answers 503 until it is restarted."""


@dataclass
class RequestOutput:
    """A request's new tokens, with their log-probabilities when it asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]


@dataclass
class Pending:
    """A request the engine is serving: its handler reads `RequestOutput`s from `queue` until an `Ended` comes."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    method: str  # the KV method's name, for /metrics
    submitted: float = field(default_factory=time.perf_counter)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    started: bool = False  # its first token came


class EngineClient:
    def __init__(self, settings: EngineSettings, metrics: Metrics):
        """Start the engine process and wait until it has loaded the model (`ready`); SemkvError if it cannot."""
        self.metrics = metrics
        self.requests: dict[int, Pending] = {}
        self.next_id = 0
        self.dead: str | None = None  # why the engine stopped serving
        self.draining = False
        self.folder = tempfile.mkdtemp(prefix="semkv-serve-")
        self.context = zmq.Context()
        self.inputs, self.outputs = self.context.socket(zmq.PUSH), self.context.socket(zmq.PULL)
        for sock in (self.inputs, self.outputs):
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        addresses = [f"ipc://{Path(self.folder) / name}" for name in ("inputs", "outputs")]
        self.inputs.bind(addresses[0])
        self.outputs.bind(addresses[1])
        # not a daemon: it starts the ranks of tensor parallelism; it ends with this process (`end_with_parent`)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine, args=(settings, *addresses), name="semkv-engine")
        try:
            self.process.start()
            self.ready = self._wait_ready()
            metrics.memory(self.ready.memory)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> Ready:
        while True:
            if self.outputs.poll(POLL_MS):
                message = pickle.loads(self.outputs.recv())
                if isinstance(message, Ready):
                    return message
                if isinstance(message, StartFailed):
                    self.process.join(30)
                    raise SemkvError(message.message if message.user_error else
                                     f"the engine process failed to start: {message.message}")
            elif not self.process.is_alive():
                raise SemkvError(f"the engine process ended (exit code {self.process.exitcode}) before it was ready; "
                                 "its error is above")

    # -- requests -------------------------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, choice: MethodChoice) -> Pending:
        if self.dead is not None:
            raise EngineDead(self.dead)
        pending = Pending(self.next_id, prompt_ids, params, choice.name)
        self.next_id += 1
        self._send(Submit(pending.request_id, prompt_ids, params, choice))
        self.requests[pending.request_id] = pending
        return pending

    def cancel(self, pending: Pending) -> None:
        """The client went away: the engine ends the request (its last output still comes, "cancelled")."""
        if pending.request_id in self.requests and self.dead is None:
            try:
                self._send(Cancel(pending.request_id))
            except EngineDead:
                pass

    def _send(self, message) -> None:
        try:
            self.inputs.send(pickle.dumps(message, pickle.HIGHEST_PROTOCOL), zmq.NOBLOCK)
        except zmq.Again:  # no engine connected: it has ended
            raise EngineDead("the engine process takes no requests") from None

    # -- outputs --------------------------------------------------------------------------------------------------
    async def receive(self) -> None:
        """Route the engine's outputs to the requests until the engine process ends."""
        sock = zmq.asyncio.Socket.from_socket(self.outputs)
        while True:
            if await sock.poll(POLL_MS):
                self._handle(pickle.loads(await sock.recv()))
            elif not self.process.is_alive():
                if not self.draining:
                    self._die(f"the engine process ended (exit code {self.process.exitcode})")
                return
            if self.dead is not None:
                return

    def _handle(self, message: Outputs | EngineDied) -> None:
        if isinstance(message, EngineDied):
            self._die(f"the engine failed: {message.reason}")
            return
        now = time.perf_counter()
        self.metrics.iteration(message, time.monotonic() - message.sent)
        for request_id, token_ids in zip(message.request_ids, message.token_ids):
            pending = self.requests.get(request_id)
            if pending is None:
                continue
            if not pending.started:
                pending.started = True
                self.metrics.first_token(now - pending.submitted, len(pending.prompt_ids))
            self.metrics.tokens(pending.method, len(token_ids))
            pending.queue.put_nowait(RequestOutput(token_ids, message.logprobs.get(request_id, [])))
        for end in message.ended:
            pending = self.requests.pop(end.request_id, None)
            if pending is None:
                continue
            outcome = end.finish_reason if end.finish_reason in ("error", "cancelled") else "finished"
            self.metrics.ended(pending.method, outcome, len(pending.prompt_ids), now - pending.submitted, end.stats)
            pending.queue.put_nowait(end)

    def _die(self, reason: str) -> None:
        """Tell every open request that the engine is gone; refuse new ones."""
        self.dead = reason
        message = f"{reason}; this server must be restarted"
        for pending in self.requests.values():
            self.metrics.ended(pending.method, "error")
            pending.queue.put_nowait(Ended(pending.request_id, "error", error=message, status=503))
        self.requests.clear()

    # -- the end --------------------------------------------------------------------------------------------------
    async def drain(self) -> None:
        """Let the engine finish what it runs, then end it."""
        self.draining = True
        if self.process.is_alive():
            try:
                self._send(Drain())
            except EngineDead:
                pass
            await asyncio.to_thread(self.process.join, DRAIN_S)

    def close(self) -> None:
        """End the engine process now if it still runs; free the sockets."""
        if self.context.closed:
            return
        if self.process.pid is not None and self.process.is_alive():
            self.process.terminate()
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self.inputs.close(linger=0)
        self.outputs.close(linger=0)
        self.context.term()
        shutil.rmtree(self.folder, ignore_errors=True)
