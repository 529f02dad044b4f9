#!/usr/bin/env bash
# Commands behind 2026-11-26-h100-prefill.md. Each "call" ran on its own H100 80GB HBM3 (device tool), from the
# repository root with PYTHONPATH set to it. Raw outputs sit beside this file.
# Call 1 (the Triton kernel, before the cuDNN path): tiles and splits; TTFT by engine chunk size
python benchmarks/prefill_sweep.py --out prefill_sweep.json
python benchmarks/results/2026-11-26-h100-prefill/ttft_chunks.py 32768 > ttft_chunks_triton.log
# Call 2: the cuDNN path against the reference, its speed, a fresh shape's plan cost
python benchmarks/results/2026-11-26-h100-prefill/cudnn_check.py > cudnn_check.log
# Call 3: kernel profile of a 32k Full-KV prefill (chunk 8192, torch merge)
python benchmarks/results/2026-11-26-h100-prefill/profile_full_32k.py > profile_full_32k_chunk8192.log
# Call 6 (chunk 8192): GEMM libraries, TTFT, kernel equality rows, TokenSelect's selective chunk
python benchmarks/results/2026-11-26-h100-prefill/gemm_lib.py > gemm_lib.log
python -m semkv.cli.main bench --shape llama3-8b --methods full,snapkv,chunkkv,h2o --budget 0.1 --contexts 32k,128k \
  --batches 1 --steps 4 --ttft --out bench_ttft_chunk8192    # then the default chunk was 8192
python benchmarks/kernel_check.py > kernel_check.log
python benchmarks/studies/tokenselect_attention.py --lengths 131072 1048576 --out tokenselect_attention_call6.json
# Call 7: TokenSelect's selection profile; Full KV TTFT at chunk 16384
python benchmarks/results/2026-11-26-h100-prefill/tokenselect_profile.py > tokenselect_profile.log
python -m semkv.cli.main bench --shape llama3-8b --methods full --contexts 32k,128k --batches 1 --steps 2 --ttft \
  --prefill-chunk 16384 --out bench_ttft_chunk16384
# Call 8: TokenSelect's sparse attention by tile and context parts
python benchmarks/results/2026-11-26-h100-prefill/sparse_sweep.py > sparse_sweep.log
# Call 9 (the committed code, default chunk 16384): the TTFT table, TokenSelect, the profile
python -m semkv.cli.main bench --shape llama3-8b --methods full,snapkv,chunkkv,h2o --budget 0.1 --contexts 32k,128k \
  --batches 1 --steps 4 --ttft --out bench_ttft       # bench_ttft.json / .md / .log
python benchmarks/studies/tokenselect_attention.py --lengths 131072 1048576 --out tokenselect_attention.json
python benchmarks/results/2026-11-26-h100-prefill/profile_full_32k.py > profile_full_32k.log
# Call 10 (2 x H100): tensor parallelism with the load-time warm-up and the cuDNN path
python benchmarks/results/2026-11-26-h100-prefill/tp_tokens_tiny.py# a tiny float32 model: every method's tokens with 2 ranks equal one process's
python -m semkv.cli.main bench --shape llama3-8b --contexts 32k --batches 1 --steps 4 --methods full,h2o --budget 0.1 \
  --ttft --tensor-parallel-size 2 --out tp2
