"""The quality column beside vLLM (issue 54): RULER NIAH answers of vLLM's Full KV against semkv's Full KV and
methods, on the same samples and prompt token ids, scored by the same scorer.

semkv's side is `semkv eval` itself (batched: each method runs all samples of a task and length through one
`generate`), into `--out/semkv`. vLLM's side draws the same samples (same tokenizer, seed and data), encodes them as
`LLM.generate` does, runs `vllm.LLM.generate` greedy (prefix caching off, stop at EOS, the task's new tokens),
decodes the new tokens as semkv decodes them and scores them with the task: rows of method "vllm" in `--out/vllm`, in
the format `semkv eval` writes (`semkv report --out/vllm` reads them). Both are resumable: a finished row is skipped.

    python benchmarks/vllm_quality.py --model $QWEN --data $DATA --out /tmp/w/quality        # on the device
    python benchmarks/vllm_quality.py --smoke --out /tmp/quality-smoke                      # semkv on the CPU

`vllm_offline.py --niah DIR` runs vLLM's side in its vLLM process (one start of vLLM less); then run this script
with `--sides semkv --out DIR` for semkv's.
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vllm_workload import add_common, load_text, smoke_model  # noqa: E402

NIAH = ("ruler_niah_single_1,ruler_niah_single_2,ruler_niah_single_3,ruler_niah_multikey_1,ruler_niah_multikey_2,"
        "ruler_niah_multikey_3,ruler_niah_multivalue,ruler_niah_multiquery")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common(p, "folder of the two results directories (semkv/, vllm/)",
               "CPU check: the embedded model, one task, 2 x 1024 tokens (vLLM's side too where vllm imports)")
    p.add_argument("--tasks", default=NIAH, help="RULER tasks (semkv eval's names)")
    p.add_argument("--length", type=int, default=31744, help="context tokens of each sample")
    p.add_argument("--samples", type=int, default=20, help="samples per task")
    p.add_argument("--methods", default="full,chess[anchor=queries],chunkkv[neighbours=3]",
                   help="semkv's side: semkv eval --methods")
    p.add_argument("--budget", default="0.1", help="semkv eval --budgets")
    p.add_argument("--sides", default="semkv,vllm", help="which sides run, in order")
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    smoke_model(p, args)
    if args.smoke:
        args.tasks, args.length, args.samples = "ruler_niah_single_1", 1024, 2
        if importlib.util.find_spec("vllm") is None:
            args.sides = args.sides.replace("vllm", "").strip(",")
    out = Path(args.out)
    for side in args.sides.split(","):
        started = time.time()
        if side == "semkv":
            cmd = [sys.executable, "-m", "semkv.cli.main", "eval", "--model", args.model, "--data-dir", args.data,
                   "--task", args.tasks, "--lengths", str(args.length), "--samples", str(args.samples),
                   "--methods", args.methods, "--budgets", args.budget, "--out", str(out / "semkv")]
            cmd += ["--batched", "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
            code = subprocess.run(cmd).returncode
        else:
            code = run_vllm(args, out / "vllm")
        print(f"{side}: exit {code} after {time.time() - started:.0f} s", flush=True)
    print(table(out))


class _Count:
    """store_run's progress bar, here a count."""

    n = 0

    def update(self, k: int) -> None:
        self.n += k


def run_vllm(args, folder: Path, llm=None) -> int:
    """vLLM's side into `folder` (`llm`: a `vllm.LLM` to use, as `vllm_offline.py --niah` passes its own)."""
    import vllm
    from vllm import LLM, SamplingParams

    from semkv.engine.sequence import GenerationStats
    from semkv.eval.runner import Arm, expand_tasks, make_task, sample_key, store_run
    from semkv.eval.store import ResultsDir, row_key

    text = load_text(args.model)
    store = ResultsDir(folder)
    store.path.mkdir(parents=True, exist_ok=True)
    store.repair()
    arm, done = Arm("vllm", None, {}), {row_key(r) for r in store.rows()}
    work = []
    for name in expand_tasks(args.tasks.split(",")):
        task = make_task(name, args.data, 64)
        todo = [s for s in task.samples(text.tokenizer, args.length, args.samples, 0)
                if sample_key(task, s, arm) not in done]
        if todo:
            work.append((task, todo))
    if not work:
        return 0
    llm = llm or LLM(model=args.model, dtype="bfloat16", enable_prefix_caching=False, seed=0,
                     gpu_memory_utilization=args.gpu_memory_utilization)
    for task, samples in work:
        ids = [text.encode(s.context, s.question, task.chat, s.answer_prefix)[0] for s in samples]
        params = SamplingParams(temperature=0.0, max_tokens=task.max_new_tokens)
        started = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
        wall = time.perf_counter() - started
        results = []
        for prompt, out in zip(ids, outputs):
            new = list(out.outputs[0].token_ids)
            stats = GenerationStats(prompt_tokens=len(prompt), new_tokens=len(new))
            finish = "eos" if out.outputs[0].finish_reason == "stop" else "length"
            results.append((text.tokenizer.decode(new, skip_special_tokens=True), finish, stats))
        store_run(store, task, arm, samples, results, wall, None, "cuda", _Count(), engine=f"vllm {vllm.__version__}")
    return 0


def scores(out: Path) -> dict[str, dict[str, list[float]]]:
    """Scores by method (semkv's with their budget, and "vllm") and task, from both results directories."""
    from semkv.eval.store import ResultsDir

    found: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for side in ("vllm", "semkv"):
        for row in ResultsDir(out / side).rows():
            label = row["method"] if row["budget"] is None else f"{row['method']}@{row['budget']}"
            found[label][row["task"]].append(row["score"])
    return found


def means(found: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    """Each method's score: the mean over tasks of the mean over samples."""
    return {m: sum(sum(v) / len(v) for v in by_task.values()) / len(by_task) for m, by_task in found.items()}


def table(out: Path) -> str:
    """Mean score per method and task, and each method's points against vLLM's: a markdown table."""
    found = scores(out)
    tasks = sorted({t for by_task in found.values() for t in by_task})
    lines = ["| method | " + " | ".join(t.removeprefix("ruler_") for t in tasks) + " | mean | vs vLLM |",
             "|---" * (len(tasks) + 3) + "|"]
    mean = means(found)
    for method, by_task in found.items():
        cells = [f"{sum(by_task[t]) / len(by_task[t]):.1f}" if by_task.get(t) else "-" for t in tasks]
        ratio = f"{mean[method] - mean['vllm']:+.1f} pt" if "vllm" in mean else "-"
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {mean[method]:.1f} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
