"""A kernel path that a build or a shape may refuse (cuDNN's fused attention, FlashAttention 3): its first refusal
turns it off for the process with one warning, and the next path serves every later call (the same result, at its own
speed). Running out of memory is not a refusal and propagates."""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch


class OptionalPath:
    def __init__(self, name: str, instead: str):
        """name: the path, as the warning names it; instead: what the warning says serves from then on."""
        self.name, self.instead = name, instead
        self.failed: list[str] = []  # the error that turned the path off in this process, if any

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), or None where the path refuses the call (it is then turned off: `turn_off`)."""
        try:
            return fn(*args)
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            self.turn_off(exc)
            return None

    def turn_off(self, error: Exception) -> None:
        """The path refused a call: warn once; `failed` keeps the error."""
        self.failed.append(f"{type(error).__name__}: {error}")
        warnings.warn(f"{self.name} is unavailable ({self.failed[0].splitlines()[0]}); {self.instead}", RuntimeWarning,
                      stacklevel=3)
