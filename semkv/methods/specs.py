"""What every method is, as plain data: its name, where its class lives, how its budget binds, a one-line summary, its
paper and its parameters with their defaults. Importing this module imports no torch, so `semkv methods` (and the
documentation) answer at once; `tests/test_docs.py` checks every entry against its class, which stays the one place
a parameter is defined and explained (its docstring)."""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_ENTRY = re.compile(r"^(\w+(?:, \w+)*): (.*)$")  # "window: ..." or "window, kernel_size: ..." in a Parameters section


@dataclass(frozen=True)
class MethodSpec:
    """One method as plain data: what `semkv methods` prints and the documentation shows."""

    name: str
    cls: str  # "module:Class", imported by `semkv.methods.METHODS`
    kind: str  # "full", "prefill_eviction", "decode_eviction" or "selection" (`KVMethod.kind`)
    summary: str
    paper: str  # the paper's arXiv page ("" for Full KV)
    params: dict[str, Any] = field(default_factory=dict)  # name -> default, the budget left out

    def describe(self) -> dict[str, Any]:
        """What `semkv methods --json` prints for the method: its parameters with the budget first (no default)."""
        return {"summary": self.summary, "kind": self.kind, "paper": self.paper,
                "parameters": {"budget": None} | self.params}

    def parameter_docs(self) -> dict[str, str]:
        """Parameter name -> what the method's docstrings say of it: the entries of their "Parameters" sections
        (`name: text`, `a, b: text` for several, continued on indented lines), read from the source file without
        importing it or its package (no torch)."""
        source = Path(__file__).parents[1].joinpath(*self.cls.split(":")[0].split(".")[1:]).with_suffix(".py")
        tree = ast.parse(source.read_text(encoding="utf-8"))
        docs = [ast.get_docstring(tree) or ""]
        docs += [ast.get_docstring(node) or "" for node in tree.body if isinstance(node, ast.ClassDef)]
        found: dict[str, str] = {}
        for doc in docs:
            lines = doc.splitlines()
            if "Parameters" not in lines:
                continue
            names: list[str] = []
            for line in lines[lines.index("Parameters") + 2:]:
                entry = _ENTRY.match(line)
                if entry:
                    names = entry.group(1).split(", ")
                    found.update({name: entry.group(2) for name in names})
                elif names and line.startswith(" "):
                    found.update({name: f"{found[name]} {line.strip()}" for name in names})
                elif line.strip():
                    break  # the prose after the section
        for name, text in list(found.items()):  # "n_sink: initial tokens. n_recent: local window." on one line
            parts = re.split(r"(?<=\.) (\w+): ", text)
            found[name] = parts[0]
            found.update({parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2) if parts[i] in self.params})
        return found


_SNAPKV = dict(window=32, query_aware=True, kernel_size=5, pooling="avg")

