# 2026-12-03 (session 48), one NVIDIA H200, two machines (the first one's lease ended idle between two turns).
# Trees: T1 = this commit with TokenSelect's first stage in torch (`reference.page_candidates`: a top-k of the page
# bounds, then a sort; no `_page_candidates` kernel yet); T2 = this commit.
# Machine 1 (T1). Carried: one part a call, the 32 parts of 15 MiB of Qwen2.5-Coder-0.5B-Instruct's GGUF
# (benchmarks/vllm_carry.sh), then .carry/data, .carry/qwen/SHA256SUMS and gguf's wheel in .carry/gguf:
bash benchmarks/vllm_carry.sh --part-mib 15 && python3 -m pip download --no-deps -d .carry/gguf gguf==0.19.0  # here
PYTHONPATH=$PWD python3 benchmarks/kernel_check.py --tokenselect-only   # (its output not kept: T1's check matched)
bash benchmarks/vllm_device.sh setup 150
# call A -> raw/modes_bench (section 1): real prefills of the essays, 16 rows and each mode's largest batch
bash benchmarks/vllm_device.sh modes_bench 580 --methods "full,tokenselect[theta=0.95],\
tokenselect[theta=0.95,score_keys=pages],tokenselect[theta=0.95,score_keys=pages,superset=2]" --batches 16,max
# call B -> raw/ruler (section 2)
bash benchmarks/vllm_device.sh ruler 570 --lengths 8192,16384,31744 --budgets 0.1 \
  --methods "tokenselect[prefill=full,theta=0.95,score_keys=pages],full"
# call C -> raw/profile_16 (section 3)
source benchmarks/vllm_setup.sh install
python3 benchmarks/profile_step.py --model $QWEN --text-file /tmp/w/essays.txt --budget 0.1 --batch 16 \
  --context 31744 --steps 24 --method tokenselect --param tokenselect.prefill=full --param tokenselect.theta=0.95 \
  --param tokenselect.score_keys=pages --out /tmp/w/prof_pages
# Machine 2 (T2), nothing carried: call D -> raw/random (sections 1 and 3), random weights of the Qwen2.5-0.5B shape
export PYTHONPATH=$PWD
python3 benchmarks/kernel_check.py --tokenselect-only > raw/random/kcheck.txt
python3 -m semkv.cli.main bench --shape qwen2.5-0.5b --contexts 31744 --budget 0.1 --steps 16 --batches 16,fullmax \
  --methods "full,tokenselect[theta=0.95],tokenselect[theta=0.95,score_keys=pages,superset=2],\
tokenselect[theta=0.95,score_keys=pages]" --param tokenselect.prefill=full --out raw/random
python3 benchmarks/profile_step.py --shape qwen2.5-0.5b --budget 0.1 --batch 334 --context 31744 --steps 12 \
  --method tokenselect --param tokenselect.prefill=full --param tokenselect.score_keys=pages \
  --param tokenselect.superset=2 --out /tmp/prof334   # -> raw/random/profile_334.md
# here (raw/inspect, section 4; prompt.txt: 2026-11-28-h200x4-modes-servers/raw/inspect/prompt.txt.gz), for KEYS in
# exact, pages, "pages --param superset=2"; Qwen with --model qwen.gguf:
semkv inspect --device cpu --method tokenselect --budget 0.1 --param prefill=full --param score_keys=$KEYS \
  --prompt-file prompt.txt --question "What is the special magic number for the blue fox?" \
  --needle "The special magic number for the blue fox is 7391." --answer 7391 --steps 8 --max-new-tokens 16
# and DynSplit-KV (raw/inspect/dynsplit_*, section 5), for KEYS in exact, pages:
semkv inspect --device cpu --method dynsplit --budget 0.1 --param score=tokens --param score_keys=$KEYS \
  --prompt-file prompt.txt --question "What is the special magic number for the blue fox?" \
  --needle "The special magic number for the blue fox is 7391." --answer 7391 --steps 8 --max-new-tokens 16
# logs: progress bars dropped, gzipped
