"""SentenceKV on 13 of the 26 RULER NIAH samples at 8k where Full KV scored 100 and SentenceKV retain="sentences",
score="tokens" less on the H100 (2026-11-26-h100-niah/eval_qwen_8k_16k; PICK names them): does the current token's
query (query="current") or keeping only the budget at prefill (keep_factor=1) recover them? CPU, float32,
Qwen2.5-Coder-0.5B-Instruct GGUF. Run from the repository root:
    python probe.py MODEL.gguf DATA_DIR OUT.jsonl      (DATA_DIR holds paul_graham/, as for `semkv eval`)"""
import json
import sys
import time

import semkv
from semkv.eval.runner import make_arms, make_task
from semkv.eval.store import ResultsDir

GPU = "benchmarks/results/2026-11-26-h100-niah/eval_qwen_8k_16k"  # its predictions.jsonl.gz
PICK = {"ruler_niah_multikey_2": [15, 16, 19], "ruler_niah_multivalue": [3, 4, 5, 6, 17, 18],
        "ruler_niah_multikey_3": [3, 5, 8, 10]}  # sample indices of the 20 drawn per task (seed 0)
ARMS = ["sentencekv[retain=sentences,score=tokens]", "sentencekv[retain=sentences,score=tokens,query=current]",
        "sentencekv[retain=sentences,score=tokens,keep_factor=1]"]
PPL_TOKENS = 64  # make_task's perplexity setting (unused by these tasks)


def main(model: str, data: str, out: str) -> None:
    gpu = {(r["sample_id"], r["method"]): r["score"] for r in ResultsDir(GPU).rows()
           if r["length"] == 8192 and r["budget"] in (None, 0.1)}
    llm = semkv.LLM(model, device="cpu")
    arms = make_arms(ARMS, [0.1], {}, None)
    with open(out, "w") as f:
        for name, ids in PICK.items():
            task = make_task(name, data, PPL_TOKENS)
            drawn = list(task.samples(llm.tokenizer, 8192, 20, 0))
            samples = [drawn[i] for i in ids]
            for arm in arms:
                started = time.time()
                outs = llm.generate([s.context for s in samples], arm.build(), max_new_tokens=task.max_new_tokens,
                                    chat=task.chat, questions=[s.question for s in samples],
                                    answer_prefixes=[s.answer_prefix for s in samples])
                scores = [task.score(o.text, s) for s, o in zip(samples, outs)]
                for s, o, score in zip(samples, outs, scores):
                    f.write(json.dumps({"task": name, "sample_id": s.sample_id, "method": arm.method, "score": score,
                                        "prediction": o.text, "gpu_full": gpu[(s.sample_id, "full")],
                                        "gpu_method": gpu.get((s.sample_id, arm.method))}) + "\n")
                    f.flush()
                print(name, arm.label, [round(x) for x in scores], f"{time.time() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
