"""What the vLLM comparison's scripts share (`vllm_offline.py`, `vllm_quality.py`, `vllm_serve.py`): the prompts
(windows of Paul Graham's essays, RULER's haystack, each followed by a question), semkv's prompt encoding on a
tokenizer alone (so vLLM gets the very token ids semkv's `generate` makes), the semkv method entries, the card's
memory over a run, and the raw files.
"""
from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from semkv.text import TextModel

QUESTIONS = (
    "In one paragraph, what is the main argument of the text above?",
    "List three concrete examples the author gives in the text above.",
    "What advice does the author give to founders in the text above?",
    "Which people does the author mention in the text above, and why?",
    "What does the author say about programming or programming languages in the text above?",
    "Summarize the last part of the text above in three sentences.",
    "Which claim in the text above is the most surprising, and why?",
    "What questions does the author leave open in the text above?",
)
STRIDE = 1009  # tokens between the starts of consecutive windows: no two prompts share a first page


def load_text(model: str | None) -> TextModel:
    """`semkv.LLM`'s prompt encoding (question joined, chat template, answer prefix) for `model` (a HF folder), as
    `TextModel` (which `LLM` is): the ids `LLM.generate` makes from the same text, without loading weights."""
    from semkv.text import TextModel

    return TextModel.load(model)


@dataclass
class Prompt:
    document: str
    question: str
    ids: list[int]  # semkv's encoding of document + question in the chat template


class Essays:
    """Windows of RULER's essay haystack (`data_dir/paul_graham/ruler_PaulGrahamEssays.json`, where `semkv eval
    --data-dir` reads it) as prompts of a given length in tokens."""

    def __init__(self, text: TextModel, data_dir: str | Path):
        from semkv.eval.files import read_json

        self.text = text
        haystack = read_json(Path(data_dir) / "paul_graham" / "ruler_PaulGrahamEssays.json")["text"]
        self.tokens = text.tokenizer(haystack, add_special_tokens=False)["input_ids"]

    def prompts(self, first: int, n: int, length: int, questions: int = 1) -> list[Prompt]:
        """Windows `first`..`first + n - 1` (each `STRIDE` tokens after the last, wrapping), each `questions` times
        with the next question: prompts of `length` tokens (within a few) in the chat template."""
        out = []
        for k in range(first, first + n):
            document = None
            for q in range(questions):
                question = QUESTIONS[q % len(QUESTIONS)]
                if document is None:
                    document = self._document(k, length, question)
                ids, _ = self.text.encode(document, question)
                out.append(Prompt(document, question, ids))
        return out

    def _document(self, k: int, length: int, question: str) -> str:
        overhead = len(self.text.encode("x", question)[0]) - 1
        size = length - overhead
        if size > len(self.tokens):
            raise SystemExit(f"the essays hold {len(self.tokens)} tokens; a prompt of {length} needs {size}")
        start = k * STRIDE % (len(self.tokens) - size + 1)
        return self.text.tokenizer.decode(self.tokens[start:start + size])


def add_common(p, out_help: str, smoke_help: str) -> None:
    """The options every script of the comparison takes."""
    p.add_argument("--model", help="the HF folder both engines load (on the device: $QWEN, semkv's conversion of the "
                   "GGUF)")
    p.add_argument("--data", default=".carry/data", help="the data folder, laid out as `semkv eval --data-dir` reads "
                   "it: paul_graham/ruler_PaulGrahamEssays.json, ruler/wonderwords/")
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="both engines' share of the card")
    p.add_argument("--smoke", action="store_true", help=smoke_help)


def smoke_model(p, args) -> None:
    """--smoke without --model: the embedded SmolLM2's converted folder; otherwise --model is required."""
    if args.smoke and not args.model:
        from semkv.models.loader import embedded_model_path, model_folder

        args.model = str(model_folder(embedded_model_path())[1])
    if not args.model:
        p.error("--model is required (or --smoke)")


def method_entry(entry: str, budget: float | int | None) -> tuple[str, dict[str, Any], Any, str]:
    """'chess[anchor=queries]' -> ('chess', {'anchor': 'queries'}, budget, 'chess[anchor=queries]@0.1'): a
    `semkv eval --methods` entry; Full KV takes no budget."""
    from semkv.cli.args import split_variant

    name, params = split_variant(entry)
    budget = None if name == "full" else budget
    return name, params, budget, entry if budget is None else f"{entry}@{budget}"


def safe(label: str) -> str:
    """A file name for a run label."""
    return re.sub(r"[^\w.@-]+", "_", label)


class CardMemory:
    """The card's memory in use (nvidia-smi, MiB), polled on a thread: its peak over a run less what was in use
    before, which counts every process the run started (vLLM's engine core, semkv's engine process). The card is
    the first of CUDA_VISIBLE_DEVICES (several runs side by side on a machine of several GPUs)."""

    def __init__(self, every: float = 0.25):
        self.every, self.samples = every, []
        self.base = self.read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    @staticmethod
    def read() -> int | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                  "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]], capture_output=True, text=True, timeout=10).stdout
            return int(out.split()[0])
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def _poll(self) -> None:
        while not self._stop.wait(self.every):
            value = self.read()
            if value is not None:
                self.samples.append(value)

    def __enter__(self) -> "CardMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def peak_gib(self) -> float | None:
        if self.base is None or not self.samples:
            return None
        return round((max(self.samples) - self.base) / 1024, 2)


def write_json(path: Path, data: Any) -> None:
    """JSON, gzip-compressed when the name ends in .gz; written whole (a killed run leaves no half file)."""
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".gz":
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            json.dump(data, f)
    else:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> Any:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    return json.loads(path.read_text())
