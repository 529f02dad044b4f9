# One H200 (session 37, 2026-11-30), from the repository root; one lease, the working tree of this page's commit
# (the pipelined tree); the tree before in .carry/old/semkv:
git archive 124e4f9 semkv benchmarks | tar -x -C .carry/old/semkv && rm -rf .carry/old/semkv/benchmarks/results
# call 1: .carry/data, .carry/old and the SHA256SUMS files carried; then one part a call (23 of .carry/vllm, 24 of
# .carry/qwen: `benchmarks/vllm_carry.sh --part-mib 20`), about 5 s of held time each
bash benchmarks/vllm_device.sh status
bash benchmarks/vllm_device.sh setup 150   # wheels installed in 13 s, GGUF converted in 96 s, ready in 108 s
bash benchmarks/vllm_device.sh ab 400 decode_steps                             # raw/ab/
bash benchmarks/vllm_device.sh serve 585 --servers vllm,full --phases c1,c16,c64  # raw/serve/ (Full KV's c64 not reached)
bash benchmarks/vllm_device.sh serve 170 --servers full --phases c64            # raw/serve/semkv-full/c64.*
bash benchmarks/vllm_device.sh steps 405                                        # raw/steps/2048 (4096 not reached)
# here: client JSONs gzipped with times rounded to the microsecond, logs and /metrics gzipped; the tables:
python benchmarks/vllm_page.py --serve benchmarks/results/2026-11-30-h200-pipelined-decode/raw/serve
python benchmarks/vllm_page.py --serve benchmarks/results/2026-11-30-h200-pipelined-decode/raw/steps/2048
