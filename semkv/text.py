"""A model's text side: its tokenizer, chat template, context length and end-of-sequence tokens, without its weights.

`LLM` is one (with the weights loaded into the engine); `semkv serve`'s web process holds only this (`TextModel.load`):
it tokenizes, checks and detokenizes while the engine runs in a process of its own.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence as Seq

from semkv.engine.hooks import KVMethod
from semkv.engine.sequence import GenerationStats, SamplingParams, TokenLogprob, check_sampling
from semkv.engine.trace import Trace
from semkv.errors import SemkvError, check_text
from semkv.models.config import ModelConfig
from semkv.models.loader import load_text
from semkv.prefix_tokens import MIN_SHARED, PrefixTokens


@dataclass
class GenerationOutput:
    """What `LLM.generate` and `LLM.compare` return for one prompt: the text, its tokens, why it stopped, and the
    statistics of its prefill, decode steps and KV cache (`stats`)."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "eos", "stop" or "length"
    stats: GenerationStats
    prompt_token_ids: list[int]
    logprobs: list[float] | None = None  # of each new token (`logprobs=`), or of teacher-forced continuation tokens
    top_logprobs: list[list[tuple[int, float]]] | None = None  # each step's most likely (token id, log-probability)
    trace: Trace | None = None  # attended / resident positions, when `compare(trace_steps=...)` asked for them


