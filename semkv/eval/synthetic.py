"""InfiniteBench's synthetic retrieval tasks, generated at any length: passkey, number_string and kv_retrieval.

Spec: OpenBMB/InfiniteBench @ 88b3daa (`data/construct_synthetic_dataset.py`, `src/prompt.py` open-model template,
`src/eval_utils.py`, `src/compute_scores.py`); see shared/data/infinitebench/SOURCE.md. passkey / number_string
hide one needle line among repeated noise lines at a depth that sweeps 0..100% over the samples (InfiniteBench: 59
depths x 10 keys at 128K); kv_retrieval is a JSON object of uuid4 pairs whose queried record sweeps the same way. The
noise-line or record count is fitted to the requested length in the model's tokens. The open-model prompt ends with
"The pass key is" / "The sequence of digits is"; here that line is the answer prefix (after the assistant header
when chat is on, after a blank line otherwise, which gives the official prompt verbatim).
"""
from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from semkv.eval.lengths import fit_sample
from semkv.eval.metrics import digits_match, kv_match
from semkv.eval.task import Sample

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"


def passkey_key(rng: random.Random) -> str:
    return "".join(str(rng.randint(0, 9)) for _ in range(5))


def number_string_key(rng: random.Random) -> str:
    """5 random digits, then 5 times a random digit is repeated in place: 10 digits with runs."""
    digits = [str(rng.randint(0, 9)) for _ in range(5)]
    for k in range(5):
        pos = rng.randint(0, 5 + k - 1)
        digits.insert(pos, digits[pos])
    return "".join(digits)


def sweep(n: int) -> list[float]:
    """Needle depths in percent for n samples: 0..100 evenly, as InfiniteBench steps the needle line."""
    return [float(d) for d in np.linspace(0, 100, n)]


@dataclass
class NoiseRetrieval:
    """passkey / number_string: find the needle's digits among noise lines."""

    name: str
    instruction: str
    needle: str  # with {key}
    question: str
    answer_line: str
    make_key: Callable[[random.Random], str]
    max_new_tokens: int
    chat: bool = True

    def samples(self, tokenizer: Any, length: int, n: int, seed: int) -> list[Sample]:
        out, size = [], None
        for i, depth in enumerate(sweep(n)):
            key = self.make_key(random.Random(f"{self.name}:{seed}:{i}"))
            needle = self.needle.format(key=key)

            def build(lines: int, depth=depth, key=key, needle=needle, i=i) -> Sample:
                before = round(lines * depth / 100)
                context = f"{self.instruction}\n\n{NOISE * before}{needle}{NOISE * (lines - before)}"
                return Sample(self.name, f"{self.name}-{length}-s{seed}-{i}-d{depth:g}", context, self.question, [key],
                              length=length, depth=depth, needles=[needle.strip()], meta={"noise_lines": lines},
                              answer_prefix=self.answer_line if self.chat else f"\n\n{self.answer_line}")

            sample, size = fit_sample(tokenizer, length, build, guess=64, low=0, start=size)
            out.append(sample)
        return out

    def score(self, prediction: str, sample: Sample) -> float:
        return digits_match(prediction, sample.answers)


@dataclass
class KVRetrieval:
    """kv_retrieval: the value of one uuid key in a JSON object of uuid4 key-value pairs."""

    name: str = "kv_retrieval"
    max_new_tokens: int = 50
    chat: bool = True
    instruction: str = "Extract the value corresponding to the specified key in the JSON object below."

    def samples(self, tokenizer: Any, length: int, n: int, seed: int) -> list[Sample]:
        out, size = [], None
        for i in range(n):
            def build(size: int, i=i) -> Sample:
                rng = random.Random(f"{self.name}:{seed}:{i}")
                records = [(str(uuid.UUID(int=rng.getrandbits(128), version=4)),
                            str(uuid.UUID(int=rng.getrandbits(128), version=4))) for _ in range(size)]
                queried = i * size // n  # the queried record's depth sweeps linearly over the samples
                key, value = records[queried]
                context = f"{self.instruction}\n\nJSON data:\n{json.dumps(dict(records))}"
                question = f'\nKey: "{key}"\nThe value associated with the specified key is: '
                sample_id = f"{self.name}-{length}-s{seed}-{i}-d{100 * i / n:g}"
                return Sample(self.name, sample_id, context, question, [value], length=length,
                              depth=100 * queried / size, needles=[f'"{key}": "{value}"'], meta={"records": size})

            sample, size = fit_sample(tokenizer, length, build, guess=16, start=size)
            out.append(sample)
        return out

    def score(self, prediction: str, sample: Sample) -> float:
        return kv_match(prediction, sample.answers)


def passkey(chat: bool = True) -> NoiseRetrieval:
    return NoiseRetrieval(
        "passkey", "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information.", "The pass key is {key}. Remember it. {key} is the pass "
        "key.\n", "What is the pass key?", "The pass key is", passkey_key, max_new_tokens=6, chat=chat)


def number_string(chat: bool = True) -> NoiseRetrieval:
    return NoiseRetrieval(
        "number_string", "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz "
        "you about the important information there.", "The sequence of digits is {key}. Remember it. {key} is the "
        "sequence of digits.\n", "What is the sequence of digits?", "The sequence of digits is", number_string_key,
        max_new_tokens=12, chat=chat)


def kv_retrieval(chat: bool = True) -> KVRetrieval:
    return KVRetrieval(chat=chat)
