"""CHESS: hierarchical Grid -> Chunk -> Page selection by key-key affinity, re-selected when the model grows uncertain
("CHESS: Context-aware Hierarchical Efficient Semantic Selection for Long-Context LLM Inference", 2026,
https://arxiv.org/abs/2602.20732).

Every page of `block_size` tokens is summarised by the mean of its keys, flattened over all layers and KV heads (Eq. 1);
chunks of `chunk_pages` pages and grids of `grid_chunks` chunks are logical views whose vectors are means of their
children (Eq. 2). The anchor is the mean vector of the last `recent_pages` pages (Eq. 3); one matrix product scores grids,
chunks and pages against it (Eq. 4) and a coarse-to-fine cascade keeps the top grids, then the top chunks inside them,
then the top pages inside those (Algorithm 1). One page set serves every layer and head; the first page (attention
sinks) and the recent window are always attended. The set is kept until the model's uncertainty over a page of
generated tokens (mean entropy or varentropy) crosses thresholds calibrated offline (section 3.3, Appendix C).

Budget: a decode step attends to at most `budget` tokens, recent window first, then the sink page, then
`k = (budget - recent - sink) // block_size` selected pages. The budget sets rho_p (k pages among those the grid and
chunk levels leave) with the preset's rho_g, rho_c; where k exceeds the preset's rho_g * rho_c share of the candidate
pages, rho_g and rho_c are raised by a common power until their product is that share, so a budget at least the
context makes every ratio 1.0 (Full KV). `budget=rho_g*rho_c*rho_p` as a fraction reproduces a Table 1 setting.

Parameters
----------
budget: attended tokens per step (shared by every layer and KV head); a float is a fraction of the context.
preset: (rho_g, rho_c) from Table 1: "conservative" (0.9, 0.9), "moderate" (0.8, 0.7), "aggressive" (0.5, 0.2);
    default "moderate" (the paper's rho_p of each preset, 0.9 / 0.7 / 0.1, is replaced by the budget).
block_size: B, tokens per CHESS page; 32 (the paper's setting); a multiple of the engine's KV `page_size` (the
    paper's page, named apart from the engine's; `page_size` is a deprecated alias).
chunk_pages: N_c, pages per chunk; 4, chosen by ablation (benchmarks/studies/chess_eval.py ablation; the paper gives
    none).
grid_chunks: N_g, chunks per grid; 4, chosen by the same ablation.
recent_pages: W, recent pages that form the anchor and are always attended; 2 (the paper gives no value: two pages hold
    the question of a prompt and the latest generated tokens). Between re-selections the window grows from where it
    started, so no page falls between the window and the kept selection.
mode: "dynamic" (re-select on uncertainty, the paper's method), "periodic" (every `period` generated pages,
    Appendix C's baseline) or "always" (every step).
period: generated pages between re-selections in periodic mode; 6 (Appendix C).
trigger: "any" (mean entropy or varentropy above its threshold: the paper calls them complementary signals) or
    "both" (the upper-right region of Figure 4).
rope_free: summarise the keys before RoPE (rotated back by their positions) instead of the stored, rotated keys;
    False: the paper's "Key states" as its engine (nano-vllm) stores them. Rotated keys of distant pages are compared
    at a position-dependent angle.
center: subtract the mean candidate page vector from every vector and the anchor before scoring; False (the paper's
    plain dot product). Appendix B assumes unrelated keys cancel out, which holds only for centred keys.
anchor: what the pages are scored against. "keys" (the paper's Eq. 3-4): the mean key vector of the recent pages,
    key-key affinity. "queries" (opt-in, not in the paper): the attention the prompt's last `query_window` queries
    (its question) give each page at the end of prefill, as SnapKV's observation window: softmax over the prompt's
    keys per query and head, averaged over the window, summed over the page's tokens, the query heads and the
    layers (one page set still serves every layer and head). The cascade and the budget stay as they are; the
    selection is made once, after prefill, and the recent window then grows over the generated tokens (pages
    leave the selection worst first as it grows): `mode` and the thresholds stay at their defaults (else an error).
    On Qwen2.5-0.5B RULER needles at 8k key-key affinity ranks the needle's page below the median of ~254
    candidates, where this score ranks it first (benchmarks/studies/chess_anchor_ranks.py; retention and answers:
    benchmarks/studies/retrieval_study.py, benchmarks/results/2026-11-26-h100-quality.md).
query_window: prompt queries that score the pages when anchor="queries"; 32 (SnapKV's window).
neighbours: with anchor="queries", a page scores the most attention of itself and the `neighbours` pages on either
    side (max pooling), so a needle cut by a page boundary is kept whole (SnapKV pools its token scores for the same
    reason); 1. Measured: without it a number split over two pages was kept in half and misread ("8125633" for
    8127378, RULER multivalue at 8k).
entropy_threshold, varentropy_threshold: override the calibrated thresholds (nats, nats^2); None reads
    `semkv calibrate --method chess` for the model, else the defaults below (the embedded SmolLM2 calibrated on the
    shared Paul Graham essays, 99th percentiles over 32-token pages).
"""
from __future__ import annotations

