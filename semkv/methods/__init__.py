"""KV-selection methods: a module for a method that fits one file, a package (method, state, references, kernels) for
one that does not, and the name -> class registry used by the API, the CLI and the shared tests. A new method is a
`KVMethod` subclass (`semkv.engine.hooks`) and one line in `METHODS`."""
from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

from semkv.engine.hooks import DecodeBatch, KVMethod, Selection
from semkv.errors import SemkvError
from semkv.methods.chess.method import Chess
from semkv.methods.chunkkv import ChunkKV
from semkv.methods.dynsplit.method import DynSplitKV
from semkv.methods.full import FullKV
from semkv.methods.h2o.method import H2O
from semkv.methods.infllm.method import InfLLM
from semkv.methods.keydiff import KeyDiff
from semkv.methods.pyramidkv import PyramidKV
from semkv.methods.quest import Quest
from semkv.methods.sentencekv.method import SentenceKV
from semkv.methods.snapkv import SnapKV
from semkv.methods.streaming_llm import StreamingLLM
from semkv.methods.tokenselect.method import TokenSelect

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


def get_method(method: str | KVMethod, budget: int | float | None = None, /, **params: Any) -> KVMethod:
    """A method object from a name, or a given object (a copy with `budget` filled in if it had none; the object
    itself is never changed). Old parameter names (`KVMethod.renamed`) are accepted with a DeprecationWarning."""
    if isinstance(method, KVMethod):
        if params:
            raise SemkvError(f"method parameters {sorted(params)} go into the method object, not generate()")
        if budget is not None and method.budget is None:
            return replace(method, budget=budget)
        return method
    if not isinstance(method, str) or method not in METHODS:
        raise SemkvError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    cls = METHODS[method]
    if "budget" in params:  # a caller's dict of parameters (kv_params, --param) may hold it
        if budget is not None:
            raise SemkvError(f"the budget is given twice ({budget!r} and the parameter budget={params['budget']!r}); "
                             "give one")
        budget = params.pop("budget")
    for old in set(params) & set(cls.renamed):
        new = cls.renamed[old]
        warnings.warn(f"{method} parameter {old!r} is now {new!r}", DeprecationWarning, stacklevel=2)
        params[new] = params.pop(old)
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
