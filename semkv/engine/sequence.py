"""Per-request state: token ids, sampling parameters, the request's page tables and its statistics."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from semkv.engine.kv_cache import SeqKV
from semkv.engine.prefix_cache import PromptKeys
from semkv.engine.trace import Trace
from semkv.errors import INT_MAX, SemkvError


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: each new token's log-probability and the k most likely ones


def check_sampling(max_new_tokens: Any, temperature: Any, top_k: Any, top_p: Any,
                   spell: Callable[[str], str] = str, seed: Any = 0) -> None:
    """Raise SemkvError for the first bad sampling value; `spell(name)` writes a name as the caller's user does
    (`--max-new-tokens` on the command line)."""
    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    def integer(value: Any, low: int, high: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high

    if not integer(max_new_tokens, 1, INT_MAX):
        raise SemkvError(f"{spell('max_new_tokens')}={max_new_tokens!r} must be an int >= 1 and <= {INT_MAX}")
    if not number(temperature) or not 0 <= temperature < math.inf:
        raise SemkvError(f"{spell('temperature')}={temperature!r} must be >= 0 (0 = greedy) and finite")
    if not integer(top_k, 0, INT_MAX):
        raise SemkvError(f"{spell('top_k')}={top_k!r} must be an int >= 0 (0 = off) and <= {INT_MAX}")
    if not number(top_p) or not 0 < top_p <= 1:
        raise SemkvError(f"{spell('top_p')}={top_p!r} must be in (0, 1]")
    if not integer(seed, -(2**63), 2**64 - 1):
        raise SemkvError(f"{spell('seed')}={seed!r} must be an int in [-2**63, 2**64 - 1] (a torch generator's seed)")


@dataclass(slots=True)
class TokenLogprob:
    """A generated token's log-probability under the model (before temperature and filters) and the most likely
    tokens of that step with theirs, as many as the request asked for."""

    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass
class GenerationStats:
    """What one request cost. Token counts are per KV head of one layer (averaged over layers), like the budget."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache instead of being computed
    new_tokens: int = 0
    queue_s: float = 0.0  # from submission to admission (waiting for memory or for its turn)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    kv_resident_tokens: float = 0.0  # peak resident during decoding
    kv_resident_prefill_peak: float = 0.0  # peak resident during prefill (before prefill-time eviction)
    kv_attended_tokens: float = 0.0  # mean per decode step and layer
    kv_attended_max: int = 0  # max over decode steps and layers
    selection_s: float = 0.0
    h2d_bytes: int = 0  # host -> device KV bytes (offloading methods)
    d2h_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # method-specific counters (cache hits, re-selections)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        out.update(prefill_tokens_per_s=self.prefill_tokens_per_s, decode_tokens_per_s=self.decode_tokens_per_s)
        out.update(self.extra)
        return out


class Sequence:
    def __init__(self, seq_id: int, prompt_ids: list[int], params: SamplingParams, kv: SeqKV,
                 question_start: int | None = None):
        self.seq_id = seq_id
        self.prompt_ids = prompt_ids
        self.question_start = question_start  # where the question begins inside the prompt, if known
        self.output_ids: list[int] = []
        self.params = params
        self.kv = kv
        self.method_state: Any = None
        self.generator = torch.Generator(device="cpu").manual_seed(params.seed)
        self.finished = False
        self.finish_reason = ""
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.num_computed = 0  # tokens whose K/V went through the model (prefill progress, then +1 per step)
        self.slot_ready = False  # the next decode step's slot is appended already (prepared during the last step)
        self.window_queries: dict[int, torch.Tensor] = {}  # layer -> last prompt queries, for shared prefills
        self.attended_total = 0.0  # sum over decode steps of attended slots per head, averaged over layers
        self.trace: Trace | None = None  # set to record resident / attended positions (engine/trace.py)
        self.logprobs: list[TokenLogprob] = []  # one per new token when `params.logprobs` asks for them
        self.prefill: Any = None  # `Engine.start_prefill`'s progress while the prompt is prefilled chunk by chunk
        self.block_keys: PromptKeys | None = None  # prefix caching: the keys of its full prompt pages
        self.cached_blocks = 0  # of those, the ones in the prefix cache (found there, or added by this request)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def next_input(self) -> int:
        """The token the next decode step feeds: the last one, or while a preempted request is recomputed, the
        output token at its position (`replaying`)."""
        return self.output_ids[self.num_computed - len(self.prompt_ids)]

    @property
    def replaying(self) -> bool:
        """A preempted request catching up: its prompt is prefilled again and its output tokens are fed back through
        decode steps (no sampling, nothing emitted) until it is where it was."""
        return self.num_computed < self.num_tokens - 1
