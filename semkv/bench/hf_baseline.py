"""HF transformers' own decode (DynamicCache) on the same shape: the reference the speed targets compare against,
with transformers' default attention (sdpa: torch's fused kernels) unless told otherwise. The cache is filled with
random K/V like semkv's benchmark cache."""
from __future__ import annotations

import time

import torch

from semkv.bench.shapes import hf_config_for
from semkv.bench.run import sync


def hf_model(shape: str, device: torch.device, dtype: torch.dtype, attn_implementation: str):
    """The shape's `transformers` model with random weights, made on the device, in eval mode."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config_for(shape), dtype=dtype,
                                                attn_implementation=attn_implementation).eval()


@torch.inference_mode()
def hf_decode_tpot_ms(shape: str, batch: int, context: int, steps: int, device: torch.device, dtype: torch.dtype,
                      attn_implementation: str = "sdpa") -> float:
    """Median ms per decode step of `transformers` with `batch` sequences of `context` cached tokens."""
    from transformers import DynamicCache

    model = hf_model(shape, device, dtype, attn_implementation)
    config = model.config
    cache = DynamicCache(config=config)
    gen = torch.Generator(device=device).manual_seed(0)
    shape_kv = (batch, config.num_key_value_heads, context, config.hidden_size // config.num_attention_heads)
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
        model(input_ids=tokens, past_key_values=cache, position_ids=position, use_cache=True)
        sync(device)
        times.append(time.perf_counter() - started)
    del model, cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    times = sorted(times[3:])
    return 1e3 * times[len(times) // 2]


@torch.inference_mode()
def hf_prefill_s(shape: str, context: int, device: torch.device, dtype: torch.dtype, repeats: int = 2,
                 attn_implementation: str = "sdpa") -> list[float]:
    """Seconds `transformers` takes to prefill one prompt of `context` tokens and give its first token's logits (as
    `generate` does: the cache filled, logits of the last position only), `repeats` times in one process: the
    first run pays what a process pays once."""
    from transformers import DynamicCache

    model = hf_model(shape, device, dtype, attn_implementation)
    config = model.config
    ids = torch.randint(1, config.vocab_size - 1, (1, context), device=device)
    times = []
    for _ in range(repeats):
        cache = DynamicCache(config=config)
        sync(device)
        started = time.perf_counter()
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        sync(device)
        times.append(time.perf_counter() - started)
        del cache
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times
