"""DynSplit-KV placement: device-resident vs host-offloaded K/V against Full KV on one long prompt (decode speed,
resident tokens, bytes moved per decode step, reuse across steps). The paper's CPU-GPU setting is the GPU run:

    PYTHONPATH=. python benchmarks/studies/dynsplit_offload.py --model MODEL --device cuda --tokens 32000 --budget 0.1

On a CPU-only machine the numbers are the traffic a GPU run would have (nothing crosses a bus).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import semkv
from semkv.methods import DynSplitKV, FullKV

SHARED = os.environ.get("SEMKV_SHARED") or next(
    (str(d / "shared") for d in Path(__file__).resolve().parents if (d / "shared" / "data").is_dir()), "shared")
BOOK = Path(SHARED) / "data" / "books" / "pg2600_war_and_peace.txt"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=3000, help="prompt tokens")
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    llm = semkv.LLM(args.model, device=args.device)
    ids = llm.tokenizer(BOOK.read_text()[200_000:])["input_ids"][: args.tokens]
    prompt = llm.tokenizer.decode(ids)
    methods = {"full": FullKV(), "dynsplit (device)": DynSplitKV(budget=args.budget),
               "dynsplit (offload)": DynSplitKV(budget=args.budget, offload=True)}
    outs = llm.compare(prompt, list(methods.values()), question="Summarise the passage in one sentence.",
                       max_new_tokens=args.max_new_tokens, chat=False, allow_overlong=True)
    print(f"prompt {outs[0].stats.prompt_tokens} tokens, budget {args.budget:g}, device {args.device}")
    print("| placement | decode tok/s | selection s | resident tokens | H2D MB/step | D2H MB/step | reuse rate |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, out in zip(methods, outs):
        s = out.stats
        steps = max(s.new_tokens - 1, 1)
        moved = s.extra.get("kv_reused", 0) + s.extra.get("kv_reloaded", 0)
        reuse = f"{s.extra['kv_reused'] / moved:.2f}" if moved else "-"
        d2h_decode = s.d2h_bytes - (s.prompt_tokens * 2 * llm.config.num_layers * llm.config.num_kv_heads
                                    * llm.config.head_dim * llm.engine.pool.k.element_size() if s.d2h_bytes else 0)
        print(f"| {name} | {s.decode_tokens_per_s:.2f} | {s.selection_s:.2f} | {s.kv_resident_tokens:.0f} | "
              f"{s.h2d_bytes / steps / 2**20:.2f} | {d2h_decode / steps / 2**20:.3f} | {reuse} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
