"""PyramidKV: SnapKV's scores with a pyramid of per-layer budgets (Cai et al., 2024, "PyramidKV: Dynamic KV Cache
Compression based on Pyramidal Information Funneling", https://arxiv.org/abs/2406.02069).

Lower layers spread their attention widely and keep more tokens, higher layers focus and keep fewer: the budgets
decrease linearly with depth and average to `budget`. Each layer scores its tokens as SnapKV does (observation window
attention, pooled, per KV head) and really keeps (and frees the pages of) its own count, at the end of prefill.

Schedule (the paper's Section 3.3 and its reference code, KVCache-Factory): with L layers, window w and mean budget B,
the tokens chosen outside the window average `B - w`; the top layer chooses `(B - w) / beta`, the bottom layer
`2 (B - w) - (B - w) / beta`, and layer l interpolates linearly between them; every layer adds the window. When the
bottom layer would need more than the `n - w` prompt tokens outside the window it is capped there and the top layer
takes the rest of the mean (as kvpress does). Budgets are rounded so that they sum to exactly L * B.

Parameters
----------
budget: mean tokens kept per KV head and layer (int) or fraction of the prompt (float).
beta: steepness, 20 (the paper's default); the top layer keeps 1/beta of the mean outside the window.
window, kernel_size, pooling, query_aware: as in SnapKV (window 32, kernel 5, "avg", True).
"""
from __future__ import annotations

from dataclasses import dataclass

from semkv.engine.hooks import resolve_budget
from semkv.errors import check_range
from semkv.methods.snapkv import SnapKV


def pyramid_budgets(budget: int, window: int, n: int, layers: int, beta: float) -> list[int]:
    """Tokens each layer keeps out of n: a linear pyramid with mean `budget` (integers summing to layers * budget)."""
    if budget >= n or budget <= window or layers == 1:
        return [min(budget, n)] * layers
    extra = budget - window  # mean tokens chosen outside the window
    top = extra / beta
    bottom = 2 * extra - top
    if bottom > n - window:
        bottom = n - window
        top = 2 * extra - bottom
    exact = [window + bottom - (bottom - top) * layer / (layers - 1) for layer in range(layers)]
    floors = [int(x) for x in exact]
    short = layers * budget - sum(floors)  # hand the rounding remainder to the largest fractions
    for layer in sorted(range(layers), key=lambda i: floors[i] - exact[i])[:short]:
        floors[layer] += 1
    return floors


@dataclass
class PyramidKV(SnapKV):
    beta: float = 20.0

    name = "pyramidkv"
    summary = "PyramidKV: SnapKV scores with per-layer budgets decreasing with depth (mean = budget), at prefill"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("beta", self.beta, 1.0, None, (int, float))

    def layer_budget(self, layer: int, n: int) -> int:
        budget = resolve_budget(self.budget, n)
        return pyramid_budgets(budget, self.window, n, self.model.num_layers, self.beta)[layer]
