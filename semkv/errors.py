"""The error types of semkv and the checks of input at the API boundary: a message names the bad value and what is
allowed."""
from __future__ import annotations

import math
from typing import Any, Iterable

INT_MAX = 2**31 - 1  # the largest count of tokens, positions or slots the device's int32 tensors hold


class SemkvError(ValueError):
    """Bad input to semkv (model path, method, budget, prompt, device...). The CLI prints it and exits with code 2."""


class RankError(RuntimeError):
    """A rank of a tensor-parallel LLM failed (an exception, out of memory, a crash or a kill): every rank has ended
    and the LLM is unusable; the message names the rank and its cause."""


def check_range(name: str, value: Any, low: float | None = None, high: float | None = None,
                types: type | tuple[type, ...] = (int, float)) -> None:
    """Raise SemkvError unless low <= value <= high (bounds optional; an int is at most INT_MAX), value has the right
    type and, if a float, is finite."""
    if (isinstance(value, bool) and types is not bool) or not isinstance(value, types):
        raise SemkvError(f"{name}={value!r} must be of type {getattr(types, '__name__', types)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise SemkvError(f"{name}={value!r} must be a finite number")
    if isinstance(value, int) and not isinstance(value, bool) and high is None:
        high = INT_MAX
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise SemkvError(f"{name}={value!r} is out of range; allowed: {bounds}")


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> None:
    """Raise SemkvError unless value is one of `allowed`."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise SemkvError(f"{name}={value!r}; allowed: {', '.join(map(repr, allowed))}")


def check_text(what: str, text: Any) -> None:
    """Raise SemkvError unless `text` is a str a tokenizer can take: valid Unicode (no lone UTF-16 surrogate such as
    '\\udcff', which a JSON body may hold as an escape)."""
    if not isinstance(text, str):
        raise SemkvError(f"{what} must be text (str), not {type(text).__name__}: {text!r:.80}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SemkvError(f"{what} holds {text[exc.start:exc.end]!r} at character {exc.start}, a lone UTF-16 "
                         "surrogate that is not Unicode text; send valid UTF-8") from None
