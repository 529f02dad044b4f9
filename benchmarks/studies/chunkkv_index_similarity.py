"""ChunkKV's Table 2 and Table 8 shape on one model (default: the embedded SmolLM2-135M-Instruct).

Table 2: mean Jaccard similarity of the kept positions of adjacent layers after prefill-time compression, per KV
head, on Paul Graham essays with a question at the end, for any registered methods given as `label=name:k=v,...`
(e.g. `h2o`, `chunkkv_reuse2=chunkkv:reuse_layers=2`); the caches are read through `LLM.compare(inspect=...)`, so
the methods that allow it share one Full-KV prefill. Table 8: latency (prefill + decode; wall clock and process CPU
time) and throughput of Full KV, ChunkKV and ChunkKV with index reuse on one prompt of `--tokens` tokens, each method
prefilling on its own, repeats interleaved; plus the time ChunkKV spends scoring and how many layers scored.

    PYTHONPATH=$PWD python benchmarks/studies/chunkkv_index_similarity.py --samples 3 --budget 0.1 --tokens 4096 \
        --new-tokens 128 --repeats 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
import torch

import semkv
from semkv.cli.args import parse_budget, parse_params
from semkv.engine.sequence import Sequence
from semkv.methods import METHODS, KVMethod, get_method

SHARED = Path(os.environ.get("SEMKV_SHARED", Path(__file__).resolve().parents[2].parent / "shared"))
ESSAYS = SHARED / "data" / "paul_graham" / "gkamradt_essays"
QUESTION = "What is the main point the author makes? Answer in one sentence."
SIMILARITY_METHODS = ["h2o", "snapkv", "chunkkv", "chunkkv_reuse2=chunkkv:reuse_layers=2"]
LATENCY_METHODS = ["full", "chunkkv", "chunkkv_reuse2=chunkkv:reuse_layers=2"]


def essay_context(llm: semkv.LLM, n_tokens: int, start_file: int, folder: Path = ESSAYS) -> str:
    """Essays from the `start_file`-th on (sorted, wrapping), cut to about `n_tokens` of the model's tokens."""
    names = sorted(p.name for p in folder.glob("*.txt") if p.stat().st_size > 1000)
    names = names[start_file % len(names):] + names[: start_file % len(names)]
    text = "\n\n".join((folder / name).read_text() for name in names)
    ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens]
    return llm.tokenizer.decode(ids)


def parse_methods(specs: list[str], budget: int | float | None) -> dict[str, KVMethod]:
    """['chunkkv_reuse2=chunkkv:reuse_layers=2', 'snapkv'] -> label -> method object (unknown names skipped)."""
    methods = {}
    for spec in specs:
        head, _, params = spec.partition(":")
        label, _, name = head.rpartition("=")
        label = label or spec
        if name not in METHODS:
            print(f"skipping {label}: no method {name!r} in this checkout")
            continue
        methods[label] = get_method(name, None if name == "full" else budget,
                                    **parse_params(params.split(",") if params else []))
    return methods


def adjacent_jaccard(seq: Sequence) -> list[float]:
    """Mean over KV heads of |A ∩ B| / |A ∪ B| of the kept positions of layers l and l + 1, for every l."""
    kept = [seq.kv.positions(layer) for layer in range(seq.kv.pool.num_layers)]  # [kv_heads, n_keep] each
    out = []
    for a, b in zip(kept[:-1], kept[1:]):
        per_head = []
        for ha, hb in zip(a.tolist(), b.tolist()):
            sa, sb = set(ha), set(hb)
            per_head.append(len(sa & sb) / len(sa | sb))
        out.append(sum(per_head) / len(per_head))
    return out


def similarity(llm, methods, samples: int, n_tokens: int) -> dict[str, dict]:
    per_method: dict[str, list[list[float]]] = {label: [] for label in methods}
    labels = {id(m): label for label, m in methods.items()}
    for i in range(samples):
        llm.compare(essay_context(llm, n_tokens, start_file=7 * i), list(methods.values()), question=QUESTION,
                    max_new_tokens=1, inspect=lambda m, seq: per_method[labels[id(m)]].append(adjacent_jaccard(seq)))
        print(f"sample {i} done")
    return {label: dict(mean=statistics.mean(v for s in runs for v in s),
                        per_layer=[statistics.mean(col) for col in zip(*runs)]) for label, runs in per_method.items()}


