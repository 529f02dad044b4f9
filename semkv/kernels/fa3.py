"""Full attention through FlashAttention 3, the Hopper kernel vLLM serves with, as vLLM's wheel bundles it
(`vllm.vllm_flash_attn`): an optional dependency, used where it is installed (`usable`). It reads the paged cache in
place through the page tables (no gather of the context, as `cudnn_prefill` needs). Prefill: a chunk over every
earlier slot and itself in one call with a lower-right causal mask (no second call, no merge), for a chunk of any
length at any start, or the chunks of several sequences in one call; decode: one query row a sequence over all its
slots (attention that selects nothing), as vLLM decodes. No plans to build, nothing to warm up. Where it refuses a
call (a shape or a build it does not run), it turns itself off for the process with one warning and the next path
serves (`PATH` for prefill, `DECODE_PATH` for decode).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from semkv.kernels.optional_path import OptionalPath

PATH = OptionalPath("FlashAttention 3 prefill attention", "cuDNN's path or the Triton kernel serves prefill instead")
DECODE_PATH = OptionalPath("FlashAttention 3 decode attention", "the Triton kernel serves decode instead")


@functools.cache
def available() -> bool:
    """True when vLLM's FlashAttention 3 imports and runs on this process's GPU (compute capability 9.x)."""
    try:
        from vllm.vllm_flash_attn.flash_attn_interface import is_fa_version_supported
    except Exception:  # noqa: BLE001  not installed, or a build that does not load here
        return False
    return bool(is_fa_version_supported(3))


def serves(dtype: torch.dtype, path: OptionalPath = PATH) -> bool:
    """True when `path` (prefill's or `DECODE_PATH`) may serve full attention of `dtype` values in this process:
    16-bit values, FlashAttention 3 available, no earlier call of the path failed."""
    return not path.failed and dtype in (torch.bfloat16, torch.float16) and available()


def usable(q: torch.Tensor, context: torch.Tensor | None, k_pool: torch.Tensor, path: OptionalPath = PATH) -> bool:
    """True when `path` serves the call: full attention (no index list), head_dim <= 256, K/V of the queries'
    dtype, and `serves` that dtype."""
    return context is None and q.shape[-1] <= 256 and k_pool.dtype == q.dtype and serves(q.dtype, path)


def attend(q, k_pool, v_pool, table, start, scale, lse=False):
    """`prefill_attention`, or None where FlashAttention 3 refuses the call: the path is then turned off for the
    process (`PATH`)."""
    return PATH.run(prefill_attention, q, k_pool, v_pool, table, start, scale, lse)


def attend_packed(q, k_pool, v_pool, tables, cu_q, used_k, longest_q, longest_k, scale):
    """`packed_attention`, or None where FlashAttention 3 refuses the call (the path is then turned off: `PATH`)."""
    return PATH.run(packed_attention, q, k_pool, v_pool, tables, cu_q, used_k, longest_q, longest_k, scale)


_lengths_key: tuple = ()
_lengths: tuple[torch.Tensor, torch.Tensor] = ()


def lengths(chunk: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_seqlens_q [2] = (0, chunk) and seqused_k [1] = (n,), int32, made on the device from the numbers (kernel
    arguments: a copy from pageable host memory would make the host wait for every queued kernel), once per chunk:
    every layer's call reuses them."""
    global _lengths_key, _lengths
    if _lengths_key != (chunk, n, device):
        cu_q = torch.arange(0, 2 * chunk, chunk, dtype=torch.int32, device=device)
        _lengths_key, _lengths = (chunk, n, device), (cu_q, torch.full((1,), n, dtype=torch.int32, device=device))
    return _lengths


def prefill_attention(q, k_pool, v_pool, table, start, scale, lse=False):
    """`reference.prefill_attention` with context None: q [C, heads, D] of slots [start, start + C) over every slot
    below start + C, read through `table` [>= pages] from the pools [num_pages, page, kv_heads, D]. Returns out
    [C, heads, D] (and the natural-log lse [C, heads] float32 with lse=True)."""
    from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func

    chunk = q.shape[0]
    n = start + chunk
    pages = -(-n // k_pool.shape[1])
    cu_q, used_k = lengths(chunk, n, q.device)
    block_table = table[:pages].to(torch.int32)[None]  # [1, pages] int32, as FlashAttention's page table
    out = flash_attn_varlen_func(q, k_pool, v_pool, max_seqlen_q=chunk, cu_seqlens_q=cu_q, max_seqlen_k=n,
                                 seqused_k=used_k, softmax_scale=scale, causal=True, block_table=block_table,
                                 return_softmax_lse=lse, fa_version=3)
    if not lse:
        return out
    out, total = out  # total [heads, C]
    return out, total.t().contiguous()


def packed_attention(q, k_pool, v_pool, tables, cu_q, used_k, longest_q, longest_k, scale):
    """The chunks of several sequences in one call: q [T, heads, D] holds them one after another (chunk i: rows
    [cu_q[i], cu_q[i + 1]), cu_q [P + 1] int32), each over its own pages (tables [P, >= pages] int32) up to used_k[i]
    slots, its chunk the last of them (lower-right causal); longest_q / longest_k: the longest chunk and context.
    Returns out [T, heads, D]."""
    from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k_pool, v_pool, max_seqlen_q=longest_q, cu_seqlens_q=cu_q, max_seqlen_k=longest_k,
                                  seqused_k=used_k, softmax_scale=scale, causal=True, block_table=tables,
                                  fa_version=3)


@dataclass
class DecodeInputs:
    """A decode step's arguments of FlashAttention 3 as it reads them (int32, each layer's rows contiguous), made once a
    step for every layer: tables [layers, B, W] (each row's pages), used [layers, B] (the slots each row attends in
    each layer), cu_q [B + 1] (0..B: one query row a sequence), longest: an upper bound of `used` (a CUDA graph's
    capacity, so nothing reads the device; it sets how FlashAttention splits the context)."""

    tables: torch.Tensor
    used: torch.Tensor
    cu_q: torch.Tensor
    longest: int


def decode_inputs(tables: torch.Tensor, num_slots: torch.Tensor, longest: int) -> DecodeInputs:
    """tables [B, layers, W] and num_slots [B, layers] (a decode batch's, int64) -> `DecodeInputs`: three small
    kernels a step instead of two a layer."""
    batch = tables.shape[0]
    return DecodeInputs(tables.transpose(0, 1).to(torch.int32).contiguous(),
                        num_slots.t().to(torch.int32).contiguous(),
                        torch.arange(batch + 1, dtype=torch.int32, device=tables.device), longest)


def attend_decode(q, k_pool, v_pool, inputs: DecodeInputs, layer: int, scale: float):
    """`decode_attention`, or None where FlashAttention 3 refuses the call (the path is then turned off:
    `DECODE_PATH`)."""
    return DECODE_PATH.run(decode_attention, q, k_pool, v_pool, inputs, layer, scale)


def decode_attention(q, k_pool, v_pool, inputs: DecodeInputs, layer: int, scale: float):
    """One decode step's full attention in `layer`: q [B, heads, D], row b over its first inputs.used[layer, b] slots
    through inputs.tables[layer, b]. Returns out [B, heads, D]."""
    from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k_pool, v_pool, max_seqlen_q=1, cu_seqlens_q=inputs.cu_q,
                                  max_seqlen_k=inputs.longest, seqused_k=inputs.used[layer], softmax_scale=scale,
                                  causal=True, block_table=inputs.tables[layer], fa_version=3)
