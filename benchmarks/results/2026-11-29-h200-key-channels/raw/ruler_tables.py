"""RULER NIAH tables of this page from a call's predictions: per task, length and method the mean score of its
samples, and the mean over the tasks (only over tasks that ran for every method: call 39 ran out of device time).
Usage: python ruler_tables.py call21_ruler_predictions.jsonl.gz"""
import collections
import gzip
import json
import sys

scores = collections.defaultdict(list)
for line in gzip.open(sys.argv[1], "rt"):
    row = json.loads(line)
    scores[(row["method"], row["length"], row["task"].replace("ruler_niah_", ""))].append(row["score"])
methods = sorted({m for m, _, _ in scores}, key=lambda m: (m != "full", m))
for length in sorted({n for _, n, _ in scores}):
    tasks = sorted({t for m, n, t in scores if n == length})
    complete = [t for t in tasks if all(len(scores.get((m, length, t), [])) == 20 for m in methods)]
    print(f"\n{length} tokens | " + " | ".join(tasks) + " | mean over " + ", ".join(complete))
    for m in methods:
        cells = [scores.get((m, length, t), []) for t in tasks]
        mean = sum(sum(scores[(m, length, t)]) / 20 for t in complete) / len(complete)
        print(m, "|", " | ".join(f"{sum(c) / len(c):.1f}" if len(c) == 20 else "-" for c in cells), f"| {mean:.1f}")
