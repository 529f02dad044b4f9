"""semkv: long-context LLM inference with semantic KV-cache selection.

The names below load on first use, so the command line starts without importing torch for `--help`."""
from __future__ import annotations

import importlib
from typing import Any

from semkv.errors import SemkvError

_LAZY = {"LLM": "semkv.llm", "GenerationOutput": "semkv.llm", "METHODS": "semkv.methods", "KVMethod": "semkv.methods",
         "get_method": "semkv.methods"}

__all__ = ["LLM", "GenerationOutput", "METHODS", "KVMethod", "SemkvError", "get_method"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'semkv' has no attribute {name!r}")
