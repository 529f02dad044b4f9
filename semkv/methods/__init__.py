"""KV-selection methods, one module each, and the name -> class registry used by the API and the CLI."""
from __future__ import annotations

from typing import Any

from semkv.errors import SemkvError
from semkv.methods.base import DecodeBatch, KVMethod, Selection
from semkv.methods.chess import Chess
from semkv.methods.chunkkv import ChunkKV
from semkv.methods.dynsplit import DynSplitKV
from semkv.methods.full import FullKV
from semkv.methods.h2o import H2O
from semkv.methods.infllm import InfLLM
from semkv.methods.keydiff import KeyDiff
from semkv.methods.pyramidkv import PyramidKV
from semkv.methods.quest import Quest
from semkv.methods.sentencekv import SentenceKV
from semkv.methods.snapkv import SnapKV
from semkv.methods.streaming_llm import StreamingLLM
from semkv.methods.tokenselect import TokenSelect

# baselines first, then the five methods of the papers semkv is built around
METHODS: dict[str, type[KVMethod]] = {
    cls.name: cls
    for cls in (FullKV, StreamingLLM, H2O, SnapKV, PyramidKV, Quest, KeyDiff, InfLLM,
                ChunkKV, SentenceKV, DynSplitKV, TokenSelect, Chess)
}

__all__ = [
    "METHODS", "Chess", "ChunkKV", "DecodeBatch", "DynSplitKV", "FullKV", "H2O", "InfLLM", "KVMethod", "KeyDiff",
    "PyramidKV", "Quest", "Selection", "SentenceKV", "SnapKV", "StreamingLLM", "TokenSelect", "get_method",
]


def get_method(method: str | KVMethod, budget: int | float | None = None, **params: Any) -> KVMethod:
    """A method object from a name (or an object, returned as is with `budget` filled in if it had none)."""
    if isinstance(method, KVMethod):
        if params:
            raise SemkvError(f"method parameters {sorted(params)} go into the method object, not generate()")
        if budget is not None and method.budget is None:
            method.budget = budget
            method.__post_init__()
        return method
    if not isinstance(method, str) or method not in METHODS:
        raise SemkvError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    cls = METHODS[method]
    allowed = cls.parameters()
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise SemkvError(
            f"unknown parameter(s) {', '.join(unknown)} for method {method!r}; "
            f"allowed: {', '.join(k for k in allowed if k != 'budget') or 'none'}"
        )
    if budget is None and cls is not FullKV:
        raise SemkvError(f"method {method!r} needs a budget: an int (tokens) or a float in (0, 1]")
    return cls(budget=budget, **params)
