"""The README's picture: each method's quality against its decode speed, both as a share of Full KV's, read from the
committed results (no GPU needed).

    python benchmarks/quality_speed_plot.py                  # writes docs/images/quality_speed.png

Quality: the average of the 13 RULER tasks (20 samples each) at 31,744 tokens and budget 10% on
Qwen2.5-Coder-0.5B-Instruct, over Full KV's, from the suite's rows (`2026-11-26-h100-suite/eval_qwen_31k`).
Speed: decode tokens/s at 185 sequences of 31,744 tokens (Full KV's largest batch on an H100, CUDA graphs) over Full
KV's in the same `semkv bench` run (its results.json). An opt-in mode whose decode step is its method's (the same
kept-token count and kernel: ChunkKV `neighbours=3`, TokenSelect `prefill="full"`) is drawn hollow at that step.
Quest's page summaries did not fit beside the pool at 185 sequences, so it has no point.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from semkv.eval.store import ResultsDir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
EVAL = RESULTS / "2026-11-26-h100-suite" / "eval_qwen_31k"
BENCH185 = RESULTS / "2026-11-26-h100-suite" / "bench" / "bench185" / "results.json"
TOKENS185 = RESULTS / "2026-11-27-h100-token-scores" / "bench" / "tokens_185_fused_machine2" / "results.json"
LENGTH, BUDGET = 31744, 0.1
# label, eval arm, bench results.json, bench method, whether the step was timed for this arm itself
POINTS = [
    ("Full KV", "full", BENCH185, "full", True),
    ('CHESS anchor="queries"', "chess", BENCH185, "chess", True),
    ("ChunkKV", "chunkkv", BENCH185, "chunkkv", True),
    ("ChunkKV neighbours=3", "chunkkv[neighbours=3]", BENCH185, "chunkkv", False),
    ("SnapKV", "snapkv", BENCH185, "snapkv", True),
    ("TokenSelect", "tokenselect", BENCH185, "tokenselect", True),
    ('TokenSelect prefill="full"', "tokenselect[prefill=full]", BENCH185, "tokenselect", False),
    ("SentenceKV", "sentencekv", BENCH185, "sentencekv", True),
    ('DynSplit-KV score="tokens"', "dynsplit[score=tokens]", TOKENS185, "dynsplit", True),
]
TASKS = 13
LABEL_AT = {"TokenSelect prefill=\"full\"": (7, 3), "DynSplit-KV score=\"tokens\"": (7, -11)}  # where labels touch


def quality(rows: list[dict]) -> dict[str, float]:
    """Arm -> its RULER average over Full KV's, in percent, where the arm has all 13 tasks."""
    cells: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rows:
        at_budget = r["budget"] == BUDGET or r["method"] == "full"  # Full KV's rows have no budget
        if r["length"] == LENGTH and r["task"].startswith("ruler_") and at_budget:
            cells[(r["method"], r["task"])].append(r["score"])
    means: dict[str, list[float]] = defaultdict(list)
    for (arm, _), scores in cells.items():
        means[arm].append(sum(scores) / len(scores))
    full = sum(means["full"]) / TASKS
    return {arm: 100 * sum(m) / TASKS / full for arm, m in means.items() if len(m) == TASKS}


def speed(path: Path, method: str) -> float:
    """A method's decode tokens/s over Full KV's in one bench run."""
    rows = {r["method"]: r["tokens_per_s"] for r in json.loads(path.read_text())["decode"]}
    return rows[method] / rows["full"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "images" / "quality_speed.png"))
    args = parser.parse_args()
    scores = quality(ResultsDir(EVAL).rows())
    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=110)
    for label, arm, bench, method, timed in POINTS:
        x, y = speed(bench, method), scores[arm]
        ax.scatter([x], [y], s=60, color="black" if arm == "full" else "tab:blue",
                   facecolors=None if timed else "none", zorder=3)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=LABEL_AT.get(label, (7, -4)), fontsize=8.5)
        print(f"{label:<28} quality {y:5.1f}% of Full KV   decode {x:4.2f}x Full KV")
    ax.set_xlabel("decode tokens/s, x Full KV (185 x 31,744 tokens, H100)")
    ax.set_ylabel("RULER average, % of Full KV (13 tasks)")
    ax.set_title("Qwen2.5-Coder-0.5B-Instruct, budget 10% of 31,744 tokens", fontsize=10)
    ax.set_xlim(0.5, 5.8)
    ax.text(0.99, 0.02, "hollow: an opt-in mode at its method's decode step", transform=ax.transAxes, ha="right",
            fontsize=8, color="gray")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
