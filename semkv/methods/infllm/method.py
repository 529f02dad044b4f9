"""InfLLM: initial tokens, a local window and the most relevant memory blocks (Xiao et al., 2024, "InfLLM: Training-Free
Long-Context Extrapolation for LLMs with an Efficient Context Memory", https://arxiv.org/abs/2402.04617).

The context beyond the initial and local tokens is a memory of blocks of `block_size` tokens, each represented by its
`n_repr` representative tokens: the tokens whose keys received the highest attention scores from the queries of the
local window when the block left it. At each decode step the query scores every block by its dot product with the
mean of the block's representative keys, and the layer attends to the initial tokens, the top blocks and the local
window. All K/V stay stored; only attention is sparse.

Readings of the paper and its reference code:
- Representative score of token m (paper, Sec. 3.2): r_m = sum over the W queries after it, q_{m+j} . k_m, j = 1..W,
  with W the local window; summed over the query heads of its KV group (GQA). A block is formed, and its
  representatives fixed, once its last token has been seen by W later queries, at the end of that step: it is a
  candidate from the next step on. The reference code sums softmax
  probabilities instead of dot products; the ranking inside a block differs only through the softmax normaliser.
- Blocks are the fixed logical slot ranges [i * block_size, (i + 1) * block_size) (page aligned when block_size is a
  multiple of the page size); the initial tokens overlap the first blocks and blocks inside them are not candidates.
- Block score: mean over the group's query heads and the representatives of q . k. One set of blocks per layer
  (summed over KV heads, as the reference code does by default) or per KV head (`per_head=True`, its `perhead`).
- Prefill is dense: the budget binds decode steps (the paper also applies the memory to prompt chunks, for length
  extrapolation; keys keep their original positions here, no position re-assignment).
- Budget split (the paper's 128 initial + 4096 local + top-k x 128 assume budgets of several thousand tokens): with
  budget B, init = min(n_sink, floor(B * init_ratio)); the local window gets at least
  min(n_recent, floor(B * local_ratio)) (at least 1: the current token); whole blocks take as much of the rest as there
  are formed candidates; the local window absorbs what is left. Attended = init + blocks + local <= B. W is the local
  minimum resolved at the prompt length.

Decoding is batched and captured in CUDA graphs. The representative scores and the block keys live beside the KV pool
(`page_storage`), by physical page, and are read through the page tables. Each layer scores the formed blocks with
the paged dot-product kernel (the block keys are laid out like a cache of blocks) and builds each row's slot list
from tensors alone. Once per step, at the last layer, the memory of every layer is updated at once: the band of keys
in each query's window gets its scores, and the block that has just left the window is formed (formed again at every
step until the next one leaves: idempotent, so no host flag is needed).
A block is stored at the page holding its first slot, so `block_size` must divide or be a multiple of the engine's KV
page size. W is per sequence (a fractional budget resolves it at the prompt length) and reaches the graph as the
step plan.

Parameters
----------
budget: attended tokens per KV head and layer (int) or fraction of the current context (float).
n_sink: initial tokens, 128 (the paper's n_init). n_recent: local window, 4096 (the paper's n_local).
block_size: 128 (paper).
n_repr: representative tokens per block, 4 (paper).
init_ratio: largest share of the budget for initial tokens, 0.125.
local_ratio: share of the budget guaranteed to the local window, 0.25 (TokenSelect's evaluation of InfLLM used 2K
    selected + 512 local tokens, i.e. 20%).
per_head: each KV head selects its own blocks (False: one set per layer, the reference code's default).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from semkv import kernels
from semkv.engine.hooks import DecodeBatch, KVMethod, Selection, StepPlan, budget_tokens, resolve_budget
from semkv.engine.kv_cache import KVPool
from semkv.engine.sequence import Sequence
from semkv.errors import SemkvError, check_range
from semkv.kernels import reference
from semkv.methods.infllm import kernels as infllm_kernels
from semkv.methods.state.page_storage import PageStorage, slot_scores
from semkv.models.parallel import over_heads


@dataclass
class InfLLMState:
    window: int  # W: queries after a key that score it


@dataclass
class RowSplit:
    """The budget split of each row of a decode step, [B] each: `InfLLM.split` at the row's context."""

    budget: torch.Tensor
    init: torch.Tensor
    most: torch.Tensor  # most blocks
    window: torch.Tensor  # W


