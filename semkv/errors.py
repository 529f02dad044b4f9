"""The one error type raised at the API boundary for bad input, and the checks that raise it: the message names the
bad value and what is allowed."""
from __future__ import annotations

from typing import Any, Iterable


class SemkvError(ValueError):
    """Bad input to semkv (model path, method, budget, prompt, device...). The CLI prints it and exits with code 2."""


def check_range(name: str, value: Any, low: float | None = None, high: float | None = None,
                types: type | tuple[type, ...] = (int, float)) -> None:
    """Raise SemkvError unless low <= value <= high (bounds optional) and value has the right type."""
    if (isinstance(value, bool) and types is not bool) or not isinstance(value, types):
        raise SemkvError(f"{name}={value!r} must be of type {getattr(types, '__name__', types)}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise SemkvError(f"{name}={value!r} is out of range; allowed: {bounds}")


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> None:
    """Raise SemkvError unless value is one of `allowed`."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise SemkvError(f"{name}={value!r}; allowed: {', '.join(map(repr, allowed))}")
