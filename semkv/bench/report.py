"""Tables and plots of a `semkv bench` run: results.json, results.md, PNGs."""
from __future__ import annotations

import json
from pathlib import Path


def share(value: float | None) -> str:
    """A selection share as a percentage; '-' where it was not measured (selection inside a captured graph)."""
    return "-" if value is None else f"{100 * value:.2f}%"


def decode_line(row) -> str:
    return (f"{row.method:<12} B={row.batch:<3} ctx={row.context:<6} TPOT {row.tpot_ms:8.2f} ms "
            f"(mean {row.tpot_mean_ms:.2f}, forward {row.forward_ms:.2f})  {row.tokens_per_s:9.1f} tok/s  "
            f"(served {row.served_tokens_per_s:.1f})  "
            f"selection {share(row.selection_share)}  peak {row.peak_memory_gib:6.1f} GiB  "
            f"attended {row.attended_per_layer:8.0f}"
            + ("" if row.cache_hit_rate is None else f"  cache hits {100 * row.cache_hit_rate:.1f}%")
            + (f"  host {row.host_gib:.1f} GiB, {row.h2d_mb_per_step:.1f} MiB/step from host" if row.host_gib else ""))


def served_ratio(row: dict, base: dict | None) -> str:
    """A row's served tokens/s against Full KV's row; '-' where either was not measured (runs before it was)."""
    served, full = row.get("served_tokens_per_s", 0), (base or {}).get("served_tokens_per_s", 0)
    return f"{served / full:.2f}" if served and full else "-"


def floor_ms(row: dict, info: dict, kv_token_bytes: int) -> float:
    """Bytes a step must move (weights + the K/V it attends to) over the measured bandwidth."""
    bandwidth = info.get("hbm_bandwidth_gbs") or 0
    if not bandwidth:
        return 0.0
    moved = info["weight_bytes"] + row["batch"] * row["attended_per_layer"] * kv_token_bytes
    return 1e3 * moved / (bandwidth * 1e9)


def hit_rate(row: dict) -> str:
    rate = row.get("cache_hit_rate")
    return "-" if rate is None else f"{100 * rate:.1f}%"


