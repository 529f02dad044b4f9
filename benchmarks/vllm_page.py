"""The tables of a results page from the raw files of the vLLM comparison (issues 54 and 53): offline throughput
(`vllm_offline.py`), the quality column (`vllm_quality.py`) and serving (`vllm_serve.py`), every ratio against vLLM
from the same call, and each issue's targets with their numbers.

    python benchmarks/vllm_page.py --offline DIR --quality DIR --serve DIR > tables.md
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vllm_offline import compare  # noqa: E402
from vllm_quality import means, scores, table  # noqa: E402
from vllm_workload import read_json  # noqa: E402

from semkv.engine.scheduler import STEP_KINDS  # noqa: E402

FULL = "semkv-full"  # vllm_serve.py's label of semkv serve with Full KV


def serve_rows(folder: Path) -> list[dict]:
    """One row per server and phase, from the client's JSON and the server's /metrics."""
    rows = []
    for server in [p for p in folder.iterdir() if (p / "server.json").is_file()]:
        info = read_json(server / "server.json")
        for client_file in sorted([*server.glob("*.client.json"), *server.glob("*.client.json.gz")]):
            phase = client_file.name.removesuffix(".gz").removesuffix(".client.json")  # gzipped on results pages
            metrics_file = next((f for f in (server / f"{phase}.metrics.json", server / f"{phase}.metrics.json.gz")
                                 if f.is_file()), None)
            if phase == "warmup" or metrics_file is None:
                continue
            c, m = read_json(client_file), read_json(metrics_file)
            after, before = m["after"], m["before"]
            delta = lambda *names: sum(after.get(k, 0) - before.get(k, 0)  # noqa: E731
                                       for k in after if k.split("{")[0] in names)
            rows.append(dict(
                server=info.get("label", server.name), phase=phase, first=m["phase"]["first"],
                concurrency=m["phase"]["concurrency"], completed=c["completed"],
                failed=c["failed"], errors=[e for e in c.get("errors", []) if e][:1], duration_s=c["duration"],
                output_tok_s=c["output_throughput"], request_s=c["request_throughput"],
                prompt_tok_s=c["total_input_tokens"] / c["duration"], prompt_tokens=c["total_input_tokens"],
                ttft_p50=c["median_ttft_ms"], ttft_p99=c["p99_ttft_ms"], itl_p50=c["median_itl_ms"],
                itl_p99=c["p99_itl_ms"], tpot_p50=c["median_tpot_ms"],
                cached_tokens=delta("semkv_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
                preemptions=delta("semkv_preemptions_total", "vllm:num_preemptions_total"),
                pages_after=after.get('semkv_kv_pool_pages{state="in_use"}'),
                live_after=after.get("semkv_engine_live_requests"),
                kv_peak_gib=kv_gib(m["kv_peak"], after, info["kv"]["token_bytes"]),
                card_peak_gib=info.get("card_peak_gib"), ready_s=info.get("ready_s"),
                steps={kind: [after.get(f'{name}{{kind="{kind}"}}', 0) - before.get(f'{name}{{kind="{kind}"}}', 0)
                              for name in ("semkv_engine_steps_total", "semkv_engine_step_seconds_total")]
                       for kind in STEP_KINDS}))
    # phases in the order they ran; vLLM first, then Full KV
    return sorted(rows, key=lambda r: (r["first"], r["phase"], r["server"] != "vllm", r["server"] != FULL,
                                       r["server"]))


def kv_gib(peak: dict, after: dict, token_bytes: int) -> float | None:
    """Peak KV memory in use: semkv's pages x page bytes; vLLM's share of its blocks x their bytes."""
    if "semkv_pages" in peak:
        page_bytes = after.get("semkv_kv_page_bytes") or 16 * token_bytes
        return round(peak["semkv_pages"] * page_bytes / 2**30, 2)
    info = next((k for k in after if k.startswith("vllm:cache_config_info")), "")
    labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', info))
    try:
        blocks, block = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    except (KeyError, ValueError):
        return None
    return round(peak.get("vllm_usage", 0) * blocks * block * token_bytes / 2**30, 2)


def serve_tables(rows: list[dict]) -> str:
    out = []
    for phase in dict.fromkeys(r["phase"] for r in rows):
        here = [r for r in rows if r["phase"] == phase]
        base = next((r for r in here if r["server"] == "vllm"), None)
        out += [f"\n**{phase}** (concurrency {here[0]['concurrency']})\n",
                "| server | done / failed | output tok/s | x vLLM | req/s | prompt tok/s | TTFT p50 / p99 ms | "
                "ITL p50 / p99 ms | TPOT p50 ms | cached prompt tokens | peak KV GiB | pages / requests held after |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in here:
            ratio = f"{r['output_tok_s'] / base['output_tok_s']:.2f}" if base and base["output_tok_s"] else "-"
            held = "-" if r["pages_after"] is None else f"{r['pages_after']:.0f} / {r['live_after']:.0f}"
            out.append(f"| {r['server']} | {r['completed']} / {r['failed']} | {r['output_tok_s']:.0f} | {ratio} | "
                       f"{r['request_s']:.2f} | {r['prompt_tok_s']:.0f} | {r['ttft_p50']:.0f} / {r['ttft_p99']:.0f} | "
                       f"{r['itl_p50']:.1f} / {r['itl_p99']:.1f} | {r['tpot_p50']:.1f} | {r['cached_tokens']:.0f} | "
                       f"{r['kv_peak_gib']} | {held} |")
        timed = [r for r in here if any(n for n, _ in r["steps"].values())]
        if timed:  # semkv's engine steps by kind (servers of this tree on)
            out += ["\n| server | decode-only steps: count, mean ms | mixed steps | prefill-only steps |",
                    "|---|---|---|---|"]
            out += [f"| {r['server']} | " + " | ".join(f"{n:.0f}, {1e3 * t / n:.1f}" if n else "-"
                                                     for n, t in r["steps"].values()) + " |" for r in timed]
    servers = {r["server"]: r for r in rows}
    out += ["\n| server | ready after s | card peak GiB |", "|---|---|---|"]
    out += [f"| {s} | {r['ready_s']} | {r['card_peak_gib']} |" for s, r in servers.items()]
    return "\n".join(out)


def targets(rows: list[dict], engine_ttft: Path | None, quality: Path | None) -> str:
    """Issue 54's and issue 53's targets, each with its number (missing where its phase did not run)."""
    at = {(r["server"], r["phase"]): r for r in rows}
    full = FULL
    lines = ["| target | number | met |", "|---|---|---|"]

    def add(name: str, value: float | None, ok) -> None:
        lines.append(f"| {name} | {'-' if value is None else f'{value:.2f}'} | "
                     f"{'-' if value is None else 'yes' if ok(value) else 'no'} |")

    mean = means(scores(quality)) if quality is not None else {}
    for method in [m for m in mean if m.startswith(("chess", "chunkkv"))]:
        add(f"54: {method} NIAH score - vLLM's (points)", mean[method] - mean["vllm"] if "vllm" in mean else None,
            lambda v: v >= -5)

    for phase in [p for p in dict.fromkeys(r["phase"] for r in rows) if p.startswith("c")]:
        base, mine = at.get(("vllm", phase)), at.get((full, phase))
        ok = base and mine
        add(f"54: Full KV output tok/s / vLLM's, {phase}", mine["output_tok_s"] / base["output_tok_s"] if ok else None,
            lambda v: v >= 0.9)
        add(f"54: Full KV TTFT p50 / vLLM's, {phase}", mine["ttft_p50"] / base["ttft_p50"] if ok else None,
            lambda v: v <= 1.1)
    methods = [s for s in dict.fromkeys(r["server"] for r in rows) if s.startswith(("semkv-chess", "semkv-chunkkv"))]
    for server in methods:
        mine, base, ref = at.get((server, "c64")), at.get(("vllm", "c64")), at.get((full, "c64"))
        add(f"54: {server} output tok/s / vLLM's, c64", mine["output_tok_s"] / base["output_tok_s"]
            if mine and base else None, lambda v: v >= 2)
        add(f"53: {server} output tok/s / Full KV's, c64", mine["output_tok_s"] / ref["output_tok_s"]
            if mine and ref else None, lambda v: v >= 2)
    if engine_ttft is not None and engine_ttft.is_file() and (full, "prefill") in at:
        ttft = next(t for t in read_json(engine_ttft)["ttft"] if t["method"] == "full")
        add("53: server prompt tok/s (prefill phase) / semkv bench --ttft's", at[(full, "prefill")]["prompt_tok_s"]
            / (ttft["context"] / ttft["ttft_s"]), lambda v: v >= 0.9)
    for server in dict.fromkeys(r["server"] for r in rows):
        if server == "vllm":
            continue
        load, first = at.get((server, "c64")), at.get((server, "shared_first"))
        follow = at.get((server, "shared_followup"))
        add(f"53: {server} ITL p99 / p50, c64", load["itl_p99"] / load["itl_p50"] if load else None, lambda v: v <= 3)
        add(f"53: {server} follow-up TTFT p50 / first question's", follow["ttft_p50"] / first["ttft_p50"]
            if first and follow else None, lambda v: v <= 0.1)
        mine = [r for r in rows if r["server"] == server]
        add(f"53: {server} failed requests, every phase", sum(r["failed"] for r in mine), lambda v: v == 0)
        add(f"53: {server} pages held after a phase (most)", max((r["pages_after"] or 0) for r in mine),
            lambda v: v == 0)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--offline", help="vllm_offline.py's --out")
    p.add_argument("--quality", help="vllm_quality.py's --out")
    p.add_argument("--serve", help="vllm_serve.py's --out")
    args = p.parse_args()
    if args.offline:
        print("## Offline (`vllm_offline.py`)\n")
        print(compare(Path(args.offline)))
        vllm = Path(args.offline) / "vllm.json"
        if vllm.is_file():
            row = read_json(vllm)
            print(f"\nvLLM {row['vllm']} on {row['device']}: attention backend {row['backend']}, settings "
                  f"{json.dumps(row['settings'])}")
    if args.quality:
        print("\n## Quality (`vllm_quality.py`, score 0-100)\n")
        print(table(Path(args.quality)))
    rows = serve_rows(Path(args.serve)) if args.serve else []
    if rows:
        print("\n## Serving (`vllm_serve.py`, `vllm bench serve`)")
        print(serve_tables(rows))
    if rows or args.quality:
        print("\n## Targets\n")
        print(targets(rows, Path(args.serve) / "engine_ttft" / "results.json" if args.serve else None,
                      Path(args.quality) if args.quality else None))


if __name__ == "__main__":
    main()
