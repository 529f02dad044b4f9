"""ChunkKV chunk-size ablation ({3, 5, 10, 20, 30}, the paper's Table 10) on passkey retrieval, against Full KV and
SnapKV at the same budgets.

A 5-digit passkey sentence is hidden at several depths of Paul Graham essays cut to `--tokens` tokens; the question
comes after the text (query-aware compression, as in the paper). Accuracy: the passkey string is in the answer. As a
steadier signal on a weak model, residency: the fraction of (layer, KV head) pairs whose cache still holds every token
of the passkey after prefill-time compression. Each prompt is prefilled once with Full KV for all methods
(`LLM.compare`), and once more to read the compressed caches.

    PYTHONPATH=$PWD python benchmarks/chunkkv_chunk_size.py --tokens 3000 --budgets 128 0.1 --depths 10 30 50 70 90
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import torch

import semkv
from chunkkv_index_similarity import compressed, essay_context
from semkv.cli.main import parse_budget
from semkv.methods import KVMethod, get_method

NEEDLE = " The secret passkey is {}. Remember it. "
QUESTION = "What is the secret passkey? Answer with the number only."


def passkey_prompt(llm: semkv.LLM, n_tokens: int, depth: float, seed: int) -> tuple[str, str]:
    """(context with the passkey sentence after the first sentence end past `depth` percent, passkey)."""
    passkey = str(random.Random(f"{seed}-{depth}").randint(10000, 99999))
    haystack = essay_context(llm, n_tokens, start_file=5 * seed)
    cut = haystack.find(". ", int(len(haystack) * depth / 100))
    cut = len(haystack) if cut < 0 else cut + 1
    return haystack[:cut] + NEEDLE.format(passkey) + haystack[cut:], passkey


def passkey_token_positions(llm: semkv.LLM, context: str, passkey: str) -> list[int]:
    """Positions of the prompt tokens that overlap the passkey digits (prompt as `LLM.encode` builds it)."""
    ids, _ = llm.encode(context, QUESTION)
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": f"{context}\n\n{QUESTION}"}],
                                             add_generation_prompt=True, tokenize=False)
    enc = llm.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == ids, "prompt tokenisation differs from LLM.encode"
    where = text.find(passkey)
    return [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < where + len(passkey) and b > where]


def build_methods(chunk_sizes: list[int], budgets: list[int | float]) -> dict[str, KVMethod]:
    methods: dict[str, KVMethod] = {"full": get_method("full")}
    for budget in budgets:
        methods[f"snapkv@{budget}"] = get_method("snapkv", budget)
        for c in chunk_sizes:
            methods[f"chunkkv c={c}@{budget}"] = get_method("chunkkv", budget, chunk_size=c)
    return methods


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=3000, help="context tokens (the question comes on top)")
    p.add_argument("--depths", type=float, nargs="*", default=[10, 30, 50, 70, 90])
    p.add_argument("--seeds", type=int, default=1, help="haystacks (and passkeys) per depth")
    p.add_argument("--chunk-sizes", type=int, nargs="*", default=[3, 5, 10, 20, 30])
    p.add_argument("--budgets", nargs="*", default=["128", "0.1"])
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", default="results/chunkkv_chunk_size.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = semkv.LLM(args.model, device="cpu")
    budgets = [parse_budget(b) for b in args.budgets]
    methods = build_methods(args.chunk_sizes, budgets)
    samples = []
    for seed in range(args.seeds):
        for depth in args.depths:
            context, passkey = passkey_prompt(llm, args.tokens, depth, seed)
            needle = passkey_token_positions(llm, context, passkey)
            ids, start = llm.encode(context, QUESTION)
            resident = {}
            for label, seq in compressed(llm, ids, start, methods):
                held = [all(set(needle) <= set(head) for head in seq.kv.positions(layer).tolist())
                        for layer in range(llm.config.num_layers)]
                heads = [set(needle) <= set(head) for layer in range(llm.config.num_layers)
                         for head in seq.kv.positions(layer).tolist()]
                resident[label] = dict(heads=sum(heads) / len(heads), layers=sum(held) / len(held))
            outs = llm.compare(context, list(methods.values()), question=QUESTION, max_new_tokens=args.new_tokens)
            answers = {label: out.text for label, out in zip(methods, outs)}
            samples.append(dict(seed=seed, depth=depth, passkey=passkey, prompt_tokens=len(ids), answers=answers,
                                correct={k: passkey in v for k, v in answers.items()}, resident=resident))
            print(f"depth {depth:.0f} seed {seed}: {len(ids)} tokens, full says {answers['full']!r} (key {passkey})")
    summary = {label: dict(accuracy=100 * statistics.mean(s["correct"][label] for s in samples),
                           resident_heads=100 * statistics.mean(s["resident"][label]["heads"] for s in samples),
                           resident_layers=100 * statistics.mean(s["resident"][label]["layers"] for s in samples))
               for label in methods}
    print(f"\n### Passkey retrieval, {len(samples)} prompts of ~{args.tokens} tokens, model {llm.source}\n")
    print("accuracy % (passkey in the answer) / resident % ((layer, KV head) pairs holding every passkey token)\n")
    print("| method | " + " | ".join(f"budget {b}" for b in args.budgets) + " |")
    print("| --- |" + " --- |" * len(budgets))
    for name in ["full", "snapkv"] + [f"chunkkv c={c}" for c in args.chunk_sizes]:
        cells = [summary[name if name == "full" else f"{name}@{b}"] for b in budgets]
        print(f"| {name} | " + " | ".join(f"{r['accuracy']:.0f} / {r['resident_heads']:.0f}" for r in cells) + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(model=llm.source, tokens=args.tokens, budgets=budgets,
                                              summary=summary, samples=samples), indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
