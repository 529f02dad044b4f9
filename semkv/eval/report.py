"""`semkv report RESULTS_DIR`: markdown tables and PNG plots from a results directory, and the HTML view of every
traced sample.

Scores are the mean over samples (0..100); perplexity is exp(total NLL / total scored tokens). Plots: score (or
perplexity) vs budget per task, one panel per method with a line per context length, Full KV dashed; depth x length
heatmaps per method and budget for tasks whose samples have a needle depth (in bands of 10% where the depths
differ between lengths); with batched runs (`runs.jsonl`), a Pareto plot per length: score as % of Full KV against
throughput as x Full KV. Rows of method "hf" (`semkv eval --hf`) are HF transformers' `generate`, shown as "HF
transformers" after Full KV. Matplotlib is used through `Figure` (Agg), never pyplot, so no global backend is
touched.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from semkv.errors import SemkvError
from semkv.eval import html
from semkv.eval.store import ResultsDir

PERPLEXITY = "perplexity"
HF, HF_LABEL = "hf", "HF transformers"  # the rows of `semkv eval --hf`
# selection diagnostics of the rows (`diagnostics.py`), shown where a task has them
DIAG_COLUMNS = {"retention": "needle kept (heads)", "retained_layers": "layers keeping needle",
                "recall": "top-k recall", "mass_recall": "mass recall"}


def _aggregate(rows: list[dict[str, Any]]) -> float:
    if rows and "nll" in rows[0]:
        return math.exp(sum(r["nll"] for r in rows) / sum(r["tokens"] for r in rows))
    return sum(r["score"] for r in rows) / len(rows)


def _arms(rows: Iterable[dict[str, Any]]) -> list[tuple[str, Any]]:
    """(method, budget) in a stable order: Full KV, HF, methods by first appearance, token budgets then fractions."""
    order: dict[str, int] = {}
    arms = set()
    for r in rows:
        order.setdefault(r["method"], len(order))
        arms.add((r["method"], r["budget"]))
    return sorted(arms, key=lambda a: (_rank(a[0]), order[a[0]], *_budget_order(a[1])))


def _rank(method: str) -> int:
    """Full KV first, then HF (the references), then the methods."""
    return {"full": 0, HF: 1}.get(method, 2)


def _budget_order(budget: Any) -> tuple[int, float]:
    return (0, 0.0) if budget is None else (isinstance(budget, float), float(budget))


def _label(method: str, budget: Any) -> str:
    return _name(method) if budget is None else f"{method}@{budget}"


def _name(method: str) -> str:
    return HF_LABEL if method == HF else method


def _group(rows: Iterable[dict[str, Any]], *keys: str) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[tuple(r[k] for k in keys)].append(r)
    return groups


def _markdown(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines])


def _diag_mean(rows: list[dict[str, Any]], key: str) -> str:
    values = [r["diag"][key] for r in rows if key in r.get("diag", {})]
    return "-" if not values else f"{sum(values) / len(values):.{1 if key == 'retained_layers' else 2}f}"


def summary_table(rows: list[dict[str, Any]]) -> str:
    """Per task: one line per method and budget, one column per length, the mean, the KV attended per step and the
    means of the selection diagnostics the rows have."""
    parts = []
    for (task,), task_rows in _group(rows, "task").items():
        lengths = sorted({r["length"] for r in task_rows})
        diag = [key for key in DIAG_COLUMNS if any(key in r.get("diag", {}) for r in task_rows)]
        cells = _group(task_rows, "method", "budget", "length")
        arm_rows = _group(task_rows, "method", "budget")
        lines = []
        for method, budget in _arms(task_rows):
            rs = arm_rows[(method, budget)]
            attended = sum(r["stats"]["kv_attended_tokens"] for r in rs) / len(rs)
            per_length = [f"{_aggregate(cells[(method, budget, n)]):.1f}" if cells.get((method, budget, n)) else "-"
                          for n in lengths]
            lines.append([_name(method), "-" if budget is None else str(budget), *per_length, f"{_aggregate(rs):.1f}",
                          f"{attended:.0f}", *[_diag_mean(rs, key) for key in diag]])
        metric = "perplexity, lower is better" if task == PERPLEXITY else "score 0-100"
        n = len({r["sample_id"] for r in task_rows})
        header = ["method", "budget", *[f"{x} tok" for x in lengths], "mean", "KV attended/step",
                  *[DIAG_COLUMNS[key] for key in diag]]
        parts.append(f"### {task} ({metric}; {n} samples)\n\n" + _markdown(header, lines))
    return "\n\n".join(parts)


def run_speeds(runs: list[dict[str, Any]]) -> dict[tuple, dict[str, float]]:
    """(length, method, budget) -> the speed of its batched runs over every task: tokens per second (all tokens over
    all seconds), TPOT and attended KV (means weighted by samples), the highest peak memory."""
    speeds = {}
    for key, group in _group(runs, "length", "method", "budget").items():
        samples = sum(r["samples"] for r in group)
        peaks = [r["peak_memory_gib"] for r in group if r["peak_memory_gib"] is not None]
        speeds[key] = {"tokens_per_s": sum(r["new_tokens"] for r in group) / sum(r["wall_s"] for r in group),
                       "tpot_ms": sum(r["tpot_ms"] * r["samples"] for r in group) / samples,
                       "attended": sum(r["attended"] * r["samples"] for r in group) / samples,
                       "peak_memory_gib": max(peaks) if peaks else None}
    return speeds


def relative_quality(rows: list[dict[str, Any]]) -> dict[tuple, float]:
    """(length, method, budget) -> the arm's mean score over the generative tasks both it and Full KV ran at that
    length, as a percentage of Full KV's mean over the same tasks: a suite's average as a share of Full KV's."""
    cells = _group([r for r in rows if r["task"] != PERPLEXITY], "task", "length", "method", "budget")
    sums: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])  # the arm's scores, Full KV's
    for (task, length, method, budget), rs in cells.items():
        full = cells.get((task, length, "full", None))
        if full:
            total = sums[(length, method, budget)]
            total[0] += _aggregate(rs)
            total[1] += _aggregate(full)
    return {key: 100 * arm / full for key, (arm, full) in sums.items() if full > 0}


