"""TokenSelect: token-level KV selection by a head soft vote (Wu et al., 2024, "TokenSelect: Efficient Long-Context
Inference and Length Extrapolation for LLMs via Dynamic Token-Level KV Cache Selection",
https://arxiv.org/abs/2411.02886).

Every query head scores each cached token of its KV group by `q_h . k`; the scores are softmax-normalised per head
and summed over the heads (the head soft vote, Eq. 7), and attention covers the initial tokens, the top-k voted
tokens and the most recent ones. Prompts are selected chunk by chunk with the chunk's mean query, and during decoding
a Selection Cache (Algorithm 1) reuses a layer's last selection while consecutive queries stay similar.

Readings of the paper (each a parameter where it matters):
- Eq. 7 sums over all H heads of a layer, so one token set serves the whole layer (`scope="layer"`, as the authors'
  code does); `scope="kv_head"` votes within each KV group instead. The softmax runs over the candidate tokens (not
  the initial or recent ones, which are always attended) on raw logits `q . k`, as Eq. 7 writes (no 1/sqrt(d)).
- Budget split: `budget` = initial + k + recent attended slots per layer and decode step. The paper's setting,
  128 + 2048 + 512, is `budget=2688`; a small budget shrinks the initial tokens to at most budget // 8 and the recent
  window to at most budget // 4 (at least 1: the current token) and k takes the rest.
- Prefill runs in chunks of at most `chunk` tokens (the paper's 512; the engine's chunk when shorter): a chunk
  attends to itself causally plus `budget` earlier slots: initial, top-k by the chunk's mean query, and the recent
  tokens just before the chunk. While the budget covers every earlier token the chunk attends to all of them, so
  prefill then equals Full KV exactly. `prefill="full"` (opt-in, exact mode) prefills with full attention in the
  engine's chunks and selects at decode only: the prompt's last token, whose logits give the first answer token,
  then sees the whole prompt.
- The Selection Cache (decode only, as Algorithm 1) keys on the query flattened over heads, per sequence and layer;
  a hit reuses the top-k slots and refreshes the initial and recent ones. Hit counts go to `stats.extra`. In exact
  mode (an int or a fractional budget) it lives on the device (`kernels.token_select`, one cache row per running
  sequence, named by the step plan), so the whole decode step is captured in a CUDA graph and the scoring kernels
  skip the rows that hit; an entry is reused only under the budget it was selected with (a fractional budget grows
  with the context: at 0.1 it is selected anew at least every 10 tokens). Extrapolation keeps it per sequence on
  the host.
- Exact mode (default) scores post-RoPE keys with post-RoPE queries. `extrapolate=True` stores keys before RoPE,
  scores without positions, and rotates the attended keys by their rank (`KVMethod.rope_by_rank`), so the model sees
  positions below budget + chunk however long the input: keep that under the model's context.

Parameters
----------
budget: attended slots per layer (and KV head) in a decode step, initial and recent included; an int, or a float
    fraction of the current context (exact mode only).
n_sink: initial tokens always attended, 128 (paper Sec. 6.1 and the authors' configs, `n_init`).
n_recent: most recent tokens always attended, 512 (paper Sec. 6.1, `n_local`).
selection: "soft_vote" (Eq. 7, the paper's method), "hard_vote" (Eq. 6: each head's top-k, counted; ties broken by
    the soft vote) or "top_k" (Eq. 5: top-k of the logits summed over heads), the ablations of Table 4.
scope: "layer" (Eq. 7, one token set per layer) or "kv_head" (one set per KV group).
theta: Selection Cache threshold on the cosine similarity of consecutive queries, 0.9 (paper Sec. 6.1), in
    [-1, 1]; 1.0 practically disables the cache, -1 reuses each layer's first decode selection (every lookup hits:
    the bound `semkv bench` measures the cache against). At 0.9 a selection reused while a long value is copied can
    lack its next tokens (RULER NIAH at 10% 3-5 points under Full KV); 0.95 keeps Full KV's score, with fewer hits
    (benchmarks/results/2026-12-01-h200-tokenselect-cache.md).
extrapolate: store keys before RoPE and rotate the attended ones by rank (the paper's length-extrapolation setting).
chunk: the longest prefill chunk, 512 (paper Sec. 6.1); each chunk selects its own context.
prefill: "sparse" (the paper: each chunk attends to its budget of earlier tokens) or "full" (full attention at
    prefill, selection in decoding only; not with `extrapolate`).
score_keys: the keys a decode step scores every candidate with: "exact" (the cache's), "int8" (opt-in, issue 55:
    an int8 sketch of the keys kept by page beside the pool, `state.key_sketch`, read at D + 4 bytes a key instead of
    2D; the voted tokens are attended with their exact keys; the sketch costs (D + 4) / 4D of the K/V's memory, 27%
    at head_dim 64) or "pages" (opt-in, issue 55: two stages. Quest's bound of each KV page's best logit from the
    min / max of its keys, `state.page_summaries`, read at 4D bytes a page of `page_size` keys, picks the pages
    holding about `superset` times k candidates; the soft vote then scores those pages' keys exactly and picks the
    top-k among them, attended with their exact keys. A decode step reads 2 / page_size of the keys' bytes for the
    bounds and superset x k exact keys instead of every key; the summaries cost 1 / page_size of the K/V's memory,
    6% at 16 tokens a page). Not with `extrapolate`.
superset: score_keys="pages": the pages scored exactly hold about this many times the top-k's tokens (at least 1;
    4 by default, a third of the candidates at a budget of 10%).
reuse_layers: N, 1 = off (the paper). Opt-in (issue 55): a decode step selects in the first layer of each group of N
    layers only, and the group's other layers attend to the same slots (ChunkKV's layer-wise index reuse, Liu et
    al., 2025, applied to the decode step's selection as TidalDecode, Yang et al., 2024, reuses token selections
    across layers): the selection's cost a step is divided by N. The cache's tokens are the same in every layer,
    so slots carry over; with scope="kv_head" a KV head takes the set of the same-numbered head of the group's
    first layer. Decode only (a sparse prefill selects in every layer). Measured on an H200 at N = 3
    (benchmarks/results/2026-12-03-h200-layer-reuse.md): 1.25x Full KV's tokens/s at 16 x 31k rows and 1.63x on
    the Llama-3.1-8B shape, but RULER NIAH 15 points under Full KV at 8k (look-alike keys lost; N = 2 alike): a
    measured option, not a recommendation.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from semkv.engine.hooks import DecodeBatch, KVMethod, Selection, StepPlan, budget_tokens, resolve_budget
from semkv.engine.kv_cache import KVPool
from semkv.engine.sequence import Sequence
from semkv.engine.staging import copy_early
from semkv.errors import SemkvError, check_choice, check_range
from semkv.kernels.reference import physical_rows
from semkv.methods.state.key_sketch import KeySketch
from semkv.methods.state.page_summaries import PageSummaries
from semkv.methods.tokenselect import kernels as tokenselect_kernels
from semkv.methods.tokenselect.reference import SelectionCacheBuffers, split_parts
from semkv.models.parallel import cosine

SELECTIONS = ("soft_vote", "hard_vote", "top_k")


@dataclass
class CacheRows(StepPlan):
    """TokenSelect's step plan: each sequence's row in the device Selection Cache."""

    cache_row: torch.Tensor  # [B]


@dataclass
class TokenSelect(KVMethod):
    n_sink: int = 128
    n_recent: int = 512
    selection: str = "soft_vote"
    scope: str = "layer"
    theta: float = 0.9
    extrapolate: bool = False
    chunk: int = 512
    prefill: str = "sparse"
    score_keys: str = "exact"
    superset: float = 4.0
    reuse_layers: int = 1

    kind = "selection"
    name = "tokenselect"
    summary = "TokenSelect: per-head q.k criticality, head soft vote, top tokens + sinks + recent; Selection Cache"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("n_sink", self.n_sink, 0, None, int)
        check_range("n_recent", self.n_recent, 1, None, int)
        check_range("theta", self.theta, -1.0, 1.0)
        check_range("extrapolate", self.extrapolate, types=bool)
        check_range("chunk", self.chunk, 1, None, int)
        check_choice("selection", self.selection, SELECTIONS)
        check_choice("scope", self.scope, ("layer", "kv_head"))
        check_choice("prefill", self.prefill, ("sparse", "full"))
        check_choice("score_keys", self.score_keys, ("exact", "int8", "pages"))
        check_range("superset", self.superset, 1.0, None)
        check_range("reuse_layers", self.reuse_layers, 1, None, int)
        if self.extrapolate and self.score_keys != "exact":
            raise SemkvError(f"score_keys={self.score_keys!r} cannot be used with extrapolate=True (it scores the "
                             f"keys after RoPE); use score_keys='exact'")
        if self.extrapolate and self.prefill == "full":
            raise SemkvError("prefill='full' cannot be used with extrapolate=True: a full prefill gives every prompt "
                             "token its position, so the prompt must fit the model's context; use prefill='sparse'")
        if self.extrapolate and self.budget is not None and not isinstance(self.budget, int):
            raise SemkvError(f"budget={self.budget!r}: extrapolate=True needs an int budget (a fixed attended length)")

    @property
    def extrapolates(self) -> bool:
        """Read by `LLM.generate`: prompts longer than the model's context are allowed in extrapolation mode."""
        return self.extrapolate

    def rope_by_rank(self) -> bool:
        return self.extrapolate

    def prefill_chunk(self) -> int | None:
        return self.chunk if self.prefill == "sparse" else None

    @property
    def graph_safe(self) -> bool:
        """In exact mode every row of a step is selected by tensor operations alone, each row's budget and the
        Selection Cache included (`select_batched`), which CUDA graphs capture."""
        return not self.extrapolate

    @property
    def plans_ahead(self) -> bool:
        """Batched (exact mode): the plan is the rows of the Selection Cache, the key sketch of the last step's slot
        is made with it, and `end_step` only copies the cache's counts to the statistics without waiting."""
        return self.graph_safe

    def bind(self, model, tokenizer, page_size: int) -> None:
        super().bind(model, tokenizer, page_size)
        if self.extrapolate and self.budget is not None and self.budget >= model.max_position_embeddings:
            raise SemkvError(f"budget={self.budget} must be below the model's context of "
                             f"{model.max_position_embeddings} tokens for extrapolation")

    def reset(self) -> None:
        # the device Selection Cache, id(seq) -> (seq, its row in it), (sequences, plan) of the last step and
        # (batch, each row's split of its budget [B, 3]) of the current step
        self._cache: SelectionCacheBuffers | None = None
        self._rows: dict[int, tuple[Sequence, int]] = {}
        self._plan: tuple[list[Sequence], CacheRows] | None = None
        self._parts: tuple[DecodeBatch, torch.Tensor] | None = None
        self._sketch = KeySketch() if self.score_keys == "int8" else None
        self._summaries = PageSummaries(("min", "max")) if self.score_keys == "pages" else None
        # the Selection Cache's counts on their way to the host (`_count`): the sequences, the host copy, its event
        self._counting: tuple[list[Sequence], torch.Tensor, torch.cuda.Event | None] | None = None
        # reuse_layers > 1: (batch, the selection of the current group's first layer) of the step under way
        self._reused: tuple[DecodeBatch, Selection | None] | None = None

    def release(self, seq: Sequence) -> None:
        self._count()  # its last counts, if copied already (the statistics may be a step or so behind on a GPU)
        self._rows.pop(id(seq), None)
        self._plan = self._parts = self._reused = None

    def new_state(self, seq: Sequence) -> list:
        """Selection Cache per layer: (query [heads * D], top-k slots [S, k]) of the last selection, or None."""
        seq.stats.extra.update(selection_cache_hits=0, selection_cache_lookups=0, selection_cache_hit_rate=0.0)
        return [None] * seq.kv.pool.num_layers

    def split(self, budget: int) -> tuple[int, int, int]:
        """(initial, k, recent) attended slots that make up `budget` (`split_parts`, the one rule, on the host)."""
        sink, k, recent = split_parts(torch.tensor([budget]), self.n_sink, self.n_recent)[0].tolist()
        return sink, k, recent

    def top_slots(self, layer: int, seq: Sequence, q: torch.Tensor, lo: int, hi: int, k: int) -> torch.Tensor:
        """The k voted slots among candidates [lo, hi) for the query q [heads, D]: [S, k]."""
        kv = seq.kv
        kv_heads = kv.pool.num_kv_heads if self.scope == "kv_head" else None
        return tokenselect_kernels.top_slots(q, kv.pool.k, kv.table[layer], lo, hi, k, self.selection, kv_heads,
                                             self.tp)

    @property
    def _by_page(self) -> "KeySketch | PageSummaries | None":
        """The state kept by KV page: the int8 sketch or the page summaries (score_keys), or None."""
        return self._sketch if self._sketch is not None else self._summaries

    def admission_bytes(self, seq: Sequence) -> int:
        return 0 if self._by_page is None else self._by_page.growth_bytes(seq.kv.pool)

    def page_state_bytes(self, pool: KVPool) -> int:
        return 0 if self._by_page is None else self._by_page.bytes_per_page(pool)

    def batch_state_bytes(self, seq: Sequence, batch: int) -> int:
        return 0  # the key sketch is kept by page (`page_state_bytes`)

    def _sketch_rows(self, pool: KVPool, rows: torch.Tensor) -> None:
        """Sketch the keys at flat pool rows `rows` [n] (the sketch grown with the pool first: a move makes captured
        graphs be captured again)."""
        if self._sketch.ensure(pool):
            self.graph_epoch += 1
        self._sketch.write(pool, rows)

    # -- prefill --------------------------------------------------------------------------------------------------
    def finish_prefill(self, seq: Sequence) -> None:
        """score_keys="int8": sketch every slot the prefill stored (the same count in every layer), from the
        device's page table; "pages": summarise every page of every layer that selects (`reuse_layers`)."""
        if self._summaries is not None:
            for layer in range(0, seq.kv.pool.num_layers, self.reuse_layers):
                self._summaries.build(seq.kv, layer)
        if self._sketch is None:
            return
        kv, n = seq.kv, seq.kv.num_slots[0]
        slots = torch.arange(n, device=kv.table.device).expand(kv.table.shape[0], -1)  # [layers, n]
        self._sketch_rows(kv.pool, physical_rows(kv.table, slots, kv.pool.page_size).flatten())

    def prefill_context(self, layer: int, seq: Sequence, q: torch.Tensor, start: int) -> torch.Tensor | None:
        budget = resolve_budget(self.budget, seq.num_computed)
        if self.prefill == "full" or budget >= start:
            return None
        sink, k, recent = self.split(budget)
        kv_heads = seq.kv.pool.num_kv_heads if self.scope == "kv_head" else None
        return tokenselect_kernels.prefill_context(q.mean(0), seq.kv.pool.k, seq.kv.table[layer], sink,
                                                   start - recent, start, k, self.selection, kv_heads, self.tp)

    # -- decode ---------------------------------------------------------------------------------------------------
    def select(self, layer: int, batch: DecodeBatch, q: torch.Tensor) -> Selection | None:
        if layer % self.reuse_layers and self._reused is not None and self._reused[0] is batch:
            return self._reused[1]  # the group's first layer selected this step's slots
        if self.graph_safe:
            selection = self.select_batched(layer, batch, q)
        else:
            selection = self.select_per_sequence(layer, batch, q)
        if self.reuse_layers > 1:
            self._reused = batch, selection
        return selection

    def select_per_sequence(self, layer: int, batch: DecodeBatch, q: torch.Tensor) -> Selection | None:
        """Row by row, with per-sequence budgets (fractions) and the Selection Cache."""
        n_slots = [seq.kv.num_slots[layer] for seq in batch.seqs]  # host copies: no device read
        budgets = [resolve_budget(self.budget, s.num_computed + 1) for s in batch.seqs]
        if all(b >= n for b, n in zip(budgets, n_slots)):
            return None
        groups = batch.model.num_kv_heads if self.scope == "kv_head" else 1
        mask = torch.zeros(batch.size, groups, max(n_slots), dtype=torch.bool, device=q.device)  # [B, S, n]
        for b, seq in enumerate(batch.seqs):
            n = n_slots[b]
            if budgets[b] >= n:
                mask[b, :, :n] = True
                continue
            sink, k, recent = self.split(budgets[b])
            mask[b, :, :sink] = True
            mask[b, :, n - recent : n] = True
            mask[b].scatter_(-1, self.cached_top(layer, seq, q[b], sink, n - recent, k), True)
        return Selection.from_mask(mask)

    def select_batched(self, layer: int, batch: DecodeBatch, q: torch.Tensor) -> Selection | None:
        """Every row at once, without reading device values (`kernels.token_select`, the Selection Cache on the
        device): the initial slots, the voted top-k among [initial, n - recent) and the recent ones where n > the
        row's budget (a fraction resolved per row on the device), else all n slots. q [B, heads, D]; the step plan
        holds each row's cache row."""
        width = batch.max_slots
        out_width = resolve_budget(self.budget, width)  # every row's budget is at most this
        n = batch.num_slots[:, layer]  # [B] (every layer stores every token)
        if out_width >= width:
            if self._summaries is not None:  # the summaries still take the current key
                self._summaries.add_tokens(batch.pool, batch.tables[:, layer], (n - 1)[:, None].expand(
                    -1, batch.pool.num_kv_heads))
            return None
        if layer == 0 or self._parts is None or self._parts[0] is not batch:  # once a step (a capture), on the device
            self._parts = batch, split_parts(budget_tokens(self.budget, n), self.n_sink, self.n_recent)
        parts = self._parts[1]  # [B, 3]
        kv_heads = batch.model.num_kv_heads if self.scope == "kv_head" else None
        sketch = self._sketch
        keys, scales = (batch.pool.k, None) if sketch is None else (sketch.keys.data, sketch.scales.data)
        tables, scored, pages = batch.tables[:, layer], width, None
        if self._summaries is not None:
            tables, scored, pages = self.candidate_pages(layer, batch, q, n, parts, out_width)
        slots = tokenselect_kernels.token_select(q, keys, tables, n, scored, batch.step_plan.cache_row, self._cache,
                                                 layer, parts, out_width, self.theta, self.selection, kv_heads,
                                                 self.tp, scales, pages)  # [B, S, out_width]
        return Selection(slots, torch.minimum(n, parts.sum(1))[:, None].expand(-1, slots.shape[1]))

    def candidate_pages(self, layer: int, batch: DecodeBatch, q: torch.Tensor, n: torch.Tensor, parts: torch.Tensor,
                        out_width: int) -> tuple[torch.Tensor, int, tuple[torch.Tensor, torch.Tensor]]:
        """score_keys="pages", the first stage: each row's pages with the highest bound (the maximum over its heads)
        that hold about `superset` times the widest top-k (`PageSummaries.best_pages`). Returns their physical ids
        [B, count], the width count * page_size of their compact slots, and (pages, span) for `token_select`."""
        self._summaries.ensure(batch.pool)
        k = self.split(out_width)[1]
        compact, pages, span = self._summaries.best_pages(batch, layer, q, n, parts[:, 0], n - parts[:, 2],
                                                          int(self.superset * k), "max", self.tp)
        return compact, pages.shape[1] * batch.pool.page_size, (pages, span)

    def step_plan(self, batch: DecodeBatch) -> "CacheRows | None":
        """Each sequence's row in the device Selection Cache ([B]; the same object while the batch is the same
        sequences). Rows of sequences that left the batch are freed; a new sequence gets an empty row. Growing the
        cache moves it, so captured graphs are captured again (`graph_epoch`)."""
        if not self.graph_safe:
            return None
        seqs, device = batch.seqs, batch.pool.k.device
        if self._sketch is not None:  # the slot each layer stored at the last step (the one before this step's own):
            # it leaves the recent window, attended exactly, before it is scored from the sketch
            pool, size = batch.pool, batch.pool.page_size
            newest = [seq.kv.num_slots[0] - 2 for seq in seqs]
            self._sketch_rows(pool, pool.staging.send(np.concatenate([seq.kv.pages[:, t // size] * size + t % size
                                                                      for seq, t in zip(seqs, newest)])))
        # the widest top-k these requests will take: a fractional budget's k grows with the context, and a cache
        # grown mid-run is a graph captured again (on an H200 a 182 ms step, three steps into a 16-row batch)
        last = max(len(s.prompt_ids) + s.params.max_new_tokens for s in seqs)
        k = self.split(resolve_budget(self.budget, last))[1]
        if self._plan is not None and len(self._plan[0]) == len(seqs) and all(
                a is b for a, b in zip(self._plan[0], seqs)):
            self._ensure_cache(1, k, device)
            return self._plan[1]
        live = {id(s) for s in seqs}
        for key in [key for key in self._rows if key not in live]:
            del self._rows[key]
        taken = {row for _, row in self._rows.values()}
        free = (row for row in range(1, len(seqs) + len(taken) + 1) if row not in taken)  # row 0: padding
        fresh = [(s, next(free)) for s in seqs if id(s) not in self._rows]
        self._rows.update((id(s), (s, row)) for s, row in fresh)
        self._ensure_cache(max(row for _, row in self._rows.values()) + 1, k, device)
        for _, row in fresh:
            self._cache.valid[row] = 0
            self._cache.counts[row] = 0
        plan = CacheRows(torch.tensor([self._rows[id(s)][1] for s in seqs], device=device))
        self._plan = (list(seqs), plan)
        return plan

    def _ensure_cache(self, rows: int, k: int, device: torch.device) -> None:
        """A Selection Cache of at least `rows` rows and top-k width `k`, grown geometrically (a fractional budget's k
        grows with the context); growing moves it, so captured graphs are captured again (`graph_epoch`)."""
        old = self._cache
        if old is not None and old.q.shape[0] >= rows and old.top.shape[-1] >= k:
            return
        model = self.model
        sets = model.num_kv_heads if self.scope == "kv_head" else 1
        old_rows, old_k = (0, 0) if old is None else (old.q.shape[0], old.top.shape[-1])
        new_rows = old_rows if old_rows >= rows else max(2 * rows, 8)
        new_k = old_k if old_k >= k else max(k, 2 * old_k)
        self._cache = SelectionCacheBuffers.allocate(new_rows, model.num_layers, model.num_heads * model.head_dim,
                                                     sets, new_k, device)
        if old is not None:
            for name in ("q", "valid", "counts"):
                getattr(self._cache, name)[:old_rows] = getattr(old, name)
            self._cache.top[:old_rows, ..., :old_k] = old.top
        self.graph_epoch += 1

    def plan_buffers(self, size: int, max_slots: int, device: torch.device) -> "CacheRows":
        return CacheRows.static(size, device)

    def end_step(self, seqs: list[Sequence], logits: torch.Tensor, tokens: list[int]) -> None:
        """Hit counts of the device Selection Cache into each sequence's statistics, without waiting for the device:
        those of the last copy that is done (on a GPU a step or so behind), and a new copy."""
        if self._cache is None or not self.graph_safe:
            return
        self._count()
        if self._counting is None:  # else an earlier copy is under way
            self._counting = list(seqs), *copy_early(self._cache.counts)  # [rows, 2]
            self._count()  # off CUDA: the counts themselves, read now

    def _count(self) -> None:
        """The copied counts into the statistics of the sequences still in the cache, once the copy is done."""
        if self._counting is None or (self._counting[2] is not None and not self._counting[2].query()):
            return
        seqs, host, _ = self._counting
        self._counting = None
        counts = host.tolist()  # one read: indexing the tensor a row at a time cost ~5 us a sequence on the host
        for seq in seqs:
            if id(seq) in self._rows:
                hits, lookups = counts[self._rows[id(seq)][1]]
                seq.stats.extra.update(selection_cache_hits=hits, selection_cache_lookups=lookups,
                                       selection_cache_hit_rate=hits / max(lookups, 1))

    def cached_top(self, layer: int, seq: Sequence, q: torch.Tensor, lo: int, hi: int, k: int) -> torch.Tensor:
        """Algorithm 1: reuse the layer's last top-k while cos(q, cached q) >= theta, else select anew."""
        flat = q.flatten().float()
        cache = seq.method_state[layer]
        extra = seq.stats.extra
        extra["selection_cache_lookups"] += 1
        if cache is not None and cosine(self.tp, flat, cache[0], dim=0) >= self.theta:  # every rank's heads
            extra["selection_cache_hits"] += 1
            top = cache[1]
        else:
            top = self.top_slots(layer, seq, q, lo, hi, k)
            seq.method_state[layer] = (flat, top)
        extra["selection_cache_hit_rate"] = extra["selection_cache_hits"] / extra["selection_cache_lookups"]
        return top
