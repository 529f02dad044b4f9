"""Attention over the paged cache: Triton kernels on CUDA (and for full prefill chunks on Hopper, FlashAttention 3
where vLLM's wheel brings it, `fa3`, else cuDNN's fused attention for long chunks, `cudnn_prefill`; the
choice: `prefill_path`; for full decode attention FlashAttention 3 too: `decode_path`), the plain-torch reference
elsewhere (or when `SEMKV_KERNELS=reference`). All take the same
arguments, so the engine and the methods never see which one runs."""
from __future__ import annotations

import os

import torch

from semkv.errors import SemkvError
from semkv.kernels import reference

PREFILL_PATHS = ("auto", "fa3", "cudnn", "triton")  # SEMKV_PREFILL_ATTENTION's values
DECODE_PATHS = ("auto", "fa3", "triton")  # SEMKV_DECODE_ATTENTION's values


def use_triton(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get("SEMKV_KERNELS") == "reference":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def decode_attention(q, k_pool, v_pool, tables, slots, lengths, scale, max_len: int = 0):
    """See `reference.decode_attention`. max_len: an upper bound of `lengths` when slots is None (0: read it)."""
    if use_triton(q.device):
        from semkv.kernels import triton_decode

        return triton_decode.decode_attention(q, k_pool, v_pool, tables, slots, lengths, scale, max_len=max_len)
    return reference.decode_attention(q, k_pool, v_pool, tables, slots, lengths, scale)


def decode_path(device: torch.device | None = None) -> str:
    """The kernel that runs full decode attention (a step's layer that selects nothing) on CUDA, from
    SEMKV_DECODE_ATTENTION: `auto` (the default: FlashAttention 3 where vLLM's wheel brings it to a Hopper GPU, else
    Triton), `fa3` or `triton`. With a device, checks the value as `prefill_path` does."""
    return _path("SEMKV_DECODE_ATTENTION", DECODE_PATHS, "decode", device)


def fa3_decodes(q, k_pool) -> bool:
    """True when FlashAttention 3 may serve full decode attention of q over k_pool (`decode_path` allows it and
    `fa3.usable` for decode), so that a decode step makes its `fa3.decode_inputs`."""
    if not use_triton(q.device) or decode_path() not in ("auto", "fa3"):
        return False
    from semkv.kernels import fa3

    return fa3.usable(q, None, k_pool, fa3.DECODE_PATH)


def prefill_path(device: torch.device | None = None) -> str:
    """The kernel that runs full prefill chunks on CUDA, from SEMKV_PREFILL_ATTENTION: `auto` (the default:
    FlashAttention 3 where vLLM's wheel brings it to a Hopper GPU, else cuDNN for chunks of 1,024 tokens or more, else
    Triton), `fa3`, `cudnn` or `triton` (each falling back to Triton where it cannot serve a call). With a device,
    checks that the value is allowed and that `fa3`, if asked for, is there (the engine does at start)."""
    return _path("SEMKV_PREFILL_ATTENTION", PREFILL_PATHS, "prefill", device)


def _path(variable: str, allowed: tuple[str, ...], kind: str, device: torch.device | None) -> str:
    """The value of `variable` (default `auto`); with a device, checked against `allowed`, and `fa3` against
    FlashAttention 3's presence."""
    path = os.environ.get(variable, "auto")
    if device is not None:
        if path not in allowed:
            raise SemkvError(f"{variable}={path!r} is not a {kind} attention; allowed: " + ", ".join(allowed))
        if path == "fa3" and use_triton(device):
            from semkv.kernels import fa3

            if not fa3.available():
                others = ", ".join(p for p in allowed if p != "fa3")
                raise SemkvError(f"{variable}=fa3 needs vLLM's FlashAttention 3 (pip install vllm) and a Hopper GPU; "
                                 f"allowed without them: {others}")
    return path


def prefill_attention(q, k_pool, v_pool, table, start, context, scale, lse=False):
    """See `reference.prefill_attention`."""
    if use_triton(q.device):
        from semkv.kernels import cudnn_prefill, fa3, triton_prefill

        path = prefill_path()
        if path in ("auto", "fa3") and fa3.usable(q, context, k_pool):
            out = fa3.attend(q, k_pool, v_pool, table, start, scale, lse=lse)
            if out is not None:
                return out
        if path in ("auto", "cudnn") and cudnn_prefill.usable(q, context):
            out = cudnn_prefill.attend(q, k_pool, v_pool, table, start, scale, lse=lse)
            if out is not None:
                return out
        return triton_prefill.prefill_attention(q, k_pool, v_pool, table, start, context, scale, lse=lse)
    return reference.prefill_attention(q, k_pool, v_pool, table, start, context, scale, lse=lse)


def packed_prefill_serves(q, k_pool, longest_q: int) -> bool:
    """True when `packed_prefill_attention` serves chunks of at most `longest_q` tokens: on CUDA with Triton, unless
    `prefill_attention` would give one of them to cuDNN (FlashAttention 3 not serving, a chunk of `MIN_CHUNK` tokens
    or more): cuDNN's fused attention, a call a chunk, outruns the Triton kernel on long chunks."""
    if not use_triton(q.device):
        return False
    from semkv.kernels import cudnn_prefill

    if _fa3_packs(q, k_pool):
        return True
    return not (longest_q >= cudnn_prefill.MIN_CHUNK and _cudnn_serves(k_pool) and not cudnn_prefill.PATH.failed)


def _fa3_packs(q, k_pool) -> bool:
    """True when FlashAttention 3's varlen call may serve a packed step, as `prefill_path` allows."""
    from semkv.kernels import fa3

    return prefill_path() in ("auto", "fa3") and fa3.usable(q, None, k_pool)


def packed_prefill_attention(q, k_pool, v_pool, tables, cu_q, used_k, longest_q, longest_k, scale):
    """Full prefill attention of several sequences' chunks in one call (where `packed_prefill_serves`): FlashAttention
    3's (`fa3.packed_attention`) where `prefill_path` allows and it serves, else (or where it refuses) the
    Triton kernel's (`triton_prefill.packed_prefill_attention`, which takes the same arguments)."""
    from semkv.kernels import fa3, triton_prefill

    if _fa3_packs(q, k_pool):
        out = fa3.attend_packed(q, k_pool, v_pool, tables, cu_q, used_k, longest_q, longest_k, scale)
        if out is not None:
            return out
    return triton_prefill.packed_prefill_attention(q, k_pool, v_pool, tables, cu_q, used_k, longest_q, longest_k,
                                                   scale)


def warm_up_prefill(k_pool, v_pool, heads: int, scale: float, chunk: int, max_len: int) -> None:
    """Prepare the full-prefill attention of chunks of `chunk` tokens up to max_len tokens (cuDNN's plans, where that
    path serves them; `cudnn_prefill.warm_up`)."""
    if _cudnn_serves(k_pool):
        from semkv.kernels import cudnn_prefill

        cudnn_prefill.warm_up(k_pool, v_pool, heads, scale, chunk, max_len)


def warm_up_prefill_cuts(k_pool, v_pool, heads: int, scale: float, step: int, chunk: int, max_len: int) -> None:
    """Prepare the full-prefill attention of the chunks a server's step budget cuts (`cudnn_prefill.warm_up_cuts`,
    where that path serves them)."""
    if _cudnn_serves(k_pool):
        from semkv.kernels import cudnn_prefill

        cudnn_prefill.warm_up_cuts(k_pool, v_pool, heads, scale, step, chunk, max_len)


def _cudnn_serves(k_pool) -> bool:
    """True when cuDNN may serve full prefill chunks in this process (so its plans are worth building)."""
    if not use_triton(k_pool.device):
        return False
    from semkv.kernels import fa3

    path = prefill_path()
    return path == "cudnn" or path == "auto" and not fa3.serves(k_pool.dtype)


def rms_norm(x, weight, eps, residual=None):
    """See `reference.rms_norm`."""
    if use_triton(x.device):
        from semkv.kernels import triton_fused

        return triton_fused.rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def silu_mul(gate_up):
    """See `reference.silu_mul`."""
    if use_triton(gate_up.device):
        from semkv.kernels import triton_fused

        return triton_fused.silu_mul(gate_up)
    return reference.silu_mul(gate_up)


def rope_store(q, k, v, cos, sin, rows, positions, kf, vf, pf):
    """See `reference.rope_store`."""
    if use_triton(q.device):
        from semkv.kernels import triton_fused

        return triton_fused.rope_store(q, k, v, cos, sin, rows, positions, kf, vf, pf)
    return reference.rope_store(q, k, v, cos, sin, rows, positions, kf, vf, pf)


def paged_dot(q, k_pool, table, slots):
    """See `reference.paged_dot`."""
    if use_triton(q.device):
        from semkv.kernels import triton_paged_dot as kernel

        return kernel.paged_dot(q, k_pool, table, slots)
    return reference.paged_dot(q, k_pool, table, slots)


def page_bound(q, kmin, kmax, tables, num_slots, page_size, group_reduce, k_pool=None):
    """See `reference.page_bound`."""
    if use_triton(q.device):
        from semkv.kernels import triton_page_select

        return triton_page_select.page_bound(q, kmin, kmax, tables, num_slots, page_size, group_reduce, k_pool)
    return reference.page_bound(q, kmin, kmax, tables, num_slots, page_size, group_reduce, k_pool)


PAGE_BLOCK = 16384  # the most page bounds of a row one program of `triton_page_select.page_candidates` holds


def page_candidates(bound, lo, hi, tables, page_size, count):
    """See `reference.page_candidates`: Triton on CUDA for rows of at most PAGE_BLOCK pages."""
    if use_triton(bound.device) and bound.shape[-1] <= PAGE_BLOCK:
        from semkv.kernels import triton_page_select

        return triton_page_select.page_candidates(bound, lo, hi, tables, page_size, count)
    return reference.page_candidates(bound, lo, hi, tables, page_size, count)


def page_slots(top, budget, num_slots, page_size):
    """See `reference.page_slots`."""
    if use_triton(top.device):
        from semkv.kernels import triton_page_select

        return triton_page_select.page_slots(top, budget, num_slots, page_size)
    return reference.page_slots(top, budget, num_slots, page_size)




def working_set(slots, lengths, rows, n_sink, offloaded, cache, held, where, hand, host, stores, table, k_pool,
                v_pool, pos_pool, traffic, layer):
    """See `reference.working_set`; host [rows, 4] is every row's store as `HostKVStore.pointers` gives it (what
    the Triton kernel reads), stores the same stores by row (what the reference reads)."""
    if use_triton(slots.device):
        from semkv.kernels import triton_working_set

        return triton_working_set.working_set(slots, lengths, rows, n_sink, offloaded, cache, held, where, hand,
                                              host, table, k_pool, v_pool, pos_pool, traffic, layer)
    return reference.working_set(slots, lengths, rows, n_sink, offloaded, cache, held, where, hand, stores, table,
                                 k_pool, v_pool, pos_pool, traffic, layer)


def put_host(k, v, pos, store_k, store_v, store_pos, first: int, n: int) -> None:
    """See `reference.put_host`; on CUDA the device writes the host store in place (its pinned address is a device
    address), in stream order and without waiting."""
    if use_triton(k.device):
        from semkv.kernels import triton_working_set

        return triton_working_set.put_host(k, v, pos, store_k, store_v, store_pos, first, n)
    return reference.put_host(k, v, pos, store_k, store_v, store_pos, first, n)


def window_mass(q_window, keys, positions, query_positions, scale):
    """See `reference.window_mass`."""
    if use_triton(q_window.device):
        from semkv.kernels import triton_window_mass

        return triton_window_mass.window_mass(q_window, keys, positions, query_positions, scale)
    return reference.window_mass(q_window, keys, positions, query_positions, scale)


def bucket_take(scores, count, capacity, rows=None):
    """See `reference.bucket_take`."""
    if use_triton(scores.device):
        from semkv.kernels import triton_bucket_take

        return triton_bucket_take.bucket_take(scores, count, capacity, rows)
    return reference.bucket_take(scores, count, capacity, rows)
