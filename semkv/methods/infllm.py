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
  representatives fixed, once its last token has been seen by W later queries. The reference code sums softmax
  probabilities instead of dot products; the ranking inside a block differs only through the softmax normaliser.
- Blocks are the fixed logical slot ranges [i * block_size, (i + 1) * block_size) (page aligned when block_size is a
  multiple of the page size); the initial tokens overlap the first blocks and blocks inside them are not candidates.
- Block score: mean over the group's query heads and the representatives of q . k. One set of blocks per layer
  (summed over KV heads, as the reference code does by default) or per KV head (`per_head=True`, its `perhead`).
- Prefill is dense: the budget binds decode steps (the paper also applies the memory to prompt chunks, for length
  extrapolation; keys keep their original positions here, no position re-assignment).
- Budget split (the paper's 128 initial + 4096 local + top-k x 128 assume budgets of several thousand tokens): with
  budget B, init = min(n_init, floor(B * init_ratio)); the local window gets at least
  min(n_local, floor(B * local_ratio)) (at least 1: the current token); whole blocks take as much of the rest as there
  are formed candidates; the local window absorbs what is left. Attended = init + blocks + local <= B. W is the local
  minimum resolved at the prompt length.

Parameters
----------
budget: attended tokens per KV head and layer (int) or fraction of the current context (float).
n_init: initial tokens, 128 (paper). n_local: local window, 4096 (paper). block_size: 128 (paper).
n_repr: representative tokens per block, 4 (paper).
init_ratio: largest share of the budget for initial tokens, 0.125.
local_ratio: share of the budget guaranteed to the local window, 0.25 (TokenSelect's evaluation of InfLLM used 2K
    selected + 512 local tokens, i.e. 20%).
per_head: each KV head selects its own blocks (False: one set per layer, the reference code's default).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from semkv.engine.sequence import Sequence
from semkv.errors import SemkvError
from semkv.methods.base import DecodeBatch, KVMethod, Selection, check_range, resolve_budget


@dataclass
class InfLLMState:
    window: int  # W: queries after a key that score it
    scores: list[torch.Tensor]  # per layer [kv_heads, capacity] representative scores
    block_keys: list[torch.Tensor | None]  # per layer [n_blocks, kv_heads, D] mean representative keys


def band_scores(q: torch.Tensor, keys: torch.Tensor, q_start: int, k_start: int, window: int) -> torch.Tensor:
    """Representative-score contributions: q [C, heads, D] at positions q_start.., keys [kv_heads, K, D] at k_start..
    -> [kv_heads, K], the sum over queries j and the group's heads of q_j . k_m for j - window <= m < j."""
    kv_heads = keys.shape[0]
    qg = q.float().view(q.shape[0], kv_heads, -1, q.shape[-1]).sum(2).transpose(0, 1)  # [kv_heads, C, D]
    dots = torch.matmul(qg, keys.float().transpose(1, 2))  # [kv_heads, C, K]
    j = torch.arange(q_start, q_start + q.shape[0], device=q.device)[:, None]
    m = torch.arange(k_start, k_start + keys.shape[1], device=q.device)[None, :]
    return dots.masked_fill(~((m < j) & (m >= j - window)), 0.0).sum(1)


@dataclass
class InfLLM(KVMethod):
    n_init: int = 128
    n_local: int = 4096
    block_size: int = 128
    n_repr: int = 4
    init_ratio: float = 0.125
    local_ratio: float = 0.25
    per_head: bool = False

    name = "infllm"
    summary = "InfLLM: initial + local tokens and the top memory blocks by representative keys, each decode step"
    kind = "selection"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("n_init", self.n_init, 0, None, int)
        check_range("n_local", self.n_local, 1, None, int)
        check_range("block_size", self.block_size, 1, None, int)
        check_range("n_repr", self.n_repr, 1, self.block_size, int)
        check_range("init_ratio", self.init_ratio, 0.0, 1.0, (int, float))
        check_range("local_ratio", self.local_ratio, 0.0, 1.0, (int, float))
        check_range("per_head", self.per_head, types=bool)
        if self.init_ratio + self.local_ratio > 1.0:
            raise SemkvError(f"init_ratio + local_ratio = {self.init_ratio + self.local_ratio} must be <= 1")

    def split(self, budget: int) -> tuple[int, int, int]:
        """Budget -> (initial tokens, minimum local window, most blocks)."""
        local = max(1, min(self.n_local, int(budget * self.local_ratio)))
        init = min(self.n_init, int(budget * self.init_ratio), budget - local)
        return init, local, (budget - init - local) // self.block_size

    def new_state(self, seq: Sequence) -> InfLLMState:
        pool = seq.kv.pool
        window = self.split(resolve_budget(self.budget, len(seq.prompt_ids)))[1]
        n = len(seq.prompt_ids)
        return InfLLMState(window, [torch.zeros(pool.num_kv_heads, n, device=pool.device)
                                    for _ in range(pool.num_layers)], [None] * pool.num_layers)

    def observe_prefill(self, layer: int, seq: Sequence, q: torch.Tensor, start: int) -> None:
        state = seq.method_state
        lo = max(start - state.window, 0)
        keys = seq.kv.gather(layer, torch.arange(lo, start + q.shape[0], device=q.device)[None])[0]
        state.scores[layer][:, lo : start + q.shape[0]] += band_scores(q, keys, start, lo, state.window)

    def _update_memory(self, layer: int, seq: Sequence, q: torch.Tensor, n: int) -> torch.Tensor:
        """Score the keys in the current query's window, form the blocks that left it; return the block keys
        [n_blocks, kv_heads, D]."""
        state, kv = seq.method_state, seq.kv
        scores = state.scores[layer]
        if scores.shape[1] < n:  # grow by doubling
            scores = state.scores[layer] = F.pad(scores, (0, max(n, 2 * scores.shape[1]) - scores.shape[1]))
        lo = max(n - 1 - state.window, 0)
        keys = kv.gather(layer, torch.arange(lo, n, device=q.device)[None])[0]  # [kv_heads, n - lo, D]
        scores[:, lo:n] += band_scores(q[None], keys, n - 1, lo, state.window)
        blocks = state.block_keys[layer]
        have = 0 if blocks is None else blocks.shape[0]
        formed = max(n - state.window, 0) // self.block_size
        if formed > have:
            size = self.block_size
            span = torch.arange(have * size, formed * size, device=q.device)
            block_scores = scores[:, span].view(-1, formed - have, size)  # [kv_heads, new, size]
            top = block_scores.topk(self.n_repr, dim=-1).indices + (span.view(formed - have, size)[:, :1])[None]
            keys = kv.gather(layer, top.flatten(1))[0].view(*top.shape, -1)  # [kv_heads, new, n_repr, D]
            new = keys.float().mean(2).transpose(0, 1)  # [new, kv_heads, D]
            blocks = new if blocks is None else torch.cat([blocks, new])
            state.block_keys[layer] = blocks
        return blocks

    def select(self, layer: int, batch: DecodeBatch, q: torch.Tensor) -> Selection | None:
        num_slots = [seq.kv.num_slots[layer] for seq in batch.seqs]  # host copies: no device read
        heads = batch.model.num_kv_heads if self.per_head else 1
        masks, full = [], True
        for b, seq in enumerate(batch.seqs):
            n = num_slots[b]
            blocks = self._update_memory(layer, seq, q[b], n)
            budget = resolve_budget(self.budget, seq.num_computed + 1)
            mask = torch.ones(heads, n, dtype=torch.bool, device=q.device)  # [S, n]
            if budget < n:
                full = False
                mask = self._mask(q[b], blocks, n, budget, heads)
            masks.append(mask)
        if full:
            return None
        width = max(num_slots)
        return Selection.from_mask(torch.stack([F.pad(m, (0, width - m.shape[1])) for m in masks]))

    def _mask(self, q: torch.Tensor, blocks: torch.Tensor | None, n: int, budget: int, heads: int) -> torch.Tensor:
        """Attended slots [S, n] of one sequence: initial tokens, the top blocks, the local window."""
        init, _, most = self.split(budget)
        first = init // self.block_size  # blocks before it lie inside the initial tokens
        k = min(most, max(0 if blocks is None else blocks.shape[0] - first, 0))
        slot = torch.arange(n, device=q.device)
        mask = ((slot < init) | (slot >= n - (budget - init - k * self.block_size)))[None].expand(heads, -1)
        if k == 0:
            return mask
        kv_heads = blocks.shape[1]
        q_mean = q.float().view(kv_heads, -1, q.shape[-1]).mean(1)  # [kv_heads, D]
        block_scores = torch.einsum("hd,bhd->hb", q_mean, blocks[first:])  # [kv_heads, candidates]
        if heads == 1:
            block_scores = block_scores.sum(0, keepdim=True)
        top = block_scores.topk(k, dim=-1).indices + first  # [S, k]
        chosen = torch.zeros(heads, -(-n // self.block_size), dtype=torch.bool, device=q.device)
        chosen.scatter_(1, top, True)
        return mask | chosen.repeat_interleave(self.block_size, dim=1)[:, :n]
