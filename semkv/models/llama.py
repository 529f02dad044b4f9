"""The Llama family as one compact decoder: RMSNorm, GQA attention (optional q/k/v bias and q/k norm), SwiGLU MLP.

Module names mirror transformers' (`model.layers.N.self_attn.q_proj`...), so a HF state dict loads as is; `fuse()`
then concatenates q/k/v and gate/up into one projection each (fewer, larger matrix products per layer). Tokens of
all sequences in a step are flattened to [tokens, hidden] (no padding); attention itself is delegated to the
engine's `AttentionContext`, which applies RoPE, writes K/V into the paged cache and attends over the positions the
KV method selected. Between two attentions the forward is one piece of dense work (`enter`, `leave`), which the
engine's prefill replays from CUDA graphs. Norms and the SwiGLU product go through `semkv.kernels` (fused Triton
kernels on CUDA). With tensor parallelism (`parallel.py`) a rank holds its share of the heads and of the MLP, and the
outputs of o_proj and down_proj are added over the ranks.
"""
from __future__ import annotations

from typing import Generator, Protocol

import torch
from torch import nn

from semkv import kernels
from semkv.models.config import ModelConfig
from semkv.models.parallel import reduce


class AttentionContext(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] before RoPE -> output [T, heads, head_dim]."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual); x [..., dim]."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        normed, summed = kernels.rms_norm(flat, self.weight, self.eps,
                                          None if residual is None else residual.reshape(-1, shape[-1]))
        return normed.view(shape), summed.view(shape)


def fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear computing the concatenation of `parts`' outputs."""
    weight = torch.cat([p.weight for p in parts])
    bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
    with torch.device("meta"):
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.tp = layer, cfg.tp
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def fuse(self) -> None:
        self.qkv_proj = fused_linear([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """h [T, hidden] -> q, k and v side by side [T, (heads + 2 kv_heads) * head_dim], written into `out` when
        given (a static buffer of the prefill's CUDA graphs, shared by every layer)."""
        proj = self.qkv_proj
        if out is None:
            return proj(h)
        if proj.bias is None:
            return torch.mm(h, proj.weight.t(), out=out)
        return torch.addmm(proj.bias, h, proj.weight.t(), out=out)

    def attend(self, qkv: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """q/k/v side by side [T, width] -> the attention's output [T, heads * head_dim] (before o_proj)."""
        tokens = qkv.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        return ctx.attend(self.layer, q, k, v).reshape(tokens, -1)  # [T, heads * head_dim]

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The attention's output [T, heads * head_dim] -> [T, hidden], every rank's heads added."""
        return reduce(self.tp, self.o_proj(out))

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        return self.output(self.attend(self.project(x), ctx))


# tokens the MLP takes at a time: its intermediate activations (3 x intermediate_size values a token) bound a long
# prefill chunk's peak memory, while the attention takes the whole chunk in one call (one causal pass over a prompt
# is faster than a chunked one: no log-sum-exps to merge)
MLP_SLICE = 16384


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tp = cfg.tp
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def fuse(self) -> None:
        self.gate_up_proj = fused_linear([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], at most `MLP_SLICE` tokens at a time (each written in place, no copy)."""
        if x.shape[0] <= MLP_SLICE:
            return reduce(self.tp, self.down_proj(kernels.silu_mul(self.gate_up_proj(x))))
        down = self.down_proj
        out = torch.empty(x.shape[0], down.out_features, dtype=x.dtype, device=x.device)
        for a in range(0, x.shape[0], MLP_SLICE):
            h = kernels.silu_mul(self.gate_up_proj(x[a : a + MLP_SLICE]))  # [S, intermediate]
            if down.bias is None:
                torch.mm(h, down.weight.t(), out=out[a : a + MLP_SLICE])
            else:
                torch.addmm(down.bias, h, down.weight.t(), out=out[a : a + MLP_SLICE])
        return reduce(self.tp, out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: AttentionContext):
        """Pre-norm block with the residual stream carried separately (so the add fuses into the norm)."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, ctx), residual)
        return self.mlp(h), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    """Decoder-only LM. `forward(input_ids [T], ctx, last_only)` -> logits [T or n_last, vocab] in float32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse(self) -> None:
        """Concatenate each layer's q/k/v and gate/up projections (after loading weights)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def forward(self, input_ids: torch.Tensor, ctx: AttentionContext, logits_at: torch.Tensor | slice | None = None):
        """logits_at: indices (or a slice) of the tokens whose logits are needed (default all)."""
        qkv, residual = self.enter(input_ids)
        for i, layer in enumerate(self.model.layers):
            qkv, residual = self.leave(i, layer.self_attn.attend(qkv, ctx), residual)
        return self._logits(qkv, residual, logits_at)  # after the last layer: its hidden states

    # The forward between attentions, in pieces (what the prefill's CUDA graphs capture, `PrefillGraphs`): `enter`
    # before the first layer's attention, `leave(i)` from layer i's attention output to the next layer's q/k/v.
    def enter(self, input_ids: torch.Tensor, qkv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] -> (the first layer's q/k/v [T, width] (into `qkv` when given), residual [T, hidden])."""
        first = self.model.layers[0]
        h, residual = first.input_layernorm(self.model.embed_tokens(input_ids))
        return first.self_attn.project(h, qkv), residual

    def leave(self, i: int, out: torch.Tensor, residual: torch.Tensor,
              qkv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's attention output [T, heads * head_dim] -> (the next layer's q/k/v [T, width] (into `qkv` when
        given), residual); after the last layer, (its hidden states [T, hidden], residual)."""
        layers = self.model.layers
        layer = layers[i]
        h, residual = layer.post_attention_layernorm(layer.self_attn.output(out), residual)
        x = layer.mlp(h)
        if i + 1 == len(layers):
            return x, residual
        h, residual = layers[i + 1].input_layernorm(x, residual)
        return layers[i + 1].self_attn.project(h, qkv), residual

    def forward_by_layer(self, input_ids: torch.Tensor, chunks: list[tuple[int, int, AttentionContext]],
                         logits_at: torch.Tensor | slice) -> torch.Tensor:
        """What `forward` gives chunk after chunk, computed layer after layer: tokens [a, b) of input_ids [T] with
        their context, every chunk through one layer before the next layer. Holds the prompt's hidden states and
        residual [T, hidden]."""
        layers = self.by_layer(input_ids, chunks, logits_at)
        while True:
            try:
                next(layers)
            except StopIteration as done:
                return done.value

    def by_layer(self, input_ids: torch.Tensor, chunks: list[tuple[int, int, AttentionContext]],
                 logits_at: torch.Tensor | slice) -> Generator[int, None, torch.Tensor]:
        """`forward_by_layer` one layer at a time: yields each layer's index once every chunk went through it, and
        returns the logits, so a caller can spread the layers over several engine steps."""
        x = self.model.embed_tokens(input_ids)
        residual = torch.empty_like(x)
        for i, layer in enumerate(self.model.layers):
            for a, b, ctx in chunks:
                x[a:b], residual[a:b] = layer(x[a:b], residual[a:b] if i else None, ctx)
            yield i
        return self._logits(x, residual, logits_at)

    def _logits(self, x: torch.Tensor, residual: torch.Tensor, logits_at: torch.Tensor | slice | None) -> torch.Tensor:
        if logits_at is not None:
            x, residual = x[logits_at], residual[logits_at]
        return self.lm_head(self.model.norm(x, residual)[0]).float()
