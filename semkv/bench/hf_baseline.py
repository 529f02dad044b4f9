"""HF transformers as the Full-KV reference, with its default attention (sdpa: torch's fused kernels) unless told
otherwise (`attention`: one of `semkv.cli.args.HF_ATTENTIONS`): its decode (DynamicCache) timed on a cache of random
K/V like semkv's benchmark cache, its prefill, and its greedy `generate` (`semkv eval --hf`). The model is a shape
with random weights or a local model's real weights."""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from semkv.bench.shapes import SHAPES, hf_config_for
from semkv.bench.run import sync
from semkv.models.loader import model_folder

# a shape name (a str in `SHAPES`: random weights), or a local model: a HF folder, a .gguf file, None (the embedded one)
Source = str | os.PathLike | None


@contextmanager
def attention_kernels(attention: str):
    """Run HF's model calls inside this for `attention` (sdpa-flash turns cuDNN's kernel off)."""
    if attention != "sdpa-flash":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield


def hf_model(source: Source, device: torch.device, dtype: torch.dtype, attention: str = "sdpa"):
    """The `transformers` model on the device, in eval mode: a shape's with random weights, or a local model's real
    weights from the HF folder semkv loads it from (`model_folder`: a GGUF file's converted copy). A local model's
    generation settings are transformers' defaults, so `generate` is plain greedy (no repetition penalty of its own)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    attn_implementation = "eager" if attention == "eager" else "sdpa"
    if isinstance(source, str) and source in SHAPES:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(hf_config_for(source), dtype=dtype,
                                                    attn_implementation=attn_implementation).eval()
    folder = model_folder(source)[1]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
    model.generation_config = GenerationConfig()
    return model.to(device).eval()


@torch.inference_mode()
def hf_decode_tpot_ms(source: Source, batch: int, context: int, steps: int, device: torch.device, dtype: torch.dtype,
                      attention: str = "sdpa") -> float:
    """Median ms per decode step of `transformers` with `batch` sequences of `context` cached tokens."""
    from transformers import DynamicCache

    model = hf_model(source, device, dtype, attention)
    config = model.config
    cache = DynamicCache(config=config)
    gen = torch.Generator(device=device).manual_seed(0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape_kv = (batch, config.num_key_value_heads, context, head_dim)
    for layer in range(config.num_hidden_layers):
        k = torch.randn(shape_kv, generator=gen, device=device, dtype=dtype)
        v = torch.randn(shape_kv, generator=gen, device=device, dtype=dtype)
        cache.update(k, v, layer)
    tokens = torch.ones(batch, 1, dtype=torch.long, device=device)
    times = []
    for step in range(steps + 3):
        position = torch.full((batch, 1), context + step, device=device)
        sync(device)
        started = time.perf_counter()
        with attention_kernels(attention):
            model(input_ids=tokens, past_key_values=cache, position_ids=position, use_cache=True)
        sync(device)
        times.append(time.perf_counter() - started)
    del model, cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    times = sorted(times[3:])
    return 1e3 * times[len(times) // 2]


@torch.inference_mode()
def hf_prefill_s(source: Source, context: int, device: torch.device, dtype: torch.dtype, repeats: int = 2,
                 attention: str = "sdpa") -> list[float]:
    """Seconds `transformers` takes to prefill one prompt of `context` tokens and give its first token's logits (as
    `generate` does: the cache filled, logits of the last position only), `repeats` times in one process: the
    first run pays what a process pays once."""
    from transformers import DynamicCache

    model = hf_model(source, device, dtype, attention)
    config = model.config
    ids = torch.randint(1, config.vocab_size - 1, (1, context), device=device)
    times = []
    for _ in range(repeats):
        cache = DynamicCache(config=config)
        sync(device)
        started = time.perf_counter()
        with attention_kernels(attention):
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        sync(device)
        times.append(time.perf_counter() - started)
        del cache
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times


@dataclass
class HFOutput:
    """One prompt's greedy generation by `hf_generate`."""

    token_ids: list[int]  # the new tokens, through the first EOS
    prefill_s: float  # its batch's prefill: from the call to the first step's logits
    decode_s: float  # from the first step's logits to those of its last token


class StepClock:
    """A logits processor that records `time.perf_counter()` at each step of `generate`; the first call comes right
    after prefill."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync(self.device)
        self.times.append(time.perf_counter())
        return scores


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int], pad_id: int,
                attention: str = "sdpa") -> list[HFOutput]:
    """transformers' greedy `generate` of the prompts' token ids, left-padded into one batch and one call, under
    `attention_kernels(attention)` (the model's own attention: `hf_model(..., attention)`). If the GPU
    runs out of memory the batch is halved (said once on stderr) and the prompts not yet done run in batches of that
    size."""
    outputs: list[HFOutput] = []
    size = len(prompts)
    while len(outputs) < len(prompts):
        try:
            with attention_kernels(attention):
                outputs += _generate(model, prompts[len(outputs):len(outputs) + size], max_new_tokens, eos_ids,
                                     pad_id)
        except torch.cuda.OutOfMemoryError:
            if size == 1:
                raise
            torch.cuda.empty_cache()
            if size == len(prompts):
                print(f"HF transformers ran out of GPU memory generating {size} prompts at once: halving the batch "
                      "until it fits", file=sys.stderr)
            size = -(-size // 2)
    return outputs


def hf_warm_up(model, eos_ids: list[int], pad_id: int, attention: str = "sdpa") -> None:
    """One short left-padded `generate` on a GPU, as semkv's engine warms up at load: a process's first call loads the
    kernels and libraries it uses (seconds), which would otherwise count in the first run timed."""
    if model.device.type == "cuda":
        with attention_kernels(attention):
            _generate(model, [[pad_id] * 64, [pad_id] * 128], 8, eos_ids, pad_id)


def _generate(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int],
              pad_id: int) -> list[HFOutput]:
    from transformers import LogitsProcessorList

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, width], prompts at the right
    mask = torch.zeros_like(ids)  # [B, width], 1 on the prompt tokens
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    clock = StepClock(model.device)
    sync(model.device)
    started = time.perf_counter()
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=eos_ids, pad_token_id=pad_id,
                         logits_processor=LogitsProcessorList([clock]))
    eos = set(eos_ids)
    outputs = []
    for tokens in out[:, width:].tolist():
        n = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        outputs.append(HFOutput(tokens[:n], clock.times[0] - started, clock.times[n - 1] - clock.times[0]))
    return outputs