import functools
import itertools
import math
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F

from semkv.engine.hooks import DecodeBatch, KVMethod, Selection, StepPlan, budget_tokens, resolve_budget
from semkv.engine.kv_cache import KVPool
from semkv.engine.sequence import Sequence
from semkv.errors import SemkvError, check_choice, check_range
from semkv.methods import calibration
from semkv.methods.base import layer_groups, layers_window_mass, neighbour_max
from semkv.methods.chess import kernels as chess_kernels
from semkv.methods.chess.cascade import cascade, cascade_ratios
from semkv.methods.chess.uncertainty import page_uncertainty, teacher_forced_entropies, token_entropy
from semkv.methods.eviction import window_positions
from semkv.methods.state.page_summaries import PageSummaries
from semkv.models.config import ModelConfig
from semkv.models.parallel import reduce
from semkv.models.rotary import RotaryEmbedding

PRESETS = {"conservative": (0.9, 0.9), "moderate": (0.8, 0.7), "aggressive": (0.5, 0.2)}
MODES = ("dynamic", "periodic", "always")
ANCHORS = ("keys", "queries")
# `semkv calibrate --method chess` of the embedded SmolLM2-135M-Instruct on the essays worked, popular, gap and gh
# (4096 tokens each: 512 pages of 32 tokens)
DEFAULT_THRESHOLDS = {"entropy": 3.84, "varentropy": 3.50}


_selections = itertools.count(1)


def safety(n: torch.Tensor, budget: torch.Tensor, start: torch.Tensor, size: int):
    """Recent and sink tokens attended, and pages left for the selection, under the budget (all [b]), for n slots and
    a window starting at page `start` (pages of `size` tokens)."""
    recent = torch.minimum(n - start * size, budget)
    sink = torch.minimum(start.clamp(max=1) * size, budget - recent)
    return recent, sink, (budget - recent - sink) // size


