"""Full KV: every cached token is kept and attended. The reference all other methods are measured against."""
from __future__ import annotations

from dataclasses import dataclass

from semkv.engine.hooks import KVMethod


@dataclass
class FullKV(KVMethod):
    """Dense attention over the whole cache; `budget` is ignored (there is nothing to drop)."""

    graph_safe = True
    idle_graphs = True
    name = "full"
    summary = "Full KV cache: attend to every cached token (the exact reference)"