def latency(llm, methods, n_tokens: int, new_tokens: int, repeats: int) -> dict[str, dict]:
    context = essay_context(llm, n_tokens - 40, start_file=0)
    runs: dict[str, list[dict]] = {label: [] for label in methods}
    for _ in range(repeats):
        for label, m in methods.items():
            cpu = time.process_time()
            s = llm.generate(context, questions=[QUESTION], method=m, max_new_tokens=new_tokens,
                             ignore_eos=True)[0].stats
            cpu = time.process_time() - cpu
            runs[label].append(dict(prompt_tokens=s.prompt_tokens, new_tokens=s.new_tokens, prefill_s=s.prefill_s,
                                    cpu_s=cpu,
                                    decode_s=s.decode_s, latency_s=s.prefill_s + s.decode_s,
                                    scoring_s=s.extra.get("scoring_s", 0.0),
                                    scored_layers=s.extra.get("scored_layers", 0),
                                    kv_resident=s.kv_resident_tokens))
            print(f"{label}: {runs[label][-1]}")
    out = {}
    for label, rs in runs.items():
        mean = {k: statistics.mean(r[k] for r in rs) for k in rs[0]}
        mean["throughput_tok_s"] = (mean["prompt_tokens"] + mean["new_tokens"]) / mean["latency_s"]
        mean["decode_tok_s"] = mean["new_tokens"] / mean["decode_s"]
        out[label] = mean
    return out


def add_common_args(p: argparse.ArgumentParser, out: str) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", default=out, help="JSON file of the results")


def load_llm(args: argparse.Namespace) -> semkv.LLM:
    if args.threads:
        torch.set_num_threads(args.threads)
    return semkv.LLM(args.model, device=args.device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, "results/chunkkv_index_similarity.json")
    p.add_argument("--budget", default="0.1", help="tokens (128) or a fraction (0.1, 10%%)")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--tokens", type=int, default=4096, help="context tokens")
    p.add_argument("--methods", nargs="*", default=SIMILARITY_METHODS)
    p.add_argument("--latency-methods", nargs="*", default=LATENCY_METHODS)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    llm = load_llm(args)
    budget = parse_budget(args.budget)
    result = dict(model=llm.source, budget=budget, tokens=args.tokens, samples=args.samples)
    if args.samples:
        result["similarity"] = sim = similarity(llm, parse_methods(args.methods, budget), args.samples, args.tokens)
        print(f"\n### Adjacent-layer Jaccard similarity of kept positions (budget {args.budget}, {args.tokens} tokens, "
              f"{args.samples} samples)\n\n| method | mean Jaccard |\n| --- | --- |")
        for label, r in sim.items():
            print(f"| {label} | {100 * r['mean']:.2f}% |")
    if args.repeats:
        result["latency"] = lat = latency(llm, parse_methods(args.latency_methods, budget), args.tokens,
                                          args.new_tokens, args.repeats)
        base = lat.get("full")
        print(f"\n### Latency and throughput ({args.tokens} in, {args.new_tokens} out, budget {args.budget}, "
              f"mean of {args.repeats})\n")
        print("| method | prefill (s) | decode (s) | latency (s) | throughput (tok/s) | decode (tok/s) | CPU time (s) "
              "| scoring (s) | scored layers |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for label, r in lat.items():
            change = None if base is None or label == "full" else 100 * (r["latency_s"] / base["latency_s"] - 1)
            gain = "" if change is None else f" ({change:+.1f}%)"
            print(f"| {label} | {r['prefill_s']:.2f} | {r['decode_s']:.2f} | {r['latency_s']:.2f}{gain} | "
                  f"{r['throughput_tok_s']:.1f} | {r['decode_tok_s']:.2f} | {r['cpu_s']:.1f} | {r['scoring_s']:.3f} | "
                  f"{r['scored_layers']:.0f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
