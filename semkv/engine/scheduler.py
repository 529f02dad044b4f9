"""Continuous batching of requests that arrive over time, each with its own method object.

Requests of one method object decode in one batch; the batches of different methods take turns, one decode step each per
`advance`. With a token budget (`max_num_batched_tokens`, the server) a step is: one decode step of every batch, then
prompt chunks up to what the budget has left (a chunk cut to it; a method's own chunks stay whole), so a long prompt is
prefilled over several steps while the running requests keep decoding; a step in which no request decodes prefills up to
the engine's own chunk (`Engine.prefill_chunk`) when it is larger than the budget, which bounds the time between a
running request's tokens, not a prefill's. The budget counts tokens, but a chunk late in a long prompt attends over all
the keys before it: on an H200 (Qwen2.5-0.5B, 64 requests, benchmarks/results/2026-12-02-h200-budgets-beside-vllm.md)
the time between a request's tokens grew from 11.8 to 31.1 ms over a 32k prompt's first seven 4,096-token chunks. With
`dynamic_chunking` (as SGLang's) a step in which requests decode also keeps its chunks' cost (`chunk_cost`: each
token's dense work and its attention to the keys before it, in multiply-adds from the model's shape) within that of
the budget's tokens at a prompt's start, so a long prompt's later chunks are shorter and its steps even. The last
batch's decode step ends (its tokens read, the method's `end_step`,
its finished requests released) after the chunks of the prompts already being prefilled are queued and before new
prompts are admitted: the device runs those chunks while the host ends the step, instead of idling between the decode
step's end and the first chunk (an H200, 64 requests of 32,000 tokens: a mixed step 54.2 -> 49.7 ms,
benchmarks/results/2026-11-29-h200-mixed-steps.md). The prompts a step finishes get their first tokens chosen on the
device at its end and read by the next step after it has queued its own work (`_choose_first`, `_first_tokens`): the
device goes from one step's prefill to the next one's while the host admits and plans it; they decode from the step
after (until then they count as decoding for the budget, unless they ask for one token). On CUDA a step that computed at
most `READ_AT_ONCE` prompt tokens (follow-up questions on cached documents) reads its prompts' first tokens before it
ends instead (`read_at_once`): the host waits for a short forward, after publishing the tokens of the step before (an
H200, ChunkKV's follow-ups arriving over two steps: first tokens' median 31.6 -> 28-30 ms, slowest decode step 40 -> 2.7
ms, benchmarks/results/2026-11-30-h200-served-follow-ups.md). The chunks of a step that need no more than attention from
their methods (`Engine.prefill_span`: most follow-up questions on a cached document, the last short chunks of prompts)
run together in one forward (`Engine.prefill_together`) instead of one each; a prompt that such a forward ends is ended
(its layers' eviction, the method's `finish_prefill`: `Engine.end_prompt`) once the step's first tokens are given and
`publish` has sent them, before its first decode step, so that a follow-up question's first token does not wait for its
method's work on the documents, its own or that of the follow-ups admitted a step before it (on an H200, 8 follow-ups on
32k documents under ChunkKV: first tokens 95 -> 54 ms after submission, Full KV's 50-52). A batch that decodes
alone (nothing waiting, no prompt to run) pipelines its steps on CUDA (`pipeline`): its next decode step, whose
inputs the last one prepared on the device (`Engine.ready_ahead`), is launched before the last one is ended, so the
device runs a step while the host ends the one before and a server sends its tokens; only for methods whose steps
read nothing the last step's end leaves on the host (`Engine.pipelines`, `KVMethod.plans_ahead`), so the tokens are
those of steps run one after another (a request that a step ended gets no token from the step already launched).
Without a budget (`Engine.run`), waiting requests are admitted and prefilled whole before the decode steps, and get
their first tokens at once.

Admission takes the oldest waiting request that the pool and the device can hold now (`Engine.blocked`): its
prefill's pages beside those promised to prompts being prefilled and a watermark (`WATERMARK`), its method state.
A request that cannot be admitted does not hold the queue: up to `BYPASS` later ones may pass it, then it waits for
room. Running requests grow a page at a time; when a decode step's pages are missing, the most recently admitted
request is preempted: its
pages and state are freed and it goes back to the head of the queue, to be recomputed (its prompt prefilled again,
from the prefix cache where it can, then its output fed back through decode steps: `Sequence.replaying`), so it ends
with the tokens it would have had. With prefix caching, a request starts from the cached pages of its prompt's
prefix (`Engine.lookup_prefix`) and gives its own to the cache as its prefill computes them (`Engine.cache_prompt`).

Every decision reads counts (pages, tokens), never clocks, so that the ranks of tensor parallelism decide alike.
`Engine.run` drives a scheduler over a fixed list of requests; `semkv serve` keeps one for the life of the server and
submits requests as they arrive (with `contain=True`, so that a request that fails ends alone).
"""
from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Callable

