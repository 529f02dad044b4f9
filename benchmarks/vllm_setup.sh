# The vLLM comparison's set-up on a device machine (issue 54); run from the repository root there:
#   bash benchmarks/vllm_setup.sh status   # which carried parts are there (after each carrying call)
#   source benchmarks/vllm_setup.sh        # install once per machine, then export the environment
# Once every part that benchmarks/vllm_carry.sh made is there (.carry/vllm, .carry/qwen, .carry/data): checks them
# against SHA256SUMS, installs vLLM 0.26.0's wheels with `pip --target /tmp/site` (no network there, no dependency
# resolution: the machine's torch 2.11, transformers, numpy... stay), joins the GGUF and converts it once into semkv's
# HF folder, /tmp/qwen-hf (the folder both vLLM and semkv load: the same weights), and prints vLLM's version and the
# FlashAttention version it picks on this GPU. A machine that has done it skips to the exports (about a second).
# semkv's stages alone (modes_bench, ab, ruler, kernels...) need no vLLM: without .carry/vllm, and with gguf's wheel
# in .carry/gguf (`pip download --no-deps gguf==0.19.0 -d .carry/gguf`), only that wheel and the model are set up.
# Exports: PYTHONPATH, PATH, CUDA_HOME (FlashInfer compiles with its nvcc), QWEN (the HF folder), DATA (.carry/data:
# the essays, RULER's word lists, a tokenizer for the random 8B shape), SEMKV_CACHE_DIR and offline switches.

T=${VLLM_TMP:-/tmp}  # where it installs and converts (kept while the machine is warm)

_vllm_parts() {  # DIR [quick]: "ok", or which parts are missing or damaged (quick: presence only, no hashing)
  local dir=$1 missing="" bad=""
  [ -f "$dir/SHA256SUMS" ] || { echo "no $dir/SHA256SUMS"; return; }
  while read -r sum name; do
    [[ $name == *.[0-9][0-9] ]] || continue
    if [ ! -f "$dir/$name" ]; then missing="$missing ${name##*.}"
    elif [ -z "${2:-}" ] && [ "$(sha256sum < "$dir/$name" | cut -d' ' -f1)" != "$sum" ]; then bad="$bad ${name##*.}"; fi
  done < "$dir/SHA256SUMS"
  if [ -z "$missing$bad" ]; then echo ok; else echo "missing parts:${missing:- none}; damaged:${bad:- none}"; fi
}

_vllm_join() {  # DIR OUTPUT: the parts joined, checked against the whole file's sum
  local dir=$1 out=$2
  cat "$dir"/*.[0-9][0-9] > "$out"
  [ "$(sha256sum < "$out" | cut -d' ' -f1)" = "$(head -1 "$dir/SHA256SUMS" | cut -d' ' -f1)" ] || {
    echo "vllm_setup: $out does not match $dir/SHA256SUMS" >&2; rm -f "$out"; return 1; }
}

if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
  sed -n '1,/^$/p' "${BASH_SOURCE[0]}"; return 0 2>/dev/null || exit 0
fi
if [ "${1:-}" = status ]; then
  for d in vllm qwen vllm-extra; do echo ".carry/$d: $(_vllm_parts .carry/$d quick)"; done
  echo ".carry/data: $([ -f .carry/data/SHA256SUMS ] && echo there || echo missing)"
  [ -f $T/site/vllm/__init__.py ] && echo "vLLM installed in $T/site"
  [ -e $T/qwen-hf/config.json ] && echo "model folder $T/qwen-hf ready"
  return 0 2>/dev/null || exit 0
fi

export PYTHONPATH=$T/site:$T/site/nvidia_cutlass_dsl/dsl_packages:$T/site-extra:$PWD
export PATH=$T/site/bin:$T/site-extra/bin:$PATH
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} FLASHINFER_DISABLE_VERSION_CHECK=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export SEMKV_CACHE_DIR=$T/semkv-cache QWEN=$T/qwen-hf DATA=$PWD/.carry/data
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # kept off, as the machines ask

_vllm_setup() {
  local t0=$SECONDS state semkv_only=""
  # semkv's stages alone (the header): gguf's carried wheel is all that is installed, and the vLLM checks are skipped
  if [ ! -f .carry/vllm/SHA256SUMS ] && ls .carry/gguf/gguf-*.whl > /dev/null 2>&1; then
    semkv_only=1
    [ -d $T/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $T/site \
      .carry/gguf/*.whl || { echo "vllm_setup: pip install of .carry/gguf failed" >&2; return 1; }
  elif [ ! -f $T/site/vllm/__init__.py ]; then
    state=$(_vllm_parts .carry/vllm); [ "$state" = ok ] || { echo "vllm_setup: .carry/vllm: $state" >&2; return 1; }
    _vllm_join .carry/vllm $T/wheels.tar || return 1
    mkdir -p $T/wheels && tar -xf $T/wheels.tar -C $T/wheels && rm $T/wheels.tar
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $T/site $T/wheels/*.whl \
      || { echo "vllm_setup: pip install failed" >&2; return 1; }
    rm -rf $T/wheels
    echo "vllm_setup: wheels installed in $((SECONDS - t0)) s"
  fi
  # the left-out wheels, if they were carried, in a folder of their own (--target would skip $T/site/nvidia)
  if [ ! -d $T/site-extra ] && [ "$(_vllm_parts .carry/vllm-extra)" = ok ]; then  # tried once
    mkdir -p $T/site-extra $T/extra
    _vllm_join .carry/vllm-extra $T/extra.tar && tar -xf $T/extra.tar -C $T/extra \
      && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $T/site-extra \
           $T/extra/*.whl && echo "vllm_setup: the left-out wheels installed in $T/site-extra"
    rm -rf $T/extra.tar $T/extra
  fi
  if [ ! -e $T/qwen-hf/config.json ]; then
    if [ ! -f $T/qwen.gguf ]; then
      state=$(_vllm_parts .carry/qwen); [ "$state" = ok ] || { echo "vllm_setup: .carry/qwen: $state" >&2; return 1; }
      _vllm_join .carry/qwen $T/qwen.gguf || return 1
    fi
    local folder
    folder=$(python3 -c "from semkv.models.loader import model_folder; print(model_folder('$T/qwen.gguf')[1])" \
             2>$T/qwen-convert.log) || { tail -5 $T/qwen-convert.log >&2; return 1; }
    ln -sfn "$folder" $T/qwen-hf
    echo "vllm_setup: $T/qwen.gguf converted to $folder ($((SECONDS - t0)) s)"
  fi
  if [ -n "$semkv_only" ]; then
    echo "vllm_setup: semkv alone (no .carry/vllm), ready in $((SECONDS - t0)) s"; return 0
  fi
  if [ -f $T/site/.checked ]; then cat $T/site/.checked; return 0; fi
  python3 - <<'EOF' > $T/site/.checking || { echo "vllm_setup: vLLM does not import" >&2; return 1; }
import json, os, torch, transformers, vllm
from vllm.vllm_flash_attn.flash_attn_interface import is_fa_version_supported
folder = os.environ["QWEN"]
config = json.load(open(f"{folder}/config.json"))
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"{torch.cuda.get_device_name()}, FlashAttention 3 supported: {is_fa_version_supported(3)}")
print(f"model folder {folder}: {config['model_type']}, {config['num_hidden_layers']} layers, "
      f"dtype in config: {config.get('dtype', config.get('torch_dtype'))} (both engines load it as bfloat16)")
EOF
  mv $T/site/.checking $T/site/.checked && cat $T/site/.checked
  echo "vllm_setup: ready in $((SECONDS - t0)) s"
}
_vllm_setup
