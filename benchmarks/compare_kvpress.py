"""Do our SnapKV, StreamingLLM and KeyDiff keep the same prompt positions as NVIDIA kvpress's presses?

Both sides compress the same token ids of a few Paul Graham essays on the embedded SmolLM2-135M-Instruct (float32,
CPU): semkv through its paged engine, kvpress (installed by this script into a separate virtual environment, with its
own transformers) through `press(model)` on transformers' copy of the same model. The kvpress side runs in a
subprocess (`--kvpress-worker`) and writes, per press, prompt and layer, the kept positions of every KV head (found by
matching the kept keys against the uncompressed keys, so no kvpress internals are re-implemented). The report is the
Jaccard similarity of the kept positions per layer, averaged over KV heads and prompts.

Same hyperparameters on both sides: kvpress keeps `max(1, int(n * (1 - compression_ratio)))` tokens, which is our
budget; SnapKV window 32 / kernel 5 / average pooling (SnapKVPress(window_size=32)); StreamingLLM 4 sinks; KeyDiff
with no protected window (KeyDiffPress protects none).

Usage: [SEMKV_SHARED=/work/shared] python benchmarks/compare_kvpress.py [--venv /work/kvpress-venv] [--tokens 1024]
       [--prompts 3] [--ratio 0.75]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SEMKV_SHARED", ROOT.parent / "shared"))  # as in tests/conftest.py
ESSAYS = SHARED / "data" / "paul_graham" / "gkamradt_essays"
PRESSES = {  # name -> (our method parameters, kvpress press class and arguments)
    "snapkv": (dict(window=32, kernel_size=5, pooling="avg"), ("SnapKVPress", dict(window_size=32, kernel_size=5))),
    "streaming_llm": (dict(n_sink=4), ("StreamingLLMPress", dict(n_sink=4))),
    "keydiff": (dict(window=0), ("KeyDiffPress", {})),
}


def ensure_venv(venv: Path) -> Path:
    """A virtual environment with kvpress 0.5.5 (and the CPU torch wheel installed first, so that pip does not pull
    the CUDA build); created on first use."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import kvpress"], capture_output=True).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + ["kvpress==0.5.5"], check=True)
    return python


# -- kvpress side (runs inside the kvpress environment; imports nothing of semkv) --------------------------------------
def kvpress_worker(job_path: str, out_path: str) -> None:
    import kvpress
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.utils import logging

    logging.disable_progress_bar()

    job = json.loads(Path(job_path).read_text())
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32, attn_implementation="sdpa").eval()
    kept: dict[str, list] = {}
    for name, (cls_name, kwargs) in job["presses"].items():
        press = getattr(kvpress, cls_name)(compression_ratio=job["ratio"], **kwargs)
        layers: dict[int, list] = {}
        original = press.compress

        def compress(module, hidden_states, keys, values, attentions, kw, original=original, layers=layers):
            out_k, out_v = original(module, hidden_states, keys, values, attentions, kw)
            dist = torch.cdist(out_k[0].float(), keys[0].float(), compute_mode="donot_use_mm_for_euclid_dist")
            assert float(dist.min(-1).values.max()) < 1e-5, "a kept key is not one of the input keys"
            layers[module.layer_idx] = dist.argmin(-1).sort(-1).values.tolist()
            return out_k, out_v

        press.compress = compress
        kept[name] = []
        for ids in job["prompts"]:
            layers.clear()
            with torch.inference_mode(), press(model):
                model(torch.tensor([ids]), past_key_values=DynamicCache())
            kept[name].append([layers[i] for i in range(len(layers))])
    Path(out_path).write_text(json.dumps(kept))