def largest_batches(results: dict) -> list[str]:
    """The rows measured at each method's largest batch (`--batches max`) against Full KV's at its own largest."""
    sizes = results.get("method_max_batch", {})
    rows = {(r["method"], r["batch"], r["context"]): r for r in results["decode"]}
    lines = []
    for name, by_context in sizes.items():
        for context, batch in by_context.items():
            row = rows.get((name, batch, int(context)))
            full_batch = results.get("max_batch", {}).get(context)
            base = rows.get(("full", full_batch, int(context)))
            if row is None:
                continue
            vs = ("-", "-") if base is None else (f"{batch / full_batch:.2f}",
                                                  f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}")
            lines.append(f"| {name} | {context} | {batch} | {vs[0]} | {row['tokens_per_s']:.1f} | {vs[1]} | "
                         f"{row.get('served_tokens_per_s', 0):.1f} | {served_ratio(row, base)} | "
                         f"{row['tpot_ms']:.2f} | {row['peak_memory_gib']:.1f} | {row.get('host_gib', 0):.1f} |")
    if not lines:
        return []
    return ["", "## Each method at its largest batch", "",
            "| method | context | batch | x Full KV's batch | tokens/s | x Full KV at its largest | served tokens/s | "
            "x Full KV | TPOT ms | peak GiB | host GiB |", "|---|---|---|---|---|---|---|---|---|---|---|", *lines]


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    info = results["info"]
    kv_token_bytes = info.get("kv_token_bytes", 0)
    lines = ["# semkv bench", "", "| key | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    full = {(r["batch"], r["context"]): r for r in results["decode"] if r["method"] == "full"}
    lines += ["", "## Decode", "",
              "| method | batch | context | TPOT ms | tokens/s | x Full KV | served tokens/s | x Full KV | floor ms | "
              "TPOT / floor | graph forward ms | selection share | peak GiB | host GiB | from host MiB/step | "
              "attended / layer | cache hits | graphs |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["decode"]:
        base = full.get((r["batch"], r["context"]))
        speedup = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        floor = floor_ms(r, info, kv_token_bytes)
        ratio = f"{r['tpot_ms'] / floor:.2f}" if floor else "-"
        lines.append(f"| {r['method']} | {r['batch']} | {r['context']} | {r['tpot_ms']:.2f} | {r['tokens_per_s']:.1f} "
                     f"| {speedup} | {r.get('served_tokens_per_s', 0):.1f} | {served_ratio(r, base)} | {floor:.2f} | "
                     f"{ratio} | {r.get('forward_ms', 0):.2f} | {share(r.get('selection_share', 0))} | "
                     f"{r['peak_memory_gib']:.1f} | {r.get('host_gib', 0):.1f} | {r.get('h2d_mb_per_step', 0):.1f} | "
                     f"{r['attended_per_layer']:.0f} | {hit_rate(r)} | {r['graphs']} |")
    lines += largest_batches(results)
    lines += ["", "tokens/s: the batch over the mean of the timed steps, each waited for. served tokens/s: as many "
              "steps again as a server's scheduler runs a batch decoding alone, each launched before the last one "
              "ends where the method's steps may be pipelined (`Engine.pipelines`), no wait between steps.",
              "", "graph forward: median device time of the timed steps' graph replays. selection share '-': the "
              "method selects inside each layer of the captured graph, which host timing cannot see; the eager step "
              "below times it.",
              "", "## Step breakdown (one eager step, ms)", "",
              "| method | batch | context | step | selection | attention | rest | selection share |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results["decode"]:
        b = r["breakdown_ms"]
        eager_share = b.get("selection", 0) / b["step"] if b.get("step") else 0
        lines.append(f"| {r['method']} | {r['batch']} | {r['context']} | {b.get('step', 0):.2f} | "
                     f"{b.get('selection', 0):.2f} | {b.get('attention', 0):.2f} | {b.get('rest', 0):.2f} | "
                     f"{share(eager_share)} |")
    if results["ttft"]:
        hf = {t["context"]: t["ttft_s"] for t in results.get("hf_ttft", [])}
        lines += ["", "## Time to first token (batch 1, real prefill)", "",
                  "| method | context | TTFT s | first request s | FLOP floor s | TTFT / floor | "
                  "TTFT / sustained floor | HF sdpa s | x HF |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for t in results["ttft"]:
            ttft, floor, base = t["ttft_s"], t.get("floor_s", float("nan")), hf.get(t["context"])
            held = t.get("floor_sustained_s", float("nan"))
            vs_hf = ("-", "-") if base is None else (f"{base:.3f}", f"{base / ttft:.2f}")
            lines.append(f"| {t['method']} | {t['context']} | {ttft:.3f} | {t.get('first_s', ttft):.3f} | "
                         f"{floor:.3f} | {ttft / floor:.2f} | {ttft / held:.2f} | {vs_hf[0]} | {vs_hf[1]} |")
        lines += ["", "TTFT: the second of two requests; first request: the method's first in the process (the "
                  "engine compiles its kernels and builds the prefill plans at load). FLOP floor: `prefill_flops` "
                  "over the measured GEMM rate (`gemm_tflops`, 50 ms of GEMMs); sustained floor: over the rate the "
                  "card holds through 2.5 s of GEMMs (`gemm_tflops_sustained`). HF sdpa: transformers' prefill of the "
                  "same shape with its default attention, timed in the same process before the engine; x HF: its "
                  "TTFT over ours."]
    if results["long_generation"]:
        lines += ["", "## TPOT over a long generation (batch 1)", "",
                  "| method | first ms | last ms | growth |", "|---|---|---|---|"]
        for name, curve in results["long_generation"].items():
            first, last = curve[0][1], curve[-1][1]
            lines.append(f"| {name} | {first:.2f} | {last:.2f} | {100 * (last / first - 1):+.1f}% |")
    if results["hf"]:
        lines += ["", "## HF transformers (DynamicCache)", "",
                  "| attention | batch | context | TPOT ms | tokens/s |", "|---|---|---|---|---|"]
        lines += [f"| {h.get('attention', 'eager')} | {h['batch']} | {h['context']} | {h['tpot_ms']:.2f} | "
                  f"{h['tokens_per_s']:.1f} |" for h in results["hf"]]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plots(results, out)


def plots(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["decode"]
    methods = sorted({r["method"] for r in rows})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    smallest = min((r["batch"] for r in rows), default=1)
    largest = max((r["context"] for r in rows), default=0)
    for m in methods:
        pts = sorted((r["context"], r["tpot_ms"]) for r in rows if r["method"] == m and r["batch"] == smallest)
        if pts:
            ax1.plot(*zip(*pts), marker="o", label=m)
        pts = sorted((r["batch"], r["tokens_per_s"]) for r in rows if r["method"] == m and r["context"] == largest)
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=m)
    ax1.set(xlabel="context (tokens)", ylabel="TPOT (ms)", title=f"decode latency, batch {smallest}")
    ax2.set(xlabel="batch", ylabel="tokens/s", title=f"throughput at context {largest}")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "decode.png", dpi=120)
    plt.close(fig)
    if results["long_generation"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, curve in results["long_generation"].items():
            ax.plot(*zip(*curve), label=name)
        ax.set(xlabel="generated tokens", ylabel="TPOT (ms)", title="TPOT over a long generation")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "long_generation.png", dpi=120)
        plt.close(fig)
