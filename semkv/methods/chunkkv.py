"""ChunkKV: keep whole chunks of prompt tokens, chosen by the attention of the last prompt queries, with layer-wise
index reuse (Liu et al., 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM
Inference", https://arxiv.org/abs/2502.00299).

The prompt before the observation window is cut into chunks of `chunk_size` tokens; a chunk's score is the attention
the last `window` prompt queries give to its tokens, summed (Algorithm 1). The best chunks are kept whole, in their
original order, and the window itself is always kept. With `reuse_layers = N` only the first layer of each group of N
layers scores; the others keep the same positions without scoring (Algorithm 2). Compression happens once, at the end
of prefill; generated tokens are appended.

Parameters
----------
budget: L_max, prompt tokens kept per layer (and KV head), the window included (the paper concatenates the window in
    place of the last w kept tokens, so the compressed prompt is L_max long); a float is a fraction of the prompt.
window: observation window w, 32 (the paper uses 4 to 32; 32 as SnapKV).
chunk_size: c, 10 (the paper's best value in its chunk-size ablation, Table 10, and its recommended default).
reuse_layers: N_reuse, 1 = off (the paper's efficiency and quality experiments of section 4.3 use 2).
per_head: False keeps one chunk set per layer shared by its KV heads (the paper's Figure 1; chunk scores averaged
    over all query heads); True lets each KV head choose its own chunks from its query group's scores (GQA).
hybrid: False; True is the variant of section 4.6: ChunkKV in the lower half of the layers (layer < layers // 2),
    SnapKV with its defaults (pooled scores, top tokens per KV head) in the upper half, where reuse does not apply.
query_aware: the window contains the question (True, as in the paper) or only the context (False).
neighbours: 0 (the paper); n > 0 scores a chunk by the best of itself and the n chunks on either side (CHESS's
    `neighbours` rule), so a kept chunk brings its neighbours. The window attends to a needle's key and the first
    tokens of its value; the value's later tokens (a digit or uuid character a token: a uuid is 36) fall in the next
    chunks and are dropped, and the model answers the value's start and invents the rest
    (benchmarks/results/2026-11-26-h100-niah.md). Opt-in: it spends the budget on fewer, whole regions; 3 brings RULER
    NIAH at 10% within 5 points of Full KV at 8k-31k (benchmarks/results/2026-11-27-h100-baselines.md).

Readings of the paper (where it is loose):
- Scores are softmax attention probabilities of the window queries over every prompt key (causal inside the window),
  without the pooling SnapKV adds: Algorithm 1 has none. Chunks are aligned on the first prompt token and cover the
  prompt before the window; the last of them may be shorter than `chunk_size`.
- Algorithm 1 takes k = floor(L_max / c) chunks and then cuts their concatenation to L_max - w tokens, which can drop
  selected chunks wholesale. Here the best chunks are taken until they hold L_max - w tokens, laid out in original
  order, and the last one is cut: exactly L_max tokens are kept, every one a whole chunk except the last.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from semkv.engine.sequence import Sequence
from semkv.errors import check_range
from semkv.methods.base import layer_groups, layers_window_mass, neighbour_max, per_kv_head
from semkv.methods.eviction import ScoredEviction, window_positions
from semkv.methods.snapkv import SnapKV
from semkv.models.parallel import TensorParallel, over_heads


def keep_chunks(mass: torch.Tensor, kv_heads: int, n_keep: int, window: int, chunk_size: int,
                per_head: bool, tp: TensorParallel | None = None, neighbours: int = 0) -> torch.Tensor:
    """Algorithm 1 from the window's attention mass [G, heads, n] of G layers (`window_mass`: its probabilities summed
    over its queries): each layer's kept slots [G, kv_heads or 1, n_keep], ascending. Chunks shared by the heads are
    scored over every rank's heads (`tp`); `neighbours` > 0 max-pools the chunk scores over that many chunks on either
    side."""
    n = mass.shape[-1]
    n_window = min(window, n_keep)
    prefix, fill = n - n_window, n_keep - n_window  # chunked part of the prompt, and its budget
    token_scores = per_kv_head(mass[..., :prefix], kv_heads, dim=1)  # [G, kv_heads, prefix]
    if not per_head:
        token_scores = over_heads(tp, token_scores, 1, keepdim=True)  # [G, 1, prefix]
    n_chunks = -(-prefix // chunk_size)
    padded = F.pad(token_scores, (0, n_chunks * chunk_size - prefix))
    chunk_scores = padded.view(*padded.shape[:2], n_chunks, chunk_size).sum(-1)  # [G, S, n_chunks]
    chunk_scores = neighbour_max(chunk_scores, neighbours)
    # tokens of each chunk, the last one's cut by the prefix's end (computed on the device: writing a Python number
    # into a device tensor makes the host wait for the device, once a layer)
    sizes = (prefix - chunk_size * torch.arange(n_chunks, device=mass.device)).clamp_(max=chunk_size)  # [n_chunks]
    order = torch.argsort(chunk_scores, dim=-1, descending=True, stable=True)  # [G, S, n_chunks] best first
    filled_before = sizes[order].cumsum(-1) - sizes[order]
    chosen = torch.zeros_like(chunk_scores, dtype=torch.bool).scatter_(-1, order, filled_before < fill)
    tokens = chosen.repeat_interleave(chunk_size, dim=-1)[..., :prefix]  # [G, S, prefix]
    # the first `fill` chosen tokens in original order: the last chosen chunk is cut to the budget
    slots = torch.sort((~tokens).to(torch.int8), dim=-1, stable=True).indices[..., :fill]  # [G, S, fill] ascending
    window_slots = torch.arange(prefix, n, device=mass.device).expand(*slots.shape[:-1], -1)
    return torch.cat([slots, window_slots], dim=-1)


@dataclass
class ChunkKV(ScoredEviction):
    chunk_size: int = 10
    reuse_layers: int = 1
    per_head: bool = False
    hybrid: bool = False
    neighbours: int = 0

    name = "chunkkv"
    summary = "ChunkKV: keep whole chunks of prompt tokens most attended by the last prompt queries; layer index reuse"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("chunk_size", self.chunk_size, 1, None, int)
        check_range("reuse_layers", self.reuse_layers, 1, None, int)
        check_range("per_head", self.per_head, types=bool)
        check_range("hybrid", self.hybrid, types=bool)
        check_range("neighbours", self.neighbours, 0, None, int)

    def new_state(self, seq: Sequence) -> dict[int, torch.Tensor]:
        return {}  # first layer of a reuse group -> its kept slots (Algorithm 2's I_reuse), during the prefill

    def finish_prefill(self, seq: Sequence) -> None:
        """Index reuse is over once every layer is compressed: the kept slots go (a row held them for every layer
        through its decoding, 0.6 MB at 32k: 1.9 GiB at 3,295 rows, which the largest batch on an H200 missed by)."""
        seq.method_state.clear()

    def keep(self, layer: int, seq: Sequence, q_window: torch.Tensor, n_keep: int) -> torch.Tensor:
        snapkv_layer = self.hybrid and layer >= seq.kv.pool.num_layers // 2
        first = layer - layer % self.reuse_layers
        if not snapkv_layer and first != layer and first in seq.method_state:
            return seq.method_state[first]  # index reuse: no scoring in this layer
        started = time.perf_counter()
        if snapkv_layer:
            keep = SnapKV(window=self.window).keep(layer, seq, q_window, n_keep)
        else:
            mass = layers_window_mass(seq.kv, [layer], [q_window], window_positions(seq, q_window))  # [1, heads, n]
            keep = keep_chunks(mass, seq.kv.pool.num_kv_heads, n_keep, self.window, self.chunk_size, self.per_head,
                               self.tp, self.neighbours)[0]
            if self.reuse_layers > 1:  # the group's later layers read it
                seq.method_state[layer] = keep
        self._scored(seq, 1, started)
        return keep

    def evict_prefill_layers(self, seq: Sequence, q_windows: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Every layer at once (a packed prompt chunk's): the first layer of each reuse group scored in a few calls
        (`layers_window_mass`, a `layer_groups` group a call) and each group's chunks chosen in one pass, where they
        keep as many slots (not `hybrid`, every layer holding the same slots); else layer by layer."""
        kv, layers = seq.kv, len(q_windows)
        n = kv.num_slots[0]
        if self.hybrid or any(count != n for count in kv.num_slots):
            return super().evict_prefill_layers(seq, q_windows)
        n_keep = self.layer_budget(0, n)
        if n_keep >= n:
            return [None] * layers
        started, query_positions = time.perf_counter(), window_positions(seq, q_windows[0])
        scored = list(range(0, layers, self.reuse_layers))  # the others keep their group's first layer's slots
        keeps = []
        for group in layer_groups(kv, scored):
            mass = layers_window_mass(kv, group, [q_windows[layer] for layer in group], query_positions)
            keeps.extend(keep_chunks(mass, kv.pool.num_kv_heads, n_keep, self.window, self.chunk_size,
                                     self.per_head, self.tp, self.neighbours))  # [G, S, n_keep]
        self._scored(seq, len(scored), started)
        return [keeps[layer // self.reuse_layers] for layer in range(layers)]

    @staticmethod
    def _scored(seq: Sequence, layers: int, started: float) -> None:
        extra = seq.stats.extra
        extra["scored_layers"] = extra.get("scored_layers", 0) + layers
        extra["scoring_s"] = extra.get("scoring_s", 0.0) + time.perf_counter() - started