def plan_slots(n: torch.Tensor, start: torch.Tensor, pages: torch.Tensor, budget: int | float | None, size: int,
               width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's slots from its plan: the sink tokens, the best k kept pages (the window may have grown since the
    selection, so k may have shrunk) and the recent window, ascending, by index arithmetic over a fixed width (no
    mask over the context, no sort of it). n [b] slots, start [b] window start, pages [b, P] kept pages best first
    (-1 padding). Returns slots [b, width] and lengths [b]."""
    recent, sink, k = safety(n, budget_tokens(budget, n), start, size)
    kept = (torch.arange(pages.shape[1], device=n.device) < k[:, None]) & (pages >= 0)
    chosen = torch.where(kept, pages, torch.iinfo(torch.long).max).sort(-1).values  # [b, P] ascending
    n_kept = kept.sum(-1) * size  # [b] slots of the kept pages
    j = torch.arange(width, device=n.device)[None]  # [1, W]
    in_pages = j - sink[:, None]  # [b, W] offset into the kept pages' slots
    page = torch.gather(chosen, 1, (in_pages // size).clamp(0, pages.shape[1] - 1))
    in_recent = in_pages - n_kept[:, None]
    slots = torch.where(j < sink[:, None], j, torch.where(in_recent < 0, page * size + in_pages % size,
                                                         (n - recent)[:, None] + in_recent))
    lengths = sink + n_kept + recent  # [b]
    return torch.where(j < lengths[:, None], slots, 0), lengths


@functools.cache
def _compiled_plan_slots():
    return torch.compile(plan_slots, dynamic=True, fullgraph=True)


def plan_slots_function(device: torch.device):
    """`plan_slots` as run on `device`: on CUDA compiled by torch.compile, which fuses its ~45 element-wise
    operations into a few kernels (inside the decode graph they would otherwise cost ~2 us each). Compiled for
    symbolic shapes: one compilation serves every batch bucket and width (a compilation per shape cost seconds in
    each new request mix of continuous batching)."""
    return _compiled_plan_slots() if device.type == "cuda" else plan_slots


@dataclass
class ChessState:
    ranked: torch.Tensor | None = None  # [width] page ids of the last selection, best score first, then -1
    selection_id: int = 0  # unique per selection, so a step plan can be reused while no sequence re-selected
    window_start: int = 0  # first page of the recent window (fixed between selections, so the window grows)
    summarized: int = 0  # tokens whose keys are folded into the page sums (brought up to date at a selection)
    entropies: list[torch.Tensor] = field(default_factory=list)  # 0-d, on the device: the current page's tokens
    page_tokens: int = 0  # generated tokens of the current page
    pages_since: int = 0  # generated pages since the last selection
    pending: bool = True  # select at the next step
    # anchor="queries": the prompt window's attention per page, float32 [layers, pages] during the prefill, [pages]
    page_mass: torch.Tensor | None = None


@dataclass
class PagePlan(StepPlan):
    """CHESS's step plan: each sequence's kept pages, best first (-1 past the last), and its window's first page."""

    pages: torch.Tensor = field(metadata={"pad": -1})  # [B, kept pages]
    window: torch.Tensor  # [B]


