"""DynSplit-KV (Ye et al., 2026, "DynSplit-KV: Dynamic Semantic Splitting for KVCache Compression in Efficient
Long-Context LLM Inference", https://arxiv.org/abs/2602.03184).

The cache is cut into variable-length semantic chunks by DD-Select: each chunk ends near `chunk_size` tokens, at the
delimiter that best trades its importance weight (measured per model by attention dependency, Algorithm 1) against
closeness to the ideal length. V2F keeps the element-wise min and max of each chunk's keys, bounds the current
query's attention to the chunk by `sum_d max(q_d * max_d, q_d * min_d)`, gives that bound to every token of the
chunk and lets each KV head attend to its top `budget` tokens, chosen in one fixed-shape sort.

The method class is `DynSplitKV`; its helpers beside it are `split.py` (delimiters, Algorithm 1, DD-Select), `v2f.py`
(chunk summaries, scores, selection, per-sequence state), `rows.py` (the batched device state) and `kernels.py`
(Triton kernels, torch references in `reference.py`).

With K/V resident and min/max pooling, decoding is batched and captured in CUDA graphs: every sequence's chunk
summaries and chunk starts live in device rows (`DynSplitRows`); the prompt is split on the host at the end of
prefill, and each decode step goes on with DD-Select on the device for every row at once, at layer 0 inside the step
(`_split_step`: the new token's delimiter weight, and the chunk it closes once its search range is complete, as
`split.dd_select` closes it); each layer refreshes the summaries of the chunks the
new token touched (`kernels.chunk_refresh`, from the last chunk_size + max_deviation + 1 keys), bounds every chunk
with `kernels.page_bound` (a chunk read as a page of one slot), finds what the budget takes of the ranked chunks
(`kernels.bucket_take`, without sorting them) and writes the slot lists with `kernels.chunk_slots` (each chunk's
leading slots, placed after those the chunks before it take): the same selection as V2F's token sort (whole chunks
by score, ties to the earlier chunk, the last one cut to its leading tokens). With `count_reuse`, reuse is counted
on the device from per-slot stamps (`kernels.slot_stamps`). Mean pooling keeps a per-sequence path.
With score="tokens" (opt-in) a layer scores each chunk by its best token instead (`kernels.chunk_best`: the query's
dot products with every key between the sinks and the recent window, read in place, a max per chunk; no summaries
are kept), then the same ranking and slot lists. With score_keys="channels" too (opt-in, issue 55) the tokens are
scored from a few channels of each key (`state/key_channels.py`: Double Sparsity's label channels, chosen for each
request, layer and KV head from the prompt's last queries at the end of prefill), kept by page beside the pool; the
chosen chunks are attended with their exact keys.

Offload (the paper's CPU-GPU setting, min/max pooling): the same selection runs over virtual slots (every token in
position order, as resident), and `WorkingSets.load` makes it device slots. On the device a sequence keeps its
`n_sink` sinks, a working set of as many slots as it attends at most, and its tail: the newest tokens, at least
chunk_size + max_deviation + 1 of them (the chunk summaries are refreshed from them) and the recent window. The
tokens in between live in pinned host memory; the working set holds the selected ones, and only those it did not
hold yet are read from the host, in the same kernel (KV reuse across steps: the paper's Appendix B.2). Tokens leaving
the tail go to the host `offload_chunk` at a time, between steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from semkv import kernels
from semkv.engine.hooks import DecodeBatch, KVMethod, Selection, StepPlan, budget_tokens, resolve_budget
from semkv.engine.kv_cache import KVPool, SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.engine.staging import copy_early
from semkv.errors import SemkvError, check_choice, check_range
from semkv.kernels import use_triton
from semkv.kernels.reference import physical_rows
from semkv.methods import calibration
from semkv.methods.dynsplit import kernels as dynsplit_kernels
from semkv.methods.dynsplit.rows import DynSplitRows
from semkv.methods.dynsplit.split import (DEFAULT_DELIMITERS, AttentionDependency, arrange_weights, dd_select,
                                          delimiter_candidates, normalise, table7_weight)
from semkv.methods.dynsplit.v2f import DynSplitState, block_scores, block_summaries, v2f_select
from semkv.methods.state import key_channels
from semkv.methods.state.rows import RowHolder
from semkv.methods.state.working_set import WorkingSets, move_tail, record_traffic, slot_range, working_set_slots

MIN_OCCURRENCES = 5  # scored positions a delimiter token needs before its calibrated weight is trusted
CHANNEL_WINDOW = 32  # score_keys="channels": the prompt's last queries the key channels are chosen for
CHOICES = {"split": ("dynamic", "fixed"), "weights": ("calibrated", "table7", "uniform", "reversed"),
           "pooling": ("minmax", "mean"), "group_reduce": ("mean", "max"), "score": ("bound", "tokens"),
           "score_keys": ("exact", "channels", "pages")}


@dataclass
class ChunkPlan(StepPlan):
    """DynSplit-KV's step plan (batched path, packed), [B] a value a row: its state row; with `count_reuse` (K/V
    resident) this step's stamp and 1 at the row's first decode step (no reuse yet), else 0s; with offload on, its
    sinks on the device, offloaded tokens and working-set slots (else 0s). What depends on the step's token count (the
    budget, the split) is made on the device (`SplitStep`): with K/V resident and no `count_reuse` the plan holds while
    the batch does, and the steps may be pipelined (`plans_ahead`)."""

    row: torch.Tensor
    step: torch.Tensor
    first_step: torch.Tensor
    sinks: torch.Tensor
    offloaded: torch.Tensor
    cache: torch.Tensor


@dataclass
class SplitStep:
    """What a step's token count makes on the device, [B] a value a row (`DynSplitKV._split_step`): the tokens each
    row attends (k), of which its sinks and recent tokens; what DD-Select made of the token: the open chunk after it,
    the chunk the token joined (open before it: its start, and the start of the chunk after it or the token count),
    the summary rows `targets` [B, 2] of that chunk and of the chunk the token opened (0: none)."""

    k: torch.Tensor
    n_sink: torch.Tensor
    n_recent: torch.Tensor
    open_chunk: torch.Tensor
    dirty_start: torch.Tensor
    following: torch.Tensor
    targets: torch.Tensor


@dataclass
class DynSplitKV(RowHolder, KVMethod):
    """DynSplit-KV: DD-Select chunks + V2F per-head token selection (Ye et al., 2026, "DynSplit-KV: Dynamic Semantic
    Splitting for KVCache Compression in Efficient Long-Context LLM Inference", https://arxiv.org/abs/2602.03184).

    Parameters
    ----------
    budget: tokens each KV head of each layer attends to per decode step (the current token and `n_recent` included); a
        float is a fraction of the current context.
    chunk_size: C, the base chunk length, 16: the best of {8, 16, 32, 64} on our passkey ablation (the paper gives no C;
        its "window length between the initial end and the current position" of 14 could also be read as C).
    max_deviation: Delta, 14 (the paper's window parameter): a chunk ends within C +- Delta tokens of its start (and
        after at least one token).
    alpha: DD-Select's balance of delimiter weight and closeness to C, 0.5 (the paper gives no value); 1.0 ignores
        closeness, which is our reading of the paper's "without length control" ablation.
    split: "dynamic" (DD-Select) or "fixed" (chunks of exactly C: the "without delimiters" ablation). The min/max bound
        grows with a chunk's length (Spearman 0.6 between length and bound over DD-Select's chunks on Qwen2.5-0.5B,
        about 0 over fixed ones), so variable chunks are ranked by length as well as by the query, and a needle value
        that a delimiter cuts into a short chunk ranks low (benchmarks/results/2026-11-27-h100-baselines.md).
    weights: "calibrated" (`semkv calibrate --method dynsplit` for this model, else the paper's Table 7), "table7",
        "uniform" (all delimiters equal: "without weights") or "reversed" (importance order reversed).
    delimiters: characters that make a token a delimiter candidate, ".!?;:,'\\"()[]{}" and newline (Table 7's set plus
        newline and the code delimiters).
    future_window, overlap, drop_penalty: Algorithm 1's W = 8, R = 128, alpha = 1 (the paper's values).
    document_tokens: 0 (off); > 0 re-estimates the weights of the delimiters seen in the first `document_tokens` prompt
        tokens during prefill (the paper: weights differ across scenarios and converge within a few tokens).
    pooling: "minmax" (the paper's main setting) or "mean" (Appendix A.2: the score is q . mean key).
    score: "bound" (the paper: V2F's chunk summaries, min/max or mean as `pooling` says) or "tokens": a chunk scores
        the best query . key of its tokens, read from the cache every step, so it ranks by its best-matching token
        whatever its length (and is taken from its start, as every chunk). Opt-in: it reads every key each step
        (about half of Full KV's decode bytes) and keeps no summaries; K/V resident, min/max path.
    score_keys: with score="tokens", the keys a step scores tokens with: "exact" (the cache's) or "channels" (opt-in,
        issue 55: `channels` of each key's D channels, kept by page beside the pool, `channels / (2 D)` of the K/V's
        memory (12.5% at 16 of 64); chosen for each request, layer and KV head at the end of prefill, as whole rotary
        pairs, by how much of q . k's variation over the prompt they carry for its last 32 queries). Below the
        quality of exact scores on Qwen2.5-0.5B (RULER NIAH at 10%: 16 channels 8-10 points under Full KV, 8 channels
        30-42; benchmarks/results/2026-11-29-h200-key-channels.md), and its memory does not fit at Full KV's
        largest batch: a measured option, not a recommendation. Or "pages" (opt-in, issue 55, TokenSelect's first
        stage: Quest's bound of every KV page from the min / max of its keys, kept by page beside the pool, 1 /
        page_size of the K/V's memory, keeps the pages holding about `superset` times the budget's tokens, and
        only their tokens are scored, exactly; a chunk scores its best token among them). Measured on an H200
        (benchmarks/results/2026-12-03-h200-pages-quality.md): RULER NIAH 5.8 points under Full KV at 8k and no
        faster than Full KV (0.66x at 16 rows, 0.92x at its largest batch): a measured option, not a recommendation.
    superset: with score_keys="pages", the kept pages hold about this many times the budget's tokens (at least 1).
    reuse_layers: N, 1 = off (the paper). Opt-in (issue 55), with score="tokens": a decode step scores and selects in
        the first layer of each group of N layers only, and the group's other layers attend to the same slots (ChunkKV's
        layer-wise index reuse, Liu et al., 2025, applied to the decode step as TidalDecode, Yang et al., 2024, reuses
        token selections across layers; a KV head takes the set of the same-numbered head of the group's first
        layer): the scoring's cost a step is divided by N. `count_reuse` then counts the selecting layers. At N = 3
        on an H200 (benchmarks/results/2026-12-03-h200-layer-reuse.md) 1.18x Full KV's tokens/s at 16 x 31k rows,
        1.37x on the Llama-3.1-8B shape, but RULER NIAH 17-22 points under Full KV: a measured option.
    channels: with score_keys="channels", the key channels kept, 16 (even, at most head_dim; Double Sparsity keeps
        16 of 128).
    group_reduce: "mean" or "max" over the query heads of a KV group (GQA; the paper does not say; "mean" as Quest):
        of the bounds, or with score="tokens" of the dot products.
    n_sink: first tokens always attended, 0 (the paper names none). n_recent: newest tokens always attended, 16 (one
        Quest page, so the open chunk's latest keys are never dropped); both count in the budget.
    offload: False keeps all K/V on the device; True keeps them in pinned host memory (the paper's CPU-GPU setting):
        the device holds the sinks, a working set of the selected tokens and the newest tokens, so a request's device
        footprint is about its budget, not its context; same tokens as False (min/max pooling only).
    offload_chunk: with offload, tokens leaving the device's tail go to the host, in whole KV pages, once this many
        wait; 16.
    cache_factor: with offload, the device's working set holds this many times the tokens a step selects (>= 1;
        1.0): a token that leaves the selection stays there until its slot is needed (clock order), so a re-selected
        token is found on the device instead of read from host memory again. More device memory, fewer bytes over
        PCIe; the same tokens.
    count_reuse: with K/V resident, count each step's selected tokens that were selected at the previous step too
        (`stats.extra["kv_reused"]` / `["kv_reloaded"]`: the paper's Appendix B.2 reuse rate, what offloading would
        load again); False (the default) spares the decode step that work (per-slot stamps beside the pool and a
        kernel a layer: 29 us a layer, 0.7 ms of an 8.4 ms step at 16 x 31k on an H200). With offload the working
        sets count it anyway.
    """

    chunk_size: int = 16
    max_deviation: int = 14
    alpha: float = 0.5
    split: str = "dynamic"
    weights: str = "calibrated"
    delimiters: str = DEFAULT_DELIMITERS
    future_window: int = 8
    overlap: int = 128
    drop_penalty: float = 1.0
    document_tokens: int = 0
    pooling: str = "minmax"
    score: str = "bound"
    score_keys: str = "exact"
    channels: int = 16
    superset: float = 4.0
    reuse_layers: int = 1
    group_reduce: str = "mean"
    n_sink: int = 0
    n_recent: int = 16
    offload: bool = False
    offload_chunk: int = 16
    cache_factor: float = 1.0
    count_reuse: bool = False

    kind = "selection"
    name = "dynsplit"
    summary = "DynSplit-KV: delimiter-weighted semantic chunks, per-head top tokens by chunk min/max key bounds"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("chunk_size", self.chunk_size, 1, None, int)
        check_range("max_deviation", self.max_deviation, 0, None, int)
        check_range("alpha", self.alpha, 0.0, 1.0)
        check_range("future_window", self.future_window, 1, None, int)
        check_range("overlap", self.overlap, 1, None, int)
        check_range("drop_penalty", self.drop_penalty, 0.0, None)
        check_range("document_tokens", self.document_tokens, 0, None, int)
        if 0 < self.document_tokens <= self.overlap:
            raise SemkvError(f"document_tokens={self.document_tokens} must be 0 (off) or > overlap={self.overlap}: "
                             "only delimiters at positions >= overlap are scored")
        check_range("n_sink", self.n_sink, 0, None, int)
        check_range("n_recent", self.n_recent, 0, None, int)
        check_range("offload", self.offload, types=bool)
        check_range("offload_chunk", self.offload_chunk, 1, None, int)
        check_range("cache_factor", self.cache_factor, 1.0, 64.0)
        check_range("count_reuse", self.count_reuse, types=bool)
        check_range("channels", self.channels, 2, None, int)
        check_range("superset", self.superset, 1.0, None)
        check_range("reuse_layers", self.reuse_layers, 1, None, int)
        if self.channels % 2:
            raise SemkvError(f"channels={self.channels} must be even: the key channels are kept as rotary pairs")
        for field, allowed in CHOICES.items():
            check_choice(field, getattr(self, field), allowed)
        if self.offload and self.pooling == "mean":
            raise SemkvError("offload=True needs pooling='minmax' (the batched path); mean pooling keeps K/V resident")
        if self.score == "tokens" and (self.offload or self.pooling == "mean"):
            raise SemkvError(f"score='tokens' reads every key from the device each step: it needs offload=False and "
                             f"pooling='minmax' (got offload={self.offload}, pooling={self.pooling!r})")
        if self.score_keys == "channels" and (self.score != "tokens" or self.n_recent < 1):
            raise SemkvError(f"score_keys='channels' needs score='tokens' and n_recent >= 1 (a step keeps the channels "
                             f"of the token before it; got score={self.score!r}, n_recent={self.n_recent})")
        if self.reuse_layers > 1 and self.score != "tokens":
            raise SemkvError(f"reuse_layers={self.reuse_layers} needs score='tokens' (with score='bound' every layer "
                             f"keeps its own chunk summaries up to date each step; got score={self.score!r})")
        if self.score_keys == "pages" and self.score != "tokens":
            raise SemkvError(f"score_keys='pages' needs score='tokens' (it chooses the tokens a step scores; got "
                             f"score={self.score!r})")
        if not isinstance(self.delimiters, str) or not self.delimiters:
            raise SemkvError(f"delimiters={self.delimiters!r} must be a non-empty string of characters")

    @property
    def batched(self) -> bool:
        """Min/max pooling: every row is selected from device state (`DynSplitRows`) and the step plan; mean pooling
        selects sequence by sequence."""
        return self.pooling == "minmax"

    @property
    def graph_safe(self) -> bool:
        """The batched path is captured in a CUDA graph (with offload, when the working-set kernel runs on the
        device: its torch reference reads host memory from Python)."""
        return self.batched and (not self.offload or use_triton(torch.device("cuda")))

    @property
    def steady_slots(self) -> bool:
        """With offload on, `end_step` moves the tail back over the tokens it offloads."""
        return not self.offload

    @property
    def plans_ahead(self) -> bool:
        """Batched with K/V resident and no `count_reuse`: the plan is the rows alone and `end_step` does nothing."""
        return self.batched and not self.offload and not self.count_reuse

    # -- set-up ---------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()  # the device rows
        self._step = 0  # decode steps of this method: the stamps of attended slots
        self._ranges: tuple[torch.Tensor, ...] = ()  # the step's chunk ranges, made at layer 0 (`_chunk_ranges`)
        self._split: SplitStep | None = None  # the step's split, made at layer 0 (`_split_step`)
        self._plan: tuple[list[list[int]], ChunkPlan] | None = None  # the last plan's rows and plan
        self._delimiters: torch.Tensor | None = None  # [vocab] each token's column in `DynSplitRows.weights`
        # a copy of the rows' open chunks on its way to the host (`_count_chunks`): the host tensor and its event
        self._counting: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._chosen: torch.Tensor | None = None  # score_keys="channels": the rows' key channels [B, L, H, channels]
        # reuse_layers > 1: (batch, the selection of the current group's first layer) of the step under way
        self._reused: tuple[DecodeBatch, Selection] | None = None

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        self._reused = None

    def bind(self, model: Any, tokenizer: Any, page_size: int) -> None:
        super().bind(model, tokenizer, page_size)
        self.candidates = delimiter_candidates(tokenizer, self.delimiters)  # token id -> text
        base = {t: table7_weight(text) for t, text in self.candidates.items()}
        saved = calibration.load(self.name, model.source) if self.weights != "table7" else None
        if saved:
            base.update({int(t): w for t, w in saved["weights"].items() if int(t) in self.candidates})
        self.base_weights = base
        self.token_weights = arrange_weights(base, self.weights)
        self.vocab = max(model.vocab_size, max(self.candidates, default=0) + 1)
        self.columns = sorted(self.candidates)  # the delimiter tokens' order in `DynSplitRows.weights` (from 1)
        if self.score_keys == "channels" and self.channels > model.head_dim:
            raise SemkvError(f"channels={self.channels} must be at most the model's head_dim ({model.head_dim})")

    def new_state(self, seq: Sequence) -> DynSplitState:
        pool = seq.kv.pool
        if self.offload and self._sets is None:
            self._sets = WorkingSets(pool.num_layers, pool.num_kv_heads, pool.device)
        if self.batched and self._rows is None:
            self._rows = DynSplitRows(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype, pool.device,
                                      stamped=self._stamped, summarised=self.score == "bound",
                                      channels=self.channels if self.score_keys == "channels" else 0,
                                      pages=self.score_keys == "pages",
                                      ring=self.chunk_size + self.max_deviation, delimiters=len(self.columns))
            column = torch.zeros(self.vocab, dtype=torch.long)
            column[self.columns] = torch.arange(1, len(self.columns) + 1)
            self._delimiters = column.to(pool.device)
        state = DynSplitState(pool.num_layers, self.token_weights, pool.device)
        if self.offload:
            state.sinks, state.cache = self._device_layout(len(seq.prompt_ids), seq.params.max_new_tokens,
                                                           pool.page_size)
        return state

    @property
    def _stamped(self) -> bool:
        """Whether the batched path counts reuse from per-slot stamps (`count_reuse`, K/V resident)."""
        return self.batched and self.count_reuse and not self.offload

    def page_state_bytes(self, pool: KVPool) -> int:
        """The attended-step stamps of every slot (`DynSplitRows.stamps`; with `count_reuse`, not with offload), with
        score_keys="channels" the chosen channels of its keys and with "pages" each page's min / max key."""
        stamps = 4 if self._stamped else 0
        kept = self.channels * pool.dtype.itemsize if self.score_keys == "channels" else 0
        summaries = 2 * pool.head_dim * pool.dtype.itemsize if self.score_keys == "pages" else 0
        return pool.num_kv_heads * (pool.page_size * (stamps + kept) + summaries)

    def _device_layout(self, prompt_tokens: int, max_new_tokens: int, page_size: int) -> tuple[int, int]:
        """Offload: the sinks that stay on the device and the working-set slots (the most a step attends, times
        `cache_factor` up to what can be offloaded, up to a page boundary)."""
        tokens = prompt_tokens + max_new_tokens
        sinks = min(self.n_sink, prompt_tokens)
        most = tokens - sinks - self._tail() - -(-self.offload_chunk // page_size) * page_size  # what can offload
        return sinks, working_set_slots(sinks, min(resolve_budget(self.budget, tokens), tokens), page_size,
                                        self.cache_factor, most)

    def takes_row(self, seq: Sequence) -> bool:
        return self.batched and not seq.method_state.row

    def set_needs(self, seq: Sequence, row: int) -> tuple[int, int, int] | None:
        """(rows, working-set slots, offloaded tokens: every token at most), or None without offload."""
        tokens = len(seq.prompt_ids) + seq.params.max_new_tokens
        return (row + 1, seq.method_state.cache, tokens) if self.offload else None

    def device_tokens(self, prompt_tokens: int, max_new_tokens: int, page_size: int) -> int | None:
        """With offload: the sinks, the working set (the most it attends, up to a page boundary) and the tail with
        the tokens waiting to leave it; without: every token."""
        if not self.offload:
            return None
        sinks, cache = self._device_layout(prompt_tokens, max_new_tokens, page_size)
        return min(prompt_tokens + max_new_tokens,
                   sinks + cache + self._tail() + -(-self.offload_chunk // page_size) * page_size)

    def _tail(self) -> int:
        """Offload: the newest tokens kept on the device (the recent window and the slots `chunk_refresh` reads)."""
        return max(self.n_recent, self.chunk_size + self.max_deviation + 1)

    def row_needs(self, seq: Sequence, row: int) -> tuple[int, int]:
        """(rows, chunks) the device rows need for `seq` in `row`: its whole generation, in about as many chunks as
        chunk_size gives (`step_plan` grows them past that when a row's split may need more)."""
        return row + 1, (len(seq.prompt_ids) + seq.params.max_new_tokens) // self.chunk_size + 2

    def _shortest(self) -> int:
        """The fewest tokens of a chunk DD-Select closes (its end is at least C - Delta, and one, after its start)."""
        return max(1, self.chunk_size - self.max_deviation)

    def own_prefill(self, has_question: bool) -> bool:
        return self.document_tokens > 0  # otherwise the prefill is plain Full KV and can be shared

    def window_size(self) -> int:
        return CHANNEL_WINDOW if self.score_keys == "channels" else 0

    # -- prefill --------------------------------------------------------------------------------------------------
    def observe_prefill(self, layer: int, seq: Sequence, q: torch.Tensor, start: int,
                        lse: torch.Tensor | None) -> None:
        if start >= self.document_tokens:
            return
        state = seq.method_state
        if state.dependency is None:
            is_delimiter = torch.tensor([t in self.candidates for t in seq.prompt_ids])
            state.dependency = AttentionDependency(is_delimiter, self.future_window, self.overlap,
                                                   self.drop_penalty, self.document_tokens, self.tp)
        n = min(start + q.shape[0], self.document_tokens)
        keys = seq.kv.gather(layer, torch.arange(n, device=q.device)[None])[0]  # [kv_heads, n, D]
        state.dependency.observe(q, keys, start)

    def evict_prefill(self, layer: int, seq: Sequence, q_window: torch.Tensor) -> None:
        """Offload with a split known before the prompt is read (`document_tokens=0`): this layer's chunk summaries
        go into the sequence's device row and its tokens to the host as soon as the layer is computed, so a prefill
        holds one layer's whole prompt on the device, not every layer's. Otherwise `finish_prefill` does it.
        score_keys="channels": this layer's key channels are chosen for q_window [w, heads, D] and kept of every
        prompt slot."""
        if self.score_keys == "channels":
            self._keep_channels(layer, seq, q_window)
        if not self.prefill_by_layer():
            return None
        state = seq.method_state
        if layer == 0:
            self._extend(state, seq.prompt_ids)
            self._prefill_starts(seq, state)
        self._prefill_layer(seq, state, layer)
        return None

    def _keep_channels(self, layer: int, seq: Sequence, q_window: torch.Tensor) -> None:
        """The request's key channels of `layer` ([kv_heads, channels], into its device row), and those channels of
        every slot's key."""
        kv, rows, row = seq.kv, self._rows, seq.method_state.row
        self.ensure_rows((row + 1, 1), kv.pool)  # the key channels cover the pool's pages
        chosen = key_channels.choose(q_window, kv.keys(layer), self.channels, self.group_reduce == "mean")
        rows.channels[row, layer] = chosen
        n = kv.num_slots[layer]
        flat = physical_rows(kv.table[layer][None], torch.arange(n, device=chosen.device)[None], kv.pool.page_size)
        rows.key_channels.write(kv.pool, flat[0], chosen.expand(n, -1, -1))

    def prefill_by_layer(self) -> bool:
        """Offload with a split known before the prompt is read: each layer is summarised and offloaded as soon as it
        is computed (`evict_prefill`), so a prompt longer than the device holds can be prefilled."""
        return self.batched and self.offload and self.document_tokens == 0

    def finish_prefill(self, seq: Sequence) -> None:
        state, kv = seq.method_state, seq.kv
        if not self.prefill_by_layer():  # else every layer is done (`evict_prefill`)
            if state.dependency is not None:
                scores = {t: s / c for t, (s, c) in state.dependency.by_token(seq.prompt_ids).items()
                          if c >= MIN_OCCURRENCES}
                state.token_weights = arrange_weights({**self.base_weights, **normalise(scores)}, self.weights)
            self._extend(state, seq.prompt_ids)
            if self.batched:
                self._prefill_starts(seq, state)
                for layer in range(kv.pool.num_layers):
                    self._prefill_layer(seq, state, layer)
        if self.offload:
            state.offloaded += self._prompt_offload(state)
            seq.stats.d2h_bytes = state.store.d2h_bytes
        if self.batched:
            return
        for layer in range(kv.pool.num_layers):
            keys, _, _ = kv.gather(layer, kv.all_slots(layer))
            state.summarise(layer, keys, self.pooling)
        state.pending = 0

    def _prompt_offload(self, state: DynSplitState) -> int:
        """Offload: the prompt tokens that go to the host at the end of prefill (after the sinks, before the tail)."""
        return max(len(state.ids) - state.sinks - self._tail(), 0)

    def _prefill_starts(self, seq: Sequence, state: DynSplitState) -> None:
        """Room in the device rows for the prompt's chunks, their starts, and what DD-Select on the device goes on
        from: the open chunk, the weights of its positions and the row's weight of every delimiter token."""
        chunks, rows, device = len(state.ends) + 1, self._rows, self._rows.device
        self.ensure_rows((state.row + 1, chunks + 2), seq.kv.pool)
        rows.start[state.row, :chunks] = torch.tensor([0] + state.ends, dtype=torch.int32, device=device)
        ring = torch.full((rows.ring.shape[1],), -1.0, dtype=torch.float64)
        for p in range(state.open_start, len(state.ids)):  # fewer than the ring's positions: the chunk is open
            ring[p % ring.shape[0]] = state.position_weights[p]
        rows.ring[state.row] = ring.to(device)
        rows.open[state.row] = len(state.ends)
        rows.weights[state.row] = torch.tensor([-1.0] + [state.token_weights.get(t, -1.0) for t in self.columns],
                                               dtype=torch.float64, device=device)
        state.split_at = (len(state.ends), len(seq.prompt_ids))  # (chunks closed, tokens) the host knows of

    def _prefill_layer(self, seq: Sequence, state: DynSplitState, layer: int) -> None:
        """One layer at the end of prefill: its chunk summaries (score="bound") into the device row, or with
        score_keys="pages" its pages' summaries; with offload, its prompt after the sinks less the tail to the host,
        the tail moved behind the working set, which holds the first offloaded tokens (already in place)."""
        kv, rows, n, chunks = seq.kv, self._rows, len(state.ids), len(state.ends) + 1
        if rows.page_summaries is not None:
            rows.page_summaries.build(kv, layer)
        if layer < rows.summary_layers:
            blocks = block_summaries(kv.keys(layer), state.labels[:n], chunks, "minmax")  # [2, kv_heads, chunks, D]
            rows.kmin[layer][state.row, :chunks] = blocks[0].transpose(0, 1)
            rows.kmax[layer][state.row, :chunks] = blocks[1].transpose(0, 1)
        if not self.offload:
            return
        m = self._prompt_offload(state)
        if m:
            state.store.put(slice(layer, layer + 1), *slot_range(kv, slice(layer, layer + 1), state.sinks, m))
        self._sets.hold_first(layer, state.row, min(state.cache, m))
        move_tail(kv, layer, state.sinks + m, state.sinks + state.cache)

    def _offload(self, seq: Sequence, state: DynSplitState, m: int) -> None:
        """Offload during decoding: the m (whole pages) oldest tokens after the sinks and the working set go to the
        host, every layer at once; their pages leave the page table without a copy."""
        kv, start = seq.kv, state.sinks + state.cache
        state.store.put(slice(None), *slot_range(kv, slice(None), start, m))
        kv.drop_pages(start // kv.pool.page_size, m // kv.pool.page_size)
        state.offloaded += m
        seq.stats.d2h_bytes = state.store.d2h_bytes

    def _extend(self, state: DynSplitState, tokens: list[int]) -> None:
        """Append tokens to the split; close the chunks whose search range is now complete."""
        state.append(tokens)
        ends = dd_select(state.position_weights, state.open_start, self.chunk_size, self.max_deviation, self.alpha,
                         fixed=self.split == "fixed")
        state.close(ends)

    # -- decode ---------------------------------------------------------------------------------------------------
    def _k(self, seq: Sequence) -> int:
        """Tokens attended this step."""
        n = seq.num_computed + 1  # the current token included
        return min(resolve_budget(self.budget, n), n)

    def step_plan(self, batch: DecodeBatch) -> "ChunkPlan | None":
        """Batched path: room in the device rows for every row's split, and each row's `ChunkPlan` (the last plan
        again while its values hold: with K/V resident and no `count_reuse`, while the batch holds). Mean pooling:
        every split is extended by the step's token on the host (nothing to plan)."""
        if not self.batched:
            for seq in batch.seqs:
                self._extend(seq.method_state, [seq.last_token])
            return None
        self._step += 1
        counted = self._counted()  # the rows' closed chunks some steps ago, when that copy is done
        asking = self._count_chunks()  # a new copy, when none is under way
        shortest, stamped, plan, need = self._shortest(), self._stamped, [], 1
        for seq in batch.seqs:
            state = seq.method_state
            n = seq.num_computed + 1  # tokens, the current one included
            if counted is not None and state.asked[0] is counted[0]:
                state.split_at = (counted[1][state.row], state.asked[1] - 1)  # before the token of that step
            if asking is not None:
                state.asked = (asking, n)
            closed, at = state.split_at
            # at most one chunk closes in `shortest` tokens; one token more for a step launched before the last one
            # ended (`plans_ahead`: the host's count is a step behind)
            need = max(need, closed + (n + 1 - at) // shortest + 3)
            plan.append([state.row, self._step if stamped else 0, int(stamped and len(seq.output_ids) == 1),
                         state.sinks, state.offloaded, state.cache])
        self.ensure_rows((max(row[0] for row in plan) + 1, need), batch.pool)
        if self._plan is None or self._plan[0] != plan:
            self._plan = plan, ChunkPlan.send(batch.pool.staging, plan)  # one copy that does not wait
        return self._plan[1]

    def _count_chunks(self) -> "torch.Tensor | None":
        """Copy every row's closed chunks (its open chunk) to the host without waiting for the device: what the steps
        launched so far make of them (`_counted` reads it once the copy is done). The host tensor, or None while an
        earlier copy is under way."""
        if self._counting is not None:
            return None
        rows = self._rows.open
        self._counting = copy_early(rows if rows.is_cuda else rows.clone())  # off CUDA a copy too: read a step later
        return self._counting[0]

    def _counted(self) -> "tuple[torch.Tensor, list[int]] | None":
        """The copy `_count_chunks` made and its values by row, once it is done (then no copy is under way)."""
        if self._counting is None:
            return None
        host, event = self._counting
        if event is not None and not event.query():
            return None
        self._counting = None
        return host, host.tolist()

    def plan_buffers(self, size: int, max_slots: int, device: torch.device) -> "ChunkPlan | None":
        return ChunkPlan.static(size, device) if self.batched else None

    def select(self, layer: int, batch: DecodeBatch, q: torch.Tensor) -> Selection | None:
        if layer % self.reuse_layers and self._reused is not None and self._reused[0] is batch:
            return self._reused[1]  # the group's first layer selected this step's slots (score="tokens")
        if self.batched:
            selection = self._select_rows(layer, batch, q)
            if self.reuse_layers > 1:
                self._reused = batch, selection
            return selection
        seqs, device = batch.seqs, q.device
        for b, seq in enumerate(seqs):
            slot = torch.tensor([[seq.kv.num_slots[layer] - 1]], device=device)  # the host's count: no device read
            k_new, _, _ = seq.kv.gather(layer, slot)  # [kv_heads, 1, D]: the current token
            seq.method_state.summarise(layer, k_new, self.pooling)
        n_host, k_host = [len(s.method_state.ids) for s in seqs], [self._k(s) for s in seqs]
        n, k = torch.tensor(n_host, device=device), torch.tensor(k_host, device=device)  # [B]
        width = max(n_host)
        if all(a >= b for a, b in zip(k_host, n_host)):
            mask = torch.arange(width, device=device)[None, None] < n[:, None, None]
            self._count_reuse(seqs, layer, mask.expand(-1, batch.model.num_kv_heads, -1))
            return None
        summaries, labels = DynSplitState.stack([s.method_state for s in seqs], layer, width)
        scores = block_scores(q, summaries, self.pooling, self.group_reduce)  # [B, kv_heads, n_blocks]
        pos = torch.arange(width, device=device)[None]
        recent = torch.minimum(k, torch.tensor(self.n_recent, device=device))
        sinks = torch.minimum(k - recent, torch.tensor(self.n_sink, device=device))
        forced = ((pos >= (n - recent)[:, None]) | (pos < sinks[:, None])) & (pos < n[:, None])  # [B, width]
        mask = v2f_select(scores, labels, k, forced)  # [B, kv_heads, width]
        self._count_reuse(seqs, layer, mask)
        return Selection.from_mask(mask)

    def _select_rows(self, layer: int, batch: DecodeBatch, q: torch.Tensor) -> Selection:
        """Every row at once from the device rows and the plan (see the module docstring); with offload, over
        virtual slots, made device slots by the working set. q [B, heads, D]."""
        plan: ChunkPlan = batch.step_plan
        stored = batch.num_slots[:, layer]  # [B] device slots, the same in every layer
        shift = plan.offloaded - plan.cache  # virtual slot - device slot in the tail (0 without offload)
        n = stored + shift  # [B] virtual slots: every token
        if batch.graphed:  # the widest any row may attend
            width = min(resolve_budget(self.budget, batch.max_slots), batch.max_slots)
        else:  # one token more than the host counts: a pipelined step is launched before it counts the last one
            width = max(min(resolve_budget(self.budget, s.num_computed + 2), s.num_computed + 2) for s in batch.seqs)
        state, pool = self._rows, batch.pool
        span = self.chunk_size + self.max_deviation + 1  # a chunk closes once that many slots follow its start
        if layer == 0:
            self._split = self._split_step(plan.row, n, batch.tokens)
            self._ranges = self._chunk_ranges(plan, self._split, n,
                                              self._token_width(batch) if self.score == "tokens" else 0)
        split, (table, lo, count, chunk_of) = self._split, self._ranges
        if self.score == "tokens":  # the best token of each chunk between the forced ones
            keys = pool.k
            if self.score_keys == "channels":
                keys, q = state.key_channels.data, self._channel_queries(layer, batch, q)
            kept = None if self.score_keys != "pages" else self._kept_pages(layer, batch, q, n, split, width)
            scores = dynsplit_kernels.chunk_best(q, keys, batch.tables[:, layer], chunk_of, split.n_sink,
                                                 n - split.n_recent, state.chunks, self.group_reduce, kept)
        else:
            kmin, kmax = state.kmin[layer].flatten(0, 1), state.kmax[layer].flatten(0, 1)  # [rows * chunks, H, D]
            dynsplit_kernels.chunk_refresh(pool.flat()[0], batch.tables[:, layer], pool.page_size,
                                           split.dirty_start - shift, split.following - shift, stored,
                                           split.targets, span, kmin, kmax)  # in the tail
            scores = kernels.page_bound(q, kmin, kmax, table, split.open_chunk + 2, 1,
                                        self.group_reduce)  # [B, kv_heads, chunks]
        sinks, recent = split.n_sink, split.n_recent
        capacity = split.k - sinks - recent
        before, _, place = kernels.bucket_take(scores, count[:, None].expand_as(scores), capacity)
        slots, lengths = dynsplit_kernels.chunk_slots(lo, count, before, place, n, sinks, capacity,
                                                      torch.minimum(recent, n - sinks).clamp(min=1), self.n_sink,
                                                      width, span)
        if self.offload:  # reuse is the working set's: tokens found on the device
            return self._sets.load(layer, batch, Selection(slots, lengths), plan.row, plan.sinks, plan.offloaded,
                                   plan.cache)
        if self.count_reuse:
            dynsplit_kernels.slot_stamps(state.stamps.data.view(-1, pool.num_kv_heads), batch.tables[:, layer],
                                         pool.page_size, slots, lengths, n - 1, plan.step, plan.first_step,
                                         state.reuse, plan.row, pool.scratch)  # reuse counts
        return Selection(slots, lengths)

    def _kept_pages(self, layer: int, batch: DecodeBatch, q: torch.Tensor, n: torch.Tensor, split: SplitStep,
                    width: int) -> torch.Tensor:
        """score_keys="pages": the pages whose tokens a step scores, uint8 [B, max_pages] (1: kept): those with the
        highest Quest bound holding about `superset` times the widest budget's tokens between the sinks and the
        recent window (`PageSummaries.best_pages`)."""
        _, pages, _ = self._rows.page_summaries.best_pages(batch, layer, q, n, split.n_sink, n - split.n_recent,
                                                           int(self.superset * width), self.group_reduce, self.tp)
        kept = torch.zeros(batch.tables.shape[0], batch.tables.shape[-1], dtype=torch.uint8, device=q.device)
        return kept.scatter_(1, pages, 1)

    def _channel_queries(self, layer: int, batch: DecodeBatch, q: torch.Tensor) -> torch.Tensor:
        """score_keys="channels": q [B, heads, D] at each row's key channels of `layer` ([B, heads, channels]). At
        layer 0 the channels of the token before the current one are kept, in every layer (the step before stored
        it; it is scored from this step on where n_recent is 1)."""
        state, pool = self._rows, batch.pool
        if layer == 0:
            self._chosen = chosen = state.channels[batch.step_plan.row]  # [B, L, H, channels]
            before = (batch.num_slots[:, 0] - 2).clamp(min=0).repeat_interleave(chosen.shape[1])  # [B * L]
            flat = physical_rows(batch.tables.flatten(0, 1), before[:, None], pool.page_size)[:, 0]
            state.key_channels.write(pool, flat, chosen.flatten(0, 1))
        size, kv_heads, dim = q.shape[0], pool.num_kv_heads, q.shape[-1]
        chosen = self._chosen[:, layer, :, None].expand(-1, -1, q.shape[1] // kv_heads, -1)  # [B, H, group, c]
        return q.view(size, kv_heads, -1, dim).gather(3, chosen).flatten(1, 2)

    @staticmethod
    def _token_width(batch: DecodeBatch) -> int:
        """score="tokens": the slots scored in every row: `max_slots` (a graphed step: the graph's capacity; else the
        longest row), within the page table."""
        return min(batch.max_slots, batch.tables.shape[-1] * batch.pool.page_size)

    def _split_step(self, row: torch.Tensor, n: torch.Tensor, tokens: torch.Tensor) -> SplitStep:
        """DD-Select on the device for every row at once (layer 0 of a step, inside its graph): the token at position
        n - 1 [B] (`tokens` [B]) gets its row's delimiter weight; a row whose open chunk now has its whole search
        range closes it at the best end, as `split.dd_select` does (the same float64 scores; the first of equal
        ones; s + C without a delimiter in range). Also the tokens each row attends from n, as `_k` counts them on the
        host. Padding rows work on row 0."""
        k = torch.minimum(budget_tokens(self.budget, n), n)
        n_recent = k.clamp(max=self.n_recent)
        n_sink = (k - n_recent).clamp(max=self.n_sink)
        rows, size, dev = self._rows, self.chunk_size + self.max_deviation, self.max_deviation
        rows.ring[row, (n - 1) % size] = rows.weights[row, self._delimiters[tokens]]
        open_chunk = rows.open[row]  # [B]
        start = rows.start[row, open_chunk].long()  # [B] the open chunk's start
        ends = start[:, None] + torch.arange(1, size + 1, device=n.device)  # [B, C + Delta] its possible ends
        target = start[:, None] + self.chunk_size
        best = target[:, 0]
        if self.split == "dynamic":
            weight = rows.ring[row[:, None], (ends - 1) % size]  # [B, C + Delta] of each end's last token
            closeness = 1.0 - (ends - target).abs().double() / dev if dev else torch.ones_like(weight)
            valid = (ends >= target - dev) & (weight >= 0)
            score = torch.where(valid, self.alpha * weight + (1.0 - self.alpha) * closeness, float("-inf"))
            best = torch.where(valid.any(1), ends.gather(1, score.argmax(1, keepdim=True))[:, 0], best)
        closes = n - start >= size  # [B]
        following = torch.where(closes, best, n)
        after = open_chunk + closes.long()
        rows.start[row, after] = torch.where(closes, best, start).int()  # the chunk the token opened starts there
        rows.open[row] = after
        flat = row * rows.chunks + open_chunk
        return SplitStep(k, n_sink, n_recent, after, start, following,
                         torch.stack([flat, torch.where(closes, flat + 1, 0)], 1))

    def _chunk_ranges(self, plan: "ChunkPlan", split: SplitStep, n: torch.Tensor,
                      width: int) -> tuple[torch.Tensor, ...]:
        """What every layer of the step shares: each chunk's summary row (`table` [B, chunks], a chunk read as a
        page of one slot), its first slot between the forced ones and how many it has there (`lo`, `count`); with
        width > 0 (score="tokens") the chunk of each of the first `width` slots ([B, width]; else None)."""
        state, open_chunk = self._rows, split.open_chunk[:, None]
        index = torch.arange(state.chunks, device=n.device)
        table = plan.row[:, None] * state.chunks + index
        start = state.start[plan.row].long()  # [B, chunks]
        end = torch.where(index < open_chunk, start.roll(-1, dims=1), n[:, None])
        lo, hi = torch.maximum(start, split.n_sink[:, None]), torch.minimum(end, (n - split.n_recent)[:, None])
        count = torch.where(index <= open_chunk, (hi - lo).clamp(min=0), 0)
        if not width:
            return table, lo, count, None
        later = torch.where((index > 0) & (index <= open_chunk), start, width).clamp(max=width)  # [B, chunks]
        marks = torch.zeros(n.shape[0], width + 1, dtype=torch.int32, device=n.device)  # a 1 where a chunk starts
        chunk_of = marks.scatter_add_(1, later, torch.ones_like(later, dtype=torch.int32))[:, :width].cumsum(
            1, dtype=torch.int32)
        return table, lo, count, chunk_of

    def end_step(self, seqs: list[Sequence], logits: torch.Tensor, tokens: list[int]) -> None:
        """Batched path: the rows' reuse counters into the sequences' statistics (one small read); with offload,
        the working sets' (tokens found on the device / loaded from the host) and the oldest tokens of a tail
        `offload_chunk` longer than it must be go to the host."""
        if not self.batched:
            return
        rows = [s.method_state.row for s in seqs]
        if not self.offload:
            if not self.count_reuse:
                return
            counts = self._rows.reuse[torch.tensor(rows, device=self._rows.device)].tolist()
            for seq, (reused, reloaded) in zip(seqs, counts):
                seq.stats.extra.update(kv_reused=reused, kv_reloaded=reloaded)
            return
        for seq, counts in zip(seqs, self._sets.counts(rows)):
            state = seq.method_state
            record_traffic(seq, *counts)
            extra = seq.kv.num_slots[0] - state.sinks - state.cache - self._tail()
            extra -= extra % seq.kv.pool.page_size  # whole pages leave
            if extra and extra >= self.offload_chunk:
                self._offload(seq, state, extra)

    def _count_reuse(self, seqs: list[Sequence], layer: int, mask: torch.Tensor) -> None:
        """Selected tokens (the current one aside) that were / were not selected at the previous step of this layer
        (with `count_reuse`)."""
        if not self.count_reuse:
            return
        for b, seq in enumerate(seqs):
            state = seq.method_state
            n = len(state.ids)
            now = mask[b, :, : n - 1]
            before = state.previous[layer]
            reused = 0 if before is None else int((now[:, : before.shape[1]] & before).sum())
            state.count(seq, reused=reused, reloaded=int(now.sum()) - reused)
            state.previous[layer] = mask[b, :, :n].clone()

    # -- calibration ----------------------------------------------------------------------------------------------
    @classmethod
    def calibrate(cls, llm: Any, texts: list[str], max_tokens: int) -> dict[str, Any]:
        """Algorithm 1 over `texts` (each cut to `max_tokens`): per delimiter token, the mean dependency score s of
        its occurrences, min-max normalised into a weight in [0, 1]; tokens seen fewer than MIN_OCCURRENCES times
        keep their Table 7 weight. Attention is recomputed chunk by chunk inside the engine's prefill
        (`observe_prefill`), so no L x L map is ever held."""
        if max_tokens <= cls.overlap:
            raise SemkvError(f"max_tokens={max_tokens} must exceed the overlap R={cls.overlap}: only delimiters at "
                             "positions >= R are scored")
        method = cls(document_tokens=max_tokens, weights="table7")
        method.bind(llm.config, llm.tokenizer, llm.engine.pool.page_size)
        totals: dict[int, tuple[float, int]] = {}
        used = 0
        for text in texts:
            ids = llm.encode(text, chat=False)[0][:max_tokens]
            used += len(ids)
            for t, (s, c) in prefilled_state(llm, method, ids).dependency.by_token(ids).items():
                old = totals.get(t, (0.0, 0))
                totals[t] = (old[0] + s, old[1] + c)
        scores = {t: s / c for t, (s, c) in totals.items() if c >= MIN_OCCURRENCES}
        weights = normalise(scores)
        table = [dict(token=method.candidates[t], id=t, score=round(scores[t], 5), weight=round(w, 4),
                      count=totals[t][1]) for t, w in sorted(weights.items(), key=lambda kv: -kv[1])]
        return dict(weights={str(t): round(w, 4) for t, w in weights.items()}, table=table, texts=len(texts),
                    tokens=used, future_window=method.future_window, overlap=method.overlap,
                    drop_penalty=method.drop_penalty)


def prefilled_state(llm: Any, method: DynSplitKV, ids: list[int]) -> DynSplitState:
    """Prefill `ids` through the engine with a bound `method` (the pages are released afterwards); the state."""
    seq = Sequence(0, ids, SamplingParams(), SeqKV(llm.engine.pool))
    seq.method_state = state = method.new_state(seq)
    try:
        llm.engine.prefill(seq, method)
    finally:
        llm.engine.release(seq)
    return state
