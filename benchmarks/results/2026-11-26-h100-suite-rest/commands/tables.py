"""The results page's tables from the eval directories: per method and length the score of each task, their average,
and the difference to Full KV's average over the same tasks (a row that misses a task is compared on the tasks it
has; Full KV's rows have no budget and serve every budget), the methods in ORDER first, then any other arm. Usage:
    python tables.py niah|other|suite BUDGET DIR...      (BUDGET: a fraction such as 0.1, or tokens such as 2688)
niah: the eight RULER NIAH tasks; other: variable tracking, common and frequent words, QA on SQuAD and HotpotQA;
suite: the average of all thirteen per method and length, and its share of Full KV's (only where a method has all
thirteen at that length)."""
from __future__ import annotations

import sys
from collections import defaultdict

from semkv.eval.store import ResultsDir  # reads predictions.jsonl.gz as the pages keep it

TASKS = {"niah": ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                  "niah_multikey_3", "niah_multivalue", "niah_multiquery"],
         "other": ["vt", "cwe", "fwe", "qa_1", "qa_2"]}
ORDER = ["full", "chess", "chess[preset=aggressive]", "chess[preset=moderate]", "chess[preset=conservative]", "chunkkv",
         "chunkkv[neighbours=1]", "chunkkv[neighbours=3]", "chunkkv[chunk_size=20,neighbours=1]", "sentencekv",
         "sentencekv[retain=sentences]", "sentencekv[retain=sentences,keep_factor=8]", "sentencekv[score=tokens]",
         "sentencekv[retain=sentences,score=tokens]", "sentencekv[retain=sentences,score=tokens,keep_factor=4]",
         "sentencekv[retain=sentences,score=tokens,keep_factor=10]",
         "sentencekv[retain=sentences,score=tokens,query=current]",
         "sentencekv[retain=sentences,score=tokens,keep_factor=1]",
         "sentencekv[retain=sentences,score=tokens,query=current,keep_factor=1]", "dynsplit", "dynsplit[score=tokens]",
         "dynsplit[neighbours=1]", "dynsplit[group_reduce=max]", "dynsplit[n_sink=4]",
         "dynsplit[n_sink=16,n_recent=64]", "tokenselect",
         "tokenselect[neighbours=8]", "tokenselect[prefill=full]", "streaming_llm", "h2o", "snapkv", "pyramidkv",
         "quest", "keydiff", "infllm"]


def read(tasks: list[str], budget: float, dirs: list[str]) -> dict[tuple, list[float]]:
    """(length, method, task) -> the scores of its samples; Full KV's rows (no budget) serve every budget."""
    cells: dict[tuple, list[float]] = defaultdict(list)
    for d in dirs:
        for r in ResultsDir(d).rows():
            task = r["task"].removeprefix("ruler_")
            if task in tasks and (r["budget"] == budget or r["method"] == "full"):
                cells[(r["length"], r["method"], task)].append(r["score"])
    return cells


def budget_label(budget: float) -> str:
    return f"{budget:g} tokens" if budget >= 1 else f"{100 * budget:g}%"


def ordered(methods: set[str]) -> list[str]:
    return [m for m in ORDER if m in methods] + sorted(methods - set(ORDER))  # arms the list does not name go last


def suite(budget: float, dirs: list[str]) -> None:
    tasks = TASKS["niah"] + TASKS["other"]
    cells = read(tasks, budget, dirs)
    lengths = sorted({k[0] for k in cells})
    means = {key: sum(v) / len(v) for key, v in cells.items()}
    print(f"| method @ {budget_label(budget)} | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---" * (len(lengths) + 1) + "|")
    for method in ordered({k[1] for k in cells}):
        row = []
        for length in lengths:
            scores = [means.get((length, method, t)) for t in tasks]
            full = [means.get((length, "full", t)) for t in tasks]
            if None in scores or None in full:
                row.append("-")
                continue
            avg, ref = sum(scores) / len(tasks), sum(full) / len(tasks)
            row.append(f"{avg:.1f}" if method == "full" else f"{avg:.1f} ({100 * avg / ref:.1f}%)")
        if any(c != "-" for c in row):
            print(f"| {method} | " + " | ".join(row) + " |")


def main(group: str, budget: float, dirs: list[str]) -> None:
    if group == "suite":
        suite(budget, dirs)
        return
    tasks = TASKS[group]
    cells = read(tasks, budget, dirs)
    names = [t.removeprefix("niah_") for t in tasks]
    print(f"| method @ {budget_label(budget)} | length | " + " | ".join(names) + " | avg | vs Full KV |")
    print("|---" * (len(tasks) + 4) + "|")
    for length in sorted({k[0] for k in cells}):
        full = {t: sum(v) / len(v) for (n, m, t), v in cells.items() if n == length and m == "full"}
        for method in ordered({k[1] for k in cells if k[0] == length}):
            means = {t: sum(v) / len(v) for (n, m, t), v in cells.items() if n == length and m == method}
            shared = [t for t in tasks if t in means and t in full]
            if method != "full" and not shared:
                continue
            avg = sum(means[t] for t in shared) / len(shared)
            ref = sum(full[t] for t in shared) / len(shared)
            note = "" if len(shared) == len(tasks) else f" ({len(shared)} tasks)"
            delta = "" if method == "full" else f"{avg - ref:+.1f}{note}"
            row = [f"{means[t]:.1f}" if t in means else "-" for t in tasks]
            print(f"| {method} | {length} | " + " | ".join(row) + f" | {avg:.1f} | {delta} |")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3:])