class Unrotate:
    """Keys [..., D] stored at `positions` [...] -> the keys before RoPE (up to RoPE's constant scaling)."""

    def __init__(self, model: ModelConfig) -> None:
        self.model = model
        self.rotary: RotaryEmbedding | None = None

    def __call__(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.rotary is None or self.rotary.device != keys.device:
            self.rotary = RotaryEmbedding(self.model.hf_config, self.model.head_dim, keys.device)
        cos, sin = self.rotary.cos_sin(positions.flatten().long(), torch.float32)
        return RotaryEmbedding.rotate(keys.reshape(-1, 1, keys.shape[-1]), cos, -sin).view_as(keys)


@dataclass
class Chess(KVMethod):
    preset: str = "moderate"
    block_size: int = 32
    chunk_pages: int = 4
    grid_chunks: int = 4
    recent_pages: int = 2
    mode: str = "dynamic"
    period: int = 6
    trigger: str = "any"
    rope_free: bool = False
    center: bool = False
    anchor: str = "keys"
    query_window: int = 32
    neighbours: int = 1
    entropy_threshold: float | None = None
    varentropy_threshold: float | None = None

    kind = "selection"
    graph_safe = True  # the step's plan is decided before the forward; its selection is computed inside the graph
    name = "chess"
    renamed = {"page_size": "block_size", "window": "recent_pages"}
    summary = "CHESS: grid->chunk->page cascade by key-key affinity with the recent pages, re-selected on uncertainty"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, value, allowed in (("preset", self.preset, tuple(PRESETS)), ("mode", self.mode, MODES),
                                     ("trigger", self.trigger, ("any", "both")), ("anchor", self.anchor, ANCHORS)):
            check_choice(name, value, allowed)
        check_range("block_size", self.block_size, 1, 256, int)
        check_range("chunk_pages", self.chunk_pages, 1, 1024, int)
        check_range("grid_chunks", self.grid_chunks, 1, 1024, int)
        check_range("recent_pages", self.recent_pages, 1, None, int)
        check_range("period", self.period, 1, None, int)
        check_range("rope_free", self.rope_free, types=bool)
        check_range("center", self.center, types=bool)
        check_range("query_window", self.query_window, 1, None, int)
        check_range("neighbours", self.neighbours, 0, None, int)
        if self.anchor == "keys" and self.neighbours != 1:
            raise SemkvError(f"neighbours={self.neighbours} pools the page scores of anchor='queries'; give "
                             "anchor='queries' or leave neighbours at 1")
        if self.anchor == "queries" and (self.rope_free or self.center):
            raise SemkvError("anchor='queries' scores pages by the prompt window's attention to the stored keys; "
                             "rope_free and center apply to anchor='keys' only: leave them False")
        retuned = self.mode != "dynamic" or self.entropy_threshold is not None or self.varentropy_threshold is not None
        if self.anchor == "queries" and retuned:
            raise SemkvError("anchor='queries' selects once, after prefill; mode and the entropy thresholds apply to "
                             "anchor='keys' only: leave them at their defaults")
        for name in ("entropy_threshold", "varentropy_threshold"):
            if getattr(self, name) is not None:
                check_range(name, getattr(self, name), 0.0, None)

    def bind(self, model, tokenizer, page_size: int) -> None:
        super().bind(model, tokenizer, page_size)
        if self.block_size % page_size:
            raise SemkvError(f"block_size={self.block_size} must be a multiple of the engine's KV page size "
                             f"{page_size}; allowed: {page_size}, {2 * page_size}, ...")
        found = dict(DEFAULT_THRESHOLDS, **(calibration.load("chess", model.source) or {}))
        given = (self.entropy_threshold, self.varentropy_threshold)
        self.thresholds = tuple(found[k] if v is None else v for k, v in zip(("entropy", "varentropy"), given))

    def reset(self) -> None:
        self.summaries = PageSummaries(("sum",), Unrotate(self.model) if self.rope_free else None)
        self._plan: tuple[tuple[int, ...], PagePlan] | None = None  # (selection ids, plan)

    def release(self, seq: Sequence) -> None:
        self._plan = None

    def new_state(self, seq: Sequence) -> ChessState:
        seq.stats.extra["reselections"] = 0
        return ChessState()

    def admission_bytes(self, seq: Sequence) -> int:
        return self.summaries.growth_bytes(seq.kv.pool) if self.anchor == "keys" else 0

    def page_state_bytes(self, pool: KVPool) -> int:
        return self.summaries.bytes_per_page(pool) if self.anchor == "keys" else 0

    def batch_state_bytes(self, seq: Sequence, batch: int) -> int:
        return 0  # its state is kept by page (`page_state_bytes`)

    @classmethod
    def calibrate(cls, llm: Any, texts: list[str], max_tokens: int) -> dict[str, Any]:
        """99th percentiles of the mean entropy and the varentropy of next-token distributions over pages of the
        texts (teacher-forced with Full KV), as in section 5.1."""
        size = next(f.default for f in fields(cls) if f.name == "block_size")
        per_page = []
        for text in texts:
            ids = llm.tokenizer(text, add_special_tokens=True)["input_ids"][:max_tokens]
            if len(ids) >= size:
                entropies = teacher_forced_entropies(llm, ids)[: len(ids) // size * size]
                per_page.append(torch.stack(page_uncertainty(entropies.view(-1, size)), dim=-1))
        if not per_page:
            raise SemkvError(f"the calibration texts hold no full page of {size} tokens; give longer texts")
        pages = torch.cat(per_page)  # [pages, 2]
        entropy, varentropy = torch.quantile(pages, 0.99, dim=0).tolist()
        return {"entropy": entropy, "varentropy": varentropy, "percentile": 99, "block_size": size,
                "pages": pages.shape[0]}

    # -- page vectors ---------------------------------------------------------------------------------------------
    def window_size(self) -> int:
        return self.query_window if self.anchor == "queries" else 0

    def evict_prefill(self, layer: int, seq: Sequence, q_window: torch.Tensor) -> None:
        """anchor="queries": this layer's attention of the prompt window q_window [w, heads, D] to each page (nothing
        is evicted)."""
        if self.anchor == "queries":
            self._page_mass(seq, [layer], [q_window])
        return None

    def evict_prefill_layers(self, seq: Sequence, q_windows: list[torch.Tensor]) -> list[None]:
        """anchor="queries": every layer's attention of the prompt window to each page in a few calls
        (`layers_window_mass`; nothing is evicted)."""
        if self.anchor == "queries":
            self._page_mass(seq, list(range(len(q_windows))), q_windows)
        return [None] * len(q_windows)

    def _page_mass(self, seq: Sequence, layers: list[int], q_windows: list[torch.Tensor]) -> None:
        """The prompt window's attention to each page in `layers` (consecutive; q_windows [w, heads, D] each): the
        window's mean summed over the heads and the page's tokens, into `ChessState.page_mass`'s rows [layers, pages],
        a `layer_groups` group a call."""
        kv, st = seq.kv, seq.method_state
        query_positions, w = window_positions(seq, q_windows[0]), q_windows[0].shape[0]
        size, n = self.block_size, kv.num_slots[layers[0]]
        if st.page_mass is None:
            st.page_mass = torch.zeros(kv.pool.num_layers, -(-n // size), device=query_positions.device)
        for group in layer_groups(kv, layers):
            windows = q_windows[group[0] - layers[0] : group[-1] + 1 - layers[0]]
            mass = layers_window_mass(kv, group, windows, query_positions).sum(1) / w  # [G, n]
            st.page_mass[group[0] : group[-1] + 1] = F.pad(mass, (0, -n % size)).view(len(group), -1, size).sum(-1)

    def finish_prefill(self, seq: Sequence) -> None:
        self.warn_if_nothing_selected(seq.kv.num_slots[0])
        if self.anchor == "queries":  # the pages' scores are final (summed over the layers): no page vectors
            seq.method_state.page_mass = seq.method_state.page_mass.sum(0)
            return
        for layer in range(seq.kv.pool.num_layers):
            self.summaries.build(seq.kv, layer)
        seq.method_state.summarized = seq.kv.num_slots[0]

    def warn_if_nothing_selected(self, prompt_tokens: int) -> None:
        """Warn when the budget at this prompt cannot hold a selected page: the recent window (up to `recent_pages`
        pages) and the sink page come first, so a page more needs (recent_pages + 2) * block_size tokens. Such a
        request attends only the window and the sink, as StreamingLLM would (the paper's aggressive setting, 1%, is
        82 tokens at 8k)."""
        tokens, least = resolve_budget(self.budget, prompt_tokens + 1), (self.recent_pages + 2) * self.block_size
        if tokens < least and tokens < prompt_tokens + 1:
            budget = self.budget
            where = f" at prompts under {math.ceil(least / budget)} tokens" if isinstance(budget, float) else ""
            warnings.warn(f"chess: budget={budget!r} leaves no page to select{where}: the recent window (up to "
                          f"{self.recent_pages * self.block_size} tokens) and the sink page ({self.block_size}) come "
                          f"first, and one page more needs {least} tokens; such a request attends only the window "
                          f"and the sink, as StreamingLLM. Give a budget of at least {least} tokens.", stacklevel=2)

    @staticmethod
    def stacked_tables(seqs: list[Sequence], kv_pages: int) -> torch.Tensor:
        """The first `kv_pages` columns of each sequence's page tables: [b, layers, kv_pages] (0, the scratch page,
        past a table's end)."""
        return torch.stack([s.kv.table[:, :kv_pages] if s.kv.table.shape[1] >= kv_pages else
                            F.pad(s.kv.table, (0, kv_pages - s.kv.table.shape[1])) for s in seqs])

    def fold(self, seqs: list[Sequence], upto: list[int], tables: torch.Tensor | None = None) -> None:
        """Bring the page sums of each sequence up to its first `upto` tokens, in every layer (the keys of tokens
        generated since the last fold; only a selection reads the sums), all sequences in one rebuild. tables:
        `stacked_tables` covering the tokens, if the caller has them."""
        size = self.kv_page_size
        firsts = [seq.method_state.summarized // size for seq in seqs]  # first KV page holding new tokens
        if all(end <= seq.method_state.summarized for seq, end in zip(seqs, upto)):
            return
        width = max(-(-end // size) - first for end, first in zip(upto, firsts))
        if tables is None:
            tables = self.stacked_tables(seqs, max(firsts) + width)
        device, pool = tables.device, seqs[0].kv.pool
        first, end = pool.staging.send([firsts, upto])  # [2, b], in a copy that does not wait for the device
        cols = first[:, None] + torch.arange(width, device=device)  # [b, width]
        filled = (end[:, None] - cols * size).clamp(0, size)  # 0: nothing written
        ids = torch.gather(tables, 2, cols.clamp(max=tables.shape[2] - 1)[:, None].expand(-1, tables.shape[1], -1))
        ids = torch.where((cols < tables.shape[2])[:, None], ids, pool.scratch)  # past the tables: nothing to fold
        self.summaries.rebuild(pool, ids, filled[:, None].expand_as(ids))
        for seq, end in zip(seqs, upto):
            seq.method_state.summarized = max(seq.method_state.summarized, end)

    def page_sums(self, seqs: list[Sequence], summarized: torch.Tensor, pages: torch.Tensor, n_pages: int,
                  tables: torch.Tensor | None = None):
        """Eq. 1's numerators for pages [b, m] (all below `n_pages`) of each sequence, the first `summarized` [b]
        tokens summarised: the physical ids of their KV pages [b, layers, m * per_page] (their sums are stale where
        nothing is summarised: mask with the counts), the tokens summarised in each KV page [b, m * per_page] and in
        each page [b, m]."""
        size, per_page = self.kv_page_size, self.block_size // self.kv_page_size
        b, m = pages.shape
        cols = (pages[..., None] * per_page + torch.arange(per_page, device=pages.device)).flatten(1)  # [b, m * pp]
        if tables is None:
            tables = self.stacked_tables(seqs, n_pages * per_page)
        physical = torch.gather(tables, 2, cols[:, None].expand(-1, tables.shape[1], -1))  # [b, layers, m * pp]
        filled = (summarized[:, None] - cols * size).clamp(0, size)  # [b, m * pp]
        return physical, filled, filled.view(b, m, -1).sum(-1)

    def mean_vector(self, seqs: list[Sequence], summarized: torch.Tensor, pages: torch.Tensor,
                    chosen: torch.Tensor, n_pages: int, tables: torch.Tensor | None = None) -> torch.Tensor:
        """The mean of the page vectors (Eq. 1) of the `chosen` [b, m] non-empty pages among `pages` [b, m] (all
        below `n_pages`): [b, layers, kv_heads, D]."""
        physical, filled, counts = self.page_sums(seqs, summarized, pages, n_pages, tables)
        chosen = chosen & (counts > 0)
        weights = chosen / counts.clamp(min=1) / chosen.sum(1, keepdim=True).clamp(min=1)  # [b, m]
        weights = weights.repeat_interleave(self.block_size // self.kv_page_size, -1)  # [b, m * pp] per KV page
        live = (filled > 0)[..., None, None, None]  # stale sums (even NaN) of unfilled KV pages
        pool, (b, layers, w) = seqs[0].kv.pool, physical.shape
        step = max(1, (1 << 30) // (b * w * 4 * pool.num_kv_heads * pool.head_dim))  # layers per gather (< 1 GiB)
        means = []
        for lo in range(0, layers, step):
            sums = self.summaries.gather("sum", physical[:, lo : lo + step].transpose(1, 2))  # [b, w, step, heads, D]
            means.append(torch.einsum("bwlhd,bw->blhd", torch.where(live, sums, 0.0), weights))
        return torch.cat(means, 1)

    def page_dots(self, seqs: list[Sequence], summarized: torch.Tensor, n_pages: int,
                  directions: torch.Tensor, tables: torch.Tensor | None = None) -> torch.Tensor:
        """Dot products of the page vectors (Eq. 1) of pages [0, n_pages) with `directions` [b, r, layers, kv_heads,
        D]: the page sums of every layer are read in place through the page ids (`kernels.summary_dots`; the
        vectors of all pages, layers flattened, are never built), then divided by the pages' counts: [b, r, n_pages].
        With tensor parallelism the dot products add every rank's KV heads."""
        b, r = directions.shape[:2]
        pages = torch.arange(n_pages, device=directions.device).expand(b, -1)
        physical, filled, counts = self.page_sums(seqs, summarized, pages, n_pages, tables)
        dots = chess_kernels.summary_dots(self.summaries.data["sum"], physical, directions)  # [b, w, r]
        dots = dots.masked_fill((filled == 0)[..., None], 0.0)  # stale sums (even NaN) of unfilled KV pages
        return reduce(self.tp, dots.view(b, n_pages, -1, r).sum(2).transpose(1, 2) / counts.clamp(min=1)[:, None])

    # -- decode ---------------------------------------------------------------------------------------------------
    def selection_width(self, max_slots: int) -> int:
        return min(resolve_budget(self.budget, max_slots), max_slots)

    @property
    def plans_ahead(self) -> bool:
        """A re-selection is asked for by `observe_logits` (run as a step is launched) and made from the device's
        keys and the host's slot counts: the plan needs nothing of the last step's end."""
        return True

    def step_plan(self, batch: DecodeBatch) -> "PagePlan":
        """Re-select where pending; the plan is each sequence's kept pages, best first, and its window start."""
        states: list[ChessState] = [s.method_state for s in batch.seqs]
        redo = [s for s, st in zip(batch.seqs, states) if st.pending]
        if redo:
            self.reselect(redo)
        key = tuple(st.selection_id for st in states)
        if self._plan is None or self._plan[0] != key:
            width = max(1, max(st.ranked.shape[0] for st in states))
            pages = torch.stack([F.pad(st.ranked, (0, width - st.ranked.shape[0]), value=-1) for st in states])
            window = batch.seqs[0].kv.pool.staging.send([st.window_start for st in states])  # [b], does not wait
            self._plan = key, PagePlan(pages, window)
        return self._plan[1]

    def plan_buffers(self, size: int, max_slots: int, device: torch.device) -> "PagePlan":
        return PagePlan.static(size, device, {"pages": self.selection_width(max_slots) // self.block_size + 1})

    def plan_selection(self, batch: DecodeBatch, plan: "PagePlan") -> Selection:
        """One page set for every layer and head of the step (`plan_slots`; compiled into a few kernels on CUDA)."""
        n = batch.num_slots[:, 0]  # [b] selection methods store every token in every layer
        slots, lengths = plan_slots_function(n.device)(n, plan.window, plan.pages, self.budget,
                                                       self.block_size, self.selection_width(batch.max_slots))
        return Selection(slots[:, None], lengths[:, None])

    def page_scores(self, seqs: list[Sequence], summarized: torch.Tensor, start: torch.Tensor, n_pages: torch.Tensor,
                    candidates: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Each page's score [b, width] (n_pages [b]: each sequence's pages): its affinity with the recent window's
        mean key (Eq. 3-4, centred if asked), or with anchor="queries" the prompt window's attention to it,
        max-pooled over `neighbours` pages on either side (pages past the prompt score 0)."""
        b, width = candidates.shape
        if self.anchor == "queries":
            masses = [seq.method_state.page_mass for seq in seqs]
            scores = reduce(self.tp, torch.stack([F.pad(m, (0, width - m.shape[0])) for m in masses]))  # [b, width]
            return neighbour_max(scores, self.neighbours)
        device = candidates.device
        window = (start[:, None] + torch.arange(self.recent_pages, device=device)).clamp(max=width - 1)
        anchor = self.mean_vector(seqs, summarized, window, window < n_pages[:, None], width,
                                  tables)  # Eq. 3: [b, layers, kv_heads, D]
        if not self.center:
            return self.page_dots(seqs, summarized, width, anchor[:, None], tables)[:, 0]  # Eq. 4
        # (v - mean) . (anchor - mean)
        page = torch.arange(width, device=device)[None, :].expand(b, -1)
        mean = self.mean_vector(seqs, summarized, page, candidates, width, tables)
        dots = self.page_dots(seqs, summarized, width, torch.stack([anchor, mean], 1), tables)
        return dots[:, 0] - dots[:, 1] + reduce(self.tp, ((mean - anchor) * mean).sum((1, 2, 3)))[:, None]

    def reselect(self, seqs: list[Sequence]) -> None:
        """Algorithm 1 for the given sequences at once; nothing is read back from the device (the plan takes the kept
        pages as a fixed-width tensor), so the host only queues the work."""
        size = self.block_size
        counts = [s.kv.num_slots[0] for s in seqs]  # the current token included: its keys are not written yet
        n_pages = [-(-c // size) for c in counts]
        starts = [max(p - self.recent_pages, 0) for p in n_pages]  # first page of the recent window
        width = max(n_pages)
        tables = self.stacked_tables(seqs, width * (size // self.kv_page_size))
        if self.anchor == "keys":
            self.fold(seqs, [c - 1 for c in counts], tables)
        device = tables.device
        n, start, pages = seqs[0].kv.pool.staging.send([counts, starts, n_pages])  # [b] each, one copy: no wait
        summarized = n - 1
        _, _, k = safety(n, budget_tokens(self.budget, n), start, size)
        page = torch.arange(width, device=device)[None, :]
        candidates = (page >= 1) & (page < start[:, None])  # neither the sink page nor the window
        scores = self.page_scores(seqs, summarized, start, pages, candidates, tables)  # [b, width]
        share = k / candidates.sum(1).clamp(min=1)
        rho = cascade_ratios(PRESETS[self.preset], share)
        keep = cascade(scores, candidates, self.chunk_pages, self.grid_chunks, rho, k)
        most = min(self.selection_width(max(counts)) // size + 1, width)  # k <= budget // block_size everywhere
        ranked = scores.masked_fill(~keep, float("-inf")).argsort(dim=-1, descending=True, stable=True)[:, :most]
        ranked = torch.where(keep.gather(1, ranked), ranked, -1)  # [b, most] kept pages best first, then -1
        for i, seq in enumerate(seqs):
            st: ChessState = seq.method_state
            seq.stats.extra["reselections"] += st.ranked is not None
            st.ranked, st.selection_id, st.window_start = ranked[i], next(_selections), starts[i]
            st.pages_since, st.pending = 0, False

    def observe_logits(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Track uncertainty per page of generated tokens: the entropies stay on the device until a page ends. With
        anchor="queries" the one selection after prefill stands."""
        if self.anchor == "queries":
            return
        if self.mode == "always":
            for seq in seqs:
                seq.method_state.pending = True
            return
        entropies = token_entropy(logits).unbind() if self.mode == "dynamic" else None  # [b] 0-d tensors
        ended = []
        for b, seq in enumerate(seqs):
            st: ChessState = seq.method_state
            st.page_tokens += 1
            if entropies is not None:
                st.entropies.append(entropies[b])
            if st.page_tokens == self.block_size:
                st.page_tokens, st.pages_since = 0, st.pages_since + 1
                ended.append(st)
        if self.mode == "periodic":
            for st in ended:
                st.pending = st.pages_since >= self.period
        elif ended:  # one read of the ended pages' entropies
            means, variances = page_uncertainty(torch.stack([torch.stack(st.entropies) for st in ended]))
            for st, mean, var in zip(ended, means.tolist(), variances.tolist()):
                st.entropies.clear()
                st.pending = self.uncertain(mean, var)

    def uncertain(self, mean_entropy: float, varentropy: float) -> bool:
        above = (mean_entropy > self.thresholds[0], varentropy > self.thresholds[1])
        return any(above) if self.trigger == "any" else all(above)
