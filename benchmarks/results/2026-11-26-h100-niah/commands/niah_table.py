"""The results page's NIAH tables from the two eval directories: per method and length the score of each of the eight
RULER NIAH tasks, their average, and the difference to Full KV's average over the same tasks (a row that misses a
task is compared on the tasks it has). Usage: python niah_table.py DIR... (budget 0.1 rows, and 0.03 if present)."""
from __future__ import annotations

import json
import sys
from collections import defaultdict

TASKS = ["single_1", "single_2", "single_3", "multikey_1", "multikey_2", "multikey_3", "multivalue", "multiquery"]
ORDER = ["full", "chess", "chunkkv", "chunkkv[neighbours=1]", "sentencekv", "sentencekv[retain=sentences]",
         "dynsplit", "dynsplit[neighbours=1]", "tokenselect", "tokenselect[neighbours=8]", "quest", "snapkv"]


def main(dirs: list[str]) -> None:
    cells: dict[tuple, list[float]] = defaultdict(list)
    for d in dirs:
        for line in open(f"{d}/predictions.jsonl"):
            r = json.loads(line)
            task = r["task"].removeprefix("ruler_niah_")
            if task in TASKS and r["budget"] in (None, 0.1):
                cells[(r["length"], r["method"], task)].append(r["score"])
    print("| method @ 10% | length | " + " | ".join(TASKS) + " | NIAH avg | vs Full KV |")
    print("|---" * (len(TASKS) + 4) + "|")
    for length in sorted({k[0] for k in cells}):
        full = {t: sum(v) / len(v) for (n, m, t), v in cells.items() if n == length and m == "full"}
        for method in [m for m in ORDER if any(k[:2] == (length, m) for k in cells)]:
            means = {t: sum(v) / len(v) for (n, m, t), v in cells.items() if n == length and m == method}
            shared = [t for t in TASKS if t in means and t in full]
            avg = sum(means[t] for t in shared) / len(shared)
            ref = sum(full[t] for t in shared) / len(shared)
            note = "" if len(shared) == len(TASKS) else f" ({len(shared)} tasks)"
            delta = "" if method == "full" else f"{avg - ref:+.1f}{note}"
            row = [f"{means[t]:.1f}" if t in means else "-" for t in TASKS]
            print(f"| {method} | {length} | " + " | ".join(row) + f" | {avg:.1f} | {delta} |")


if __name__ == "__main__":
    main(sys.argv[1:])
