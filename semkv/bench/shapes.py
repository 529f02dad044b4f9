"""Model shapes for speed benchmarks: real architectures with random weights (speed does not depend on the weights)."""
from __future__ import annotations

import torch

from semkv.errors import SemkvError
from semkv.models.config import ModelConfig
from semkv.models.llama import LlamaModel
from semkv.models.parallel import TensorParallel, local_config

SHAPES: dict[str, dict] = {
    # Llama-3.1-8B: 32 layers, 32 heads, 8 KV heads, Llama-3.1 RoPE scaling
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=131072, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Llama-3.1-70B: 80 layers, 64 heads, 8 KV heads, hidden 8192 (tensor parallelism over 4 or 8 GPUs)
    "llama3-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=131072, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Qwen2-7B: 28 layers, 28 heads, 4 KV heads, q/k/v bias
    "qwen2-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                     max_position_embeddings=131072, rope_theta=1000000.0),
    # Qwen2.5-0.5B (the quality judge, Qwen2.5-Coder-0.5B-Instruct): 24 layers, 14 heads, 2 KV heads, q/k/v bias
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
    # SmolLM2-135M: the embedded model's shape
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
}


def hf_config_for(shape: str):
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise SemkvError(f"unknown shape {shape!r}; available: {', '.join(SHAPES)}")
    spec = dict(SHAPES[shape])
    model_type = spec.pop("model_type")
    spec.setdefault("tie_word_embeddings", False)
    return AutoConfig.for_model(model_type, rms_norm_eps=1e-5, **spec)


@torch.no_grad()
def random_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 tp: TensorParallel | None = None) -> LlamaModel:
    """A model of `shape` with random weights drawn on the device (std 0.02, norms at 1); with `tp`, one rank's
    shard of that shape."""
    cfg = ModelConfig.from_hf(hf_config_for(shape))
    cfg.source = f"random:{shape}"
    if tp is not None:
        cfg = local_config(cfg, tp)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.fuse()
    return model.eval()