def speed_table(rows: list[dict[str, Any]], runs: list[dict[str, Any]]) -> str:
    """Per length and arm: the batched runs' speed beside the quality (% of Full KV) measured in the same runs."""
    speeds, quality = run_speeds(runs), relative_quality(rows)
    lines = []
    for length, method, budget in sorted(speeds, key=lambda k: (k[0], _rank(k[1]), k[1], *_budget_order(k[2]))):
        speed, full = speeds[(length, method, budget)], speeds.get((length, "full", None))
        share = quality.get((length, method, budget))
        peak = speed["peak_memory_gib"]
        lines.append([str(length), _label(method, budget), f"{speed['tokens_per_s']:.1f}",
                      "-" if full is None else f"{speed['tokens_per_s'] / full['tokens_per_s']:.2f}",
                      f"{speed['tpot_ms']:.2f}", "-" if peak is None else f"{peak:.1f}", f"{speed['attended']:.0f}",
                      "-" if share is None else f"{share:.1f}"])
    header = ["length", "method", "tokens/s", "x Full KV", "TPOT ms", "peak GiB", "KV attended/step",
              "score % of Full KV"]
    return _markdown(header, lines)


def _pareto_plot(length: int, rows: list[dict[str, Any]], runs: list[dict[str, Any]], path: Path) -> Path:
    """Score as % of Full KV against throughput as x Full KV, one point per method and budget (and HF's), at one
    length."""
    speeds, quality = run_speeds(runs), relative_quality(rows)
    full = speeds[(length, "full", None)]["tokens_per_s"]
    points = [(speed["tokens_per_s"] / full, quality[(n, method, budget)], method, _label(method, budget), False)
              for (n, method, budget), speed in speeds.items() if n == length and (n, method, budget) in quality]
    return _pareto_figure(points, "throughput, x Full KV (same run's tokens per second)",
                          f"{length} tokens: quality against speed", path)


