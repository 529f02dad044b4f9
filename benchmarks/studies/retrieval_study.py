"""Why a method finds the needle or not, layer by layer (issue 28, item 4): answers, needle retention and attention-mass
recall against Full KV of named method variants on the same needle prompts.

Every variant of a sample runs from one Full-KV prefill where it can (`LLM.compare_iter`, with traces): per layer, the
share of KV heads whose attended set holds the whole answer span at every traced decode step (retention), and the
share of Full KV's attention probability that set covers (mass recall, averaged over query heads and steps). Rows go
to `--out` (JSON lines, resumable); the summary prints answers, retention and mass recall per variant, then the
per-layer retention of every variant.

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/studies/retrieval_study.py --model qwen.gguf --lengths 8192,32768 \\
        --tasks ruler_niah_single_2,passkey --samples 5 --out benchmarks/results/retrieval_qwen_8k.jsonl
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import semkv
from semkv.eval import diagnostics, runner
from semkv.cli.args import parse_names
from semkv.methods import get_method

# name -> (method, budget (None: the study's --budget), parameters)
VARIANTS = {
    "full": ("full", None, {}),
    "chess": ("chess", None, {}),
    "chess-aggressive": ("chess", None, {"preset": "aggressive"}),
    "chess+rope_free": ("chess", None, {"rope_free": True}),
    "chess+center": ("chess", None, {"center": True}),
    "chess+rope_free+center": ("chess", None, {"rope_free": True, "center": True}),
    "chess+queries": ("chess", None, {"anchor": "queries"}),
    "chess-aggressive+queries": ("chess", None, {"anchor": "queries", "preset": "aggressive"}),
    "chess-conservative+queries": ("chess", None, {"anchor": "queries", "preset": "conservative"}),
    "chess-flat+queries": ("chess", None, {"anchor": "queries", "chunk_pages": 1, "grid_chunks": 1}),  # no cascade
    "chess+queries-no_neighbours": ("chess", None, {"anchor": "queries", "neighbours": 0}),
    "quest": ("quest", None, {}),
    "snapkv": ("snapkv", None, {}),
    "tokenselect": ("tokenselect", None, {}),
    "tokenselect@2688": ("tokenselect", 2688, {}),
    "tokenselect+full_prefill": ("tokenselect", None, {"chunk": 1 << 20}),
    "tokenselect+no_cache": ("tokenselect", None, {"theta": 1.0}),
    "tokenselect+prefill_full": ("tokenselect", None, {"prefill": "full"}),
    "dynsplit+tokens": ("dynsplit", None, {"score": "tokens"}),
    "sentencekv+lookup": ("sentencekv", None, {"retain": "sentences", "score": "tokens", "query": "current",
                                               "keep_factor": 1.0}),
    "h2o": ("h2o", None, {}),
    "infllm": ("infllm", None, {}),
}


def run(args) -> list[dict]:
    llm = semkv.LLM(args.model, device=args.device)
    names = parse_names(args.variants)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    out = Path(args.out)
    done = {(r["task"], r["sample"], r["variant"]) for r in map(json.loads, out.read_text().splitlines())} \
        if out.is_file() else set()
    rows = []
    for length, task_name in itertools.product(args.lengths, parse_names(args.tasks)):
        task = runner.make_task(task_name, args.data_dir, 64)
        for sample in task.samples(llm.tokenizer, length, args.samples, 0):
            if args.only and sample.sample_id not in args.only:
                continue
            pending = [n for n in names if (task_name, sample.sample_id, n) not in done]
            if not pending:
                continue
            run_names = ["full"] + [n for n in pending if n != "full"]
            methods = [get_method(VARIANTS[n][0], None if n == "full" else VARIANTS[n][1] or args.budget,
                                  **VARIANTS[n][2]) for n in run_names]
            started = time.time()
            outputs = llm.compare_iter(sample.context, methods, sample.question, task.max_new_tokens, task.chat,
                                       trace_steps=range(min(runner.DIAG_STEPS, task.max_new_tokens)),
                                       trace_weights=True, answer_prefix=sample.answer_prefix)
            full = requirements = None
            for i, gen in outputs:
                name = run_names[i]
                if i == 0:
                    full = gen
                    requirements = diagnostics.prompt_requirements(llm, sample.context, sample.question, task.chat,
                                                                   sample.answer_prefix, sample.needles,
                                                                   sample.answers)
                    if name not in pending:
                        continue
                budget = None if name == "full" else VARIANTS[name][1] or args.budget
                maps = diagnostics.head_maps(gen, full, budget, requirements, len(gen.prompt_token_ids))
                row = {"task": task_name, "sample": sample.sample_id, "variant": name, "length": length,
                       "budget": budget, "score": task.score(gen.text, sample), "prediction": gen.text,
                       "attended": gen.stats.kv_attended_tokens, "diag": diagnostics.summarize(maps)}
                rows.append(row)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{task_name} {sample.sample_id} {name:<26} score {row['score']:.2f} "
                      f"retention {row['diag'].get('retention', float('nan')):.2f} "
                      f"mass {row['diag'].get('mass_recall', float('nan')):.2f} {gen.text[:40]!r}", flush=True)
            print(f"sample done in {time.time() - started:.0f} s", flush=True)
    return rows


def mean(rows: list[dict], key: str) -> float:
    """The mean of a diagnostic over the rows that have it (mass recall needs a step where the method's tokens so far
    equal Full KV's)."""
    values = [r["diag"][key] for r in rows if key in r["diag"]]
    return sum(values) / len(values) if values else float("nan")


def summary(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(f"{r['variant']} {r['length'] // 1024}k", []).append(r)
    lines = ["| variant | samples | score | needle kept (heads) | layers keeping needle | mass recall |",
             "|---|---|---|---|---|---|"]
    for name, rs in by.items():
        lines.append(f"| {name} | {len(rs)} | {sum(r['score'] for r in rs) / len(rs):.2f} | "
                     f"{mean(rs, 'retention'):.2f} | {mean(rs, 'retained_layers'):.1f} | {mean(rs, 'mass_recall'):.3f} |")
    for key, title, digits in (("layers_retention", "Needle retention per layer (share of KV heads", 1),
                               ("layers_mass_recall", "Mass recall per layer (all heads", 2)):
        lines += ["", f"{title}; mean over the samples that have it):", ""]
        for name, rs in by.items():
            layers = [r["diag"][key] for r in rs if key in r["diag"]]
            if layers:
                per = [sum(col) / len(col) for col in zip(*layers)]
                lines.append(f"{name:<26} " + " ".join(f"{x:.{digits}f}" for x in per))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[8192])
    p.add_argument("--budget", type=float, default=0.1, help="budget of every variant that names none")
    p.add_argument("--tasks", default="ruler_niah_single_2,passkey")
    p.add_argument("--samples", type=int, default=5, help="samples per task (needle depths spread over the context)")
    p.add_argument("--only", type=lambda s: set(s.split(",")), default=None,
                   help="sample ids to study (comma-separated, of the first --samples of each task and length)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--data-dir", default=None, help="data root (default: the packaged data)")
    p.add_argument("--out", required=True, help="JSON-lines file (appended to; done rows are skipped)")
    p.add_argument("--summary-only", action="store_true")
    args = p.parse_args()
    if not args.summary_only:
        run(args)
    print(summary(Path(args.out)))


if __name__ == "__main__":
    main()