def band_scores(q: torch.Tensor, keys: torch.Tensor, q_start: int, k_start: int, window: int,
                block: int = 1024) -> torch.Tensor:
    """Representative-score contributions: q [C, heads, D] at positions q_start.., keys [kv_heads, K, D] at k_start..
    -> [kv_heads, K], the sum over queries j and the group's heads of q_j . k_m for j - window <= m < j. Queries go
    `block` at a time against the keys their band reaches, so the workspace is [kv_heads, block, block + window],
    not [kv_heads, C, K] (7.6 GiB for a 32k prompt of Qwen2.5-0.5B in one chunk)."""
    kv_heads, n = keys.shape[0], q.shape[0]
    qg = q.float().view(n, kv_heads, -1, q.shape[-1]).sum(2).transpose(0, 1)  # [kv_heads, C, D]
    out = torch.zeros(kv_heads, keys.shape[1], device=q.device)
    for a in range(0, n, block):
        b = min(a + block, n)
        lo, hi = max(q_start + a - window - k_start, 0), min(q_start + b - 1 - k_start, keys.shape[1])
        if hi <= lo:
            continue
        dots = torch.matmul(qg[:, a:b], keys[:, lo:hi].float().transpose(1, 2))  # [kv_heads, b - a, hi - lo]
        j = torch.arange(q_start + a, q_start + b, device=q.device)[:, None]
        m = torch.arange(k_start + lo, k_start + hi, device=q.device)[None, :]
        out[:, lo:hi] += dots.masked_fill(~((m < j) & (m >= j - window)), 0.0).sum(1)
    return out


@dataclass
class WindowPlan(StepPlan):
    """InfLLM's step plan under a fractional budget: each sequence's W (padding rows: 1)."""

    window: torch.Tensor = field(metadata={"pad": 1})  # [B]