def _pareto_figure(points: list[tuple[float, float, str, str, bool]], xlabel: str, title: str, path: Path) -> Path:
    """Points (x, score % of Full KV, method, label, hollow) with the Full-KV lines at 1x and 100%."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    ax = fig.subplots()
    for x, y, method, label, hollow in points:
        ax.scatter([x], [y], marker={"full": "*", HF: "s"}.get(method, "o"), s=60,
                   facecolors="none" if hollow else None, edgecolors="C0" if hollow else None)
        ax.annotate(label, (x, y), fontsize=7, xytext=(3, -9 if method == HF else 3),
                    textcoords="offset points")  # HF's label below its point: it often sits beside Full KV's
    ax.axhline(100, ls="--", lw=1, color="grey")
    ax.axvline(1, ls="--", lw=1, color="grey")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("mean score over the tasks, % of Full KV's")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    return path


def bench_speeds(folders: Iterable[str | Path]) -> list[dict[str, Any]]:
    """The decode rows of `semkv bench` runs (each folder's results.json), each with `full_tokens_per_s`: Full KV's
    tokens/s in the same run at the same batch and context, else at its largest batch there (what a method at its own
    largest batch is compared with), and `full_batch`; HF transformers' rows (`--hf`) come as method "hf"."""
    speeds = []
    for folder in folders:
        path = Path(folder) / "results.json"
        if not path.is_file():
            raise SemkvError(f"--bench {str(folder)!r}: no results.json there (a folder written by `semkv bench`)")
        results = json.loads(path.read_text())
        hf = [dict(h, method=HF, budget=None, label=f"{HF_LABEL} ({h['attention']})") for h in results["hf"]]
        full = {(r["batch"], r["context"]): r["tokens_per_s"] for r in results["decode"] if r["method"] == "full"}
        for row in results["decode"] + hf:
            same = (row["batch"], row["context"])
            batch = row["batch"] if same in full else max((b for b, c in full if c == row["context"]), default=None)
            if batch is not None:
                speeds.append(dict(row, full_tokens_per_s=full[(batch, row["context"])], full_batch=batch))
    return speeds


def bench_table(rows: list[dict[str, Any]], speeds: list[dict[str, Any]]) -> str:
    """Decode speed from `semkv bench` beside the quality this results directory measured at the same context
    length, method and budget."""
    quality, lines = relative_quality(rows), []
    for s in sorted(speeds, key=lambda s: (s["context"], s["full_batch"], _rank(s["method"]), s["batch"])):
        share = quality.get((s["context"], s["method"], s["budget"]))
        lines.append([str(s["context"]), s.get("label", _label(s["method"], s["budget"])), str(s["batch"]),
                      f"{s['tpot_ms']:.2f}", f"{s['tokens_per_s']:.1f}",
                      f"{s['tokens_per_s'] / s['full_tokens_per_s']:.2f} (at {s['full_batch']})",
                      "-" if share is None else f"{share:.1f}"])
    header = ["context", "method", "batch", "TPOT ms", "tokens/s", "x Full KV (its batch)", "score % of Full KV"]
    return _markdown(header, lines)


def _bench_pareto_plot(length: int, rows: list[dict[str, Any]], speeds: list[dict[str, Any]], path: Path) -> Path:
    """Score as % of Full KV against decode throughput as x Full KV (`semkv bench`), at one length; a method at a
    batch other than Full KV's is drawn hollow."""
    quality, points = relative_quality(rows), []
    for s in speeds:
        y = quality.get((length, s["method"], s["budget"]))
        if s["context"] == length and y is not None:
            own = s["batch"] != s["full_batch"]
            label = s.get("label", _label(s["method"], s["budget"])) + (f" (batch {s['batch']})" if own else "")
            points.append((s["tokens_per_s"] / s["full_tokens_per_s"], y, s["method"], label, own))
    return _pareto_figure(points, "decode throughput, x Full KV (semkv bench, Full KV at its largest batch)",
                          f"{length} tokens: quality against decode speed", path)


def cost_table(rows: list[dict[str, Any]]) -> str:
    lines = []
    arm_rows = _group(rows, "method", "budget")
    for method, budget in _arms(rows):
        rs = arm_rows[(method, budget)]
        mean = lambda key: sum(r["stats"][key] for r in rs) / len(rs)  # noqa: E731
        lines.append([_label(method, budget), f"{mean('prefill_s'):.2f}", f"{mean('decode_tokens_per_s'):.1f}",
                      f"{mean('kv_attended_tokens'):.0f}", f"{mean('kv_resident_tokens'):.0f}",
                      f"{mean('selection_s'):.3f}"])
    header = ["method", "prefill s", "decode tok/s", "KV attended/step", "KV resident", "selection s"]
    return _markdown(header, lines)


MARKERS = "osD^vPX*"


def _budget_plot(task: str, rows: list[dict[str, Any]], path: Path) -> Path:
    """Small multiples: one panel per method (shared axes), score against budget with a line per context length in
    its own colour and marker, Full KV at that length dashed in the same colour."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    lengths = sorted({r["length"] for r in rows})
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None}, key=_budget_order)
    cells = _group(rows, "method", "budget", "length")
    fulls = [method for method, _ in _arms(r for r in rows if r["budget"] is None) if method != HF]
    methods = list(dict.fromkeys(m for m, b in _arms(rows) if b is not None)) or fulls[:1]
    colours = colormaps["viridis"]([0.1 + 0.75 * j / max(len(lengths) - 1, 1) for j in range(len(lengths))])
    cols = min(4, len(methods))
    grid = -(-len(methods) // cols)
    fig = Figure(figsize=(3.2 * cols + 1.6, 2.5 * grid + 0.7), layout="constrained")
    axes = fig.subplots(grid, cols, squeeze=False, sharex=True, sharey=True).flatten()
    for ax, method in zip(axes, methods):
        for j, length in enumerate(lengths):
            style = dict(color=colours[j], label=f"{length} tokens")
            for full in fulls:
                if (full, None, length) in cells:
                    ax.axhline(_aggregate(cells[(full, None, length)]), ls="--", lw=1, color=colours[j])
            xs = [i for i, b in enumerate(budgets) if (method, b, length) in cells]
            ax.plot(xs, [_aggregate(cells[(method, budgets[i], length)]) for i in xs], marker=MARKERS[j % 8], **style)
        ax.set_title(method, fontsize=10)
        ax.set_xticks(range(len(budgets)), [str(b) for b in budgets])
        ax.grid(alpha=0.3)
    for ax in axes[len(methods):]:
        ax.set_visible(False)
    fig.suptitle(f"{task}: {'perplexity' if task == PERPLEXITY else 'score'} against budget (dashed: Full KV)")
    fig.supxlabel("budget (tokens per head, or fraction of the context)")
    fig.supylabel("perplexity" if task == PERPLEXITY else "score")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize=8, title="context")
    fig.savefig(path, dpi=110)
    return path


BAND = 10  # percent of depth per heatmap row when the depths differ between lengths


def _depth_bands(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[float, str]]:
    """The rows with the depth their heatmap row is keyed by, and each heatmap row's label: the depths themselves
    when every length has the same ones (a grid), else bands of `BAND` percent (RULER measures where each sample's
    needle landed, so a depth holds one sample of one length and the other lengths' cells stay empty)."""
    grids = {frozenset(r["depth"] for r in rows if r["length"] == n) for n in {r["length"] for r in rows}}
    if len(grids) == 1:
        return rows, {d: f"{d:.0f}%" for d in sorted(next(iter(grids)))}
    top = 100 - BAND  # the last band holds 100%
    banded = [{**r, "depth": float(min(r["depth"] // BAND * BAND, top))} for r in rows]
    return banded, {lo: f"{lo:.0f}-{lo + BAND:.0f}%" for lo in sorted({r["depth"] for r in banded})}


def _depth_heatmaps(task: str, rows: list[dict[str, Any]], path: Path) -> Path:
    from matplotlib.figure import Figure

    rows, labels = _depth_bands(rows)
    depths = sorted(labels)
    lengths = sorted({r["length"] for r in rows})
    cells = _group(rows, "method", "budget", "depth", "length")
    arms = _arms(rows)
    cols = min(4, len(arms))
    fig = Figure(figsize=(3.2 * cols, 0.5 + (0.4 * len(depths) + 1.2) * -(-len(arms) // cols)), layout="constrained")
    axes = fig.subplots(-(-len(arms) // cols), cols, squeeze=False).flatten()
    for ax, (method, budget) in zip(axes, arms):
        grid = [[_aggregate(cells[(method, budget, d, n)]) if (method, budget, d, n) in cells else float("nan")
                 for n in lengths] for d in depths]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
        for i, line in enumerate(grid):
            for j, value in enumerate(line):
                ax.text(j, i, "" if math.isnan(value) else f"{value:.0f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [labels[d] for d in depths])
        ax.set_title(_label(method, budget), fontsize=9)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("needle depth")
    for ax in axes[len(arms):]:
        ax.set_visible(False)
    fig.colorbar(image, ax=axes.tolist(), shrink=0.6, label="score")
    fig.savefig(path, dpi=110)
    return path


def write_report(results_dir: str | Path, html_samples: list[str] | None = None,
                 bench: Iterable[str | Path] = ()) -> tuple[Path, list[Path]]:
    """Write report.md, plots/*.png and html/*.html (every traced sample, or those named) into `results_dir`;
    return the report's path and the HTML pages'. `bench`: folders of `semkv bench` runs whose decode speed is
    shown beside this directory's quality at the same context length, method and budget (a table and a Pareto plot
    per length)."""
    store = ResultsDir(results_dir)
    rows = store.rows()
    if not rows:
        raise SemkvError(f"no results in {store.predictions}; run `semkv eval --out {results_dir}` first")
    plots, pages = store.path / "plots", store.path / "html"
    plots.mkdir(exist_ok=True)
    images = []
    for (task,), task_rows in _group(rows, "task").items():
        images.append(_budget_plot(task, task_rows, plots / f"{task}_vs_budget.png"))
        if any(r["depth"] is not None for r in task_rows):
            images.append(_depth_heatmaps(task, [r for r in task_rows if r["depth"] is not None],
                                          plots / f"{task}_depth_heatmap.png"))
    runs = store.runs()
    speeds = run_speeds(runs)
    for length in sorted({n for n, method, budget in speeds if method == "full"}):
        images.append(_pareto_plot(length, rows, runs, plots / f"pareto_{length}.png"))
    decode = bench_speeds(bench)
    for length in sorted({s["context"] for s in decode} & {r["length"] for r in rows}):
        images.append(_bench_pareto_plot(length, rows, decode, plots / f"pareto_decode_{length}.png"))
    views = [store.find_trace(s) for s in html_samples] if html_samples else [store.read_trace(p)
                                                                               for p in store.traces()]
    links = [html.write(v, pages / f"{store.trace_path(v['task'], v['sample_id']).name[:-8]}.html") for v in views]
    config = store.config() or {}
    model = config.get("resolved", {}).get("model_source", "?")
    text = [f"# Evaluation report\n\nModel: `{model}`. Rows: {len(rows)}. Budget: KV tokens per head and layer "
            "(a fraction: of the context). KV attended/step: mean per decode step, head and layer. "
            "Needle kept: share of (layer, KV head) pairs that attended every answer-span token at the first "
            "decode steps; layers keeping needle: layers where all heads did; top-k / mass recall: share of Full "
            "KV's top-k (k = budget) attention mass, and of all its attention mass, on the attended positions.\n",
            "## Scores\n", summary_table(rows), "\n## Cost\n", cost_table(rows)]
    if runs:
        hf = (f" {HF_LABEL}: transformers' greedy `generate` of the same prompt ids, all samples of a task and length "
              "in one left-padded batch (`semkv eval --hf`).") if any(r["method"] == HF for r in runs) else ""
        text += ["\n## Speed of the batched runs\n", "Each method ran the samples of a task and length together "
                 "through continuous batching; tokens/s: tokens generated over the run's seconds (prefill included); "
                 "TPOT: the mean over the requests of the time of the decode steps each took part in per token "
                 "after the first, a CUDA graph's capture at a batch size first met and a method's first selection "
                 "included (with answers of a few tokens, not the steady decode speed that `semkv bench` "
                 "measures); x Full KV: against Full KV's runs at that length; score: the mean score over the tasks "
                 f"as a percentage of Full KV's mean over the same tasks (the Pareto plots draw the two).{hf}\n",
                 speed_table(rows, runs)]
    if decode:
        text += ["\n## Decode speed (`semkv bench`) beside quality\n", "Decode throughput of `semkv bench` runs, "
                 "against Full KV's in the same run at the same batch, or at Full KV's largest batch for a method at "
                 "its own; score: this directory's mean score over the tasks as a percentage of Full KV's mean, at "
                 "that context length, method and budget.\n", bench_table(rows, decode)]
    text += ["\n## Plots\n"]
    text += [f"![{p.stem}](plots/{p.name})" for p in images]
    if links:
        text += ["\n## What each method attended (HTML)\n"] + [f"- [{p.stem}](html/{p.name})" for p in links]
    path = store.path / "report.md"
    path.write_text("\n".join(text) + "\n", encoding="utf-8")
    return path, links
