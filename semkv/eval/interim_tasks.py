"""Interim task registry of the runner, until the task generators (passkey, NIAH, RULER, LongBench, book loading) are
merged: a passkey task in InfiniteBench's format and the loader of the Project Gutenberg books for perplexity.

`TASKS` maps a task name to `make(data_dir) -> Task`; `data_dir` is the root given by `--data-dir` (None when not
given) and a task that needs data raises `SemkvError` naming the file it expects, before any model is loaded.
"""
from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any, Callable

from semkv.errors import SemkvError
from semkv.eval.task import Sample, Task

NOISE = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
QUESTION = "What is the pass key?"


class PasskeyTask:
    """InfiniteBench's passkey retrieval: a 5-digit key in repeated filler, the needle at evenly spaced depths."""

    name = "passkey"
    max_new_tokens = 12
    chat = True

    def samples(self, tokenizer: Any, length: int, n: int, seed: int) -> list[Sample]:
        rng = random.Random(f"passkey-{length}-{seed}")
        sentences = [x + "." for x in NOISE.split(".")[:-1]]  # the filler is cut by sentences, for the length
        per_sentence = len(tokenizer(NOISE * 10, add_special_tokens=False)["input_ids"]) / (10 * len(sentences))
        out = []
        for i in range(n):
            key = str(rng.randint(10000, 99999))
            depth = 100.0 * (i + 0.5) / n
            needle = f" The pass key is {key}. Remember it. {key} is the pass key."
            count = max(1, round((length - _prompt_tokens(tokenizer, INTRO + needle, QUESTION)) / per_sentence))
            filler = [sentences[j % len(sentences)] for j in range(count)]
            cut = round(count * depth / 100)
            context = INTRO + "".join(filler[:cut]) + needle + "".join(filler[cut:])
            out.append(Sample(self.name, f"passkey-{length}-{i}", context, QUESTION, [key], length, depth, [needle]))
        return out

    def score(self, prediction: str, sample: Sample) -> float:
        numbers = re.findall(r"\d+", prediction)
        return 100.0 if numbers and numbers[0] == sample.answers[0] else 0.0


def _prompt_tokens(tokenizer: Any, context: str, question: str) -> int:
    """Tokens of context + question in the chat template, as `LLM.encode` builds the prompt."""
    messages = [{"role": "user", "content": f"{context}\n\n{question}"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def gutenberg_body(text: str) -> str:
    """A Project Gutenberg eBook without its header and license footer (kept in the stored files, stripped here)."""
    start = re.search(r"\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG EBOOK[^\n]*\n", text)
    end = re.search(r"\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG EBOOK|End of (the )?Project Gutenberg", text)
    body = text[start.end() if start else 0 : end.start() if end else len(text)]
    return body.replace("\r\n", "\n").lstrip("\ufeff").strip()


def load_books(data_dir: Path | None) -> dict[str, str]:
    """Book name -> text of every `*.txt` in `<data_dir>/books`."""
    if data_dir is None:
        raise SemkvError("task 'perplexity' needs --data-dir: a folder with books/*.txt (e.g. Project Gutenberg "
                         "eBooks)")
    folder = Path(data_dir) / "books"
    files = sorted(folder.glob("*.txt")) if folder.is_dir() else []
    if not files:
        raise SemkvError(f"task 'perplexity' needs long books as plain text: expected *.txt files in {folder}")
    return {f.stem: gutenberg_body(f.read_text(encoding="utf-8", errors="replace")) for f in files}


# perplexity is built by the runner itself (`runner.make_task`), with `load_books` and its --ppl-tokens
TASKS: dict[str, Callable[[Path | None], Task]] = {"passkey": lambda data_dir: PasskeyTask()}
