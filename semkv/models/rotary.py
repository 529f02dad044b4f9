"""Rotary position embedding with every scaling the Llama family uses (Llama-3.1 `llama3`, linear, dynamic NTK, YaRN).

The inverse frequencies come from transformers' `ROPE_INIT_FUNCTIONS`, so each scaling is computed exactly as the
reference implementation does; this module only caches them and rotates.
"""
from __future__ import annotations

import torch

from semkv.kernels import reference

try:  # transformers >= 4.45
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
except ImportError:  # pragma: no cover - very old transformers
    ROPE_INIT_FUNCTIONS = {}


def _rope_parameters(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return dict(params)


class RotaryEmbedding:
    """cos/sin tables for positions; `rotate(x, cos, sin)` applies them to [tokens, heads, head_dim]."""

    def __init__(self, hf_config, head_dim: int, device: torch.device):
        params = _rope_parameters(hf_config)
        self.rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        self.theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        self.head_dim = head_dim
        self.hf_config = hf_config
        self.device = device
        self.max_position_embeddings = hf_config.max_position_embeddings
        if self.rope_type != "default" and self.rope_type not in ROPE_INIT_FUNCTIONS:
            from semkv.errors import SemkvError

            raise SemkvError(
                f"unsupported rope_type {self.rope_type!r}; supported: default, "
                + ", ".join(sorted(ROPE_INIT_FUNCTIONS))
            )
        self.inv_freq, self.scaling = self._frequencies(seq_len=None)

    def _frequencies(self, seq_len: int | None) -> tuple[torch.Tensor, float]:
        if self.rope_type == "default":
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=self.device) / self.head_dim
            return 1.0 / (self.theta**exponents), 1.0
        kwargs = {} if seq_len is None else {"seq_len": seq_len}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](self.hf_config, self.device, **kwargs)
        return inv_freq.to(self.device, torch.float32), float(scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, head_dim]. Dynamic NTK scales its base with `seq_len` (default: the longest
        position + 1), which HF takes as the length of the tokens in one forward call (the whole prompt at prefill)."""
        inv_freq, scaling = self.inv_freq, self.scaling
        if self.rope_type == "dynamic":
            longest = seq_len or int(positions.max()) + 1
            if longest > self.max_position_embeddings:
                inv_freq, scaling = self._frequencies(seq_len=longest)
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)

    rotate = staticmethod(reference.rotate)  # x [T, heads, head_dim], cos/sin [T, head_dim]