import torch

from semkv.engine.cuda_graph import GraphRunner
from semkv.engine.hooks import KVMethod
from semkv.engine.prefix_cache import PrefixCache
from semkv.engine.sampler import Choice, choose_each, chosen
from semkv.engine.sequence import Sequence
from semkv.errors import SemkvError

StopTest = Callable[[Sequence], str]  # why a request stops after its last token ("eos", "stop", "length"), or ""
BYPASS = 8  # admissions that may pass a waiting request the pool cannot hold now, before it holds the queue
SCAN = 16  # waiting requests looked at per admission (the oldest ones)
WATERMARK = 100  # admission leaves 1 / WATERMARK of the pool free for the running requests' next pages
READ_AT_ONCE = 1024  # on CUDA, a step of at most this many prompt tokens reads their first tokens before it ends


Mark = float | torch.cuda.Event  # a point in time: the clock's on the CPU, a recorded event on CUDA
STEP_KINDS = ("decode", "mixed", "prefill")  # a step's work: decode rows only, decode rows and prompt chunks, chunks
Prompts = list[tuple[Sequence, torch.Tensor]]  # prompts done, each with its last logits [vocab]


def _kinds(zero: int | float):
    """A counters field: `zero` for each step kind."""
    return field(default_factory=lambda: dict.fromkeys(STEP_KINDS, zero))


@dataclass
class Counters:
    """What a scheduler has done, for a server's metrics: counts since it was made, and the last step's tokens."""

    admitted: int = 0  # requests admitted
    prompt_tokens: int = 0  # prompt tokens of the admitted requests
    cached_tokens: int = 0  # of those, read from the prefix cache instead of computed
    preemptions: int = 0  # running requests whose pages were freed to make room (recomputed later)
    steps: int = 0  # engine steps (`advance` calls that ran something)
    step_tokens: int = 0  # tokens the last step computed: one per decoding request plus its prefill chunks
    # steps by kind (`STEP_KINDS`) whose end the device has reached, and their time: from the step's first kernel to
    # its last as the device ran them (CUDA events, read once done: a step is counted a step or two late), wall time
    # on the CPU
    timed_steps: dict[str, int] = _kinds(0)
    step_seconds: dict[str, float] = _kinds(0.0)


@dataclass
class Batch:
    """The running requests of one method object and the CUDA graphs of their decode steps."""

    method: KVMethod
    running: list[Sequence] = field(default_factory=list)
    graphs: GraphRunner | None = None


def attention_weight(config) -> float:
    """What a prompt token's attention to one key costs against its dense work (projections and MLP), by
    multiply-adds a layer: 2 x heads x head_dim (q . k and p . v) against hidden x (q, k, v and o's columns) + 3 x
    hidden x intermediate. Qwen2.5-0.5B: 1.2e-4 (a token after about 8,300 keys costs twice one at the start);
    Llama-3.1-8B: 3.8e-5."""
    heads, kv_heads, dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.hidden_size
    return 2 * heads / (dim * (2 * heads + 2 * kv_heads) + 3 * dim * config.intermediate_size)


