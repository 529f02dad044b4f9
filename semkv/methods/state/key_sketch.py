"""An int8 copy of the cached keys, kept by physical page beside the KV pool (a "key sketch"), for methods that score
every cached token each decode step (TokenSelect): they read a key in D + 4 bytes instead of 2D (bfloat16), and
attend to the exact keys of the tokens they pick.

Each key of one slot and KV head is stored as round(k / s) in [-127, 127] with its own float32 scale s = max|k| / 127,
so a dot product q . k is (q . round(k / s)) * s, off by at most |q|_1 * s / 2. The method writes the sketch of every
slot it will score: a prompt's after its prefill, a generated token's at the end of its step (it is in the recent
window then, attended exactly, so it is scored from the sketch only from a later step on)."""
from __future__ import annotations

import torch

from semkv.engine.kv_cache import KVPool
from semkv.methods.state.page_storage import PageStorage

LEVELS = 127  # int8 steps on either side of 0
# float32 bytes of the keys quantized at once by `KeySketch.write`: a prompt's sketch is written in parts, so its
# float32 copy is not a whole prompt's (all layers of 11 x 32k rows at the Llama-3.1-8B shape asked 3.9 GiB at once
# beside a full pool and ran out of memory)
WRITE_BYTES = 64 << 20


def quantize(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [..., D] -> (int8 [..., D], float32 scales [...]): round(k / s), s = max|k| / 127 (1 for a zero key)."""
    keys = keys.float()
    scale = keys.abs().amax(-1) / LEVELS
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (keys / scale[..., None]).round_().clamp_(-LEVELS, LEVELS).to(torch.int8), scale


class KeySketch:
    """The int8 keys [pages, page_size, kv_heads, D] and their scales [pages, page_size, kv_heads] of every page id
    the pool covers (two `PageStorage`s, grown with the pool's coverage)."""

    def __init__(self) -> None:
        self.keys = PageStorage(lambda pool: (pool.page_size, pool.num_kv_heads, pool.head_dim), dtype=torch.int8)
        self.scales = PageStorage(lambda pool: (pool.page_size, pool.num_kv_heads))

    def bytes_per_page(self, pool: KVPool) -> int:
        return self.keys.bytes_per_page(pool) + self.scales.bytes_per_page(pool)

    def growth_bytes(self, pool: KVPool) -> int:
        return self.keys.growth_bytes(pool) + self.scales.growth_bytes(pool)

    def ensure(self, pool: KVPool) -> bool:
        """Cover the pool's pages (and grow with it); True when a tensor moved (graphs must be captured again)."""
        moved = self.keys.ensure(pool)
        return self.scales.ensure(pool) or moved

    def write(self, pool: KVPool, rows: torch.Tensor) -> None:
        """Sketch the keys at flat pool rows `rows` [n] (page * page_size + offset; every KV head), covered by an
        `ensure` first (whose move the caller answers); `WRITE_BYTES` of float32 keys at a time."""
        stored = pool.flat()[0]
        sketch_keys = self.keys.data.view(-1, pool.num_kv_heads, pool.head_dim)
        sketch_scales = self.scales.data.view(-1, pool.num_kv_heads)
        step = max(1, WRITE_BYTES // (pool.num_kv_heads * pool.head_dim * 4))
        for part in rows.split(step):
            keys, scales = quantize(stored[part])  # [n, kv_heads, D], [n, kv_heads]
            sketch_keys[part], sketch_scales[part] = keys, scales
