"""The messages between `semkv serve`'s two processes, pickled over ZeroMQ: the web process sends `Submit`, `Cancel`
and `Drain` to the engine process; the engine process answers `Ready` (or `StartFailed`) once, then one `Outputs` per
loop iteration that did something, and `EngineDied` if its loop raises."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from semkv.engine.memory import MemoryUsage
from semkv.engine.scheduler import Counters
from semkv.engine.sequence import GenerationStats, SamplingParams, TokenLogprob


@dataclass(frozen=True)
class MethodChoice:
    """A request's KV method as the client named it (checked with `get_method` by the web process)."""

    name: str
    budget: int | float | None
    params: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, name: str, budget: int | float | None, params: dict[str, Any]) -> MethodChoice:
        """The choice of a method, a budget and its parameters (in name order: the same ones give the same `key`)."""
        return cls(name, budget, tuple(sorted(params.items())))

    @property
    def key(self) -> str:
        """Requests with the same key share one bound method, so they decode in one batch."""
        return json.dumps([self.name, self.budget, self.params], default=str)


@dataclass
class EngineSettings:
    """How the engine process makes its `LLM` and its `Session` (the flags of `semkv serve`)."""

    model: str | None
    device: str = "auto"
    dtype: str = "auto"
    page_size: int = 16
    prefill_chunk: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_prefix_caching: bool = True
    # the method of requests that name none: the pool leaves room for its state kept by page (`LLM(reserve_for=)`),
    # and with warm_up, on CUDA, it runs on a text of its own first (`Session.warm_up`)
    method: MethodChoice | None = None
    warm_up: bool = False
    num_pages: int | None = None  # a fixed KV pool (`LLM(num_pages=)`)
    dynamic_chunking: bool = False  # a long prompt's later chunks cut to the budget's cost (`Scheduler`)


# -- web -> engine ------------------------------------------------------------------------------------------------
@dataclass
class Submit:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    choice: MethodChoice


@dataclass
class Cancel:
    """The client went away: end the request and free what it holds."""

    request_id: int


@dataclass
class Drain:
    """The server shuts down: finish the requests in flight, then end."""


# -- engine -> web ------------------------------------------------------------------------------------------------
@dataclass
class Ready:
    """The engine process loaded the model; the web process loads the tokenizer from `folder`."""

    folder: str  # the HF folder of the model (a .gguf file's converted copy)
    source: str  # the model as the user gave it
    device: str
    tensor_parallel_size: int
    memory: MemoryUsage
    max_num_batched_tokens: int | None  # as the scheduler took them
    max_num_seqs: int | None
    prefix_caching: bool
    dynamic_chunking: bool


@dataclass
class StartFailed:
    message: str
    user_error: bool  # bad input (a model path that does not exist...), not a crash


@dataclass
class Ended:
    """A request that ended: why ("eos", "stop", "length", "cancelled" or "error"), with its statistics or its error."""

    request_id: int
    finish_reason: str
    stats: GenerationStats | None = None
    error: str | None = None
    status: int = 0  # the HTTP status of an error: 400 (the request cannot run), 500 (the engine failed it), 503


@dataclass
class Outputs:
    """One iteration of the engine loop: the requests' new tokens and ends, and the scheduler's numbers for /metrics.
    The tokens go in columns (plain lists pickle about 20x faster than an object per request)."""

    request_ids: list[int]  # the requests with new tokens
    token_ids: list[list[int]]  # their new tokens, in the same order
    logprobs: dict[int, list[TokenLogprob]]  # request id -> its new tokens' log-probabilities, if it asked for them
    ended: list[Ended]  # requests that ended in this iteration (after their last tokens above)
    counters: Counters
    running: int
    waiting: int
    batch_sizes: list[int]  # requests in each method's batch at this iteration's step (empty: no step ran)
    memory: MemoryUsage | None  # measured at most every MEASURE_EVERY_S, and when the engine goes idle
    sent: float  # time.monotonic() when sent (one clock for every process of the host): the receiver's lag


@dataclass
class EngineDied:
    reason: str
