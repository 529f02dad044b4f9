"""A few channels of every cached key, kept by physical page beside the KV pool, for methods that score every cached
token each decode step (DynSplit-KV's score="tokens"): a step reads `count` of a key's D channels (16 of 64 at
Qwen2.5-0.5B's head_dim: a quarter of its bytes) to rank the tokens, and attends to the exact keys of those it picks.

The channels are Double Sparsity's label channels (Yang et al., 2024, "Post-Training Sparse Attention with Double
Sparsity", https://arxiv.org/abs/2408.07092), which that paper calibrates offline per model; here they are chosen per
request, layer and KV head at the end of its prefill (`choose`): whole rotary pairs (d, d + D/2), since RoPE rotates a
pair as one and its share of q . k depends on both, ranked by how much of the variation of q . k over the prompt's
keys they carry for the prompt's last queries: sum over those queries of q_p^T Cov(k_p) q_p, Cov the 2 x 2 covariance
of pair p over the keys (a pair whose keys hardly change, however large, ranks no token above another)."""
from __future__ import annotations

import torch

from semkv.engine.kv_cache import KVPool
from semkv.methods.state.page_storage import PageStorage


def choose(q: torch.Tensor, keys: torch.Tensor, count: int, mean: bool) -> torch.Tensor:
    """The `count` channels (count / 2 rotary pairs, in channel order) of each KV head that carry the most of the
    variation of q . k over `keys` [kv_heads, n, D] for the queries q [w, heads, D] (all after RoPE): [kv_heads, count]
    int64. mean: the method scores with the mean query of each KV group (else every head's)."""
    kv_heads, _, dim = keys.shape
    half = dim // 2
    k = keys.float()
    k = k - k.mean(1, keepdim=True)
    a, b = k[..., :half], k[..., half:]  # [kv_heads, n, half]: the two channels of each pair
    cov = torch.stack(((a * a).mean(1), (a * b).mean(1), (b * b).mean(1)))  # [3, kv_heads, half]
    qf = q.float().view(q.shape[0], kv_heads, -1, dim)  # [w, kv_heads, group, D]
    if mean:
        qf = qf.mean(2, keepdim=True)
    qa, qb = qf[..., :half], qf[..., half:]  # [w, kv_heads, group, half]
    energy = (qa * qa * cov[0][:, None] + 2 * qa * qb * cov[1][:, None] + qb * qb * cov[2][:, None]).sum((0, 2))
    pairs = energy.topk(count // 2, dim=-1).indices.sort(-1).values  # [kv_heads, count / 2]
    return torch.cat((pairs, pairs + half), -1)


class KeyChannels(PageStorage):
    """The chosen channels [pages, page_size, kv_heads, count] of the keys of every page id the pool covers, in the
    cache's dtype (grown with the pool's coverage). The method writes the channels of every slot it will score before
    it scores it."""

    def __init__(self, count: int) -> None:
        super().__init__(lambda pool: (pool.page_size, pool.num_kv_heads, count), pool_dtype=True)
        self.count = count

    def write(self, pool: KVPool, rows: torch.Tensor, channels: torch.Tensor) -> None:
        """Keep channels [n, kv_heads, count] (int64) of the keys at flat pool rows `rows` [n] (page * page_size +
        offset), covered by an `ensure` first (whose move the caller answers)."""
        self.data.view(-1, pool.num_kv_heads, self.count)[rows] = pool.flat()[0][rows].gather(-1, channels)
