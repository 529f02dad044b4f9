"""GPU check that each graph-safe method's decode step, replayed from a captured CUDA graph, gives the logits of the
same method's eager step.

    python benchmarks/graph_decode_check.py [--shape smollm2-135m] [--steps 40] [--tokenizer DIR]

A model of the shape with random weights (float32, so that only the order of additions may differ) prefills four
prompts of random tokens of different lengths for real; then both paths decode the same tokens (the eager path's
greedy ones) side by side, each with its own method object and cache. One request leaves at step 12, so the graph
of the batch-of-four bucket also runs with a padding row, and the steps cross KV page boundaries. Printed per method:
the largest |logit difference| relative to the logits' spread, and the share of steps whose greedy tokens agree.
The methods that read token text (SentenceKV, DynSplit-KV) run when a tokenizer of the shape's vocabulary is given.
"""
from __future__ import annotations

import argparse

import torch

from semkv.bench.shapes import random_model
from semkv.engine.cuda_graph import GraphRunner
from semkv.engine.engine import Engine
from semkv.engine.kv_cache import SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.methods import get_method

PROMPT_LENGTHS = (1500, 700, 2100, 300)
METHODS = {  # label -> (method, budget, parameters); budgets below the prompts so that selection is sparse
    "full": ("full", None, {}),
    "chess": ("chess", 512, {}),
    "tokenselect": ("tokenselect", 512, dict(n_sink=32, n_recent=64)),
    "quest": ("quest", 512, {}),
    "quest 0.2": ("quest", 0.2, {}),
    "snapkv": ("snapkv", 512, {}),
    "pyramidkv": ("pyramidkv", 512, {}),
    "chunkkv": ("chunkkv", 512, {}),
    "keydiff": ("keydiff", 512, {}),
    "streaming_llm": ("streaming_llm", 512, {}),
    "h2o": ("h2o", 512, {}),
    "h2o 0.2": ("h2o", 0.2, {}),
    "infllm": ("infllm", 512, {}),
    "infllm 0.2": ("infllm", 0.2, dict(per_head=True)),
    "sentencekv": ("sentencekv", 512, {}),
    "sentencekv 0.2": ("sentencekv", 0.2, dict(query="current", offload_chunk=4)),
    "dynsplit": ("dynsplit", 512, {}),
    "dynsplit 0.2": ("dynsplit", 0.2, dict(n_sink=16, group_reduce="max")),
}
NEED_TOKENIZER = {"sentencekv", "dynsplit"}


def prefilled(engine: Engine, method, lengths, vocab: int) -> list[Sequence]:
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i, n in enumerate(lengths):
        ids = torch.randint(1, vocab, (n,), generator=gen).tolist()
        seq = Sequence(i, ids, SamplingParams(), SeqKV(engine.pool))
        seq.method_state = method.new_state(seq)
        seq.output_ids.append(int(engine.prefill(seq, method).argmax()))
        seqs.append(seq)
    return seqs


def check(engine: Engine, label: str, steps: int, tokenizer) -> tuple[float, float]:
    name, budget, params = METHODS[label]
    eager_method, graph_method = (get_method(name, budget, **params) for _ in range(2))
    for m in (eager_method, graph_method):
        m.bind(engine.config, tokenizer, engine.pool.page_size)
    assert graph_method.graph_safe, f"{label} is not graph-safe"
    eager = prefilled(engine, eager_method, PROMPT_LENGTHS, engine.config.vocab_size)
    graphed = prefilled(engine, graph_method, PROMPT_LENGTHS, engine.config.vocab_size)
    runner = GraphRunner(engine, graph_method, max_pages=-(-(max(PROMPT_LENGTHS) + steps + 2) // engine.pool.page_size) + 1)
    worst, agree = 0.0, 0
    for step in range(steps):
        if step == 12:
            for batch in (eager, graphed):
                batch.pop(1).kv.release()
        want = engine.decode_step(eager, eager_method)
        got = runner.decode_step(graphed)
        worst = max(worst, float((got - want).abs().max() / (want.amax() - want.amin())))
        agree += bool((got.argmax(-1) == want.argmax(-1)).all())
        for e, g, row in zip(eager, graphed, want):
            token = int(row.argmax())
            e.output_ids.append(token)
            g.output_ids.append(token)
    assert runner.steps and runner.capture == (engine.device.type == "cuda"), "the graph path did not run"
    for seq in eager + graphed:
        seq.kv.release()
    return worst, agree / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the same steps without capture")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder for the methods that read token text")
    args = parser.parse_args()
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    device = torch.device(args.device)
    model = random_model(args.shape, device, torch.float32)
    engine = Engine(model, model.config, device, torch.float32, cuda_graphs=True, gpu_memory_utilization=0.5)
    print(f"{'method':<16}{'max |dlogit| / spread':>24}{'greedy steps agreeing':>24}")
    failed = []
    with torch.inference_mode():
        for label in args.methods.split(","):
            if tokenizer is None and METHODS[label][0] in NEED_TOKENIZER:
                print(f"{label:<16}skipped: needs --tokenizer")
                continue
            worst, agree = check(engine, label, args.steps, tokenizer)
            ok = worst < 1e-3 and agree == 1.0
            failed += [] if ok else [label]
            print(f"{label:<16}{worst:>24.2e}{agree:>23.0%}{'' if ok else '  MISMATCH'}")
    print("ALL GRAPHED STEPS MATCH" if not failed else f"MISMATCH: {', '.join(failed)}")


if __name__ == "__main__":
    main()