@dataclass
class InfLLM(KVMethod):
    n_sink: int = 128
    n_recent: int = 4096
    block_size: int = 128
    n_repr: int = 4
    init_ratio: float = 0.125
    local_ratio: float = 0.25
    per_head: bool = False

    name = "infllm"
    renamed = {"n_init": "n_sink", "n_local": "n_recent"}
    summary = "InfLLM: initial + local tokens and the top memory blocks by representative keys, each decode step"
    kind = "selection"
    graph_safe = True  # state beside the pool, the window in the step plan

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("n_sink", self.n_sink, 0, None, int)
        check_range("n_recent", self.n_recent, 1, None, int)
        check_range("block_size", self.block_size, 1, None, int)
        check_range("n_repr", self.n_repr, 1, self.block_size, int)
        check_range("init_ratio", self.init_ratio, 0.0, 1.0, (int, float))
        check_range("local_ratio", self.local_ratio, 0.0, 1.0, (int, float))
        check_range("per_head", self.per_head, types=bool)
        if self.init_ratio + self.local_ratio > 1.0:
            raise SemkvError(f"init_ratio + local_ratio = {self.init_ratio + self.local_ratio} must be <= 1")

    def reset(self) -> None:
        self.scores = slot_scores()  # r_m of every slot: [pages, page_size, kv_heads]
        # block keys at the page of each block's first slot, in the cache's dtype (1/32 of the K/V bytes with the
        # default 16-slot pages): [pages, blocks per page, kv_heads, D]
        size = self.block_size  # not `self` in the lambda: the method would hold itself in a cycle
        self.block_keys = PageStorage(lambda pool: (max(1, pool.page_size // size), pool.num_kv_heads,
                                                    pool.head_dim), pool_dtype=True)
        self._plan: tuple[list[Sequence], WindowPlan] | None = None
        self._rows: RowSplit | None = None  # of the step running, from layer 0
        self._queries: list[torch.Tensor] = []  # the step's queries so far, one [B, heads, D] per layer

    def release(self, seq: Sequence) -> None:
        self._plan = None

    def bind(self, model, tokenizer, page_size: int) -> None:
        super().bind(model, tokenizer, page_size)
        if self.block_size % page_size and page_size % self.block_size:
            raise SemkvError(f"block_size={self.block_size} must divide or be a multiple of the KV page size "
                             f"{page_size} (blocks are stored by page)")

    def split(self, budget: int) -> tuple[int, int, int]:
        """Budget -> (initial tokens, minimum local window, most blocks)."""
        local = max(1, min(self.n_recent, int(budget * self.local_ratio)))
        init = min(self.n_sink, int(budget * self.init_ratio), budget - local)
        return init, local, (budget - init - local) // self.block_size

    def new_state(self, seq: Sequence) -> InfLLMState | None:
        if self.budget is None:
            return None
        return InfLLMState(self.split(resolve_budget(self.budget, len(seq.prompt_ids)))[1])

    def admission_bytes(self, seq: Sequence) -> int:
        return self.scores.growth_bytes(seq.kv.pool) + self.block_keys.growth_bytes(seq.kv.pool)

    def page_state_bytes(self, pool: KVPool) -> int:
        return self.scores.bytes_per_page(pool) + self.block_keys.bytes_per_page(pool)

    def batch_state_bytes(self, seq: Sequence, batch: int) -> int:
        return 0  # its state is kept by page (`page_state_bytes`)

    def _storage(self, pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores [pages, page_size, kv_heads] and block keys, grown with the pool first (a move makes captured
        graphs be captured again)."""
        moved = self.scores.ensure(pool)
        if self.block_keys.ensure(pool) or moved:
            self.graph_epoch += 1
        return self.scores.data, self.block_keys.data

    # -- prefill ----------------------------------------------------------------------------------------------------
    def observe_prefill(self, layer: int, seq: Sequence, q: torch.Tensor, start: int,
                        lse: torch.Tensor | None) -> None:
        """Add the chunk's band contributions to the scores of the keys in its queries' windows (the chunk's own
        slots start at zero)."""
        if self.budget is None:
            return
        kv, window = seq.kv, seq.method_state.window
        scores = self._storage(kv.pool)[0].view(-1, kv.pool.num_kv_heads)  # [pages * page_size, kv_heads]
        lo, end = max(start - window, 0), start + q.shape[0]
        slots = torch.arange(lo, end, device=q.device)
        rows = kv.physical(layer, slots)
        keys = kv.gather(layer, slots[None])[0]  # [kv_heads, end - lo, D]
        old = torch.where((slots >= start)[:, None], 0.0, scores[rows])
        scores[rows] = old + band_scores(q, keys, start, lo, window).T

    def finish_prefill(self, seq: Sequence) -> None:
        """Form every block of the prompt that has left the last query's window."""
        if self.budget is None:
            return
        kv = seq.kv
        for layer in range(kv.pool.num_layers):
            formed = max(kv.num_slots[layer] - seq.method_state.window, 0) // self.block_size
            if formed:
                self._form_blocks(kv.pool, kv.table[layer][None], torch.arange(formed, device=kv.table.device)[None])

    def _form_blocks(self, pool: KVPool, tables: torch.Tensor, blocks: torch.Tensor) -> None:
        """Block keys of blocks [B, m] (index -1: none, written to the scratch page) of rows with tables [B,
        max_pages]: the mean of each KV head's `n_repr` best-scored keys of the block."""
        scores, block_keys = self._storage(pool)
        size, bs, heads = pool.page_size, self.block_size, pool.num_kv_heads
        kf = pool.flat()[0]  # [pages * page_size, kv_heads, D]
        slots = blocks.clamp(min=0)[..., None] * bs + torch.arange(bs, device=blocks.device)  # [B, m, bs]
        slots = slots.clamp(max=tables.shape[1] * size - 1)  # "no block" reads block 0, which may outrun a short table
        rows = reference.physical_rows(tables, slots, size)  # [B, m, bs] flat pool rows
        top = scores.view(-1, heads)[rows].topk(self.n_repr, dim=2).indices  # [B, m, n_repr, kv_heads]
        key_rows = torch.gather(rows[..., None].expand(-1, -1, -1, heads), 2, top)
        keys = kf[key_rows, torch.arange(heads, device=blocks.device)]  # [B, m, n_repr, kv_heads, D]
        first = torch.where(blocks >= 0, rows[..., 0] // size, pool.scratch)  # [B, m]
        block_keys[first, slots[..., 0] % size // bs] = keys.float().mean(2).to(block_keys.dtype)

    # -- decode -----------------------------------------------------------------------------------------------------
    @property
    def plans_ahead(self) -> bool:
        """The plan is each request's window, fixed when it is made: nothing of the last step's end."""
        return True

    def step_plan(self, batch: DecodeBatch) -> "WindowPlan | None":
        """Each sequence's W ([B], the same object while the batch is the same sequences) when the budget is a
        fraction; an int budget has one W for every sequence."""
        if not isinstance(self.budget, float):
            return None
        seqs = batch.seqs
        if self._plan is None or len(self._plan[0]) != len(seqs) or any(a is not b for a, b in zip(self._plan[0],
                                                                                                   seqs)):
            windows = torch.tensor([s.method_state.window for s in seqs], device=batch.positions.device)
            self._plan = (list(seqs), WindowPlan(windows))
        return self._plan[1]

    def plan_buffers(self, size: int, max_slots: int, device: torch.device) -> "WindowPlan | None":
        return WindowPlan.static(size, device) if isinstance(self.budget, float) else None

    def select(self, layer: int, batch: DecodeBatch, q: torch.Tensor) -> Selection | None:
        """Initial tokens, the top formed blocks and the local window, from the batch tensors alone (shapes from the
        capacity `batch.max_slots`, each row cut by its own budget). The rows' budget split is computed at layer 0
        and the memory of every layer is updated with the step's queries at the last layer, so both run once per
        step. q [B, heads, D]."""
        if self.budget is None:
            return None
        if layer == 0:
            self._rows, self._queries = self._row_split(batch), []
        self._queries.append(q)
        n = batch.num_slots[:, layer]  # [B] stored slots, the current token included
        # blocks formed by the end of the previous step: they left the window of an earlier query
        formed = (n - 1 - self._rows.window).clamp(min=0) // self.block_size  # [B]
        capacity = resolve_budget(self.budget, batch.max_slots)  # the largest budget of any row
        dense = not isinstance(self.budget, float) and capacity >= batch.max_slots
        if not dense and not batch.graphed:  # eager step: dense rows are known on the host
            dense = all(resolve_budget(self.budget, s.num_computed + 1) >= s.kv.num_slots[layer] for s in batch.seqs)
        selection = None if dense else self._selection(batch, batch.tables[:, layer], n, formed, capacity, q)
        if layer == batch.model.num_layers - 1:
            self._update_memory(batch, torch.stack(self._queries, 1), self.split(capacity)[1])
        return selection

    def _row_split(self, batch: DecodeBatch) -> "RowSplit":
        """`split` of each row's budget at its context, and its W."""
        budget = budget_tokens(self.budget, batch.positions + 1)  # [B] tokens per row at its context
        local_min = (budget.double() * self.local_ratio).floor().long().clamp(max=self.n_recent).clamp(min=1)
        init = torch.minimum((budget.double() * self.init_ratio).floor().long().clamp(max=self.n_sink),
                             budget - local_min)
        if isinstance(self.budget, float):
            window = batch.step_plan.window
        else:
            window = torch.full_like(budget, self.split(self.budget)[1])
        return RowSplit(budget, init, (budget - init - local_min) // self.block_size, window)

    def _update_memory(self, batch: DecodeBatch, queries: torch.Tensor, widest: int) -> None:
        """Every layer at once, with the step's queries [B, layers, heads, D]: add the band scores, then form the
        block that has left the window. `widest`: the largest W of any row."""
        layers = queries.shape[1]
        tables = batch.tables.flatten(0, 1)  # [B * layers, max_pages]
        n = batch.num_slots.flatten()  # [B * layers]
        window = self._rows.window.repeat_interleave(layers)
        self._score_band(batch.pool, tables, n, window, widest, queries.flatten(0, 1))
        formed = (n - window).clamp(min=0) // self.block_size
        self._form_blocks(batch.pool, tables, (formed - 1)[:, None])

    def _score_band(self, pool: KVPool, tables: torch.Tensor, n: torch.Tensor, window: torch.Tensor, widest: int,
                    q: torch.Tensor) -> None:
        """scores[m] += sum over the group's heads of q . k_m for the keys n - 1 - W <= m < n - 1 of each row; the
        current token's slot n - 1 starts at zero. `widest`: the largest W of any row."""
        scores = self._storage(pool)[0]
        size, heads = pool.page_size, pool.num_kv_heads
        batch = q.shape[0]
        lo = (n - 1 - window).clamp(min=0)  # [B]
        index = (lo // size)[:, None] + torch.arange(-(-(widest + 1) // size) + 1, device=n.device)  # [B, P]
        held = index * size < n[:, None]
        pages = torch.where(held, torch.gather(tables, 1, index.clamp(max=tables.shape[1] - 1)), pool.scratch)
        width = pages.shape[1] * size
        dots = kernels.paged_dot(q, pool.k, pages, torch.arange(width, device=n.device))  # [B, heads, width]
        dots = dots.view(batch, heads, -1, width).sum(2).transpose(1, 2)  # [B, width, kv_heads]
        m = (index[..., None] * size + torch.arange(size, device=n.device)).flatten(1)  # [B, width] logical slots
        in_band = ((m >= lo[:, None]) & (m < (n - 1)[:, None]))[..., None]
        current = (m == (n - 1)[:, None])[..., None]
        old = scores[pages].flatten(1, 2)  # [B, width, kv_heads]
        new = torch.where(current, 0.0, old + torch.where(in_band, dots, 0.0))
        scores[pages] = new.view(batch, -1, size, heads)

    def _selection(self, batch: DecodeBatch, tables: torch.Tensor, n: torch.Tensor, formed: torch.Tensor,
                   capacity: int, q: torch.Tensor) -> Selection:
        """Each row's initial tokens, top blocks and local window as ascending slots [B, S, capacity]."""
        bs, heads, device = self.block_size, batch.pool.num_kv_heads, n.device
        rows = self._rows
        budget, init = rows.budget, rows.init
        chosen = torch.minimum(rows.most, (formed - init // bs).clamp(min=0))  # blocks before init // bs lie inside
        chosen = torch.where(budget >= n, 0, chosen)  # [B] blocks each row takes; a dense row takes none
        local = budget - init - chosen * bs  # [B]
        candidates = batch.max_slots // bs  # blocks any row may have formed
        blocks = min(self.split(capacity)[2], candidates)
        top = torch.zeros(n.shape[0], heads if self.per_head else 1, 0, dtype=torch.long, device=device)
        if blocks:
            # the block-key storage is a paged "cache" of blocks: block i of a row lies at entry i // per_page of
            # the page list below (per_page blocks a page when blocks are smaller than pages, else one)
            size = batch.pool.page_size
            block_tables = tables[:, :: bs // size] if bs >= size else tables
            dots = kernels.paged_dot(q, self.block_keys.data, block_tables,
                                     torch.arange(candidates, device=device))  # [B, heads, N]
            block_scores = dots.view(n.shape[0], heads, -1, candidates).mean(2)  # [B, kv_heads, N]: q_mean . key
            if not self.per_head:  # the layer's blocks: scored by every rank's heads
                block_scores = over_heads(self.tp, block_scores, 1, "sum", keepdim=True)  # [B, 1, N]
            index = torch.arange(candidates, device=device)
            candidate = (index >= (init // bs)[:, None]) & (index < formed[:, None])  # [B, N]
            top = block_scores.masked_fill(~candidate[:, None], float("-inf")).topk(blocks, dim=-1).indices
        return Selection(*infllm_kernels.block_slots(top, chosen, init, local, n, bs, capacity))
