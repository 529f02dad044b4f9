"""Evaluation: tasks (`task.py`), the runner (`semkv.eval.run`), reports and the HTML view of one sample. `run` and
`run_config` load on first use (the command line builds its parser without importing torch)."""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["run", "run_config"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("semkv.eval.runner"), name)
    raise AttributeError(f"module 'semkv.eval' has no attribute {name!r}")
