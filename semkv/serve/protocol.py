"""The OpenAI API's request bodies as semkv serves them, and its error body.

Fields follow the OpenAI API (completions and chat completions); `top_k` and `ignore_eos` follow vLLM; `kv_method`,
`kv_budget` and `kv_params` choose the request's KV method (the server's flags give the default). An unknown field is
an error (400) rather than silently ignored; accepted fields semkv cannot honour (n > 1, penalties, echo...) are errors
that say so. Types are strict, as the OpenAI API's are (true is not 1, "5" is not 5) and numbers finite (NaN and
Infinity, which Python's JSON reader takes, are errors); the ranges of the sampling values are checked once for the
Python API, the command line and the server (`LLM.sampling_params`).
"""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class Sampling(BaseModel):
    """What completions and chat completions share."""

    model_config = STRICT
    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM's extension; 0 = off
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension (its load client sends 1.0); 1 = off
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says
    kv_method: str | None = None
    kv_budget: int | float | str | None = None  # tokens (512), a fraction (0.1) or a percentage ("10%")
    kv_params: dict[str, Any] | None = None

    @field_validator("kv_budget", mode="before")
    @classmethod
    def _finite(cls, value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("a budget must be a finite number")
        return value

    def unsupported(self) -> str | None:
        """The first field whose value semkv cannot honour, described, or None."""
        if self.n != 1:
            return f"n={self.n}: semkv returns one choice per request (n=1)"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty and frequency_penalty are not supported (give 0)"
        if self.repetition_penalty != 1.0:
            return f"repetition_penalty={self.repetition_penalty} is not supported (give 1)"
        if self.logit_bias:
            return "logit_bias is not supported"
        return None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = 16  # the OpenAI default
    logprobs: int | None = None  # 0..20: the chosen token's and the most likely tokens' log-probabilities
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo is not supported"
        if self.suffix:
            return "suffix is not supported"
        if self.best_of not in (None, 1):
            return f"best_of={self.best_of} is not supported (one choice per request)"
        return super().unsupported()


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the model's context
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # 0..20, with logprobs


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI API's error object. A lone surrogate that a client sent, and that the message or param quotes, is
    written as its escape (JSON's UTF-8 cannot hold it)."""
    def text(value: str | None) -> str | None:
        return None if value is None else value.encode("utf-8", "backslashreplace").decode("utf-8")

    return {"error": {"message": text(message), "type": kind, "param": text(param), "code": code}}