# baselines first, then the five methods of the papers semkv is built around; the order of `semkv methods`
SPECS: dict[str, MethodSpec] = {s.name: s for s in (
    MethodSpec("full", "semkv.methods.full:FullKV", "full",
               "Full KV cache: attend to every cached token (the exact reference)", ""),
    MethodSpec("streaming_llm", "semkv.methods.streaming_llm:StreamingLLM", "decode_eviction",
               "StreamingLLM: attention sinks + recent window; evicts the oldest token as generation goes on",
               "https://arxiv.org/abs/2309.17453", dict(n_sink=4)),
    MethodSpec("h2o", "semkv.methods.h2o.method:H2O", "decode_eviction",
               "H2O: heavy hitters by accumulated attention + recent window; evicts the lightest token while decoding",
               "https://arxiv.org/abs/2306.14048", dict(recent_ratio=0.5)),
    MethodSpec("snapkv", "semkv.methods.snapkv:SnapKV", "prefill_eviction",
               "SnapKV: keep tokens most attended by the last prompt queries (pooled, per KV head), at prefill",
               "https://arxiv.org/abs/2404.14469", _SNAPKV),
    MethodSpec("pyramidkv", "semkv.methods.pyramidkv:PyramidKV", "prefill_eviction",
               "PyramidKV: SnapKV scores with per-layer budgets decreasing with depth (mean = budget), at prefill",
               "https://arxiv.org/abs/2406.02069", _SNAPKV | dict(beta=20.0)),
    MethodSpec("quest", "semkv.methods.quest:Quest", "selection",
               "Quest: per-head top pages by a min/max key bound on the query's attention, each decode step",
               "https://arxiv.org/abs/2406.10774", dict(group_reduce="mean", dense_layers=0)),
    MethodSpec("keydiff", "semkv.methods.keydiff:KeyDiff", "prefill_eviction",
               "KeyDiff: keep the keys least similar (cosine) to the mean key, per KV head, at prefill",
               "https://arxiv.org/abs/2504.15364", dict(window=0, query_aware=True)),
    MethodSpec("infllm", "semkv.methods.infllm.method:InfLLM", "selection",
               "InfLLM: initial + local tokens and the top memory blocks by representative keys, each decode step",
               "https://arxiv.org/abs/2402.04617",
               dict(n_sink=128, n_recent=4096, block_size=128, n_repr=4, init_ratio=0.125, local_ratio=0.25,
                    per_head=False)),
    MethodSpec("chunkkv", "semkv.methods.chunkkv:ChunkKV", "prefill_eviction",
               "ChunkKV: keep whole chunks of prompt tokens most attended by the last prompt queries; layer index "
               "reuse", "https://arxiv.org/abs/2502.00299",
               dict(window=32, query_aware=True, chunk_size=10, reuse_layers=1, per_head=False, hybrid=False,
                    neighbours=0)),
    MethodSpec("sentencekv", "semkv.methods.sentencekv.method:SentenceKV", "selection",
               "SentenceKV: prompt cut into sentence buckets, top r*budget tokens kept (on the device, or in host "
               "memory with offload=True), mean-query sentence retrieval each decode step",
               "https://arxiv.org/abs/2504.00970",
               dict(keep_factor=2.0, window=32, n_sink=32, n_recent=32, split_std=3.0, max_sentence=128,
                    query="mean", buckets="sentences", offload=False, offload_chunk=16, cache_factor=1.5,
                    retain="tokens", score="vector")),
    MethodSpec("dynsplit", "semkv.methods.dynsplit.method:DynSplitKV", "selection",
               "DynSplit-KV: delimiter-weighted semantic chunks, per-head top tokens by chunk min/max key bounds",
               "https://arxiv.org/abs/2602.03184",
               dict(chunk_size=16, max_deviation=14, alpha=0.5, split="dynamic", weights="calibrated",
                    delimiters=".!?;:,'\"()[]{}\n", future_window=8, overlap=128, drop_penalty=1.0,
                    document_tokens=0, pooling="minmax", score="bound", score_keys="exact", channels=16, superset=4.0,
                    reuse_layers=1, group_reduce="mean", n_sink=0, n_recent=16, offload=False, offload_chunk=16,
                    cache_factor=1.0, count_reuse=False)),
    MethodSpec("tokenselect", "semkv.methods.tokenselect.method:TokenSelect", "selection",
               "TokenSelect: per-head q.k criticality, head soft vote, top tokens + sinks + recent; Selection Cache",
               "https://arxiv.org/abs/2411.02886",
               dict(n_sink=128, n_recent=512, selection="soft_vote", scope="layer", theta=0.9, extrapolate=False,
                    chunk=512, prefill="sparse", score_keys="exact", superset=4.0, reuse_layers=1)),
    MethodSpec("chess", "semkv.methods.chess.method:Chess", "selection",
               "CHESS: grid->chunk->page cascade by key-key affinity with the recent pages, re-selected on "
               "uncertainty", "https://arxiv.org/abs/2602.20732",
               dict(preset="moderate", block_size=32, chunk_pages=4, grid_chunks=4, recent_pages=2, mode="dynamic",
                    period=6, trigger="any", rope_free=False, center=False, anchor="keys", query_window=32,
                    neighbours=1, entropy_threshold=None, varentropy_threshold=None)),
)}
