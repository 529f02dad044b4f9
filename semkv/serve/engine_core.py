"""The engine process of `semkv serve` (as vLLM v1's engine core): it owns the `LLM` and its `Session` and runs the
scheduler loop, so no Python web work (HTTP, JSON, tokenizing, detokenizing) ever waits in front of a step.

Each iteration takes what the web process sent (without waiting while requests run; blocking when idle), runs one
`Session.advance` (the scheduler's step), and sends one `Outputs` message with every request's new tokens and ends, the
scheduler's counters and, now and then, the engine's memory; a step that gives prompts their first tokens sends those at
once, before it ends the prompts of its packed forward (`Scheduler.publish`). With tensor parallelism this process is
rank 0 and starts the other ranks (`LLM(tensor_parallel_size=N)`). If the loop raises, it sends `EngineDied` before it
ends.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import zmq

from semkv.engine.memory import MemoryUsage
from semkv.engine.sequence import Sequence
from semkv.errors import SemkvError
from semkv.launch import Ranks, end_with_parent, freeze_heap
from semkv.llm import LLM, Session
from semkv.methods import get_method
from semkv.models.loader import model_folder
from semkv.serve.messages import (Cancel, Drain, Ended, EngineDied, EngineSettings, Outputs, Ready, StartFailed,
                                  Submit)

MEASURE_EVERY_S = 0.5  # Engine.memory() walks the methods' tensors: not every step
IDLE_POLL_MS = 500  # how long an idle loop waits for a message before it looks whether the web process lives
RANK_CHECK_S = 1.0  # how often the engine process looks whether its tensor-parallel ranks live


@dataclass
class Tracked:
    seq: Sequence
    sent: int = 0  # tokens sent to the web process


def error_status(error: BaseException) -> tuple[int, str]:
    """The HTTP status and message a client gets for a request the engine failed."""
    if isinstance(error, SemkvError):
        return 400, str(error)
    if isinstance(error, MemoryError):
        return 400, f"the request does not fit in this server's memory: {error}"
    return 500, f"internal error: {type(error).__name__}: {error}"


class EngineCore:
    def __init__(self, llm: LLM, session: Session, inputs: zmq.Socket, outputs: zmq.Socket):
        self.llm, self.session, self.scheduler = llm, session, session.scheduler
        self.inputs, self.outputs = inputs, outputs
        self.requests: dict[int, Tracked] = {}
        self.ended: list[Ended] = []  # requests that failed at submission, sent with the next outputs
        self.draining = False
        self.measured = 0.0  # when the engine's memory was last measured
        self.reported_steps = 0  # the scheduler's step count in the last message (each step's tokens are reported)
        self.started = False  # a request got its first token since the last `_report` (the pool changed)
        self.scheduler.publish = self._publish  # a step's first tokens go out before the prompts' ends

    def run(self) -> None:
        with torch.inference_mode():
            while True:
                if not self._take(block=not self.scheduler.busy):
                    return  # the web process is gone
                if self.draining and not self.scheduler.busy:
                    return
                sizes = []
                if self.scheduler.busy:
                    sizes = [len(b.running) for b in self.scheduler.batches.values() if b.running]
                    self.session.advance()
                self._report(sizes)

    def _take(self, block: bool) -> bool:
        """Handle what the web process sent; when idle, wait for it. False when the web process has ended."""
        timeout = IDLE_POLL_MS if block else 0
        while self.inputs.poll(timeout):
            timeout = 0
            message = pickle.loads(self.inputs.recv())
            if isinstance(message, Submit):
                self._submit(message)
            elif isinstance(message, Cancel):
                if message.request_id in self.requests:
                    self.session.cancel(message.request_id)
            elif isinstance(message, Drain):
                self.draining = True
        parent = multiprocessing.parent_process()
        return not block or parent is None or parent.is_alive()

    def _submit(self, message: Submit) -> None:
        choice = message.choice
        try:
            method = get_method(choice.name, choice.budget, **dict(choice.params))
            seq = self.session.submit(message.request_id, message.prompt_ids, message.params, method, choice.key)
        except Exception as error:  # noqa: BLE001 - the client gets it; the server goes on
            status, text = error_status(error)
            self.ended.append(Ended(message.request_id, "error", error=text, status=status))
            return
        self.requests[message.request_id] = Tracked(seq)

    def _new_tokens(self) -> tuple[list[int], list[list[int]], dict]:
        """The requests with tokens not sent yet, those tokens and their log-probabilities (now counted as sent)."""
        ids, tokens, logprobs = [], [], {}
        for request_id, tracked in self.requests.items():
            seq, sent = tracked.seq, tracked.sent
            n = len(seq.output_ids)
            if n > sent:
                self.started |= sent == 0
                ids.append(request_id)
                tokens.append(seq.output_ids[sent:n])
                if seq.params.logprobs is not None:
                    logprobs[request_id] = seq.logprobs[sent:n]
                tracked.sent = n
        return ids, tokens, logprobs

    def _publish(self) -> None:
        """Inside a step (`Scheduler.publish`): send the tokens it has given so far (ends wait for `_report`)."""
        ids, tokens, logprobs = self._new_tokens()
        if ids:
            self._send(ids, tokens, logprobs, [], [], None)

    def _report(self, batch_sizes: list[int]) -> None:
        """Send each request's new tokens and ends (one message for the iteration); forget ended requests."""
        ended, self.ended = self.ended, []
        failed = dict(self.scheduler.failed)
        self.scheduler.failed.clear()
        ids, tokens, logprobs = self._new_tokens()
        changed = bool(ended) or self.started  # requests came or went: the pool changed
        self.started = False
        for request_id, tracked in list(self.requests.items()):
            seq = tracked.seq
            if seq.finished:
                changed = True
                del self.requests[request_id]
                if seq in failed:
                    status, error = error_status(failed[seq])
                    ended.append(Ended(request_id, "error", error=error, status=status))
                else:
                    ended.append(Ended(request_id, seq.finish_reason, seq.stats))
        now = time.monotonic()
        memory = None
        # under load at most every MEASURE_EVERY_S (a method with many small tensors takes milliseconds); at once
        # when requests came or went and the engine is idle, so that what it holds afterwards is known
        if now - self.measured >= MEASURE_EVERY_S or changed and not self.scheduler.busy:
            memory, self.measured = self.llm.engine.memory(), now
        stepped = self.scheduler.counters.steps != self.reported_steps  # a step with no tokens to send counts too
        if ids or ended or batch_sizes or memory is not None or stepped:
            self.reported_steps = self.scheduler.counters.steps
            self._send(ids, tokens, logprobs, ended, batch_sizes, memory)

    def _send(self, ids: list[int], tokens: list[list[int]], logprobs: dict, ended: list[Ended],
              batch_sizes: list[int], memory: MemoryUsage | None) -> None:
        """One `Outputs` message, with the scheduler's counters and queue lengths as they are now."""
        scheduler = self.scheduler
        message = Outputs(ids, tokens, logprobs, ended, scheduler.counters, len(scheduler.running),
                          len(scheduler.waiting), batch_sizes, memory, time.monotonic())
        self.outputs.send(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


def watch_ranks(ranks: Ranks, address: str, done: threading.Event) -> None:
    """A thread of the engine process with tensor parallelism: once a rank has failed (`Ranks.failure`: the ranks'
    watchdog has ended them all), rank 0 may wait inside a collective for ever, or idle until the next request, so
    tell the web process why and end this process."""
    while not done.wait(RANK_CHECK_S):
        if ranks.failure is not None:
            context = zmq.Context()  # a socket of its own: the loop's sockets belong to the loop's thread
            sock = context.socket(zmq.PUSH)
            sock.connect(address)
            sock.send(pickle.dumps(EngineDied(ranks.failure)))
            sock.close(linger=5000)
            context.term()  # waits until the message is out
            os._exit(1)


def run_engine(settings: EngineSettings, inputs_address: str, outputs_address: str) -> None:
    """The engine process: load the model, say `Ready` (or `StartFailed`), then run the loop until `Drain`."""
    end_with_parent()
    # Ctrl-C reaches every process of the terminal's group: the web process drains the requests and then sends Drain
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    context = zmq.Context()
    inputs, outputs = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 5000)  # what is sent before the end still reaches a living web process
    outputs.setsockopt(zmq.SNDHWM, 0)  # never wait for a slow web process: queue
    inputs.connect(inputs_address)
    outputs.connect(outputs_address)
    done = threading.Event()  # the loop has ended: rank processes may end now
    try:
        try:
            choice = settings.method
            default = None if choice is None else get_method(choice.name, choice.budget, **dict(choice.params))
            llm = LLM(settings.model, device=settings.device, dtype=settings.dtype, page_size=settings.page_size,
                      prefill_chunk=settings.prefill_chunk, gpu_memory_utilization=settings.gpu_memory_utilization,
                      tensor_parallel_size=settings.tensor_parallel_size, num_pages=settings.num_pages,
                      reserve_for=default)
            if llm.engine.page_state_bytes:
                print(f"semkv serve: {choice.name} keeps {llm.engine.page_state_bytes} bytes of state a KV page "
                      "beside the pool; a pool sized from the card's memory leaves it room", file=sys.stderr,
                      flush=True)
            session = llm.new_session(max_num_batched_tokens=settings.max_num_batched_tokens,
                                      max_num_seqs=settings.max_num_seqs,
                                      enable_prefix_caching=settings.enable_prefix_caching,
                                      dynamic_chunking=settings.dynamic_chunking)
            if settings.warm_up and default is not None and llm.engine.device.type == "cuda":
                started = time.perf_counter()
                print(f"semkv serve: warming up {choice.name} (Triton compiles its kernels now; --no-warm-up skips "
                      "this)", file=sys.stderr, flush=True)
                session.warm_up(default, choice.key)
                print(f"semkv serve: warmed up in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
            folder = str(model_folder(settings.model)[1])
            freeze_heap()  # no collector pause over the start's objects in front of a step
        except Exception as error:  # noqa: BLE001 - the web process says why and exits with code 2
            if not isinstance(error, SemkvError):
                traceback.print_exc()
            outputs.send(pickle.dumps(StartFailed(str(error) if isinstance(error, SemkvError) else
                                                  f"{type(error).__name__}: {error}", isinstance(error, SemkvError))))
            return
        try:
            scheduler = session.scheduler
            outputs.send(pickle.dumps(Ready(folder, llm.source, str(llm.engine.device), llm.tensor_parallel_size,
                                            llm.engine.memory(), scheduler.max_num_batched_tokens,
                                            scheduler.max_num_seqs, scheduler.prefix_caching,
                                            scheduler.dynamic_chunking)))
            if llm.ranks is not None:
                threading.Thread(target=watch_ranks, args=(llm.ranks, outputs_address, done), daemon=True).start()
            EngineCore(llm, session, inputs, outputs).run()
        except BaseException as error:  # a crash, a failed collective: every open request must hear of it
            traceback.print_exc()
            outputs.send(pickle.dumps(EngineDied(f"{type(error).__name__}: {error}")))
            raise
        finally:
            done.set()
            llm.close()
    finally:
        inputs.close(linger=0)
        outputs.close()
        context.term()
