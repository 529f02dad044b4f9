"""Merge eval directories that grew from copies of one directory on separate GPUs (run.sh) back into it: the rows of
each other directory whose key (`semkv.eval.store.row_key`) the main one lacks, its speed records (`runs.jsonl`) that
the main one lacks, and the union of their settings (`semkv.eval.runner._merge`; the arms' resolved parameters
joined, the rest of `resolved` from the other directory's run, as a resumed run records its own). The main
directory's rows stay first and unchanged, so it grows as a resumed run would.
    python merge.py MAIN OTHER...
"""
from __future__ import annotations

import json
import sys

from semkv.eval.runner import _merge
from semkv.eval.store import ResultsDir, row_key


def merge(main: ResultsDir, other: ResultsDir) -> tuple[int, int]:
    """Append what `other` has and `main` lacks; -> (rows, runs) appended."""
    keys = {row_key(r) for r in main.rows()}
    rows = [r for r in other.rows() if row_key(r) not in keys]
    for row in rows:
        main.append(row)
    seen = {json.dumps(r, sort_keys=True) for r in main.runs()}
    runs = [r for r in other.runs() if json.dumps(r, sort_keys=True) not in seen]
    for record in runs:
        main.append_run(record)
    mine, theirs = main.config(), other.config()
    resolved = dict(theirs["resolved"])  # the later run's commit, command and versions, as a resumed run keeps
    resolved["methods"] = mine["resolved"]["methods"] | theirs["resolved"]["methods"]
    main.write_config({"run": _merge(mine["run"], theirs["run"]), "resolved": resolved})
    return len(rows), len(runs)


if __name__ == "__main__":
    target = ResultsDir(sys.argv[1])
    target.repair()
    for path in sys.argv[2:]:
        added = merge(target, ResultsDir(path))
        print(f"{path}: {added[0]} rows, {added[1]} runs -> {sys.argv[1]}")
