"""Throughput against batch for Full KV and the offloading methods, from `semkv bench` logs (one line per point).

    python benchmarks/studies/offload_plot.py OUT.png LOG...

A point is offloaded when its line reports host memory; each log names its card in the results page beside it.
"""
from __future__ import annotations

import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LINE = re.compile(r"^(\w+)\s+B=(\d+)\s+ctx=(\d+)\s+TPOT\s+([\d.]+) ms .*?([\d.]+) tok/s")
HOST = re.compile(r"host ([\d.]+) GiB")


def points(logs: list[str], context: int = 32768) -> dict[str, dict[int, float]]:
    """method (with ' offload' when it held host memory) -> batch -> tokens/s, at `context` (a point already read
    from an earlier log is kept)."""
    out: dict[str, dict[int, float]] = {}
    for path in logs:
        for line in open(path, encoding="utf-8"):
            m = LINE.match(line.strip())
            if not m or int(m.group(3)) != context:
                continue
            host = HOST.search(line)
            name = m.group(1) + (" offload" if host and float(host.group(1)) > 0 else "")
            out.setdefault(name, {}).setdefault(int(m.group(2)), float(m.group(5)))
    return out


def main(png: str, logs: list[str]) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, by_batch in sorted(points(logs).items()):
        batches = sorted(by_batch)
        ax.plot(batches, [by_batch[b] for b in batches], marker="o", label=name)
    ax.set(xlabel="batch (sequences of 32k tokens)", ylabel="tokens/s", xscale="log",
           title="Llama-3.1-8B shape, budget 0.1, H100")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
