"""Reading user-supplied evaluation data, with errors that say which file is expected where."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from semkv.errors import SemkvError


def data_file(folder: str | Path, names: str | list[str], what: str, hint: str = "") -> Path:
    """The first of `names` that exists in `folder`, else a SemkvError naming the expected file(s) and folder
    (and `hint`: where to get the data)."""
    names = [names] if isinstance(names, str) else names
    for name in names:
        path = Path(folder) / name
        if path.is_file():
            return path
    expected = " or ".join(names)
    raise SemkvError(f"{what}: expected {expected} in {Path(folder).resolve()}, not found{hint}")


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