# -- semkv side --------------------------------------------------------------------------------------------------------
def semkv_kept(prompts: list[list[int]], ratio: float) -> dict[str, list]:
    """Kept positions per method, prompt, layer and KV head, from one Full-KV prefill per prompt."""
    import semkv
    from semkv.engine.kv_cache import SeqKV
    from semkv.engine.sequence import SamplingParams, Sequence
    from semkv.methods import get_method

    llm = semkv.LLM(None, device="cpu", dtype="float32")
    engine = llm.engine
    kept: dict[str, list] = {name: [] for name in PRESSES}
    for ids in prompts:
        budget = max(1, int(len(ids) * (1 - ratio)))
        base = Sequence(0, ids, SamplingParams(), SeqKV(engine.pool))
        engine.prefill(base, get_method("full"), record_window=32)
        for name, (params, _) in PRESSES.items():
            method = get_method(name, budget, **params)
            method.bind(llm.config, llm.tokenizer, engine.pool.page_size)
            seq = engine.fork(base, 1)
            engine.apply_prefill(seq, method)
            kept[name].append([sorted_rows(seq.kv.positions(layer)) for layer in range(llm.config.num_layers)])
            seq.kv.release()
        base.kv.release()
    return kept


def sorted_rows(positions) -> list[list[int]]:
    return positions.sort(-1).values.tolist()


def essay_prompts(count: int, tokens: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from semkv.models.loader import _gguf_to_folder, embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(_gguf_to_folder(embedded_model_path()))
    prompts = []
    for path in sorted(ESSAYS.glob("*.txt")):
        ids = tokenizer(path.read_text())["input_ids"]
        if len(ids) >= tokens:
            prompts.append(ids[:tokens])
        if len(prompts) == count:
            return prompts
    raise SystemExit(f"fewer than {count} essays of {tokens} tokens in {ESSAYS}")


def jaccard(a: list[int], b: list[int]) -> float:
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb)


def agreement(ours: list, theirs: list) -> list[float]:
    """Per layer: Jaccard of kept positions, averaged over prompts and KV heads."""
    layers = len(ours[0])
    table = []
    for layer in range(layers):
        values = [jaccard(h_ours, h_theirs) for p_ours, p_theirs in zip(ours, theirs)
                  for h_ours, h_theirs in zip(p_ours[layer], p_theirs[layer])]
        table.append(sum(values) / len(values))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default="/work/kvpress-venv", help="where kvpress's environment lives (created)")
    parser.add_argument("--tokens", type=int, default=1024, help="prompt tokens per essay")
    parser.add_argument("--prompts", type=int, default=3, help="number of essays")
    parser.add_argument("--ratio", type=float, default=0.75, help="kvpress compression_ratio (fraction removed)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compare_kvpress.json"))
    parser.add_argument("--kvpress-worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kvpress_worker:
        return kvpress_worker(*args.kvpress_worker)

    sys.path.insert(0, str(ROOT))
    from semkv.models.loader import _gguf_to_folder, embedded_model_path

    python = ensure_venv(Path(args.venv))
    prompts = essay_prompts(args.prompts, args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "kept.json"
        job.write_text(json.dumps(dict(model=str(_gguf_to_folder(embedded_model_path())), ratio=args.ratio,
                                       prompts=prompts, presses={n: p[1] for n, p in PRESSES.items()})))
        subprocess.run([str(python), __file__, "--kvpress-worker", str(job), str(out)], check=True)
        theirs = json.loads(out.read_text())
    ours = semkv_kept(prompts, args.ratio)
    table = {name: agreement(ours[name], theirs[name]) for name in PRESSES}
    budget = max(1, int(args.tokens * (1 - args.ratio)))
    print(f"kept-position agreement (Jaccard, mean over {len(prompts)} essays x KV heads), {args.tokens} tokens, "
          f"compression_ratio={args.ratio} (budget {budget})\n")
    print("| layer | " + " | ".join(PRESSES) + " |")
    print("| --- |" + " --- |" * len(PRESSES))
    for layer in range(len(table["snapkv"])):
        print(f"| {layer} | " + " | ".join(f"{table[name][layer]:.3f}" for name in PRESSES) + " |")
    print("| mean | " + " | ".join(f"{sum(t) / len(t):.3f}" for t in table.values()) + " |")
    print("| min | " + " | ".join(f"{min(t):.4f}" for t in table.values()) + " |")
    # what unrelated choices of the same size score: our SnapKV against kvpress's KeyDiff
    control = agreement(ours["snapkv"], theirs["keydiff"])
    print(f"\ncontrol, our snapkv vs kvpress keydiff: mean {sum(control) / len(control):.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(tokens=args.tokens, prompts=len(prompts), ratio=args.ratio,
                                              budget=budget, agreement=table, control=control), indent=1))


if __name__ == "__main__":
    main()
