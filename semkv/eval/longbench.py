"""LongBench v1 (21 tasks) and v2 (503 multiple-choice items) from the user's copy of the official data files.

v1 (THUDM/LongBench @ 2e00731, `pred.py` / `eval.py`): rows `{input, context, answers, length, dataset, language,
all_classes, _id}` in `data_dir/<dataset>.jsonl` (the official data.zip); the prompt is the task's official template
(packaged: semkv/data/longbench_v1_prompts.json), middle-truncated when it is longer than `length` tokens (the first
and the last `length/2` tokens, each half decoded); no chat template for trec, triviaqa, samsum, lsht, lcc and
repobench-p; max new tokens per task from longbench_v1_maxlen.json; the official metrics (`longbench_metrics`).
v2 (`pred.py`, `result.py`): `data_dir/data.json` (a list, or data.jsonl) with `{_id, domain, sub_domain, difficulty,
length, question, choice_A..D, answer, context}`; the 0-shot template, the token list middle-truncated to `length`,
128 new tokens (greedy here; the official run samples at temperature 0.1), the answer letter extracted from "The
correct answer is (X)"; accuracy overall and by difficulty and length (`v2_accuracy`).
The interface joins context and question with a blank line: the template's text after the context is the question,
which is exact where that text starts with a blank line (all tasks but trec/lsht, which have one newline there,
and lcc/repobench-p, which have none).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from semkv.errors import SemkvError
from semkv.eval.files import data_file, read_json, read_jsonl
from semkv.eval.longbench_metrics import extract_choice, score_v1
from semkv.eval.task import Sample

_DATA = Path(__file__).resolve().parents[1] / "data"
V1_PROMPTS: dict[str, str] = json.loads((_DATA / "longbench_v1_prompts.json").read_text(encoding="utf-8"))
V1_MAX_NEW: dict[str, int] = json.loads((_DATA / "longbench_v1_maxlen.json").read_text(encoding="utf-8"))
V2_TEMPLATE = (_DATA / "longbench_v2_0shot.txt").read_text(encoding="utf-8")
V1_NO_CHAT = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
HINT = " (LongBench's test data is on the Hugging Face hub: THUDM/LongBench data.zip, THUDM/LongBench-v2 data.json)"


def split_prompt(prompt: str, tail: str, halves: tuple[str, str] | None) -> tuple[str, str]:
    """(context, question) of a prompt whose template text after the context is `tail`. If truncation cut into the
    tail, the first half is the context and the second the question."""
    if prompt.endswith(tail) and len(prompt) > len(tail):
        question = tail[2:] if tail.startswith("\n\n") else tail.lstrip("\n")
        return prompt[:len(prompt) - len(tail)], question
    return halves


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


@dataclass
class LongBenchV1:
    dataset: str
    data_dir: Path

    def __post_init__(self):
        if self.dataset not in V1_PROMPTS:
            raise SemkvError(f"unknown LongBench dataset {self.dataset!r}; known: {', '.join(V1_PROMPTS)}")
        self.name = f"longbench_{self.dataset}"
        self.max_new_tokens = V1_MAX_NEW[self.dataset]
        self.chat = self.dataset not in V1_NO_CHAT

    def samples(self, tokenizer: Any, length: int, n: int, seed: int) -> list[Sample]:
        """The first n rows (file order; `seed` is not used), truncated to `length` tokens (0: not truncated)."""
        path = data_file(self.data_dir, f"{self.dataset}.jsonl", f"LongBench v1 task {self.dataset!r}", HINT)
        template = V1_PROMPTS[self.dataset]
        out = []
        for row in read_jsonl(path)[:n]:
            prompt = template.format(**row)
            tail = template.split("{context}", 1)[1].format(**row)
            halves = None
            ids = _ids(tokenizer, prompt)
            if length and len(ids) > length:
                half = int(length / 2)
                halves = (tokenizer.decode(ids[:half], skip_special_tokens=True),
                          tokenizer.decode(ids[-half:], skip_special_tokens=True))
                prompt = halves[0] + halves[1]
            context, question = split_prompt(prompt, tail, halves)
            out.append(Sample(self.name, str(row["_id"]), context, question, list(row["answers"]), length=length,
                              meta={"all_classes": row["all_classes"], "words": row["length"],
                                    "language": row.get("language"), "truncated": halves is not None}))
        return out

    def score(self, prediction: str, sample: Sample) -> float:
        return 100 * score_v1(self.dataset, prediction, sample.answers, sample.meta["all_classes"])


@dataclass
class LongBenchV2:
    data_dir: Path
    name: str = "longbench_v2"
    max_new_tokens: int = 128
    chat: bool = True

    def samples(self, tokenizer: Any, length: int, n: int, seed: int) -> list[Sample]:
        """The first n items (file order; `seed` is not used), truncated to `length` tokens (0: not truncated)."""
        path = data_file(self.data_dir, ["data.json", "data.jsonl"], "LongBench v2", HINT)
        rows = read_json(path) if path.suffix == ".json" else read_jsonl(path)
        out = []
        for row in rows[:n]:
            prompt = V2_TEMPLATE.replace("$DOC$", row["context"].strip()).replace("$Q$", row["question"].strip())
            for letter in "ABCD":
                prompt = prompt.replace(f"$C_{letter}$", row[f"choice_{letter}"].strip())
            tail = prompt[prompt.rindex("\n</text>") + len("\n</text>"):]
            halves = None
            ids = tokenizer.encode(prompt)
            if length and len(ids) > length:
                halves = (tokenizer.decode(ids[:length // 2], skip_special_tokens=True),
                          tokenizer.decode(ids[-length // 2:], skip_special_tokens=True))
                prompt = tokenizer.decode(ids[:length // 2] + ids[-length // 2:], skip_special_tokens=True)
            context, question = split_prompt(prompt, tail, halves)
            out.append(Sample(self.name, str(row["_id"]), context, question, [row["answer"]], length=length,
                              meta={key: row[key] for key in ("domain", "sub_domain", "difficulty", "length")}))
        return out

    def score(self, prediction: str, sample: Sample) -> float:
        return 100.0 * (extract_choice(prediction) == sample.answers[0])


def v2_accuracy(samples: list[Sample], scores: list[float]) -> dict[str, float]:
    """Accuracy (0..100, 1 decimal as `result.py`) overall, by difficulty (easy/hard) and by length
    (short/medium/long); `result.py` counts medium items under long by a typo, here each goes to its own group."""
    groups: dict[str, list[float]] = {"overall": list(scores)}
    for sample, score in zip(samples, scores):
        groups.setdefault(sample.meta["difficulty"], []).append(score)
        groups.setdefault(sample.meta["length"], []).append(score)
    return {key: round(sum(v) / len(v), 1) for key, v in groups.items()}
