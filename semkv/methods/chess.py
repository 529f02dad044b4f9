"""CHESS: hierarchical Grid -> Chunk -> Page selection by key-key affinity, re-selected when the model grows uncertain
("CHESS: Context-aware Hierarchical Efficient Semantic Selection for Long-Context LLM Inference", 2026,
https://arxiv.org/abs/2602.20732).

Every page of `page_size` tokens is summarised by the mean of its keys, flattened over all layers and KV heads (Eq. 1);
chunks of `chunk_pages` pages and grids of `grid_chunks` chunks are logical views whose vectors are means of their
children (Eq. 2). The anchor is the mean vector of the last `window` pages (Eq. 3); one matrix product scores grids,
chunks and pages against it (Eq. 4) and a coarse-to-fine cascade keeps the top grids, then the top chunks inside them,
then the top pages inside those (Algorithm 1). One page set serves every layer and head; the first page (attention
sinks) and the recent window are always attended. The set is kept until the model's uncertainty over a page of
generated tokens (mean entropy or varentropy) crosses thresholds calibrated offline (section 3.3, Appendix C).

Budget: a decode step attends to at most `budget` tokens, recent window first, then the sink page, then
`k = (budget - recent - sink) // page_size` selected pages. The budget sets rho_p (k pages among those the grid and
chunk levels leave) with the preset's rho_g, rho_c; where k exceeds the preset's rho_g * rho_c share of the candidate
pages, rho_g and rho_c are raised by a common power until their product is that share, so a budget at least the
context makes every ratio 1.0 (Full KV). `budget=rho_g*rho_c*rho_p` as a fraction reproduces a Table 1 setting.

Parameters
----------
budget: attended tokens per step (shared by every layer and KV head); a float is a fraction of the context.
preset: (rho_g, rho_c) from Table 1: "conservative" (0.9, 0.9), "moderate" (0.8, 0.7), "aggressive" (0.5, 0.2);
    default "moderate" (the paper's rho_p of each preset, 0.9 / 0.7 / 0.1, is replaced by the budget).
page_size: B, tokens per page; 32 (the paper's setting); a multiple of the engine's KV page size.
chunk_pages: N_c, pages per chunk; 4, chosen by ablation (benchmarks/chess_eval.py ablation; the paper gives none).
grid_chunks: N_g, chunks per grid; 4, chosen by the same ablation.
window: W, recent pages that form the anchor and are always attended; 2 (the paper gives no value: two pages hold
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
entropy_threshold, varentropy_threshold: override the calibrated thresholds (nats, nats^2); None reads
    `semkv calibrate --method chess` for the model, else the defaults below (the embedded SmolLM2 calibrated on the
    shared Paul Graham essays, 99th percentiles over 32-token pages).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F

from semkv.engine.sequence import Sequence
from semkv.errors import SemkvError
from semkv.methods import calibration
from semkv.methods.base import DecodeBatch, KVMethod, Selection, check_range, resolve_budget
from semkv.methods.cascade import cascade, cascade_ratios, top_mask
from semkv.methods.page_summaries import PageSummaries
from semkv.methods.uncertainty import page_uncertainty, teacher_forced_entropies, token_entropy
from semkv.models.rotary import RotaryEmbedding

PRESETS = {"conservative": (0.9, 0.9), "moderate": (0.8, 0.7), "aggressive": (0.5, 0.2)}
MODES = ("dynamic", "periodic", "always")
# `semkv calibrate --method chess` of the embedded SmolLM2-135M-Instruct on the essays worked, popular, gap and gh
# (4096 tokens each: 512 pages of 32 tokens)
DEFAULT_THRESHOLDS = {"entropy": 3.84, "varentropy": 3.50}


@dataclass
class ChessState:
    scores: torch.Tensor | None = None  # [pages at the last selection] score of each selected page, -inf elsewhere
    window_start: int = 0  # first page of the recent window (fixed between selections, so the window grows)
    entropies: list[float] = field(default_factory=list)  # of the generated tokens of the current page
    pages_since: int = 0  # generated pages since the last selection
    pending: bool = True  # select at the next step


@dataclass
class Chess(KVMethod):
    preset: str = "moderate"
    page_size: int = 32
    chunk_pages: int = 4
    grid_chunks: int = 4
    window: int = 2
    mode: str = "dynamic"
    period: int = 6
    trigger: str = "any"
    rope_free: bool = False
    center: bool = False
    entropy_threshold: float | None = None
    varentropy_threshold: float | None = None

    kind = "selection"
    graph_safe = True  # the step's selection is decided before the forward and copied into the graph's buffers
    name = "chess"
    summary = "CHESS: grid->chunk->page cascade by key-key affinity with the recent pages, re-selected on uncertainty"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, value, allowed in (("preset", self.preset, tuple(PRESETS)), ("mode", self.mode, MODES),
                                     ("trigger", self.trigger, ("any", "both"))):
            if value not in allowed:
                raise SemkvError(f"{name}={value!r}; allowed: {', '.join(map(repr, allowed))}")
        check_range("page_size", self.page_size, 1, 256, int)
        check_range("chunk_pages", self.chunk_pages, 1, 1024, int)
        check_range("grid_chunks", self.grid_chunks, 1, 1024, int)
        check_range("window", self.window, 1, None, int)
        check_range("period", self.period, 1, None, int)
        check_range("rope_free", self.rope_free, types=bool)
        check_range("center", self.center, types=bool)
        for name in ("entropy_threshold", "varentropy_threshold"):
            if getattr(self, name) is not None:
                check_range(name, getattr(self, name), 0.0, None)
        self.summaries = PageSummaries(("sum",), self.unrotate if self.rope_free else None)
        self.rotary: RotaryEmbedding | None = None

    def bind(self, model, tokenizer, page_size: int) -> None:
        super().bind(model, tokenizer, page_size)
        if self.page_size % page_size:
            raise SemkvError(f"page_size={self.page_size} must be a multiple of the engine's KV page size "
                             f"{page_size}; allowed: {page_size}, {2 * page_size}, ...")
        found = dict(DEFAULT_THRESHOLDS, **(calibration.load("chess", model.source) or {}))
        given = (self.entropy_threshold, self.varentropy_threshold)
        self.thresholds = tuple(found[k] if v is None else v for k, v in zip(("entropy", "varentropy"), given))

    def unrotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys [..., D] stored at `positions` [...] -> the keys before RoPE (up to RoPE's constant scaling)."""
        if self.rotary is None or self.rotary.device != keys.device:
            self.rotary = RotaryEmbedding(self.model.hf_config, self.model.head_dim, keys.device)
        cos, sin = self.rotary.cos_sin(positions.flatten().long(), torch.float32)
        return RotaryEmbedding.rotate(keys.reshape(-1, 1, keys.shape[-1]), cos, -sin).view_as(keys)

    def new_state(self, seq: Sequence) -> ChessState:
        seq.stats.extra["reselections"] = 0
        return ChessState()

    @classmethod
    def calibrate(cls, llm: Any, texts: list[str], max_tokens: int) -> dict[str, Any]:
        """99th percentiles of the mean entropy and the varentropy of next-token distributions over pages of the
        texts (teacher-forced with Full KV), as in section 5.1."""
        size = next(f.default for f in fields(cls) if f.name == "page_size")
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
        return {"entropy": entropy, "varentropy": varentropy, "percentile": 99, "page_size": size,
                "pages": pages.shape[0]}

    # -- page vectors ---------------------------------------------------------------------------------------------
    def finish_prefill(self, seq: Sequence) -> None:
        for layer in range(seq.kv.pool.num_layers):
            self.summaries.build(seq.kv, layer)

    def page_vectors(self, seqs: list[Sequence], summarized: torch.Tensor, n_pages: int) -> torch.Tensor:
        """Eq. 1 for pages [0, n_pages) of each sequence: the mean of the `summarized` [b] first tokens' keys per page,
        every layer reading the key sums of its own physical pages -> [b, n_pages, layers * kv_heads * head_dim]."""
        size, pool = self.kv_page_size, seqs[0].kv.pool
        per_page = self.page_size // size
        width = n_pages * per_page
        tables = torch.stack([F.pad(s.kv.table[:, :width], (0, max(width - s.kv.table.shape[1], 0))) for s in seqs])
        first = torch.arange(width, device=pool.device) * size  # first token of each KV page
        filled = (summarized[:, None] - first).clamp(0, size)  # [b, width] summarized tokens in each KV page
        sums = self.summaries.gather("sum", tables)  # [b, layers, width, kv_heads, D]
        sums = torch.where(filled[:, None, :, None, None] > 0, sums, 0.0)  # unfilled pages hold stale sums
        b, layers, _, heads, dim = sums.shape
        sums = sums.view(b, layers, n_pages, per_page, heads, dim).sum(3).permute(0, 2, 1, 3, 4)
        counts = filled.view(b, n_pages, per_page).sum(-1)  # [b, n_pages]
        return sums.reshape(b, n_pages, -1) / counts.clamp(min=1)[..., None]

    # -- decode ---------------------------------------------------------------------------------------------------
    def selection_width(self, max_slots: int) -> int:
        return min(resolve_budget(self.budget, max_slots), max_slots)

    def safety(self, n: torch.Tensor, budget: torch.Tensor, start: torch.Tensor):
        """Recent and sink tokens attended, and pages left for the selection, under the budget (all [b])."""
        size = self.page_size
        recent = torch.minimum(n - start * size, budget)
        sink = torch.minimum(start.clamp(max=1) * size, budget - recent)
        return recent, sink, (budget - recent - sink) // size

    def step_selection(self, batch: DecodeBatch) -> Selection:
        """One page set for every layer and head of the step (the vectors span all layers)."""
        n = batch.num_slots[:, 0]  # [b] selection methods store every token in every layer
        budget = torch.tensor([resolve_budget(self.budget, int(x)) for x in n.tolist()], device=n.device)
        states: list[ChessState] = [s.method_state for s in batch.seqs]
        redo = [i for i, st in enumerate(states) if st.pending]
        if redo:
            self.reselect([batch.seqs[i] for i in redo], n[redo], budget[redo])
        start = torch.tensor([st.window_start for st in states], device=n.device)
        recent, sink, k = self.safety(n, budget, start)
        width = max(st.scores.shape[0] for st in states)
        scores = torch.stack([F.pad(st.scores, (0, width - st.scores.shape[0]), value=float("-inf")) for st in states])
        pages = top_mask(scores, scores > float("-inf"), k)  # the best k of the selection: the window may have grown
        slot = torch.arange(int(n.max()), device=n.device)
        mask = pages.repeat_interleave(self.page_size, -1)
        mask = F.pad(mask, (0, max(slot.shape[0] - mask.shape[1], 0)))[:, : slot.shape[0]]
        mask = mask | (slot < sink[:, None]) | ((slot >= (n - recent)[:, None]) & (slot < n[:, None]))
        return Selection.from_mask(mask[:, None])

    def reselect(self, seqs: list[Sequence], n: torch.Tensor, budget: torch.Tensor) -> None:
        size = self.page_size
        n_pages = -(-n // size)  # [b]
        start = (n_pages - self.window).clamp(min=0)
        _, _, k = self.safety(n, budget, start)
        width = int(n_pages.max())
        vectors = self.page_vectors(seqs, n - 1, width)  # the current token's keys are folded in at end_step
        page = torch.arange(width, device=n.device)[None, :]
        counts = (n[:, None] - 1 - page * size).clamp(0, size)
        recent = (page >= start[:, None]) & (counts > 0)
        anchor = (vectors * recent[..., None]).sum(1) / recent.sum(1, keepdim=True).clamp(min=1)  # Eq. 3
        candidates = (page >= 1) & (page < start[:, None])
        if self.center:
            mean = (vectors * candidates[..., None]).sum(1) / candidates.sum(1, keepdim=True).clamp(min=1)  # [b, dim]
            vectors, anchor = vectors - mean[:, None], anchor - mean
        share = k / candidates.sum(1).clamp(min=1)
        rho = cascade_ratios(PRESETS[self.preset], share)
        keep, scores = cascade(vectors, candidates, anchor, self.chunk_pages, self.grid_chunks, rho, k)
        kept_scores = scores.masked_fill(~keep, float("-inf"))
        for i, seq in enumerate(seqs):
            st: ChessState = seq.method_state
            seq.stats.extra["reselections"] += st.scores is not None
            st.scores, st.window_start = kept_scores[i, : int(n_pages[i])], int(start[i])
            st.pages_since, st.pending = 0, False

    def end_step(self, batch: DecodeBatch, logits: torch.Tensor, tokens: list[int]) -> None:
        """Fold the step's keys (now written in every layer) into the page sums; track uncertainty per page."""
        pool = batch.seqs[0].kv.pool
        width = max(s.kv.table.shape[1] for s in batch.seqs)
        tables = torch.stack([F.pad(s.kv.table, (0, width - s.kv.table.shape[1])) for s in batch.seqs])
        slots = (batch.num_slots.to(tables.device) - 1).flatten()[:, None].expand(-1, pool.num_kv_heads)
        self.summaries.add_tokens(pool, tables.flatten(0, 1), slots)  # every (sequence, layer) at once
        for seq, entropy in zip(batch.seqs, token_entropy(logits).tolist()):
            st: ChessState = seq.method_state
            st.entropies.append(entropy)
            if self.mode == "always":
                st.pending = True
            elif len(st.entropies) == self.page_size:
                st.pages_since += 1
                mean, var = page_uncertainty(torch.tensor(st.entropies))
                st.entropies.clear()
                if self.mode == "periodic":
                    st.pending = st.pages_since >= self.period
                else:
                    st.pending = self.uncertain(float(mean), float(var))

    def uncertain(self, mean_entropy: float, varentropy: float) -> bool:
        above = (mean_entropy > self.thresholds[0], varentropy > self.thresholds[1])
        return any(above) if self.trigger == "any" else all(above)
