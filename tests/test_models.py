"""The model implementation against HF transformers: logits of prefill and of decode steps on tiny random models of
every architecture variant (float32, max abs diff < 1e-3)."""
from __future__ import annotations

import pytest
import torch

import semkv
from semkv.engine.kv_cache import SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.methods import FullKV

ARCHS = ["llama", "llama31", "llama_linear", "llama_dynamic", "llama_yarn", "llama_tied", "mistral", "qwen2", "qwen3"]


def semkv_logits(llm: semkv.LLM, ids: list[int], steps: list[int]) -> list[torch.Tensor]:
    """Last-token logits after prefill, then after feeding each token of `steps`."""
    engine = llm.engine
    seq = Sequence(0, ids, SamplingParams(), SeqKV(engine.pool))
    method = FullKV()
    out = [engine.prefill(seq, method)]
    for token in steps:
        seq.output_ids.append(token)
        out.append(engine.decode_step([seq], method)[0])
    engine.release(seq)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(tiny_model_dir, arch):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(arch)
    llm = semkv.LLM(path, device="cpu", prefill_chunk=64)  # several chunks: chunked prefill is part of the check
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    # longer than max_position_embeddings for the dynamic-NTK model, so its scaling engages
    ids = torch.randint(3, llm.config.vocab_size, (200,), generator=gen).tolist()
    steps = torch.randint(3, llm.config.vocab_size, (6,), generator=gen).tolist()
    ours = semkv_logits(llm, ids, steps)
    with torch.no_grad():  # HF the way it generates: one call for the prompt, then one per token with its cache
        out = hf(torch.tensor([ids]), use_cache=True)
        refs, past = [out.logits[0, -1]], out.past_key_values
        for token in steps:
            out = hf(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            refs.append(out.logits[0, -1])
            past = out.past_key_values
    for i, (logits, ref) in enumerate(zip(ours, refs)):
        assert (logits - ref).abs().max().item() < 1e-3, f"{arch}: step {i} differs"


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(semkv.SemkvError, match="unsupported architecture 'gpt2'.*llama.*qwen2"):
        semkv.LLM(tmp_path, device="cpu")


def test_the_conversion_cache_keeps_weights_in_16_bits_only_where_exact():
    """float32 weights whose values float16 (or bfloat16) holds exactly are cached in it; dequantized weights that 16
    bits would round stay float32; either way the cache loads to the same values."""
    from semkv.models.loader import smallest_exact

    gen = torch.Generator().manual_seed(0)
    half = torch.randn(64, 64, generator=gen).half().float()  # an f16 GGUF's weights, read as float32
    brain = (torch.randn(64, 64, generator=gen) * 1e6).bfloat16().float()  # beyond float16: bfloat16 holds them
    scale = torch.rand(64, 1, generator=gen).half().float()
    quantized = scale * torch.randint(0, 16, (64, 32), generator=gen) + torch.rand(64, 1, generator=gen).half().float()
    cases = [(half, torch.float16), (brain, torch.bfloat16), (quantized, torch.float32),
             (torch.arange(4), torch.long)]
    for weights, dtype in cases:
        kept = smallest_exact(weights)
        assert kept.dtype == dtype and torch.equal(kept.to(weights.dtype), weights)


@pytest.mark.parametrize("bias", [False, True])
def test_a_long_chunk_runs_the_mlp_in_slices_with_the_same_output(monkeypatch, bias):
    """Past `MLP_SLICE` tokens the MLP runs slice by slice into one output (its intermediate activations bound a
    long chunk's memory): the same values as one pass over every token, with and without biases."""
    from semkv.models import llama
    from semkv.models.config import ModelConfig

    config = ModelConfig("llama", 100, 32, 88, 1, 4, 2, 8, 1e-5, 4096, False, False, False, bias, False)
    torch.manual_seed(0)
    mlp = llama.MLP(config)
    if bias:
        for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            torch.nn.init.normal_(linear.bias)
    mlp.fuse()
    x = torch.randn(50, 32)
    with torch.inference_mode():
        whole = mlp(x)
        monkeypatch.setattr(llama, "MLP_SLICE", 16)  # 16 + 16 + 16 + 2 tokens
        sliced = mlp(x)
    assert sliced.shape == (50, 32) and torch.allclose(sliced, whole, rtol=1e-5, atol=1e-6)
