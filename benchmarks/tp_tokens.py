"""Tensor parallelism keeps every method's tokens: greedy tokens of each method with N ranks against one process, on a
real device (Triton kernels, CUDA graphs, NCCL) or the CPU (gloo).

    python benchmarks/tp_tokens.py --model DIR --device cuda --dtype float32 --sizes 2 --out tp_tokens.json

Every method runs at its defaults with an int budget (`--budget`, the CUDA-graph path where the method has one) and
at a fraction (`--fraction`), over a batch of prompts; a row is "equal" when every prompt's tokens match.
"""
from __future__ import annotations

import argparse
import json
import time

from semkv import LLM
from semkv.methods import METHODS

PROMPTS = [
    "Paged attention stores keys and values in fixed-size pages, and a page table maps positions to pages. " * 12,
    "Long documents are split into sentences. Each sentence has a meaning! Does the model keep it? " * 10,
    "The passkey is 4821. Remember it. " + "Grass is green and the sky is blue. " * 40 + "What is the passkey?",
]


def tokens(llm: LLM, method: str, budget, new: int) -> list[list[int]]:
    out = llm.generate(PROMPTS, method=method, budget=None if method == "full" else budget, max_new_tokens=new,
                       chat=False, ignore_eos=True)
    return [o.token_ids for o in out]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--sizes", default="2", help="tensor-parallel sizes to check against 1, e.g. 2,4")
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--fraction", type=float, default=0.1)
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods (default: all)")
    p.add_argument("--out", default="tp_tokens.json")
    args = p.parse_args()
    runs: dict[int, dict[str, list]] = {}
    seconds: dict[int, float] = {}
    for size in [1] + [int(s) for s in args.sizes.split(",")]:
        llm = LLM(args.model, device=args.device, dtype=args.dtype, tensor_parallel_size=size)
        started = time.perf_counter()
        runs[size] = {f"{m}@{b}": tokens(llm, m, b, args.new) for m in args.methods.split(",")
                      for b in (args.budget, args.fraction)
                      if m != "full" or b == args.budget}
        seconds[size] = time.perf_counter() - started
        llm.close()
        del llm
    rows = [dict(arm=arm, **{f"equal_n{s}": runs[s][arm] == runs[1][arm] for s in runs if s > 1}) for arm in runs[1]]
    for row in rows:
        print(row)
    print(f"all equal: {all(all(v for k, v in r.items() if k != 'arm') for r in rows)}; seconds {seconds}")
    with open(args.out, "w") as f:
        json.dump(dict(args=vars(args), rows=rows, seconds=seconds, tokens={str(s): r for s, r in runs.items()}), f)


if __name__ == "__main__":
    main()
