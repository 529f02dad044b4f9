"""Model configuration: the few numbers of a Llama-family decoder, read from a HF config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from semkv.errors import SemkvError

# model_type -> (q/k/v bias, o_proj bias, q/k RMSNorm); None means "read attention_bias from the config".
ARCHITECTURES: dict[str, tuple[bool | None, bool | None, bool]] = {
    "llama": (None, None, False),    # Llama-2/3/3.1/3.2, Yi, LongChat, DeepSeek-R1-Distill-Llama, SmolLM2
    "mistral": (False, False, False),
    "qwen2": (True, False, False),   # Qwen2 / Qwen2.5: bias on q/k/v only
    "qwen3": (None, None, True),     # Qwen3: RMSNorm on q and k per head
}


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hf_config: Any = None  # the transformers config, kept for RoPE scaling parameters
    source: str = ""  # the path the model was loaded from (keys per-model calibration files)
    # this process's rank with tensor parallelism (`models.parallel.TensorParallel`): then the head, KV-head and MLP
    # counts above are the rank's share (`parallel.local_config`)
    tp: Any = None

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        model_type = getattr(hf, "model_type", None)
        if model_type not in ARCHITECTURES:
            raise SemkvError(
                f"unsupported architecture {model_type!r}; supported model types: "
                f"{', '.join(sorted(ARCHITECTURES))} (Llama-2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3, Yi, "
                "LongChat, DeepSeek-R1-Distill-Llama, SmolLM2)"
            )
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise SemkvError(f"unsupported activation {act!r}: semkv implements SwiGLU (silu) MLPs only")
        qkv_bias, o_bias, qk_norm = ARCHITECTURES[model_type]
        attention_bias = bool(getattr(hf, "attention_bias", False))
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        window = getattr(hf, "sliding_window", None)
        if model_type == "qwen2" and not getattr(hf, "use_sliding_window", False):
            window = None
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias if o_bias is None else o_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=qk_norm,
            sliding_window=window,
            eos_token_ids=eos_ids,
            hf_config=hf,
        )