class TextModel:
    """What a front end needs of a model: `tokenizer` and `config` (a `ModelConfig`: context length, vocabulary size,
    eos ids, sliding window). Prompts in, checked sampling parameters, answers out."""

    tokenizer: Any
    config: ModelConfig
    # tokenizes texts of at least MIN_SHARED characters elsewhere (`semkv serve`'s tokenizer processes; a text it
    # gives None for is tokenized here), or None
    long_texts: Callable[[str, bool], tuple[list[int], Any] | None] | None = None

    def __init__(self, tokenizer: Any, config: ModelConfig):
        self.tokenizer, self.config = tokenizer, config

    @classmethod
    def load(cls, model: str | os.PathLike | None) -> "TextModel":
        """The tokenizer and configuration of a HF folder, a .gguf file or the embedded model (`load_text`)."""
        return cls(*load_text(model))

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    # -- prompts --------------------------------------------------------------------------------------------------
    def prompt_text(self, prompt: str, question: str | None = None, chat: bool = True, answer_prefix: str = "") -> str:
        """The text `encode` tokenizes: prompt and question joined, wrapped in the chat template if asked, then the
        answer prefix (after the template's generation prompt, so the model continues it)."""
        content = prompt if question is None else f"{prompt}\n\n{question}"
        if chat:
            content = self.chat_text([{"role": "user", "content": content}])
        return content + answer_prefix

    def chat_text(self, messages: Seq[dict[str, str]], hint: str = "use chat=False (--no-chat)") -> str:
        """A conversation (`[{"role": "system" | "user" | "assistant", "content": text}, ...]`) in the model's chat
        template, ending with the assistant's generation prompt; without a template, SemkvError ending with `hint`."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise SemkvError(f"this model's tokenizer has no chat template; {hint}")
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)

    def tokens(self, text: str, special: bool) -> tuple[list[int], Any]:
        """Token ids of `text` (with the tokenizer's special tokens when `special`) and each token's end offset
        ([ids] int32), reusing the tokens of a recent text that starts alike (`PrefixTokens`: a follow-up question on a
        long document is tokenized from near the document's end); by `long_texts` when it is set and the text has at
        least `MIN_SHARED` characters."""
        if self.long_texts is not None and len(text) >= MIN_SHARED:
            tokens = self.long_texts(text, special)
            if tokens is not None:
                return tokens
        return self.tokens_here(text, special)

    def tokens_here(self, text: str, special: bool) -> tuple[list[int], Any]:
        """`tokens` in this process."""
        cache = getattr(self, "_prefix_tokens", None)
        if cache is None or cache.tokenizer is not self.tokenizer:
            cache = self._prefix_tokens = PrefixTokens(self.tokenizer)
        return cache(text, special)

    def encode_chat(self, messages: Seq[dict[str, str]]) -> list[int]:
        """Token ids of `chat_text(messages)`."""
        for i, message in enumerate(messages):
            check_text(f"message {i}'s content", message.get("content") if isinstance(message, dict) else message)
        text = self.chat_text(messages, "send a completion prompt instead")
        return self.tokens(text, False)[0]

    def encode(self, prompt: str, question: str | None = None, chat: bool = True,
               answer_prefix: str = "") -> tuple[list[int], int | None]:
        """Token ids of `prompt_text` and where the question starts in them (None without a question). SemkvError
        for what is not text a tokenizer takes."""
        check_text("the prompt", prompt)
        if question is not None:
            check_text("the question", question)
        check_text("the answer prefix", answer_prefix)
        text = self.prompt_text(prompt, question, chat, answer_prefix)
        special = not chat  # the chat template writes its own special tokens
        ids, ends = self.tokens(text, special)
        if question is None:
            return ids, None
        if ends is None:
            raise SemkvError("this model's tokenizer gives no character offsets, which a prompt with a question needs; "
                             "join the question to the prompt instead")
        where = text.rfind(question, 0, len(text) - len(answer_prefix))
        # the first token that ends past the question's first character holds its start
        return ids, int((ends > where).argmax())

    def token_ids(self, tokens: str | Seq[int], what: str) -> list[int]:
        """Token ids of a text (no special tokens added) or checked ids; SemkvError names `what` if they are bad."""
        if isinstance(tokens, str):
            check_text(f"the {what}", tokens)
            tokens = self.tokens(tokens, False)[0]
        vocab = self.config.vocab_size
        ids = list(tokens) if isinstance(tokens, Seq) else []
        if not ids or not all(type(t) is int and 0 <= t < vocab for t in ids):
            raise SemkvError(f"the {what} must be non-empty text or a list of token ids in [0, {vocab})")
        return ids

    def sampling_params(self, max_new_tokens, temperature, top_k, top_p, seed, stop, ignore_eos,
                        logprobs: int | None = None, spell: Callable[[str], str] = str) -> SamplingParams:
        """Checked sampling parameters (SemkvError names the first bad one as `spell` writes it: `check_sampling`)."""
        check_sampling(max_new_tokens, temperature, top_k, top_p, spell, seed)
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stops):
            raise SemkvError(f"stop={stop!r} must be a list of non-empty strings")
        for s in stops:
            check_text("a stop string", s)
        if not isinstance(ignore_eos, bool):
            raise SemkvError(f"ignore_eos={ignore_eos!r} must be True or False")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= 20):
            raise SemkvError(f"logprobs={logprobs!r} must be an int in 0..20 (the most likely tokens to list)")
        return SamplingParams(max_new_tokens, float(temperature), top_k, float(top_p), int(seed), stops, ignore_eos,
                              logprobs)

    def check_length(self, which: str, n_prompt: int, max_new: int, allow_overlong: bool = False,
                     method: KVMethod | None = None,
                     hint: str = "shorten it or pass allow_overlong=True (--allow-overlong)") -> None:
        """Raise SemkvError when a prompt and its new tokens pass the model's context (unless allowed, or the method
        extrapolates past it; the message ends with `hint`) or a sliding attention window."""
        allowed = allow_overlong or getattr(method, "extrapolates", False)
        limit = self.max_context
        window = self.config.sliding_window
        if window is not None and n_prompt + max_new > window:
            raise SemkvError(
                f"{which} has {n_prompt} tokens + {max_new} new tokens, more than this model's sliding attention "
                f"window of {window} tokens, which semkv does not implement"
            )
        if n_prompt + max_new > limit and not allowed:
            raise SemkvError(
                f"{which} has {n_prompt} tokens and asks for {max_new} new tokens: {n_prompt + max_new} > the "
                f"model's context of {limit} tokens; {hint}"
            )

    def answer(self, prompt_ids: list[int], token_ids: list[int], finish_reason: str, stats: GenerationStats,
               stop: Seq[str] = (), logprobs: list[TokenLogprob] | None = None) -> GenerationOutput:
        """A request's output: its new tokens' text (cut at the first stop string when one stopped it)."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if finish_reason == "stop":
            text = cut_at_stop(text, stop)
        out = GenerationOutput(text, list(token_ids), finish_reason, stats, list(prompt_ids))
        if logprobs is not None:
            out.logprobs = [t.logprob for t in logprobs]
            out.top_logprobs = [t.top for t in logprobs]
        return out


class Detokenizer:
    """A request's output text as its tokens arrive, each token decoded once (`tokenizers`' `DecodeStream`, as vLLM
    streams); a tokenizer it cannot follow (no Rust backend, or one that cleans up spaces after decoding) decodes the
    whole output again each time."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self.backend = None
        if self.backend is not None:
            from tokenizers.decoders import DecodeStream

            self.stream = DecodeStream(skip_special_tokens=True)
        self.seen = 0  # tokens decoded
        self.text = ""

    def text_of(self, token_ids: Seq[int]) -> str:
        """The text of the output so far (`token_ids`: all its tokens, the ones of earlier calls first), a character
        still split across tokens left out."""
        if self.backend is None:
            self.text = self.tokenizer.decode(token_ids, skip_special_tokens=True).rstrip("\ufffd")
        else:
            for token in token_ids[self.seen:]:
                self.text += self.stream.step(self.backend, token) or ""
        self.seen = len(token_ids)
        return self.text


def cut_at_stop(text: str, stops: Seq[str]) -> str:
    """The text before the first stop string in it (all of it when none occurs)."""
    return text[: min((text.find(s) for s in stops if s in text), default=len(text))]
