"""Where CHESS's page scorings rank the needle's page (issue 28, item 4): one Full-KV prefill per RULER needle
prompt, then every candidate page (neither the sink page nor the last two) scored by

- keys: the paper's key-key affinity, the mean key of the page against the mean key of the last two pages (Eq. 1-4),
  flattened over layers and KV heads;
- keys-center: the same with the mean candidate page vector subtracted (`center=True`);
- query-mean-logit: the mean query of the last 32 prompt tokens against the page's mean key, summed over layers and
  heads (the mean pre-softmax logit);
- query-mean-softvote: that mean logit softmaxed over the pages per layer and head, then summed;
- window-attention: the softmax attention of each of the last 32 prompt queries over the prompt's keys, averaged over
  the queries, summed over the page's tokens, the heads and the layers (`anchor="queries"`).

The rank of the best-ranked page holding an answer token is printed per prompt (0 = first of ~250 candidates at 8k)
and written to `--out` as JSON.

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/studies/chess_anchor_ranks.py --model qwen.gguf --length 8192 \\
        --samples 3 --out benchmarks/results/2026-11-26-h100-quality/chess_anchor_ranks_qwen_8k.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import semkv
from semkv.engine.kv_cache import SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.eval import diagnostics, runner
from semkv.methods import FullKV

WINDOW = 32  # prompt queries of the query scorings (CHESS's query_window)
SIZE = 32  # tokens per CHESS page (block_size)


def scorings(keys: torch.Tensor, queries: torch.Tensor, candidates: torch.Tensor) -> dict[str, torch.Tensor]:
    """keys [layers, kv_heads, n, D] (after RoPE), queries [layers, w, heads, D] -> page scores [pages] by name."""
    layers, kv_heads, n, dim = keys.shape
    pages = candidates.shape[0]
    pad = pages * SIZE - n
    per_page = F.pad(keys, (0, 0, 0, pad)).view(layers, kv_heads, pages, SIZE, dim)
    counts = torch.full((pages,), SIZE)
    counts[-1] = SIZE - pad
    mean = per_page.sum(3) / counts[:, None]  # [layers, kv_heads, pages, D]
    anchor = mean[:, :, -2:].mean(2, keepdim=True)
    centre = mean[:, :, candidates].mean(2, keepdim=True)
    grouped = queries.view(layers, queries.shape[1], kv_heads, -1, dim)  # [layers, w, kv_heads, group, D]
    mean_query = grouped.mean((1, 3))  # [layers, kv_heads, D]
    scale = dim ** -0.5
    logit = torch.einsum("lhpd,lhd->lhp", mean, mean_query) * scale  # mean logit of each page
    token_logits = torch.einsum("lhnd,lwhgd->lwhgn", keys, grouped) * scale
    attention = torch.softmax(token_logits, -1).mean((1, 3))  # [layers, kv_heads, n]
    return {
        "keys": (mean * anchor).sum((0, 1, 3)),
        "keys-center": ((mean - centre) * (anchor - centre)).sum((0, 1, 3)),
        "query-mean-logit": logit.sum((0, 1)),
        "query-mean-softvote": torch.softmax(logit.masked_fill(~candidates, float("-inf")), -1).sum((0, 1)),
        "window-attention": F.pad(attention, (0, pad)).view(layers, kv_heads, pages, SIZE).sum(-1).sum((0, 1)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--task", default="ruler_niah_single_2")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    llm = semkv.LLM(args.model, device="cpu")
    engine, task = llm.engine, runner.make_task(args.task, args.data_dir, 64)
    rows = []
    for sample in task.samples(llm.tokenizer, args.length, args.samples, 0):
        ids, question_start = llm.encode(sample.context, sample.question, task.chat, sample.answer_prefix)
        needle = diagnostics.prompt_requirements(llm, sample.context, sample.question, task.chat,
                                                 sample.answer_prefix, sample.needles, sample.answers)[0][0]
        seq = Sequence(0, ids, SamplingParams(), SeqKV(engine.pool), question_start)
        try:
            engine.prefill(seq, FullKV(), record_window=WINDOW)
            all_slots = torch.arange(len(ids))[None]
            keys = torch.stack([seq.kv.gather(layer, all_slots)[0].float() for layer in range(llm.config.num_layers)])
            queries = torch.stack([seq.window_queries[layer].float() for layer in range(llm.config.num_layers)])
        finally:
            engine.release(seq)
        pages = -(-len(ids) // SIZE)
        candidates = torch.zeros(pages, dtype=torch.bool)
        candidates[1 : pages - 2] = True
        needle_pages = sorted({p for p in (needle // SIZE).tolist() if candidates[p]})
        ranks = {}
        for name, scores in scorings(keys, queries, candidates).items():
            order = scores.masked_fill(~candidates, float("-inf")).argsort(descending=True)
            ranks[name] = min(int((order == page).nonzero()[0]) for page in needle_pages)
        rows.append({"sample": sample.sample_id, "tokens": len(ids), "candidates": int(candidates.sum()),
                     "needle_pages": needle_pages, "rank": ranks})
        print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
