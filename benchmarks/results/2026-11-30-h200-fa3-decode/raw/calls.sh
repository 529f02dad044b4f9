# One H200 (session 36, 2026-11-30), from the repository root; one lease, the working tree of this page's commit
# (calls 2-5 before the evicting methods were kept on the Triton kernel: ChunkKV's `auto` rows of decode/auto).
# call 1: .carry/data and the SHA256SUMS files carried; then one part a call (23 of .carry/vllm, 24 of .carry/qwen:
# `benchmarks/vllm_carry.sh --part-mib 20`), about 5 s of held time each
bash benchmarks/vllm_device.sh status
bash benchmarks/vllm_device.sh setup 150   # wheels installed in 12 s, GGUF converted in 71 s, ready in 81 s
bash benchmarks/vllm_device.sh decode 330  # raw/decode/kernels.txt, triton/, auto/, bench_*.log.gz
bash benchmarks/vllm_device.sh serve 580 --servers vllm,full --phases c1,c16,c64,shared_first,shared_followup
bash benchmarks/vllm_device.sh serve 320 --servers vllm,full --phases c1,c16,c64,shared_first,shared_followup  # resumed
# offline (raw/offline/), twice: vllm and full, then chess and chunkkv (runs done are skipped)
source benchmarks/vllm_setup.sh install
python3 benchmarks/vllm_offline.py --model $QWEN --data $DATA --out /tmp/w/offline --runs vllm,full --no-prefill-pass \
  --deadline 470
python3 benchmarks/vllm_offline.py --model $QWEN --data $DATA --out /tmp/w/offline \
  --runs "vllm,full,chess[anchor=queries],chunkkv[neighbours=3]" --no-prefill-pass --deadline 330
# the final tree (evicting methods on the Triton kernel): raw/decode/final/, bench_final.log.gz
python3 -m semkv.cli.main bench --model $QWEN --text-file /tmp/w/essays.txt --contexts 31744 --budget 0.1 --steps 32 \
  --batches 16 --methods full,chunkkv,chess --param chunkkv.neighbours=3 --param chess.anchor=queries \
  --out /tmp/w/decode/final
bash benchmarks/vllm_device.sh serve 250 --servers "vllm,full,chunkkv[neighbours=3]" \
  --phases c1,c16,c64,shared_first,shared_followup  # ChunkKV's server; cut before its follow-ups
# here: client JSONs gzipped with times rounded to the microsecond, logs and /metrics gzipped, the offline prompts
# left out (remade from the essays); the tables:
python benchmarks/vllm_page.py --serve benchmarks/results/2026-11-30-h200-fa3-decode/raw/serve
python benchmarks/vllm_page.py --offline benchmarks/results/2026-11-30-h200-fa3-decode/raw/offline
