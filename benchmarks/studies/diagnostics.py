"""Needle retention and critical-token recall of every method (issue 11's closing numbers).

For each task (passkey, NIAH) one sample at the requested length with the needle at mid depth (the middle of a
3-point depth sweep: 50%) runs under every method at each budget, with one shared Full-KV prefill (methods with their
own prefill prefill again); rows go to `--out` as `semkv eval` writes them (resumable, `semkv report` reads it), and
the summary table with the diagnostics columns is printed at the end.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/studies/diagnostics.py --length 4096 --out results/diag_smollm2_4k
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/studies/diagnostics.py --model /work/qwen/qwen2.5-coder-0.5b-instruct.gguf \
        --length 8192 --out results/diag_qwen_8k
"""
from __future__ import annotations

import argparse
import time

from tqdm.auto import tqdm

import semkv
from semkv.eval import report, runner
from semkv.cli.args import parse_names
from semkv.eval.cli import parse_budgets
from semkv.eval.store import ResultsDir, row_key
from semkv.methods import METHODS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--budgets", default="0.1,0.25")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--tasks", default="passkey,niah")
    p.add_argument("--data-dir", default="/work/shared/data")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    started = time.time()
    llm = semkv.LLM(args.model, device="cpu")
    arms = runner.make_arms(parse_names(args.methods), parse_budgets(args.budgets), {}, None)
    store = ResultsDir(args.out)
    store.write_config({"script": "benchmarks/studies/diagnostics.py", "args": vars(args),
                        "resolved": {"model_source": llm.source}})
    store.repair()
    for name in parse_names(args.tasks):
        task = runner.make_task(name, args.data_dir, 64)
        sample = task.samples(llm.tokenizer, args.length, 3, 0)[1]  # needle depth 50%
        done = {row_key(r) for r in store.rows()}
        pending = [a for a in arms if runner.sample_key(task, sample, a) not in done]
        with tqdm(total=len(pending), desc=sample.sample_id, unit="run") as bar:
            runner.run_sample(llm, store, task, sample, pending, False, bar)
    print(report.summary_table(store.rows()))
    print(f"wall time: {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