def chunk_cost(start: int, tokens: int, weight: float) -> float:
    """The cost of prefilling prompt tokens [start, start + tokens), in units of one token's dense work: each token's
    dense work and its attention to the keys up to itself (`weight` each)."""
    return tokens * (1 + weight * (start + (tokens + 1) / 2))


def chunk_tokens(start: int, cost: float, weight: float) -> int:
    """The most prompt tokens from `start` whose `chunk_cost` is at most `cost`."""
    linear = 1 + weight * (start + 0.5)  # chunk_cost = linear x tokens + weight / 2 x tokens^2
    tokens = max(0, int((math.sqrt(linear * linear + 2 * weight * cost) - linear) / weight))
    while tokens and chunk_cost(start, tokens, weight) > cost:  # the square root's rounding
        tokens -= 1
    while chunk_cost(start, tokens + 1, weight) <= cost:
        tokens += 1
    return tokens


class Scheduler:
    def __init__(self, engine, contain: bool = False, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None, prefix_caching: bool = False, dynamic_chunking: bool = False):
        """contain: a request that cannot be admitted even alone, or whose prefill or decode step raises, ends with
        its error in `failed` (with the other requests of its batch for a failed step) and the others go on; without
        it the error propagates (the caller then ends the run: `Engine.end`). max_num_batched_tokens: tokens one
        step computes (decode rows and prefill chunks; None: whole prompts before the decode steps); max_num_seqs:
        requests running at once; prefix_caching: reuse the prompt pages of earlier requests with the same prefix;
        dynamic_chunking: a step in which requests decode keeps its chunks' `chunk_cost` within that of
        max_num_batched_tokens tokens at a prompt's start (see the module's docstring)."""
        if dynamic_chunking and max_num_batched_tokens is None:
            raise SemkvError("dynamic chunking cuts prompt chunks to a step's budget: give max_num_batched_tokens")
        self.engine, self.contain = engine, contain
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.dynamic_chunking = dynamic_chunking
        self.weight = attention_weight(engine.config)
        # a decoding step's prompt chunks cost at most this (`chunk_cost`; without dynamic chunking, no bound)
        self.step_cost = chunk_cost(0, max_num_batched_tokens, self.weight) if dynamic_chunking else math.inf
        self.prefix_caching = prefix_caching
        if prefix_caching and engine.pool.cache is None:
            engine.pool.cache = PrefixCache(engine.config.num_layers)
        self.counters = Counters()
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, prompt not done yet (in admission order)
        self.batches: dict[int, Batch] = {}  # id(method) -> its batch
        self.kept: set[int] = set()  # ids of methods whose batch (its CUDA graphs) stays while no request uses them
        self.failed: list[tuple[Sequence, BaseException]] = []  # contained errors; the caller takes them
        self._method: dict[Sequence, KVMethod] = {}
        self._stop: dict[Sequence, StopTest] = {}
        self._queued: dict[Sequence, float] = {}  # when each waiting request joined the queue (for `stats.queue_s`)
        self._admitted: dict[Sequence, int] = {}  # admission order of live requests (the newest is preempted first)
        self._order = itertools.count()
        self._bypassed = 0  # admissions past the request at the head of the queue
        self._timing: deque[tuple[str, Mark, Mark]] = deque()  # (kind, start, end) of steps not yet counted
        self._done: Prompts = []  # prompts done this step
        # the prompts a step finished, those of them that get a first token (not recomputed), and those tokens being
        # chosen (`_choose_first`): the next step takes them
        self._choosing: tuple[Prompts, Prompts, Choice] | None = None
        self.awaiting: set[Sequence] = set()  # those prompts (less any preempted or ended since): decoding next step
        # called once a step's first tokens are given to their requests (`_first_tokens`), before the ends of the
        # prompts that a packed forward ran (`Engine.end_prompt`): a server sends the tokens out then
        self.publish: Callable[[], None] | None = None
        self._given = False  # first tokens given in this step, not yet published
        self._ending: list[Sequence] = []  # prompts given their first tokens, to be ended once published
        # a step that computed at most this many prompt tokens reads their first tokens before it ends: the host waits
        # for a short forward (follow-up questions), and those tokens go out before the step's prompt ends, not after
        # the next step's work (0: never, the CPU's steps, where nothing runs ahead of the host)
        self.read_at_once = READ_AT_ONCE if engine.device.type == "cuda" else 0
        # a batch decoding alone (nothing waiting, no prompt) launches its next decode step before it ends the last
        # one, when the last one prepared its inputs (`Engine.ready_ahead`): the device runs a step while the host
        # ends the one before and the server sends its tokens (off CUDA nothing runs ahead of the host: off)
        self.pipeline = engine.device.type == "cuda"
        # a batch's decode step (`Engine.launch_step`'s) launched by the last `advance`, ended by the next
        self._pending: tuple[Batch, object] | None = None

    def submit(self, seq: Sequence, method: KVMethod, is_stop: StopTest) -> None:
        """Queue a request (its `method_state` made already) behind the waiting ones."""
        self.waiting.append(seq)
        self._method[seq], self._stop[seq] = method, is_stop
        self._queued[seq] = time.perf_counter()
        self._protect(seq)

    @property
    def running(self) -> list[Sequence]:
        """The requests decoding."""
        return [seq for batch in self.batches.values() for seq in batch.running]

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.awaiting
                    or any(b.running for b in self.batches.values()))

    def keep(self, method: KVMethod) -> None:
        """Keep the batch of `method` (an `idle_graphs` one), with its captured decode steps, while no request uses
        it, until `forget`."""
        self.kept.add(id(method))

    def forget(self, method: KVMethod) -> None:
        """Stop keeping the batch of `method`: it goes now if no request uses the method, else with its last one."""
        self.kept.discard(id(method))
        if not self._in_use(method):
            self.batches.pop(id(method), None)

    def _in_use(self, method: KVMethod) -> bool:
        """True while a request (waiting, prefilling or running) uses `method`."""
        return any(m is method for m in self._method.values())

    def cancel(self, seq: Sequence) -> None:
        """End a waiting or running request now: it finishes as "cancelled" and everything it holds is freed."""
        if seq not in self._method:
            return
        self._settle()
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.finished, seq.finish_reason = True, seq.finish_reason or "cancelled"
        self._end(seq)

    @torch.inference_mode()
    def advance(self, progress: bool = False) -> None:
        """One step: a decode step of each batch and prefill work (see the module's docstring); finished requests
        are released."""
        budget = self.max_num_batched_tokens
        started = self._mark()
        if self._pending is not None and self._pipelined(started):
            return
        tokens = prompt = 0
        if budget is None:  # whole prompts first, as many as fit
            while (seq := self._admit()) is not None:
                prompt += self._prefill(seq, 0, progress)
            self._choose_first()
            self._first_tokens()
            self._publish_then_end()
            tokens = prompt
        active = [b for b in self.batches.values() if b.running]
        launched = None  # the last batch's step, completed after the running prompts' chunks are queued
        for i, batch in enumerate(active):
            try:
                self._make_room(batch)
                if not batch.running:
                    continue
                overlap = i == len(active) - 1 and budget is not None and bool(self.prefilling)
                alone = self.pipeline and self._alone(batch)
                step = self.engine.launch_step(list(batch.running), batch.method, batch.graphs,
                                               early=overlap or alone)
            except Exception as error:  # noqa: BLE001 - contained or re-raised by _fail
                self._fail([s for s in batch.running if not s.finished], error)  # not those it finished before
                continue
            tokens += len(batch.running)
            if overlap:
                launched = (batch, step)
            elif alone and self.engine.ready_ahead(batch.running):
                self._pending = (batch, step)  # ended by the next advance, after it launched the next step
            else:
                self._complete(batch, step)
        if budget is not None:  # what the decode steps left of the budget goes to prompts; a step in which no
            # request decodes keeps no one from a token: it prefills up to the engine's own chunk when that is larger
            # (the prompts awaiting their first token count as decoding, but those asking for one token: they end
            # with it)
            decoding = tokens + sum(seq.params.max_new_tokens > 1 for seq in self.awaiting)
            left = budget - decoding if decoding else max(budget, self.engine.prefill_chunk)
            cost = self.step_cost - decoding if decoding else math.inf
            left, cost, done = self._prompts(iter(list(self.prefilling)), left, cost)  # prompts being prefilled first
            if launched is not None:  # the device runs those chunks while the host ends the decode step
                self._complete(*launched)
            done += self._prompts(iter(self._admit, None), left, cost)[2]  # then new ones
            tokens, prompt = tokens + done, prompt + done
            self._first_tokens()  # the last step's prompts: their tokens were chosen before this step's work
            self._choose_first()
            if self._choosing is not None and done <= self.read_at_once:  # a short forward: its prompts' tokens now,
                self._publish()  # the last step's out first, not after the wait
                self._first_tokens()
            self._publish_then_end()
        self.engine.reserved = 0  # the promises hold while this scheduler steps
        if tokens:
            self.counters.steps += 1
            self.counters.step_tokens = tokens
            kind = "decode" if not prompt else "prefill" if prompt == tokens else "mixed"
            self._timing.append((kind, started, self._mark()))
        self._count_time()

    def _alone(self, batch: Batch) -> bool:
        """True when `batch` is all there is to run (no request waits or is being prefilled or given its first
        token, and no other batch decodes) and its method's steps may be pipelined (`Engine.pipelines`)."""
        return self.engine.pipelines(batch.method) and not (
            self.waiting or self.prefilling or self.awaiting or self._choosing or self._ending) and all(
            b is batch or not b.running for b in self.batches.values())

    def _pipelined(self, started: Mark) -> bool:
        """With a decode step pending (`pipeline`): launch the batch's next step, then end the pending one, when the
        batch is still alone and the pending step prepared the next one's inputs (True: that was the whole step);
        else only end the pending one (False: the step goes on as usual). A request that the pending step finished is
        in the next one too: that step is then ended at once, its tokens past the request's end dropped."""
        batch, step = self._pending
        self._pending = None
        if not (self._alone(batch) and self.engine.ready_ahead(batch.running)):
            self._complete(batch, step)
            return False
        try:
            after = self.engine.launch_step(list(batch.running), batch.method, batch.graphs, early=True, behind=1)
        except Exception as error:  # noqa: BLE001 - contained or re-raised by _fail
            self._complete(batch, step)
            self._fail([s for s in batch.running if not s.finished], error)
            return True
        self._complete(batch, step)
        if any(s.finished for s in after.running) or not self.engine.ready_ahead(batch.running):
            self._complete(batch, after)
        else:
            self._pending = (batch, after)
        self.counters.steps += 1
        self.counters.step_tokens = len(after.running)
        self._timing.append(("decode", started, self._mark()))
        self._count_time()
        return True

    def _settle(self) -> None:
        """End the pending decode step, if any (`pipeline`): before anything that changes the running requests from
        outside a step (a cancel)."""
        if self._pending is not None:
            batch, step = self._pending
            self._pending = None
            self._complete(batch, step)

    def _complete(self, batch: Batch, step) -> None:
        """End a batch's launched decode step (`Engine.complete_step`); its finished requests are released."""
        try:
            self.engine.complete_step(step, self._stop_any)
        except Exception as error:  # noqa: BLE001 - contained or re-raised by _fail
            self._fail([s for s in batch.running if not s.finished], error)
        for seq in [s for s in batch.running if s.finished]:
            self._end(seq)

    def _mark(self) -> Mark:
        """Now, for a step's time: a CUDA event recorded on the stream the steps run on, the clock on the CPU."""
        if self.engine.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _count_time(self) -> None:
        """Count the steps the device has finished in `counters` (never waits for it)."""
        while self._timing:
            kind, start, end = self._timing[0]
            if isinstance(end, float):
                seconds = end - start
            elif end.query():
                seconds = start.elapsed_time(end) / 1e3
            else:
                return
            self._timing.popleft()
            self.counters.timed_steps[kind] += 1
            self.counters.step_seconds[kind] += seconds

    # -- admission and prefill ------------------------------------------------------------------------------------
    def _admit(self) -> Sequence | None:
        """Admit the oldest waiting request that fits now (see the module's docstring), start its prefill; None when
        none may start."""
        if self.max_num_seqs is not None and len(self._admitted) >= self.max_num_seqs:
            return None
        limit = self.max_num_batched_tokens
        # pages promised to prompts being prefilled, and a watermark for the running requests' growth
        reserved = self._reserved() + (self.engine.pool.num_pages // WATERMARK if self._admitted else 0)
        for i, seq in enumerate(itertools.islice(self.waiting, SCAN)):
            method = self._method[seq]
            try:
                blocked = self.engine.blocked(seq, method, reserved, limit)
            except Exception as error:  # noqa: BLE001 - a method's admission hook failed: contained or re-raised
                self._fail([seq], error)
                return self._admit()
            if blocked is None:
                break
            if not self._admitted:  # it cannot fit even alone
                self._fail([seq], MemoryError(blocked))
                return self._admit()
            if i == 0 and self._bypassed >= BYPASS:
                return None  # it has been passed often enough: it waits for room
        else:
            return None
        self._bypassed = 0 if i == 0 else self._bypassed + 1
        self.waiting.remove(seq)
        seq.stats.queue_s += time.perf_counter() - self._queued.pop(seq)
        self._admitted[seq] = next(self._order)
        try:
            if self.prefix_caching:
                self.engine.lookup_prefix(seq, method)
            self.engine.start_prefill(seq, method, limit)
        except Exception as error:  # noqa: BLE001 - contained or re-raised by _fail
            self._fail([seq], error)
            return self._admit()
        self.prefilling.append(seq)
        self.counters.admitted += 1
        self.counters.prompt_tokens += len(seq.prompt_ids)
        self.counters.cached_tokens += seq.num_computed
        return seq

    def _prompts(self, seqs: Iterator[Sequence], left: int, cost: float) -> tuple[int, float, int]:
        """Prefill chunks of the prompts `seqs` yields, in turn, while `left` tokens and `cost` (`chunk_cost`) of the
        step's budget remain: the chunks that may share a forward (`Engine.prefill_span`) run in one after the others
        (`_prefill_together`). (The tokens and the cost left, the prompt tokens computed.)"""
        together, computed = [], 0
        while left > 0 and cost >= 1 and (seq := next(seqs, None)) is not None:
            start = seq.num_computed
            tokens = left if math.isinf(cost) else min(left, chunk_tokens(start, cost, self.weight))
            if not tokens:  # no token of it fits the cost left (an admitted prompt starts at the next step)
                break
            span = self.engine.prefill_span(seq, tokens)
            if span is None:
                done = self._prefill(seq, tokens)
            else:
                together.append(seq)
                done = span
            left, computed = left - done, computed + done
            cost -= chunk_cost(start, done, self.weight)
        together = [seq for seq in together if not seq.finished]  # (one may fail at admission)
        if together:  # one alone too: its forward's host work a layer is less than `PrefillStep`'s
            self._prefill_together(together)
        return left, cost, computed

    def _prefill_together(self, seqs: list[Sequence]) -> None:
        """One chunk of each prompt in one forward (`Engine.prefill_together`); as `_prefill` for each, but that a
        prompt done waits for its end (`Engine.end_prompt`, then its pages to the prefix cache) until its first token
        is out (`_first_tokens`)."""
        try:
            firsts = self.engine.prefill_together(seqs)
        except Exception as error:  # noqa: BLE001 - contained or re-raised by _fail
            self._fail(seqs, error)
            return
        for seq, first in zip(seqs, firsts):
            if first is None:
                self._prefilled(seq, None)
            else:
                self.prefilling.remove(seq)
                self._done.append((seq, first))

    def _prefilled(self, seq: Sequence, first: torch.Tensor | None) -> None:
        """After a call's chunks of a prompt: its pages to the prefix cache; once it is done, it waits in `_done` for
        its first token."""
        try:
            if self.prefix_caching:
                self.engine.cache_prompt(seq)
        except Exception as error:  # noqa: BLE001 - contained or re-raised by _fail
            self._fail([seq], error)
            return
        if first is not None:
            self.prefilling.remove(seq)
            self._done.append((seq, first))

    def _prefill(self, seq: Sequence, budget: int, progress: bool = False) -> int:
        """Run prefill chunks of an admitted request, `budget` tokens' worth (0: all of them); once its prompt is done
        it waits in `_done` for its first token (`_first_tokens`). The prompt tokens computed."""
        before = seq.num_computed
        try:
            if budget:
                first = self.engine.continue_prefill(seq, budget)
            else:
                first = self.engine.run_prefill(seq, progress)
        except Exception as error:  # noqa: BLE001 - contained or re-raised by _fail
            self._fail([seq], error)
            return 0
        self._prefilled(seq, first)
        return seq.num_computed - before

    def _choose_first(self) -> None:
        """The prompts done in this step get their first tokens chosen together on the device (`choose_each`),
        copied to the host without a wait: the next step queues its work before it reads them (`_first_tokens`), so
        the device runs that work while the host admits and plans it, instead of idling from the end of this step's
        prefill to the next step's first kernel."""
        done, self._done = self._done, []
        if not done:
            return
        fresh = [(seq, logits) for seq, logits in done if not seq.output_ids]
        try:
            choice = choose_each([logits for _, logits in fresh], [seq.params for seq, _ in fresh],
                                 [seq.generator for seq, _ in fresh])
        except Exception as error:  # noqa: BLE001 - contained or re-raised by _fail
            self._fail([seq for seq, _ in done], error)
            return
        self._choosing = done, fresh, choice
        self.awaiting.update(seq for seq, _ in done)

    def _first_tokens(self) -> None:
        """The prompts whose first tokens `_choose_first` chose get them and join their method's batch (those
        preempted or ended since are left out). A prompt recomputed after preemption gets none: its next tokens are
        its output's. Those whose prompts a packed forward ran are ended by `_publish_then_end`, once the step's
        first tokens are out: a follow-up question's first token does not wait for its method's work on the cached
        document, its own or that of the follow-ups before it."""
        if self._choosing is None:
            return
        (done, fresh, choice), self._choosing = self._choosing, None
        try:
            tokens = self.engine.agree(chosen(choice))
        except Exception as error:  # noqa: BLE001 - contained or re-raised by _fail
            self._fail([seq for seq, _ in done if seq in self.awaiting], error)
            return
        for (seq, logits), token in zip(fresh, tokens):
            if seq not in self.awaiting:
                continue
            try:
                self.engine.append_token(seq, token, self._stop[seq], logits)
            except Exception as error:  # noqa: BLE001 - contained or re-raised by _fail
                self._fail([seq], error)
        for seq, _ in done:
            if seq not in self.awaiting:  # preempted, or failed or ended above
                continue
            self.awaiting.discard(seq)
            if seq.finished:
                self._end(seq)
                continue
            self._batch(self._method[seq], seq).running.append(seq)
            if seq.prefill is not None:
                self._ending.append(seq)
        self._given |= bool(fresh)

    def _publish(self) -> None:
        """`publish` the first tokens given since it was last called, if any."""
        if self.publish is not None and self._given:
            self.publish()
        self._given = False

    def _publish_then_end(self) -> None:
        """After a step's first tokens are given: `publish`, then the ends of the prompts that a packed forward ran
        (their layers' eviction, the method's `finish_prefill`, their pages to the prefix cache), before their first
        decode step."""
        self._publish()
        ending, self._ending = self._ending, []
        for seq in ending:
            if seq.finished or seq.prefill is None:  # ended or preempted since
                continue
            try:
                self.engine.end_prompt(seq)
                if self.prefix_caching:
                    self.engine.cache_prompt(seq)
            except Exception as error:  # noqa: BLE001 - contained or re-raised by _fail
                self._fail([seq], error)

    def _reserved(self) -> int:
        """Pages promised to the prompts being prefilled (their prefill's pages not taken yet; a prompt done in a
        packed forward until its end); a request whose method fails to say ends with the error."""
        engine, limit, total = self.engine, self.max_num_batched_tokens, 0
        for seq in [*self.prefilling, *(s for s in self.awaiting if s.prefill is not None)]:
            try:
                total += max(engine.pages_needed(seq, self._method[seq], prefill=True, limit=limit)
                             - seq.kv.held_pages, 0)
            except Exception as error:  # noqa: BLE001 - contained or re-raised by _fail
                self._fail([seq], error)
        return total

    def _protect(self, seq: Sequence) -> None:
        """With prefix caching, a request whose method shares prompt pages keeps its full prompt pages intact for the
        cache (`SeqKV.protect`), which admission counts."""
        if self.prefix_caching and self._method[seq].shares_prefix(seq):
            seq.kv.protect = len(seq.prompt_ids) // self.engine.pool.page_size

    # -- preemption -----------------------------------------------------------------------------------------------
    def _make_room(self, batch: Batch) -> None:
        """Preempt the most recently admitted requests until the pages of this batch's next decode step are there."""
        engine = self.engine
        engine.reserved = self._reserved()
        while not engine.can_grow(batch.running, batch.method):
            need = engine.step_pages(batch.running, batch.method)
            victim = max(self._admitted, key=self._admitted.get)
            if len(self._admitted) == 1:  # nothing left to preempt: it cannot grow further
                self._fail([victim], MemoryError(
                    f"request {victim.seq_id} needs {need} more KV pages to go on; the pool has "
                    f"{engine.pool.num_pages - 1} and every other request was preempted (raise "
                    "gpu_memory_utilization or lower max_new_tokens)"))
                return
            self._preempt(victim)
            engine.reserved = self._reserved()

    def _preempt(self, seq: Sequence) -> None:
        """Free a live request's pages and state and put it back at the head of the queue, to be recomputed."""
        method = self._method[seq]
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        elif seq in self.awaiting:
            self.awaiting.discard(seq)
        else:
            self.batches[id(method)].running.remove(seq)
        del self._admitted[seq]
        self.engine.release(seq)
        seq.num_computed, seq.prefill, seq.slot_ready = 0, None, False
        seq.block_keys, seq.cached_blocks = None, 0
        seq.method_state = method.new_state(seq)
        self.waiting.appendleft(seq)
        self._queued[seq] = time.perf_counter()
        self._protect(seq)
        self.counters.preemptions += 1

    # -- decode ---------------------------------------------------------------------------------------------------
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
        self._queued.pop(seq, None)
        self._admitted.pop(seq, None)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        self.awaiting.discard(seq)
        batch = self.batches.get(id(method))
        if batch is not None and seq in batch.running:
            batch.running.remove(seq)
        self.engine.finish(seq)
        if not self._in_use(method):
            if id(method) not in self.kept:
                self.batches.pop(id(method), None)
            self.engine.end([], method)

    def _fail(self, seqs: list[Sequence], error: BaseException) -> None:
        if not self.contain:
            self._done.clear()  # the run ends: no prompt's logits outlive it in the error's traceback
            self._choosing, self._ending = None, []
            self.awaiting.clear()
            raise error
        for seq in seqs:
            if seq in self.waiting:
                self.waiting.remove(seq)
            seq.finished, seq.finish_reason = True, "error"
            self.failed.append((seq, error))
            self._end(seq)
