"""What an evaluation task is, for the runner: samples to generate from, and a scorer.

A generative task turns (tokenizer, target length in the model's tokens, seed) into `Sample`s; the runner feeds
`context` + `question` to `LLM.generate`/`LLM.compare` (the question marks the query, so prefill-eviction methods can
run query-agnostic) and scores the prediction with `task.score`, 0..100. `needles` are the spans of the context the
answer depends on (passkey, needle sentence, values), used for needle-retention diagnostics and highlighting.
`answer_prefix` is the start of the model's answer (RULER's answer prefix, InfiniteBench's "The pass key is"): the
runner appends it verbatim after the encoded prompt (after the chat template's generation prompt when chat is on) and
the prediction is what the model writes after it. `prompt_text` is the text whose tokens `length` counts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Sample:
    task: str
    sample_id: str  # unique within the task and stable across runs with the same seed (resumability key)
    context: str
    question: str
    answers: list[str]  # gold answers (all required or any, as the task's scorer says)
    length: int = 0  # requested context length in the model's tokens (0: natural length, e.g. LongBench)
    depth: float | None = None  # needle depth in percent, where the task has one
    needles: list[str] = field(default_factory=list)  # exact substrings of `context` the answer depends on
    meta: dict[str, Any] = field(default_factory=dict)  # task-specific fields (category, difficulty...)
    answer_prefix: str = ""  # the start of the answer, appended after the (chat-wrapped) prompt; "" for none


def prompt_text(sample: Sample) -> str:
    """The prompt without chat template: `LLM.encode`'s join of context and question, then the answer prefix."""
    return f"{sample.context}\n\n{sample.question}{sample.answer_prefix}"


class Task(Protocol):
    name: str
    max_new_tokens: int
    chat: bool  # wrap in the chat template

    def samples(self, tokenizer: Any, length: int, n: int, seed: int) -> list[Sample]:
        """`n` samples whose `prompt_text` is `length` tokens (within 2%) for this tokenizer."""

    def score(self, prediction: str, sample: Sample) -> float:
        """0..100: 100 on the gold answer, 0 on an empty prediction."""
