"""A results directory: `config.json` (everything needed to reproduce the run), `predictions.jsonl` (one row per
sample x method x budget, appended as each finishes) and `traces/` (what each method attended, for the HTML view).

Rows are the unit of resumption: a row is written whole, with one `write` and a flush, so a killed run leaves at most
one torn last line, which `repair` cuts off before new rows are appended.

A finished directory may keep its rows compressed (`predictions.jsonl.gz`, `runs.jsonl.gz`, as the results pages under
`benchmarks/results/` do): they are read as they are, before the rows of a plain file that a later run appends to.
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

from semkv.errors import SemkvError

CONFIG, PREDICTIONS, RUNS, TRACES = "config.json", "predictions.jsonl", "runs.jsonl", "traces"


def row_key(row: dict[str, Any]) -> tuple:
    """What identifies a result: the sample and the method with its budget (128 and 0.1 stay distinct)."""
    return row["task"], row["length"], row["sample_id"], row["method"], json.dumps(row["budget"])


class ResultsDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    @property
    def predictions(self) -> Path:
        return self.path / PREDICTIONS

    def lines(self, name: str) -> list[str]:
        """The lines of `name` (predictions or runs): its compressed copy `name.gz` first, then the plain file."""
        lines = []
        if (self.path / f"{name}.gz").is_file():
            with gzip.open(self.path / f"{name}.gz", "rt", encoding="utf-8") as f:
                lines += f.read().splitlines()
        if (self.path / name).is_file():
            lines += (self.path / name).read_text(encoding="utf-8").splitlines()
        return lines

    def rows(self) -> list[dict[str, Any]]:
        """Finished rows, first occurrence of each key, a torn last line ignored."""
        seen, rows = set(), []
        for line in self.lines(PREDICTIONS):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row_key(row) not in seen:
                seen.add(row_key(row))
                rows.append(row)
        return rows

    def repair(self) -> None:
        """Cut a torn last line (a run killed while writing) so that appended rows start on a line of their own."""
        if not self.predictions.is_file():
            return
        data = self.predictions.read_bytes()
        if data and not data.endswith(b"\n"):
            self.predictions.write_bytes(data[: data.rfind(b"\n") + 1])

    def append(self, row: dict[str, Any]) -> None:
        with open(self.predictions, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()

    def append_run(self, record: dict[str, Any]) -> None:
        """The speed of one continuous-batching run (`runner.run_batch`): one line of `runs.jsonl`."""
        with open(self.path / RUNS, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def runs(self) -> list[dict[str, Any]]:
        """Every recorded batched run, a torn last line ignored."""
        runs = []
        for line in self.lines(RUNS):
            try:
                runs.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return runs

    def config(self) -> dict[str, Any] | None:
        path = self.path / CONFIG
        return json.loads(path.read_text()) if path.is_file() else None

    def write_config(self, config: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / CONFIG).write_text(json.dumps(config, indent=2, default=str) + "\n")

    # -- traces ---------------------------------------------------------------------------------------------------
    def trace_path(self, task: str, sample_id: str) -> Path:
        return self.path / TRACES / f"{_safe(task)}__{_safe(sample_id)}.json.gz"

    def read_trace(self, path: Path) -> dict[str, Any]:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)

    def write_trace(self, task: str, sample_id: str, data: dict[str, Any]) -> None:
        path = self.trace_path(task, sample_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            json.dump(data, f)
        tmp.replace(path)  # a killed run never leaves half a trace

    def traces(self) -> list[Path]:
        return sorted((self.path / TRACES).glob("*.json.gz"))

    def find_trace(self, sample_id: str) -> dict[str, Any]:
        found = [p for p in self.traces() if p.name.endswith(f"__{_safe(sample_id)}.json.gz")]
        if not found:
            names = ", ".join(p.name[: -len(".json.gz")].split("__", 1)[-1] for p in self.traces())
            raise SemkvError(f"sample {sample_id!r} has no trace in {self.path / TRACES}; traced samples: "
                             f"{names or 'none'} (run `semkv eval` with --trace-samples N)")
        return self.read_trace(found[0])


def _safe(name: str) -> str:
    """A file-name-safe form of a task or sample id."""
    return re.sub(r"[^\w.-]+", "_", name)
