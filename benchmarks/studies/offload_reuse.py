"""Working-set reuse of the offloading methods on real weights: the embedded SmolLM2 on the CPU answers a question
about an essay with SentenceKV and DynSplit-KV at budget 0.1, K/V in host memory; per decode step, how many of the
selected offloaded tokens were already in the working set and how many were read from the host.

    python benchmarks/studies/offload_reuse.py ESSAYS.txt CHARS OUT.json
"""
from __future__ import annotations

import json
import sys
import time

import semkv
from semkv.methods import get_method


def main(path: str, chars: int, out: str) -> None:
    llm = semkv.LLM(None, device="cpu")
    doc = open(path, encoding="utf-8").read()[:chars]
    cfg, rows = llm.config, {}
    for name in ("sentencekv", "dynsplit"):
        started = time.time()
        result = llm.generate(doc, questions=["Summarise the essay in a few sentences."], max_new_tokens=64,
                              method=get_method(name, 0.1, offload=True), ignore_eos=True)[0]
        stats, steps = result.stats, result.stats.new_tokens - 1
        found, loaded = stats.extra["kv_reused"], stats.extra["kv_reloaded"]
        rows[name] = dict(prompt=stats.prompt_tokens, steps=steps, found=found, loaded=loaded,
                          loaded_share=loaded / max(found + loaded, 1),
                          loaded_per_head_step=loaded / (steps * cfg.num_layers * cfg.num_kv_heads),
                          h2d_bytes_per_step=stats.h2d_bytes / steps, seconds=time.time() - started,
                          text=result.text[:200])
        print(name, json.dumps(rows[name]), flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
