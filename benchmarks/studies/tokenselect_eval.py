"""TokenSelect's closing-note numbers on the embedded SmolLM2-135M-Instruct (8192-token context), on InfiniteBench-style
passkey prompts (noise lines, the needle at a depth, "What is the pass key?"; scored as InfiniteBench does: the first
run of digits of the answer equals the key).

1. Length extrapolation: passkey at `--long-tokens` (16k = 2x the context) with `extrapolate=True` and the paper's
   budget 128 + 2048 + 512: found or not, and the generated text. `--baseline` adds, on the same prompt, Full KV and
   TokenSelect in exact mode, both with absolute positions past the context (`allow_overlong`), for contrast.
2. Selection Cache: a theta sweep at `--sweep-tokens` (~4k): hit rate and passkey accuracy per theta. Prefill does
   not depend on theta, so each sample is prefilled once and every theta decodes from a copy of that cache.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/studies/tokenselect_eval.py --out results/tokenselect_eval.json
"""
from __future__ import annotations

import argparse
import json
import random
import re

import semkv
from semkv.engine.kv_cache import SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.methods import TokenSelect

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information.\n\n")
QUESTION = "What is the pass key? Answer with the number only."


def passkey_prompt(llm: semkv.LLM, n_tokens: int, depth: float, key: str) -> str:
    """INTRO + noise lines with the needle at `depth` (0..1), about n_tokens tokens in all."""
    per_line = len(llm.tokenizer(NOISE * 10, add_special_tokens=False)["input_ids"]) / 10
    lines = max(int((n_tokens - 60) / per_line), 1)
    before = round(lines * depth)
    return INTRO + NOISE * before + NEEDLE.format(key=key) + NOISE * (lines - before)


def found(text: str, key: str) -> bool:
    digits = [piece for piece in re.split("[^0-9]", text) if piece]
    return bool(digits) and digits[0] == key


def long_passkey(llm: semkv.LLM, args, rng: random.Random) -> list[dict]:
    rows = []
    for depth in args.long_depths:
        key = str(rng.randint(10000, 99999))
        prompt = passkey_prompt(llm, args.long_tokens, depth, key)
        runs = [("tokenselect_extrapolate", TokenSelect(budget=args.budget, extrapolate=True), False)]
        if args.baseline:  # absolute positions past the context: without and with selection
            runs += [("full_overlong", "full", True),
                     ("tokenselect_exact_overlong", TokenSelect(budget=args.budget), True)]
        for label, method, overlong in runs:
            out = llm.generate(prompt, questions=[QUESTION], method=method, max_new_tokens=args.new_tokens,
                               allow_overlong=overlong)[0]
            s = out.stats
            rows.append(dict(run=label, depth=depth, key=key, prompt_tokens=s.prompt_tokens, text=out.text,
                             found=found(out.text, key), prefill_s=s.prefill_s, decode_s=s.decode_s,
                             kv_attended_max=s.kv_attended_max, **s.extra))
            print(f"{label} {s.prompt_tokens} tokens, depth {depth}: found={rows[-1]['found']} {out.text!r} "
                  f"(prefill {s.prefill_s:.0f} s)", flush=True)
    return rows


def theta_sweep(llm: semkv.LLM, args, rng: random.Random) -> list[dict]:
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    stopper = llm._stopper(params)
    engine, rows = llm.engine, []
    depths = [(i + 0.5) / args.sweep_samples for i in range(args.sweep_samples)]
    for depth in depths:
        key = str(rng.randint(10000, 99999))
        ids, question_start = llm.encode(passkey_prompt(llm, args.sweep_tokens, depth, key), QUESTION)
        shared = TokenSelect(budget=args.sweep_budget, extrapolate=args.sweep_extrapolate)
        shared.bind(llm.config, llm.tokenizer, engine.pool.page_size)
        seq = Sequence(0, ids, params, SeqKV(engine.pool), question_start)
        seq.method_state = shared.new_state(seq)
        first = engine.prefill(seq, shared)
        for theta in args.thetas:
            method = TokenSelect(budget=args.sweep_budget, theta=theta, extrapolate=args.sweep_extrapolate)
            method.bind(llm.config, llm.tokenizer, engine.pool.page_size)
            twin = engine.fork(seq, 0)
            twin.method_state = method.new_state(twin)
            engine.generate([twin], method, [first], stopper)
            twin.kv.release()
            text = llm.tokenizer.decode(twin.output_ids, skip_special_tokens=True)
            rows.append(dict(theta=theta, depth=depth, key=key, prompt_tokens=len(ids), text=text,
                             found=found(text, key), **twin.stats.extra))
            print(f"theta {theta} depth {depth:.2f}: found={rows[-1]['found']} hit rate "
                  f"{twin.stats.extra['selection_cache_hit_rate']:.3f} {text!r}", flush=True)
        seq.kv.release()
    return rows


def summary(rows: list[dict], thetas: list[float]) -> list[dict]:
    table = []
    for theta in thetas:
        mine = [r for r in rows if r["theta"] == theta]
        hits = sum(r["selection_cache_hits"] for r in mine)
        lookups = sum(r["selection_cache_lookups"] for r in mine)
        table.append(dict(theta=theta, hit_rate=hits / max(lookups, 1), accuracy=sum(r["found"] for r in mine) /
                          len(mine), samples=len(mine)))
        print(f"theta {theta}: hit rate {table[-1]['hit_rate']:.3f}, passkey accuracy {table[-1]['accuracy']:.2f} "
              f"({len(mine)} samples)")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--budget", type=int, default=2688, help="extrapolation run: 128 + 2048 + 512 (the paper)")
    parser.add_argument("--long-tokens", type=int, default=16384)
    parser.add_argument("--long-depths", type=float, nargs="*", default=[0.5])
    parser.add_argument("--baseline", action="store_true", help="also Full KV and exact-mode TokenSelect past the "
                        "context on the long prompts")
    parser.add_argument("--sweep-tokens", type=int, default=4096)
    parser.add_argument("--sweep-samples", type=int, default=4)
    parser.add_argument("--sweep-budget", type=int, default=1024, help="128 + 640 + 256: a quarter of ~4k")
    parser.add_argument("--sweep-extrapolate", action="store_true", help="sweep in extrapolation mode")
    parser.add_argument("--thetas", type=float, nargs="*", default=[0.5, 0.7, 0.9, 1.0])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write all rows as JSON here")
    args = parser.parse_args()
    llm = semkv.LLM(args.model, device="cpu")
    rng = random.Random(args.seed)
    result = dict(model=str(llm.source), context=llm.max_context, args=vars(args))
    if args.thetas:
        result["sweep"] = theta_sweep(llm, args, rng)
        result["sweep_summary"] = summary(result["sweep"], args.thetas)
    if args.long_depths:
        result["long"] = long_passkey(llm, args, rng)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
