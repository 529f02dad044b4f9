"""Greedy tokens of every registered method on the embedded model, recorded once and compared later.

A refactor that must not change behaviour records before (`--out before.json`) and compares after
(`--compare before.json`): every method, in its default and one non-default configuration, on three prompts cut
from `examples/scandal_in_bohemia.txt`, through `LLM.generate` (continuous batching on the CPU path).

    python3 benchmarks/method_tokens.py --out benchmarks/results/method_tokens.json
    python3 benchmarks/method_tokens.py --compare benchmarks/results/method_tokens.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import semkv
from semkv.methods import METHODS

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["What is the name of the woman in this story?", "Who writes the letter to Holmes?",
             "Where does the King of Bohemia stay?"]
# tokens cut from the story for each prompt, and where each starts
CUTS = [(0, 1200), (1500, 1600), (2800, 1500)]
BUDGET = 256
NEW = 24


def prompts(llm: semkv.LLM) -> list[str]:
    ids = llm.tokenizer.encode((ROOT / "examples" / "scandal_in_bohemia.txt").read_text(), add_special_tokens=False)
    return [llm.tokenizer.decode(ids[start:start + n]) for start, n in CUTS]


def record(llm: semkv.LLM) -> dict[str, list[list[int]]]:
    texts = prompts(llm)
    tokens = {}
    for name in METHODS:
        budget = None if name == "full" else BUDGET
        outs = llm.generate(texts, questions=QUESTIONS, method=name, budget=budget, max_new_tokens=NEW)
        tokens[name] = [o.token_ids for o in outs]
        print(f"{name:14s} {[o.text[:40] for o in outs]}", flush=True)
    return tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", type=Path, help="write the tokens of every method here")
    group.add_argument("--compare", type=Path, help="compare with tokens recorded earlier")
    args = parser.parse_args()
    llm = semkv.LLM(device="cpu")
    tokens = record(llm)
    if args.out:
        args.out.write_text(json.dumps(tokens) + "\n")
        return 0
    before = json.loads(args.compare.read_text())
    differ = sorted(set(before) ^ set(tokens)) + [n for n in tokens if n in before and before[n] != tokens[n]]
    for name in differ:
        print(f"DIFFERS: {name}")
    print("ALL METHODS EQUAL" if not differ else f"{len(differ)} method(s) differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
