"""How an answer looks in the OpenAI API: a whole completion or chat completion, the chunks of a stream (server-sent
events), the usage object (with `prompt_tokens_details.cached_tokens`) and semkv's own numbers beside them."""
from __future__ import annotations

import json
import time
from typing import Any, Callable

from semkv.engine.sequence import TokenLogprob
from semkv.text import GenerationOutput, TextModel

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # semkv's finish reasons as the API names them


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def usage(output: GenerationOutput) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: the prompt tokens read from the prefix cache."""
    prompt, new = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new,
            "prompt_tokens_details": {"cached_tokens": output.stats.cached_tokens}}


class Render:
    """An answer in one endpoint's format: `whole` (not streamed) and `chunk` (one server-sent event)."""

    kind: str  # the object name of a chunk

    def __init__(self, text: TextModel, model: str, logprobs: bool, request_id: str):
        self.text, self.model, self.logprobs = text, model, logprobs
        self.id = f"{self.prefix}-{request_id}"
        self.created = int(time.time())

    prefix = "cmpl"

    def head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def token(self, token_id: int) -> str:
        return self.text.tokenizer.decode([token_id])

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        return {**self.head(self.kind), "choices": [], "usage": counts}

    def whole(self, output: GenerationOutput) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, text: str, finish: str | None, counts: dict[str, int] | None) -> dict[str, Any]:
        raise NotImplementedError

    opening: Callable[[], dict[str, Any]] | None = None  # the first event of a stream, if the format has one


def stats(output: GenerationOutput) -> dict[str, Any]:
    """semkv's own numbers of a request, beside the OpenAI fields."""
    s = output.stats
    return {"queue_s": s.queue_s, "prefill_s": s.prefill_s, "decode_s": s.decode_s, "kv_resident_tokens": s.kv_resident_tokens,
            "kv_attended_tokens": s.kv_attended_tokens}


class Completion(Render):
    kind = "text_completion"

    def _logprobs(self, ids: list[int], items: list[TokenLogprob], offset: int = 0) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        tokens = [self.token(t) for t in ids]
        offsets, at = [], offset
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {"tokens": tokens, "token_logprobs": [i.logprob for i in items],
                "top_logprobs": [{self.token(t): lp for t, lp in i.top} for i in items], "text_offset": offsets}

    def whole(self, output: GenerationOutput) -> dict[str, Any]:
        items = [TokenLogprob(lp, top) for lp, top in zip(output.logprobs or [], output.top_logprobs or [])]
        choice = {"index": 0, "text": output.text, "logprobs": self._logprobs(output.token_ids, items),
                  "finish_reason": FINISH.get(output.finish_reason, "stop")}
        return {**self.head(self.kind), "choices": [choice], "usage": usage(output), "semkv": stats(output)}

    def chunk(self, text, finish, counts):
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self.head(self.kind), "choices": [choice], **({"usage": counts} if counts else {})}


class Chat(Render):
    kind = "chat.completion.chunk"
    prefix = "chatcmpl"

    def _content(self, items: list[TokenLogprob], ids: list[int]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [dict(entry(t, i.logprob), top_logprobs=[entry(a, lp) for a, lp in i.top])
                            for t, i in zip(ids, items)]}

    def whole(self, output: GenerationOutput) -> dict[str, Any]:
        items = [TokenLogprob(lp, top) for lp, top in zip(output.logprobs or [], output.top_logprobs or [])]
        choice = {"index": 0, "message": {"role": "assistant", "content": output.text},
                  "logprobs": self._content(items, output.token_ids),
                  "finish_reason": FINISH.get(output.finish_reason, "stop")}
        return {**self.head("chat.completion"), "choices": [choice], "usage": usage(output), "semkv": stats(output)}

    def chunk(self, text, finish, counts):
        delta = {"content": text} if text or finish is None else {}  # the last chunk's delta may be empty
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**self.head(self.kind), "choices": [choice], **({"usage": counts} if counts else {})}

    def opening(self) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return {**self.head(self.kind), "choices": [choice]}

