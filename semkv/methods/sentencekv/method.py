"""SentenceKV: sentence-level semantic KV caching (Zhu et al., 2025, "SentenceKV: Efficient LLM Inference via
Sentence-Level Semantic KV Caching", https://arxiv.org/abs/2504.00970).

At the end of prefill the prompt is cut into sentence buckets; the last `window` prompt queries score every token (the
attention it receives, summed over the window and the query heads of its KV group), the top floor(keep_factor *
budget) tokens of each KV head are retained across all sentences and the rest are dropped for good; each bucket gets
a sentence vector per KV head (the mean of its retained keys, kept on the device); with `offload` the retained K/V
move to host memory (by default they stay on the device). At every decode step the mean query of the tokens
generated since the last sentence end is scored against the sentence vectors (dot product per KV head), the best
buckets are taken (with offload: loaded) until the budget is filled, and attention runs over them plus the attention
sinks and the recent window.

Device memory during decoding with offload: `n_sink` sinks + a working set of `budget - n_sink - n_recent` slots
(rounded up so that it ends on a KV page; the loaded buckets: a bucket that stays chosen stays loaded, so only newly
chosen tokens are copied) + the recent window, which holds up to `offload_chunk` (at least a page) more tokens on
their way out: tokens leaving the recent window are offloaded in whole pages, which leave the page table without a
copy, and join the bucket of the sentence they belong to (generated text is bucketed like the prompt), so they can be
retrieved later. Plus the sentence vectors (score="vector") and a token -> bucket map (one int per retained
token). Bytes moved are counted in `stats.h2d_bytes` / `d2h_bytes` (`h2d_bytes_step_max`: the largest decode step).

Choices where the paper is silent: sinks and recent window count in the budget (`budget // 4` each at most, so at
least half is left for buckets); the last bucket that does not fit keeps its leading tokens; a float budget is
resolved against the prompt length; with a budget covering the whole generation nothing is dropped or moved and the
output equals Full KV exactly; the mean query of a GQA group is its query heads' mean; the query resets whenever a
new generated bucket starts (a sentence end or an over-long split). The authors' code keeps all K/V on the GPU and
masks; here retained K/V really live in host memory (pinned on GPU runs) when `offload` is on.

Decoding is batched (`buckets.SentenceRows`): the sentence vectors, bucket counts, the bucket of every retained
token and the running query sums of all sequences live in device tensors, one row per sequence; the step plan gives
each row its state row and budget split, `kernels.bucket_take` finds what the budget takes of the ranked buckets
of every row and KV head (without sorting them), and `kernels.sentence_slots` turns that into slot lists (with
score="tokens", opt-in, the buckets are ranked by their best retained token instead: `kernels.bucket_best`, the
retained keys read in place, a max per bucket). With offload on, those slot lists name virtual slots (the resident
layout) and `WorkingSets.load` makes them device slots, reading the chosen tokens the working set does not hold from
pinned host memory in the same kernel. Either way a step reads nothing back and is captured in a CUDA graph; tokens
that leave the recent window join their buckets between steps (host-decided, every `offload_chunk` tokens: at the
step's plan when K/V stay resident, so that with query="current" a step may be launched before the last one ends;
at the step's end with offload, which moves their slots).

Parameters
----------
budget: tokens one KV head of one layer attends to per decode step, sinks and recent window included.
keep_factor: r, the semantic keeping factor: floor(r * budget) tokens per KV head survive prefill; 2.0 (the paper's
    default, "typically r = 2 or 3").
window: N, the observation window of prompt queries that score token importance; 32 (paper).
n_sink: initial tokens always attended; 32 (the authors' code).
n_recent: most recent tokens always attended, the current one included; 32 (the authors' code).
split_std: n of the paper's A.7: sentences longer than mean + n * std tokens are split; 3.0 (only outliers; the
    paper proposes the rule without a value).
max_sentence: hard cap on a bucket's length, so text without punctuation is still bucketed; 128 (about four
    median sentences, which the paper puts at 25-30 tokens).
query: "mean" (mean query of the current generated sentence, the paper) or "current" (the current token's query,
    the paper's ablation, section 6.2).
score: "vector" (the paper: a bucket scores query . its sentence vector) or "tokens": a bucket scores the best
    query . key of its retained tokens, read from the cache every step (the paged dot product TokenSelect uses). A
    sentence vector averages a needle's few matching keys with the rest of its sentence; the best token does not.
    Opt-in: it reads the retained keys each step (the widest row's, about r x budget per KV head, for every row);
    K/V resident (offload=False).
buckets: "sentences" (the paper) or "chunks" (as many equal-size chunks as there are sentences, the ablation of
    section 6.1; generated text is chunked the same way).
offload: False (the default) keeps the retained K/V resident and selects in place: the same tokens as offloading,
    and most of the memory saving already comes from dropping the unretained tokens at prefill. True keeps retained
    K/V in host memory and holds only the budget on the device (the paper's setting): the same tokens, a device
    footprint that does not grow with the context, so more or longer requests fit; None: on when the engine runs on
    a GPU. Both are batched and replayed in CUDA graphs.
retain: "tokens" (the paper: the top floor(r * budget) tokens per KV head) or "sentences": a token scores the best
    score of its sentence, so retained sentences are kept whole (the last one may be cut). The window attends to a
    needle's key and the first tokens of its value; the paper's top tokens drop the value's later tokens (digits and
    uuid pieces are a token or two each), and the model answers the value's start and invents the rest
    (benchmarks/results/2026-11-26-h100-niah.md). Opt-in: fewer, whole sentences.
offload_chunk: tokens leaving the recent window join their buckets (with offload: go to the host, in whole KV
    pages) this many at a time; 16 (with offload a multiple of the KV page size).
cache_factor: with offload, the device's working set holds this many times the tokens a step selects (>= 1; 1.5):
    a token that leaves the selection stays there until its slot is needed (clock order), so a re-selected token is
    found on the device instead of read from host memory again. More device memory, fewer bytes over PCIe; the same
    tokens. At 1.5 on an H100 (Llama-3.1-8B shape, 10% of 32k): within 1.26x of the resident step, 6x Full KV's
    batch at 2.6x its tokens/s, 2.9x less memory at 15 x 32k
    (benchmarks/results/2026-11-27-h100-offload-one-setting.md).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from semkv.engine.hooks import DecodeBatch, KVMethod, Selection, StepPlan, resolve_budget
from semkv.engine.kv_cache import KVPool
from semkv.engine.sequence import Sequence
from semkv.errors import SemkvError, check_choice, check_range
from semkv.kernels import use_triton
from semkv.methods.base import keep_top, per_kv_head, window_mass
from semkv.methods.eviction import window_positions
from semkv.methods.sentencekv import kernels as sentencekv_kernels
from semkv.methods.sentencekv.buckets import SentenceRows, SentenceState, bucket_of
from semkv.methods.sentencekv.sentences import SentenceRule, segment
from semkv.methods.state.rows import RowHolder
from semkv.methods.state.working_set import WorkingSets, move_tail, record_traffic, slot_ranges, working_set_slots

KEEP_ALL = 1 << 40  # the recent window of a row that keeps everything


@dataclass
class SentencePlan(StepPlan):
    """SentenceKV's step plan, one value a sequence [B]: its row in the device state, the queries summed in its open
    sentence, its sinks, retained tokens, the tokens its chosen buckets take and its recent window; with offload on,
    its offloaded tokens (the retained ones) and working-set slots, else 0 and 0 (a row that keeps everything: row 0,
    recent window `KEEP_ALL`)."""

    row: torch.Tensor
    q_count: torch.Tensor
    n_sink: torch.Tensor
    retained: torch.Tensor
    capacity: torch.Tensor
    n_recent: torch.Tensor
    offloaded: torch.Tensor
    cache: torch.Tensor


@dataclass
class SentenceKV(RowHolder, KVMethod):
    keep_factor: float = 2.0
    window: int = 32
    n_sink: int = 32
    n_recent: int = 32
    split_std: float = 3.0
    max_sentence: int = 128
    query: str = "mean"
    buckets: str = "sentences"
    offload: bool | None = False
    offload_chunk: int = 16
    cache_factor: float = 1.5
    retain: str = "tokens"
    score: str = "vector"

    name = "sentencekv"
    summary = ("SentenceKV: prompt cut into sentence buckets, top r*budget tokens kept (on the device, or in host "
               "memory with offload=True), mean-query sentence retrieval each decode step")
    kind = "selection"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("keep_factor", self.keep_factor, 1.0, 64.0)
        check_range("window", self.window, 1, None, int)
        check_range("n_sink", self.n_sink, 0, None, int)
        check_range("n_recent", self.n_recent, 1, None, int)
        check_range("split_std", self.split_std, 0.0, None)
        check_range("max_sentence", self.max_sentence, 1, None, int)
        check_range("offload_chunk", self.offload_chunk, 1, None, int)
        check_range("cache_factor", self.cache_factor, 1.0, 64.0)
        check_choice("query", self.query, ("mean", "current"))
        check_choice("buckets", self.buckets, ("sentences", "chunks"))
        check_choice("retain", self.retain, ("tokens", "sentences"))
        check_choice("score", self.score, ("vector", "tokens"))
        if self.offload not in (None, True, False):
            raise SemkvError(f"offload={self.offload!r}; allowed: True, False, None (on when the device is a GPU)")
        if self.score == "tokens" and self.offload is not False:
            raise SemkvError(f"score='tokens' reads the retained keys from the device each step: it needs "
                             f"offload=False (got offload={self.offload})")
        self._ends: tuple[torch.Tensor, torch.Tensor] = ()  # the step's virtual slots and recent window, at layer 0

    @property
    def graph_safe(self) -> bool:
        """A step ranks every row's buckets from the device state and the step plan alone, and with offload on the
        working-set kernel loads from host addresses on the device (the torch reference of that kernel reads the
        host from Python: not captured)."""
        return self.offload is False or use_triton(torch.device("cuda"))

    @property
    def steady_slots(self) -> bool:
        """With offload on, `end_step` moves the recent window back over the tokens it offloads."""
        return self.offload is False

    @property
    def plans_ahead(self) -> bool:
        """K/V resident and no mean query: the plan (rows, budget split, retained counts) is made from what the
        host knows a step before, and `end_step` only follows the sentences; the steps may be pipelined."""
        return self.offload is False and self.query != "mean"

    def bind(self, model: Any, tokenizer: Any, page_size: int) -> None:
        super().bind(model, tokenizer, page_size)
        if self.offload is not False and self.offload_chunk % page_size:
            raise SemkvError(f"offload_chunk={self.offload_chunk} must be a multiple of the KV page size ({page_size}) "
                             "with offload on: offloaded tokens leave the device a page at a time")
        self.rule = SentenceRule.for_tokenizer(tokenizer)

    def window_size(self) -> int:
        return self.window

    def prefill_by_layer(self) -> bool:
        """With offload (or offload=None): each layer's prompt is scored, retained and offloaded before the next
        layer's is computed, so a prompt longer than the device holds can be prefilled."""
        return self.offload is not False

    def split(self, prompt_tokens: int, max_new_tokens: int) -> tuple[bool, int, int, int]:
        """A request's budget split: whether the budget covers its whole generation (nothing is dropped or moved),
        its budget, sinks and recent window."""
        final = prompt_tokens + max_new_tokens - 1  # tokens in the cache at the last decode step
        dense = self.budget is None or resolve_budget(self.budget, final) >= final
        budget = resolve_budget(self.budget, prompt_tokens)
        return dense, budget, min(self.n_sink, budget // 4, prompt_tokens), max(1, min(self.n_recent, budget // 4))

    def new_state(self, seq: Sequence) -> SentenceState:
        n = len(seq.prompt_ids)
        dense, budget, n_sink, n_recent = self.split(n, seq.params.max_new_tokens)
        starts, limit = segment(seq.prompt_ids, self.rule, self.split_std, self.max_sentence,
                                self.buckets == "chunks")
        pool = seq.kv.pool
        offload = pool.device.type == "cuda" if self.offload is None else self.offload
        middle = n - n_sink - min(n_recent, n - n_sink)  # prompt tokens between the sinks and the recent window
        offload = offload and not dense
        capacity = budget - n_sink - n_recent
        st = SentenceState(dense=dense, budget=budget, n_sink=n_sink, n_recent=n_recent, capacity=capacity,
                           offload=offload, starts=starts + [n], limit=limit, row=0,
                           retained=0 if dense else min(int(self.keep_factor * budget), middle), store=None,
                           cache=self._cache(n_sink, capacity, n + seq.params.max_new_tokens - n_sink - n_recent,
                                             pool.page_size) if offload else 0)
        new = seq.params.max_new_tokens  # each generated token may join the retained ones and start a bucket
        st.room = len(st.starts) + (new if self.score == "tokens" else 0), st.retained + new
        if self._rows is None:  # also when every row keeps everything: a graphed step still reads row 0
            self._rows = SentenceRows(self.model.num_layers, self.model.num_heads, pool.num_kv_heads, pool.head_dim,
                                      pool.device, vectors=self.score == "vector")
        if offload and self._sets is None:
            self._sets = WorkingSets(pool.num_layers, pool.num_kv_heads, pool.device)
        return st

    def reset(self) -> None:
        super().reset()
        self._ends = ()
        self._plan: tuple[list[list[int]], SentencePlan] | None = None  # the last step plan and its values

    def takes_row(self, seq: Sequence) -> bool:
        st: SentenceState = seq.method_state
        return not st.dense and not st.row

    def row_needs(self, seq: Sequence, row: int, more_tokens: int = 0) -> tuple[int, int, int]:
        """(rows, buckets, retained tokens) the device state needs for `seq` in `row` with `more_tokens` further
        retained tokens: at least the room for all it may reach while generating (`SentenceState.room`), so that the
        state does not grow, and the captured steps of every row are not captured again, mid-generation."""
        st: SentenceState = seq.method_state
        return row + 1, max(len(st.starts), st.room[0]), max(st.retained + more_tokens, st.room[1])

    def set_needs(self, seq: Sequence, row: int) -> tuple[int, int, int] | None:
        """(rows, working-set slots, offloaded tokens: the retained prompt and every generated token), or None
        without offload."""
        st: SentenceState = seq.method_state
        return (row + 1, st.cache, st.retained + seq.params.max_new_tokens) if st.offload else None

    def device_tokens(self, prompt_tokens: int, max_new_tokens: int, page_size: int) -> int | None:
        """With offload: the sinks, the working set and the recent window with the tokens waiting to leave it;
        without: the prompt's sinks, retained tokens and recent window, and every generated token (they join the
        retained region). None when it keeps everything, or with offload=None (decided by the device when the
        request is made)."""
        dense, budget, n_sink, n_recent = self.split(prompt_tokens, max_new_tokens)
        if dense or self.offload is None:
            return None
        if not self.offload:
            return min(prompt_tokens + max_new_tokens, budget + int(self.keep_factor * budget) + max_new_tokens)
        cache = self._cache(n_sink, budget - n_sink - n_recent, prompt_tokens + max_new_tokens - n_sink - n_recent,
                            page_size)
        return min(prompt_tokens + max_new_tokens, n_sink + cache + n_recent + self.offload_chunk)

    def _cache(self, n_sink: int, capacity: int, middle: int, page_size: int) -> int:
        """Working-set slots for a selection of `capacity` offloaded tokens (`cache_factor` times as many, at most
        the `middle` tokens between a request's sinks and recent window less one `offload_chunk`)."""
        return working_set_slots(n_sink, capacity, page_size, self.cache_factor, middle - self.offload_chunk)

    # -- prefill --------------------------------------------------------------------------------------------------
    def evict_prefill(self, layer: int, seq: Sequence, q_window: torch.Tensor) -> torch.Tensor | None:
        """Retain the top floor(r * budget) middle tokens per KV head; keep sinks, the retained tokens (offload
        off) or as many as the working set holds (offload on: all of them go to the host) and the recent window."""
        st: SentenceState = seq.method_state
        if st.dense:
            return None
        kv = seq.kv
        n = kv.num_slots[layer]
        recent = min(st.n_recent, n - st.n_sink)
        keys, values, positions = kv.gather(layer, kv.all_slots(layer))  # [kv_heads, n, D]
        mass = window_mass(q_window, keys, positions, window_positions(seq, q_window))  # [heads, n]
        importance = per_kv_head(mass, keys.shape[0], "sum")[:, st.n_sink : n - recent]  # [kv_heads, mid]
        size = int(self.keep_factor * st.budget)
        starts = kv.pool.staging.send(st.starts)  # [buckets], in a copy that does not wait for the device
        if self.retain == "sentences":  # each token scores its sentence's best; ties go to the earlier token
            bucket = bucket_of(starts, torch.arange(st.n_sink, n - recent, device=keys.device))[None]  # [1, mid]
            best = importance.new_full((importance.shape[0], len(st.starts)), float("-inf"))
            best = best.scatter_reduce(1, bucket.expand_as(importance), importance, "amax")  # [kv_heads, buckets]
            order = best.gather(1, bucket.expand_as(importance)).sort(dim=-1, descending=True, stable=True).indices
            retained = order[:, :size].sort(dim=-1).values + st.n_sink  # [kv_heads, R] ascending
        else:
            retained = keep_top(importance, size) + st.n_sink  # [kv_heads, R] ascending
        heads = torch.arange(keys.shape[0], device=keys.device)[:, None]
        vectors = keys[heads, retained][None, None] if self._rows.vectors is not None else None  # [1, 1, H, R, D]
        row = torch.full((1,), st.row, device=keys.device)  # a fill, not a copy from the host that waits
        self._rows.add(row, slice(layer, layer + 1), vectors, bucket_of(starts, retained)[None, None],
                       torch.zeros_like(row))
        resident = retained
        if st.offload:
            st.store.put(slice(layer, layer + 1), keys[heads, retained][None], values[heads, retained][None],
                         positions[heads, retained][None])
            resident = retained[:, : st.cache]
            self._sets.hold_first(layer, st.row, resident.shape[1])
        own = torch.arange(n, device=keys.device)[None].expand(keys.shape[0], -1)
        return torch.cat([own[:, : st.n_sink], resident, own[:, n - recent :]], dim=1)

    def finish_prefill(self, seq: Sequence) -> None:
        """Offload on: move the recent window behind the working set (which may be larger than what was retained)."""
        st: SentenceState = seq.method_state
        if st.dense:
            return
        n = len(seq.prompt_ids)
        st.tail_pos = n - min(st.n_recent, n - st.n_sink)  # the tail holds consecutive positions from here on
        if st.offload:
            for layer in range(seq.kv.pool.num_layers):
                move_tail(seq.kv, layer, st.n_sink + min(st.cache, st.retained), st.tail_start)

    # -- decode ---------------------------------------------------------------------------------------------------
    def step_plan(self, batch: DecodeBatch) -> "SentencePlan | None":
        """Each row's place in the device state and budget split (`SentencePlan`); a row that keeps
        everything reads as row 0 with an unbounded recent window. None when every row keeps everything
        (eager steps only: a graphed step always takes a plan). The last plan again while its values hold (without
        query="mean" they change only when tokens join the buckets, one step in `offload_chunk`): no copy to the
        device, and none into a graph's buffers. Resident rows' waiting tokens join their buckets here (offloading
        rows' at `end_step`, which moves their slots), so the plan needs nothing of the last step's end
        (`plans_ahead`)."""
        states: list[SentenceState] = [s.method_state for s in batch.seqs]
        if all(st.dense for st in states) and not self.graph_safe:
            return None
        resident = [seq for seq, st in zip(batch.seqs, states) if not st.offload and not st.dense]
        if resident:  # their waiting tokens join before the first step that could attend to them: the step's own
            # slot is the only one not written, and the sentences of those tokens are known one step before
            self._join_waiting(resident, [1] * len(resident))
        mean = self.query == "mean"  # q_count is read on the device only then
        rows = [[0, 0, 0, 0, 0, KEEP_ALL, 0, 0] if st.dense else
                [st.row, st.q_count if mean else 0, st.n_sink, st.retained, st.capacity, st.n_recent,
                 st.retained if st.offload else 0, st.cache]
                for st in states]
        if self._plan is None or self._plan[0] != rows:
            self._plan = rows, SentencePlan.send(batch.pool.staging, rows)  # one copy that does not wait
        return self._plan[1]

    def plan_buffers(self, size: int, max_slots: int, device: torch.device) -> "SentencePlan":
        return SentencePlan.static(size, device)

    def select(self, layer: int, batch: DecodeBatch, q: torch.Tensor) -> Selection | None:
        """Sinks, the chosen buckets' tokens and the recent window of every row, ranked from the device state; with
        offload on, as device slots of the working set, which is made to hold the chosen tokens. q [B, heads, D]."""
        if batch.step_plan is None or self.budget is None:
            return None
        if batch.graphed:  # the widest budget any row may have
            if not isinstance(self.budget, float) and self.budget >= batch.max_slots:  # every row keeps everything
                return None
            width = min(resolve_budget(self.budget, batch.max_slots), batch.max_slots)
        else:
            states: list[SentenceState] = [s.method_state for s in batch.seqs]
            if all(st.dense for st in states):
                return None
            width = min(max(batch.max_slots if st.dense else st.budget for st in states), batch.max_slots)
        plan: SentencePlan = batch.step_plan
        rows, n_sink, retained, capacity = plan.row, plan.n_sink, plan.retained, plan.capacity
        kv_heads = batch.model.num_kv_heads
        query = self._rows.mean_query(layer, rows, q, plan.q_count) if self.query == "mean" else q  # [B, heads, D]
        if self.score == "tokens":
            before, first, place = self._rank_tokens(layer, batch, query, plan)
        else:
            query = query.float().view(q.shape[0], kv_heads, -1, q.shape[-1]).mean(2)  # [B, kv_heads, D] a group's
            before, first, place = self._rows.rank(layer, rows, query, capacity)  # [B, kv_heads, buckets] each
        if layer == 0:  # every layer holds as many slots (each retains as many tokens): once a step
            n = batch.num_slots[:, 0] - plan.cache + plan.offloaded  # [B] virtual slots (the resident layout)
            self._ends = n, torch.minimum(plan.n_recent, n - n_sink - retained).clamp(min=1)  # and attended recent
        n, tail = self._ends
        selection = Selection(*sentencekv_kernels.sentence_slots(self._rows.bucket[layer], rows, before, first, place,
                                                                 n, n_sink, retained, capacity, tail, self.n_sink,
                                                                 width))
        if self._sets is None:
            return selection
        return self._sets.load(layer, batch, selection, rows, n_sink, plan.offloaded, plan.cache)

    def _rank_tokens(self, layer: int, batch: DecodeBatch, query: torch.Tensor,
                     plan: SentencePlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """score="tokens": what the capacity takes of the buckets ranked by their best retained token for each KV
        group's query (the mean of its heads of query [B, heads, D], taken in `kernels.bucket_best`) ->
        `kernels.bucket_take`. Retained token t of a row is its slot n_sink + t (K/V resident)."""
        rows = self._rows
        best = sentencekv_kernels.bucket_best(query, batch.pool.k, batch.tables[:, layer], rows.bucket[layer],
                                              plan.row, plan.n_sink, plan.retained, rows.count.shape[-1])
        return rows.rank_best(layer, plan.row, best, plan.capacity)

    def end_step(self, seqs: list[Sequence], logits: torch.Tensor, tokens: list[int]) -> None:
        """Start a new generated bucket after a sentence end (the mean query starts again); with offload, the tokens
        that left the recent window join their buckets and move to the host once `offload_chunk` of them wait, those
        of every row at once (resident, they join at the next step's plan: `step_plan`)."""
        self._ends = ()  # the step's tensors go with it (a graph keeps its own copy)
        for seq, token in zip(seqs, tokens):
            st: SentenceState = seq.method_state
            if st.dense:
                continue
            next_pos = seq.num_computed
            ended = False
            if self.buckets == "sentences":  # does the token before `token` end a sentence of the open bucket
                if st.scan is None:
                    st.scan = self.rule.scan()
                    for t in seq.output_ids[st.starts[-1] - len(seq.prompt_ids) : next_pos - len(seq.prompt_ids)]:
                        st.scan.push(t)  # the open bucket's tokens before `token` (its first; a recomputed
                        # request's output holds later ones too)
                ended = st.scan.push(token)
            if ended or next_pos - st.starts[-1] >= st.limit:
                st.starts.append(next_pos)
                st.scan = None  # the new bucket starts with `token`, pushed at the next step
                st.q_count = 0
            else:
                st.q_count += 1
        offloading = [seq for seq in seqs if seq.method_state.offload]
        if offloading:
            self._join_waiting(offloading, [seq.slot_ready for seq in offloading])  # a slot prepared for the next
            # step is not written yet
            counts = self._sets.counts([seq.method_state.row for seq in offloading])  # their traffic, each step
            vector_bytes = self._rows.row_bytes()  # (the largest step's bytes are a statistic)
            for seq, found_loaded in zip(offloading, counts):
                self._record(seq, vector_bytes, found_loaded)

    def _join_waiting(self, seqs: list[Sequence], unwritten: list[int]) -> None:
        """Rows whose tokens past the recent window (between it and the retained ones: attended by no step) number
        `offload_chunk` or more: the oldest of them, whole multiples of it, join their buckets. unwritten: each
        sequence's slots not yet written (the step's own at its plan, a slot prepared ahead at its end). Rows that
        keep some tokens only."""
        leaving = []  # (sequence, state, tokens that leave its recent window now)
        for seq, ahead in zip(seqs, unwritten):
            st: SentenceState = seq.method_state
            waiting = seq.kv.num_slots[0] - ahead - st.tail_start - st.n_recent
            if waiting >= self.offload_chunk:
                leaving.append((seq, st, waiting - waiting % self.offload_chunk))
        for m in sorted({m for _, _, m in leaving}):
            self._join_buckets([(seq, st) for seq, st, size in leaving if size == m], m, seqs[0].kv.pool)

    def _join_buckets(self, group: list[tuple[Sequence, SentenceState]], m: int, pool: KVPool) -> None:
        """The m oldest tokens of the recent window of each of these rows join their buckets, every layer at once
        (and with offload go to the host: their pages, which start where the working set ends, leave the page
        table). The buckets are decided on the host (the tail holds consecutive positions; only the buckets that
        start inside it are looked at) and reach the device with the rows and places in one copy that does not
        wait; one scatter updates every row's counts, map and vectors."""
        needs = [self.row_needs(seq, st.row, m) for seq, st in group]
        self.ensure_rows(tuple(map(max, zip(*needs))), pool)
        first = np.array([bisect.bisect_right(st.starts, st.tail_pos) - 1 for _, st in group])  # [R] bucket of each
        # tail's first token, and the starts of the later buckets inside the tail (padded past it)
        later = [st.starts[j + 1 : bisect.bisect_left(st.starts, st.tail_pos + m, j + 1)] for (_, st), j in
                 zip(group, first.tolist())]
        inside = np.full((len(group), max(map(len, later), default=0)), np.iinfo(np.int64).max)
        for r, starts in enumerate(later):
            inside[r, : len(starts)] = starts
        positions = np.array([st.tail_pos for _, st in group])[:, None] + np.arange(m)  # [R, m]
        bucket = first[:, None] + (inside[:, None, :] <= positions[:, :, None]).sum(-1)  # [R, m]
        sent = pool.staging.send(np.concatenate([np.array([[st.row, st.retained, st.tail_start] for _, st in group]),
                                                 bucket], 1))  # [R, 3 + m]
        rows, at, start, bucket = sent[:, 0], sent[:, 1], sent[:, 2], sent[:, 3:]
        k = v = pos = None
        if self._rows.vectors is not None or any(st.offload for _, st in group):  # [L, R, kv_heads, m, D] x 2, ...
            k, v, pos = slot_ranges([seq.kv for seq, _ in group], start, m)
        layers, heads = pool.num_layers, pool.num_kv_heads
        self._rows.add(rows, slice(None), k, bucket[None, :, None].expand(layers, -1, heads, -1), at)
        for r, (seq, st) in enumerate(group):
            if st.offload:
                st.device_peak = max(st.device_peak, seq.kv.num_slots[0] - seq.slot_ready)
                st.store.put(slice(None), k[:, r], v[:, r], pos[:, r])
                seq.kv.drop_pages(st.tail_start // pool.page_size, m // pool.page_size)
            st.retained += m
            st.tail_pos += m

    def release(self, seq: Sequence) -> None:
        """The request's statistics are final (a row that keeps everything records none), then its row is free."""
        st: SentenceState | None = seq.method_state
        if st is not None and not st.dense and self._rows is not None:
            self._record(seq, self._rows.row_bytes())
        self._plan = None  # the batch changes; nothing of a request is kept past it
        super().release(seq)

    @staticmethod
    def _record(seq: Sequence, vector_bytes: int, counts: tuple[int, int] | None = None) -> None:
        """The request's statistics; counts: an offloading request's (found, loaded) chosen tokens so far, read this
        step (None: its traffic stays as last recorded)."""
        st: SentenceState = seq.method_state
        stats = seq.stats
        if counts is not None:
            before = stats.h2d_bytes
            record_traffic(seq, *counts)
            st.h2d_step_max = max(st.h2d_step_max, stats.h2d_bytes - before)
        if st.store is not None:
            stats.d2h_bytes = st.store.d2h_bytes
        stats.extra.update(
            sentences=len(st.starts), offload=st.offload, h2d_bytes_step_max=st.h2d_step_max,
            kv_device_peak=max(st.device_peak, max(seq.kv.num_slots)),
            sentence_vector_bytes=vector_bytes)
