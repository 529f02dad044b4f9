"""ChunkKV chunk-size ablation ({3, 5, 10, 20, 30}, the paper's Table 10) on passkey retrieval, against Full KV and
SnapKV at the same budgets.

A 5-digit passkey sentence is hidden at several depths of Paul Graham essays cut to `--tokens` tokens; the question
comes after the text (query-aware compression, as in the paper). Accuracy: the passkey string is in the answer. As a
steadier signal on a weak model, residency: the fraction of (layer, KV head) pairs whose cache still holds every token
of the passkey after prefill-time compression. Each prompt is prefilled once with Full KV for all methods
(`LLM.compare`), whose `inspect` hook reads each compressed cache before decoding.

    PYTHONPATH=$PWD python benchmarks/studies/chunkkv_chunk_size.py --tokens 3000 --budgets 128 0.1 --depths 10 30 50 70 90
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import semkv
from chunkkv_index_similarity import add_common_args, essay_context, load_llm
from semkv.cli.args import parse_budget
from semkv.engine.sequence import Sequence
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
    add_common_args(p, "results/chunkkv_chunk_size.json")
    p.add_argument("--tokens", type=int, default=3000, help="context tokens (the question comes on top)")
    p.add_argument("--depths", type=float, nargs="*", default=[10, 30, 50, 70, 90])
    p.add_argument("--seeds", type=int, default=1, help="haystacks (and passkeys) per depth")
    p.add_argument("--chunk-sizes", type=int, nargs="*", default=[3, 5, 10, 20, 30])
    p.add_argument("--budgets", nargs="*", default=["128", "0.1"])
    p.add_argument("--new-tokens", type=int, default=16)
    args = p.parse_args()
    llm = load_llm(args)
    budgets = [parse_budget(b) for b in args.budgets]
    methods = build_methods(args.chunk_sizes, budgets)
    labels = {id(m): label for label, m in methods.items()}
    samples = []
    for seed in range(args.seeds):
        for depth in args.depths:
            context, passkey = passkey_prompt(llm, args.tokens, depth, seed)
            needle = passkey_token_positions(llm, context, passkey)
            resident = {}

            def look(method: KVMethod, seq: Sequence) -> None:
                held = [[set(needle) <= set(head) for head in seq.kv.positions(layer).tolist()]
                        for layer in range(llm.config.num_layers)]  # [layers][kv_heads]
                resident[labels[id(method)]] = dict(heads=statistics.mean(h for layer in held for h in layer),
                                                    layers=statistics.mean(all(layer) for layer in held))

            outs = llm.compare(context, list(methods.values()), question=QUESTION, max_new_tokens=args.new_tokens,
                               inspect=look)
            answers = {label: out.text for label, out in zip(methods, outs)}
            n_prompt = outs[0].stats.prompt_tokens
            samples.append(dict(seed=seed, depth=depth, passkey=passkey, prompt_tokens=n_prompt, answers=answers,
                                correct={k: passkey in v for k, v in answers.items()}, resident=resident))
            print(f"depth {depth:.0f} seed {seed}: {n_prompt} tokens, full says {answers['full']!r} (key {passkey})")
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
